"""What the daemon's two HTTP/1.1 servers share: `api/v2_http.py` (the Open Inference
Protocol) and `http_endpoint.py` (metrics and health). Both parse requests with httptools on
the daemon's loop; this module holds the pieces of their connections that are the same.

Invariants: a response head is the status line, the headers in the order given with their
names as given, and an empty line, encoded latin-1; a `ConnectionTimer` holds at most one
pending loop timer, calls back on the running loop no earlier than its deadline and never
after it is disarmed or stopped, and holds no loop timer once stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from http import HTTPStatus

# Looked up per response, where ``HTTPStatus(status)`` (an enum's call) costs a microsecond.
_REASONS = {status.value: status.phrase for status in HTTPStatus}


def reason(status: int) -> str:
    """The reason phrase of ``status`` (499 is nginx's, for a client that went away)."""
    phrase = _REASONS.get(status)
    if phrase is not None:
        return phrase
    return "Client Closed Request" if status == 499 else "Unknown"


def encode_head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    """A response head: ``HTTP/1.1 <status> <reason>``, the headers, the empty line."""
    lines = [f"HTTP/1.1 {status} {reason(status)}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class ConnectionTimer:
    """The one timer a connection keeps (a request's deadline, an idle limit, a write limit):
    ``arm`` replaces what was armed, ``disarm`` cancels it, ``on_expiry`` runs when it fires,
    ``stop`` (the connection is gone) cancels it for good.

    Armed and disarmed twice a request, it is lazy: arming sets a deadline, and a loop timer
    is started only when none is pending that fires by then; one that fires before the
    deadline (it was armed again later) starts the next for the rest, one that finds the timer
    disarmed does nothing. A loop timer costs microseconds to start and cancel; a deadline
    moved on, a float."""

    __slots__ = ("_deadline_s", "_fires_s", "_handle", "_loop", "_on_expiry")

    def __init__(self, on_expiry: Callable[[], None]) -> None:
        self._on_expiry = on_expiry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._deadline_s: float | None = None  # loop time it expires at; None: disarmed
        self._fires_s = 0.0  # loop time the pending handle fires at

    def arm(self, timeout_s: float) -> None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        self._deadline_s = deadline_s
        if self._handle is not None and self._fires_s <= deadline_s:
            return  # it fires first and starts the next for the rest
        self._start(loop, deadline_s)

    def disarm(self) -> None:
        self._deadline_s = None  # a pending handle fires and finds nothing to do

    def stop(self) -> None:
        self._deadline_s = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _start(self, loop: asyncio.AbstractEventLoop, at_s: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._fires_s = at_s
        self._handle = loop.call_at(at_s, self._fire)

    def _fire(self) -> None:
        self._handle = None
        deadline_s = self._deadline_s
        if deadline_s is None or self._loop is None:
            return
        if self._loop.time() < deadline_s:
            self._start(self._loop, deadline_s)
            return
        self._deadline_s = None
        self._on_expiry()
