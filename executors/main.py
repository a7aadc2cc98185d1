"""`clockwork-async executor`: one executor process per device, serving one controller.

Invariants:
- Configuration is parsed once, at the edge, into a frozen `ExecutorConfig`; backends are
  chosen by name from `BACKENDS`. Only `main` returns an exit status; nothing here exits.
- Every connection must open with a controller `Hello` of our protocol version (and the
  ``--token`` where one is set, compared in constant time); anything else gets an `Error` and
  the connection closes. The executor answers `Hello` then `ExecutorInfo`.
- One controller at a time: a newly authenticated controller connection replaces the current
  one, which gets `Error(protocol_error, "replaced ...")` and is closed; replies to actions it
  sent are dropped. (A restarted controller must never be locked out by its dead predecessor's
  half-open connection; the token keeps strangers out.)
- `Ping` is answered with `Pong` at once, from the event loop; every action gets exactly one
  reply, from the host (`host.py`).
- Lifecycle: start (pin CPUs, preallocate the arena, start lanes), print ``ready <address>``
  once listening, serve until SIGTERM/SIGINT, then drain: close the listener, let running
  actions finish, answer queued ones (INTERNAL, "shutting down"), close the connection, exit
  0. A second signal cancels the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import hmac
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from clockwork_async.connection import Connection, ConnectionClosed, TcpAddress, start_server
from clockwork_async.wire.codec import EncodeError, ProtocolError
from clockwork_async.wire.messages import (
    EXECUTOR_ACTIONS,
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ErrorCode,
    Hello,
    Message,
    Ping,
    Pong,
    Role,
)

from .backend import Backend, BackendError
from .host import ExecutorAction, ExecutorHost
from .pages import PageCache

log = logging.getLogger("clockwork_async.executor")

MIB = 1 << 20
DEFAULT_PAGE_BYTES = 16 * MIB
DEFAULT_ORT_WEIGHTS_BYTES = 256 * MIB  # 16 pages: room for every demo model many times over
DEFAULT_CUDA_WEIGHTS_BYTES = 8 << 30  # checked against the device's free memory at start
DEFAULT_IO_BYTES = 64 * MIB  # cuda: one INFER's inputs and outputs
DEFAULT_WORKSPACE_BYTES = 1 << 30  # cuda: ONNX Runtime's arena cap, per session
LANE_SCHEDULING = ("auto", "idle", "normal")
KEEP_WARM_MAX_MS = 60_000.0
HELLO_TIMEOUT_S = 10.0
PARENT_PID_ENV = "CLOCKWORK_EXECUTOR_PARENT_PID"  # set by the daemon's supervisor
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SIZE_PATTERN = re.compile(r"(\d+(?:\.\d*)?)\s*([kmg]i?b?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1 << 10, "mi": MIB}
_SIZE_UNITS["gi"] = 1 << 30
_DEVICE_PATTERN = re.compile(r"cpu|sim|cuda:[0-9]{1,2}")


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """The executor's settings; each field is the flag of the same name (``--page-bytes``)."""

    backend: str
    device: str  # cpu, sim or cuda:N
    listen: str
    name: str
    page_bytes: int
    weights_bytes: int | None  # None: the backend's default
    cpus: tuple[int, ...]  # () leaves the affinity alone
    lane_scheduling: str  # auto (idle when pinned), idle or normal
    keep_warm_ms: float  # the execute lane polls this long after each action before it sleeps
    intra_op_threads: int
    seed: int
    noise: float
    slowdown: float
    profile_file: str | None
    token: str
    io_bytes: int
    workspace_bytes: int
    cuda_weights: str


# --- backends by name -----------------------------------------------------------------------


def _onnxruntime(config: ExecutorConfig) -> Backend:
    if config.device.startswith("cuda:"):
        return _onnxruntime_cuda(config)
    if config.device != "cpu":
        raise ValueError(f"--backend onnxruntime runs on cpu or cuda:N, not {config.device!r}")
    from .arena import NumpyArena
    from .onnxruntime import OnnxRuntimeBackend

    weights_bytes = config.weights_bytes or DEFAULT_ORT_WEIGHTS_BYTES
    arena = NumpyArena(config.page_bytes, weights_bytes // config.page_bytes)
    return OnnxRuntimeBackend(arena, intra_op_threads=config.intra_op_threads)


def _onnxruntime_cuda(config: ExecutorConfig) -> Backend:
    from .onnxruntime_cuda import make_cuda_backend

    return make_cuda_backend(
        config.device,
        page_bytes=config.page_bytes,
        weights_bytes=config.weights_bytes or DEFAULT_CUDA_WEIGHTS_BYTES,
        io_bytes=config.io_bytes,
        workspace_bytes=config.workspace_bytes,
        weights_mode="initializers" if config.cuda_weights == "initializers" else "inputs",
    )


def _simulated(config: ExecutorConfig) -> Backend:
    from .simulated import make_simulated_backend

    if config.device not in ("cpu", "sim"):
        raise ValueError(f"the simulated backend uses no device; {config.device} needs onnxruntime")

    return make_simulated_backend(
        config.page_bytes,
        config.weights_bytes,
        seed=config.seed,
        noise=config.noise,
        slowdown=config.slowdown,
        profile_file=config.profile_file,
    )


BACKENDS: dict[str, Callable[[ExecutorConfig], Backend]] = {
    "onnxruntime": _onnxruntime,
    "simulated": _simulated,
}


# --- flags ----------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """``"16MiB"``, ``"1.5GiB"``, ``"64k"``, ``"4096"`` -> bytes (k/M/G are powers of 1000,
    KiB/MiB/GiB of 1024). Raises argparse.ArgumentTypeError."""
    match = _SIZE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 4096)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower().removesuffix("b")])


def parse_device(text: str) -> str:
    """``cpu``, ``sim`` or ``cuda:N``. Raises argparse.ArgumentTypeError."""
    if _DEVICE_PATTERN.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu or cuda:N)")
    return text


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> (0, 2, 3). Raises argparse.ArgumentTypeError."""
    cpus: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0,2-3)") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0,2-3)")
    return tuple(sorted(cpus))


def parse_keep_warm_ms(text: str) -> float:
    """``"20"`` -> 20.0, in [0, KEEP_WARM_MAX_MS]. Raises argparse.ArgumentTypeError."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= KEEP_WARM_MAX_MS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"not milliseconds in 0..{KEEP_WARM_MAX_MS:g}: {text!r}")
    return value


def default_listen(name: str) -> str:
    """``unix:$XDG_RUNTIME_DIR/clockwork-async/executor-NAME.sock`` (``/tmp`` without it)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"unix:{runtime_dir}/clockwork-async/executor-{name}.sock"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clockwork-async executor",
        description="Run one executor process (one per device) serving one controller.",
    )
    add = parser.add_argument
    add("--backend", choices=sorted(BACKENDS), default="onnxruntime")
    add("--device", type=parse_device, default="cpu", help="cpu, or cuda:N for onnxruntime")
    add("--listen", help="unix:PATH or tcp:HOST:PORT (default: a Unix socket named by --name)")
    add("--name", default="executor", help="this executor's name, for logs and the socket")
    add("--page-bytes", type=parse_bytes, default=DEFAULT_PAGE_BYTES, help="default 16MiB")
    add("--weights-bytes", type=parse_bytes, help="arena size; pages = this // page-bytes")
    add("--cpus", type=parse_cpus, default=(), help="pin the process to these CPUs, e.g. 0,1")
    lanes_help = "idle: lane threads yield the CPU to the event loop at once (auto: when pinned)"
    add("--lane-scheduling", choices=LANE_SCHEDULING, default="auto", help=lanes_help)
    warm_help = "keep the CPU awake this long after each action, yielding it to any thread (0: off)"
    add("--keep-warm-ms", type=parse_keep_warm_ms, default=0.0, help=warm_help)
    add("--intra-op-threads", type=int, default=1, help="onnxruntime threads per session")
    add("--seed", type=int, default=0, help="simulated: seed of the duration noise")
    add("--noise", type=float, default=0.0, help="simulated: relative stddev of durations")
    add("--slowdown", type=float, default=1.0, help="simulated: run X times the profile")
    add("--profile-file", help="simulated: a TOML file of extra duration profiles")
    token_help = "shared secret a controller must present (default: $CLOCKWORK_EXECUTOR_TOKEN)"
    add("--token", default=os.environ.get("CLOCKWORK_EXECUTOR_TOKEN", ""), help=token_help)
    add("--io-bytes", type=parse_bytes, default=DEFAULT_IO_BYTES, help="cuda: IO buffer")
    workspace_help = "cuda: ONNX Runtime's arena cap per session (default 1GiB)"
    add("--workspace-bytes", type=parse_bytes, default=DEFAULT_WORKSPACE_BYTES, help=workspace_help)
    weights_help = "cuda: weights bound as graph inputs, or as initializers of a session per LOAD"
    add("--cuda-weights", choices=("inputs", "initializers"), default="inputs", help=weights_help)
    add("--log-level", default="WARNING", help="logging level on stderr")
    return parser


def parse_config(argv: Sequence[str]) -> tuple[ExecutorConfig, str]:
    """The frozen config and the log level. Raises SystemExit (argparse) on bad flags."""
    args = build_parser().parse_args(list(argv))
    args.listen = args.listen or default_listen(args.name)
    config = ExecutorConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ExecutorConfig)}
    )
    return config, args.log_level


# --- serving --------------------------------------------------------------------------------


class ControllerLink:
    """Serves controller connections for one host: handshake, pings, actions, replies."""

    def __init__(self, config: ExecutorConfig, host: ExecutorHost) -> None:
        self._config = config
        self._host = host
        self._current: Connection | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def handle(self, conn: Connection) -> None:
        """One connection, from Hello to close."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            if await self._handshake(conn):
                await self._serve(conn)
        finally:
            if self._current is conn:
                self._current = None
            conn.close()
            if task is not None:
                self._handlers.discard(task)

    async def close(self) -> None:
        """Flush and close the current connection; wait for every handler to end."""
        current, self._current = self._current, None
        if current is not None:
            await _flush(current)
            current.close()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5.0)

    async def _handshake(self, conn: Connection) -> bool:
        try:
            hello = await asyncio.wait_for(conn.recv(), HELLO_TIMEOUT_S)
        except (ConnectionClosed, TimeoutError):
            return False
        except ProtocolError as error:
            await _refuse(conn, error.code, error.message)
            return False
        refusal = self._check_hello(hello)
        if refusal is not None:
            await _refuse(conn, *refusal)
            return False
        await self._replace_current(conn)
        conn.send(Hello(PROTOCOL_VERSION, Role.EXECUTOR.value, self._config.name))
        conn.send(self._host.info(self._config.name))
        return True

    def _check_hello(self, hello: Message) -> tuple[ErrorCode, str] | None:
        if not isinstance(hello, Hello):
            return ErrorCode.PROTOCOL_ERROR, f"the first message must be hello, got {hello.TAG}"
        if hello.protocol_version != PROTOCOL_VERSION:
            return ErrorCode.UNSUPPORTED_VERSION, (
                f"peer speaks protocol version {hello.protocol_version}; "
                f"this executor speaks {PROTOCOL_VERSION}"
            )
        if hello.role != Role.CONTROLLER:
            return ErrorCode.PROTOCOL_ERROR, f"an executor serves controllers, not {hello.role!r}"
        token = self._config.token
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            return ErrorCode.UNAUTHORIZED, "wrong or missing token"
        return None

    async def _replace_current(self, conn: Connection) -> None:
        previous, self._current = self._current, conn
        if previous is not None:
            log.warning("a new controller connection replaces the current one")
            message = "replaced by a newer controller connection"
            await _refuse(previous, ErrorCode.PROTOCOL_ERROR, message)

    async def _serve(self, conn: Connection) -> None:
        """Handle each message as it is decoded (`Connection.dispatch`: no task wake-up per
        action); while the controller does not read our replies, its actions wait unread
        within the connection's bounds."""
        try:
            await conn.dispatch(partial(self._handle_message, conn))
        except _Refusal as refusal:
            await _refuse(conn, refusal.code, refusal.message)
        except ProtocolError as error:
            await _refuse(conn, error.code, error.message)
        except ConnectionClosed:
            pass

    def _handle_message(self, conn: Connection, message: Message) -> None:
        if self._current is not conn:
            return  # replaced: _replace_current refused and closed it
        refusal = self._on_message(conn, message)
        if refusal is not None:
            raise _Refusal(*refusal)

    def _on_message(self, conn: Connection, message: Message) -> tuple[ErrorCode, str] | None:
        """Handle one message; a refusal (code, sentence) for one out of place."""
        if isinstance(message, Ping):
            conn.send(Pong(message.seq, message.sent_ns, time.monotonic_ns()))
        elif isinstance(message, EXECUTOR_ACTIONS):
            action: ExecutorAction = message  # type: ignore[assignment]
            self._host.submit(action, partial(self._reply, conn))
        else:
            text = f"{message.TAG} is not something a controller sends an executor"
            return ErrorCode.PROTOCOL_ERROR, text
        return None

    def _reply(self, conn: Connection, message: Message) -> None:
        """Send an action's one reply; one that cannot be encoded becomes INTERNAL."""
        if self._current is not conn:
            log.info("dropped %s for a connection that was replaced", message.TAG)
            return
        try:
            conn.send(message)
        except EncodeError as error:
            log.error("cannot encode %s: %s", message.TAG, error)
            text = f"the result could not be encoded: {error}"
            conn.send(ActionResult(getattr(message, "action_id", 0), ErrorCode.INTERNAL, text))
        except ConnectionClosed:
            log.info("dropped %s: the connection closed", message.TAG)


class _Refusal(Exception):
    """A message out of place: the connection gets an Error and closes."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def _flush(conn: Connection) -> None:
    with contextlib.suppress(ConnectionClosed, ConnectionError, TimeoutError):
        await asyncio.wait_for(conn.drain(), 2.0)


async def _refuse(conn: Connection, code: ErrorCode, message: str) -> None:
    """Send a connection-level Error, flush it (bounded) and close."""
    with contextlib.suppress(ConnectionClosed, ConnectionError):
        conn.send(Error(code.value, message))
    await _flush(conn)
    conn.close()


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
        backend = BACKENDS[config.backend](config)
    except (OSError, ValueError, BackendError) as error:
        print(f"clockwork-async executor: {error}", file=sys.stderr)
        return 2
    pages = PageCache(backend.arena.pages_total)
    host = ExecutorHost(
        backend,
        pages,
        background_lanes=background_lanes(config),
        keep_warm_ns=int(config.keep_warm_ms * 1e6),
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
