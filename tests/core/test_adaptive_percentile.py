"""The adaptive percentile (`prediction_miss_budget`, core/profiles.py): exact steps, bounds,
its share of misses, and the config's checks."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.config import ConfigError, ControllerConfig
from clockwork_async.core.profiles import (
    ADAPT_FLOOR_PERCENT,
    ADAPT_STEP_PERCENT,
    Predictions,
    SlidingWindow,
)

from .harness import KIND, RESNET, make_spec


def test_a_miss_raises_the_percentile_and_a_hit_lowers_it_by_the_budgets_share() -> None:
    window = SlidingWindow(size=5, percentile=90.0, seed_ns=10, miss_budget=0.2)
    window.add(20)  # over the prediction (10): +5 x 0.8
    assert window.percentile == pytest.approx(94.0)
    assert window.value_ns == 20
    window.add(20)  # not over 20: -5 x 0.2
    assert window.percentile == pytest.approx(93.0)
    for _ in range(3):
        window.add(30)  # over 20 (+4), then not over 30 (-1, -1)
    assert window.percentile == pytest.approx(93.0 + 4.0 - 1.0 - 1.0)
    assert ADAPT_STEP_PERCENT == 5.0


def test_the_percentile_stays_between_the_floor_and_100() -> None:
    rising = SlidingWindow(size=10, percentile=99.0, seed_ns=1, miss_budget=0.01)
    for sample in range(2, 40):
        rising.add(sample)  # every sample a new maximum: a miss each time
    assert rising.percentile == 100.0
    assert rising.value_ns == 39
    falling = SlidingWindow(size=10, percentile=60.0, seed_ns=1_000, miss_budget=0.5)
    for _ in range(100):
        falling.add(1)  # never over
    assert falling.percentile == ADAPT_FLOOR_PERCENT
    assert falling.value_ns == 1


@given(
    st.integers(1, 12),
    st.floats(0.001, 0.5),
    st.lists(st.integers(0, 50), max_size=80),
)
def test_an_adaptive_window_predicts_its_current_percentile_of_its_last_samples(
    size: int, budget: float, samples: list[int]
) -> None:
    window = SlidingWindow(size=size, percentile=99.0, seed_ns=7, miss_budget=budget)
    for sample in samples:
        window.add(sample)
    kept = sorted(([7, *samples])[-size:])
    rank = max(0, math.ceil(window.percentile / 100.0 * len(kept)) - 1)
    assert window.value_ns == kept[rank]
    assert ADAPT_FLOOR_PERCENT <= window.percentile <= 100.0


@pytest.mark.parametrize("budget", [0.05, 0.1])
def test_the_share_of_samples_over_the_prediction_tends_to_the_budget(budget: float) -> None:
    """Seeded heavy-tailed samples (a tenth of them 3x): over 20,000 the share of misses is
    the budget to within a fifth of it. (Not below about 1 / (size + 1): the window's largest
    sample is the most it predicts, and a new sample beats the largest of 50 that often.)"""
    rng = random.Random(5)
    window = SlidingWindow(size=50, percentile=99.0, seed_ns=1_000, miss_budget=budget)
    misses = 0
    count = 20_000
    for _ in range(count):
        sample = round(1_000 * rng.uniform(1.0, 1.2) * (3 if rng.random() < 0.1 else 1))
        misses += sample > window.value_ns
        window.add(sample)
    assert abs(misses / count - budget) < budget / 5


def test_predictions_pass_the_budget_to_every_window() -> None:
    predictions = Predictions(window_size=40, percentile=99.0, miss_budget=0.25)
    spec = make_spec("a")
    first = RESNET.execute_ns[1]
    predictions.record_execute(spec, KIND, 1, first + 1)  # a miss: 99 + 3.75 -> 100
    predictions.record_load(spec, KIND, RESNET.load_ns + 1)
    kind = predictions.get(spec, KIND)
    assert kind.exec_ns[1] == first + 1
    assert kind.load_ns == RESNET.load_ns + 1
    for _ in range(7):
        predictions.record_execute(spec, KIND, 1, first)  # hits: -1.25 each -> 91.25
    assert kind.exec_ns[1] == first + 1  # rank ceil(0.9125 x 9) - 1 = 8 of 9: the largest
    for _ in range(2):
        predictions.record_execute(spec, KIND, 1, first)  # -> 88.75
    assert kind.exec_ns[1] == first  # rank ceil(0.8875 x 11) - 1 = 9 of 11: no longer it


@pytest.mark.parametrize("budget", [-0.01, 1.0, 2.0])
def test_a_budget_outside_0_1_is_a_config_error(budget: float) -> None:
    with pytest.raises(ConfigError, match="prediction_miss_budget"):
        ControllerConfig(prediction_miss_budget=budget)


def test_the_default_is_a_fixed_percentile() -> None:
    assert ControllerConfig().prediction_miss_budget == 0.0
