"""The Prometheus rules: `promtool check rules` is clean, `promtool test rules` shows each alert
firing on the series it is for (tests/ops/rules_test.yml), and every alert has a severity, a
summary and a runbook section in docs/operations.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .kit import ROOT, RULES, alerts, recording_rules, rules
from .promql import is_recording_rule_name, level_labels, uses

OPERATIONS_DOC = ROOT / "docs" / "operations.md"
RULES_TEST = Path(__file__).with_name("rules_test.yml")
SEVERITIES = frozenset({"critical", "warning"})

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (Debian: apt-get install prometheus)",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def loaded() -> dict[str, Any]:
    return rules()


@needs_promtool
def test_promtool_check_rules_is_clean() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_fire_each_alert() -> None:
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_unit_tested_firing(loaded: dict[str, Any]) -> None:
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert fired == set(alerts(loaded))


def runbook_anchors() -> set[str]:
    """GitHub's anchors of the docs' headings: lower case, spaces to dashes, punctuation out."""
    text = re.sub(r"^```.*?^```", "", OPERATIONS_DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_every_alert_has_a_severity_a_summary_and_a_runbook(loaded: dict[str, Any]) -> None:
    anchors = runbook_anchors()
    for name, rule in alerts(loaded).items():
        assert name.startswith("Clockwork"), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        document, _, anchor = notes["runbook_url"].partition("#")
        assert document == "docs/operations.md" and anchor == name.lower(), name
        assert anchor in anchors, f"no section {name} in docs/operations.md"


def test_recording_rules_are_named_by_the_labels_they_keep(loaded: dict[str, Any]) -> None:
    # level:metric:operations; a rule aggregating with `sum by` keeps exactly its level's
    # labels, and rules built on rules use only rules defined before them.
    seen: set[str] = set()
    for name, expr in recording_rules(loaded).items():
        assert is_recording_rule_name(name) and name.count(":") == 2, name
        found = uses(expr)
        aggregated = re.match(r"sum by \(([\w, ]+)\)", expr)
        if aggregated:
            kept = {label.strip() for label in aggregated[1].split(",")}
            assert kept == level_labels(name), name
        for selector in found.selectors:
            if is_recording_rule_name(selector.metric):
                assert selector.metric in seen, (name, selector.metric)
                assert level_labels(selector.metric) >= level_labels(name), name
        seen.add(name)
