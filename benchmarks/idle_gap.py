"""Execution after an idle gap: how much slower an INFER runs when its CPU executor idled
before it, how many executions it takes to recover, and which lost state it is not.

    python -m benchmarks.idle_gap [--quick] [--models resnet-like,mlp] [--json OUT]

Why: on CPU executors the time of a batch depends on how long the lane idled before it
(docs/benchmarks-peer.md), which the paper's GPU executors do not show. It is what keeps tight
SLOs (2x-3x b1) and the light-load latency of docs/benchmarks-peer.md from their goals.

1. The real executor (ONNX Runtime, pinned to the last CPU, one intra-op thread: as the daemon
   runs it; this client on the other CPUs). Bursts of ``burst`` batch-1 INFERs, sent together,
   the first one's window opening ``gap`` after the previous burst ended: the execute duration
   the executor reports, by position in the burst (1st = after the gap, 2nd = after one
   execution, ...), for gaps of 0.3 to 30 ms (and the idle time measured before each
   burst); with the lane sleeping between actions (the default) and with ``--keep-warm-ms``
   over the longest gap (the lane polls, the CPU never idles), in executor processes that
   alternate between the two. Back to back (a full queue) is the reference. Gaps run
   round-robin, so a drift of the machine spreads over all of them.
2. In this process, pinned to the same CPU, the same backend and model: before each
   execution nothing (back to back), sleep 10 ms, spin 10 ms (the CPU stays busy, its caches
   untouched), sleep 10 ms then read every weight byte (the weights back in the caches), or
   write 64 MiB (every cache evicted, and no idle time). Which of them runs as slow as after
   a sleep says what the gap loses.

Writes ``results/idle_gap[-quick].json`` and ``.png`` (execute p50 vs gap by position; part
2 per condition), prints both tables. A benchmark for a quiet machine: the effect is the
machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.executor import Plan as ExecutorPlan
from benchmarks.executor import back_to_back_ns, pipelined
from benchmarks.lib import (
    RESULTS,
    machine_description,
    percentiles,
    pyplot,
    save,
    table,
    write_report,
)
from clockwork_async.demo import NEVER_NS, ExecutorSession, infer_action, spawn_executor
from clockwork_async.wire.messages import ActionResult, Load, ModelInfo

MS_NS = 1_000_000
WRITE_BYTES = 64 << 20
SEND_AHEAD_NS = 250_000  # a burst is sent at least this long before its window opens
PAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class Plan:
    bursts: int  # per gap and executor setting
    back_to_back: int
    in_process: int  # executions per part-2 condition
    burst: int = 4
    gaps_ms: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0, 30.0)
    rounds: int = 5  # per executor process, the gaps run round-robin this many times
    repeats: int = 2  # executor processes per lane setting, the settings alternating
    in_process_gap_ms: float = 10.0


QUICK = Plan(bursts=30, back_to_back=200, in_process=60)
FULL = Plan(bursts=320, back_to_back=2000, in_process=300, repeats=4)
SETTINGS = ("sleeps", "keep-warm")  # the execute lane between actions


def percentiles_ms(values_ns: Sequence[int]) -> dict[str, float | None]:
    """n and p50/p90/p99 in ms."""
    found = percentiles(values_ns, (50, 90, 99), scale=1 / MS_NS, digits=4, suffix="_ms")
    del found["max_ms"]
    return {"n": len(values_ns), **found}


# --- part 1: the real executor ------------------------------------------------------------------


async def burst_ns(
    session: ExecutorSession, model: ModelInfo, count: int, gap_ns: int, after_ns: int
) -> tuple[list[int], int, int]:
    """``count`` INFERs sent together, the first window opening ``gap_ns`` after
    ``after_ns`` (executor clock), or as soon as they can get there; returns their execute
    durations in order, the last end and the idle time measured before the first."""
    earliest_ns = max(after_ns + gap_ns, session.executor_now_ns() + SEND_AHEAD_NS)
    futures = [
        session.send(infer_action(model, 1, earliest_ns, NEVER_NS, seed)) for seed in range(count)
    ]
    results = [await future for future in futures]
    durations, end_ns = [], after_ns
    for result in results:
        if not isinstance(result, ActionResult) or not result.ok:
            raise RuntimeError(f"INFER failed: {result!r}")
        durations.append(result.durations_ns["execute"])
        end_ns = max(end_ns, result.end_ns)
    first = results[0]
    idle_ns = first.start_ns - after_ns if isinstance(first, ActionResult) else 0
    return durations, end_ns, idle_ns


async def gap_sweep(
    session: ExecutorSession, model: ModelInfo, plan: Plan
) -> dict[float, list[list[int]]]:
    """Per gap (ms) the bursts of one executor process: the idle time measured before each,
    then its durations; gaps round-robin."""
    found: dict[float, list[list[int]]] = {gap: [] for gap in plan.gaps_ms}
    after_ns = session.executor_now_ns()
    per_round = max(1, plan.bursts // plan.repeats // plan.rounds)
    for _ in range(plan.rounds):
        for gap_ms in plan.gaps_ms:
            for _ in range(per_round):
                durations, end_ns, idle_ns = await burst_ns(
                    session, model, plan.burst, round(gap_ms * MS_NS), after_ns
                )
                found[gap_ms].append([idle_ns, *durations])
                after_ns = end_ns
    return found


Samples = tuple[list[int], dict[float, list[list[int]]]]  # full queue; bursts by gap


async def executor_samples(name: str, path: Path, plan: Plan, cpu: int, setting: str) -> Samples:
    """One executor process (pinned to ``cpu``, lane ``setting``) through model ``name``:
    its share (1 / ``repeats``) of the full-queue and the burst samples."""
    keep_warm_ms = 2 * max(plan.gaps_ms)
    with tempfile.TemporaryDirectory(prefix="clockwork-idle-gap-") as folder:
        args = ["--backend", "onnxruntime", "--listen", f"unix:{folder}/executor.sock"]
        args += ["--weights-bytes", "256MiB", "--cpus", str(cpu)]
        if setting == "keep-warm":
            args += ["--keep-warm-ms", f"{keep_warm_ms:g}"]
        executor = await spawn_executor(args)
        try:
            session = await ExecutorSession.open(executor.address)
            await session.sync_clock()
            info = await session.register(name, str(path))
            await session.action(lambda i: Load(i, name, 0, NEVER_NS))
            share = ExecutorPlan((1,), plan.back_to_back // plan.repeats, 0, 0, warmup=20)
            reference = await back_to_back_ns(session, info, 1, share)
            await pipelined(session, lambda: infer_action(info, 1, 0, NEVER_NS), 20)
            sweep = await gap_sweep(session, info, plan)
            await session.close()
        finally:
            status = await executor.stop()
    if status != 0:
        raise RuntimeError(f"the executor exited {status}")
    return reference, sweep


def executor_part(name: str, path: Path, plan: Plan, cpu: int) -> list[dict[str, Any]]:
    """Rows for model ``name``: ``repeats`` executor processes per lane setting, the settings
    alternating (so a drift of the machine spreads over both)."""
    merged: dict[str, Samples] = {s: ([], {gap: [] for gap in plan.gaps_ms}) for s in SETTINGS}
    for repeat in range(plan.repeats):
        for setting in SETTINGS:
            print(
                f"  {name}: the executor, lane {setting} ({repeat + 1}/{plan.repeats})",
                file=sys.stderr,
                flush=True,
            )
            reference, sweep = asyncio.run(executor_samples(name, path, plan, cpu, setting))
            merged[setting][0].extend(reference)
            for gap_ms, bursts in sweep.items():
                merged[setting][1][gap_ms].extend(bursts)
    rows = []
    for setting, samples in merged.items():
        rows += executor_rows(name, setting, samples, plan)
    return rows


def executor_rows(name: str, setting: str, samples: Samples, plan: Plan) -> list[dict[str, Any]]:
    reference, sweep = samples
    base: dict[str, Any] = {"part": "executor", "model": name, "setting": setting}
    rows = [base | {"gap_ms": 0.0, "position": 0} | percentiles_ms(reference)]
    for gap_ms, bursts in sweep.items():
        idle_p50_ms = percentiles_ms([burst[0] for burst in bursts])["p50_ms"]
        for position in range(1, plan.burst + 1):
            values = [burst[position] for burst in bursts]
            where = {"gap_ms": gap_ms, "idle_p50_ms": idle_p50_ms, "position": position}
            rows.append(base | where | percentiles_ms(values))
    return rows


# --- part 2: in this process ---------------------------------------------------------------------


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def in_process_part(name: str, path: Path, plan: Plan, cpu: int) -> list[dict[str, Any]]:
    """Rows per condition for model ``name``, this process pinned to ``cpu`` meanwhile."""
    from executors.arena import NumpyArena
    from executors.backend import PageRun
    from executors.onnxruntime import OnnxRuntimeBackend, example_feeds

    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    arena = NumpyArena(PAGE_BYTES, 16)
    backend = OnnxRuntimeBackend(arena)
    try:
        model = backend.register(name, str(path), [1])
        runs, first = [], 0
        for count in model.run_pages:
            runs.append(PageRun(first, count))
            first += count
        loaded, _ = backend.load(model, runs)
        weights = [arena.view(run).view(np.uint64) for run in runs]
        feeds = example_feeds(model.inputs, 1)
        scratch = np.zeros(WRITE_BYTES, dtype=np.uint8)
        touch_ns: list[int] = []
        gap_s = plan.in_process_gap_ms / 1e3

        def sleep_then_read() -> None:
            time.sleep(gap_s)
            start_ns = time.perf_counter_ns()
            for view in weights:
                view.sum()
            touch_ns.append(time.perf_counter_ns() - start_ns)

        conditions: dict[str, Callable[[], Any]] = {
            "back to back": lambda: None,
            f"sleep {plan.in_process_gap_ms:g} ms": lambda: time.sleep(gap_s),
            f"spin {plan.in_process_gap_ms:g} ms": lambda: _spin(gap_s),
            f"sleep {plan.in_process_gap_ms:g} ms, read the weights": sleep_then_read,
            f"write {WRITE_BYTES >> 20} MiB": lambda: scratch.fill(1),
        }
        found: dict[str, list[int]] = {label: [] for label in conditions}
        for _ in range(20):
            backend.infer(loaded, 1, feeds)
        per_round = max(1, plan.in_process // plan.rounds)
        for _ in range(plan.rounds):
            for label, before in conditions.items():
                for _ in range(per_round):
                    before()
                    found[label].append(backend.infer(loaded, 1, feeds)[1]["execute"])
        backend.unload(loaded)
    finally:
        backend.close()
        arena.close()
        os.sched_setaffinity(0, affinity)
    rows = []
    for label, values in found.items():
        row: dict[str, Any] = {"part": "in process", "model": name, "condition": label}
        row |= percentiles_ms(values)
        if "read the weights" in label:
            row["read_weights_p50_ms"] = percentiles_ms(touch_ns)["p50_ms"]
        rows.append(row)
    return rows


# --- the run, the report ------------------------------------------------------------------------


def run(plan: Plan, models: Sequence[str]) -> dict[str, Any]:
    from clockwork_async.models.demo import default_directory, generate_demo_models

    paths = generate_demo_models(default_directory(), names=list(models))
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1]
    if len(cpus) > 1:  # this client stays off the executor's CPU
        os.sched_setaffinity(0, [c for c in cpus if c != cpu])
    started_s = time.monotonic()
    rows: list[dict[str, Any]] = []
    for name in models:
        rows += executor_part(name, paths[name], plan, cpu)
        print(f"  {name}: in process", file=sys.stderr, flush=True)
        rows += in_process_part(name, paths[name], plan, cpu)
    return {
        "machine": machine_description(),
        "plan": asdict(plan),
        "executor_cpu": cpu,
        "duration_s": round(time.monotonic() - started_s, 1),
        "rows": rows,
    }


def _reference(rows: list[dict[str, Any]], model: str, setting: str) -> float:
    for row in rows:
        if (row["part"], row["model"], row.get("setting"), row.get("position")) == (
            "executor",
            model,
            setting,
            0,
        ):
            return float(row["p50_ms"])
    return float("nan")


def _ms(row: dict[str, Any]) -> tuple[float, float, float]:
    return row["p50_ms"], row["p90_ms"], row["p99_ms"]


def executor_table(result: dict[str, Any]) -> str:
    """One line per model, lane setting and gap: the idle time measured before the bursts
    (p50), the p50 of each position in the burst, the p99 of the first, and the first's p50
    over the full queue's."""
    rows = [r for r in result["rows"] if r["part"] == "executor"]
    burst = max(r["position"] for r in rows)
    lines: list[tuple[Any, ...]] = []
    for model, setting in dict.fromkeys((r["model"], r["setting"]) for r in rows):
        ours = [r for r in rows if (r["model"], r["setting"]) == (model, setting)]
        full = next(r for r in ours if r["position"] == 0)
        blanks = ("",) * (burst - 1)
        lines.append((model, setting, "full queue", "", full["n"], full["p50_ms"], *blanks))
        lines[-1] += (full["p99_ms"], 1.0)
        for gap_ms in dict.fromkeys(r["gap_ms"] for r in ours if r["position"]):
            by_position = sorted((r for r in ours if r["gap_ms"] == gap_ms), key=_position)
            first = by_position[0]
            ratio = round(first["p50_ms"] / full["p50_ms"], 2)
            p50s = tuple(r["p50_ms"] for r in by_position)
            gap, idle = f"{gap_ms:g} ms", first["idle_p50_ms"]
            lines.append((model, setting, gap, idle, first["n"], *p50s, first["p99_ms"], ratio))
    headers: tuple[str, ...] = ("model", "lane", "gap", "idle p50 ms", "n")
    headers += tuple(f"p50 #{i + 1} ms" for i in range(burst))
    headers += ("p99 #1 ms", "#1 / full")
    return table(headers, lines)


def _position(row: dict[str, Any]) -> int:
    return int(row["position"])


def in_process_table(result: dict[str, Any]) -> str:
    rows = [r for r in result["rows"] if r["part"] == "in process"]
    lines = []
    for row in rows:
        base = next(r["p50_ms"] for r in rows if r["model"] == row["model"])
        ratio = round(row["p50_ms"] / base, 2)
        read_ms = row.get("read_weights_p50_ms")
        lines.append((row["model"], row["condition"], row["n"], *_ms(row), ratio, read_ms))
    headers = ("model", "before each", "n", "p50 ms", "p90 ms", "p99 ms", "p50 / b2b", "read ms")
    return table(headers, lines)


def print_report(result: dict[str, Any]) -> None:
    machine = result["machine"]
    print(
        f"\nmachine: {machine.get('cpu_model')}, {machine.get('cpus')} CPUs; executor on CPU "
        f"{result['executor_cpu']}; {result['duration_s']} s"
    )
    print("\n1. the executor: batch-1 execute duration by gap and position in the burst")
    print(executor_table(result))
    print("\n2. in process: batch-1 execute duration after each condition")
    print(in_process_table(result))


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    for column, model in enumerate(models):
        _gap_axes(axes[0][column], result["rows"], model)
        _condition_axes(axes[1][column], result["rows"], model)
    return save(plt, fig, path, dpi=90)


def _gap_axes(ax: Any, rows: list[dict[str, Any]], model: str) -> None:
    ours = [r for r in rows if r["part"] == "executor" and r["model"] == model]
    positions = sorted({r["position"] for r in ours if r["position"]})
    for setting, style in zip(SETTINGS, ("-", "--"), strict=True):
        for position in positions:
            points = [r for r in ours if r["setting"] == setting and r["position"] == position]
            ax.plot(
                [r["idle_p50_ms"] for r in points],
                [r["p50_ms"] for r in points],
                style,
                color=f"C{position - 1}",
                marker="o",
                label=f"lane {setting}, execution {position} after the gap",
            )
        ax.axhline(_reference(ours, model, setting), linestyle=":", color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("idle before the burst, p50 (ms); dotted: full queue")
    ax.set_ylabel("execute p50 (ms)")
    ax.set_title(f"{model} b1 in the executor")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _condition_axes(ax: Any, rows: list[dict[str, Any]], model: str) -> None:
    ours = [r for r in rows if r["part"] == "in process" and r["model"] == model]
    labels = [r["condition"] for r in ours]
    ax.barh(labels, [r["p50_ms"] for r in ours], label="p50")
    ax.barh(
        labels,
        [r["p90_ms"] - r["p50_ms"] for r in ours],
        left=[r["p50_ms"] for r in ours],
        alpha=0.4,
        label="to p90",
    )
    ax.invert_yaxis()
    ax.set_xlabel("execute (ms)")
    ax.set_title(f"{model} b1 in process, before each execution:")
    ax.legend(fontsize=7)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_gap", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="few samples (about half a minute)")
    parser.add_argument("--models", default="resnet-like,mlp", help="demo models, comma-separated")
    parser.add_argument("--json", type=Path, help="write the result here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    plan = QUICK if args.quick else FULL
    result = run(plan, [name for name in args.models.split(",") if name])
    print_report(result)
    stem = "idle_gap-quick" if args.quick else "idle_gap"
    path = write_report(stem, result) if args.json is None else _write(args.json, result)
    plot = write_plot(result, path.with_suffix(".png"))
    print(f"\nwrote {path}" + (f" and {plot}" if plot else ""))
    return 0


def _write(path: Path, result: dict[str, Any]) -> Path:
    return write_report(path.stem, result, path.parent or RESULTS)


if __name__ == "__main__":
    sys.exit(main())
