"""The clock contract, and the virtual clock of tests and the simulator.

Invariant: the controller core never reads a clock, and nothing in core/ imports one that
reads real time (``clockwork_async.runtime.realclock.MonotonicClock`` is one, outside the core).
Whoever drives the core (the daemon in real time, the simulator in virtual time) reads the
time and passes ``now_ns`` with every event.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """A source of monotonic time in nanoseconds."""

    def now_ns(self) -> int:
        """Return the current time in nanoseconds; never smaller than a previous answer."""
        ...


class VirtualClock:
    """A clock that only moves when told to: it jumps, it never drifts (tests, simulator)."""

    __slots__ = ("_now_ns",)

    def __init__(self, start_ns: int = 0) -> None:
        self._now_ns = start_ns

    def now_ns(self) -> int:
        return self._now_ns

    def advance(self, delta_ns: int) -> int:
        """Move forward by ``delta_ns`` (>= 0); return the new time. Raises ValueError if < 0."""
        if delta_ns < 0:
            raise ValueError(f"a virtual clock cannot go back ({delta_ns} ns)")
        self._now_ns += delta_ns
        return self._now_ns

    def jump_to(self, time_ns: int) -> int:
        """Move to ``time_ns`` (not earlier than now); return it. Raises ValueError if earlier."""
        if time_ns < self._now_ns:
            raise ValueError(f"a virtual clock cannot go back from {self._now_ns} to {time_ns}")
        self._now_ns = time_ns
        return time_ns
