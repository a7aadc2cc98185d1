"""Workload generators: rates within statistical bounds, order, laziness, closed loop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from clockwork_async.sim.workloads import (
    NS_PER_S,
    bursty,
    closed_loop,
    draw_piece,
    poisson,
    ramp,
    slo_sweep_ms,
)


def arrivals(workload, seed: int = 1) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    times: list[int] = []
    instances: list[int] = []
    for piece_times, piece_instances in workload.open_arrivals(np.random.default_rng(seed)):
        times += piece_times
        instances += piece_instances
    return times, instances


def test_poisson_rate_is_within_statistical_bounds() -> None:
    times, instances = arrivals(poisson(instances=10, rate_rps=1000.0, duration_s=20.0))
    assert abs(len(times) - 20_000) < 5 * 20_000**0.5
    per_instance = np.bincount(instances, minlength=10)
    assert np.all(np.abs(per_instance - 2000) < 5 * 2000**0.5)
    assert times == sorted(times)
    assert 0 <= times[0] and times[-1] < 20 * NS_PER_S


def test_poisson_gaps_are_exponential() -> None:
    times, _ = arrivals(poisson(instances=1, rate_rps=1000.0, duration_s=20.0))
    gaps_ms = np.diff(times) / 1e6
    assert abs(gaps_ms.mean() - 1.0) < 0.05
    assert abs(gaps_ms.std() - 1.0) < 0.05  # exponential: std == mean


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    workload = poisson(instances=3, rate_rps=500.0, duration_s=2.0)
    assert arrivals(workload, seed=3) == arrivals(workload, seed=3)
    assert arrivals(workload, seed=3) != arrivals(workload, seed=4)


def test_arrivals_come_lazily_in_pieces_of_at_most_a_second() -> None:
    pieces = poisson(instances=2, rate_rps=100.0, duration_s=3600.0).open_arrivals(
        np.random.default_rng(0)
    )
    first_two = list(itertools.islice(pieces, 2))
    assert all(t < NS_PER_S for t in first_two[0][0])
    assert all(NS_PER_S <= t < 2 * NS_PER_S for t in first_two[1][0])


def test_draw_piece_with_zero_rates_is_empty() -> None:
    assert draw_piece(np.random.default_rng(0), 0, NS_PER_S, np.zeros(4)) == ([], [])


def test_ramp_activates_one_more_instance_each_step() -> None:
    times, instances = arrivals(ramp(instances=5, rate_rps=1000.0, duration_s=8.0))
    for time_ns, instance in zip(times, instances, strict=True):
        assert time_ns >= instance * NS_PER_S
    assert abs(len(times) - 8000) < 5 * 8000**0.5
    late_counts = np.bincount([i for t, i in zip(times, instances, strict=True) if t > 5e9])
    assert len(late_counts) == 5 and late_counts.min() > 400  # all five share the rate


def test_bursty_keeps_the_mean_rate_and_goes_silent() -> None:
    workload = bursty(instances=2, rate_rps=200.0, duration_s=200.0, on_s=0.5, off_s=0.5)
    times, _ = arrivals(workload)
    assert abs(len(times) - 40_000) < 0.15 * 40_000
    per_bin = np.bincount(np.asarray(times) // (NS_PER_S // 10), minlength=2000)
    assert per_bin.var() / per_bin.mean() > 3  # over-dispersed (Poisson: 1)
    assert np.sum(np.diff(times) > 0.3 * NS_PER_S) > 10  # silences


def test_closed_loop_starts_every_slot_and_backs_off_after_a_rejection() -> None:
    workload = closed_loop(instances=2, clients=3, in_flight=2, duration_s=1.0, think_ms=0.5)
    (times, instances), *rest = list(workload.open_arrivals(np.random.default_rng(0)))
    assert not rest
    assert times == [0] * 6 and instances == [0, 0, 1, 1, 0, 0]
    assert workload.after_reply(0, 1_000, ok=True) == 501_000
    assert workload.after_reply(0, 1_000, ok=False) == 1_001_000
    assert workload.after_reply(0, NS_PER_S - 1, ok=True) is None


def test_slo_sweep_starts_at_the_b1_time() -> None:
    slos = slo_sweep_ms(2.73)
    assert slos[0] == 2.73 and slos == sorted(slos) and slos[-1] > 100


@pytest.mark.parametrize(
    "make",
    [
        lambda: poisson(instances=0, rate_rps=1.0, duration_s=1.0),
        lambda: poisson(instances=1, rate_rps=1.0, duration_s=0.0),
        lambda: bursty(instances=1, rate_rps=1.0, duration_s=1.0, on_s=0.0),
        lambda: closed_loop(instances=1, clients=0, in_flight=1, duration_s=1.0),
    ],
)
def test_bad_workload_arguments_raise_value_error(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        make()
