"""WakeTimer (never before its time, one pending wake) and LagProbe, on the running loop."""

from __future__ import annotations

import asyncio
import time

from clockwork_async.runtime.timers import LagProbe, WakeTimer


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
