"""The simulator's counts: the histogram percentile is the house's nearest-rank percentile;
counts read as Counters."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.outcomes import Outcome
from clockwork_async.core.percentile import percentile_of
from clockwork_async.sim.stats import SimStats, percentile


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


def test_counts_read_as_counters_of_what_was_counted() -> None:
    stats = SimStats(interval_ns=1_000_000_000)
    stats.on_reply(Outcome.OK, 1_500_000_000, 1_000_000_000)  # 500 ms: interval 1
    stats.on_reply(Outcome.OK, 1_600_000_000, 1_599_000_000)
    stats.on_reply(Outcome.LATE, 1_700_000_000, 1_000_000_000)
    stats.on_infer(1_500_000_000, 4, 3)
    assert stats.outcomes == Counter({"ok": 2, "late": 1})
    assert stats.outcomes["dropped"] == 0  # a Counter: what never happened counts 0
    assert stats.latency_us == Counter({500_000: 1, 1_000: 1})
    assert stats.late_latency_us == Counter({700_000: 1})
    assert stats.batch_sizes == Counter({4: 1})
    interval = stats.timeline.intervals[1]
    assert interval.outcomes == Counter({"ok": 2, "late": 1})
    assert interval.latency_bins == Counter({5_000: 1, 10: 1})
    stats.outcomes["ok"] += 5  # a copy: the run's counts stay as counted
    assert stats.outcomes["ok"] == 2


def test_ok_counted_apart_reads_in_the_order_the_outcomes_came() -> None:
    stats = SimStats(interval_ns=1_000_000_000)
    stats.on_reply(Outcome.DROPPED, 100, 0)  # interval 0: dropped first, then ok
    stats.on_reply(Outcome.OK, 200, 0)
    stats.on_reply(Outcome.OK, 1_000_000_100, 1_000_000_000)  # interval 1: ok first
    stats.on_reply(Outcome.DROPPED, 1_000_000_200, 1_000_000_000)
    stats.on_reply(Outcome.OK, 1_000_000_300, 1_000_000_000)
    assert list(stats.outcomes.items()) == [("dropped", 2), ("ok", 3)]
    first, second = stats.timeline.intervals
    assert list(first.outcomes.items()) == [("dropped", 1), ("ok", 1)]
    assert list(second.outcomes.items()) == [("ok", 2), ("dropped", 1)]
    assert SimStats(interval_ns=1).outcomes == Counter()  # no ok: no ok key
