"""The pure lane rules: lane of each action, order by earliest start, too late, LOAD vs pages."""

from __future__ import annotations

import pytest

from clockwork_async.lane_rules import (
    EXECUTE_LANE,
    LANE_OF,
    LOAD_LANE,
    NEVER_NS,
    REGISTER_LANE,
    UNLOAD_WAIT_NS,
    UNTIMED,
    ActionKind,
    LaneQueue,
    LoadVerdict,
    RejectJob,
    RunJob,
    WaitUntil,
    load_verdict,
)

# --- which lane ---------------------------------------------------------------------------------


def test_load_has_its_lane_and_unload_shares_the_execute_lane_with_infer() -> None:
    assert LANE_OF[ActionKind.LOAD] == LOAD_LANE
    assert LANE_OF[ActionKind.INFER] == LANE_OF[ActionKind.UNLOAD] == EXECUTE_LANE
    assert LANE_OF[ActionKind.REGISTER] == LANE_OF[ActionKind.UNREGISTER] == REGISTER_LANE


def test_an_unload_goes_ahead_of_every_waiting_infer_and_is_never_too_late() -> None:
    queue: LaneQueue[str] = LaneQueue()
    queue.push("infer", 1, 10)  # any real window starts after 0
    queue.push("unload", *UNTIMED)
    assert queue.next_step(5) == RunJob("unload")
    assert queue.next_step(5) == RunJob("infer")
    queue.push("late unload", *UNTIMED)
    assert queue.next_step(NEVER_NS) == RunJob("late unload")


# --- LaneQueue: pure ordering -------------------------------------------------------------------


def test_empty_queue_has_no_step() -> None:
    assert LaneQueue[str]().next_step(0) is None


def test_head_is_the_smallest_earliest_and_waits_until_it() -> None:
    queue: LaneQueue[str] = LaneQueue()
    queue.push("late", 300, NEVER_NS)
    queue.push("early", 100, NEVER_NS)
    assert queue.next_step(50) == WaitUntil(100)
    assert queue.next_step(100) == RunJob("early")
    assert queue.next_step(100) == WaitUntil(300)
    assert queue.next_step(301) == RunJob("late")
    assert len(queue) == 0


def test_ties_go_in_order_of_arrival() -> None:
    queue: LaneQueue[int] = LaneQueue()
    for job in range(5):
        queue.push(job, 10, NEVER_NS)
    assert [queue.next_step(10) for _ in range(5)] == [RunJob(job) for job in range(5)]


def test_a_job_past_its_latest_is_rejected_not_run() -> None:
    queue: LaneQueue[str] = LaneQueue()
    queue.push("job", 10, 20)
    assert queue.next_step(21) == RejectJob("job")
    assert queue.next_step(21) is None


def test_a_job_may_start_exactly_at_latest() -> None:
    queue: LaneQueue[str] = LaneQueue()
    queue.push("job", 10, 20)
    assert queue.next_step(20) == RunJob("job")


def test_drain_returns_jobs_in_lane_order() -> None:
    queue: LaneQueue[str] = LaneQueue()
    queue.push("second", 2, NEVER_NS)
    queue.push("first", 1, NEVER_NS)
    assert queue.drain() == ["first", "second"]
    assert len(queue) == 0


# --- a LOAD and its pages -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("registered", "fit", "pending", "waited_ns", "verdict"),
    [
        (False, True, False, 0, LoadVerdict.ALREADY_LOADED),
        (False, False, True, 0, LoadVerdict.ALREADY_LOADED),
        (True, True, True, 0, LoadVerdict.START),
        (True, False, True, 0, LoadVerdict.WAIT),
        (True, False, True, UNLOAD_WAIT_NS - 1, LoadVerdict.WAIT),
        (True, False, True, UNLOAD_WAIT_NS, LoadVerdict.NO_PAGES),
        (True, False, False, 0, LoadVerdict.NO_PAGES),
    ],
)
def test_a_load_waits_for_pending_unloads_only_when_short_and_only_so_long(
    registered: bool, fit: bool, pending: bool, waited_ns: int, verdict: LoadVerdict
) -> None:
    found = load_verdict(
        registered=registered, pages_fit=fit, unloads_pending=pending, waited_ns=waited_ns
    )
    assert found is verdict
