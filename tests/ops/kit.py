"""The operators' kit as data: the Grafana dashboard's queries and the Prometheus rules'
expressions, each with where it comes from, for the tests that check them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "clockwork-async.json"
RULES = ROOT / "packaging" / "prometheus" / "clockwork-async.rules.yml"
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+),\s*(?P<label>\w+)\)")


@dataclass(frozen=True, slots=True)
class Query:
    where: str  # "panel 3 'Goodput' A", "rule job_group:...", "alert ClockworkDaemonDown"
    expr: str
    legend: str = ""


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def rules() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return loaded


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in collapsed rows too."""
    for panel in model["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(model: dict[str, Any]) -> Iterator[Query]:
    for panel in panels(model):
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel['title']!r} {target['refId']}"
            yield Query(where, target["expr"], target.get("legendFormat", ""))


def variable_queries(model: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(selector, label) of each ``label_values(selector, label)`` variable."""
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.fullmatch(variable["query"]["query"])
            assert match, variable["query"]
            yield match["selector"], match["label"]


def recording_rules(loaded: dict[str, Any]) -> dict[str, str]:
    """Recorded name -> expression."""
    return {
        rule["record"]: rule["expr"]
        for group in loaded["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def alerts(loaded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        rule["alert"]: rule
        for group in loaded["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def rule_queries(loaded: dict[str, Any]) -> Iterator[Query]:
    for name, expr in recording_rules(loaded).items():
        yield Query(f"rule {name}", expr)
    for name, rule in alerts(loaded).items():
        yield Query(f"alert {name}", rule["expr"])
