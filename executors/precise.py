"""Precise waiting on the monotonic clock, and how the kernel schedules lane threads.

Invariant: nothing here returns before its deadline (``time.monotonic_ns()``). A wait sleeps
until ``SPIN_NS`` before the deadline, then spins: sleeps and timed waits overshoot by tens of
microseconds here (more under load), and uvloop's timers are millisecond-grained, so neither
alone can honour a sub-millisecond window. Spinning holds the GIL only for the last stretch.

A lane thread that computes (an ONNX Runtime run holds its CPU for milliseconds) shares the
executor's CPU with the event loop thread that carries actions in and results out. Linux's fair
scheduler lets a running thread finish its slice before a woken one runs, so a result or an
INFER that lands mid-execution waited up to a whole execution (seen: the return hop's p99 at
the 10 ms ceiling under overload, every tight-SLO request refused). ``run_in_background``
moves the calling thread to ``SCHED_IDLE``: any normal thread that wakes on that CPU preempts
it at once. It is meant for a CPU the executor has to itself (pinned), where the only normal
threads are the executor's own; next to other busy processes an idle thread would starve.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from collections.abc import Callable

SPIN_NS = 200_000  # spin the last 200 us of every wait
_PR_SET_TIMERSLACK = 29
_TIMER_SLACK_NS = 1_000


def spin_until(deadline_ns: int) -> None:
    """Busy-wait until ``time.monotonic_ns() >= deadline_ns``."""
    now_ns = time.monotonic_ns
    while now_ns() < deadline_ns:
        pass


def yield_while(waiting: Callable[[], bool], duration_ns: int) -> bool:
    """Give the CPU away turn by turn (``os.sched_yield``, without the GIL) while
    ``waiting()`` holds, for at most ``duration_ns``; returns whether it still holds."""
    now_ns = time.monotonic_ns
    until_ns = now_ns() + duration_ns
    while waiting():
        if now_ns() >= until_ns:
            return True
        os.sched_yield()
    return False


def precise_wait_until(deadline_ns: int, *, spin_ns: int = SPIN_NS) -> None:
    """Sleep until ``spin_ns`` before ``deadline_ns``, then spin up to it. Returns at or
    just after the deadline (at once if it has passed)."""
    remaining_ns = deadline_ns - time.monotonic_ns()
    if remaining_ns > spin_ns:
        time.sleep((remaining_ns - spin_ns) / 1e9)
    spin_until(deadline_ns)


def precise_wait_ns(duration_ns: int, *, spin_ns: int = SPIN_NS) -> int:
    """Wait ``duration_ns`` from now; returns the measured duration in ns."""
    start_ns = time.monotonic_ns()
    precise_wait_until(start_ns + duration_ns, spin_ns=spin_ns)
    return time.monotonic_ns() - start_ns


def reduce_timer_slack() -> bool:
    """Ask Linux to wake this thread's sleeps within ~1 us instead of the default 50 us
    (prctl PR_SET_TIMERSLACK). Returns whether it took effect; harmless elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return int(libc.prctl(_PR_SET_TIMERSLACK, _TIMER_SLACK_NS, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def run_in_background() -> None:
    """Move the calling thread to ``SCHED_IDLE`` (unprivileged on Linux). Threads it starts
    afterwards inherit that. Raises OSError where the kernel has no such policy."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        raise OSError(f"SCHED_IDLE is not available on {sys.platform}")
    os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread (Linux)
