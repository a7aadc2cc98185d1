"""The daemon's lifecycle as systemd and an operator see it: READY/WATCHDOG/STOPPING on a real
notify socket, SIGTERM drains and answers every request, a second signal stops at once.

Each test starts its own daemon on a simulated executor slowed down 20x (tiny-sim at batch 16
takes 40 ms), so requests are still running when the signal comes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.client import Client, ClientError, InferResult
from clockwork_async.core.outcomes import Outcome

from .harness import DaemonProcess, add_tiny, children, clean_environ, sim_executor, write_config

SLO_MS = 10_000.0
NOTIFY_TIMEOUT_S = 60.0  # only ends a wait for a datagram that never comes


def row(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, dtype=np.float32)}


class Notifications:
    """A notify socket read as systemd reads it: at once, by a thread, into a queue. (Unread,
    the kernel holds only a few datagrams (net.unix.max_dgram_qlen, 10 here); the daemon's
    pings every 50 ms would fill it, and it drops what does not fit, STOPPING=1 included.)"""

    def __init__(self, path: str) -> None:
        self.path = path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(path)
        self._socket.settimeout(0.05)
        self._received: queue.Queue[bytes] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._read, name="notify", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                self._received.put(self._socket.recv(4096))

    def next(self) -> bytes:
        """The next datagram; raises queue.Empty if none comes in NOTIFY_TIMEOUT_S."""
        return self._received.get(timeout=NOTIFY_TIMEOUT_S)

    def until_prefix(self, prefix: bytes) -> bytes:
        """The first datagram that starts with ``prefix`` (others, such as WATCHDOG=1, skipped)."""
        while not (datagram := self.next()).startswith(prefix):
            pass
        return datagram

    def until(self, last: bytes) -> list[bytes]:
        """Datagrams up to and including ``last``."""
        datagrams = [self.next()]
        while datagrams[-1] != last:
            datagrams.append(self.next())
        return datagrams

    def close(self) -> list[bytes]:
        """Stop reading; returns what was received and not taken yet."""
        self._stopping.set()
        self._thread.join(10)
        self._socket.close()
        left = []
        while not self._received.empty():
            left.append(self._received.get_nowait())
        return left


@pytest.fixture
def notifications(tmp_path: Path) -> Iterator[Notifications]:
    listener = Notifications(str(tmp_path / "notify.sock"))
    try:
        yield listener
    finally:
        listener.close()


def start_slow_daemon(folder: Path, drain_timeout_s: float, env: dict[str, str]) -> DaemonProcess:
    add_tiny(folder / "models")
    config = write_config(folder, sim_executor(slowdown=20.0), drain_timeout_s=drain_timeout_s)
    return DaemonProcess.start(folder, config, env=env)


def outcome_of(future: Future[InferResult]) -> str:
    """A result's status, or ``closed`` if the connection ended before it came."""
    try:
        return future.result(30).status
    except ClientError:
        return "closed"


def test_sigterm_drains_answers_everything_and_exits_0(
    tmp_path: Path, notifications: Notifications
) -> None:
    env = clean_environ(tmp_path, {"NOTIFY_SOCKET": notifications.path, "WATCHDOG_USEC": "100000"})
    daemon = start_slow_daemon(tmp_path, drain_timeout_s=0.5, env=env)
    try:
        startup = notifications.until(b"WATCHDOG=1")
        assert startup[:2] == [b"STATUS=starting executors", b"STATUS=registering models"]
        assert startup[2].startswith(b"READY=1\nSTATUS=serving 1 models on 1 executors")
        with Client(daemon.api, timeout_s=30.0) as client:
            before = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(300)]
            client.ping()  # every request has reached the daemon
            daemon.signal(signal.SIGTERM)
            # The signal is handled when the daemon's loop gets to it: wait until it drains.
            stopping = notifications.until_prefix(b"STOPPING=1")
            after = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(20)]
            statuses = [outcome_of(future) for future in before + after]
        assert daemon.wait() == 0, daemon.log()
    finally:
        daemon.stop()
    assert stopping.startswith(b"STOPPING=1\nSTATUS=draining "), stopping
    assert set(statuses) <= {Outcome.OK, Outcome.SHUTTING_DOWN}, set(statuses)
    assert Outcome.SHUTTING_DOWN in statuses[300:]  # sent once it was draining
    assert statuses.count(Outcome.OK) >= 1, statuses
    assert "daemon stopped" in daemon.log()


def test_systemd_status_follows_model_adds_and_removes(
    tmp_path: Path, notifications: Notifications
) -> None:
    add_tiny(tmp_path / "models")
    config = write_config(tmp_path, sim_executor())
    env = clean_environ(tmp_path, {"NOTIFY_SOCKET": notifications.path})
    daemon = DaemonProcess.start(tmp_path, config, env=env)
    try:
        ready = notifications.until_prefix(b"READY=1")
        assert ready.startswith(b"READY=1\nSTATUS=serving 1 models on 1 executors (1 up)")
        with Client(daemon.api, timeout_s=30.0) as client:
            client.add_model("second", (tmp_path / "models" / "tiny" / "model.onnx").read_bytes())
            added = notifications.until_prefix(b"STATUS=")
            assert added.startswith(b"STATUS=serving 2 models on 1 executors"), added
            client.remove_model("second")
            removed = notifications.until_prefix(b"STATUS=")
            assert removed.startswith(b"STATUS=serving 1 models on 1 executors"), removed
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_second_signal_stops_at_once_and_leaves_no_executor(
    tmp_path: Path, notifications: Notifications
) -> None:
    env = clean_environ(tmp_path, {"NOTIFY_SOCKET": notifications.path})
    daemon = start_slow_daemon(tmp_path, drain_timeout_s=60.0, env=env)
    executors = children(daemon.pid)
    assert executors
    try:
        with Client(daemon.api, timeout_s=30.0) as client:
            pending = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(1000)]
            client.ping()
            daemon.signal(signal.SIGTERM)
            notifications.until_prefix(b"STOPPING=1")  # the drain has begun (it takes seconds)
            stopped_s = time.monotonic()
            daemon.signal(signal.SIGINT)
            assert daemon.wait() == 1
            assert time.monotonic() - stopped_s < 10.0  # not the 60 s drain
            statuses = {outcome_of(future) for future in pending}
    finally:
        daemon.stop()
    assert statuses <= {Outcome.OK, Outcome.SHUTTING_DOWN, "closed"}
    assert Outcome.SHUTTING_DOWN in statuses
    assert not [pid for pid in executors if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] != "Z"
