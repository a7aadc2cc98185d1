"""The simulated executor honours action windows and page accounting as a real one does."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clockwork_async.core.events import ActionFinished, StartInfer, StartLoad, StartUnload
from clockwork_async.lane_rules import UNLOAD_WAIT_NS, LaneQueue, RunJob, WaitUntil
from clockwork_async.sim.executors import Command, ExecutorHost, SimExecutor, SimLane
from clockwork_async.sim.profiles import SimProfile

MS = 1_000_000
NEVER = 2**62
PROFILE = SimProfile(
    name="test",
    execute_ns={1: 1 * MS, 2: 3 * MS // 2},
    load_ns=2 * MS,
    weights_bytes=1,
    weights_pages=2,
    pages_total=4,
)


class Harness(ExecutorHost):
    """One SimExecutor on a tiny virtual clock."""

    def __init__(self, noise: float = 0.0, seed: int = 0, profile: SimProfile = PROFILE) -> None:
        self.heap: list[tuple[int, int, int, SimLane]] = []
        self.seq = 0
        self.results: list[ActionFinished] = []
        self.executor = SimExecutor("e0", profile, self, noise, random.Random(seed))

    def schedule_event(self, time_ns: int, kind: int, first: object, second: object) -> None:
        lane = second
        assert isinstance(lane, SimLane)
        heapq.heappush(self.heap, (time_ns, self.seq, kind, lane))
        self.seq += 1

    def on_action_result(
        self, executor: SimExecutor, command: Command, finished: ActionFinished
    ) -> None:
        self.results.append(finished)

    def run(self, until_ns: int = NEVER) -> None:
        while self.heap and self.heap[0][0] <= until_ns:
            time_ns, _, kind, lane = heapq.heappop(self.heap)
            self.executor.on_event(kind, lane, time_ns)

    def result(self, action_id: int) -> ActionFinished:
        (found,) = [r for r in self.results if r.action_id == action_id]
        return found


def load(action_id: int, model: str = "m", earliest: int = 0, latest: int = NEVER) -> StartLoad:
    return StartLoad("e0", action_id, model, earliest, latest)


def infer(
    action_id: int, earliest: int, latest: int = NEVER, model: str = "m", batch: int = 1
) -> StartInfer:
    return StartInfer("e0", action_id, model, batch, (action_id,), earliest, latest, 1 * MS)


def loaded_harness() -> Harness:
    harness = Harness()
    harness.executor.deliver(load(1), 0)
    harness.run()
    assert harness.result(1) == ActionFinished("e0", 1, "", 0, 2 * MS, 2 * MS)
    return harness


def test_an_action_waits_for_its_earliest_start() -> None:
    harness = loaded_harness()
    harness.executor.deliver(infer(2, earliest=5 * MS, latest=6 * MS), 2 * MS)
    harness.run()
    assert harness.result(2) == ActionFinished("e0", 2, "", 5 * MS, 6 * MS, 1 * MS)


def test_an_action_that_cannot_start_by_latest_is_rejected_without_running() -> None:
    harness = loaded_harness()
    harness.executor.deliver(infer(2, earliest=2 * MS), 2 * MS)  # runs 2..3 ms
    harness.executor.deliver(infer(3, earliest=2 * MS, latest=2_500_000), 2 * MS)
    harness.executor.deliver(infer(4, earliest=2 * MS, latest=3 * MS), 2 * MS)
    harness.run()
    assert harness.result(3) == ActionFinished("e0", 3, "too_late", 3 * MS, 3 * MS, 0)
    assert harness.result(4) == ActionFinished("e0", 4, "", 3 * MS, 4 * MS, 1 * MS)


def test_a_lane_runs_one_action_at_a_time_smallest_earliest_first() -> None:
    harness = loaded_harness()
    harness.executor.deliver(infer(2, earliest=2 * MS), 2 * MS)  # 2..3
    harness.executor.deliver(infer(3, earliest=2_600_000), 2 * MS)
    harness.executor.deliver(infer(4, earliest=2_500_000), 2 * MS)
    harness.executor.deliver(infer(5, earliest=2_500_000), 2 * MS)
    harness.run()
    order = [r.action_id for r in sorted(harness.results, key=lambda r: r.start_ns)]
    assert order == [1, 2, 4, 5, 3]
    starts = [harness.result(a).start_ns for a in (2, 4, 5, 3)]
    assert starts == [2 * MS, 3 * MS, 4 * MS, 5 * MS]


def test_an_earlier_action_overtakes_a_head_that_is_still_waiting() -> None:
    harness = loaded_harness()
    harness.executor.deliver(infer(2, earliest=10 * MS), 2 * MS)
    harness.run(until_ns=3 * MS)
    harness.executor.deliver(infer(3, earliest=5 * MS), 3 * MS)
    harness.run()
    assert harness.result(3).start_ns == 5 * MS
    assert harness.result(2).start_ns == 10 * MS


def test_infer_of_a_model_not_yet_loaded_fails_not_loaded() -> None:
    harness = Harness()
    harness.executor.deliver(load(1), 0)  # loading until 2 ms
    harness.executor.deliver(infer(2, earliest=1 * MS), 0)
    harness.executor.deliver(infer(3, earliest=1 * MS, model="other"), 0)
    harness.run()
    assert harness.result(2).code == "not_loaded"
    assert harness.result(3).code == "not_loaded"


def test_load_takes_pages_and_unload_frees_them() -> None:
    harness = loaded_harness()
    executor = harness.executor
    assert executor.pages_free == 2
    executor.deliver(load(2, "m"), 2 * MS)
    executor.deliver(load(3, "n"), 2 * MS)
    executor.deliver(load(4, "o"), 2 * MS)
    harness.run()
    assert [harness.result(a).code for a in (2, 3, 4)] == ["already_loaded", "", "no_pages"]
    assert executor.pages_free == 0
    executor.deliver(StartUnload("e0", 5, "m"), 10 * MS)
    executor.deliver(StartUnload("e0", 6, "m"), 10 * MS)
    assert harness.result(5) == ActionFinished("e0", 5, "", 10 * MS, 10 * MS)
    assert harness.result(6).code == "not_loaded"
    assert executor.pages_free == 2


def full_harness(profile: SimProfile = PROFILE) -> Harness:
    """Models "m" and "n" loaded (2 ms each, one after the other): no page is free."""
    harness = Harness(profile=profile)
    harness.executor.deliver(load(1, "m"), 0)
    harness.executor.deliver(load(2, "n"), 0)
    harness.run()
    assert harness.executor.pages_free == 0
    return harness


def test_an_unload_waits_for_the_running_infer_and_goes_ahead_of_waiting_ones() -> None:
    harness = full_harness()
    executor = harness.executor
    executor.deliver(infer(3, earliest=4 * MS, model="m"), 4 * MS)  # runs 4..5 ms
    executor.deliver(infer(4, earliest=4 * MS + 1, model="n"), 4 * MS)
    executor.deliver(infer(5, earliest=4 * MS + 2, model="m"), 4 * MS)
    executor.deliver(StartUnload("e0", 6, "m"), 4 * MS)
    assert executor.pages_free == 0  # not at once: the execute lane is busy
    harness.run()
    assert harness.result(6) == ActionFinished("e0", 6, "", 5 * MS, 5 * MS)
    assert harness.result(4) == ActionFinished("e0", 4, "", 5 * MS, 6 * MS, 1 * MS)
    assert harness.result(5) == ActionFinished("e0", 5, "not_loaded", 6 * MS, 6 * MS)


def test_a_load_short_of_pages_waits_for_the_pending_unload() -> None:
    harness = full_harness()
    executor = harness.executor
    executor.deliver(infer(3, earliest=4 * MS, model="m"), 4 * MS)  # runs 4..5 ms
    executor.deliver(StartUnload("e0", 4, "n"), 4 * MS)
    executor.deliver(load(5, "o", earliest=4 * MS), 4 * MS)
    harness.run()
    assert harness.result(4).end_ns == 5 * MS
    # Started by its lane at 4 ms, loading from 5 to 7 ms; its duration is the loading alone.
    assert harness.result(5) == ActionFinished("e0", 5, "", 4 * MS, 7 * MS, 2 * MS)


def test_a_load_short_of_pages_without_pending_unloads_is_refused_at_once() -> None:
    harness = full_harness()
    harness.executor.deliver(load(3, "o", earliest=4 * MS), 4 * MS)
    harness.run()
    assert harness.result(3) == ActionFinished("e0", 3, "no_pages", 4 * MS, 4 * MS)


def test_a_load_waits_for_pending_unloads_at_most_unload_wait_ns() -> None:
    slow = dataclasses.replace(PROFILE, execute_ns={1: 3 * UNLOAD_WAIT_NS})
    harness = full_harness(slow)
    executor = harness.executor
    executor.deliver(infer(3, earliest=4 * MS, model="m"), 4 * MS)  # the UNLOAD waits behind it
    executor.deliver(StartUnload("e0", 4, "n"), 4 * MS)
    executor.deliver(load(5, "o", earliest=4 * MS), 4 * MS)
    harness.run()
    gave_up_ns = 4 * MS + UNLOAD_WAIT_NS
    assert harness.result(5) == ActionFinished("e0", 5, "no_pages", gave_up_ns, gave_up_ns)
    assert harness.result(4).end_ns == 4 * MS + 3 * UNLOAD_WAIT_NS


def test_a_batch_size_the_profile_lacks_is_bad_input() -> None:
    harness = loaded_harness()
    harness.executor.deliver(infer(2, earliest=2 * MS, batch=4), 2 * MS)
    harness.run()
    assert harness.result(2).code == "bad_input"


def test_every_delivered_action_gets_exactly_one_result() -> None:
    harness = loaded_harness()
    for action_id in range(2, 40):
        harness.executor.deliver(infer(action_id, earliest=action_id * MS // 3), 2 * MS)
    harness.run()
    assert sorted(r.action_id for r in harness.results) == list(range(1, 40))


def noisy_durations(seed: int) -> list[int]:
    harness = Harness(noise=0.1, seed=seed)
    harness.executor.deliver(load(1), 0)
    harness.run()
    for action_id in range(2, 12):
        harness.executor.deliver(infer(action_id, earliest=5 * MS), 5 * MS)
    harness.run()
    assert not [r for r in harness.results if r.code]
    return [harness.result(action_id).duration_ns for action_id in range(2, 12)]


@pytest.mark.parametrize("seed", [1, 2])
def test_noise_is_seeded(seed: int) -> None:
    first = noisy_durations(seed)
    assert first == noisy_durations(seed)
    assert first != noisy_durations(seed + 10)
    assert len(set(first)) > 1
    assert all(MS // 2 <= d for d in first)


# --- Conformance with the lane rules, driven the plain way ---------------------------------


def real_lane_schedule(deliveries: list[tuple[int, int, int]]) -> dict[int, tuple[str, int]]:
    """Action id -> ("run" | "too_late", time) under `LaneQueue` (the real executor's lane
    order) driven step by step, 1 ms per action.
    ``deliveries`` are (delivered_at, earliest, latest), action ids 2, 3, ... in list order."""
    lane = _ReferenceLane()
    for at, action_id, earliest, latest in _ordered(deliveries):
        lane.advance(until_ns=at)
        lane.queue.push(action_id, earliest, latest)
        lane.step(at)
    lane.advance(until_ns=2**62)
    return lane.outcome


def _ordered(deliveries: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(at, action id, earliest, latest) by delivery time; action i is delivered i+1 ns late
    so that no delivery ties with another or with a lane event."""
    timed = [(at + i + 1, i + 2, e, lt) for i, (at, e, lt) in enumerate(deliveries)]
    return sorted(timed)


class _ReferenceLane:
    """A lane on a virtual clock: `LaneQueue` decides, actions take 1 ms."""

    def __init__(self) -> None:
        self.queue: LaneQueue[int] = LaneQueue()
        self.outcome: dict[int, tuple[str, int]] = {}
        self.busy_until_ns = 0
        self.now_ns = 0
        self.wait_ns: int | None = None

    def step(self, now_ns: int) -> None:
        """Run or reject what is due at ``now_ns`` while the lane is free."""
        self.now_ns, self.wait_ns = now_ns, None
        while now_ns >= self.busy_until_ns and (step := self.queue.next_step(now_ns)) is not None:
            if isinstance(step, WaitUntil):
                self.wait_ns = step.time_ns
                return
            ran = isinstance(step, RunJob)
            self.outcome[step.job] = ("run" if ran else "too_late", now_ns)
            if ran:
                self.busy_until_ns = now_ns + MS

    def advance(self, until_ns: int) -> None:
        """Process lane events (an action ending, a wait ending) strictly before ``until_ns``."""
        while len(self.queue):
            busy = self.busy_until_ns > self.now_ns
            next_ns = self.busy_until_ns if busy else self.wait_ns
            if next_ns is None or next_ns >= until_ns:
                return
            self.step(next_ns)


def sim_lane_schedule(deliveries: list[tuple[int, int, int]]) -> dict[int, tuple[str, int]]:
    """The same deliveries to a SimExecutor's execute lane (times shifted past its LOAD)."""
    harness = loaded_harness()  # the model is loaded at 2 ms
    base_ns = 2 * MS
    for at, action_id, earliest, latest in _ordered(deliveries):
        harness.run(until_ns=at + base_ns - 1)
        harness.executor.deliver(
            infer(action_id, earliest + base_ns, latest + base_ns), at + base_ns
        )
    harness.run()
    return {
        r.action_id: ("too_late" if r.code else "run", r.start_ns - base_ns)
        for r in harness.results
        if r.action_id != 1
    }


@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 8), st.integers(0, 4)).map(
            lambda t: (t[0] * MS // 2, t[1] * MS // 2, (t[1] + t[2]) * MS // 2)
        ),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=150, deadline=None)
def test_the_simulated_lane_decides_as_the_real_lane_queue(
    deliveries: list[tuple[int, int, int]],
) -> None:
    assert sim_lane_schedule(deliveries) == real_lane_schedule(deliveries)
