"""Experiment 3 of the Clockwork paper, thousands of models, in virtual time on the production
core:

    python -m benchmarks.thousands [--quick] [--policies clockwork,fifo,timeout] [--docs]

3,600 ResNet50 (V100 profile) instances on one simulated executor share 1,000 req/s at a
100 ms SLO; instance i becomes active at i x step, and the rate is split evenly over the
active ones (`sim.workloads.ramp`). Full mode: one more every second, 3,600 s of virtual time
(the paper's setup). Quick mode: compressed as `sim_scenarios` (a): one more every 15 ms, all
active within 54 s, 60 s in all. The executor holds 196 copies (1,376 pages of 16 MiB, 7 per
copy); the rest must be loaded (8.3 ms each) when asked for.

Reports, over time (per window and as plots): offered and ok rate, cold starts per second
(requests whose model was resident nowhere at arrival), LOADs and UNLOADs per second, ok
latency p50/p99/max, resident copies; over the run: outcomes (rejected by reason, dropped,
late, lost), ok/accepted and ok/requests. Goals: late == 0 and lost == 0.

Writes ``results/thousands[-quick].json`` and ``results/thousands[-quick]-timeline.png``;
``--docs`` copies the PNG to ``docs/img/exp3-...``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    POLICIES,
    RESULTS,
    copy_to_docs,
    load_average,
    machine_description,
    percent,
    plot_panels,
    pyplot,
    rejected_text,
    table,
    write_json,
)
from benchmarks.lib.sim import Row, Series, interval_for, run_sim, windows
from clockwork_async.sim.workloads import ramp

SLO_MS = 100.0


@dataclass(frozen=True)
class Plan:
    instances: int = 3600
    rate_rps: float = 1000.0
    step_s: float = 1.0
    duration_s: float = 3600.0
    executors: int = 1
    windows: int = 12


FULL = Plan()
QUICK = Plan(step_s=0.015, duration_s=60.0)


def active_models(series: Series, plan: Plan) -> list[float]:
    """Active instances at the end of each interval (``ramp``: instance i from i x step)."""
    interval_s = series["time_s"][1] - series["time_s"][0] if len(series["time_s"]) > 1 else 1.0
    return [
        float(min(plan.instances, int((t + interval_s) / plan.step_s) + 1))
        for t in series["time_s"]
    ]


def run_policy(plan: Plan, policy: str) -> Row:
    workload = ramp(plan.instances, plan.rate_rps, plan.duration_s, plan.step_s)
    print(f"thousands: {policy}, load {load_average()[0]}", file=sys.stderr, flush=True)
    run = run_sim(
        workload,
        executors=plan.executors,
        slo_ms=SLO_MS,
        policy=policy,
        interval_ns=interval_for(plan.duration_s, 360),
    )
    series = run.series
    series["active_models"] = active_models(series, plan)
    edges = [plan.duration_s * k / plan.windows for k in range(plan.windows + 1)]
    found = windows(series, edges)
    for row in found:
        row["active_models"] = min(plan.instances, int(row["to_s"] / plan.step_s))
    print(
        f"thousands: {policy} done in {run.summary['wall_seconds']:.1f} s wall "
        f"({run.summary['speedup']}x real time)",
        file=sys.stderr,
        flush=True,
    )
    return {"policy": policy, "summary": run.summary, "windows": found, "series": series}


def goals(runs: list[Row]) -> Row:
    """late, lost and violations of the `clockwork` runs (the baselines make no promise)."""
    ours = [run["summary"] for run in runs if run["policy"] == "clockwork"]
    return {
        "late": sum(s["late"] for s in ours),
        "lost": sum(s["lost"] for s in ours),
        "violations": [s["violations"] for s in ours],
    }


# --- reporting -----------------------------------------------------------------------------------


def totals_table(runs: list[Row]) -> str:
    headers = ["policy", "requests", "ok", "rejected", "dropped", "late", "lost", "ok/acc %"]
    headers += ["ok/req %", "cold starts", "cold ok %", "loads", "unloads", "p50 ms", "p99 ms"]
    headers += ["wall s"]
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append(
            [
                run["policy"],
                s["requests"],
                s["ok"],
                rejected_text(s["rejected"]),
                s["dropped"],
                s["late"],
                s["lost"],
                percent(s["ok_over_accepted"], 4),
                percent(s["ok_over_requests"], 2),
                s["cold_starts"],
                percent(s["cold_arrivals"]["ok_share"], 2),
                s["loads"],
                s["evictions"],
                s["latency_ms"]["p50"],
                s["latency_ms"]["p99"],
                s["wall_seconds"],
            ]
        )
    return table(headers, rows)


def windows_table(run: Row) -> str:
    headers = ["window s", "active", "offered/s", "ok/s", "rejected/s", "cold/s", "cold ok/s"]
    headers += ["loads/s"]
    headers += ["unloads/s", "max p50 ms", "max p99 ms", "max ms", "resident"]
    rows = []
    for row in run["windows"]:
        rows.append(
            [
                f"{row['from_s']:g}-{row['to_s']:g}",
                row["active_models"],
                row["offered_rps"],
                row["goodput_rps"],
                row.get("infeasible_per_s", 0.0),
                row["cold_starts_per_s"],
                row["cold_ok_per_s"],
                row["loads_per_s"],
                row["unloads_per_s"],
                row["p50_ms"],
                row["p99_ms"],
                row["max_ms"],
                int(row["resident_models"]),
            ]
        )
    return table(headers, rows)


def write_plots(runs: list[Row], out: Path, stem: str) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for run in runs:
        suffix = "" if run["policy"] == "clockwork" else f"-{run['policy']}"
        panels = [
            ("req/s", ("offered_rps", "goodput_rps", "infeasible_per_s", "dropped_per_s")),
            ("per s", ("cold_starts_per_s", "cold_ok_per_s", "loads_per_s", "unloads_per_s")),
            ("ok latency (ms)", ("p50_ms", "p99_ms", "max_ms")),
            ("models", ("active_models", "resident_models")),
        ]
        title = f"3,600 models, 1,000 req/s, 1 executor ({run['policy']})"
        path = out / f"{stem}-timeline{suffix}.png"
        paths.append(plot_panels(plt, run["series"], panels, title, path, slo_ms=SLO_MS))
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="compressed ramp, 60 s virtual")
    parser.add_argument("--policies", default="clockwork", help="comma-separated policies")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--docs", action="store_true", help="copy the PNGs to docs/img/exp3-*")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"policies must be among {', '.join(POLICIES)}")
    plan = QUICK if args.quick else FULL
    machine = machine_description()
    runs = [run_policy(plan, policy) for policy in policies]
    stem = "thousands-quick" if args.quick else "thousands"
    result: dict[str, Any] = {
        "experiment": "3: thousands of models",
        "quick": args.quick,
        "plan": asdict(plan),
        "slo_ms": SLO_MS,
        "machine": machine,
        "load_average_end": load_average(),
        "goals": goals(runs),
        "runs": runs,
    }
    plots = write_plots(runs, args.out, stem)
    result["plots"] = [str(p) for p in plots]
    if args.docs:
        result["docs_plots"] = [str(p) for p in copy_to_docs(plots, "exp3")]
    write_json("thousands", args.quick, result, args.out)
    print(totals_table(runs))
    for run in runs:
        print(f"\n{run['policy']}, per window:")
        print(windows_table(run))
    print(f"\ngoals of the clockwork policy (late 0, lost 0): {result['goals']}")
    met = result["goals"]["late"] == 0 and result["goals"]["lost"] == 0
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
