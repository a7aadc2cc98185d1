"""The fifo and timeout baselines, exactly."""

from __future__ import annotations

from clockwork_async.core.events import Reply, StartInfer
from clockwork_async.core.outcomes import Outcome

from .harness import MS, only
from .test_scheduling import B1, B16, busy_lane, loaded_harness


def test_fifo_admits_what_clockwork_rejects_and_answers_it_late() -> None:
    h = loaded_harness("a", policy="fifo")
    busy_lane(h)
    assert not only(h.request(1, "a", 1 * MS), Reply)  # hopeless, but accepted
    (infer,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    assert infer.request_ids == (1,) and infer.latest_ns > 10**18  # never refused
    h.finish(infer)
    assert h.outcome(1) is Outcome.LATE


def test_fifo_batches_what_is_queued_in_arrival_order_up_to_the_largest_batch() -> None:
    h = loaded_harness("a", "b", policy="fifo")
    busy_lane(h)
    for request_id in range(20):
        h.request(request_id, "a", (100 - request_id) * MS)  # later arrivals, earlier deadlines
    h.request(50, "b", 1 * MS)
    (infer,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    assert infer.batch_size == 16 and infer.request_ids == tuple(range(16))
    h.ticks_until(100 * MS)
    assert not h.replies  # nothing is ever dropped: no result has come back yet


def test_timeout_waits_for_a_fuller_batch_at_most_the_max_queue_delay() -> None:
    h = loaded_harness("a", policy="timeout", max_queue_delay_ns=1 * MS)
    assert not only(h.request(1, "a", 100 * MS), StartInfer)
    assert h.wake_ns == 1 * MS
    (infer,) = only(h.tick(1 * MS), StartInfer)
    assert (infer.batch_size, infer.planned_start_ns) == (1, 1 * MS)


def test_timeout_sends_a_full_batch_at_once() -> None:
    h = loaded_harness("a", policy="timeout", max_queue_delay_ns=1 * MS)
    commands = [c for i in range(16) for c in h.request(i, "a", 100 * MS)]
    (infer,) = only(commands, StartInfer)
    assert infer.batch_size == 16 and infer.predicted_ns == B16


def test_timeout_drops_only_requests_that_timed_out_in_the_queue() -> None:
    h = loaded_harness("a", policy="timeout", max_queue_delay_ns=0, queue_timeout_ns=4 * MS)
    busy_lane(h)
    h.request(1, "a", 1 * MS)  # its deadline is no business of this policy
    h.request(2, "a", 100 * MS, at_ns=1 * MS)
    (infer,) = only(h.tick(2 * B1 - 3 * MS), StartInfer)
    assert infer.request_ids == (1, 2)
    h.request(3, "a", 100 * MS, at_ns=3 * MS)  # lane full until 9.51 ms
    h.ticks_until(7 * MS)
    assert h.outcome(3) is Outcome.DROPPED and "timed out" in h.replies[3][0].message
    assert 1 not in h.replies and 2 not in h.replies


def test_timeout_rejects_over_the_queue_cap() -> None:
    h = loaded_harness("a", policy="timeout", max_queue_delay_ns=0, max_queued_per_model=1)
    busy_lane(h)
    h.request(1, "a", 100 * MS)
    assert only(h.request(2, "a", 100 * MS), Reply)[0].outcome is Outcome.OVERLOADED
