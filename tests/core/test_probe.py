"""Predictions that recover when nothing runs (issue 29, point 3): a probe measures a stale
batch-1 prediction that refuses every request; on the virtual clock, exactly."""

from __future__ import annotations

from clockwork_async.core.events import StartInfer
from clockwork_async.core.outcomes import Outcome

from .harness import MS, US, Harness, only

B1 = 2_730 * US
SLOW = 10 * MS


def _slow_spell() -> Harness:
    """Model a on e1 ran ten times at 10 ms (a busy machine): its b1 prediction is 10 ms."""
    h = Harness()
    h.register("a")
    h.join("e1", loaded=("a",))
    for request_id in range(10):
        (infer,) = only(h.request(request_id, "a", 100 * MS), StartInfer)
        h.finish(infer, end_ns=infer.planned_start_ns + SLOW)
    assert h.ctl.predicted_exec_ns("a", "gpu", 1) == SLOW
    return h


def test_a_probe_after_a_slow_spell_lets_requests_in_again() -> None:
    h = _slow_spell()
    h.tick(h.now_ns + 999 * MS)  # 999 ms after the last sample: not stale yet
    assert not only(h.request(100, "a", 5 * MS), StartInfer)
    assert h.outcome(100) is Outcome.INFEASIBLE
    h.tick(h.now_ns + 2 * MS)  # stale now: the next refusal sends a probe
    (probe,) = only(h.request(101, "a", 5 * MS), StartInfer)
    assert h.outcome(101) is Outcome.INFEASIBLE
    assert probe.request_ids == () and probe.batch_size == 1
    assert not only(h.request(102, "a", 5 * MS), StartInfer)  # one probe at a time
    h.finish(probe, end_ns=probe.planned_start_ns + B1)  # the machine is fast again
    assert h.ctl.predicted_exec_ns("a", "gpu", 1) == B1  # samples over 2 x B1 forgotten
    (infer,) = only(h.request(103, "a", 5 * MS), StartInfer)
    assert infer.request_ids == (103,)
    assert h.ctl.stats().counters["probes"] == 1


def test_a_model_still_too_slow_stays_refused_one_probe_per_stale_period() -> None:
    h = _slow_spell()
    h.tick(h.now_ns + 1_001 * MS)
    (probe,) = only(h.request(100, "a", 5 * MS), StartInfer)
    h.finish(probe, end_ns=probe.planned_start_ns + SLOW)  # still slow
    assert h.ctl.predicted_exec_ns("a", "gpu", 1) == SLOW
    h.tick(h.now_ns + 500 * MS)
    assert not only(h.request(101, "a", 5 * MS), StartInfer)  # fresh: no probe
    assert h.outcome(101) is Outcome.INFEASIBLE
    h.tick(h.now_ns + 501 * MS)
    (again,) = only(h.request(102, "a", 5 * MS), StartInfer)
    assert again.request_ids == () and h.ctl.stats().counters["probes"] == 2


def test_no_probe_when_a_batch_of_one_was_predicted_to_fit() -> None:
    h = _slow_spell()
    h.tick(h.now_ns + 2_000 * MS)
    (infer,) = only(h.request(100, "a", 20 * MS), StartInfer)  # 10 ms fits: served
    assert infer.request_ids == (100,)
    assert h.ctl.stats().counters["probes"] == 0
