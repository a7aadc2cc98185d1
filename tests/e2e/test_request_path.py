"""One request's way through an in-process daemon, traced with `sys.setprofile`: the files it
passes on the controller side are exactly those docs/architecture.md lists ("A request's way"),
at most 13 outside ``core/`` and ``wire/`` (10 before the IO arena's two and the dispatcher's
door), and the core is entered through ``Controller.handle`` alone.

The daemon runs on the test's loop (one simulated executor process); the client is the
blocking one, in a worker thread, so its frames are not traced (the profile hook is per
thread). Periodic work that is not the request's (heartbeats, the lag probes, the watchdog) is
left out by the entry points listed in `BACKGROUND`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

import clockwork_async
from clockwork_async.client import Client
from clockwork_async.daemon.lifecycle import DaemonState

from .harness import add_tiny
from .test_daemon_inprocess import sim_daemon
from .test_io_arena import ARENA_FOR_ALL

PACKAGE = Path(clockwork_async.__file__).parent
# docs/architecture.md, "A request's way": the controller side outside core/ and wire/.
REQUEST_PATH = {
    "connection.py",
    "api/server.py",
    "api/session.py",
    "runtime/dispatcher.py",
    # The dispatcher's door (its refusals without the core, and the deadline they are judged
    # by) is a module of its own since the dispatcher was split by idea (issue 27).
    "runtime/door.py",
    "runtime/batching.py",
    "runtime/requests.py",
    "runtime/executor_link.py",
    "runtime/hop.py",
    "runtime/timers.py",
    "daemon/metrics.py",
    # The data plane (issue 26): a request's tensors are read into an IO arena slot, go to the
    # executor by reference and come back out of it; the slot's owner and pins live in
    # `shared`, its offsets in the pure allocator `slots`. Both are on the way of every
    # request to a local executor, so the path is 13 files, not 11.
    "ioarena/shared.py",
    "ioarena/slots.py",
    # Read turns (issue 26): every client message is handed over within its connection's
    # turn of the loop iteration, and the API's door asks it how long a frame waited unread;
    # the transport's protocol object moved to `endpoints` to keep connection.py in bounds.
    "read_turn.py",
    "endpoints.py",
}
BACKGROUND = frozenset(
    {"_heartbeat", "_on_pong", "_timer_fired", "_soon_ran", "probe_loop_lag", "_arm_watchdog"}
)


class PathTrace:
    """Records, per package file, the functions called in this thread (not in `BACKGROUND`)."""

    def __init__(self) -> None:
        self.calls: dict[str, set[str]] = {}

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(str(PACKAGE)) or _in_background(frame):
            return
        relative = str(Path(filename).relative_to(PACKAGE))
        self.calls.setdefault(relative, set()).add(frame.f_code.co_name)

    def outside_core_and_wire(self) -> set[str]:
        return {f for f in self.calls if not f.startswith(("core/", "wire/", "executors/"))}

    def unlisted(self) -> dict[str, set[str]]:
        """Files outside core/ and wire/ that are not on `REQUEST_PATH`, with their calls."""
        return {f: self.calls[f] for f in self.outside_core_and_wire() - REQUEST_PATH}


def _in_background(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name in BACKGROUND:
            return True
        frame = frame.f_back
    return False


class EntryTrace(PathTrace):
    """Also records which core functions are called by code outside the core."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        super().__call__(frame, event, arg)
        if event != "call" or frame.f_back is None:
            return
        inside = str(PACKAGE / "core")
        caller = frame.f_back.f_code.co_filename
        callee = frame.f_code.co_filename
        into_core = callee.startswith(inside) and not caller.startswith(inside)
        # Building an event or command (core/events.py: data, some with a written __init__)
        # is not entering the core.
        into_core = into_core and callee != str(PACKAGE / "core" / "events.py")
        if into_core and caller.startswith(str(PACKAGE)) and not _in_background(frame):
            self.entered.add(frame.f_code.co_qualname)


async def test_one_request_passes_the_documented_files_and_enters_the_core_once(
    tmp_path: Path,
) -> None:
    add_tiny(tmp_path / "models")
    # The arena's path (a tiny row takes it only with io_arena_min_bytes = 0): the longer one.
    daemon = sim_daemon(tmp_path, **{"metrics.enabled": "false", **ARENA_FOR_ALL})
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    row = {"input": np.ones((1, 4), np.float32)}
    client = await asyncio.to_thread(Client, daemon.api_address)
    try:
        first = await asyncio.to_thread(client.infer, "tiny", row, slo_ms=1_000)  # the LOAD
        assert first.status == "ok", first
        trace = EntryTrace()
        sys.setprofile(trace)
        try:
            second = await asyncio.to_thread(client.infer, "tiny", row, slo_ms=1_000)
            await asyncio.sleep(0.01)  # the reply's metrics and the action's release
        finally:
            sys.setprofile(None)
        assert second.status == "ok", second
    finally:
        await asyncio.to_thread(client.close)
        daemon.request_stop()
        assert await run == 0
    assert not trace.unlisted(), trace.unlisted()
    assert {"api/session.py", "runtime/dispatcher.py", "runtime/executor_link.py"} <= set(
        trace.calls
    )
    assert trace.entered == {"Controller.handle"}, trace.entered
