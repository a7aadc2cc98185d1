"""The core as the one judge of ``ok`` and ``late`` (ReturnHop), requests that arrive together
(Arrivals) and a drain out of time (Abandon), exactly on the virtual clock."""

from __future__ import annotations

import pytest

from clockwork_async.core.errors import InvalidEvent
from clockwork_async.core.events import (
    Abandon,
    ActionFinished,
    Arrivals,
    RequestArrived,
    ReturnHop,
    StartInfer,
)
from clockwork_async.core.outcomes import Outcome

from .harness import MS, RESNET, Harness, only

B1_NS = RESNET.execute_ns[1]


def _ready(h: Harness) -> None:
    h.register("m")
    h.join("e1", loaded=["m"])


def test_the_return_hop_moves_the_planned_end_earlier_not_the_judgment() -> None:
    h = Harness()
    _ready(h)
    h.at(0, ReturnHop(2 * MS))
    (infer,) = only(h.request(1, "m", 20 * MS), StartInfer)
    assert infer.latest_ns + infer.predicted_ns <= 20 * MS - 2 * MS
    # Handled with exactly the return hop left for the reply to go out: ok.
    h.finish(infer, end_ns=infer.planned_start_ns + B1_NS, at_ns=18 * MS)
    assert h.outcome(1) is Outcome.OK
    # Handled before the deadline but with less than the hop left: late, never ok.
    (second,) = only(h.request(2, "m", 20 * MS, at_ns=20 * MS), StartInfer)
    h.finish(second, end_ns=second.planned_start_ns + B1_NS, at_ns=38 * MS + 1)
    assert h.outcome(2) is Outcome.LATE
    assert "less than the 2.000 ms its reply needs" in h.replies[2][0].message
    (third,) = only(h.request(3, "m", 20 * MS, at_ns=40 * MS), StartInfer)
    h.finish(third, end_ns=third.planned_start_ns + B1_NS, at_ns=60 * MS + 1)
    assert h.outcome(3) is Outcome.LATE and "after the deadline" in h.replies[3][0].message


def test_a_return_hop_that_leaves_no_room_refuses_at_arrival() -> None:
    h = Harness()
    _ready(h)
    h.at(0, ReturnHop(5 * MS))
    h.request(1, "m", 6 * MS)  # 6 ms less 5 ms of way back: no b1 (2.73 ms) fits
    assert h.outcome(1) is Outcome.INFEASIBLE
    with pytest.raises(InvalidEvent):
        h.at(0, ReturnHop(-1))


def test_arrivals_are_admitted_one_by_one_and_scheduled_once() -> None:
    h = Harness()
    _ready(h)
    arrivals = tuple(RequestArrived(i, "m", 100 * MS) for i in range(1, 5))
    arrivals += (RequestArrived(5, "ghost", 100 * MS),)
    commands = h.at(0, Arrivals(arrivals))
    (infer,) = only(commands, StartInfer)
    assert infer.request_ids == (1, 2, 3, 4) and infer.batch_size == 4
    assert h.outcome(5) is Outcome.UNKNOWN_MODEL
    with pytest.raises(InvalidEvent):  # a reused id: refused before any state changes
        h.at(0, Arrivals((RequestArrived(6, "m", 100 * MS), RequestArrived(1, "m", 100 * MS))))
    assert h.ctl.stats().arrivals == 5


def test_abandon_answers_every_accepted_request_once_and_ignores_later_results() -> None:
    h = Harness()
    _ready(h)
    (infer,) = only(h.request(1, "m", 100 * MS), StartInfer)
    h.request(2, "m", 100 * MS)  # queued behind the running one
    h.at(1 * MS, Abandon())
    assert h.outcome(1) is Outcome.SHUTTING_DOWN and h.outcome(2) is Outcome.SHUTTING_DOWN
    assert h.ctl.pending() == 0
    h.finish(infer)  # its result comes after all: no second answer
    assert len(h.replies[1]) == 1


def test_hops_that_ride_with_a_result_are_learned_before_it_is_settled() -> None:
    h = Harness()
    _ready(h)
    (infer,) = only(h.request(1, "m", 100 * MS), StartInfer)
    event = ActionFinished(
        "e1",
        infer.action_id,
        start_ns=infer.planned_start_ns,
        end_ns=infer.planned_start_ns + B1_NS,
        duration_ns=B1_NS,
        return_hop_ns=3 * MS,
        lead_ns=1 * MS,
    )
    h.at(100 * MS - 2 * MS, event)  # 2 ms left: less than the 3 ms hop it just brought
    assert h.outcome(1) is Outcome.LATE
    assert h.ctl.executor("e1").lead_ns == 1 * MS
    with pytest.raises(InvalidEvent):
        h.at(h.now_ns, ActionFinished("e1", 999, return_hop_ns=-1))
