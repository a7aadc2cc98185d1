"""Lanes: one thread per kind of work, each running strictly one action at a time.

Invariants:
- A lane runs at most one job at a time: in its own thread, or, through `Lane.run_now`, on
  the calling thread when the lane is idle (every job submitted so far answered, so nothing
  queued or running) and the job is due now; the caller submits nothing meanwhile (it is busy
  running the job), so the lane thread never starts another beside it.
- Jobs go in the order of `lane_rules.LaneQueue` (smallest ``earliest_ns`` first, ties in
  order of arrival, never before ``earliest_ns``); a job that cannot start by its
  ``latest_ns`` is rejected (``TOO_LATE``) without running.
- Every submitted job gets exactly one callback: ``run`` or ``reject`` (too late, or the lane
  closed before it started). Callbacks of submitted jobs run in the lane thread; posting
  results to the event loop is the caller's business (`host.py` uses
  ``loop.call_soon_threadsafe``). A job `run_now` takes runs on the caller's thread, at once.
- ``close`` lets the running job finish, rejects the queued ones and joins the thread.

The ordering is the pure `lane_rules.LaneQueue`, which the simulator drives on its virtual
clock; `Lane` drives it in real time through a `LaneClock` (real: sleep, then spin the last
``SPIN_NS``). A ``background`` lane's thread runs ``SCHED_IDLE``, so the event loop preempts
its work at once (`precise.run_in_background`; the executor asks for it when pinned).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from clockwork_async.lane_rules import NEVER_NS, LaneQueue, RejectJob, RunJob, Step, WaitUntil

from .precise import SPIN_NS, reduce_timer_slack, run_in_background, spin_until, yield_while

log = logging.getLogger(__name__)


class Rejection(StrEnum):
    TOO_LATE = "too_late"  # could not start by latest_ns
    CLOSED = "closed"  # the lane closed before the job started


class LaneClosed(RuntimeError):
    """``submit`` on a lane that is closing or closed."""


@dataclass(frozen=True, slots=True)
class LaneJob:
    """One action for a lane. ``run(start_ns)`` performs it; ``reject(why, now_ns)`` answers
    it without running. Both are called in the lane thread and must not raise."""

    earliest_ns: int
    latest_ns: int
    run: Callable[[int], None]
    reject: Callable[[Rejection, int], None]


def _never_called(*_args: object) -> None:
    raise AssertionError("CLOSE_LANE is never run")


CLOSE_LANE = LaneJob(NEVER_NS, NEVER_NS, _never_called, _never_called)  # the inbox's last item


class LaneClock(Protocol):
    """Time as a lane sees it. ``take`` returns the next item put in ``inbox``, waiting at
    most ``timeout_ns`` (None: as long as it takes), or None if none came in time;
    ``spin_until`` returns at or after ``deadline_ns``."""

    def now_ns(self) -> int: ...

    def take(self, inbox: queue.SimpleQueue[LaneJob], timeout_ns: int | None) -> LaneJob | None: ...

    def spin_until(self, deadline_ns: int) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic_ns``, timed queue waits, a busy spin."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def take(self, inbox: queue.SimpleQueue[LaneJob], timeout_ns: int | None) -> LaneJob | None:
        try:
            return inbox.get(timeout=None if timeout_ns is None else timeout_ns / 1e9)
        except queue.Empty:
            return None

    def spin_until(self, deadline_ns: int) -> None:
        spin_until(deadline_ns)


class WarmClock(MonotonicClock):
    """The real clock, keeping its CPU awake while idle: a wait for the inbox first polls it
    for up to ``warm_ns``, yielding the CPU on every turn (``os.sched_yield``, which also lets
    the GIL go), and only then blocks. A CPU that idles goes to sleep, and waking it delayed
    every action sent after an idle gap (docs/runtime.md: 0.47 against 0.24 ms p50 from send
    to start at 10 ms gaps); any runnable thread on the CPU still gets it at once. Meant for a
    CPU the executor has to itself: the poll shows as 100% busy."""

    def __init__(self, warm_ns: int) -> None:
        self._warm_ns = warm_ns

    def take(self, inbox: queue.SimpleQueue[LaneJob], timeout_ns: int | None) -> LaneJob | None:
        spin_ns = self._warm_ns if timeout_ns is None else min(self._warm_ns, timeout_ns)
        if not yield_while(inbox.empty, spin_ns):
            return inbox.get_nowait()
        rest_ns = None if timeout_ns is None else timeout_ns - spin_ns
        return super().take(inbox, rest_ns)


class Lane:
    """A thread that runs `LaneJob`s one at a time in `LaneQueue` order.

    Jobs reach the thread through a `queue.SimpleQueue` (its put and get are C, and a put
    wakes the thread without a Python-level lock held around the wake-up); the thread alone
    owns the `LaneQueue`."""

    def __init__(
        self,
        name: str,
        *,
        clock: LaneClock | None = None,
        spin_ns: int = SPIN_NS,
        background: bool = False,
    ) -> None:
        self.name = name
        self._clock: LaneClock = clock or MonotonicClock()
        self._spin_ns = spin_ns
        self._background = background  # the thread runs SCHED_IDLE (precise.py)
        self._ready = threading.Event()  # the thread has set its timer slack and priority
        self._queue: LaneQueue[LaneJob] = LaneQueue()  # the lane thread's own
        self._inbox: queue.SimpleQueue[LaneJob] = queue.SimpleQueue()
        self._submitting = threading.Lock()  # a submit never lands behind CLOSE_LANE
        self._closing = False
        # Jobs submitted, and jobs the thread answered: equal when the lane is idle. Each is
        # written by one thread only (submitters hold _submitting), so no update is lost.
        self._submitted = 0
        self._answered = 0
        self._thread = threading.Thread(target=self._serve, name=f"lane-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread; returns once it runs with its timer slack and priority set."""
        self._thread.start()
        self._ready.wait()

    def submit(self, job: LaneJob) -> None:
        """Queue ``job``. Raises LaneClosed once ``close`` was called."""
        with self._submitting:
            if self._closing:
                raise LaneClosed(f"lane {self.name!r} is closed")
            self._submitted += 1
            self._inbox.put(job)

    def run_now(
        self, earliest_ns: int, latest_ns: int, run: Callable[[int], None], *, wait_ns: int = 0
    ) -> bool:
        """Call ``run(start_ns)`` on the calling thread if the lane is idle and the window is
        open now or opens within ``wait_ns`` (then spin to it, as the lane would): no hand-off
        to the lane thread and no wake-up of it. Returns False, having run nothing, otherwise
        (closing, busy, too early or too late: `submit` it, and the lane waits or rejects).
        Holds the submit lock while it runs, so nothing can be submitted beside it; ``close``
        waits for it as for a running job."""
        with self._submitting:
            if self._closing or self._submitted != self._answered:
                return False
            now_ns = self._clock.now_ns()
            if now_ns < earliest_ns and earliest_ns - now_ns <= wait_ns:
                self._clock.spin_until(earliest_ns)
                now_ns = self._clock.now_ns()
            if not earliest_ns <= now_ns <= latest_ns:
                return False
            _guarded(run, now_ns)
            return True

    def close(self) -> None:
        """Stop taking jobs, let the running one finish, reject the queued ones (CLOSED) and
        join the thread. Idempotent."""
        with self._submitting:
            if not self._closing:
                self._closing = True
                self._inbox.put(CLOSE_LANE)  # after every job: the thread stops there
        if self._thread.ident is not None:  # started
            self._thread.join()
        self._reject_queued()

    def _serve(self) -> None:
        reduce_timer_slack()
        if self._background:
            try:
                run_in_background()
            except OSError as error:
                log.warning("lane %s stays at normal priority: %s", self.name, error)
        self._ready.set()
        while (step := self._next_due()) is not None:
            if isinstance(step, RunJob):
                _guarded(step.job.run, self._clock.now_ns())
            else:
                _guarded(step.job.reject, Rejection.TOO_LATE, self._clock.now_ns())
            self._answered += 1  # after the callback: run_now waits for it to end

    def _next_due(self) -> RunJob[LaneJob] | RejectJob[LaneJob] | None:
        """Block until a job is due (to run or to reject); None once closing."""
        while True:
            step = self._await_step()
            if not isinstance(step, WaitUntil):
                return step
            self._clock.spin_until(step.time_ns)  # submits land in the inbox meanwhile

    def _await_step(self) -> Step[LaneJob]:
        """Sleep until a step is due or within the spin margin; None once CLOSE_LANE came."""
        open_ = self._take_arrivals()
        while open_:
            now_ns = self._clock.now_ns()
            step = self._queue.next_step(now_ns)
            if step is None:
                open_ = self._arrive(self._clock.take(self._inbox, None))
            elif isinstance(step, WaitUntil) and step.time_ns - now_ns > self._spin_ns:
                timeout_ns = step.time_ns - now_ns - self._spin_ns
                open_ = self._arrive(self._clock.take(self._inbox, timeout_ns))
            else:
                return step
            open_ = open_ and self._take_arrivals()
        return None

    def _take_arrivals(self) -> bool:
        """Move every job waiting in the inbox into the queue; False once CLOSE_LANE came."""
        inbox = self._inbox
        while not inbox.empty():
            if not self._arrive(inbox.get_nowait()):
                return False
        return True

    def _arrive(self, item: LaneJob | None) -> bool:
        """Queue a job taken from the inbox (None: a timed-out take). False for CLOSE_LANE."""
        if item is CLOSE_LANE:
            return False
        if item is not None:
            self._queue.push(item, item.earliest_ns, item.latest_ns)
        return True

    def _reject_queued(self) -> None:
        jobs = self._queue.drain()
        while not self._inbox.empty():
            if (job := self._inbox.get_nowait()) is not CLOSE_LANE:
                jobs.append(job)
        for job in jobs:
            _guarded(job.reject, Rejection.CLOSED, self._clock.now_ns())


def _guarded(callback: Callable[..., None], *args: object) -> None:
    """Call a job callback; a bug in it is logged, never allowed to kill the lane."""
    try:
        callback(*args)
    except Exception:
        log.exception("lane job callback failed")
