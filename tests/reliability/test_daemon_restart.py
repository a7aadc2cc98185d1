"""The daemon crashes (SIGKILL) with requests in flight and is started again on the same
repository: the real daemon as a subprocess (`tests/e2e/harness.py`), simulated executors.

Asserted: every call in flight fails with `ConnectionClosedError` (never a hang: each future
is given a bound, and a TimeoutError fails the test), later calls on the dead connection fail
at once, a new connection is refused while nothing listens; the restarted daemon serves the
same models, registered from the repository with the cached profile (nothing profiled again).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.client import Client, ConnectError, ConnectionClosedError, InferResult
from e2e.harness import DaemonProcess, add_tiny, children, clean_environ, sim_executor, write_config

SLOWDOWN = 20.0  # tiny-sim at 10-40 ms per batch: a burst keeps the executor busy a while
BURST = 200
SLO_MS = 30_000.0
REPLY_BOUND_S = 20.0  # a reply or a connection error must come within this: else a hang


def _row(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, dtype=np.float32)}


def _crash(daemon: DaemonProcess) -> list[int]:
    """SIGKILL the daemon, then its executors (systemd would kill its cgroup); returns the
    executors' pids."""
    executors = children(daemon.pid)
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    for pid in executors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return executors


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    add_tiny(tmp_path / "models")
    profiler = "[profiler]\nmax_execute_ns = 50000000"  # 50 ms: profiling stays short
    write_config(tmp_path, sim_executor(SLOWDOWN), sections=profiler)
    # The daemons' TMPDIR, where a crash leaves the supervisor's run folder behind: short,
    # since executor socket paths must fit in sun_path (108 bytes).
    run_tmp = Path(tempfile.mkdtemp(prefix="cw-rel-"))
    (tmp_path / "run-tmp").symlink_to(run_tmp)
    try:
        yield tmp_path
    finally:
        shutil.rmtree(run_tmp, ignore_errors=True)


def _start(folder: Path) -> DaemonProcess:
    env = clean_environ(folder, {"TMPDIR": str((folder / "run-tmp").resolve())})
    return DaemonProcess.start(folder, folder / "clockwork-async.toml", env=env)


def _outcomes(futures: list[concurrent.futures.Future[InferResult]]) -> tuple[int, int]:
    """(answered, failed with ConnectionClosedError); anything else raises."""
    answered = closed = 0
    for future in futures:
        try:
            future.result(REPLY_BOUND_S)  # TimeoutError here is the hang this test forbids
        except ConnectionClosedError:
            closed += 1
        else:
            answered += 1
    return answered, closed


def test_a_crash_fails_calls_in_flight_and_a_restart_serves_from_the_repository(
    folder: Path,
) -> None:
    daemon = _start(folder)
    try:
        with Client(daemon.api, timeout_s=REPLY_BOUND_S) as client:
            assert client.infer("tiny", _row(0.0), slo_ms=SLO_MS).ok
            futures = [client.submit("tiny", _row(i), slo_ms=SLO_MS) for i in range(BURST)]
            futures[0].result(REPLY_BOUND_S)  # the burst is being served
            _crash(daemon)
            answered, closed = _outcomes(futures)
            assert answered + closed == BURST and closed > 0
            with pytest.raises(ConnectionClosedError):
                client.infer("tiny", _row(1.0), slo_ms=SLO_MS)
        with pytest.raises(ConnectError, match="unreachable"):
            Client(daemon.api, connect_timeout_s=REPLY_BOUND_S)
    finally:
        daemon.stop()
    assert "profiled 'tiny'" in daemon.log()
    again = _start(folder)
    try:
        with Client(again.api, timeout_s=REPLY_BOUND_S) as client:
            assert [model.name for model in client.models()] == ["tiny"]
            result = client.infer("tiny", _row(7.0), slo_ms=SLO_MS)
            assert result.ok and result.outputs["output"][0, 0] == 7.0
    finally:
        assert again.stop() == 0, again.log()
    assert "profiled" not in again.log()  # the cached profile was used


def test_executors_do_not_outlive_a_crashed_daemon(folder: Path) -> None:
    daemon = _start(folder)
    executors = children(daemon.pid)
    try:
        assert executors
        daemon.signal(signal.SIGKILL)
        daemon.wait()
        deadline = time.monotonic() + 2.0  # a SIGTERMed executor drains in ms
        while any(_alive(pid) for pid in executors) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in executors)
    finally:
        daemon.stop()
        for pid in executors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
