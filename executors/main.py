"""`clockwork-async executor`: one executor process per device, serving one controller.

This module is the process: flags (`flags.py`) -> backend (`backend_table.py`) -> host
(`host.py`) -> controller link (`controller_link.py`). Invariants:
- Only `main` returns an exit status (2: bad configuration, 1: serving failed, 0: a clean
  drain); nothing here exits.
- Lifecycle: start (die with the supervising parent, pin CPUs, build the backend, start lanes),
  print ``ready <address>`` once listening, serve until SIGTERM/SIGINT, then drain: close the
  listener, let running actions finish, answer queued ones (INTERNAL, "shutting down"), close
  the connection, exit 0. A second signal cancels the drain. The signal handlers are removed
  and a Unix socket file is deleted on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from clockwork_async.endpoints import start_server
from clockwork_async.ioarena.shared import ArenaError, map_shared
from clockwork_async.wire.addresses import TcpAddress

from .backend import BackendError
from .backend_table import make_backend
from .controller_link import ControllerLink
from .executor_config import ExecutorConfig
from .flags import parse_config
from .host import ExecutorHost
from .pages import PageCache

PARENT_PID_ENV = "CLOCKWORK_EXECUTOR_PARENT_PID"  # set by the daemon's supervisor
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _bound_address(server: asyncio.AbstractServer, listen: str) -> str:
    """The address actually listened on (a ``tcp:HOST:0`` gets its real port)."""
    if not listen.startswith("tcp:"):
        return listen
    sockets: Sequence[socket.socket] = getattr(server, "sockets", None) or []
    host, port = sockets[0].getsockname()[:2]
    return f"tcp:{TcpAddress(host, port)}"


def _prepare_unix_path(listen: str) -> Path | None:
    """Create the socket's folder (0700) and remove a stale socket file. Returns the path
    (None for TCP). Raises OSError if a live process still listens there."""
    if not listen.startswith("unix:"):
        return None
    path = Path(listen.removeprefix("unix:"))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_socket():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(str(path)) == 0:
                raise OSError(f"another process is listening on {path}")
        path.unlink()
    return path


async def serve(config: ExecutorConfig, host: ExecutorHost) -> int:
    """Listen, print ``ready <address>``, serve until a signal, drain. Returns 0."""
    loop = asyncio.get_running_loop()
    unix_path = _prepare_unix_path(config.listen)  # raises before anything started
    host.start(loop.call_soon_threadsafe)
    link = ControllerLink(config, host)
    stop = asyncio.Event()
    try:
        server = await start_server(link.handle, config.listen, expect_hello=True)
        _install_signals(loop, stop, asyncio.current_task())
        print(f"ready {_bound_address(server, config.listen)}", flush=True)
        await stop.wait()
        server.close()
        await asyncio.to_thread(host.close)  # running actions finish, queued ones answered
        await link.close()
    finally:
        await asyncio.to_thread(host.close)  # idempotent: the lanes never outlive serve
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if unix_path is not None:
            unix_path.unlink(missing_ok=True)
    return 0


def _install_signals(
    loop: asyncio.AbstractEventLoop, stop: asyncio.Event, main_task: asyncio.Task[int] | None
) -> None:
    def on_signal() -> None:
        if stop.is_set() and main_task is not None:
            main_task.cancel()  # a second signal: stop draining
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)


def background_lanes(config: ExecutorConfig) -> bool:
    """Whether lane threads run ``SCHED_IDLE`` (`precise.run_in_background`): asked for, or
    ``auto`` on a pinned executor (its CPUs are its own, so an idle thread cannot starve)."""
    if config.lane_scheduling == "auto":
        return bool(config.cpus)
    return config.lane_scheduling == "idle"


def _pin(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process (some, like BLAS pools, start at import) and every
    thread started later to ``cpus``. Raises OSError."""
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)  # this thread; threads it starts inherit it
    tasks = Path("/proc/self/task")
    for tid in (int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else ():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)


def _die_with_parent() -> None:
    """When a supervisor names itself in ``$CLOCKWORK_EXECUTOR_PARENT_PID``, ask the kernel for
    SIGTERM (a clean drain) when it dies, so a crashed daemon leaves no executor holding its
    memory. Raises OSError if that parent is already gone."""
    expected = os.environ.get(PARENT_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(expected):  # it died before the prctl took effect
        raise OSError(f"the supervising process {expected} is gone")


def main(argv: Sequence[str] | None = None) -> int:
    """Run an executor until SIGTERM/SIGINT. Returns 0 after a clean drain, 2 on bad
    configuration, 1 if serving failed."""
    config, log_level = parse_config(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr)
    try:
        _die_with_parent()
        _pin(config.cpus)  # before the backend and lanes start their threads
        backend = make_backend(config)
    except (OSError, ValueError, BackendError) as error:
        print(f"clockwork-async executor: {error}", file=sys.stderr)
        return 2
    pages = PageCache(backend.arena.pages_total)
    try:
        io_arena = None if config.io_arena_fd is None else map_shared(config.io_arena_fd)
    except ArenaError as error:
        print(f"clockwork-async executor: {error}", file=sys.stderr)
        return 2
    host = ExecutorHost(
        backend,
        pages,
        background_lanes=background_lanes(config),
        keep_warm_ns=int(config.keep_warm_ms * 1e6),
        io_arena=io_arena,
    )
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(config, host))
    except asyncio.CancelledError:
        return 1
    except OSError as error:
        print(f"clockwork-async executor: cannot serve: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
