"""Real CPU serving: the ``resnet-like`` demo model on the daemon's default ONNX Runtime
executors under open-loop Poisson load from a separate process.

    python -m benchmarks.cpu_serving [--quick] [--controller as-configured|pinned|unpinned]
        [--json OUT]

The daemon (``clockwork-async serve``, temporary config and XDG homes) runs its default
executors: one ONNX Runtime CPU executor per CPU left after the controller's, each pinned, one
intra-op thread. Its repository holds ``resnet-like`` only; registration profiles it.
The load comes from ``clockwork-async bench`` (`benchmarks.lib.run_bench`): a separate process
pinned to the controller's CPU (so it never takes an executor's) at nice 10 (so the controller
preempts it when both are ready); its send lag is reported. Its JSON summary is kept for every run.

1. Capacity. The profile rule of `core.capacity` (the largest b with 2 exec(b) + margin <= SLO
   gives b / exec(b) requests/s, exec from the registration profile) sets the offered load of a
   short saturation run at 1.5x that rate; the *capacity* used below is that run's measured
   goodput (ok replies per second), which counts the controller's and the generator's CPU too.
2. 50%, 70% and 90% of the capacity at a 100 ms SLO.
3. Tight SLOs at 70% load: 2x, 5x and 10x the batch-1 execute time of the profile.

Per run: ok/accepted (goal >= 99.99%), ok/requests, ``late`` (goal 0), goodput, latency of ok
replies p50/p99/p99.9, and the generator's send lag. Writes ``results/cpu_serving.json`` and
``results/cpu_serving.png`` (goodput and latency vs offered load), prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    DaemonProcess,
    add_model,
    daemon_config,
    keep_log,
    load_average,
    machine_description,
    pyplot,
    registration_profile,
    run_bench,
    run_uvloop,
    save,
    table,
    write_report,
)

MODEL = "resnet-like"
SLO_MS = 100.0
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class Plan:
    saturation_s: float
    load_s: float  # each of 50/70/90% at the 100 ms SLO
    tight_s: float  # each tight SLO at 70%
    loads: tuple[float, ...] = (0.5, 0.7, 0.9)
    tight_slo_multiples: tuple[float, ...] = (2.0, 5.0, 10.0)
    tight_load: float = 0.7
    saturation_factor: float = 1.5


QUICK = Plan(saturation_s=5.0, load_s=15.0, tight_s=8.0)
FULL = Plan(saturation_s=20.0, load_s=150.0, tight_s=60.0)


# --- the daemon and its profile ------------------------------------------------------------------


def start_daemon(folder: Path) -> DaemonProcess:
    """The daemon on its default executors, serving ``resnet-like`` only."""
    from clockwork_async.models.demo import generate_demo_models

    path = generate_demo_models(folder / "demo", names=[MODEL])[MODEL]
    add_model(folder / "models", MODEL, path.read_bytes())
    return DaemonProcess.start(folder, daemon_config(folder))


def rule_capacity(profile: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """`core.capacity`'s rule on the first executor kind: batch, exec(b) and requests/s."""
    from clockwork_async.core.capacity import capacity_batch, capacity_rps
    from clockwork_async.core.events import ModelProfile

    table_ = next(iter(profile["kinds"].values()))
    execute_ns = {int(b): int(ns) for b, ns in table_["execute_ns"].items()}
    model_profile = ModelProfile(execute_ns=execute_ns, load_ns=int(table_["load_ns"]))
    sizes = sorted(int(b) for b in profile["batch_sizes"])
    slo_ns = round(slo_ms * NS_PER_MS)
    batch = capacity_batch(model_profile, sizes, slo_ns)
    return {
        "slo_ms": slo_ms,
        "batch": batch,
        "execute_ms": execute_ns[batch] / NS_PER_MS if batch else None,
        "rps": round(capacity_rps(model_profile, sizes, slo_ns), 1),
        "execute_ms_by_batch": {b: execute_ns[b] / NS_PER_MS for b in sizes},
    }


# --- one bench run -------------------------------------------------------------------------------


def bench(
    daemon: DaemonProcess,
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    out: Path,
    seed: int,
    nice: int = GENERATOR_NICE,
) -> dict[str, Any]:
    """``clockwork-async bench`` (a process pinned to the controller's CPU at ``nice``, 10
    unless given) at ``rate_rps`` for ``duration_s``; returns its summary. Raises RuntimeError
    if it fails without a summary."""
    flags = ["--model", MODEL, "--rate", f"{rate_rps:.3f}", "--duration-s", str(duration_s)]
    flags += ["--slo-ms", str(slo_ms), "--seed", str(seed)]
    return run_bench(daemon.api, out, flags, nice=nice)


def row_of(label: str, slo_ms: float, target_rps: float, summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers this benchmark reports of one bench summary."""
    latency = summary["latency_ms"]
    rejected = sum(summary["rejected"].values())
    return {
        "run": label,
        "slo_ms": round(slo_ms, 3),
        "target_rps": round(target_rps, 1),
        "offered_rps": summary["offered_rps"],
        "requests": summary["requests"],
        "accepted": summary["accepted"],
        "ok": summary["ok"],
        "rejected": rejected,
        "rejected_by_reason": summary["rejected"],
        "dropped": summary["dropped"],
        "failed": summary["failed"],
        "late": summary["late"],
        "lost": summary["lost"],
        "errors": summary["errors"],
        "ok_over_accepted": summary["ok_over_accepted"],
        "ok_over_requests": summary["ok_over_requests"],
        "goodput_rps": summary["goodput_rps"],
        "latency_ms": {k: latency.get(k) for k in ("p50", "p99", "p99.9", "max", "mean")},
        "daemon_latency_ms": summary["daemon_latency_ms"],
        "send_lag_ms": summary["send"]["lag_ms"],
        "generator_behind": summary["send"].get("behind"),  # bench's send_verdict
        "load_average": [summary["load_average_before"][0], summary["load_average_after"][0]],
    }


def runs(daemon: DaemonProcess, plan: Plan, folder: Path) -> dict[str, Any]:
    profile = registration_profile(folder)
    rule = rule_capacity(profile, SLO_MS)
    seed = iter(range(1, 1000))

    def one(label: str, rate: float, duration_s: float, slo_ms: float) -> dict[str, Any]:
        print(
            f"  {label}: {rate:.0f} req/s for {duration_s:g} s at {slo_ms:g} ms "
            f"(load {load_average()[0]})",
            file=sys.stderr,
            flush=True,
        )
        summary = bench(daemon, rate, duration_s, slo_ms, folder / f"{label}.json", next(seed))
        return row_of(label, slo_ms, rate, summary)

    saturation = one("saturation", plan.saturation_factor * rule["rps"], plan.saturation_s, SLO_MS)
    capacity_rps = saturation["goodput_rps"]
    rows = [
        one(f"{load:.0%} load", load * capacity_rps, plan.load_s, SLO_MS) for load in plan.loads
    ]
    b1_ms = rule["execute_ms_by_batch"][min(rule["execute_ms_by_batch"])]
    for multiple in plan.tight_slo_multiples:
        label = f"{plan.tight_load:.0%} load, SLO {multiple:g}x b1"
        rows.append(one(label, plan.tight_load * capacity_rps, plan.tight_s, multiple * b1_ms))
    for row in rows[len(plan.loads) :]:
        row["rule_capacity_at_slo"] = rule_capacity(profile, row["slo_ms"])["rps"]
    return {
        "registration_profile": profile,
        "rule_capacity": rule,
        "capacity": {
            "rps": capacity_rps,
            "how": f"goodput of a {plan.saturation_s:g} s saturation run offered "
            f"{plan.saturation_factor:g}x the profile rule's {rule['rps']} req/s",
        },
        "saturation": saturation,
        "runs": rows,
    }


# --- reporting -----------------------------------------------------------------------------------


def _percent(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def print_report(result: dict[str, Any]) -> None:
    rule, capacity = result["rule_capacity"], result["capacity"]
    print(
        f"profile rule at {SLO_MS:g} ms: b{rule['batch']} ({rule['execute_ms']} ms) -> "
        f"{rule['rps']} req/s; capacity used: {capacity['rps']} req/s ({capacity['how']})"
    )
    headers = [
        "run",
        "SLO ms",
        "offered",
        "requests",
        "ok",
        "rej",
        "drop",
        "late",
        "lost",
        "ok/acc %",
        "ok/req %",
        "goodput",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "load 1m",
    ]
    rows = []
    for row in [result["saturation"], *result["runs"]]:
        latency = row["latency_ms"]
        rows.append(
            [
                row["run"],
                row["slo_ms"],
                row["offered_rps"],
                row["requests"],
                row["ok"],
                row["rejected"],
                row["dropped"],
                row["late"],
                row["lost"],
                _percent(row["ok_over_accepted"], 3),
                _percent(row["ok_over_requests"], 2),
                row["goodput_rps"],
                latency["p50"],
                latency["p99"],
                latency["p99.9"],
                "-".join(map(str, row["load_average"])),
            ]
        )
    print(table(headers, rows))
    print("goals: ok/accepted >= 99.99% and late == 0 at 50-90% load, 100 ms SLO")


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """Goodput and ok latency vs offered load for the 100 ms runs (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    chosen = [result["saturation"]] + [r for r in result["runs"] if r["slo_ms"] == SLO_MS]
    chosen.sort(key=lambda r: r["offered_rps"])
    offered = [r["offered_rps"] for r in chosen]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(offered, [r["goodput_rps"] for r in chosen], "o-", label="goodput (ok/s)")
    left.plot(offered, offered, ":", color="gray", label="offered")
    left.axhline(result["capacity"]["rps"], color="gray", linestyle="--", label="capacity")
    left.set(xlabel="offered load (req/s)", ylabel="req/s", title=f"{MODEL}, SLO {SLO_MS:g} ms")
    left.legend()
    for key in ("p50", "p99", "p99.9"):
        right.plot(
            offered, [r["latency_ms"][key] for r in chosen], "o-", label=f"{key} (client, ok)"
        )
    daemon_p99 = [r["daemon_latency_ms"]["p99"] for r in chosen]
    right.plot(offered, daemon_p99, "x--", label="p99 in the daemon (all replies)")
    right.axhline(SLO_MS, color="red", linestyle="--", label="SLO")
    right.set(xlabel="offered load (req/s)", ylabel="latency (ms)", yscale="log")
    right.legend()
    return save(plt, fig, path, dpi=80)


def set_controller(daemon: DaemonProcess, how: str) -> None:
    """``pinned``: every daemon thread to the lowest CPU; ``unpinned``: to every CPU;
    ``as-configured``: leave the daemon as it set itself up."""
    cpus = set(os.sched_getaffinity(0))
    if how == "pinned":
        daemon.pin({min(cpus)})
    elif how == "unpinned":
        daemon.pin(cpus)


def run(plan: Plan, controller: str, log_copy: Path) -> dict[str, Any]:
    """Every run on one daemon; its log is copied to ``log_copy`` however it ends."""
    with tempfile.TemporaryDirectory(prefix="clockwork-cpu-serving-") as name:
        folder = Path(name)
        print("  starting the daemon (registration profiles the model)", file=sys.stderr)
        try:
            with start_daemon(folder) as daemon:
                set_controller(daemon, controller)
                controller_cpus = daemon.controller_cpus()
                result = {"daemon_controller_cpus": controller_cpus, **runs(daemon, plan, folder)}
                result["daemon_stats"] = run_uvloop(_stats(daemon.api))
        finally:
            keep_log(folder / "daemon.log", log_copy)
    result["daemon_log"] = str(log_copy)
    return result


async def _stats(address: str) -> dict[str, Any]:
    from clockwork_async.client import AsyncClient

    async with await AsyncClient.connect(address) as client:
        stats = await client.stats()
    keep = (
        "submitted",
        "outcomes",
        "prediction_errors",
        "loop_lag",
        "timer",
        "core_ns_per_request",
        "driver_ns_per_request",
        "send_ns_per_request",
    )
    return {key: stats.get(key) for key in keep}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_serving", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="short runs (about two minutes)")
    parser.add_argument(
        "--controller",
        choices=("as-configured", "pinned", "unpinned"),
        default="as-configured",
        help="the daemon's threads after it starts: as it set itself up (default), all pinned "
        "to the lowest CPU, or allowed every CPU",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "cpu_serving.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    machine = machine_description()
    result = {
        "benchmark": "cpu_serving",
        "quick": args.quick,
        "machine": machine,
        "plan": asdict(plan),
        "model": MODEL,
        "controller": args.controller,
        **run(plan, args.controller, args.json.with_name(f"{args.json.stem}-daemon.log")),
    }
    result["load_average_after"] = load_average()
    print_report(result)
    plot = write_plot(result, args.json.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path = write_report(args.json.stem, result, args.json.parent)
    print(f"\nwrote {path}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
