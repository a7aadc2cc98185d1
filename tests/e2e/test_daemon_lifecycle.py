"""The daemon's lifecycle as systemd and an operator see it: READY/WATCHDOG/STOPPING on a real
notify socket, SIGTERM drains and answers every request, a second signal stops at once.

Each test starts its own daemon on a simulated executor slowed down 20x (tiny-sim at batch 16
takes 40 ms), so requests are still running when the signal comes.
"""

from __future__ import annotations

import os
import signal
import socket
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


def row(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, dtype=np.float32)}


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(10.0)
    try:
        yield receiver, path
    finally:
        receiver.close()


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
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    receiver, path = notify_socket
    env = clean_environ(tmp_path, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    daemon = start_slow_daemon(tmp_path, drain_timeout_s=0.5, env=env)
    try:
        startup = _until(receiver, b"WATCHDOG=1")
        assert startup[:2] == [b"STATUS=starting executors", b"STATUS=registering models"]
        assert startup[2].startswith(b"READY=1\nSTATUS=serving 1 models on 1 executors")
        with Client(daemon.api, timeout_s=30.0) as client:
            before = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(300)]
            client.ping()  # every request has reached the daemon
            daemon.signal(signal.SIGTERM)
            after = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(20)]
            statuses = [outcome_of(future) for future in before + after]
        assert daemon.wait() == 0, daemon.log()
    finally:
        daemon.stop()
    assert set(statuses) <= {Outcome.OK, Outcome.SHUTTING_DOWN}, set(statuses)
    assert statuses.count(Outcome.OK) >= 1
    assert statuses.count(Outcome.SHUTTING_DOWN) >= 1
    datagrams = _received(receiver)
    assert any(d.startswith(b"STOPPING=1") for d in datagrams), datagrams
    assert "daemon stopped" in daemon.log()


def test_systemd_status_follows_model_adds_and_removes(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    receiver, path = notify_socket
    add_tiny(tmp_path / "models")
    config = write_config(tmp_path, sim_executor())
    env = clean_environ(tmp_path, {"NOTIFY_SOCKET": path})
    daemon = DaemonProcess.start(tmp_path, config, env=env)
    try:
        ready = _until_prefix(receiver, b"READY=1")
        assert ready.startswith(b"READY=1\nSTATUS=serving 1 models on 1 executors (1 up)")
        with Client(daemon.api, timeout_s=30.0) as client:
            client.add_model("second", (tmp_path / "models" / "tiny" / "model.onnx").read_bytes())
            added = _until_prefix(receiver, b"STATUS=")
            assert added.startswith(b"STATUS=serving 2 models on 1 executors"), added
            client.remove_model("second")
            removed = _until_prefix(receiver, b"STATUS=")
            assert removed.startswith(b"STATUS=serving 1 models on 1 executors"), removed
    finally:
        assert daemon.stop() == 0, daemon.log()


def _until_prefix(receiver: socket.socket, prefix: bytes) -> bytes:
    """The first datagram that starts with ``prefix`` (others, such as WATCHDOG=1, skipped)."""
    while not (datagram := receiver.recv(4096)).startswith(prefix):
        pass
    return datagram


def _until(receiver: socket.socket, last: bytes) -> list[bytes]:
    """Datagrams up to and including ``last``."""
    datagrams = [receiver.recv(4096)]
    while datagrams[-1] != last:
        datagrams.append(receiver.recv(4096))
    return datagrams


def _received(receiver: socket.socket) -> list[bytes]:
    receiver.settimeout(0.5)
    datagrams = []
    while True:
        try:
            datagrams.append(receiver.recv(4096))
        except TimeoutError:
            return datagrams


def test_a_second_signal_stops_at_once_and_leaves_no_executor(tmp_path: Path) -> None:
    daemon = start_slow_daemon(tmp_path, drain_timeout_s=60.0, env=clean_environ(tmp_path))
    executors = children(daemon.pid)
    assert executors
    try:
        with Client(daemon.api, timeout_s=30.0) as client:
            pending = [client.submit("tiny", row(i), slo_ms=SLO_MS) for i in range(1000)]
            client.ping()
            daemon.signal(signal.SIGTERM)
            time.sleep(0.2)  # the drain has begun (it would take seconds)
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
