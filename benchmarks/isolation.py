"""Experiment 5 of the paper, isolation: latency-sensitive models keep their SLO while background
closed-loop load saturates the executor.

    python -m benchmarks.isolation [--quick] [--policies clockwork,fifo,timeout] [--json OUT]

The daemon (default executors: one ONNX Runtime executor pinned to CPU 1, the controller on
CPU 0) serves two copies of the ``resnet-like`` demo model as latency-sensitive instances
(``ls-0``, ``ls-1``) and two more as background instances (``bg-0``, ``bg-1``). Per policy, one
daemon and three phases of equal length:

- before: open-loop Poisson to ``ls-0``/``ls-1`` only (a low rate), SLO 50 ms (``--ls-slo-ms``;
  ``0``: 3 exec(b16) + exec(b1) of the registration profile). On this machine a b16 batch
  takes 13-20 ms: a request may find one background batch running and one booked after it,
  then runs alone, with room left for predictions above the median. A fixed default keeps
  runs comparable: on the shared machine the profile itself moved by 2x between runs;
- during: the same, plus a closed-loop background client keeping N requests in flight over
  ``bg-0``/``bg-1`` with a long SLO (1 s), which keeps the executor busy all the time;
- after: latency-sensitive load alone again.

Both clients are ``clockwork-async bench --rows`` processes (`benchmarks.lib.spawn_recorder`,
pinned to the controller's CPU at nice 10), so every request has a row. Reports, per phase,
the latency-sensitive ok share and ok latency p50/p99/max (goal for `clockwork`: ok share and
p99 during ~ before, p99 < SLO, late 0), and the background's throughput. Writes
``results/isolation[-quick].json`` and ``isolation[-quick].png`` (latency of each
latency-sensitive request over time, background goodput per second beside it, one panel per
policy), prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.cpu_serving import MODEL
from benchmarks.lib import (
    NS_PER_MS,
    NS_PER_S,
    POLICIES,
    RESULTS,
    LoadSpec,
    ModelFolder,
    collect,
    daemon_stats,
    demo_model_bytes,
    keep_log,
    load_average,
    machine_description,
    outcome_summary,
    pyplot,
    record,
    registration_profile,
    run_uvloop,
    save,
    select,
    spawn_recorder,
    start_daemon,
    table,
    write_report,
)

LS_MODELS = ("ls-0", "ls-1")
BG_MODELS = ("bg-0", "bg-1")
PHASES = ("before", "during", "after")


@dataclass(frozen=True)
class Plan:
    phase_s: float
    ls_rate_rps: float = 40.0  # over both latency-sensitive instances
    bg_concurrency: int = 32
    bg_slo_ms: float = 1000.0
    ls_slo_ms: float = 50.0  # 0: `ls_slo_ms` of the registration profile


QUICK = Plan(phase_s=15.0)
FULL = Plan(phase_s=120.0)


def ls_slo_ms(profile: dict[str, Any], batches: int = 3) -> float:
    """``batches`` x exec(largest batch) + exec(b1) of the first executor kind's profile, ms."""
    execute_ns = {
        int(b): int(ns) for b, ns in next(iter(profile["kinds"].values()))["execute_ns"].items()
    }
    slowest_ns, b1_ns = execute_ns[max(execute_ns)], execute_ns[min(execute_ns)]
    return round((batches * slowest_ns + b1_ns) / NS_PER_MS, 1)


def model_folders(folder: Path) -> dict[str, ModelFolder]:
    onnx = demo_model_bytes(folder / "demo", [MODEL])[MODEL]
    return {"ls": ModelFolder(onnx, "copies = 2\n"), "bg": ModelFolder(onnx, "copies = 2\n")}


def run_policy(folder: Path, policy: str, plan: Plan, log_copy: Path) -> dict[str, Any]:
    """The three phases on one daemon; returns both recorders' rows and the daemon's stats."""
    print(f"  {policy}: starting the daemon", file=sys.stderr, flush=True)
    try:
        with start_daemon(folder, model_folders(folder), policy) as daemon:
            profile = registration_profile(folder)
            slo_ms = plan.ls_slo_ms or ls_slo_ms(profile)
            ls_spec = LoadSpec(
                LS_MODELS, slo_ms, 3 * plan.phase_s, rate_rps=plan.ls_rate_rps, seed=5
            )
            bg_spec = LoadSpec(
                BG_MODELS, plan.bg_slo_ms, plan.phase_s, concurrency=plan.bg_concurrency
            )
            load_before = load_average()
            print(
                f"  {policy}: ls SLO {slo_ms} ms at {plan.ls_rate_rps:g} req/s for "
                f"{3 * plan.phase_s:g} s; background from {plan.phase_s:g} s",
                file=sys.stderr,
                flush=True,
            )
            ls_out, bg_out = folder / f"{policy}-ls.json", folder / f"{policy}-bg.json"
            ls_process = spawn_recorder(daemon.api, ls_spec, ls_out)
            time.sleep(plan.phase_s)
            background = record(daemon.api, bg_spec, bg_out)
            latency_sensitive = collect(ls_process, ls_out)
            stats = run_uvloop(daemon_stats(daemon.api))
    finally:
        keep_log(folder / "daemon.log", log_copy)
    return {
        "policy": policy,
        "ls_slo_ms": slo_ms,
        "registration_profile": profile,
        "load_average": [load_before[0], load_average()[0]],
        "ls": latency_sensitive,
        "bg": background,
        "daemon_outcomes": stats.get("outcomes"),
        "prediction_errors": stats.get("prediction_errors"),
        "daemon_log": str(log_copy),
    }


# --- analysis ------------------------------------------------------------------------------------


def phase_of(sent_ns: int, background: dict[str, Any]) -> str:
    if sent_ns < background["start_ns"]:
        return "before"
    return "during" if sent_ns <= background["end_ns"] else "after"


def analyse(run: dict[str, Any]) -> dict[str, Any]:
    """Per phase and model, the latency-sensitive outcomes; the background's throughput."""
    ls, bg = run["ls"], run["bg"]
    rows = ls["rows"]
    phases = [phase_of(sent, bg) for sent in rows["sent_ns"]]
    spans_s = {
        "before": (bg["start_ns"] - ls["start_ns"]) / NS_PER_S,
        "during": (bg["end_ns"] - bg["start_ns"]) / NS_PER_S,
        "after": (ls["end_ns"] - bg["end_ns"]) / NS_PER_S,
    }
    found: dict[str, Any] = {}
    for phase in PHASES:
        in_phase = [p == phase for p in phases]
        found[phase] = outcome_summary(select(rows, in_phase), spans_s[phase])
        found[phase]["models"] = {
            model: outcome_summary(
                select(
                    rows, [k and m == model for k, m in zip(in_phase, rows["model"], strict=True)]
                ),
                spans_s[phase],
            )
            for model in LS_MODELS
        }
    bg_summary = outcome_summary(bg["rows"], spans_s["during"])
    ok_batches = Counter(
        batch
        for batch, status in zip(bg["rows"]["batch_size"], bg["rows"]["status"], strict=True)
        if status == "ok"
    )
    bg_summary["ok_by_batch_size"] = dict(sorted(ok_batches.items()))
    return {"phases": found, "background": bg_summary, "spans_s": spans_s}


# --- reporting -----------------------------------------------------------------------------------


def print_report(result: dict[str, Any]) -> None:
    headers = ["policy", "phase", "ls SLO ms", "ls sent", "ls ok %", "ls p50 ms", "ls p99 ms"]
    headers += ["ls max ms", "ls late", "ls not ok", "bg ok/s", "bg p50 ms", "bg p99 ms", "load"]
    rows = []
    for run in result["runs"]:
        analysis = run["analysis"]
        for phase in PHASES:
            found = analysis["phases"][phase]
            latency = found["ok_latency_ms"]
            not_ok = {k: v for k, v in found["statuses"].items() if k != "ok"}
            background = analysis["background"] if phase == "during" else None
            rows.append(
                [
                    run["policy"],
                    phase,
                    run["ls_slo_ms"],
                    found["sent"],
                    None if found["ok_share"] is None else round(100 * found["ok_share"], 2),
                    latency["p50"],
                    latency["p99"],
                    latency["max"],
                    found["late"],
                    ", ".join(f"{k} {v}" for k, v in not_ok.items()) or "-",
                    background["goodput_rps"] if background else None,
                    background["ok_latency_ms"]["p50"] if background else None,
                    background["ok_latency_ms"]["p99"] if background else None,
                    "-".join(map(str, run["load_average"])),
                ]
            )
    print(table(headers, rows))
    for run in result["runs"]:
        background = run["analysis"]["background"]
        print(
            f"{run['policy']}: background sent {background['sent']}, statuses "
            f"{background['statuses']}, ok by batch size {background['ok_by_batch_size']}"
        )


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        _latency_panel(ax, run)
    axes[-1][0].set_xlabel("time since the latency-sensitive load started (s)")
    return save(plt, fig, path, dpi=90)


def _latency_panel(ax: Any, run: dict[str, Any]) -> None:
    from matplotlib.ticker import NullFormatter

    ls, bg = run["ls"], run["bg"]
    origin_ns = ls["start_ns"]
    rows = ls["rows"]
    slo_ms = run["ls_slo_ms"]
    for index, model in enumerate(LS_MODELS):
        points = [
            ((sent - origin_ns) / NS_PER_S, latency / NS_PER_MS)
            for sent, latency, m, status in zip(
                rows["sent_ns"], rows["latency_ns"], rows["model"], rows["status"], strict=True
            )
            if m == model and status == "ok"
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), s=4, color=f"C{index}", label=f"{model} ok")
    failed = [
        ((sent - origin_ns) / NS_PER_S, max(latency / NS_PER_MS, 0.05))
        for sent, latency, status in zip(
            rows["sent_ns"], rows["latency_ns"], rows["status"], strict=True
        )
        if status != "ok"
    ]
    if failed:
        ax.scatter(*zip(*failed, strict=True), s=12, marker="x", color="red", label="ls not ok")
    ax.axhline(slo_ms, color="red", linestyle="--", linewidth=0.8, label="ls SLO")
    start_s, end_s = (bg["start_ns"] - origin_ns) / NS_PER_S, (bg["end_ns"] - origin_ns) / NS_PER_S
    ax.axvspan(start_s, end_s, color="gray", alpha=0.15, label="background on")
    ax.set(ylabel="ls latency (ms)", yscale="log", title=f"policy {run['policy']}")
    ax.yaxis.set_minor_formatter(NullFormatter())
    twin = ax.twinx()
    seconds, goodput = _per_second(bg, origin_ns)
    twin.plot(seconds, goodput, color="black", linewidth=1.0, label="background ok/s")
    twin.set_ylabel("background ok/s")
    twin.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    ax.legend(
        handles + more_handles,
        labels + more_labels,
        fontsize=7,
        loc="center left",
        bbox_to_anchor=(1.07, 0.5),
    )


def _per_second(recorded: dict[str, Any], origin_ns: int) -> tuple[list[float], list[int]]:
    """ok answers per second of a recorder's rows, by the second they were sent in."""
    counts: Counter[int] = Counter(
        int((sent - origin_ns) // NS_PER_S)
        for sent, status in zip(
            recorded["rows"]["sent_ns"], recorded["rows"]["status"], strict=True
        )
        if status == "ok"
    )
    seconds = sorted(counts)
    return [s + 0.5 for s in seconds], [counts[s] for s in seconds]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.isolation", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="15 s phases (about 3 minutes)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--ls-slo-ms", type=float, default=50.0, help="0: 3 exec(b16) + exec(b1) of the profile"
    )
    parser.add_argument("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = replace(QUICK if args.quick else FULL, ls_slo_ms=args.ls_slo_ms)
    policies = [p for p in args.policies.split(",") if p]
    out = args.json or RESULTS / f"isolation{'-quick' if args.quick else ''}.json"
    started = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "isolation",
        "quick": args.quick,
        "machine": machine_description(),
        "plan": asdict(plan),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="clockwork-isolation-") as name:
        folder = Path(name)
        for policy in policies:
            log_copy = out.with_name(f"{out.stem}-{policy}-daemon.log")
            run = run_policy(folder, policy, plan, log_copy)
            run["analysis"] = analyse(run)
            result["runs"].append(run)
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
