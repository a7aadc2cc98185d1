"""The upper bound (sim.bound) and the greedy baseline (sim.greedy): exact small cases, the
bound against the exhaustive optimum, and no scheduler (greedy, the core's policies) above it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clockwork_async.sim.bound import (
    SlotMatcher,
    best_batch,
    bound_of,
    brute_force_optimum,
    open_requests,
    stream_bound,
)
from clockwork_async.sim.engine import SimConfig, Simulation, build_controller, workload_rng
from clockwork_async.sim.greedy import as_requests, check_schedule, greedy
from clockwork_async.sim.profiles import RESNET50_V100, TINY_SIM
from clockwork_async.sim.workloads import poisson

MS = 1_000_000
TOY = {1: 2, 2: 3, 4: 4}  # integer durations: b/d(b) = 0.5, 0.67, 1.0
RESNET = RESNET50_V100.execute_ns


def bound(arrival: list[int], deadline: list[int], execute: dict[int, int], e: int = 1) -> int:
    return bound_of(as_requests(arrival, deadline, [0] * len(arrival)), execute, e)


def test_best_batch_is_the_least_time_per_request() -> None:
    assert best_batch(RESNET) == (16, 17_330_000)
    assert best_batch(TOY) == (4, 4)
    assert best_batch({1: 2, 2: 4}) == (1, 2)  # a tie goes to the smaller batch


def test_one_request_is_answerable_when_its_window_fits_a_batch() -> None:
    assert bound([0], [2], TOY) == 1
    assert bound([0], [1], TOY) == 0  # 1 < d(1): no batch fits
    assert bound([5], [5 + 2_730_000 - 1], RESNET) == 0


def test_a_full_batch_at_once_is_the_bound() -> None:
    arrivals = [0] * 20
    assert bound(arrivals, [RESNET[16]] * 20, RESNET) == 16
    assert bound(arrivals, [RESNET[16]] * 20, RESNET, e=2) == 20
    assert bound([0] * 40, [RESNET[16]] * 40, RESNET, e=2) == 32


def test_overload_is_bounded_by_the_best_batch_rate() -> None:
    # 2,000 requests arriving at 0 with 100 ms deadlines: 92 slots of 17.33/16 ms fit.
    assert bound([0] * 2000, [100 * MS] * 2000, RESNET) == (100 * MS * 16) // RESNET[16]


def test_the_streaming_matcher_needs_intervals_in_order() -> None:
    matcher = SlotMatcher(1)
    matcher.add([0, 0, 0, 5], [0, 0, 9, 5])  # slot 0 to one [0, 0], the other one misses
    assert matcher.finish() == 3  # [0, 9] gets slot 1, [5, 5] slot 5
    with pytest.raises(ValueError):
        SlotMatcher(1).add([3, 2], [4, 4])
    with pytest.raises(ValueError):
        SlotMatcher(0)


def test_streaming_the_workload_gives_the_bound_of_its_arrivals() -> None:
    workload = poisson(3, 3000.0, 2.0)
    requests = open_requests(workload, workload_rng(4), 20 * MS)
    streamed = stream_bound(workload, workload_rng(4), 20 * MS, RESNET, 2)
    assert streamed == (bound_of(requests, RESNET, 2), len(requests))


def test_executors_must_be_positive() -> None:
    with pytest.raises(ValueError):
        bound([0], [5], TOY, e=0)


@st.composite
def tiny_cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], int]:
    count = draw(st.integers(1, 6))
    arrival = draw(st.lists(st.integers(0, 6), min_size=count, max_size=count))
    slo = draw(st.lists(st.integers(1, 8), min_size=count, max_size=count))
    model = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
    executors = draw(st.integers(1, 2))
    return arrival, [a + s for a, s in zip(arrival, slo, strict=True)], model, executors


@settings(max_examples=120, deadline=None)
@given(tiny_cases())
def test_bound_and_greedy_enclose_the_exact_optimum(
    case: tuple[list[int], list[int], list[int], int],
) -> None:
    arrival, deadline, model, executors = case
    optimum = brute_force_optimum(arrival, deadline, model, TOY, executors)
    requests = as_requests(arrival, deadline, model)
    assert bound_of(requests, TOY, executors) >= optimum
    found = greedy(requests, TOY, executors, keep_batches=True)
    assert found.batches is not None
    assert check_schedule(requests, TOY, found.batches) == []
    assert found.ok + found.dropped == len(arrival)
    assert found.ok <= optimum


def test_brute_force_finds_the_batching_optimum() -> None:
    # Four requests at 0, deadline 4: one b4 (4 units) answers all; b1s answer two.
    assert brute_force_optimum([0] * 4, [4] * 4, [0] * 4, TOY) == 4
    # Two models cannot share a batch: b2 (3) for one, then nothing fits by 4.
    assert brute_force_optimum([0] * 4, [4] * 4, [0, 0, 1, 1], TOY) == 2
    assert brute_force_optimum([0] * 4, [4] * 4, [0, 0, 1, 1], TOY, executors=2) == 4


def test_greedy_prefers_throughput_and_passes_over_the_hopeless() -> None:
    # t=0: requests 0..3 (deadline 4) and 4 (deadline 2): b4 of 0..3 answers four.
    requests = as_requests([0] * 5, [4, 4, 4, 4, 2], [0] * 5)
    found = greedy(requests, TOY, keep_batches=True)
    assert found.batches is not None
    assert [(b.start_ns, b.batch_size, b.members) for b in found.batches] == [(0, 4, (0, 1, 2, 3))]
    assert (found.ok, found.dropped) == (4, 1)


def test_greedy_is_work_conserving() -> None:
    requests = as_requests([0, 1, 10], [20, 20, 30], [0, 0, 0])
    found = greedy(requests, TOY, keep_batches=True)
    assert found.batches is not None
    assert [(b.start_ns, b.batch_size) for b in found.batches] == [(0, 1), (2, 1), (10, 1)]


def test_greedy_rejects_a_profile_slower_per_smaller_batch() -> None:
    with pytest.raises(ValueError):
        greedy(as_requests([0], [9], [0]), {1: 3, 2: 2})


POLICIES = ("clockwork", "fifo", "timeout")


@settings(max_examples=12, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    instances=st.integers(1, 3),
    executors=st.integers(1, 2),
    rate_rps=st.floats(200.0, 6000.0),
    slo_ms=st.sampled_from([1.0, 2.0, 5.0, 20.0]),
    seed=st.integers(0, 1000),
    preload=st.booleans(),
)
def test_no_policy_of_the_core_beats_the_bound(
    policy: str,
    instances: int,
    executors: int,
    rate_rps: float,
    slo_ms: float,
    seed: int,
    preload: bool,
) -> None:
    workload = poisson(instances, rate_rps, 0.2)
    slo_ns = round(slo_ms * MS)
    config = SimConfig(
        executors=executors, profile=TINY_SIM, slo_ns=slo_ns, seed=seed, preload=preload
    )
    stats = Simulation(config, workload, build_controller(policy)).run()
    requests = open_requests(workload, workload_rng(seed), slo_ns)
    assert len(requests) == stats.requests  # the very arrivals of the run
    limit = bound_of(requests, TINY_SIM.execute_ns, executors)
    assert stats.outcomes["ok"] <= limit
    assert greedy(requests, TINY_SIM.execute_ns, executors).ok <= limit
