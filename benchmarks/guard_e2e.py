"""The guard's end-to-end part: the daemon's tests with simulated executors, run under
`benchmarks.guard_plugin`, which records for each test its result and the outcomes of the
replies its clients received.

Invariants:
- Real time makes some of these tests' outcomes vary (how many requests make a 0.5 ms SLO, say).
  ``record`` runs the tests `RECORD_RUNS` times; a test whose result and reply outcomes (a
  multiset) agree in every run is *stable* and checked for identity; the others are reported
  with their counts only, and their pass/fail is still checked when it never varied.
- ``check`` runs the tests once; a stable test that differs is run once more alone, and fails
  the check only when it differs again (a one-off is printed as such, never hidden).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TEST_FILES = (
    "tests/e2e/test_daemon_sim.py",
    "tests/runtime/test_driver_sim.py",
    "tests/e2e/test_daemon_inprocess.py",
)
RECORD_RUNS = 3
PYTEST_TIMEOUT_S = 600.0

Progress = Callable[[str], None]
TestRecord = dict[str, Any]  # {"result": "passed" | ..., "replies": {outcome: count}}


def run_tests(node_ids: Sequence[str] = TEST_FILES) -> dict[str, Any]:
    """Run pytest on ``node_ids`` under the guard's plugin; returns the plugin's record.
    Raises RuntimeError when pytest wrote no record (it could not start, or crashed)."""
    with tempfile.TemporaryDirectory(prefix="guard-e2e-") as folder:
        out = Path(folder) / "record.json"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        argv += ["-p", "benchmarks.guard_plugin", "--guard-out", str(out), *node_ids]
        finished = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S
        )
        if not out.exists():
            tail = (finished.stdout + finished.stderr)[-2000:]
            raise RuntimeError(f"pytest left no record (status {finished.returncode}):\n{tail}")
        record: dict[str, Any] = json.loads(out.read_text())
    return record


def record_runs(runs: int, progress: Progress) -> dict[str, Any]:
    """Run the tests ``runs`` times; return the baseline's ``e2e`` section."""
    seen: list[dict[str, Any]] = []
    for index in range(1, runs + 1):
        progress(f"e2e run {index}/{runs}: {' '.join(TEST_FILES)}")
        seen.append(run_tests())
        progress(f"e2e run {index}/{runs}: {summary_line(seen[-1])}")
    return {
        "files": list(TEST_FILES),
        "runs": runs,
        "missing_hooks": sorted({h for run in seen for h in run["missing_hooks"]}),
        "tests": merge_runs([run["tests"] for run in seen]),
    }


def merge_runs(runs: Sequence[dict[str, TestRecord]]) -> dict[str, Any]:
    """Per test: stable (same result and replies in every run) with its one record, or
    unstable with every distinct record seen (and its result, when that never varied)."""
    merged: dict[str, Any] = {}
    for node_id in sorted({node_id for run in runs for node_id in run}):
        records = [run.get(node_id, {"result": "absent", "replies": {}}) for run in runs]
        distinct = _distinct(records)
        results = {r["result"] for r in records}
        entry: dict[str, Any] = {"stable": len(distinct) == 1}
        entry["result"] = results.pop() if len(results) == 1 else "varies"
        if entry["stable"]:
            entry["replies"] = distinct[0]["replies"]
        else:
            entry["replies_seen"] = [r["replies"] for r in distinct]
        merged[node_id] = entry
    return merged


def _distinct(records: Sequence[TestRecord]) -> list[TestRecord]:
    found: list[TestRecord] = []
    for record in records:
        if record not in found:
            found.append(record)
    return found


def summary_line(run: dict[str, Any]) -> str:
    results: dict[str, int] = {}
    for test in run["tests"].values():
        results[test["result"]] = results.get(test["result"], 0) + 1
    replies = sum(sum(test["replies"].values()) for test in run["tests"].values())
    hooks = f", hooks missing: {run['missing_hooks']}" if run["missing_hooks"] else ""
    return f"{len(run['tests'])} tests {results}, {replies} replies recorded{hooks}"


def compare(baseline: dict[str, Any], progress: Progress) -> tuple[bool, list[str]]:
    """Run the tests once and compare with the recorded ``e2e`` section; returns (identical,
    report lines)."""
    progress(f"e2e: running {' '.join(TEST_FILES)}")
    run = run_tests(baseline.get("files", TEST_FILES))
    progress(f"e2e: {summary_line(run)}")
    tests: dict[str, TestRecord] = run["tests"]
    recorded: dict[str, Any] = baseline["tests"]
    lines: list[str] = (
        [f"hooks missing now: {run['missing_hooks']}"] if run["missing_hooks"] else []
    )
    failed = bool(run["missing_hooks"]) and not baseline.get("missing_hooks")
    suspects = []
    for node_id in sorted(set(tests) | set(recorded)):
        old, new = recorded.get(node_id), tests.get(node_id)
        problem = _test_difference(old, new)
        if problem is not None:
            failed = True
            lines.append(f"DIFFERENT {node_id}: {problem}")
        elif old and new and old["stable"] and new["replies"] != old["replies"]:
            suspects.append(node_id)
    retried_failed, retried_lines = _retry(suspects, recorded, progress)
    failed = failed or retried_failed
    lines += retried_lines
    lines += _unstable_lines(recorded, tests)
    stable = sum(1 for node_id in recorded if recorded[node_id]["stable"])
    lines.insert(0, f"{len(tests)} tests run; {stable} recorded stable; " + _verdict(failed))
    return not failed, lines


def _verdict(failed: bool) -> str:
    return "DIFFERENT" if failed else "identical (pass/fail of all, replies of the stable)"


def _test_difference(old: dict[str, Any] | None, new: TestRecord | None) -> str | None:
    """Why a test differs in its presence or its pass/fail, or None."""
    if old is None:
        return f"not in the baseline (now {new['result'] if new else '?'})"
    if new is None:
        return "in the baseline, not run now (removed or renamed?)"
    if old["result"] != "varies" and new["result"] != old["result"]:
        return f"{old['result']} -> {new['result']} (replies now {new['replies']})"
    return None


def _retry(
    suspects: list[str], recorded: dict[str, Any], progress: Progress
) -> tuple[bool, list[str]]:
    """Run stable tests whose replies differed once more; (any differed again, lines)."""
    if not suspects:
        return False, []
    progress(f"e2e: {len(suspects)} stable test(s) differed; running them once more")
    again = run_tests(suspects)["tests"]
    failed, lines = False, []
    for node_id in suspects:
        old = recorded[node_id]["replies"]
        new = again.get(node_id, {}).get("replies")
        if new == old:
            lines.append(f"one-off {node_id}: differed once, identical on a rerun")
        else:
            failed = True
            lines.append(f"DIFFERENT {node_id}: replies {old} -> {new} (twice)")
    return failed, lines


def _unstable_lines(recorded: dict[str, Any], tests: dict[str, TestRecord]) -> list[str]:
    lines = []
    for node_id, old in sorted(recorded.items()):
        if not old["stable"] and node_id in tests:
            seen = "; ".join(json.dumps(r, sort_keys=True) for r in old["replies_seen"])
            now = json.dumps(tests[node_id]["replies"], sort_keys=True)
            lines.append(f"varies {node_id.split('::')[-1]}: recorded {seen}; now {now}")
    return lines
