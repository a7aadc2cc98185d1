"""The redesign guard (`benchmarks.guard`): its digest is a pure function of a run, changes
with any row, and its baseline covers today's scenario list as configured."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is not an installed package
    from benchmarks import guard

    return guard


@pytest.fixture
def guard_e2e(guard: ModuleType) -> ModuleType:
    from benchmarks import guard_e2e

    return guard_e2e


def tiny(guard: ModuleType) -> object:
    return guard.Scenario("tiny", "poisson", 400.0, 1.0, 3, 1, slo_ms=20.0, seed=7)


def test_a_scenario_gives_the_same_rows_and_digest_twice(guard: ModuleType) -> None:
    first, second = guard.run_scenario(tiny(guard)), guard.run_scenario(tiny(guard))
    assert first.rows == second.rows
    assert first.record == second.record
    assert first.record["requests"] == len(first.rows) > 100
    assert [row[0] for row in first.rows] == list(range(len(first.rows)))  # one row per id
    assert {row[2] for row in first.rows if row[1] == "ok"} <= {"1", "2", "4", "8", "16"}
    assert {row[3] for row in first.rows if row[1] == "ok"} == {"e0"}


def test_a_changed_row_changes_the_digest_and_is_reported(guard: ModuleType) -> None:
    result = guard.run_scenario(tiny(guard))
    rows = list(result.rows)
    request_id, _, _, _ = rows[5]
    rows[5] = (request_id, "dropped", "-", "-")
    changed = guard.digest_record(rows)
    assert changed["digest"] != result.record["digest"]
    old = {**result.record}
    lines = guard.differences(old, changed, rows, result.rows)
    assert any(line.startswith("outcomes (new - old):") for line in lines)
    assert "1 of 1 blocks of 1000 ids differ" in lines
    assert any(f"id {request_id}: ok," in line and "-> dropped,-,-" in line for line in lines)
    assert guard.differences(result.record, result.record, result.rows, None) == []
    twice = {**result.record, "violations": {"second_reply": 1}}  # no row, but counted
    assert guard.differences(result.record, twice, result.rows, None) == [
        "violations: {} -> {'second_reply': 1}"
    ]


def test_the_baseline_holds_every_scenario_as_configured_now(guard: ModuleType) -> None:
    recorded = json.loads(guard.BASELINE.read_text())["scenarios"]
    for scenario in guard.SCENARIOS:
        assert recorded[scenario.name]["config"] == scenario.config(), scenario.name


def test_e2e_tests_are_stable_only_when_every_run_agrees(guard_e2e: ModuleType) -> None:
    same = {"result": "passed", "replies": {"ok": 3}}
    runs = [
        {"a": same, "b": {"result": "passed", "replies": {"ok": 2, "late": 1}}},
        {"a": same, "b": {"result": "passed", "replies": {"ok": 3}}},
        {"a": same, "c": {"result": "failed", "replies": {}}},
    ]
    merged = guard_e2e.merge_runs(runs)
    assert merged["a"] == {"stable": True, "result": "passed", "replies": {"ok": 3}}
    assert merged["b"]["stable"] is False and merged["b"]["result"] == "varies"
    assert merged["b"]["replies_seen"] == [{"ok": 2, "late": 1}, {"ok": 3}, {}]
    assert merged["c"]["result"] == "varies"  # absent in two runs
