"""systemd's notify protocol: one datagram of ``KEY=VALUE`` lines to ``$NOTIFY_SOCKET``.

Invariant: without ``$NOTIFY_SOCKET`` (not started by systemd, or ``Type=`` is not notify) every
call is a no-op, so the daemon calls these unconditionally. Sending never blocks and never raises
for a vanished socket: systemd going away must not take the daemon down.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends ``READY=1``, ``STOPPING=1``, ``STATUS=...`` and ``WATCHDOG=1`` to systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval_s = _watchdog_interval_s(env)
        self._socket: socket.socket | None = None
        if self._address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def ready(self, status: str = "") -> bool:
        return self.send(READY="1", STATUS=status) if status else self.send(READY="1")

    def stopping(self, status: str = "") -> bool:
        return self.send(STOPPING="1", STATUS=status) if status else self.send(STOPPING="1")

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    def send(self, **fields: str) -> bool:
        """Send one datagram; returns whether it was sent (False when disabled or failed)."""
        if self._socket is None or self._address is None:
            return False
        payload = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            self._socket.sendto(payload.encode(), self._address)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket_address(raw: str) -> str | bytes | None:
    if not raw:
        return None
    if raw.startswith("@"):  # abstract namespace
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock and other forms are not used by our units


def _watchdog_interval_s(env: Mapping[str, str]) -> float | None:
    """Half of ``WATCHDOG_USEC`` (systemd's advice), if the watchdog is meant for us."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2e6


def _one_line(value: str) -> str:
    return value.replace("\n", " ")
