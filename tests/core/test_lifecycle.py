"""Exact behaviour of placement, failures, re-planning and the model/executor lifecycle."""

from __future__ import annotations

import pytest

from clockwork_async.build import core_compiled
from clockwork_async.core.errors import InvalidEvent, TimeWentBackwards
from clockwork_async.core.events import (
    ActionFinished,
    ExecutionTimes,
    ExecutorJoined,
    ExecutorLeft,
    ModelRegistered,
    ModelSpec,
    ModelUnregistered,
    Reply,
    RequestArrived,
    RequestCancelled,
    Shutdown,
    StartInfer,
    StartLoad,
    StartUnload,
)
from clockwork_async.core.outcomes import Outcome

from .harness import KIND, MS, RESNET, US, Harness, only
from .test_scheduling import B1, busy_lane, loaded_harness


def test_eviction_takes_the_least_recently_used_idle_model_and_unloads_before_loading() -> None:
    h = Harness()
    h.register("a", "b", "c", "d")
    h.join("e1", pages=21, loaded=("a", "b", "c"))  # full: 3 x 7 pages
    (infer_a,) = only(h.request(1, "a", 100 * MS), StartInfer)  # LRU order now b, c, a
    h.finish(infer_a)
    commands = h.request(2, "d", 100 * MS)
    unloads, loads = only(commands, StartUnload), only(commands, StartLoad)
    assert [u.model for u in unloads] == ["b"] and [ld.model for ld in loads] == ["d"]
    assert commands.index(unloads[0]) < commands.index(loads[0])
    stats = h.ctl.executor("e1")
    assert stats.pages_used == 21 and stats.loaded == ("c", "a") and stats.loading == ("d",)
    assert h.ctl.stats().counters["evictions"] == 1


def test_a_model_with_work_outstanding_is_never_evicted_and_the_load_waits() -> None:
    h = Harness()
    h.register("a", "b", "c", "d")
    h.join("e1", pages=21, loaded=("a", "b", "c"))
    at_ns = (0, 0, 3 * MS)  # the third once the lane has room again
    running = [
        only(h.request(i, m, 100 * MS, at_ns[i]), StartInfer)[0] for i, m in enumerate("abc")
    ]
    assert not only(h.request(9, "d", 100 * MS), StartLoad)  # nothing evictable
    commands = h.finish(running[0])  # a is idle again
    assert [c.model for c in only(commands, StartUnload)] == ["a"]
    assert [c.model for c in only(commands, StartLoad)] == ["d"]


def test_queued_demand_is_evicted_only_after_idle_models_and_only_if_copied_elsewhere() -> None:
    h = Harness()
    h.register("a", "b", "c")
    h.join("e1", pages=14, loaded=("a", "b"))
    h.request(1, "a", 100 * MS)
    h.request(2, "a", 100 * MS)
    h.request(3, "b", 100 * MS)  # lane full to 8.19 ms; b has a queued request, one copy
    assert not only(h.request(4, "c", 100 * MS), StartLoad)  # b is its only copy: kept


def test_too_late_refusal_is_replanned_when_the_deadline_still_allows() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    (again,) = only(h.finish(infer, code="too_late", at_ns=1 * MS), StartInfer)
    assert again.request_ids == (1,) and again.earliest_ns == 1 * MS
    assert h.ctl.stats().counters["replans"] == 1 and 1 not in h.replies


def test_too_late_refusal_is_dropped_when_no_executor_can_serve_it_in_time() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 5 * MS), StartInfer)  # internal deadline 4.75 ms
    h.finish(infer, code="too_late", at_ns=2_500 * US)  # 2.5 + 2.73 > 4.75
    (reply,) = h.replies[1]
    assert reply.outcome is Outcome.DROPPED and "too_late" in reply.message


def test_other_infer_errors_fail_the_batch() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    h.finish(infer, code="internal", at_ns=1 * MS)
    assert h.outcome(1) is Outcome.FAILED and "internal" in h.replies[1][0].message


def test_not_loaded_forgets_the_copy_and_loads_again() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    commands = h.finish(infer, code="not_loaded", at_ns=1 * MS)
    assert [c.model for c in only(commands, StartLoad)] == ["a"]
    assert h.ctl.executor("e1").pages_used == 7 and h.ctl.executor("e1").loaded == ()


def test_executor_leaving_replans_its_requests_on_another_copy() -> None:
    h = Harness()
    h.register("a")
    h.join("e1", loaded=("a",))
    h.join("e2", loaded=("a",))
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    commands = h.at(1 * MS, ExecutorLeft(infer.executor_id, "crashed"))
    (again,) = only(commands, StartInfer)
    assert again.executor_id != infer.executor_id and again.request_ids == (1,)
    assert 1 not in h.replies


def test_executor_leaving_fails_requests_nobody_can_serve_in_time() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 10 * MS), StartInfer)
    h.request(2, "a", 100 * MS)  # runs second
    h.request(3, "a", 100 * MS)  # queued, not on the executor: stays queued
    h.at(1 * MS, ExecutorLeft("e1", "crashed"))
    # Request 1 cannot wait for a LOAD on a new executor; 2 and 3 can, so they wait.
    assert h.outcome(1) is Outcome.FAILED and "crashed" in h.replies[1][0].message
    assert 2 not in h.replies and 3 not in h.replies
    h.ticks_until(100 * MS)
    assert h.outcome(2) is Outcome.DROPPED  # no executor ever came back
    assert h.outcome(3) is Outcome.DROPPED
    h.at(h.now_ns, ActionFinished("e1", infer.action_id))  # a stray result is ignored
    assert h.ctl.stats().counters["stray_results"] == 1


def test_running_requests_of_the_only_executor_wait_for_one_to_come_back() -> None:
    h = loaded_harness("a")
    assert only(h.request(1, "a", 100 * MS), StartInfer)  # it runs at once
    h.at(1 * MS, ExecutorLeft("e1", "crashed"))
    assert 1 not in h.replies  # re-queued: a restarted executor can still load and run it
    (load,) = only(h.at(2 * MS, ExecutorJoined("e1", KIND, 1376, 16 << 20)), StartLoad)
    (again,) = only(h.finish(load), StartInfer)
    assert again.request_ids == (1,)
    h.finish(again)
    assert h.outcome(1) is Outcome.OK


def test_unregister_answers_queued_requests_lets_running_ones_finish_then_unloads() -> None:
    h = loaded_harness("a")
    first, second = busy_lane(h)
    h.request(2, "a", 100 * MS)
    h.request(3, "a", 100 * MS)
    commands = h.at(0, ModelUnregistered("a"))
    assert {r.request_id: r.outcome for r in only(commands, Reply)} == {
        2: Outcome.UNKNOWN_MODEL,
        3: Outcome.UNKNOWN_MODEL,
    }
    assert not only(commands, StartUnload)  # INFERs of it are outstanding
    h.request(4, "a", 100 * MS)
    assert h.outcome(4) is Outcome.UNKNOWN_MODEL
    assert not only(h.finish(first), StartUnload)
    commands = h.finish(second)
    assert h.outcome(1000) is Outcome.OK and h.outcome(1001) is Outcome.OK
    assert [u.model for u in only(commands, StartUnload)] == ["a"]
    assert h.ctl.executor("e1").pages_used == 0
    stats = h.ctl.stats()
    assert (stats.arrivals, stats.accepted, stats.outcomes["unknown_model"]) == (5, 4, 3)


def test_cancel_answers_once_and_the_request_never_runs() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    (second,) = only(h.request(2, "a", 100 * MS), StartInfer)
    h.request(3, "a", 100 * MS)
    h.request(4, "a", 100 * MS)
    h.at(0, RequestCancelled(1))  # running: answered now, its row is dropped later
    h.at(0, RequestCancelled(3))  # queued: never dispatched
    h.at(0, RequestCancelled(99))  # unknown: ignored
    later = h.finish(infer) + h.finish(second) + h.ticks_until(20 * MS)
    assert [i.request_ids for i in only(later, StartInfer)] == [(4,)]
    assert h.outcome(1) is Outcome.CANCELLED and h.outcome(3) is Outcome.CANCELLED
    assert h.outcome(2) is Outcome.OK
    assert h.ctl.stats().counters["stray_cancels"] == 1


def test_result_after_the_deadline_is_answered_late_with_the_action() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 10 * MS), StartInfer)
    h.finish(infer, end_ns=11 * MS)
    (reply,) = h.replies[1]
    assert reply.outcome is Outcome.LATE and reply.action_id == infer.action_id
    assert reply.executor_id == "e1" and reply.details["measured_ns"] == 11 * MS


def test_ok_reply_carries_the_action_and_the_prediction_error_is_recorded() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    h.finish(infer, end_ns=B1 + 100 * US)
    (reply,) = h.replies[1]
    assert (reply.outcome, reply.action_id, reply.details["batch_size"]) == (
        Outcome.OK,
        infer.action_id,
        1,
    )
    assert h.ctl.stats().prediction_errors["infer"].sum_ns == 100 * US
    assert h.ctl.predicted_exec_ns("a", KIND, 1) == B1 + 100 * US  # p99 of {seed, sample}
    start_ns = infer.planned_start_ns  # the harness's action ran from its planned start
    assert dict(reply.details) == {  # built on reading, from the answer's ExecutionTimes
        "batch_size": 1,
        "predicted_ns": infer.predicted_ns,
        "measured_ns": B1 + 100 * US - start_ns,
        "arrival_ns": 0,
        "start_ns": start_ns,
        "end_ns": B1 + 100 * US,
    }


def test_reply_details_given_built_from_times_or_empty() -> None:
    times = ExecutionTimes(2, 5, 6, 1, 3, 9)
    built = Reply(7, Outcome.OK, times=times)
    assert built.details == {
        "batch_size": 2,
        "predicted_ns": 5,
        "measured_ns": 6,
        "arrival_ns": 1,
        "start_ns": 3,
        "end_ns": 9,
    }
    assert Reply(7, Outcome.OK, details={"x": 1}, times=times).details == {"x": 1}
    assert Reply(7, Outcome.DROPPED).details == {}
    assert built == Reply(7, Outcome.OK, times=ExecutionTimes(2, 5, 6, 1, 3, 9))
    assert built != Reply(7, Outcome.OK, times=ExecutionTimes(2, 5, 6, 1, 3, 10))


def test_hot_model_gets_a_second_copy_on_an_idle_executor() -> None:
    h = Harness()
    h.register("a")
    h.join("e1", loaded=("a",))
    h.join("e2")
    for request_id in range(40):
        h.request(request_id, "a", 100 * MS)
    commands = h.tick(2 * B1 - 3 * MS)  # a full b16 leaves 22 queued: one more copy
    assert [(c.executor_id, c.batch_size) for c in only(commands, StartInfer)] == [("e1", 16)]
    assert [(c.executor_id, c.model) for c in only(commands, StartLoad)] == [("e2", "a")]


def test_load_failure_makes_the_model_cold_again_and_it_is_retried() -> None:
    h = Harness()
    h.register("a")
    h.join("e1")
    (load,) = only(h.request(1, "a", 100 * MS), StartLoad)
    (retry,) = only(h.finish(load, code="no_pages", at_ns=1 * MS), StartLoad)
    assert retry.model == "a" and retry.action_id != load.action_id
    assert h.ctl.executor("e1").pages_used == 7


def test_resident_models_of_a_joining_executor_are_adopted_or_unloaded() -> None:
    h = Harness()
    h.register("a")
    commands = h.at(0, ExecutorJoined("e1", KIND, 100, 16 << 20, ("a", "zzz")))
    assert [u.model for u in only(commands, StartUnload)] == ["zzz"]
    assert h.ctl.executor("e1").loaded == ("a",)
    h.at(0, ExecutorJoined("e1", KIND, 100, 16 << 20))  # joins again: the old one is settled
    assert h.ctl.executor("e1").loaded == ()


def test_admission_rejections_are_named() -> None:
    h = Harness(max_queued_per_model=2)
    h.register("a")
    assert only(h.request(1, "a", 100 * MS), Reply)[0].outcome is Outcome.INFEASIBLE  # nobody
    h.join("e1", loaded=("a",))
    assert only(h.request(2, "nope", 100 * MS), Reply)[0].outcome is Outcome.UNKNOWN_MODEL
    for request_id in range(10, 14):  # two run, two queue
        h.request(request_id, "a", 100 * MS)
    assert only(h.request(3, "a", 100 * MS), Reply)[0].outcome is Outcome.OVERLOADED
    h.at(0, Shutdown())
    assert only(h.request(4, "a", 100 * MS), Reply)[0].outcome is Outcome.SHUTTING_DOWN
    stats = h.ctl.stats()
    assert stats.arrivals == 8 and stats.accepted == 4 and h.ctl.pending() == 4


def test_bad_events_raise_named_errors() -> None:
    h = loaded_harness("a")
    h.request(1, "a", 100 * MS)
    with pytest.raises(InvalidEvent):
        h.at(0, RequestArrived(1, "a", 100 * MS))
    with pytest.raises(InvalidEvent):
        h.at(0, ModelRegistered(ModelSpec("bad", (4, 2), 1, {KIND: RESNET})))
    with pytest.raises(InvalidEvent):
        h.at(0, ModelRegistered(ModelSpec("bad", (1,), 1, {})))
    # The compiled core checks argument types at the call itself (mypyc): a TypeError there.
    with pytest.raises(TypeError if core_compiled() else InvalidEvent):
        h.ctl.handle("not an event", 0)  # type: ignore[arg-type]
    h.at(5 * MS, RequestCancelled(1))
    with pytest.raises(TimeWentBackwards):
        h.ctl.handle(RequestCancelled(1), 4 * MS)


def test_unseen_executor_kind_is_seeded_with_the_slowest_profile() -> None:
    h = Harness()
    fast = RESNET.__class__({b: ns // 2 for b, ns in RESNET.execute_ns.items()}, 1 * MS)
    h.at(0, ModelRegistered(ModelSpec("a", (1, 2, 4, 8, 16), 7, {"x": fast, "y": RESNET})))
    h.at(0, ExecutorJoined("e1", "z", 100, 16 << 20, ("a",)))
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    assert infer.predicted_ns == B1 and h.ctl.stats().fallback_seeds == 1
