"""The notify protocol against a real datagram socket, as systemd would receive it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from clockwork_async.daemon.systemd import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(2.0)
    yield receiver, path
    receiver.close()


def test_ready_status_watchdog_and_stopping_arrive_as_datagrams(
    notify_socket: tuple[socket.socket, str],
) -> None:
    receiver, path = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("serving 3 models")
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving 3 models"
    assert notifier.watchdog()
    assert receiver.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping()
    assert receiver.recv(4096) == b"STOPPING=1"
    assert notifier.status("draining\n2 left")
    assert receiver.recv(4096) == b"STATUS=draining 2 left"
    notifier.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert notifier.watchdog_interval_s is None


def test_a_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not notifier.ready()
    notifier.close()


def test_watchdog_interval_is_half_the_period_and_only_for_our_pid() -> None:
    ours = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(ours).watchdog_interval_s == 2.0
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval_s is None
