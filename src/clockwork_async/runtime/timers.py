"""The core's wake-up timer, the loop's busy poll and its lag probe, on a running asyncio loop.

uvloop (libuv) keeps time in whole milliseconds, so a ``call_at`` fires anywhere from about a
millisecond early to a millisecond late. `WakeTimer` therefore never trusts a timer for sub-ms
precision: a wake time already due is delivered at once (``call_soon``); a later one arms
``call_at`` ``arm_early_ns`` before it and, when that fires, checks the real clock: due ->
deliver; still further than ``spin_below_ns`` away -> re-arm; closer -> re-check on the next
loop iteration (``call_soon``), which still serves I/O in between, so the wait costs CPU but no
latency.

`BusyPoll` keeps the loop from sleeping for a short window after each burst of work: while a
ready callback is queued, libuv polls its sockets without blocking, so the next message (an
executor's result, the client's next request) is read as it lands instead of after the kernel
wakes a halted CPU, which costs tens of microseconds on a virtual machine (docs/runtime.md).
Each poll yields the CPU first (``sched_yield``), so it only takes time no other runnable
thread on that CPU wants.

Invariants: at most one pending wake (a new ``arm`` replaces the old, as the core's WakeAt
does); ``on_due`` is never called before the wake time by the injected clock. At most one poll
callback is queued; none once the window has passed or after ``cancel``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MS_NS = 1_000_000


@dataclass(frozen=True, slots=True)
class TimerStats:
    """How the wake timer kept time: deliveries and their lateness past the wake time."""

    wakes: int
    spins: int  # loop iterations spent re-checking within spin_below_ns of a wake
    late_mean_ns: float
    late_max_ns: int


class WakeTimer:
    """Delivers ``on_due()`` at (never before) the last armed time, on the loop thread."""

    def __init__(
        self,
        on_due: Callable[[], None],
        *,
        now_ns: Callable[[], int] = time.monotonic_ns,
        arm_early_ns: int = MS_NS,
        spin_below_ns: int = 2 * MS_NS,
    ) -> None:
        self._on_due = on_due
        self._now_ns = now_ns
        self._arm_early_ns = arm_early_ns
        self._spin_below_ns = spin_below_ns
        self._target_ns: int | None = None
        self._handle: asyncio.Handle | None = None
        self._wakes = 0
        self._spins = 0
        self._late_total_ns = 0
        self._late_max_ns = 0

    @property
    def target_ns(self) -> int | None:
        return self._target_ns

    def arm(self, time_ns: int) -> None:
        """Deliver at ``time_ns`` (replacing any earlier request)."""
        self._target_ns = time_ns
        self._schedule()

    def cancel(self) -> None:
        self._target_ns = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def stats(self) -> TimerStats:
        mean_ns = self._late_total_ns / self._wakes if self._wakes else 0.0
        return TimerStats(self._wakes, self._spins, mean_ns, self._late_max_ns)

    def _schedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._target_ns is None:
            return
        loop = asyncio.get_running_loop()
        remaining_ns = self._target_ns - self._now_ns()
        if remaining_ns <= self._spin_below_ns:
            self._handle = loop.call_soon(self._check)
        else:
            delay_s = (remaining_ns - self._arm_early_ns) / 1e9
            self._handle = loop.call_at(loop.time() + delay_s, self._check)

    def _check(self) -> None:
        self._handle = None
        if self._target_ns is None:
            return
        late_ns = self._now_ns() - self._target_ns
        if late_ns < 0:
            if -late_ns <= self._spin_below_ns:
                self._spins += 1
            self._schedule()
            return
        self._target_ns = None
        self._wakes += 1
        self._late_total_ns += late_ns
        self._late_max_ns = max(self._late_max_ns, late_ns)
        self._on_due()


@dataclass(frozen=True, slots=True)
class PollStats:
    """How the loop busy-polls: the window after each handling (0: off), windows opened from
    idle and loop iterations spent polling."""

    window_ns: int
    windows: int
    polls: int


class BusyPoll:
    """After each ``touch``, keeps one ready callback queued until ``window_ns`` has passed
    (by the injected clock), so the loop polls instead of sleeping; each poll yields the CPU
    to any other runnable thread first. A window of 0 is off."""

    def __init__(
        self, window_ns: int = 0, *, now_ns: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self._window_ns = 0
        self._now_ns = now_ns
        self._until_ns = 0
        self._handle: asyncio.Handle | None = None
        self._windows = 0
        self._polls = 0
        self.set_window(window_ns)

    def set_window(self, window_ns: int) -> None:
        """Poll ``window_ns`` after each touch from now on (0: off, and stop polling)."""
        if window_ns < 0:
            raise ValueError(f"busy poll window must be >= 0 ns, got {window_ns}")
        self._window_ns = window_ns
        if not window_ns:
            self.cancel()

    def touch(self) -> None:
        """Work was done: keep polling until ``window_ns`` from now."""
        if not self._window_ns:
            return
        self._until_ns = self._now_ns() + self._window_ns
        if self._handle is None:
            self._windows += 1
            self._handle = asyncio.get_running_loop().call_soon(self._poll)

    def cancel(self) -> None:
        self._until_ns = 0
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def stats(self) -> PollStats:
        return PollStats(self._window_ns, self._windows, self._polls)

    def _poll(self) -> None:
        if self._now_ns() < self._until_ns:
            self._polls += 1
            os.sched_yield()  # polite: any other runnable thread on this CPU goes first
            self._handle = asyncio.get_running_loop().call_soon(self._poll)
        else:
            self._handle = None


@dataclass(frozen=True, slots=True)
class LagStats:
    """Event-loop lag over recent probes.

    ``p50_ns``/``p99_ns``/``max_ns``/``last_ns``: how long a ready callback waited to run
    (a ``call_soon`` round; sub-ms precise). ``timer_late_*``: how late a timer ran past its due
    time, which includes up to ~1 ms of uvloop's millisecond timer granularity.
    """

    samples: int
    last_ns: int
    p50_ns: int
    p99_ns: int
    max_ns: int
    timer_late_p99_ns: int
    timer_late_max_ns: int


def _percentile(ordered: list[int], fraction: float) -> int:
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class LagProbe:
    """Every ``interval_s``: a timer, then a ``call_soon`` round; records both delays."""

    def __init__(
        self,
        *,
        interval_s: float = 0.1,
        window: int = 600,
        now_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._interval_s = interval_s
        self._now_ns = now_ns
        self._soon_ns: deque[int] = deque(maxlen=window)
        self._timer_ns: deque[int] = deque(maxlen=window)
        self._handle: asyncio.Handle | None = None
        self._due_ns = 0

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self._handle is None:
            self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def stats(self) -> LagStats:
        """Percentiles over the window (all zero before the first probe)."""
        if not self._soon_ns:
            return LagStats(0, 0, 0, 0, 0, 0, 0)
        soon = sorted(self._soon_ns)
        timer = sorted(self._timer_ns)
        return LagStats(
            samples=len(soon),
            last_ns=self._soon_ns[-1],
            p50_ns=_percentile(soon, 0.5),
            p99_ns=_percentile(soon, 0.99),
            max_ns=soon[-1],
            timer_late_p99_ns=_percentile(timer, 0.99),
            timer_late_max_ns=timer[-1],
        )

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._due_ns = self._now_ns() + int(self._interval_s * 1e9)
        self._handle = loop.call_at(loop.time() + self._interval_s, self._timer_fired)

    def _timer_fired(self) -> None:
        now_ns = self._now_ns()
        self._timer_ns.append(max(0, now_ns - self._due_ns))
        self._handle = asyncio.get_running_loop().call_soon(self._soon_ran, now_ns)

    def _soon_ran(self, queued_ns: int) -> None:
        self._soon_ns.append(self._now_ns() - queued_ns)
        self._arm()
