"""Refuse instead of accept-then-drop (issue 29, point 3): admission leaves as much room
after a quote as the executor's recent INFERs ran over their predictions, when work is
planned before the request; on the virtual clock, exactly. An idle lane leaves none, even when
its next INFER starts later than now (the way there, a cold lane's extra: nothing to run
over ahead of it), and a refusal says what it counted."""

from __future__ import annotations

import pytest

from clockwork_async.core.events import ExecutorLead, Reply, StartInfer
from clockwork_async.core.lanes import OVERRUN_WINDOW, Lane
from clockwork_async.core.outcomes import Outcome

from .harness import MS, US, Harness, only

B1 = 2_730 * US


def _after_one_run(overrun_ns: int) -> Harness:
    """Models a and b loaded on e1; one INFER of a ran ``overrun_ns`` over its prediction."""
    h = Harness()
    h.register("a", "b")
    h.join("e1", loaded=("a", "b"))
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    h.finish(infer, end_ns=infer.planned_start_ns + infer.predicted_ns + overrun_ns)
    assert h.outcome(1) is Outcome.OK
    return h


@pytest.mark.parametrize(("overrun_ns", "accepted"), [(0, True), (700 * US, True), (1 * MS, False)])
def test_a_request_behind_work_is_refused_when_an_overrun_would_push_it_out(
    overrun_ns: int, accepted: bool
) -> None:
    h = _after_one_run(overrun_ns)
    start_ns = h.now_ns
    (infer,) = only(h.request(2, "b", 100 * MS), StartInfer)  # b's lane: busy for one b1
    assert infer.planned_start_ns == start_ns and infer.predicted_ns == B1
    # SLO 6.5 ms: margin 0.325 ms, so 6.175 ms to finish; behind one b1 it ends at 5.46 ms:
    # 0.715 ms to spare, less than a 1 ms overrun, more than a 0.7 ms one.
    commands = h.request(3, "b", 6_500 * US)
    if accepted:
        assert 3 not in h.replies
    else:
        assert h.outcome(3) is Outcome.INFEASIBLE and not only(commands, StartInfer)
        (reply,) = h.replies[3]
        assert reply.message == (
            "no executor can finish 'b' within its SLO (6.50 ms left) after the work already "
            "queued, leaving 1.00 ms for its execute lane's recent overruns"
        )


def test_on_an_idle_lane_no_room_is_left() -> None:
    h = _after_one_run(1 * MS)
    # Alone on the lane: b1 2.73 ms of 2.73 + 0.2 ms margin + 0.1 ms; accepted and run.
    (infer,) = only(h.request(2, "b", B1 + 300 * US), StartInfer)
    assert infer.request_ids == (2,)


def test_an_idle_lane_leaves_no_room_when_its_next_infer_starts_after_the_way_there() -> None:
    h = _after_one_run(1 * MS)
    h.at(h.now_ns, ExecutorLead("e1", 100 * US))
    start_ns = h.now_ns
    # SLO 3.13 ms (margin 0.2, internal 2.93 ms): from 0.1 ms (the way there) a b1 ends at
    # 2.83 ms, in time; with the 1 ms overrun room it would not be. Nothing runs ahead of it.
    (infer,) = only(h.request(2, "b", B1 + 400 * US), StartInfer)
    assert (infer.request_ids, infer.planned_start_ns) == ((2,), start_ns + 100 * US)
    h.finish(infer)
    assert h.outcome(2) is Outcome.OK


def test_an_idle_cold_lane_leaves_no_room_its_cold_extra_covers_it() -> None:
    h = Harness(warm_gap_ns=MS, schedule_ahead_ns=10 * MS)
    h.register("a", "b")
    h.join("e1", loaded=("a", "b"))
    (first,) = only(h.request(1, "a", 100 * MS, at_ns=10 * MS), StartInfer)
    h.finish(first, end_ns=10 * MS + B1 + 800 * US)  # after 10 ms idle: a 0.8 ms cold extra
    (cold,) = only(h.request(2, "a", 100 * MS, at_ns=30 * MS), StartInfer)
    (warm,) = only(h.request(3, "a", 100 * MS), StartInfer)
    h.finish(cold, end_ns=30 * MS + B1 + 800 * US)
    h.finish(warm, end_ns=30 * MS + 2 * B1 + 1_800 * US)  # back to back: 1 ms over
    assert h.ctl.executor("e1").cold_extra_ns == 800 * US
    # b, idle and cold at 50 ms: planned from 50.8 ms, its b1 ends at 53.53 ms; SLO 3.8 ms
    # (internal 53.6 ms) holds it, but not with a's 1 ms of overrun room after it.
    (infer,) = only(h.request(4, "b", 3_800 * US, at_ns=50 * MS), StartInfer)
    assert (infer.request_ids, infer.planned_start_ns) == ((4,), 50_800 * US)
    h.finish(infer, end_ns=50 * MS + B1 + 800 * US)
    assert h.outcome(4) is Outcome.OK
    # Refused, a cold lane's refusal names its extra (SLO 3.7 ms: internal 53.5 at 50 ms).
    (reply,) = only(h.request(5, "b", 3_700 * US, at_ns=70 * MS), Reply)
    assert reply.message == (
        "no executor can finish 'b' within its SLO (3.70 ms left) after the work already "
        "queued, including the idle lane's cold extra (0.80 ms)"
    )


def test_a_warm_refusal_names_no_cold_start() -> None:
    h = _after_one_run(0)
    only(h.request(2, "b", 100 * MS), StartInfer)  # b1 planned from now
    # SLO 5 ms (internal 4.75): behind one b1 another ends at 5.46 ms.
    (reply,) = only(h.request(3, "b", 5 * MS), Reply)
    assert reply.outcome is Outcome.INFEASIBLE
    assert reply.message == (
        "no executor can finish 'b' within its SLO (5.00 ms left) after the work already queued"
    )


def test_the_overrun_is_the_largest_of_the_last_window() -> None:
    lane = Lane()
    lane.note_overrun(-5)
    assert lane.overrun_ns == 0
    lane.note_overrun(300)
    for _ in range(OVERRUN_WINDOW - 1):
        lane.note_overrun(100)
    assert lane.overrun_ns == 300
    lane.note_overrun(50)  # the 300 leaves the window
    assert lane.overrun_ns == 100
