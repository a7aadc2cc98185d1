"""Predictions, capacity, configuration and clocks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.capacity import capacity_batch, capacity_rps
from clockwork_async.core.clock import VirtualClock
from clockwork_async.core.config import ConfigError, ControllerConfig
from clockwork_async.core.lanes import OVERRUN_WINDOW, Lane
from clockwork_async.core.profiles import Predictions, SlidingWindow
from clockwork_async.runtime.realclock import MonotonicClock

from .harness import KIND, MS, RESNET, SIZES, make_spec


def test_resnet50_v100_capacity_at_100ms_is_b16_and_923_rps() -> None:
    assert capacity_batch(RESNET, SIZES, 100 * MS) == 16
    assert capacity_rps(RESNET, SIZES, 100 * MS) == pytest.approx(923.25, abs=0.01)


def test_capacity_shrinks_with_the_slo_and_is_zero_when_nothing_fits() -> None:
    # 2 x 9.93 + margin(25 ms) = 19.86 + 1.25 <= 25; b16 needs 34.66.
    assert capacity_batch(RESNET, SIZES, 25 * MS) == 8
    assert capacity_rps(RESNET, SIZES, 5 * MS) == 0.0
    assert capacity_batch(RESNET, SIZES, 100 * MS, margin_ns=70 * MS) == 8


def test_margin_scales_with_the_slo_within_its_bounds() -> None:
    config = ControllerConfig()
    assert config.margin_ns(100 * MS) == 5 * MS  # Clockwork's flat 5 ms at its default SLO
    assert config.margin_ns(1000 * MS) == 5 * MS
    assert config.margin_ns(6 * MS) == 300_000  # 2x b1: still servable (2.73 + 0.3 < 6)
    assert config.margin_ns(1 * MS) == 200_000


def test_window_predicts_its_percentile_and_forgets_the_seed() -> None:
    window = SlidingWindow(size=10, percentile=99.0, seed_ns=100)
    for sample in range(1, 10):
        window.add(sample)
    assert window.value_ns == 100  # the seed is still one of the ten
    window.add(5)
    assert window.value_ns == 9  # p99 of ten samples is their max
    median = SlidingWindow(size=4, percentile=50.0, seed_ns=1)
    for sample in (2, 3, 4):
        median.add(sample)
    assert median.value_ns == 2


@given(
    st.integers(1, 12),
    st.sampled_from([50.0, 90.0, 99.0, 100.0]),
    st.lists(st.integers(0, 20), max_size=60),
)
def test_a_window_predicts_the_percentile_of_its_last_samples(
    size: int, percent: float, samples: list[int]
) -> None:
    window = SlidingWindow(size=size, percentile=percent, seed_ns=7)
    for sample in samples:
        window.add(sample)
    kept = sorted(([7, *samples])[-size:])
    assert window.value_ns == kept[max(0, math.ceil(percent / 100.0 * len(kept)) - 1)]


@given(st.lists(st.integers(-50, 50), max_size=3 * OVERRUN_WINDOW))
def test_a_lanes_overrun_is_the_largest_of_its_last_executions(overruns_ns: list[int]) -> None:
    lane = Lane()
    for over_ns in overruns_ns:
        lane.note_overrun(over_ns)
    assert lane.overrun_ns == max([0, *overruns_ns[-OVERRUN_WINDOW:]])


def test_a_stale_window_forgets_outliers_one_per_stale_period() -> None:
    window = SlidingWindow(size=10, percentile=99.0, seed_ns=100)
    for sample in (100, 100, 100, 900, 700):
        window.add(sample, now_ns=10 * MS)
    assert window.value_ns == 900
    assert not window.forget_outlier(10 * MS + 999_999, stale_ns=MS, factor=2.0)  # not stale
    assert window.forget_outlier(11 * MS, stale_ns=MS, factor=2.0)
    assert window.value_ns == 700  # one sample per stale period
    assert not window.forget_outlier(11 * MS + 1, stale_ns=MS, factor=2.0)
    assert window.forget_outlier(12 * MS, stale_ns=MS, factor=2.0)
    assert window.value_ns == 100
    assert not window.forget_outlier(20 * MS, stale_ns=MS, factor=2.0)  # consistent now


def test_a_window_of_consistent_samples_never_relaxes() -> None:
    window = SlidingWindow(size=10, percentile=99.0, seed_ns=100)
    for sample in (100, 150, 199):
        window.add(sample)
    assert not window.forget_outlier(10**12, stale_ns=MS, factor=2.0)
    assert window.value_ns == 199
    single = SlidingWindow(size=10, percentile=99.0, seed_ns=5_000)
    assert not single.forget_outlier(10**12, stale_ns=MS, factor=1.5)


def test_predictions_are_per_kind_and_record_errors() -> None:
    predictions = Predictions(window_size=2, percentile=99.0)
    spec = make_spec("a")
    assert predictions.record_execute(spec, KIND, 1, 3 * MS) == 3 * MS - RESNET.execute_ns[1]
    predictions.record_execute(spec, KIND, 1, 3 * MS)
    assert predictions.get(spec, KIND).exec_ns[1] == 3 * MS  # the seed left the window
    assert predictions.record_load(spec, KIND, 9 * MS) == 700_000
    assert predictions.get(spec, "other").exec_ns[1] == RESNET.execute_ns[1]
    assert predictions.fallback_seeds == 1
    errors = predictions.error_stats()
    assert errors["infer"].count == 2 and errors["load"].max_ns == 700_000
    assert [e.action for e in predictions.recent] == ["infer", "infer", "load"]


@pytest.mark.parametrize(
    "field",
    [
        {"policy": "nope"},
        {"window_size": 0},
        {"percentile": 0.0},
        {"schedule_ahead_ns": 0},
        {"margin_fraction": 1.0},
        {"margin_min_ns": 6 * MS},
        {"copy_max_utilisation": 0.0},
        {"max_queue_delay_ns": -1},
        {"prediction_stale_ns": 0},
        {"outlier_factor": 1.0},
        {"warm_up_infers": -1},
        {"warm_up_infers": 2},  # without warm_gap_ns, nothing says a lane is cold
    ],
)
def test_bad_config_is_refused_with_a_named_error(field: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ControllerConfig(**field)  # type: ignore[arg-type]


def test_virtual_clock_jumps_forward_only() -> None:
    clock = VirtualClock(5)
    assert clock.advance(10) == 15 and clock.jump_to(20) == 20 and clock.now_ns() == 20
    with pytest.raises(ValueError):
        clock.jump_to(19)
    with pytest.raises(ValueError):
        clock.advance(-1)
    first = MonotonicClock().now_ns()
    assert MonotonicClock().now_ns() >= first
