"""What the daemon's two HTTP/1.1 servers share: `api/v2_http.py` (the Open Inference
Protocol) and `http_endpoint.py` (metrics and health). Both parse requests with httptools on
the daemon's loop; this module holds the pieces of their connections that are the same.

Invariants: a response head is the status line, the headers in the order given with their
names as given, and an empty line, encoded latin-1; a `ConnectionTimer` holds at most one
pending call (arming it again cancels the one before) and calls back on the running loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from http import HTTPStatus


def reason(status: int) -> str:
    """The reason phrase of ``status`` (499 is nginx's, for a client that went away)."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Unknown"


def encode_head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    """A response head: ``HTTP/1.1 <status> <reason>``, the headers, the empty line."""
    lines = [f"HTTP/1.1 {status} {reason(status)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class ConnectionTimer:
    """The one timer a connection keeps (a request's deadline, an idle limit, a write limit):
    ``arm`` replaces what was armed, ``disarm`` cancels it, ``on_expiry`` runs when it fires."""

    __slots__ = ("_handle", "_on_expiry")

    def __init__(self, on_expiry: Callable[[], None]) -> None:
        self._on_expiry = on_expiry
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, timeout_s: float) -> None:
        self.disarm()
        self._handle = asyncio.get_running_loop().call_later(timeout_s, self._fire)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._on_expiry()
