"""The picture's stand-ins for PromQL (benchmarks/dashboard_render.py) give what Prometheus
gives: exact cases, and the same series evaluated by promtool where it is installed."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
from benchmarks.dashboard_render import (
    Scrape,
    bucket_quantile,
    divide,
    histogram_quantile,
    rate,
    select,
    sum_by,
)

MINUTE_S = 60.0
# Cumulative buckets rising 10, 15 and 16 a minute; a counter reset to 10 at minute 7.
BUCKETS = {"0.1": 10, "0.2": 15, "+Inf": 16}
RESET = [0, 60, 120, 180, 240, 300, 360, 10, 70, 130, 190]
QUANTILES = (0.5, 0.9, 0.99)


def scrapes() -> list[Scrape]:
    found = []
    for minute in range(11):
        samples = {("x_bucket", (("le", le),)): float(per * minute) for le, per in BUCKETS.items()}
        samples[("c_total", (("g", "a"),))] = float(RESET[minute])
        samples[("c_total", (("g", "b"),))] = float(2 * minute)
        found.append(Scrape(minute * MINUTE_S, samples))
    return found


def test_bucket_quantiles_interpolate_inside_the_bucket_of_the_rank() -> None:
    bounds, counts = [0.1, 0.2, math.inf], [10.0, 15.0, 16.0]
    assert bucket_quantile(0.5, bounds, counts) == pytest.approx(0.08)
    assert bucket_quantile(0.9, bounds, counts) == pytest.approx(0.188)
    assert bucket_quantile(0.99, bounds, counts) == 0.2  # the rank is in +Inf
    assert math.isnan(bucket_quantile(0.5, bounds, [0.0, 0.0, 0.0]))


def test_rate_counts_a_reset_from_zero_and_needs_two_samples() -> None:
    rates = rate(scrapes(), select(scrapes(), "c_total"), 5 * MINUTE_S)
    by_group = {dict(labels)["g"]: values for labels, values in rates.items()}
    assert math.isnan(by_group["a"][0])
    assert by_group["a"][2] == 1.0
    assert by_group["a"][8] * 300 == pytest.approx(60 + 60 + 10 + 60 + 60)  # minutes 3..8
    summed = sum_by(rates, [])
    assert summed[()][10] == pytest.approx(by_group["a"][10] + by_group["b"][10])
    assert divide(summed, summed)[()][10] == 1.0


def promtool_values(tmp_path: Path) -> dict[str, float]:
    """The same series through promtool: it passes a test whose expected values are ours."""
    ours = expected()
    series = [
        f"  - series: 'x_bucket{{le=\"{le}\"}}'\n    values: '0+{per}x10'"
        for le, per in BUCKETS.items()
    ]
    series.append(f"  - series: 'c_total{{g=\"a\"}}'\n    values: '{' '.join(map(str, RESET))}'")
    cases = "".join(
        f"  - expr: round({expr}, 0.0001)\n    eval_time: 10m\n"
        f"    exp_samples:\n    - labels: '{{}}'\n      value: {value}\n"
        for expr, value in ours.items()
    )
    text = (
        "rule_files: []\nevaluation_interval: 1m\ntests:\n- interval: 1m\n  input_series:\n"
        + "\n".join("  " + line for s in series for line in s.splitlines())
        + "\n  promql_expr_test:\n"
        + "\n".join("  " + line for line in cases.splitlines())
        + "\n"
    )
    test_file = tmp_path / "equivalence.yml"
    test_file.write_text(text)
    result = subprocess.run(
        ["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return ours


def expected() -> dict[str, float]:
    found = {}
    window_s = 5 * MINUTE_S
    buckets = rate(scrapes(), select(scrapes(), "x_bucket"), window_s)
    for q in QUANTILES:
        value = histogram_quantile(q, buckets)[()][10]
        found[f"histogram_quantile({q}, rate(x_bucket[5m]))"] = round(value, 4)
    counter = rate(
        scrapes(), select(scrapes(), "c_total", lambda labels: labels["g"] == "a"), window_s
    )
    found['sum(rate(c_total{g="a"}[5m]))'] = round(sum_by(counter, [])[()][10], 4)
    return found


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_prometheus_computes_the_same(tmp_path: Path) -> None:
    assert len(promtool_values(tmp_path)) == len(QUANTILES) + 1
