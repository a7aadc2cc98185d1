"""Experiment 6 of the Clockwork paper, scale: one controller core driving 10 to 150 simulated
executors in virtual time, load and model count growing with the executors.

    python -m benchmarks.scale [--quick] [--executors 10,25,50,100,150] [--profile] [--docs]

Per case: N simulated ResNet50-V100 executors, 100 N instances (100 per executor, resident
from the start: 700 of each executor's 1,376 pages), Poisson arrivals of 200 N req/s split
evenly over the instances (200 req/s per executor: about 55% of an executor at batch 1), 100 ms
SLO, `clockwork` policy. Full mode 20 s of virtual time per case, quick 2 s.

Measured per case, on this process's clock:
- the core's cost: every ``handle`` call timed (`lib.sim.TimedController`; two clock reads
  around the real core); the serving events' total (all but the registrations and joins at
  time 0, reported apart as set-up) over the requests (µs per request), and per call: p50 /
  p99 over the serving events and over arrivals alone;
- the whole process's CPU time per request (engine + core, set-up included) and wall time
  per virtual second;
- goodput, ok / requests, late (goal 0) and lost (goal 0).

``--profile`` runs the smallest and the biggest case again under cProfile (same duration) and
lists the functions with the most own time in the biggest, per request in both. Writes
``results/scale[-quick].json`` and ``results/scale[-quick].png``; ``--docs`` copies the PNG
to docs/img/exp6-*.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    NS_PER_S,
    RESULTS,
    copy_to_docs,
    load_average,
    machine_description,
    percent,
    pyplot,
    save,
    table,
    write_json,
)
from benchmarks.lib.sim import Row, run_sim
from clockwork_async.sim.workloads import poisson

SLO_MS = 100.0
MODELS_PER_EXECUTOR = 100
RATE_PER_EXECUTOR_RPS = 200.0
EXECUTORS = (10, 25, 50, 100, 150)


@dataclass(frozen=True)
class Plan:
    executors: tuple[int, ...] = EXECUTORS
    seconds: float = 20.0  # virtual, per case


FULL = Plan()
QUICK = Plan(seconds=2.0)


def run_case(executors: int, seconds: float) -> Row:
    models = MODELS_PER_EXECUTOR * executors
    rate_rps = RATE_PER_EXECUTOR_RPS * executors
    load = load_average()[0]
    print(
        f"scale: {executors} executors, {models} models, {rate_rps:g} req/s (load {load})",
        file=sys.stderr,
        flush=True,
    )
    run = run_sim(
        poisson(models, rate_rps, seconds),
        executors=executors,
        slo_ms=SLO_MS,
        preload=True,
        interval_ns=NS_PER_S,
        timed=True,
        progress_s=0.0,
        count_cold=False,
    )
    s = run.summary
    core = run.core_us or {}
    requests = max(s["requests"], 1)
    return {
        "executors": executors,
        "models": models,
        "rate_rps": rate_rps,
        "requests": s["requests"],
        "events": s["events"],
        "core_us_per_request": round(core["serving"]["total_ms"] * 1000 / requests, 2),
        "core_setup_ms": round(core["all"]["total_ms"] - core["serving"]["total_ms"], 3),
        "core_us_per_event": core["serving"],
        "core_us_per_arrival": core.get("RequestArrived", {}),
        "core_us_by_event": core,
        "cpu_us_per_request": round(run.cpu_s * 1e6 / requests, 2),
        "wall_seconds": s["wall_seconds"],
        "wall_s_per_virtual_s": round(s["wall_seconds"] / seconds, 3),
        "goodput_rps": s["goodput_rps"],
        "offered_rps": s["offered_rps"],
        "ok_over_requests": s["ok_over_requests"],
        "ok_over_accepted": s["ok_over_accepted"],
        "rejected": s["rejected"],
        "dropped": s["dropped"],
        "late": s["late"],
        "lost": s["lost"],
        "violations": s["violations"],
        "latency_ms": s["latency_ms"],
        "batch_sizes": s["batch_sizes"],
        "load_average_before": load,
    }


def profiled(executors: int, seconds: float) -> tuple[cProfile.Profile, int]:
    """One case under cProfile; returns the profiler and the number of requests."""
    profiler = cProfile.Profile()
    profiler.enable()
    run = run_sim(
        poisson(MODELS_PER_EXECUTOR * executors, RATE_PER_EXECUTOR_RPS * executors, seconds),
        executors=executors,
        slo_ms=SLO_MS,
        preload=True,
        interval_ns=NS_PER_S,
        progress_s=0.0,
        count_cold=False,
    )
    profiler.disable()
    return profiler, run.summary["requests"]


def own_time_per_request(
    profiler: cProfile.Profile, requests: int
) -> dict[str, tuple[float, float]]:
    """Per function (``file:line(name)``, paths from ``src/`` on): own time in µs and calls,
    each per request."""
    found = {}
    raw = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (path, line, name), (_, calls, own_s, _, _) in raw.items():
        short = path.split("/src/", 1)[-1].split("/benchmarks/", 1)[-1]
        found[f"{short}:{line}({name})"] = (own_s * 1e6 / requests, calls / requests)
    return found


def profile_growth(small: int, big: int, seconds: float, top: int = 20) -> Row:
    """The smallest and biggest cases under cProfile, each for ``seconds`` (so per-model
    set-up weighs the same per request in both): the ``top`` functions by own time in the big
    case, each function's own µs and calls per request in both, and their ratio. A call count
    per request that grows with the executors would be a loop over them; a growing time at
    the same count is a costlier call. Also the text listing of the big case by own time."""
    small_profiler, small_requests = profiled(small, seconds)
    big_profiler, big_requests = profiled(big, seconds)
    before = own_time_per_request(small_profiler, small_requests)
    after = own_time_per_request(big_profiler, big_requests)
    rows = []
    for name, (us, calls) in sorted(after.items(), key=lambda kv: -kv[1][0])[:top]:
        us_small, calls_small = before.get(name, (0.0, 0.0))
        rows.append(
            {
                "function": name,
                f"own_us_per_request_{small}": round(us_small, 3),
                f"own_us_per_request_{big}": round(us, 3),
                f"calls_per_request_{small}": round(calls_small, 3),
                f"calls_per_request_{big}": round(calls, 3),
                "ratio": round(us / us_small, 2) if us_small else None,
            }
        )
    text = io.StringIO()
    pstats.Stats(big_profiler, stream=text).sort_stats("tottime").print_stats(top)
    return {
        "small": {"executors": small, "requests": small_requests},
        "big": {"executors": big, "requests": big_requests},
        "profiled_total_us_per_request": {
            str(small): round(sum(us for us, _ in before.values()), 2),
            str(big): round(sum(us for us, _ in after.values()), 2),
        },
        "top_functions": rows,
        "by_tottime": text.getvalue(),
    }


def growth_table(profile: Row) -> str:
    small, big = profile["small"]["executors"], profile["big"]["executors"]
    headers = ["function", f"µs/req @{small}", f"µs/req @{big}", "ratio"]
    headers += [f"calls/req @{small}", f"calls/req @{big}"]
    rows = [
        [
            r["function"],
            r[f"own_us_per_request_{small}"],
            r[f"own_us_per_request_{big}"],
            r["ratio"],
            r[f"calls_per_request_{small}"],
            r[f"calls_per_request_{big}"],
        ]
        for r in profile["top_functions"]
    ]
    return table(headers, rows)


# --- reporting -----------------------------------------------------------------------------------


def cases_table(rows: list[Row]) -> str:
    headers = ["executors", "models", "offered/s", "requests", "core µs/req", "event p50 µs"]
    headers += ["event p99 µs", "arrival p50 µs", "arrival p99 µs", "CPU µs/req"]
    headers += ["set-up ms", "wall s/virtual s", "goodput/s", "ok/req %", "late", "lost"]
    return table(
        headers,
        [
            [
                r["executors"],
                r["models"],
                r["offered_rps"],
                r["requests"],
                r["core_us_per_request"],
                r["core_us_per_event"].get("p50_us"),
                r["core_us_per_event"].get("p99_us"),
                r["core_us_per_arrival"].get("p50_us"),
                r["core_us_per_arrival"].get("p99_us"),
                r["cpu_us_per_request"],
                r["core_setup_ms"],
                r["wall_s_per_virtual_s"],
                r["goodput_rps"],
                percent(r["ok_over_requests"], 3),
                r["late"],
                r["lost"],
            ]
            for r in rows
        ],
    )


def growth(rows: list[Row]) -> Row:
    """Cost of the biggest case over the smallest's."""
    first, last = rows[0], rows[-1]

    def ratio(key: str) -> float | None:
        return round(last[key] / first[key], 3) if first[key] else None

    return {
        "from_executors": first["executors"],
        "to_executors": last["executors"],
        "core_us_per_request": ratio("core_us_per_request"),
        "cpu_us_per_request": ratio("cpu_us_per_request"),
        "event_p50": round(
            last["core_us_per_event"]["p50_us"] / first["core_us_per_event"]["p50_us"], 3
        ),
    }


def write_plot(rows: list[Row], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    xs = [r["executors"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r["core_us_per_request"] for r in rows], "o-", label="core µs per request")
    left.plot(xs, [r["cpu_us_per_request"] for r in rows], "s-", label="process CPU µs per request")
    left.plot(xs, [r["core_us_per_event"]["p50_us"] for r in rows], "^-", label="event p50 µs")
    left.plot(xs, [r["core_us_per_event"]["p99_us"] for r in rows], "v-", label="event p99 µs")
    left.set(xlabel="simulated executors", ylabel="µs", title="controller cost")
    left.legend(fontsize="small")
    right.plot(xs, [r["wall_s_per_virtual_s"] for r in rows], "o-", label="wall s per virtual s")
    right.axhline(1.0, color="gray", linestyle="--", label="real time")
    right.set(xlabel="simulated executors", ylabel="s", title="simulation speed")
    right.legend(fontsize="small")
    return save(plt, fig, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="2 s of virtual time per case")
    parser.add_argument("--executors", help="comma-separated counts (default 10,25,50,100,150)")
    parser.add_argument("--profile", action="store_true", help="cProfile the biggest case")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--docs", action="store_true", help="copy the PNG to docs/img/exp6-*")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.executors:
        counts = tuple(sorted(int(n) for n in args.executors.split(",")))
        if not counts or min(counts) < 1:
            parser.error("executors must be positive integers")
        plan = Plan(counts, plan.seconds)
    machine = machine_description()
    rows = [run_case(n, plan.seconds) for n in plan.executors]
    result: dict[str, Any] = {
        "experiment": "6: scale",
        "quick": args.quick,
        "plan": asdict(plan),
        "models_per_executor": MODELS_PER_EXECUTOR,
        "rate_per_executor_rps": RATE_PER_EXECUTOR_RPS,
        "slo_ms": SLO_MS,
        "machine": machine,
        "cases": rows,
        "growth": growth(rows),
        "goals": {"late": sum(r["late"] for r in rows), "lost": sum(r["lost"] for r in rows)},
    }
    if args.profile:
        small, big = plan.executors[0], plan.executors[-1]
        print(f"scale: profiling {small} and {big} executors", file=sys.stderr, flush=True)
        result["profile"] = profile_growth(small, big, plan.seconds)
    result["load_average_end"] = load_average()
    stem = "scale-quick" if args.quick else "scale"
    plot = write_plot(rows, args.out / f"{stem}.png")
    result["plots"] = [str(plot)] if plot else []
    if args.docs and plot:
        result["docs_plots"] = [str(p) for p in copy_to_docs([plot], "exp6")]
    write_json("scale", args.quick, result, args.out)
    print(cases_table(rows))
    print(f"growth {result['growth']}")
    if args.profile:
        totals = result["profile"]["profiled_total_us_per_request"]
        print(f"\nown time per request under cProfile, by executors: {totals}")
        print(growth_table(result["profile"]))
    return 1 if result["goals"]["late"] or result["goals"]["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
