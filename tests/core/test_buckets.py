"""Shape buckets on the virtual clock: the neighbour rule for unprofiled (bucket, batch size)
pairs, the bucket a request's lengths run at, and the controller serving one variant per bucket:
per-bucket predictions corrected by their own measurements, batches of one bucket only, and
deadlines kept with mixed buckets."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from clockwork_async.core.buckets import (
    all_buckets,
    bucket_for,
    neighbour_profiles,
    variant_name,
)
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ExecutorJoined,
    ModelProfile,
    ModelRegistered,
    ModelSpec,
    RequestArrived,
    StartInfer,
    StartLoad,
)
from clockwork_async.core.outcomes import Outcome

from .harness import KIND, MS, US, Harness, MiniSim, only

SIZES = (1, 2, 4, 8)
LENGTHS = (32, 128, 512)
# Execute time grows with rows and length: 0.5 ms + 10 us per (row x 32 tokens).
PER_BUCKET = {
    (length,): ModelProfile({b: 500 * US + 10 * US * b * length // 32 for b in SIZES}, 4 * MS)
    for length in LENGTHS
}


def variant(length: int) -> str:
    return variant_name("t", (length,))


def variant_specs() -> list[ModelSpec]:
    return [
        ModelSpec(variant(length), SIZES, 3, {KIND: PER_BUCKET[(length,)]}) for length in LENGTHS
    ]


def bucketed_harness(**config: object) -> Harness:
    h = Harness(**config)
    for spec in variant_specs():
        h.at(0, ModelRegistered(spec))
    h.join("e1", loaded=[variant(length) for length in LENGTHS])
    return h


# --- the pure parts ---------------------------------------------------------------------------


def test_variant_names_and_buckets_of_several_dimensions_are_the_product_smallest_first() -> None:
    assert variant_name("bert", (128,)) == "bert~128"
    assert variant_name("bert", (128, 16)) == "bert~128x16"
    assert all_buckets([(64, 128), (4, 16)]) == ((64, 4), (128, 4), (64, 16), (128, 16))


def test_a_request_runs_at_the_smallest_bucket_that_holds_it_when_padding_else_its_own() -> None:
    assert bucket_for([LENGTHS], [100], pad=True) == (128,)
    assert bucket_for([LENGTHS], [128], pad=True) == (128,)
    assert bucket_for([LENGTHS], [513], pad=True) is None
    assert bucket_for([LENGTHS], [100], pad=False) is None
    assert bucket_for([LENGTHS], [512], pad=False) == (512,)
    assert bucket_for([LENGTHS, (4, 16)], [40, 16], pad=True) == (128, 16)


def test_an_unprofiled_bucket_takes_the_next_longer_profiled_buckets_times() -> None:
    measured = {(512,): PER_BUCKET[(512,)], (32,): PER_BUCKET[(32,)]}
    profiles = neighbour_profiles([(32,), (128,), (512,)], measured)
    assert profiles[(128,)].execute_ns == PER_BUCKET[(512,)].execute_ns  # never below 512's
    assert profiles[(32,)] == PER_BUCKET[(32,)]
    assert profiles[(128,)].load_ns == 4 * MS


def test_a_batch_size_a_longer_bucket_lacks_is_scaled_from_the_longest_that_has_it() -> None:
    # 512 was profiled up to batch 2 only (the cap); 128 at every size.
    short = ModelProfile({1: 1 * MS, 2: 2 * MS}, 5 * MS)
    measured = {(512,): short, (128,): PER_BUCKET[(128,)]}
    profiles = neighbour_profiles([(128,), (512,)], measured)
    assert profiles[(512,)].execute_ns[1] == 1 * MS  # its own
    assert profiles[(512,)].execute_ns[8] == 4 * PER_BUCKET[(128,)].execute_ns[8]  # x 512/128
    assert profiles[(512,)].load_ns == 5 * MS
    assert profiles[(128,)].load_ns == 4 * MS


def test_with_several_dimensions_a_neighbour_must_be_at_least_as_long_in_each() -> None:
    wide = ModelProfile({1: 7 * MS}, 1 * MS)
    tall = ModelProfile({1: 3 * MS}, 1 * MS)
    measured = {(64, 16): wide, (128, 4): tall}
    profiles = neighbour_profiles(all_buckets([(64, 128), (4, 16)]), measured)
    assert profiles[(64, 4)].execute_ns[1] == 3 * MS  # (128, 4) holds it, fewer elements
    # (128, 16) is longer than both: scaled from the one with the most elements, (64, 16).
    assert profiles[(128, 16)].execute_ns[1] == 14 * MS


def test_nothing_profiled_is_refused() -> None:
    with pytest.raises(ValueError, match="no bucket"):
        neighbour_profiles([(32,)], {})


# --- the controller, one variant per bucket ----------------------------------------------------


def test_each_bucket_is_predicted_from_its_own_profile() -> None:
    h = bucketed_harness()
    (short,) = only(h.request(1, variant(32), 100 * MS), StartInfer)
    assert short.predicted_ns == PER_BUCKET[(32,)].execute_ns[1]
    (long,) = only(h.request(2, variant(512), 100 * MS, at_ns=10 * MS), StartInfer)
    assert long.predicted_ns == PER_BUCKET[(512,)].execute_ns[1]


def test_a_measurement_corrects_only_its_own_buckets_prediction() -> None:
    h = bucketed_harness()
    (first,) = only(h.request(1, variant(128), 100 * MS), StartInfer)
    slow_ns = 3 * first.predicted_ns
    h.finish(first, end_ns=first.planned_start_ns + slow_ns)
    (again,) = only(h.request(2, variant(128), 100 * MS, at_ns=20 * MS), StartInfer)
    assert again.predicted_ns == slow_ns  # the 99th percentile of {seed, 3x seed}
    (other,) = only(h.request(3, variant(32), 100 * MS, at_ns=40 * MS), StartInfer)
    assert other.predicted_ns == PER_BUCKET[(32,)].execute_ns[1]


def recording_sim(
    duration_ns: Callable[[StartInfer | StartLoad, int], int] | None = None,
) -> tuple[MiniSim, list[StartInfer]]:
    """A MiniSim serving the variants (32 and 128 loaded) that records each INFER it runs."""
    sim = MiniSim(Controller(ControllerConfig()), duration_ns, delay_ns=50 * US)
    for spec in variant_specs():
        sim.schedule(0, ModelRegistered(spec))
    sim.schedule(0, ExecutorJoined("e1", KIND, 9, 16 << 20, (variant(32), variant(128))))
    sent: list[StartInfer] = []
    run_action = sim._run_action

    def recorded(action: StartInfer | StartLoad) -> None:
        if isinstance(action, StartInfer):
            sent.append(action)
        run_action(action)

    sim._run_action = recorded  # type: ignore[method-assign]
    return sim, sent


def test_queued_requests_of_two_buckets_go_in_two_batches() -> None:
    sim, sent = recording_sim()
    for request_id in range(100, 106):  # six 128s fill the lane past the horizon
        sim.schedule(1 * MS, RequestArrived(request_id, variant(128), 100 * MS))
    for request_id in range(6):
        model = variant(32) if request_id % 2 else variant(128)
        sim.schedule(1 * MS + US, RequestArrived(request_id, model, 100 * MS))
    sim.run()
    later = [(i.model, set(i.request_ids), i.batch_size) for i in sent if min(i.request_ids) < 100]
    assert later == [(variant(128), {0, 2, 4}, 4), (variant(32), {1, 3, 5}, 4)]
    assert all(reply.outcome is Outcome.OK for reply in sim.replies)


@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_buckets_under_load_keep_deadlines_and_never_share_a_batch(seed: int) -> None:
    rng = random.Random(seed)

    def duration_ns(action: StartInfer | StartLoad, start_ns: int) -> int:
        predicted_ns = action.predicted_ns if isinstance(action, StartInfer) else 4 * MS
        return int(predicted_ns * rng.uniform(0.8, 1.0))

    sim, sent = recording_sim(duration_ns)
    deadlines: dict[int, int] = {}
    model_of: dict[int, str] = {}
    now_ns = 0
    for request_id in range(1, 2000):
        now_ns += int(rng.expovariate(3000.0) * 1e9)  # over what one executor serves
        deadlines[request_id] = now_ns + rng.randrange(10 * MS, 50 * MS)
        model_of[request_id] = variant(rng.choice(LENGTHS))
        sim.schedule(
            now_ns, RequestArrived(request_id, model_of[request_id], deadlines[request_id])
        )
    sim.run()
    outcomes = {reply.request_id: reply.outcome for reply in sim.replies}
    assert len(sim.replies) == len(outcomes) == len(deadlines)
    assert Outcome.LATE not in outcomes.values()
    for request_id, outcome in outcomes.items():
        if outcome is Outcome.OK:
            assert sim.replied_at_ns[request_id] <= deadlines[request_id]
    for infer in sent:
        assert {model_of[r] for r in infer.request_ids} == {infer.model}
    assert {infer.model for infer in sent if len(infer.request_ids) > 1} == {
        variant(length) for length in LENGTHS
    }
    assert sum(o is Outcome.OK for o in outcomes.values()) > len(deadlines) // 2
