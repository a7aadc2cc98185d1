"""The simulator's histogram percentile is the house's nearest-rank percentile."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.percentile import percentile_of
from clockwork_async.sim.stats import percentile


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=200),
    st.sampled_from([0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 99.99, 100.0]),
)
def test_the_histogram_walk_gives_the_percentile_of_its_samples(
    samples: list[int], percent: float
) -> None:
    assert percentile(Counter(samples), percent) == percentile_of(samples, percent)


def test_an_empty_histogram_has_no_percentile_and_a_bad_percent_raises() -> None:
    assert percentile({}, 50.0) is None
    with pytest.raises(ValueError):
        percentile({1: 1}, 101.0)
