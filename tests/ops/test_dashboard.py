"""The Grafana dashboard has the structure Grafana loads: panels with a type, a place on the
24-column grid and Prometheus targets through the ``datasource`` variable; unique ids; every
variable it uses defined; recording rules it draws defined in the rules file."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .kit import dashboard, dashboard_queries, panels, recording_rules, rules
from .promql import is_recording_rule_name, level_labels, uses

PANEL_TYPES = frozenset({"row", "timeseries", "stat", "heatmap"})
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
BUILTIN_VARIABLES = frozenset({"__rate_interval", "__interval", "__range"})
GRID_COLUMNS = 24
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    return dashboard()


def variables_used(text: str) -> set[str]:
    return {braced or bare for braced, bare in VARIABLE.findall(text)}


def test_the_dashboard_is_a_grafana_model(model: dict[str, Any]) -> None:
    assert model["uid"] and model["title"]
    assert 36 <= model["schemaVersion"] <= 41
    assert isinstance(model["panels"], list) and model["panels"]
    assert {"from", "to"} <= set(model["time"])


def test_variables_are_a_prometheus_datasource_and_model_groups(model: dict[str, Any]) -> None:
    by_name = {variable["name"]: variable for variable in model["templating"]["list"]}
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    group = by_name["group"]
    assert group["type"] == "query" and group["datasource"] == DATASOURCE
    assert group["query"]["query"] == "label_values(clockwork_requests_total, group)"
    assert group["includeAll"] and group["multi"] and group["allValue"] == ".*"


def test_every_panel_has_a_type_a_place_and_a_unique_id(model: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in panels(model)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    titles = [panel["title"] for panel in panels(model)]
    assert len(titles) == len(set(titles))
    for panel in panels(model):
        assert panel["type"] in PANEL_TYPES, panel["title"]
        place = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(place), panel["title"]
        assert all(isinstance(place[k], int) and place[k] >= 0 for k in "hwxy")
        assert place["w"] > 0 and place["h"] > 0
        assert place["x"] + place["w"] <= GRID_COLUMNS, panel["title"]


def test_panels_do_not_overlap(model: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in panels(model):
        place = panel["gridPos"]
        for x in range(place["x"], place["x"] + place["w"]):
            for y in range(place["y"], place["y"] + place["h"]):
                assert (x, y) not in taken, (panel["title"], taken.get((x, y)))
                taken[(x, y)] = panel["title"]


def test_rows_hold_nothing_when_expanded_and_other_panels_query_prometheus(
    model: dict[str, Any],
) -> None:
    for panel in panels(model):
        if panel["type"] == "row":
            assert panel["collapsed"] or panel["panels"] == [], panel["title"]
            assert "targets" not in panel
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
            assert (target.get("format") == "heatmap") == (panel["type"] == "heatmap")


def test_every_variable_used_is_defined(model: dict[str, Any]) -> None:
    defined = {variable["name"] for variable in model["templating"]["list"]}
    for query in dashboard_queries(model):
        used = variables_used(query.expr)
        assert used <= defined | BUILTIN_VARIABLES, (query.where, used)
    for panel in panels(model):
        assert variables_used(str(panel.get("datasource", ""))) <= defined


def test_recording_rules_it_draws_exist_with_the_labels_it_uses(model: dict[str, Any]) -> None:
    recorded = recording_rules(rules())
    drawn = set()
    for query in dashboard_queries(model):
        found = uses(query.expr)
        for selector in found.selectors:
            if is_recording_rule_name(selector.metric):
                drawn.add(selector.metric)
                assert selector.metric in recorded, query.where
                labels = {matcher.label for matcher in selector.matchers}
                assert labels <= level_labels(selector.metric), query.where
    assert drawn, "the ratios come from recording rules"
