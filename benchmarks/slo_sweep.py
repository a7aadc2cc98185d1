"""Experiment 2 of the paper, "how low can the SLO go": goodput and latency as the SLO grows from
1x the batch-1 execute time to 100x, for the `clockwork`, `fifo` and `timeout` policies.

    python -m benchmarks.slo_sweep [--quick] [--only real,sim] [--json OUT]

Real time: the ``resnet-like`` demo model on the daemon's default executors (one ONNX Runtime
executor pinned to CPU 1, the controller pinned to CPU 0), a daemon per policy on one folder
(so all three use the same registration profile). The offered load is fixed: open-loop
Poisson from ``clockwork-async bench`` in a separate process (pinned to CPU 0 at nice 10, as
`cpu_serving` runs it) at 70% of the profile rule's capacity at a 100 ms SLO
(`core.capacity`: the largest b with 2 exec(b) + margin <= SLO gives b / exec(b) req/s). Each
SLO is a multiple of the profile's b1 execute time; the points run in ascending order on the
policy's one daemon (what one point leaves in the predictions, the next inherits).

Simulated: the paper's setup as `sim_scenarios` (c) runs it (6 executors, 48 resident ResNet50
copies, 2,400 req/s, the V100 profile, b1 2.73 ms) in virtual time on the production core, at the
same SLO multiples.

Per point: goodput (ok/s), ok/requests, ok/accepted, ok latency p50/p99, ``late`` (goal 0 for
`clockwork`), dropped, rejected by reason. Writes ``results/slo_sweep[-quick].json`` and
``slo_sweep[-quick].png`` (goodput and ok share vs SLO, log x, per policy, real and simulated),
prints tables. Quick: 1x, 2x, 5x, 20x and 100x, 10 s each (~4 minutes); full: 1x, 1.5x, 2x, 3x,
5x, 10x, 20x, 50x and 100x, 45 s each (~25 minutes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.cpu_serving import MODEL, bench, row_of, rule_capacity
from benchmarks.lib import (
    POLICIES,
    RESULTS,
    ModelFolder,
    daemon_stats,
    demo_model_bytes,
    keep_log,
    load_average,
    machine_description,
    pyplot,
    registration_profile,
    run_uvloop,
    save,
    start_daemon,
    table,
    write_report,
)
from benchmarks.sim_scenarios import B1_MS as SIM_B1_MS
from benchmarks.sim_scenarios import simulate
from clockwork_async.sim.workloads import poisson

CAPACITY_SLO_MS = 100.0
SIM_COPIES, SIM_RATE_RPS, SIM_EXECUTORS = 48, 2400.0, 6  # as sim_scenarios (c)


@dataclass(frozen=True)
class Plan:
    multiples: tuple[float, ...]
    point_s: float  # real time per (policy, SLO)
    sim_s: float  # virtual time per (policy, SLO)
    load: float = 0.7  # of the rule's capacity at CAPACITY_SLO_MS


QUICK = Plan(multiples=(1.0, 2.0, 5.0, 20.0, 100.0), point_s=10.0, sim_s=5.0)
FULL = Plan(multiples=(1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0), point_s=45.0, sim_s=60.0)


# --- real time -----------------------------------------------------------------------------------


def real_policy(
    folder: Path, policy: str, plan: Plan, rate_rps: float | None, log_copy: Path
) -> dict[str, Any]:
    """Every SLO point of ``policy`` on one daemon. ``rate_rps`` None: derive it from the
    registration profile (the first policy's daemon profiles the model)."""
    model = {MODEL: ModelFolder(demo_model_bytes(folder / "demo", [MODEL])[MODEL])}
    print(f"  {policy}: starting the daemon", file=sys.stderr, flush=True)
    try:
        with start_daemon(folder, model, policy) as daemon:
            profile = registration_profile(folder)
            rule = rule_capacity(profile, CAPACITY_SLO_MS)
            rate = rate_rps if rate_rps is not None else plan.load * rule["rps"]
            b1_ms = rule["execute_ms_by_batch"][min(rule["execute_ms_by_batch"])]
            rows = []
            for index, multiple in enumerate(plan.multiples):
                slo_ms = round(multiple * b1_ms, 3)
                print(
                    f"  {policy}: SLO {multiple:g}x = {slo_ms} ms, {rate:.0f} req/s for "
                    f"{plan.point_s:g} s (load {load_average()[0]})",
                    file=sys.stderr,
                    flush=True,
                )
                out = folder / f"{policy}-{multiple:g}x.json"
                summary = bench(daemon, rate, plan.point_s, slo_ms, out, seed=index + 1)
                row = row_of(f"{multiple:g}x", slo_ms, rate, summary)
                rows.append(row | {"policy": policy, "multiple": multiple})
            stats = run_uvloop(daemon_stats(daemon.api))
    finally:
        keep_log(folder / "daemon.log", log_copy)
    return {
        "policy": policy,
        "rate_rps": round(rate, 1),
        "b1_ms": b1_ms,
        "rule_capacity": rule,
        "registration_profile": profile,
        "rows": rows,
        "prediction_errors": stats.get("prediction_errors"),
        "daemon_log": str(log_copy),
    }


def real_sweep(plan: Plan, log_stem: Path) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="clockwork-slo-sweep-") as name:
        folder = Path(name)
        for policy in POLICIES:
            rate = found[0]["rate_rps"] if found else None
            log_copy = log_stem.with_name(f"{log_stem.name}-{policy}-daemon.log")
            found.append(real_policy(folder, policy, plan, rate, log_copy))
    return found


# --- simulated -----------------------------------------------------------------------------------


def sim_sweep(plan: Plan) -> list[dict[str, Any]]:
    """`sim_scenarios`' scenario (c) at this plan's SLO multiples."""
    rows = []
    for multiple in plan.multiples:
        slo_ms = round(multiple * SIM_B1_MS, 3)
        for policy in POLICIES:
            workload = poisson(SIM_COPIES, SIM_RATE_RPS, plan.sim_s)
            summary, _ = simulate(
                "c", f"slo {slo_ms:g} ms", policy, workload, SIM_EXECUTORS, slo_ms, preload=True
            )
            rows.append(summary | {"multiple": multiple, "slo_ms": slo_ms})
    return rows


# --- reporting -----------------------------------------------------------------------------------


def _percent(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 2)


def _rejected(rejected: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in rejected.items()) or "-"


def real_table(policies: list[dict[str, Any]]) -> str:
    headers = ["policy", "SLO", "SLO ms", "offered", "goodput", "ok/req %", "ok/acc %"]
    headers += ["ok p50 ms", "ok p99 ms", "late", "dropped", "failed", "lost", "rejected", "load"]
    rows = []
    for found in policies:
        for row in found["rows"]:
            rows.append(
                [
                    found["policy"],
                    row["run"],
                    row["slo_ms"],
                    row["offered_rps"],
                    row["goodput_rps"],
                    _percent(row["ok_over_requests"]),
                    _percent(row["ok_over_accepted"]),
                    row["latency_ms"]["p50"],
                    row["latency_ms"]["p99"],
                    row["late"],
                    row["dropped"],
                    row["failed"],
                    row["lost"],
                    _rejected(row["rejected_by_reason"]),
                    "-".join(map(str, row["load_average"])),
                ]
            )
    return table(headers, rows)


def sim_table(rows: list[dict[str, Any]]) -> str:
    headers = ["policy", "SLO", "SLO ms", "offered", "goodput", "ok/req %", "ok/acc %"]
    headers += ["ok p50 ms", "ok p99 ms", "late", "dropped", "lost", "rejected"]
    return table(
        headers,
        [
            [
                row["policy"],
                f"{row['multiple']:g}x",
                row["slo_ms"],
                row["offered_rps"],
                row["goodput_rps"],
                _percent(row["ok_over_requests"]),
                _percent(row["ok_over_accepted"]),
                row["latency_ms"]["p50"],
                row["latency_ms"]["p99"],
                row["late"],
                row["dropped"],
                row["lost"],
                _rejected(row["rejected"]),
            ]
            for row in sorted(rows, key=lambda r: (POLICIES.index(r["policy"]), r["multiple"]))
        ],
    )


def print_report(result: dict[str, Any]) -> None:
    if result.get("real"):
        first = result["real"][0]
        rule = first["rule_capacity"]
        print(
            f"\nReal time: {MODEL}, b1 {first['b1_ms']:.3f} ms (registration profile); rule "
            f"capacity at {CAPACITY_SLO_MS:g} ms: b{rule['batch']} -> {rule['rps']} req/s; "
            f"offered {first['rate_rps']} req/s"
        )
        print(real_table(result["real"]))
    if result.get("sim"):
        print(
            f"\nSimulated (virtual time): {SIM_EXECUTORS} executors, {SIM_COPIES} copies, "
            f"{SIM_RATE_RPS:g} req/s, b1 {SIM_B1_MS} ms"
        )
        print(sim_table(result["sim"]))


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    real_rows = [row for found in result.get("real", []) for row in found["rows"]]
    panels = [
        (title, rows)
        for title, rows in (
            ("real time, 1 ONNX Runtime CPU executor", real_rows),
            (f"simulated, {SIM_EXECUTORS} executors", result.get("sim", [])),
        )
        if rows
    ]
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 7), squeeze=False)
    for column, (title, rows) in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        for policy in POLICIES:
            mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["multiple"])
            x = [r["multiple"] for r in mine]
            top.plot(x, [r["goodput_rps"] for r in mine], "o-", label=policy)
            bottom.plot(x, [100 * (r["ok_over_requests"] or 0) for r in mine], "o-", label=policy)
        offered = max((r["offered_rps"] for r in rows), default=0)
        top.axhline(offered, color="gray", linestyle=":", label="offered")
        top.set(title=title, xscale="log", ylabel="goodput (ok/s)")
        bottom.set(xscale="log", xlabel="SLO / b1 execute time", ylabel="ok / requests (%)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return save(plt, fig, path, dpi=90)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slo_sweep", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="5 SLOs, 10 s each")
    parser.add_argument("--only", default="real,sim", help="real, sim or both (default)")
    parser.add_argument("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    chosen = set(args.only.split(","))
    out = args.json or RESULTS / f"slo_sweep{'-quick' if args.quick else ''}.json"
    started = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "slo_sweep",
        "quick": args.quick,
        "machine": machine_description(),
        "plan": asdict(plan),
    }
    if "real" in chosen:
        result["real"] = real_sweep(plan, out.with_suffix(""))
    if "sim" in chosen:
        result["sim"] = sim_sweep(plan)
    result["load_average_after"] = load_average()
    result["wall_s"] = round(time.monotonic() - started, 1)
    print_report(result)
    plot = write_plot(result, out.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path = write_report(out.stem, result, out.parent)
    print(f"\nwrote {path}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
