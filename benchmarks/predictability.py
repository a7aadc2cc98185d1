"""Experiment 1 of the paper, predictability: how steady is execution inside the executor, and
how close does the controller predict it?

    python -m benchmarks.predictability [--quick] [--no-shared] [--json OUT]

1. Executor. Per model (demo ``tiny``, ``mlp``, ``resnet-like``; plus ../shared/data/models/*.onnx
   when present) and batch size, the INFER *execute* duration the executor measures and reports,
   back to back (a full queue, the lane never idles), with the executor pinned to one CPU and
   unpinned: p50, p99, p99.9, max and p99/p50. The sampling is `benchmarks.executor`'s
   (`back_to_back_ns`); this benchmark keeps every sample for the CDFs.
2. Controller. The real daemon (``clockwork-async serve``, `clockwork` policy, its default pinned
   ONNX Runtime executor) serves every model above under moderate open-loop Poisson load (the
   rate that would keep the executor ~50% busy if every request ran alone at batch 1, split
   evenly over the models; SLO 100 ms) from a separate ``clockwork-async bench --rows``
   process. Each reply carries the
   measured and the predicted execute time of its batch; per action, the prediction error is
   predicted minus actual (negative: under-predicted, the dangerous side): p50/p99/max of
   |error|, per model and overall, beside the daemon's own ``prediction_errors`` stats.

The paper's yardstick (REFERENCE.md): ResNet50 on a V100 runs with p99.99 within 0.03% of its
median. Writes ``results/predictability[-quick].json`` and two PNGs beside it (execute-time
CDFs per batch size, pinned vs unpinned; histogram of prediction errors), prints the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.executor import (
    DEMO_MODELS,
    SHARED_MODELS_DIR,
    back_to_back_ns,
    find_models,
    infer_stats,
)
from benchmarks.executor import Plan as ExecutorPlan
from benchmarks.lib import (
    NS_PER_MS,
    RESULTS,
    LoadSpec,
    ModelFolder,
    action_errors,
    cached_profiles,
    daemon_stats,
    demo_model_bytes,
    error_summary,
    keep_log,
    load_average,
    machine_description,
    outcome_summary,
    percentiles_ms,
    pyplot,
    record,
    run_uvloop,
    save,
    shared_model_bytes,
    start_daemon,
    table,
    write_report,
)
from clockwork_async.demo import NEVER_NS, ExecutorSession, spawn_executor
from clockwork_async.wire.messages import Load, Message, Unload, UnregisterModel

SLO_MS = 100.0


@dataclass(frozen=True)
class Plan:
    batch_sizes: tuple[int, ...]
    samples: int  # back-to-back INFERs per (model, batch size, pinning)
    daemon_s: float  # the prediction-error run
    busy_target: float = 0.5  # the executor's share of time busy at batch 1


QUICK = Plan(batch_sizes=(1, 4, 16), samples=500, daemon_s=30.0)
FULL = Plan(batch_sizes=(1, 2, 4, 8, 16), samples=5000, daemon_s=300.0)


# --- 1. the executor -----------------------------------------------------------------------------


async def executor_samples(
    models: dict[str, Path], plan: Plan, cpu: int | None
) -> dict[str, dict[int, list[int]]]:
    """Execute durations (ns) by model and batch size on one executor process, pinned to
    ``cpu`` or unpinned. Raises DemoError when an action fails."""
    sampling = ExecutorPlan(plan.batch_sizes, back_to_back=plan.samples, cold=0, load_cycles=0)
    found: dict[str, dict[int, list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="clockwork-predictability-") as folder:
        args = ["--backend", "onnxruntime", "--listen", f"unix:{folder}/executor.sock"]
        args += ["--weights-bytes", "512MiB"] + (["--cpus", str(cpu)] if cpu is not None else [])
        executor = await spawn_executor(args)
        try:
            session = await ExecutorSession.open(executor.address)
            await session.sync_clock()
            for name, path in models.items():
                print(f"  executor: {name} ({_pinning(cpu)})", file=sys.stderr, flush=True)
                found[name] = await model_samples(session, name, path, sampling)
            await session.close()
        finally:
            await executor.stop()
    return found


async def model_samples(
    session: ExecutorSession, name: str, path: Path, sampling: ExecutorPlan
) -> dict[int, list[int]]:
    """Register, load, sample every batch size the model has among the plan's, unload."""

    def load(action_id: int) -> Message:
        return Load(action_id, name, 0, NEVER_NS)

    def unload(action_id: int) -> Message:
        return Unload(action_id, name)

    def unregister(action_id: int) -> Message:
        return UnregisterModel(action_id, name)

    info = await session.register(name, str(path))
    await session.result(load)
    sizes = [b for b in sampling.batch_sizes if b in info.batch_sizes] or [1]
    found = {b: await back_to_back_ns(session, info, b, sampling) for b in sizes}
    await session.result(unload)
    await session.call(unregister)
    return found


def _pinning(cpu: int | None) -> str:
    return f"pinned to CPU {cpu}" if cpu is not None else "unpinned"


async def executor_part(models: dict[str, Path], plan: Plan) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    executor_cpu = cpus[-1]
    if len(cpus) > 1:  # keep this process off the executor's core, as benchmarks.executor does
        os.sched_setaffinity(0, [c for c in cpus if c != executor_cpu])
    load_before = load_average()
    try:
        pinned = await executor_samples(models, plan, executor_cpu)
        load_between = load_average()
        unpinned = await executor_samples(models, plan, None)
    finally:
        os.sched_setaffinity(0, cpus)
    stats = [
        asdict(infer_stats(model, batch, is_pinned, "back_to_back", values))
        for is_pinned, samples in ((True, pinned), (False, unpinned))
        for model, by_batch in samples.items()
        for batch, values in by_batch.items()
    ]
    return {
        "executor_cpu": executor_cpu,
        "load_average": [load_before[0], load_between[0], load_average()[0]],
        "stats": stats,
        "samples_ns": {"pinned": pinned, "unpinned": unpinned},
    }


# --- 2. the controller's predictions -------------------------------------------------------------


def daemon_models(include_shared: bool, folder: Path) -> dict[str, ModelFolder]:
    models = demo_model_bytes(folder / "demo", DEMO_MODELS)
    if include_shared:
        shared = shared_model_bytes(SHARED_MODELS_DIR)
        models |= {f"shared-{name}": onnx for name, onnx in shared.items()}
    return {name: ModelFolder(onnx) for name, onnx in models.items()}


def moderate_rate_rps(profiles: dict[str, dict[str, Any]], busy_target: float) -> float:
    """Requests/s, split evenly over the models, that keep the executor ``busy_target`` busy
    if every request ran alone at batch 1 (batching only lowers the load)."""
    b1_s = [p["execute_ms"][min(p["execute_ms"])] / 1e3 for p in profiles.values()]
    return float(busy_target * len(b1_s) / sum(b1_s))


def controller_part(plan: Plan, include_shared: bool, log_copy: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="clockwork-predictability-") as name:
        folder = Path(name)
        models = daemon_models(include_shared, folder)
        print(f"  daemon: registering {len(models)} models", file=sys.stderr, flush=True)
        try:
            with start_daemon(folder, models, "clockwork") as daemon:
                profiles = cached_profiles(folder, models)
                rate = moderate_rate_rps(profiles, plan.busy_target)
                print(f"  daemon: {rate:.0f} req/s for {plan.daemon_s:g} s", file=sys.stderr)
                spec = LoadSpec(tuple(models), SLO_MS, plan.daemon_s, rate_rps=rate, seed=1)
                load_before = load_average()
                recorded = record(daemon.api, spec, folder / "recorded.json")
                load_after = load_average()
                stats = run_uvloop(daemon_stats(daemon.api))
        finally:
            keep_log(folder / "daemon.log", log_copy)
    rows = recorded["rows"]
    errors = action_errors(rows)
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for error in errors:
        by_model[error["model"]].append(error)
    return {
        "profiles": profiles,
        "rate_rps": round(rate, 1),
        "slo_ms": SLO_MS,
        "duration_s": plan.daemon_s,
        "load_average": [load_before[0], load_after[0]],
        "outcomes": outcome_summary(rows, plan.daemon_s),
        "timing_of_ok_ms": timing_of_ok(rows),
        "errors": {"all": error_summary(errors)}
        | {model: error_summary(found) for model, found in sorted(by_model.items())},
        "error_ns": [e["error_ns"] for e in errors],
        "error_models": [e["model"] for e in errors],
        "daemon_prediction_errors": stats.get("prediction_errors"),
        "daemon_log": str(log_copy),
    }


def timing_of_ok(rows: dict[str, list[Any]]) -> dict[str, dict[str, float | None]]:
    """Percentiles of where the time of ``ok`` requests went (the reply's timing fields)."""
    ok = [status == "ok" for status in rows["status"]]
    keys = (
        "latency_ns",
        "daemon_ns",
        "queue_ns",
        "to_executor_ns",
        "execute_ns",
        "from_executor_ns",
    )
    return {
        key.removesuffix("_ns"): percentiles_ms(
            [value for value, keep in zip(rows[key], ok, strict=True) if keep], (50, 90, 99)
        )
        for key in keys
    }


# --- reporting -----------------------------------------------------------------------------------


def executor_table(stats: list[dict[str, Any]]) -> str:
    pinned = {(s["model"], s["batch_size"]): s for s in stats if s["pinned"]}
    unpinned = {(s["model"], s["batch_size"]): s for s in stats if not s["pinned"]}
    headers = ["model", "b", "n"]
    headers += [f"{k} {side}" for side in ("pin", "unpin") for k in ("p50", "p99", "p99.9", "max")]
    headers += ["p99/p50 pin", "p99/p50 unpin"]
    rows = []
    for key, mine in pinned.items():
        other = unpinned.get(key)
        cells: list[Any] = [key[0], key[1], mine["n"]]
        for side in (mine, other):
            cells += [_ms(side, k) for k in ("p50_ns", "p99_ns", "p999_ns", "max_ns")]
        cells += [mine["p99_over_p50"], other["p99_over_p50"] if other else None]
        rows.append(cells)
    return table(headers, rows)


def _ms(stats: dict[str, Any] | None, key: str) -> float | None:
    return None if stats is None else round(stats[key] / NS_PER_MS, 3)


def error_table(errors: dict[str, Any]) -> str:
    headers = ["model", "actions", "exec p50 ms", "|err| p50 ms", "|err| p99 ms", "|err| max ms"]
    headers += ["under %", "worst under ms"]
    rows = []
    for model, found in errors.items():
        if not found.get("actions"):
            rows.append([model, 0, None, None, None, None, None, None])
            continue
        absolute = found["abs_error_ms"]
        rows.append(
            [
                model,
                found["actions"],
                found["execute_p50_ms"],
                absolute["p50"],
                absolute["p99"],
                absolute["max"],
                round(100 * found["under_share"], 2),
                found["worst_under_ms"],
            ]
        )
    return table(headers, rows)


def print_report(result: dict[str, Any]) -> None:
    print(
        "\nINFER execute duration (ms) inside the executor, back to back (load average "
        f"{'-'.join(map(str, result['executor']['load_average']))})"
    )
    print(executor_table(result["executor"]["stats"]))
    controller = result["controller"]
    outcomes = controller["outcomes"]
    print(
        f"\nController predictions: {controller['rate_rps']} req/s over "
        f"{len(controller['profiles'])} models for {controller['duration_s']:g} s at "
        f"{controller['slo_ms']:g} ms; statuses {outcomes['statuses']} (load average "
        f"{'-'.join(map(str, controller['load_average']))})"
    )
    print("where the time of ok requests went (ms; execute is the whole batch's)")
    print(
        table(
            ["part", "p50", "p90", "p99", "max"],
            [
                [k, v["p50"], v["p90"], v["p99"], v["max"]]
                for k, v in controller["timing_of_ok_ms"].items()
            ],
        )
    )
    print("prediction error = predicted - actual execute, per action")
    print(error_table(controller["errors"]))
    print(f"daemon prediction_errors: {controller['daemon_prediction_errors']}")


def write_plots(result: dict[str, Any], stem: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    return [
        _cdf_plot(plt, result["executor"]["samples_ns"], stem.with_name(f"{stem.name}-cdf.png")),
        _error_plot(plt, result["controller"], stem.with_name(f"{stem.name}-errors.png")),
    ]


def _cdf_plot(plt: Any, samples: dict[str, dict[str, dict[int, list[int]]]], path: Path) -> Path:
    models = list(samples["pinned"])
    columns = 3
    rows = -(-len(models) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.3 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        for index, batch in enumerate(samples["pinned"][model]):
            color = f"C{index}"
            for style, side in (("-", "pinned"), ("--", "unpinned")):
                chosen = samples[side].get(model, {}).get(batch)
                if chosen:
                    ordered = sorted(v / NS_PER_MS for v in chosen)
                    cdf = [(i + 1) / len(ordered) for i in range(len(ordered))]
                    ax.plot(ordered, cdf, style, color=color, label=f"b{batch} {side}", lw=1.2)
        ax.set(title=model, xscale="log", xlabel="execute (ms)", ylabel="CDF")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(models) :]:
        ax.set_visible(False)
    return save(plt, fig, path, dpi=90)


def _error_plot(plt: Any, controller: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    by_model: dict[str, list[float]] = defaultdict(list)
    for error_ns, model in zip(controller["error_ns"], controller["error_models"], strict=True):
        by_model[model].append(error_ns / NS_PER_MS)
    values = [v for found in by_model.values() for v in found]
    if values:
        low, high = min(values), max(values)
        bins = [low + (high - low) * i / 80 for i in range(81)] if high > low else 10
        ax.hist(list(by_model.values()), bins=bins, stacked=True, label=list(by_model))
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set(
        xlabel="predicted - actual execute (ms); < 0: under-predicted",
        ylabel="actions",
        yscale="log",
        title=f"controller prediction error, {controller['rate_rps']} req/s, "
        f"{controller['duration_s']:g} s",
    )
    ax.legend(fontsize=7)
    return save(plt, fig, path, dpi=90)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predictability", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="about two minutes")
    parser.add_argument("--no-shared", action="store_true", help="demo models only")
    parser.add_argument("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    out = args.json or RESULTS / f"predictability{'-quick' if args.quick else ''}.json"
    started = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "predictability",
        "quick": args.quick,
        "machine": machine_description(),
        "plan": asdict(plan),
    }
    models = find_models(include_shared=not args.no_shared)
    result["executor"] = run_uvloop(executor_part(models, plan))
    log_copy = out.with_name(f"{out.stem}-daemon.log")
    result["controller"] = controller_part(plan, not args.no_shared, log_copy)
    result["load_average_after"] = load_average()
    result["wall_s"] = round(time.monotonic() - started, 1)
    print_report(result)
    plots = write_plots(result, out.with_suffix(""))
    result["plots"] = [str(p) for p in plots]
    path = write_report(out.stem, result, out.parent)
    print(f"\nwrote {path}" + "".join(f", {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
