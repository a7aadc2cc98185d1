"""Exact schedules of the clockwork policy on a virtual clock (ResNet50-V100 durations:
b1 2.73, b2 4.05, b4 5.88, b8 9.93, b16 17.33 ms; LOAD 8.3 ms; schedule ahead 3 ms; margin
5% of the SLO, clamped to [0.2, 5] ms)."""

from __future__ import annotations

from clockwork_async.core.events import Reply, StartInfer, StartLoad, WakeAt
from clockwork_async.core.outcomes import Outcome

from .harness import MS, US, Harness, only

B1, B2, B4, B8, B16 = 2_730 * US, 4_050 * US, 5_880 * US, 9_930 * US, 17_330 * US


def loaded_harness(*models: str, **config: object) -> Harness:
    h = Harness(**config)
    h.register(*models)
    h.join("e1", loaded=models)
    return h


def busy_lane(h: Harness, model: str = "a") -> list[StartInfer]:
    """Two b1 requests at t=0 fill the lane to 5.46 ms (past the 3 ms horizon)."""
    first = only(h.request(1000, model, 100 * MS), StartInfer)
    second = only(h.request(1001, model, 100 * MS), StartInfer)
    assert [(c.planned_start_ns, c.batch_size) for c in first + second] == [(0, 1), (B1, 1)]
    return first + second


def test_idle_executor_runs_a_lone_request_at_once_with_a_window_that_meets_its_deadline() -> None:
    h = loaded_harness("a")
    (infer,) = only(h.request(1, "a", 100 * MS), StartInfer)
    assert infer == StartInfer("e1", infer.action_id, "a", 1, (1,), 0, 95 * MS - B1, B1, 0)


def test_queued_requests_go_as_one_padded_batch_when_the_lane_frees_up() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    for request_id in range(5):
        assert not only(h.request(request_id, "a", 100 * MS), StartInfer)
    assert h.wake_ns == 2 * B1 - 3 * MS  # lane free at 5.46 ms, minus schedule-ahead
    (infer,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    assert infer.batch_size == 8 and infer.request_ids == (0, 1, 2, 3, 4)
    window = (infer.planned_start_ns, infer.latest_ns, infer.predicted_ns)
    assert window == (2 * B1, 95 * MS - B8, B8)


def test_batch_is_the_largest_that_meets_the_earliest_deadline() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    for request_id in range(4):  # SLO 13 ms: internal deadline 12.35 ms
        assert not only(h.request(request_id, "a", 13 * MS), Reply)
    (infer,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    # 5.46 + b8 = 15.39 > 12.35; 5.46 + b4 = 11.34 fits: four requests, in arrival order.
    assert (infer.batch_size, infer.request_ids) == (4, (0, 1, 2, 3))
    assert infer.latest_ns == 12_350 * US - B4


def test_earliest_deadline_first_across_models() -> None:
    h = loaded_harness("a", "b")
    running = busy_lane(h)
    h.request(1, "a", 80 * MS)
    h.request(2, "b", 50 * MS)
    (first,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    assert (first.model, first.planned_start_ns) == ("b", 2 * B1)
    assert h.wake_ns == 3 * B1 - 3 * MS
    h.finish(running[0])  # on time (2.73 ms): no correction
    (second,) = only(h.tick(3 * B1 - 3 * MS), StartInfer)
    assert (second.model, second.planned_start_ns) == ("a", 3 * B1)


def test_a_request_is_dropped_the_moment_the_lane_falls_behind_its_promise() -> None:
    h = loaded_harness("a")
    busy_lane(h)  # predicted free at 5.46 ms
    assert not only(h.request(1, "a", 10 * MS), Reply)  # internal 9.5: 5.46 + 2.73 fits
    # No result by 5 ms: the first INFER is taken to end now, the second at 7.73 ms, and
    # 7.73 + 2.73 > 9.5. Dropped now, before its deadline (10) and its last start (6.77).
    commands = h.tick(5 * MS)
    assert [(r.request_id, r.outcome) for r in only(commands, Reply)] == [(1, Outcome.DROPPED)]
    assert not only(commands, StartInfer) and h.ctl.executor("e1").resyncs == 1


def test_request_that_no_executor_could_meet_even_now_is_rejected_infeasible() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    # Lane free at 5.46 ms; 5.46 + 2.73 = 8.19 > 8 - 0.4 (margin) = 7.6.
    (reply,) = only(h.request(1, "a", 8 * MS), Reply)
    assert reply.outcome is Outcome.INFEASIBLE and "SLO" in reply.message


def test_cold_start_loads_then_infers_after_the_load_result() -> None:
    h = Harness()
    h.register("a")
    h.join("e1")
    commands = h.request(1, "a", 100 * MS)
    (load,) = only(commands, StartLoad)
    assert not only(commands, StartInfer)
    assert (load.executor_id, load.model, load.earliest_ns) == ("e1", "a", 0)
    (infer,) = only(h.finish(load), StartInfer)
    assert (infer.planned_start_ns, infer.request_ids) == (8_300 * US, (1,))
    assert h.ctl.stats().counters["cold_starts"] == 1


def test_cold_start_that_cannot_fit_its_slo_is_rejected_early() -> None:
    h = Harness()
    h.register("a")
    h.join("e1")
    commands = h.request(1, "a", 10 * MS)  # 8.3 + 2.73 = 11.03 > 9.5
    assert only(commands, Reply)[0].outcome is Outcome.INFEASIBLE
    assert h.ctl.stats().counters["cold_starts"] == 1  # its demand still loads the model


def test_cold_request_is_dropped_when_its_load_can_no_longer_start_in_time() -> None:
    h = Harness(max_loads_in_flight=1)
    h.register("a", "x")
    h.join("e1")
    (x_load,) = only(h.request(1, "x", 100 * MS), StartLoad)
    # SLO 30 (internal 28.5): after x's load, 8.3 + 8.3 + 2.73 = 19.33 fits, but no load slot.
    assert not only(h.request(2, "a", 30 * MS), StartLoad)
    drop_at_ns = 28_500 * US - B1 - 8_300 * US + 1
    assert h.wake_ns == drop_at_ns
    h.tick(drop_at_ns)
    assert h.outcome(2) is Outcome.DROPPED and "loaded nowhere" in h.replies[2][0].message
    h.finish(x_load, at_ns=20 * MS)
    assert 1 not in h.replies  # x's request is served after its late load


def test_executor_that_falls_behind_is_resynchronised() -> None:
    h = loaded_harness("a")
    h.request(1, "a", 100 * MS)  # predicted [0, 2.73], no result arrives
    (infer,) = only(h.request(2, "a", 100 * MS, at_ns=10 * MS), StartInfer)
    assert infer.planned_start_ns == 10 * MS  # not 2.73 ms: the lane is assumed busy until now
    assert h.ctl.executor("e1").resyncs == 1


def test_result_correction_moves_the_lane_earlier() -> None:
    h = loaded_harness("a")
    first, _ = busy_lane(h)
    for request_id in range(3):
        h.request(request_id, "a", 100 * MS)
    # 0.73 ms faster than predicted: the second may start at once (its window opened when it
    # was sent), so the lane is free at 4.73 ms, not the 5.46 planned, within the 3 ms
    # horizon of 2 ms: the queued three go, planned from 4.73
    (infer,) = only(h.finish(first, end_ns=2 * MS), StartInfer)
    assert infer.planned_start_ns == 2 * MS + B1 and infer.request_ids == (0, 1, 2)
    assert infer.earliest_ns == 2 * MS  # sent now: may start as soon as the second ends


def test_wake_at_is_sent_only_when_earlier_than_the_one_pending() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    first = only(h.request(1, "a", 100 * MS), WakeAt)
    assert first == [WakeAt(2 * B1 - 3 * MS)]
    assert not only(h.request(2, "a", 100 * MS), WakeAt)


def three_booked_as_one_batch(h: Harness, later_slo_ms: int) -> None:
    """Lane free at 5.46 ms; request 1 (SLO 12: internal 11.4) and requests 2, 3 (later
    deadlines) are booked as one batch of 4 (5.46 + 5.88 = 11.34 <= 11.4)."""
    busy_lane(h)
    for request_id, slo_ms in ((1, 12), (2, later_slo_ms), (3, later_slo_ms)):
        assert not only(h.request(request_id, "a", slo_ms * MS), Reply)


def test_a_fuller_batch_goes_first_when_serving_the_urgent_head_first_would_lose_it() -> None:
    h = loaded_harness("a")
    three_booked_as_one_batch(h, later_slo_ms=13)  # internal 12.35
    # No result by 5.03 ms: the lane frees at 7.76 instead of 5.46. Request 1 fits only
    # alone (7.76 + 4.05 > 11.4), and after it (10.49) request 2 could not even start
    # (10.49 + 2.73 > 12.35): a request is lost either way, so two beat one.
    commands = h.tick(5_030 * US)
    (infer,) = only(commands, StartInfer)
    assert (infer.batch_size, infer.request_ids, infer.planned_start_ns) == (2, (2, 3), 7_760 * US)
    assert h.outcome(1) is Outcome.DROPPED


def test_the_urgent_head_goes_first_when_the_fuller_batch_can_still_follow() -> None:
    h = loaded_harness("a")
    three_booked_as_one_batch(h, later_slo_ms=16)  # internal 15.2
    (infer,) = only(h.tick(5_030 * US), StartInfer)
    # Request 1 alone (to 10.49), then 2 and 3 (to 14.54 <= 15.2): nobody is lost.
    assert (infer.batch_size, infer.request_ids) == (1, (1,))
    assert not h.replies


def test_a_tick_that_fires_early_gets_its_wake_asked_for_again() -> None:
    h = loaded_harness("a")
    busy_lane(h)
    h.request(1, "a", 100 * MS)
    wake_ns = 2 * B1 - 3 * MS
    commands = h.tick(wake_ns - 1)  # a millisecond-grained timer may fire a little early
    assert only(commands, WakeAt) == [WakeAt(wake_ns)] and not only(commands, StartInfer)
