"""The PromQL reader used to check the dashboard and rules against a scrape: it finds every
metric name and matcher, and never mistakes a function, aggregation or label for a metric."""

from __future__ import annotations

import pytest

from .promql import Matcher, PromQLError, Selector, is_recording_rule_name, level_labels, uses


def test_a_histogram_quantile_over_a_grouped_rate() -> None:
    found = uses(
        'histogram_quantile(0.99, sum by (group, le) (rate(x_bucket{group=~"$group"}'
        "[$__rate_interval])))"
    )
    assert found.selectors == (Selector("x_bucket", (Matcher("group", "=~", "$group"),)),)
    assert found.grouping_labels == {"group", "le"}


def test_binary_operations_set_operations_and_offsets() -> None:
    found = uses(
        "sum by (job) (rate(a_total[5m]) and on (job, instance) b_info) / "
        "sum without (x) (c_total offset 1h) > bool 0.5 unless ignoring(y) d"
    )
    assert [s.metric for s in found.selectors] == ["a_total", "b_info", "c_total", "d"]
    assert found.grouping_labels == {"job", "instance", "x", "y"}


def test_group_is_a_label_and_an_aggregation() -> None:
    found = uses('group by (group) (m{group="a", outcome!~"x|y"})')
    assert found.selectors == (
        Selector("m", (Matcher("group", "=", "a"), Matcher("outcome", "!~", "x|y"))),
    )
    assert found.grouping_labels == {"group"}


def test_recording_rule_names_and_their_levels() -> None:
    (selector,) = uses("job_group:clockwork_requests_ok:rate5m > 0.1").selectors
    assert is_recording_rule_name(selector.metric)
    assert not is_recording_rule_name("clockwork_requests_total")
    assert level_labels(selector.metric) == {"job", "group"}


def test_literal_values_are_read_only_where_they_are_plain() -> None:
    assert Matcher("o", "=~", "ok|late").literal_values == ("ok", "late")
    assert Matcher("o", "!=", "ok").literal_values == ("ok",)
    assert Matcher("o", "=~", "$group").literal_values is None
    assert Matcher("o", "=~", "ok.*").literal_values is None


@pytest.mark.parametrize("expr", ['{__name__="x"}', "sum(x) # comment", 'x{a~"b"}'])
def test_what_it_cannot_read_raises(expr: str) -> None:
    with pytest.raises(PromQLError):
        uses(expr)
