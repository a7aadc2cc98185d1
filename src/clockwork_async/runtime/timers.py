"""The core's wake-up timer, the loop's busy poll, its lag probe and the loop as a lane.

One idea: the event loop's own time: when it wakes the core, how it keeps from sleeping, how
late it runs and how much work it has booked ahead.

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

`LoopLane` is the loop itself predicted as a lane (its own cost per request and per byte,
learned from the loop thread's CPU time), so the dispatcher can refuse at the door what the
loop could not handle in time (docs/controller.md, "The daemon as a lane").

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

import numpy as np

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
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop a window polls
        self._windows = 0
        self._polls = 0
        self.thread_ns = 0  # the loop thread's CPU time spent polling (not work)
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
            self._loop = asyncio.get_running_loop()
            self._handle = self._loop.call_soon(self._poll)

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
            started_ns = time.thread_time_ns()
            os.sched_yield()  # polite: any other runnable thread on this CPU goes first
            self.thread_ns += time.thread_time_ns() - started_ns
            # The loop this runs on (`get_running_loop` is a getpid system call per poll).
            assert self._loop is not None
            self._handle = self._loop.call_soon(self._poll)
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


@dataclass(frozen=True, slots=True)
class LoopCost:
    """What the loop's own work costs: per request admitted, per byte of its tensors, per
    request refused at the door (ns of the loop thread's CPU)."""

    request_ns: float
    byte_ns: float
    refusal_ns: float


PRIOR_COST = LoopCost(request_ns=60_000.0, byte_ns=0.5, refusal_ns=15_000.0)


class LoopLane:
    """The event loop as a lane, predicted like an executor's: each request books its
    predicted cost on it, and its delay is how far its booked work runs ahead of now.

    The cost model is learned from the loop thread's CPU time: every ``sample_interval_s`` the
    busy time since the last sample (CPU time less what busy polling spent) is regressed on the
    requests admitted, their bytes, the requests refused and a constant (the loop's other work:
    heartbeats, registrations, uploads) in that interval, over the last ``window`` samples
    (least squares; each per-request coefficient kept within [a tenth, 100x] its prior); until
    ``min_samples`` samples with requests exist the prior is used. A past stall of the loop
    (its measured lag) is not booked as work ahead: it is over once it was measured. A request
    that already waited for the loop before its door (an HTTP request read while the loop was
    busy: work no booking saw, such as parsing JSON bodies ahead of it) brings that wait as the
    loop's delay for it (`refusal`'s ``waited_ns``).

    Invariant: ``delay_ns`` >= 0; a refusal books only the refusal's cost, so a loop that is
    behind still answers at the rate it can refuse.
    """

    def __init__(
        self,
        *,
        now_ns: Callable[[], int] = time.monotonic_ns,
        thread_ns: Callable[[], int] = time.thread_time_ns,
        poll_ns: Callable[[], int] = lambda: 0,
        sample_interval_s: float = 0.02,
        window: int = 64,
        min_samples: int = 8,
        prior: LoopCost = PRIOR_COST,
    ) -> None:
        self._now_ns = now_ns
        self._thread_ns = thread_ns
        self._poll_ns = poll_ns
        self._interval_s = sample_interval_s
        self._min_samples = min_samples
        self._prior = prior
        self.cost = prior
        self._free_at_ns = 0
        self._samples: deque[tuple[int, int, int, int]] = deque(maxlen=window)
        self._admitted = self._bytes = self._refused = 0
        self._last_thread_ns = 0
        self._handle: asyncio.TimerHandle | None = None

    def delay_ns(self, now_ns: int) -> int:
        """How far the loop's booked work runs ahead of ``now_ns``."""
        return max(0, self._free_at_ns - now_ns)

    def predicted_ns(self, nbytes: int) -> int:
        """The predicted cost of admitting a request of ``nbytes`` tensor bytes."""
        return int(self.cost.request_ns + self.cost.byte_ns * nbytes)

    def refusal(
        self,
        slo_ns: int,
        now_ns: int,
        *,
        share: float,
        cap_ns: int,
        waited_ns: int = 0,
        unread_ns: int = 0,
    ) -> str | None:
        """Why a request with ``slo_ns`` to its deadline cannot be taken: the work booked
        ahead of it, or the time it already waited for the loop (``waited_ns``: read while
        the loop was busy, before anything was booked for it), runs past ``share`` of that,
        or past ``cap_ns`` (0: never refuse); or it waited unread in its socket
        (``unread_ns``, `read_turn.ReadTurn.backlog_ns`) past ``share`` of that (a wait
        already over: not held to the cap, which bounds the work still ahead). An idle loop
        refuses nothing: what a request cannot meet on its own is the core's to refuse."""
        delay_ns = max(self.delay_ns(now_ns), waited_ns)
        if not cap_ns or not (delay_ns or unread_ns):
            return None
        share_ns = int(share * max(0, slo_ns))
        if unread_ns > share_ns:
            return (
                f"the daemon itself is overloaded: this request waited {unread_ns / 1e6:.2f} ms "
                f"unread in its connection, more than the {share_ns / 1e6:.2f} ms it may wait; "
                f"retry after {unread_ns / 1e6:.2f} ms"
            )
        limit_ns = min(cap_ns, share_ns)
        if delay_ns <= limit_ns:
            return None
        return (
            f"the daemon itself is overloaded: its own work runs {delay_ns / 1e6:.2f} ms behind "
            f"and this request may wait at most {limit_ns / 1e6:.2f} ms for it; "
            f"retry after {delay_ns / 1e6:.2f} ms"
        )

    def book(self, now_ns: int, nbytes: int, *, admitted: bool) -> None:
        """A request was admitted (``nbytes`` of tensors) or refused at the door."""
        if admitted:
            cost_ns = self.predicted_ns(nbytes)
            self._admitted += 1
            self._bytes += nbytes
        else:
            cost_ns = int(self.cost.refusal_ns)
            self._refused += 1
        self._free_at_ns = max(self._free_at_ns, now_ns) + cost_ns

    def observe(self, busy_ns: int) -> None:
        """The loop was busy ``busy_ns`` since the last call: learn the costs."""
        self._samples.append((self._admitted, self._bytes, self._refused, max(0, busy_ns)))
        self._admitted = self._bytes = self._refused = 0
        self.cost = self._fit()

    def _fit(self) -> LoopCost:
        busy = [s for s in self._samples if s[0] or s[2]]
        if len(busy) < self._min_samples:
            return self._prior
        counts = np.array([(*s[:3], 1) for s in busy], dtype=np.float64)
        spent = np.array([s[3] for s in busy], dtype=np.float64)
        solution, *_ = np.linalg.lstsq(counts, spent, rcond=None)
        solution = solution[:3]  # the constant is the loop's other work
        prior = (self._prior.request_ns, self._prior.byte_ns, self._prior.refusal_ns)
        low = (self._prior.request_ns / 10, 0.0, self._prior.refusal_ns / 10)
        fitted = [
            min(100 * p, max(lo, float(x))) for x, p, lo in zip(solution, prior, low, strict=True)
        ]
        return LoopCost(*fitted)

    # --- on a running loop ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        """Sample every ``sample_interval_s`` on the running loop."""
        if self._handle is None:
            self._last_thread_ns = self._thread_ns() - self._poll_ns()
            self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self._interval_s, self._sample)

    def _sample(self) -> None:
        spent_ns = self._thread_ns() - self._poll_ns()
        self.observe(spent_ns - self._last_thread_ns)
        self._last_thread_ns = spent_ns
        self._arm()
