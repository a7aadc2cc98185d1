"""The house's one percentile: nearest rank, always one of the values."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.percentile import nearest_rank_index, percentile, percentile_of


def test_known_values() -> None:
    values = [15, 20, 35, 40, 50]
    assert percentile(values, 5) == 15
    assert percentile(values, 30) == 20
    assert percentile(values, 40) == 20
    assert percentile(values, 50) == 35
    assert percentile(values, 100) == 50
    assert percentile(values, 0) == 15


def test_refuses_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="at least one"):
        percentile([], 50)
    with pytest.raises(ValueError, match="percent"):
        nearest_rank_index(3, 101)


@given(st.lists(st.integers(-1000, 1000), min_size=1), st.floats(0, 100))
def test_at_least_p_percent_at_or_below(values: list[int], percent: float) -> None:
    value = percentile_of(values, percent)
    assert value in values
    at_or_below = sum(v <= value for v in values)
    assert at_or_below >= math.ceil(percent / 100 * len(values)) - 1e-9
    below = sum(v < value for v in values)
    assert below < max(1, math.ceil(percent / 100 * len(values)))
