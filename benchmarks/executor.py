"""Executor benchmark: how predictable are INFER and LOAD on this machine?

    python -m benchmarks.executor [--quick] [--json OUT]

Per model (demo ``tiny``, ``mlp``, ``resnet-like``; plus the models in ../shared/data/models
when present) and batch size, the INFER *execute* duration as the executor measures and
reports it (``ActionResult.durations_ns["execute"]``): p50, p99, p99.9, max and p99/p50,

- with the executor pinned to one core (``--cpus``) and unpinned;
- back to back (a queue of actions kept full, so the lane never idles) and after 10 ms idle
  (each INFER's window opens 10 ms after the previous one ended: caches have gone cold).

LOAD: the executor-reported ``load`` duration over LOAD/UNLOAD cycles against the memcpy floor
of the same number of bytes (``np.copyto`` between two committed buffers, in this process).

Targets (issue 2): LOAD <= 2x the memcpy floor; INFER p99/p50 <= 1.2 for ms-scale models
pinned and back to back. Prints a table, writes JSON with a machine description. This is a
benchmark, not a test: run ``--quick`` on a shared machine, the full run on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import machine_description, percentile
from clockwork_async.demo import (
    NEVER_NS,
    DemoError,
    ExecutorSession,
    infer_action,
    spawn_executor,
)
from clockwork_async.wire.messages import (
    ActionResult,
    Load,
    Message,
    ModelInfo,
    RegisterModel,
    Unload,
    UnregisterModel,
)

MS_NS = 1_000_000
DEMO_MODELS = ("tiny", "mlp", "resnet-like")
SHARED_MODELS_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "models"
IDLE_NS = 10 * MS_NS
OUTSTANDING = 32  # INFERs kept queued at the executor in back-to-back runs


@dataclass(frozen=True)
class Plan:
    batch_sizes: tuple[int, ...]
    back_to_back: int  # INFERs per (model, batch size), after WARMUP
    cold: int
    load_cycles: int
    warmup: int = 5


QUICK = Plan(batch_sizes=(1, 4, 16), back_to_back=100, cold=20, load_cycles=10)
FULL = Plan(batch_sizes=(1, 2, 4, 8, 16), back_to_back=2000, cold=200, load_cycles=50)


@dataclass(frozen=True)
class InferStats:
    model: str
    batch_size: int
    pinned: bool
    mode: str  # "back_to_back" or "after_idle"
    n: int
    p50_ns: int
    p99_ns: int
    p999_ns: int
    max_ns: int
    p99_over_p50: float


@dataclass(frozen=True)
class LoadStats:
    model: str
    pinned: bool
    weights_bytes: int
    n: int
    load_p50_ns: int
    load_p99_ns: int
    memcpy_p50_ns: int
    load_over_memcpy: float


def infer_stats(model: str, batch: int, pinned: bool, mode: str, values: list[int]) -> InferStats:
    ordered = sorted(values)
    p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
    return InferStats(
        model,
        batch,
        pinned,
        mode,
        len(ordered),
        p50,
        p99,
        percentile(ordered, 99.9),
        ordered[-1],
        round(p99 / p50, 3),
    )


def memcpy_floor_ns(nbytes: int, repeats: int) -> int:
    """Median time of copying ``nbytes`` between two committed numpy buffers."""
    source = np.ones(max(nbytes, 1), dtype=np.uint8)
    target = np.zeros_like(source)
    target.fill(1)  # commit the pages before timing
    times = []
    for _ in range(repeats):
        start_ns = time.perf_counter_ns()
        np.copyto(target, source)
        times.append(time.perf_counter_ns() - start_ns)
    return percentile(sorted(times), 50)


# --- driving one executor ---------------------------------------------------------------------


async def pipelined(
    session: ExecutorSession, make: Callable[[], Callable[[int], Message]], count: int
) -> list[ActionResult]:
    """Run ``count`` actions keeping up to OUTSTANDING queued. Raises DemoError on failure."""
    pending: set[asyncio.Future[Message]] = set()
    results: list[ActionResult] = []
    sent = 0
    while len(results) < count:
        while sent < count and len(pending) < OUTSTANDING:
            pending.add(session.send(make()))
            sent += 1
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        results += [_ok(future.result()) for future in done]
    return results


def _ok(reply: Message) -> ActionResult:
    if not isinstance(reply, ActionResult) or not reply.ok:
        raise DemoError(f"action failed: {reply!r}")
    return reply


async def back_to_back_ns(
    session: ExecutorSession, model: ModelInfo, batch: int, plan: Plan
) -> list[int]:
    """Execute durations of a full queue of INFERs (warm-up results dropped)."""
    results = await pipelined(
        session, lambda: infer_action(model, batch, 0, NEVER_NS), plan.warmup + plan.back_to_back
    )
    return [result.durations_ns["execute"] for result in results[plan.warmup :]]


async def after_idle_ns(
    session: ExecutorSession, model: ModelInfo, batch: int, plan: Plan
) -> list[int]:
    """Execute durations of INFERs each starting IDLE_NS after the previous one ended."""
    durations, previous_end_ns = [], session.executor_now_ns()
    for _ in range(plan.cold):
        earliest_ns = max(previous_end_ns + IDLE_NS, session.executor_now_ns() + MS_NS)
        result = _ok(await session.call(infer_action(model, batch, earliest_ns, NEVER_NS)))
        durations.append(result.durations_ns["execute"])
        previous_end_ns = result.end_ns
    return durations


async def load_cycles_ns(session: ExecutorSession, model: str, cycles: int) -> list[int]:
    durations = []
    for _ in range(cycles):
        loaded = _ok(await session.call(lambda i: Load(i, model, 0, NEVER_NS)))
        durations.append(loaded.durations_ns["load"])
        _ok(await session.call(lambda i: Unload(i, model)))
    return durations


async def bench_model(
    session: ExecutorSession,
    name: str,
    path: Path,
    plan: Plan,
    pinned: bool,
    report: dict[str, Any],
) -> None:
    reply = await session.call(lambda i: RegisterModel(i, name, str(path)))
    if not isinstance(reply, ModelInfo):
        report["errors"].append(f"{name}: {reply!r}")
        return
    loads = sorted(await load_cycles_ns(session, name, plan.load_cycles))
    floor_ns = memcpy_floor_ns(reply.weights_bytes, repeats=max(plan.load_cycles, 10))
    report["load"].append(
        LoadStats(
            name,
            pinned,
            reply.weights_bytes,
            len(loads),
            percentile(loads, 50),
            percentile(loads, 99),
            floor_ns,
            round(percentile(loads, 50) / max(floor_ns, 1), 2),
        )
    )
    _ok(await session.call(lambda i: Load(i, name, 0, NEVER_NS)))
    for batch in [b for b in plan.batch_sizes if b in reply.batch_sizes] or [1]:
        warm = await back_to_back_ns(session, reply, batch, plan)
        report["infer"].append(infer_stats(name, batch, pinned, "back_to_back", warm))
        cold = await after_idle_ns(session, reply, batch, plan)
        report["infer"].append(infer_stats(name, batch, pinned, "after_idle", cold))
    _ok(await session.call(lambda i: Unload(i, name)))
    _ok(await session.call(lambda i: UnregisterModel(i, name)))


async def bench_executor(
    models: dict[str, Path], plan: Plan, cpu: int | None, report: dict[str, Any]
) -> None:
    """One executor process (pinned to ``cpu`` or unpinned) through every model."""
    with tempfile.TemporaryDirectory(prefix="clockwork-bench-") as folder:
        args = ["--backend", "onnxruntime", "--listen", f"unix:{folder}/executor.sock"]
        args += ["--weights-bytes", "512MiB"] + (["--cpus", str(cpu)] if cpu is not None else [])
        executor = await spawn_executor(args)
        try:
            session = await ExecutorSession.open(executor.address)
            await session.sync_clock()
            for name, path in models.items():
                print(f"  {name} ({'pinned' if cpu is not None else 'unpinned'})", flush=True)
                await bench_model(session, name, path, plan, cpu is not None, report)
            await session.close()
        finally:
            status = await executor.stop()
        if status != 0:
            report["errors"].append(f"executor exited {status}")


# --- reporting ----------------------------------------------------------------------------------


def _ms(ns: int) -> str:
    return f"{ns / MS_NS:8.3f}"


def print_tables(report: dict[str, Any]) -> None:
    print("\nINFER execute duration (ms) as measured inside the executor")
    print(
        f"{'model':<27}{'b':>3} {'pin':<6}{'mode':<13}{'n':>5}"
        f"{'p50':>9}{'p99':>9}{'p99.9':>9}{'max':>9}{'p99/p50':>9}"
    )
    for s in report["infer"]:
        pin = "yes" if s.pinned else "no"
        print(
            f"{s.model:<27}{s.batch_size:>3} {pin:<6}{s.mode:<13}{s.n:>5}"
            f"{_ms(s.p50_ns)} {_ms(s.p99_ns)} {_ms(s.p999_ns)} {_ms(s.max_ns)}"
            f"{s.p99_over_p50:>8.2f}"
        )
    print("\nLOAD (ms) vs the memcpy floor of the same weights")
    print(f"{'model':<27}{'pin':<6}{'MB':>8}{'n':>5}{'p50':>9}{'p99':>9}{'memcpy':>9}{'ratio':>9}")
    for s in report["load"]:
        pin = "yes" if s.pinned else "no"
        print(
            f"{s.model:<27}{pin:<6}{s.weights_bytes / 1e6:8.2f}{s.n:>5}"
            f"{_ms(s.load_p50_ns)} {_ms(s.load_p99_ns)} {_ms(s.memcpy_p50_ns)}"
            f" {s.load_over_memcpy:>8.2f}"
        )
    for error in report["errors"]:
        print(f"error: {error}")


def find_models(include_shared: bool) -> dict[str, Path]:
    from clockwork_async.models.demo import default_directory, generate_demo_models

    models = dict(generate_demo_models(default_directory(), names=list(DEMO_MODELS)))
    if include_shared and SHARED_MODELS_DIR.is_dir():
        models |= {f"shared-{p.stem}": p for p in sorted(SHARED_MODELS_DIR.glob("*.onnx"))}
    return models


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    models = find_models(include_shared=not args.no_shared)
    cpus = sorted(os.sched_getaffinity(0))
    executor_cpu = cpus[-1]
    if len(cpus) > 1:  # keep this client off the executor's core
        os.sched_setaffinity(0, [c for c in cpus if c != executor_cpu])
    report: dict[str, Any] = {
        "machine": machine_description(),
        "plan": asdict(plan),
        "executor_cpu": executor_cpu,
        "infer": [],
        "load": [],
        "errors": [],
    }
    for cpu in (executor_cpu, None):
        await bench_executor(models, plan, cpu, report)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.executor", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="few samples, batch 1/4/16")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-shared", action="store_true", help="demo models only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    report = uvloop.run(run(args))
    print_tables(report)
    if args.json:
        serialisable = {
            **report,
            "infer": [asdict(s) for s in report["infer"]],
            "load": [asdict(s) for s in report["load"]],
        }
        args.json.write_text(json.dumps(serialisable, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
