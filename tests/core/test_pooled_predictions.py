"""Pooled predictions (`pooled_window_size`, core/profiles.py "Pooled"): one window of ratios
to the profile for every batch size of a model on a kind; exact, on the virtual clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.config import ConfigError, ControllerConfig
from clockwork_async.core.events import StartInfer
from clockwork_async.core.profiles import RATIO_ONE, Predictions

from .harness import KIND, MS, RESNET, SIZES, Harness, make_spec, only

SEEDS = RESNET.execute_ns


def test_one_batch_sizes_slowdown_moves_every_batch_size() -> None:
    predictions = Predictions(window_size=10, percentile=99.0, pooled_size=4)
    spec = make_spec("a")
    kind = predictions.get(spec, KIND)
    assert kind.exec_ns == SEEDS  # the seed ratio: 1
    assert predictions.record_execute(spec, KIND, 4, 2 * SEEDS[4]) == SEEDS[4]  # the error
    assert kind.exec_ns == {size: 2 * ns for size, ns in SEEDS.items()}
    for _ in range(3):
        predictions.record_execute(spec, KIND, 1, SEEDS[1])
    assert kind.exec_ns[16] == 2 * SEEDS[16]  # the 2 is still one of the last four
    predictions.record_execute(spec, KIND, 2, SEEDS[2])
    assert kind.exec_ns == SEEDS  # it left the window


def test_a_prediction_is_the_seed_times_the_ratio_rounded_up() -> None:
    predictions = Predictions(window_size=10, percentile=99.0, pooled_size=10)
    spec = make_spec("a")
    predictions.record_execute(spec, KIND, 1, 3 * MS)  # ratio 3 / 2.73 = 1.098901 (down)
    kind = predictions.get(spec, KIND)
    assert kind.exec_ns[1] == 3 * MS
    assert kind.exec_ns[16] == 19_043_955  # ceil(17.33 ms x 1.098901)


def test_loads_keep_their_own_window() -> None:
    predictions = Predictions(window_size=2, percentile=99.0, pooled_size=4)
    spec = make_spec("a")
    predictions.record_load(spec, KIND, 2 * RESNET.load_ns)
    kind = predictions.get(spec, KIND)
    assert kind.load_ns == 2 * RESNET.load_ns
    assert kind.exec_ns == SEEDS


@given(
    st.integers(1, 12),
    st.sampled_from([50.0, 90.0, 99.0, 100.0]),
    st.lists(st.tuples(st.sampled_from(SIZES), st.integers(1, 40 * MS)), max_size=40),
)
def test_every_batch_size_predicts_its_seed_times_the_windows_percentile_ratio(
    size: int, percent: float, samples: list[tuple[int, int]]
) -> None:
    predictions = Predictions(window_size=10, percentile=percent, pooled_size=size)
    spec = make_spec("a")
    for batch_size, measured_ns in samples:
        predictions.record_execute(spec, KIND, batch_size, measured_ns)
    ratios = [RATIO_ONE, *(ns * RATIO_ONE // SEEDS[b] for b, ns in samples)][-size:]
    ratio = sorted(ratios)[max(0, math.ceil(percent / 100.0 * len(ratios)) - 1)]
    expected = {b: -(-ns * ratio // RATIO_ONE) for b, ns in SEEDS.items()}
    assert predictions.get(spec, KIND).exec_ns == expected


def test_a_probe_and_a_stale_window_act_on_the_pooled_window() -> None:
    predictions = Predictions(window_size=10, percentile=99.0, pooled_size=10)
    spec = make_spec("a")
    for _ in range(3):
        predictions.record_execute(spec, KIND, 1, 3 * SEEDS[1], now_ns=10 * MS)
    kind = predictions.get(spec, KIND)
    assert kind.exec_ns[8] == 3 * SEEDS[8]
    assert not kind.exec_stale(8, 10 * MS + 999 * MS, 1_000 * MS)  # one window for all sizes
    assert kind.exec_stale(8, 1_010 * MS, 1_000 * MS)
    predictions.record_probe(spec, KIND, 2, SEEDS[2], 1_010 * MS, factor=2.0)
    assert kind.exec_ns == SEEDS  # the ratios over 2 x 1 were forgotten
    predictions.record_execute(spec, KIND, 16, 3 * SEEDS[16], now_ns=1_020 * MS)
    assert kind.exec_ns[1] == 3 * SEEDS[1]
    predictions.relax("a", 2_020 * MS, 1_000 * MS, 2.0)  # stale: 3 > 2 x the lower median 1
    assert kind.exec_ns == SEEDS


def test_the_controller_pools_when_configured() -> None:
    for pooled_window_size, b16_ns in ((0, SEEDS[16]), (10, 2 * SEEDS[16])):
        h = Harness(pooled_window_size=pooled_window_size)
        h.register("a")
        h.join("e1", loaded=("a",))
        (infer,) = only(h.request(0, "a", 100 * MS), StartInfer)
        assert infer.batch_size == 1
        h.finish(infer, end_ns=infer.planned_start_ns + 2 * SEEDS[1])  # twice its prediction
        assert h.ctl.predicted_exec_ns("a", KIND, 1) == 2 * SEEDS[1]
        assert h.ctl.predicted_exec_ns("a", KIND, 16) == b16_ns


def test_a_negative_pooled_window_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pooled_window_size"):
        ControllerConfig(pooled_window_size=-1)
    assert ControllerConfig().pooled_window_size == 0  # off by default
