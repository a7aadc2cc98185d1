"""`api.http_shared.ConnectionTimer`, lazy: a deadline moved on without a loop timer started
each time, yet it calls back once its deadline has passed, never before it, and never once
disarmed or stopped. On the running loop (uvloop): what is asserted is which calls come and
the loop's time when they do, never how long anything took."""

from __future__ import annotations

import asyncio

from clockwork_async.api.http_shared import ConnectionTimer

FAR_S = 3600.0  # a deadline no test reaches


class Expiries:
    """What a timer called back, and the loop's time at each call."""

    def __init__(self) -> None:
        self.at_s: list[float] = []
        self.fired = asyncio.Event()

    def __call__(self) -> None:
        self.at_s.append(asyncio.get_running_loop().time())
        self.fired.set()


async def test_it_calls_back_once_its_deadline_has_passed() -> None:
    expiries = Expiries()
    timer = ConnectionTimer(expiries)
    deadline_s = asyncio.get_running_loop().time() + 0.01  # at most the timer's own
    timer.arm(0.01)
    await asyncio.wait_for(expiries.fired.wait(), 30)
    await asyncio.sleep(0.03)
    assert len(expiries.at_s) == 1 and expiries.at_s[0] >= deadline_s


async def test_armed_again_later_it_waits_for_the_new_deadline() -> None:
    expiries = Expiries()
    timer = ConnectionTimer(expiries)
    timer.arm(0.01)  # its loop timer fires at 10 ms, finds the deadline moved: starts another
    deadline_s = asyncio.get_running_loop().time() + 0.05  # at most the timer's own
    timer.arm(0.05)
    await asyncio.wait_for(expiries.fired.wait(), 30)
    assert len(expiries.at_s) == 1 and expiries.at_s[0] >= deadline_s


async def test_armed_again_sooner_it_calls_back_by_the_sooner_deadline() -> None:
    expiries = Expiries()
    timer = ConnectionTimer(expiries)
    timer.arm(FAR_S)
    timer.arm(0.01)
    await asyncio.wait_for(expiries.fired.wait(), 30)  # not an hour
    assert len(expiries.at_s) == 1


async def test_disarmed_or_stopped_it_never_calls_back() -> None:
    disarmed, stopped = Expiries(), Expiries()
    first, second = ConnectionTimer(disarmed), ConnectionTimer(stopped)
    first.arm(0.01)
    first.disarm()  # its loop timer still fires, and finds nothing to do
    second.arm(0.01)
    second.stop()
    await asyncio.sleep(0.05)
    assert disarmed.at_s == [] and stopped.at_s == []
    first.arm(0.01)  # armed again after a disarm: as new
    await asyncio.wait_for(disarmed.fired.wait(), 30)
    assert len(disarmed.at_s) == 1
