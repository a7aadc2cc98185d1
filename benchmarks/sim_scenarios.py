"""The Clockwork paper's scenarios in virtual time, `clockwork` vs `fifo` vs `timeout`.

    python -m benchmarks.sim_scenarios [--quick] [--only a,b,c,d] [--azure-minutes N]

(a) thousands of instances: 3,600 ResNet50 copies on one executor sharing 1,000 req/s, one more
    copy becoming active each second (quick: every 15 ms, so all are active within 54 s);
(b) the Azure Functions sample (when present) onto 4,026 instances (61 x 66) on 6 executors at a
    100 ms SLO;
(c) an SLO sweep from 1x the batch-1 execute time upward: 6 executors, 48 copies, 2,400 req/s,
    copies resident from the start (as in the paper, where they fit in memory);
(d) overload: one executor, one resident model, offered load as multiples of its capacity at
    100 ms (923 req/s at batch 16): goodput vs capacity.

Goals: late == 0 and lost == 0; ok/accepted >= 99.999% for `clockwork`; at 2x overload its
goodput >= 95% of capacity. Writes ``results/sim_scenarios[-quick].json`` and PNGs beside it and
prints a table. Everything runs in virtual time on the production core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.lib import POLICIES, RESULTS, pyplot, save
from benchmarks.lib.sim import AZURE_SAMPLE, B1_MS, PROFILE, Row, interval_for, run_sim
from clockwork_async.sim.report import capacity_rps
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import Workload, poisson, ramp, slo_sweep_ms, trace_replay

__all__ = ["AZURE_SAMPLE", "B1_MS", "POLICIES", "PROFILE", "simulate"]


def simulate(
    scenario: str,
    case: str,
    policy: str,
    workload: Workload,
    executors: int,
    slo_ms: float,
    preload: bool = False,
) -> tuple[Row, dict[str, list[float]]]:
    """One run; returns its summary (tagged with scenario and case) and its timeline."""
    wall_start = time.perf_counter()
    run = run_sim(
        workload,
        executors=executors,
        slo_ms=slo_ms,
        policy=policy,
        preload=preload,
        interval_ns=interval_for(workload.duration_ns / 1e9),
    )
    run.summary.update(scenario=scenario, case=case, policy=policy)
    print(
        f"  {scenario} {case} {policy}: {run.summary['requests']:,} requests in "
        f"{time.perf_counter() - wall_start:.1f} s wall",
        file=sys.stderr,
        flush=True,
    )
    return run.summary, run.series


def scenario_a(quick: bool) -> list[tuple[Row, dict[str, list[float]]]]:
    step_s, duration_s = (0.015, 60.0) if quick else (1.0, 3600.0)
    case = f"3600 copies, 1000 req/s, +1 every {step_s:g} s"
    return [
        simulate("a", case, p, ramp(3600, 1000.0, duration_s, step_s), 1, 100.0) for p in POLICIES
    ]


def scenario_b(quick: bool, minutes: float | None) -> list[tuple[Row, dict[str, list[float]]]]:
    if not AZURE_SAMPLE.exists():
        print("  b: the Azure sample is not present; skipped", file=sys.stderr)
        return []
    minutes = minutes or (2.0 if quick else 60.0)
    mapping = TraceMapping(read_azure_trace(AZURE_SAMPLE, minutes), 61 * 66)
    case = f"azure sample, 4026 instances, 6 executors, {minutes:g} min"
    return [
        simulate("b", case, p, trace_replay(mapping, minutes * 60.0), 6, 100.0) for p in POLICIES
    ]


def scenario_c(quick: bool) -> list[tuple[Row, dict[str, list[float]]]]:
    duration_s = 5.0 if quick else 60.0
    runs = []
    for slo_ms in slo_sweep_ms(B1_MS):
        for policy in POLICIES:
            workload = poisson(48, 2400.0, duration_s)
            case = f"slo {slo_ms:g} ms"
            runs.append(simulate("c", case, policy, workload, 6, slo_ms, preload=True))
    return runs


def scenario_d(quick: bool) -> list[tuple[Row, dict[str, list[float]]]]:
    duration_s, factors = (10.0, (0.5, 1.0, 2.0)) if quick else (60.0, (0.5, 1.0, 1.5, 2.0, 3.0))
    capacity = capacity_rps(PROFILE, 100_000_000)
    runs = []
    for factor in factors:
        for policy in POLICIES:
            workload = poisson(1, factor * capacity, duration_s)
            case = f"{factor:g}x capacity"
            summary, timeline = simulate("d", case, policy, workload, 1, 100.0, preload=True)
            summary["capacity_rps"] = capacity
            summary["goodput_over_capacity"] = summary["goodput_rps"] / capacity
            runs.append((summary, timeline))
    return runs


def goals(rows: list[Row]) -> dict[str, Any]:
    """The benchmark's goals, checked on the `clockwork` rows."""
    ours = [row for row in rows if row["policy"] == "clockwork"]
    overload = [row for row in ours if row["scenario"] == "d" and row["case"].startswith("2x")]
    attainment = [row["ok_over_accepted"] for row in ours if row["ok_over_accepted"] is not None]
    return {
        "late_total": sum(row["late"] for row in ours),
        "lost_total": sum(row["lost"] for row in ours),
        "min_ok_over_accepted": min(attainment, default=None),
        "goodput_over_capacity_at_2x": [row["goodput_over_capacity"] for row in overload],
    }


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'':<3}{'case':<44}{'policy':<10}{'requests':>9}{'ok':>9}{'drop':>7}{'rej':>8}"
        f"{'late':>7}{'lost':>5}{'ok/acc %':>10}{'ok/req %':>9}{'goodput':>9}{'p99 ms':>8}"
    )
    print(header)
    for row in rows:
        p99 = row["latency_ms"]["p99"]
        print(
            f"{row['scenario']:<3}{row['case'][:43]:<44}{row['policy']:<10}{row['requests']:>9}"
            f"{row['ok']:>9}{row['dropped']:>7}{sum(row['rejected'].values()):>8}"
            f"{row['late']:>7}{row['lost']:>5}{_percent(row['ok_over_accepted'], 4):>10}"
            f"{_percent(row['ok_over_requests'], 2):>9}{row['goodput_rps']:>9.1f}"
            f"{'-' if p99 is None else f'{p99:.1f}':>8}"
        )


def _percent(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def write_plots(
    runs: list[tuple[Row, dict[str, list[float]]]], directory: Path, suffix: str
) -> list[Path]:
    """PNGs per scenario (skipped, with a note, when matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for scenario, keys in (("a", ("goodput_rps", "resident_models")), ("b", ("goodput_rps",))):
        chosen = [(row, series) for row, series in runs if row["scenario"] == scenario]
        if chosen:
            paths.append(
                _plot_timelines(plt, chosen, keys, directory / f"sim_{scenario}{suffix}.png")
            )
    paths += _plot_sweeps(plt, [row for row, _ in runs], directory, suffix)
    return paths


def _plot_timelines(
    plt: Any, runs: list[tuple[Row, dict[str, list[float]]]], keys: tuple[str, ...], path: Path
) -> Path:
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 3.5 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for row, series in runs:
            ax.plot(series["time_s"], series[key], label=row["policy"])
        ax.set(xlabel="simulated time (s)", ylabel=key, title=runs[0][0]["case"])
        ax.legend()
    return save(plt, fig, path)


def _plot_sweeps(plt: Any, rows: list[Row], directory: Path, suffix: str) -> list[Path]:
    specs: list[tuple[str, str, Callable[[Row], float], str]] = [
        ("c", "SLO (ms)", lambda r: r["config"]["slo_ms"], "ok_over_requests"),
        ("d", "offered (req/s)", lambda r: r["offered_rps"], "goodput_rps"),
    ]
    paths = []
    for scenario, xlabel, x_of, y_key in specs:
        chosen = [row for row in rows if row["scenario"] == scenario]
        if not chosen:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for policy in POLICIES:
            mine = [row for row in chosen if row["policy"] == policy]
            ax.plot([x_of(r) for r in mine], [r[y_key] or 0.0 for r in mine], "o-", label=policy)
        if scenario == "d":
            ax.axhline(chosen[0]["capacity_rps"], color="gray", linestyle="--", label="capacity")
        ax.set(xlabel=xlabel, ylabel=y_key, xscale="log" if scenario == "c" else "linear")
        ax.legend()
        paths.append(save(plt, fig, directory / f"sim_{scenario}{suffix}.png"))
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short runs (a minute or two)")
    parser.add_argument("--only", default="a,b,c,d", help="scenarios to run, e.g. a,d")
    parser.add_argument("--azure-minutes", type=float, help="minutes of the trace for (b)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen = set(args.only.split(","))
    runners = {
        "a": lambda: scenario_a(args.quick),
        "b": lambda: scenario_b(args.quick, args.azure_minutes),
        "c": lambda: scenario_c(args.quick),
        "d": lambda: scenario_d(args.quick),
    }
    runs = [run for name, runner in runners.items() if name in chosen for run in runner()]
    rows = [row for row, _ in runs]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    result = {"quick": args.quick, "goals": goals(rows), "runs": rows}
    (args.out / f"sim_scenarios{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(rows)
    print(json.dumps(result["goals"]))
    write_plots(runs, args.out, suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
