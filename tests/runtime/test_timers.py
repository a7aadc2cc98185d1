"""WakeTimer (never before its time, one pending wake), BusyPoll (polls for its window after a
touch, then stops) and LagProbe, on the running loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from clockwork_async.runtime.timers import BusyPoll, LagProbe, PollStats, WakeTimer


class SteppingClock:
    """A fake clock that moves ``step_ns`` forward at every read."""

    def __init__(self, step_ns: int) -> None:
        self.now = 0
        self.step_ns = step_ns

    def __call__(self) -> int:
        self.now += self.step_ns
        return self.now


async def test_a_due_wake_is_delivered_on_the_next_iteration_not_inside_arm() -> None:
    fired: list[int] = []
    timer = WakeTimer(lambda: fired.append(1))
    timer.arm(time.monotonic_ns() - 1)
    assert fired == []  # never re-entrant
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert fired == [1]
    assert timer.target_ns is None


async def test_never_delivered_before_the_wake_time() -> None:
    seen: list[tuple[int, int]] = []
    done = asyncio.Event()
    timer: WakeTimer

    def on_due() -> None:
        seen.append((time.monotonic_ns(), target))
        done.set()

    timer = WakeTimer(on_due)
    for delay_ns in (300_000, 1_500_000, 4_000_000):
        done.clear()
        target = time.monotonic_ns() + delay_ns
        timer.arm(target)
        await asyncio.wait_for(done.wait(), 5.0)
    assert len(seen) == 3
    assert all(delivered >= wanted for delivered, wanted in seen)
    assert timer.stats().wakes == 3


async def test_a_new_wake_replaces_the_old_one() -> None:
    fired: list[int] = []
    timer = WakeTimer(lambda: fired.append(time.monotonic_ns()))
    now = time.monotonic_ns()
    timer.arm(now + 200_000_000)
    timer.arm(now + 2_000_000)
    await asyncio.sleep(0.05)
    assert len(fired) == 1
    await asyncio.sleep(0.01)
    assert len(fired) == 1
    timer.cancel()


async def test_cancel_stops_delivery() -> None:
    fired: list[int] = []
    timer = WakeTimer(lambda: fired.append(1))
    timer.arm(time.monotonic_ns() + 1_000_000)
    timer.cancel()
    await asyncio.sleep(0.01)
    assert fired == []


class ManualClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


async def iterations(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_busy_poll_keeps_one_callback_queued_until_its_window_has_passed() -> None:
    clock = ManualClock()
    poll = BusyPoll(1_000, now_ns=clock)
    poll.touch()
    poll.touch()  # within the window: extends it, queues nothing more
    await iterations(5)
    assert poll.stats().windows == 1 and poll.stats().polls == 5  # one poll per iteration
    clock.now = 600
    poll.touch()  # now polls until 1,600
    clock.now = 1_200
    await iterations(3)
    assert poll.stats().polls == 8
    clock.now = 1_600
    await iterations(3)
    assert poll.stats().polls == 8  # the window passed: the loop may sleep again
    poll.touch()
    await iterations(1)
    assert poll.stats() == PollStats(window_ns=1_000, windows=2, polls=9)
    poll.cancel()
    await iterations(3)
    assert poll.stats().polls == 9


async def test_busy_poll_is_off_at_a_zero_window_and_stops_when_set_to_zero() -> None:
    clock = ManualClock()
    off = BusyPoll(now_ns=clock)
    off.touch()
    await iterations(3)
    assert off.stats().windows == 0 and off.stats().polls == 0
    poll = BusyPoll(1_000_000, now_ns=clock)
    poll.touch()
    await iterations(2)
    poll.set_window(0)
    await iterations(3)
    assert poll.stats().polls <= 2
    with pytest.raises(ValueError, match="must be >= 0"):
        poll.set_window(-1)


async def test_close_wakes_are_rechecked_each_iteration_on_the_injected_clock() -> None:
    clock = SteppingClock(step_ns=100_000)
    fired: list[int] = []
    timer = WakeTimer(lambda: fired.append(clock.now), now_ns=clock, spin_below_ns=2_000_000)
    timer.arm(1_000_000)  # 1 ms on a clock that moves 0.1 ms per read: spun, not timed
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(fired) == 1
    assert fired[0] >= 1_000_000
    stats = timer.stats()
    assert stats.wakes == 1 and stats.spins > 0 and stats.late_max_ns < 200_000


async def test_lag_probe_collects_samples_until_stopped() -> None:
    probe = LagProbe(interval_s=0.005)
    assert probe.stats().samples == 0
    probe.start()
    await asyncio.sleep(0.1)
    probe.stop()
    stats = probe.stats()
    assert stats.samples > 0
    assert 0 <= stats.p50_ns <= stats.p99_ns <= stats.max_ns
    assert stats.timer_late_p99_ns <= stats.timer_late_max_ns
    await asyncio.sleep(0.02)
    assert probe.stats().samples == stats.samples
    assert not probe.running
