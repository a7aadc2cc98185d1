"""Refuse instead of accept-then-drop (issue 29, point 3): admission leaves as much room
after a quote as the executor's recent INFERs ran over their predictions, when work is
planned before the request; on the virtual clock, exactly."""

from __future__ import annotations

import pytest

from clockwork_async.core.events import StartInfer
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


def test_on_an_idle_lane_no_room_is_left() -> None:
    h = _after_one_run(1 * MS)
    # Alone on the lane: b1 2.73 ms of 2.73 + 0.2 ms margin + 0.1 ms; accepted and run.
    (infer,) = only(h.request(2, "b", B1 + 300 * US), StartInfer)
    assert infer.request_ids == (2,)


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
