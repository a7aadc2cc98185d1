"""Lane reservations (core/reservations.py) on a virtual clock: lanes held for registration's
profiling actions are planned like actions, so requests are planned around them, never under
them (ResNet50-V100 durations, as tests/core/test_scheduling.py)."""

from __future__ import annotations

import pytest

from clockwork_async.core.errors import InvalidEvent
from clockwork_async.core.events import (
    ExecutorLeft,
    LaneReserved,
    ModelRegistered,
    ReleaseLane,
    ReserveLane,
    StartInfer,
    StartLoad,
)
from clockwork_async.core.outcomes import Outcome

from .harness import MS, Harness, make_spec, only
from .test_scheduling import B1, busy_lane, loaded_harness

PROFILE_NS = 300 * MS  # one INFER of a slow model being profiled


def reserve(h: Harness, reservation_id: int, lane: str = "execute", **kw: int) -> LaneReserved:
    duration_ns = kw.pop("duration_ns", PROFILE_NS)
    event = ReserveLane("e1", reservation_id, lane, duration_ns, kw.pop("pages", 0))
    (reserved,) = only(h.at(kw.pop("at_ns", h.now_ns), event), LaneReserved)
    return reserved


def test_an_idle_lane_is_reserved_from_now_for_the_duration() -> None:
    h = loaded_harness("a")
    assert reserve(h, 7) == LaneReserved("e1", 7, 0, PROFILE_NS)
    assert h.ctl.executor("e1").exec_free_at_ns == PROFILE_NS


def test_a_reservation_is_planned_after_the_work_committed_before_it() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    assert reserve(h, 1) == LaneReserved("e1", 1, 2 * B1, 2 * B1 + PROFILE_NS)


def test_requests_that_cannot_wait_for_the_reservation_are_refused_never_late() -> None:
    h = loaded_harness("a")
    reserve(h, 1)
    h.request(1, "a", 100 * MS, at_ns=1 * MS)
    assert h.outcome(1) is Outcome.INFEASIBLE


def test_requests_that_can_wait_are_planned_after_the_reservation_ends() -> None:
    h = loaded_harness("a")
    reserve(h, 1)
    assert not only(h.request(1, "a", 1_000 * MS, at_ns=1 * MS), StartInfer)
    (infer,) = only(h.ticks_until(PROFILE_NS), StartInfer)
    assert infer.planned_start_ns == PROFILE_NS
    h.finish(infer)
    assert h.outcome(1) is Outcome.OK


def test_a_release_before_the_predicted_end_frees_the_lane_at_once() -> None:
    h = loaded_harness("a")
    reserve(h, 1)
    h.request(1, "a", 1_000 * MS, at_ns=1 * MS)
    (infer,) = only(h.at(100 * MS, ReleaseLane("e1", 1, 99 * MS)), StartInfer)
    assert infer.planned_start_ns == 100 * MS  # now: the lane ended at 99 ms
    assert h.ctl.executor("e1").exec_free_at_ns == 100 * MS + B1


def test_a_load_lane_reservation_delays_placement_loads() -> None:
    h = Harness()
    h.join("e1")
    h.register("a")
    reserve(h, 1, lane="load")
    (load,) = only(h.request(1, "a", 1_000 * MS), StartLoad)
    assert load.earliest_ns == PROFILE_NS  # after the reserved LOAD lane


def test_reserved_pages_are_not_used_by_placement_until_released() -> None:
    h = Harness()
    h.join("e1", pages=10)
    h.register("a", pages=7)
    assert reserve(h, 1, lane="", pages=5, duration_ns=0).refused == ""
    assert h.ctl.executor("e1").pages_used == 5
    assert not only(h.request(1, "a", 1_000 * MS), StartLoad)  # 7 pages do not fit in 5
    (load,) = only(h.at(10 * MS, ReleaseLane("e1", 1)), StartLoad)  # now they do
    assert load.model == "a"
    assert h.ctl.executor("e1").pages_used == 7


def test_pages_that_do_not_fit_and_unknown_executors_are_refused() -> None:
    h = Harness()
    h.join("e1", pages=4)
    refused = reserve(h, 1, pages=5)
    assert "4 free pages, 5 needed" in refused.refused
    (other,) = only(h.at(0, ReserveLane("nope", 2, "execute", MS)), LaneReserved)
    assert "not joined" in other.refused
    assert h.ctl.executor("e1").exec_free_at_ns == 0  # nothing held


def test_a_reservation_goes_with_its_executor_and_its_release_is_ignored() -> None:
    h = loaded_harness("a")
    reserve(h, 1, pages=3)
    h.at(MS, ExecutorLeft("e1", "killed"))
    h.join("e1")
    h.at(2 * MS, ReleaseLane("e1", 1))  # the re-joined executor is not touched
    assert h.ctl.executor("e1").pages_used == 0
    assert reserve(h, 1).start_ns == 2 * MS  # the id is free again


def test_bad_reservations_are_invalid_events() -> None:
    h = loaded_harness("a")
    reserve(h, 1)
    for event in (
        ReserveLane("e1", 1, "execute", MS),  # in use
        ReserveLane("e1", 2, "copy", MS),
        ReserveLane("e1", 3, "execute", -1),
        ReserveLane("e1", 4, "", 0, pages=-1),
    ):
        with pytest.raises(InvalidEvent):
            h.at(h.now_ns, event)


def test_a_registered_model_is_served_beside_a_reservation_on_another_executor() -> None:
    h = loaded_harness("a")
    h.at(0, ModelRegistered(make_spec("b")))
    h.join("e2", loaded=("a",))
    reserve(h, 1)
    (infer,) = only(h.request(1, "a", 100 * MS, at_ns=MS), StartInfer)
    assert infer.executor_id == "e2"


def test_a_reservation_past_its_predicted_end_holds_its_lane_until_released() -> None:
    h = loaded_harness("a")
    reserve(h, 1, duration_ns=50 * MS)
    h.tick(60 * MS)  # no release yet: it is assumed to run 50 ms more
    assert h.ctl.executor("e1").exec_free_at_ns == 110 * MS
    assert h.ctl.executor("e1").resyncs == 0
    h.request(1, "a", 30 * MS, at_ns=61 * MS)
    assert h.outcome(1) is Outcome.INFEASIBLE  # not planned where it may still run
    h.at(70 * MS, ReleaseLane("e1", 1, 69 * MS))
    (infer,) = only(h.request(2, "a", 30 * MS, at_ns=70 * MS), StartInfer)
    assert infer.planned_start_ns == 70 * MS
