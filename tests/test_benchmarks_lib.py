"""benchmarks/lib's statistics agree with the house's one percentile (`core.percentile`),
whether values come as a list or as a histogram, and stay total on empty input."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from benchmarks.lib import (
    histogram_percentile,
    percentiles,
    percentiles_ms,
    pyplot,
    summarize_ns,
    table,
    write_report,
)
from benchmarks.lib.sim import histogram_us
from hypothesis import given
from hypothesis import strategies as st

from clockwork_async.core.percentile import percentile_of

VALUES = st.lists(st.integers(0, 10_000), min_size=1, max_size=200)
PERCENTS = st.sampled_from([0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0])


@given(VALUES, PERCENTS)
def test_histogram_percentile_is_the_percentile_of_the_values(
    values: list[int], percent: float
) -> None:
    assert histogram_percentile(Counter(values), percent) == percentile_of(values, percent)


@given(VALUES)
def test_percentiles_are_nearest_rank_values_scaled(values: list[int]) -> None:
    found = percentiles(values, (50, 99), scale=0.5, digits=6, suffix="_x")
    assert found == {
        "p50_x": percentile_of(values, 50) * 0.5,
        "p99_x": percentile_of(values, 99) * 0.5,
        "max_x": max(values) * 0.5,
    }


def test_empty_inputs_give_none_not_errors() -> None:
    assert percentiles_ms([]) == {"p50": None, "p99": None, "p99.9": None, "max": None}
    assert summarize_ns([]) == {"n": 0}
    assert histogram_percentile({}, 50) is None
    assert histogram_us({}) == {"count": 0}


def test_summaries_in_their_units() -> None:
    values_ns = [1_000, 2_000, 3_000, 4_000_000]
    assert percentiles_ms(values_ns) == {"p50": 0.002, "p99": 4.0, "p99.9": 4.0, "max": 4.0}
    summary = summarize_ns(values_ns)
    assert (summary["n"], summary["p50_us"], summary["max_us"]) == (4, 2.0, 4000.0)
    timed = histogram_us({10: 1, 20: 3})  # bins of 100 ns
    assert (timed["count"], timed["p50_us"], timed["max_us"]) == (4, 2.0, 2.0)


def test_reports_and_tables(tmp_path: Path) -> None:
    path = write_report("x", {"a": 1, "p": Path("/y")}, tmp_path / "out")
    assert path.read_text() == '{\n  "a": 1,\n  "p": "/y"\n}\n'
    assert table(["name", "n"], [["a", 1.5], ["bb", None]]).splitlines() == [
        "name    n",
        "a     1.5",
        "bb      -",
    ]


def test_a_missing_matplotlib_skips_the_plot_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert pyplot() is None
    assert capsys.readouterr().err == "matplotlib not installed: no plots\n"
