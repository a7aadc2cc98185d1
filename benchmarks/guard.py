"""The guard for the runtime redesign (issue 25) and the core clean-up (issue 27): a recorded
baseline of what the simulator decides for every request of a fixed set of runs, and a check
that today's code still decides the same.

    python -m benchmarks.guard record [--only NAME[,NAME]] [--quick]   # rewrite the baseline
    python -m benchmarks.guard check  [--only NAME[,NAME]] [--quick]   # compare; exit 1 on a diff
    python -m benchmarks.guard check --dump DIR      # also write each run's rows as DIR/NAME.csv
    python -m benchmarks.guard check --against DIR   # rows from a --dump on the old code: show
                                                     # the first differing rows themselves

Invariants:
- A scenario is a pure function of its config and seed (the engine's promise, see
  `sim.engine`): the same code gives the same rows, byte for byte, on any machine with the
  same numpy (its random streams are part of the record; the baseline names the version).
- A row is ``request_id,outcome,batch_size,executor`` (``-`` where a request ran in no batch).
  Rows come from the engine's own per-request and per-action logs, handed in as in-memory
  writers: the engine is run unchanged, nothing here alters what the core decides.
- The digest is sha256 over the rows in request-id order; the baseline also keeps the outcome
  counts, the histogram of INFER batch sizes and one short digest per `BLOCK_REQUESTS` request
  ids, so a check names where the rows first differ without the baseline holding every row.
- ``--quick`` runs the cheaper scenarios only; the digests are the same as in a full run.
- The end-to-end part (daemon tests on simulated executors) lives in `benchmarks.guard_e2e`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import guard_e2e
from clockwork_async.sim.engine import SimConfig, Simulation, build_controller
from clockwork_async.sim.profiles import RESNET50_V100
from clockwork_async.sim.report import capacity_rps
from clockwork_async.sim.stats import ACTION_LOG_FIELDS, REQUEST_LOG_FIELDS
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import OpenLoop, bursty, poisson, trace_replay

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "benchmarks" / "guard_baseline.json"
AZURE_RELATIVE = Path("data/traces/azure-functions-2019-500/invocations.csv")
AZURE_CANDIDATES = (REPO.parent / "shared" / AZURE_RELATIVE, Path("/work/shared") / AZURE_RELATIVE)
CODE_FOLDERS = ("src", "executors")
BLOCK_REQUESTS = 1000  # request ids per block digest
SHORT_DIGEST_CHARS = 16
ROWS_SHOWN = 8  # differing rows printed per scenario
NO_BATCH = "-"
PROFILE = RESNET50_V100
CAPACITY_100MS_RPS = capacity_rps(PROFILE, 100_000_000)  # one executor, batch 16: 923 req/s

Row = tuple[int, str, str, str]  # request id, outcome, batch size, executor


@dataclass(frozen=True)
class Scenario:
    """One fixed run of the production core on simulated executors."""

    name: str
    workload: str  # poisson | bursty | azure (a sweep is one poisson scenario per SLO)
    rate_rps: float | None  # total offered load; None: the trace's own rates (azure)
    duration_s: float
    instances: int
    executors: int
    slo_ms: float = 100.0
    seed: int = 0
    preload: bool = False
    quick: bool = True  # part of ``--quick``
    burst_on_s: float = 1.0
    burst_off_s: float = 1.0
    policy: str = "clockwork"
    core: dict[str, Any] = field(default_factory=dict)  # ControllerConfig overrides

    def config(self) -> dict[str, Any]:
        """What the baseline records of it (a changed config is reported beside the result)."""
        config = {"profile": PROFILE.name, **asdict(self)}
        del config["quick"]  # which runs --quick picks; not part of the run
        return config


def _sweep(slos_ms: Sequence[float]) -> list[Scenario]:
    """The paper's SLO sweep, shortened: 48 resident copies on 6 executors at 2,400 req/s."""
    return [
        Scenario(f"sweep-{slo:g}ms", "poisson", 2400.0, 3.0, 48, 6, slo, seed=40 + i, preload=True)
        for i, slo in enumerate(slos_ms)
    ]


def _poisson_loads(fractions: Sequence[float]) -> list[Scenario]:
    """8 instances (cold at start) on 2 executors at a fraction of their capacity at 100 ms."""
    return [
        Scenario(
            f"poisson-{round(100 * fraction)}pct",
            "poisson",
            round(fraction * 2 * CAPACITY_100MS_RPS, 1),
            15.0,
            8,
            2,
            seed=10 + i,
        )
        for i, fraction in enumerate(fractions)
    ]


B1_MS = PROFILE.execute_ns[1] / 1e6
SCENARIOS: tuple[Scenario, ...] = (
    *_poisson_loads((0.3, 0.7, 1.0)),
    # Twice the capacity of one executor at 100 ms, 12 instances loaded on demand.
    Scenario("overload-2x", "poisson", 1846.0, 10.0, 12, 1, seed=20),
    Scenario("bursty", "bursty", 900.0, 15.0, 16, 2, seed=30, burst_on_s=0.5, burst_off_s=1.0),
    *_sweep([round(B1_MS * factor, 3) for factor in (1.5, 3.0, 10.0)]),
    # The same overload under the baseline policies of the core.
    Scenario("overload-2x-fifo", "poisson", 1846.0, 10.0, 12, 1, seed=20, policy="fifo"),
    Scenario("overload-2x-timeout", "poisson", 1846.0, 10.0, 12, 1, seed=20, policy="timeout"),
    # The Azure Functions sample, its first 3 minutes: 500 functions onto 61 x 66 instances (as
    # in the paper) on 2 executors, so that pages run short (evictions) and some are refused.
    Scenario("azure-3min", "azure", None, 180.0, 4026, 2, seed=50, quick=False),
)


# --- one run ------------------------------------------------------------------------------


class RowCollector:
    """The engine's request and action logs, in memory: one `Row` per reply, with the batch
    size of the INFER that carried it (actions are logged when they end, before their replies)."""

    _ACTION_ID = ACTION_LOG_FIELDS.index("action_id")
    _TYPE = ACTION_LOG_FIELDS.index("type")
    _BATCH = ACTION_LOG_FIELDS.index("batch_size")
    _REQUEST_ID = REQUEST_LOG_FIELDS.index("request_id")
    _OUTCOME = REQUEST_LOG_FIELDS.index("outcome")
    _EXECUTOR = REQUEST_LOG_FIELDS.index("executor")
    _REPLY_ACTION = REQUEST_LOG_FIELDS.index("action_id")

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self._batch_of: dict[int, int] = {}
        self.requests = _Writer(self._on_reply)
        self.actions = _Writer(self._on_action)

    def _on_action(self, values: Sequence[Any]) -> None:
        if values[self._TYPE] == "StartInfer":
            self._batch_of[values[self._ACTION_ID]] = values[self._BATCH]

    def _on_reply(self, values: Sequence[Any]) -> None:
        batch = self._batch_of.get(values[self._REPLY_ACTION])
        executor = values[self._EXECUTOR]
        self.rows.append(
            (
                values[self._REQUEST_ID],
                str(values[self._OUTCOME]),
                NO_BATCH if batch is None else str(batch),
                NO_BATCH if executor is None else str(executor),
            )
        )

    def sorted_rows(self) -> list[Row]:
        return sorted(self.rows)


class _Writer:
    """Stands in for `sim.stats.RecordWriter` (``write(*values)``, ``close()``)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def write(self, *values: Any) -> None:
        self._sink(values)

    def close(self) -> None:
        pass


@dataclass
class RunResult:
    """What one scenario gave: its rows and what the baseline keeps of them."""

    rows: list[Row]
    record: dict[str, Any]
    wall_s: float


def find_azure_sample(explicit: Path | None = None) -> Path | None:
    """The Azure sample's invocations CSV (../shared/data, see its PROVENANCE.md), or None."""
    for path in (explicit,) if explicit is not None else AZURE_CANDIDATES:
        if path is not None and path.is_file():
            return path
    return None


def build_workload(scenario: Scenario, azure: Path | None) -> OpenLoop:
    """The scenario's workload; raises FileNotFoundError for azure without the sample."""
    if scenario.workload == "poisson":
        assert scenario.rate_rps is not None
        return poisson(scenario.instances, scenario.rate_rps, scenario.duration_s)
    if scenario.workload == "bursty":
        assert scenario.rate_rps is not None
        return bursty(
            scenario.instances,
            scenario.rate_rps,
            scenario.duration_s,
            scenario.burst_on_s,
            scenario.burst_off_s,
        )
    if scenario.workload == "azure":
        if azure is None:
            raise FileNotFoundError("the Azure sample (../shared/data/traces/...) is absent")
        trace = read_azure_trace(azure, scenario.duration_s / 60.0)
        return trace_replay(TraceMapping(trace, scenario.instances), scenario.duration_s)
    raise ValueError(f"unknown workload {scenario.workload!r}")


def run_scenario(scenario: Scenario, azure: Path | None = None) -> RunResult:
    """Run one scenario on the production core; return its rows and its record."""
    workload = build_workload(scenario, azure)
    config = SimConfig(
        executors=scenario.executors,
        profile=PROFILE,
        slo_ns=round(scenario.slo_ms * 1e6),
        seed=scenario.seed,
        preload=scenario.preload,
        interval_ns=1_000_000_000,
    )
    collector = RowCollector()
    controller = build_controller(scenario.policy, scenario.core)
    wall_start = time.perf_counter()
    stats = Simulation(
        config,
        workload,
        controller,
        request_log=collector.requests,  # type: ignore[arg-type]
        action_log=collector.actions,  # type: ignore[arg-type]
    ).run()
    wall_s = time.perf_counter() - wall_start
    rows = collector.sorted_rows()
    record = digest_record(rows)
    record["infers_by_batch_size"] = {str(k): v for k, v in sorted(stats.batch_sizes.items())}
    record["lost"] = stats.lost
    record["violations"] = dict(sorted(stats.violations.items()))
    record["loads"], record["evictions"] = stats.loads, stats.evictions
    record["action_errors"] = dict(sorted(stats.action_errors.items()))
    return RunResult(rows, record, wall_s)


def row_text(row: Row) -> str:
    return f"{row[0]},{row[1]},{row[2]},{row[3]}\n"


def digest_record(rows: Iterable[Row]) -> dict[str, Any]:
    """sha256 of the rows (in the order given), outcome counts, rows per batch size, and one
    short digest per `BLOCK_REQUESTS` request ids (block ``i`` holds ids ``[i*B, (i+1)*B)``)."""
    whole = hashlib.sha256()
    blocks: dict[int, Any] = {}
    outcomes: Counter[str] = Counter()
    rows_by_batch: Counter[str] = Counter()
    count = 0
    for row in rows:
        data = row_text(row).encode()
        whole.update(data)
        block = blocks.setdefault(row[0] // BLOCK_REQUESTS, hashlib.sha256())
        block.update(data)
        outcomes[row[1]] += 1
        rows_by_batch[row[2]] += 1
        count += 1
    return {
        "requests": count,
        "digest": whole.hexdigest(),
        "outcomes": dict(sorted(outcomes.items())),
        "rows_by_batch_size": dict(sorted(rows_by_batch.items(), key=_batch_key)),
        "block_requests": BLOCK_REQUESTS,
        "blocks": {str(i): h.hexdigest()[:SHORT_DIGEST_CHARS] for i, h in sorted(blocks.items())},
    }


def _batch_key(item: tuple[str, int]) -> tuple[int, str]:
    return (int(item[0]) if item[0].isdigit() else -1, item[0])


# --- comparing ----------------------------------------------------------------------------


COMPARED = ("requests", "lost", "violations", "loads", "evictions")
HISTOGRAMS = ("outcomes", "infers_by_batch_size", "rows_by_batch_size", "action_errors")


def differences(
    old: dict[str, Any], new: dict[str, Any], rows: list[Row], old_rows: list[Row] | None
) -> list[str]:
    """Lines describing how ``new`` differs from the recorded ``old`` (empty: identical).
    Counts are compared even when the rows agree: a second reply to a request, say, is no
    row but is counted in ``violations``."""
    lines = []
    if old["digest"] != new["digest"]:
        lines.append(f"digest {old['digest'][:16]} -> {new['digest'][:16]}")
    for key in COMPARED:
        if old.get(key) != new.get(key):
            lines.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    for key in HISTOGRAMS:
        delta = histogram_delta(old.get(key, {}), new.get(key, {}))
        if delta:
            lines.append(f"{key} (new - old): {delta}")
    if old["digest"] == new["digest"]:
        return lines
    changed = [
        int(i)
        for i in sorted(set(old["blocks"]) | set(new["blocks"]), key=int)
        if old["blocks"].get(i) != new["blocks"].get(i)
    ]
    lines.append(f"{len(changed)} of {len(new['blocks'])} blocks of {BLOCK_REQUESTS} ids differ")
    lines += _row_lines(changed, rows, old_rows)
    return lines


def histogram_delta(old: dict[str, int], new: dict[str, int]) -> dict[str, int]:
    keys = sorted(set(old) | set(new))
    return {k: new.get(k, 0) - old.get(k, 0) for k in keys if new.get(k, 0) != old.get(k, 0)}


def _row_lines(changed: list[int], rows: list[Row], old_rows: list[Row] | None) -> list[str]:
    """The first differing rows: exact when the old rows are at hand (``--against``), else
    the new rows of the first differing block."""
    if not changed:
        return []
    if old_rows is not None:
        return _row_diff(rows, old_rows)
    first = changed[0]
    block = [r for r in rows if r[0] // BLOCK_REQUESTS == first][:ROWS_SHOWN]
    lines = [f"first differing block: ids {first * BLOCK_REQUESTS}..; its first rows now:"]
    lines += ["  " + row_text(row).strip() for row in block]
    lines.append("  (dump the old code's rows with --dump DIR and rerun with --against DIR)")
    return lines


def _row_diff(rows: list[Row], old_rows: list[Row]) -> list[str]:
    old_by_id = {row[0]: row for row in old_rows}
    new_by_id = {row[0]: row for row in rows}
    lines = []
    for request_id in sorted(set(old_by_id) | set(new_by_id)):
        old, new = old_by_id.get(request_id), new_by_id.get(request_id)
        if old != new:
            lines.append(f"  id {request_id}: {_show(old)} -> {_show(new)}")
            if len(lines) >= ROWS_SHOWN:
                break
    return lines


def _show(row: Row | None) -> str:
    return "absent" if row is None else ",".join(str(v) for v in row[1:])


def read_rows(path: Path) -> list[Row]:
    with path.open(newline="") as stream:
        return [(int(r[0]), r[1], r[2], r[3]) for r in csv.reader(stream)]


def write_rows(path: Path, rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as stream:
        stream.writelines(row_text(row) for row in rows)


# --- the verbs ----------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        found = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
        )
        return found.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def code_commit() -> str:
    """The last commit that changed the code under test (src/, executors/), ``+changes`` when
    those folders hold uncommitted changes: what a recorded baseline stands for."""
    commit = _git("log", "-1", "--format=%h", "--abbrev=12", "--", *CODE_FOLDERS)
    dirty = _git("status", "--porcelain", "--", *CODE_FOLDERS)
    return commit + ("+changes" if dirty else "")


E2E = "e2e"  # the name that picks the end-to-end part in ``--only``


def chosen_scenarios(only: str | None, quick: bool) -> list[Scenario]:
    """Scenarios named by ``only`` (comma-separated names; a name that is no scenario's picks
    every scenario it begins, e.g. ``sweep``), else all (the quick ones with ``quick``).
    Raises SystemExit on a name that matches nothing."""
    if not only:
        return [s for s in SCENARIOS if s.quick or not quick]
    picked = []
    for name in only.split(","):
        matches = [s for s in SCENARIOS if s.name == name] or [
            s for s in SCENARIOS if s.name.startswith(name)
        ]
        if not matches and name != E2E:
            names = ", ".join([s.name for s in SCENARIOS] + [E2E])
            raise SystemExit(f"guard: no scenario {name!r} (scenarios: {names})")
        picked += [s for s in matches if s not in picked]
    return picked


def e2e_chosen(only: str | None) -> bool:
    return not only or E2E in only.split(",")


def load_baseline(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"scenarios": {}}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def save_baseline(path: Path, baseline: dict[str, Any]) -> None:
    path.write_text(json.dumps(baseline, indent=1, sort_keys=False) + "\n")


def _progress(text: str) -> None:
    print(f"guard: {text}", file=sys.stderr, flush=True)


def _run_all(
    scenarios: list[Scenario], azure: Path | None, dump: Path | None
) -> dict[str, RunResult | str]:
    """Each scenario's outcome, or the reason it was skipped (printed as it goes)."""
    found: dict[str, RunResult | str] = {}
    for index, scenario in enumerate(scenarios, start=1):
        head = f"[{index}/{len(scenarios)}] {scenario.name}"
        if scenario.workload == "azure" and azure is None:
            found[scenario.name] = "skipped: the Azure sample is absent (../shared/data)"
            _progress(f"{head}: {found[scenario.name]}")
            continue
        _progress(f"{head}: running ({scenario.duration_s:g} s simulated)")
        outcome = run_scenario(scenario, azure)
        found[scenario.name] = outcome
        _progress(
            f"{head}: {outcome.record['requests']:,} requests, {outcome.record['outcomes']} "
            f"in {outcome.wall_s:.1f} s wall"
        )
        if dump is not None:
            write_rows(dump / f"{scenario.name}.csv", outcome.rows)
    return found


def record(args: argparse.Namespace) -> int:
    baseline = load_baseline(args.baseline)
    scenarios = chosen_scenarios(args.only, args.quick)
    found = _run_all(scenarios, find_azure_sample(args.azure), args.dump)
    kept = baseline.setdefault("scenarios", {})
    for scenario in scenarios:
        outcome = found[scenario.name]
        if isinstance(outcome, RunResult):
            kept[scenario.name] = {"config": scenario.config(), **outcome.record}
    if scenarios:
        baseline["simulator"] = {"commit": code_commit(), "numpy": np.__version__}
    order = [s.name for s in SCENARIOS] + sorted(set(kept) - {s.name for s in SCENARIOS})
    baseline["scenarios"] = {name: kept[name] for name in order if name in kept}
    if e2e_chosen(args.only):
        baseline[E2E] = {"commit": code_commit(), **guard_e2e.record_runs(args.e2e_runs, _progress)}
    save_baseline(args.baseline, baseline)
    parts = f"{len(scenarios)} scenario(s)" + (
        " and the e2e tests" if e2e_chosen(args.only) else ""
    )
    _progress(f"recorded {parts} into {args.baseline}")
    return 0


def check(args: argparse.Namespace) -> int:
    baseline = load_baseline(args.baseline)
    recorded = baseline.get("scenarios", {})
    scenarios = chosen_scenarios(args.only, args.quick)
    wall_start = time.perf_counter()
    found = _run_all(scenarios, find_azure_sample(args.azure), args.dump)
    e2e = _check_e2e(baseline.get(E2E)) if e2e_chosen(args.only) else None
    failed = 0
    print(f"guard check against {args.baseline.name} (simulator: {baseline.get('simulator')}):")
    for scenario in scenarios:
        verdict = _verdict(scenario, found[scenario.name], recorded.get(scenario.name), args)
        failed += verdict[0]
        print(f"  {scenario.name}: {verdict[1]}")
        for line in verdict[2]:
            print(f"      {line}")
    if e2e is not None:
        print(f"  e2e (recorded at {baseline.get(E2E, {}).get('commit')}): {e2e[1][0]}")
        for line in e2e[1][1:]:
            print(f"      {line}")
    parts = (
        [f"{len(scenarios) - failed} of {len(scenarios)} scenarios identical"] if scenarios else []
    )
    if e2e is not None:
        parts.append(f"e2e {'identical' if e2e[0] else 'DIFFERENT'}")
    print(f"guard: {'; '.join(parts)} ({time.perf_counter() - wall_start:.0f} s wall)")
    return 1 if failed or (e2e is not None and not e2e[0]) else 0


def _check_e2e(recorded: dict[str, Any] | None) -> tuple[bool, list[str]]:
    if recorded is None:
        return False, ["DIFFERENT: not in the baseline (record it: record --only e2e)"]
    return guard_e2e.compare(recorded, _progress)


def _verdict(
    scenario: Scenario,
    outcome: RunResult | str,
    old: dict[str, Any] | None,
    args: argparse.Namespace,
) -> tuple[int, str, list[str]]:
    """(1 if it fails, the word, detail lines) for one scenario."""
    if isinstance(outcome, str):
        return 0, outcome, []
    if old is None:
        return 1, "DIFFERENT: not in the baseline (record it)", []
    notes = []
    if old.get("config") != scenario.config():
        notes.append(f"config changed: {old.get('config')} -> {scenario.config()}")
    old_rows = None
    if args.against is not None and (args.against / f"{scenario.name}.csv").exists():
        old_rows = read_rows(args.against / f"{scenario.name}.csv")
    lines = differences(old, outcome.record, outcome.rows, old_rows)
    if not lines:
        return 0, "identical", notes
    return 1, "DIFFERENT", notes + lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.guard",
        description="Record or check the simulator's per-request outcomes (the redesign guard).",
    )
    parser.add_argument("verb", choices=("record", "check", "list"))
    only_help = f"scenario names or prefixes, comma-separated ({E2E}: the end-to-end part)"
    parser.add_argument("--only", help=only_help)
    parser.add_argument("--quick", action="store_true", help="the cheaper scenarios only")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--azure", type=Path, help="the Azure sample (default: ../shared/data)")
    parser.add_argument("--dump", type=Path, help="write each run's rows as DIR/NAME.csv")
    parser.add_argument("--against", type=Path, help="rows from a --dump, to show row diffs")
    runs_help = "record: runs of the e2e tests (a test is stable when all agree)"
    parser.add_argument("--e2e-runs", type=int, default=guard_e2e.RECORD_RUNS, help=runs_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb == "list":
        for scenario in SCENARIOS:
            print(f"{scenario.name:<20} {json.dumps(scenario.config())}")
        print(f"{E2E:<20} {' '.join(guard_e2e.TEST_FILES)}")
        return 0
    return record(args) if args.verb == "record" else check(args)


if __name__ == "__main__":
    sys.exit(main())
