"""Issue 29, real time: why two daemons with the same settings serve very different in-SLO
goodput at ``peer_ray``'s 200% load point, measured side by side, interleaved
(docs/benchmarks.md, "Real time at 200% load: what differs between two runs").

    python -m benchmarks.overload_ab [--rounds N] [--point-s S] [--slo-multiple M]
        [--load L] [--systems A,B] [--shapes poisson,smooth,stalled]
        [--generator-nice 10,0] [--disturb none,cpu0,cpu1] [--json OUT]

One daemon per system (`VARIANTS`: by default ``clockwork`` and ``clockwork-warm``, whose keys
are today's defaults for CPU executors) runs at once on the default executors (controller on
CPU 0, one ONNX Runtime executor pinned to CPU 1), all on the first one's registration profile
(copied into the others' folders before they start). Capacity and b1 are measured as
`peer_ray` does. Then ``rounds`` rounds: in each, every variant (shape x generator nice x
disturbance, `Plan`) and every system in turn (orders alternate per round) gets the same
seeded arrivals at ``load`` x capacity for ``point_s`` from ``clockwork-async bench`` (pinned
to CPU 0: `benchmarks.lib.run_bench`) with one row per request.

Per run it reports what could differ (`analyse_rows`, `stats_delta`): the load as sent (the
generator's send lag, sends per 1 ms at the worst, the longest gap), the daemon's answers
(refusal reasons, drops, late, batch sizes of ok replies, predicted and measured execute
times), the daemon's loop lag and prediction error from its stats, and where the CPU went
during the run (per-CPU busy time from /proc/stat against the CPU time of the daemon, its
executors and the generator: the rest is other processes, e.g. other users of a shared VM).
Writes ``results/overload_ab.json``; prints one line per run and each factor's rank
correlation with the in-SLO goodput (`correlations`).

Invariants: the runs of one round share their arrivals (their seed); a ``smooth`` and a
``stalled`` run of one round send the same requests, only their times differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cpu_serving import MODEL, rule_capacity
from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    DaemonProcess,
    ModelFolder,
    children,
    daemon_stats,
    demo_model_bytes,
    load_average,
    machine_description,
    percentiles_ms,
    registration_profile,
    run_bench,
    run_uvloop,
    start_daemon,
    write_report,
)
from benchmarks.peer_ray import CAPACITY_SLO_MS, CONTROLLERS, SATURATION_FACTOR

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
SYSTEMS = ("clockwork", "clockwork-warm")
# Beside peer_ray's systems, the clockwork policy predicting a lower percentile of its window
# of 10 measured durations (the default 99th is the window's largest: one slow run among the
# last 10, e.g. while another process had the executor's CPU, sets the prediction).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **CONTROLLERS,
    "clockwork-p90": ("clockwork", {"percentile": 90.0}),
    "clockwork-p50": ("clockwork", {"percentile": 50.0}),
}
TICKS_PER_S = 100  # USER_HZ: /proc/stat and /proc/PID/stat count in these


@dataclass(frozen=True)
class Plan:
    rounds: int = 4
    point_s: float = 3.0
    saturation_s: float = 4.0
    slo_multiple: float = 10.0
    load: float = 2.0
    disturb: tuple[str, ...] = ("none",)  # `DISTURBANCES` cycled through in every round
    generator_nice: tuple[int, ...] = (GENERATOR_NICE,)  # likewise, the generator's nice
    shapes: tuple[str, ...] = ("poisson",)  # likewise, `SHAPES`
    systems: tuple[str, ...] = SYSTEMS


# A disturbance: a process pinned to one CPU at nice 0 that is busy HOG_BUSY_MS of every
# HOG_PERIOD_MS for the run (what another user's test run does to a shared 2-vCPU VM), on the
# controller's and generator's CPU 0 or on the executor's CPU 1.
DISTURBANCES = {"none": None, "cpu0": 0, "cpu1": 1}
HOG_BUSY_MS, HOG_PERIOD_MS = 5.0, 10.0
HOG_CODE = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
busy_s, period_s = float(sys.argv[2]) / 1e3, float(sys.argv[3]) / 1e3
while (now := time.monotonic()) < end:
    while time.monotonic() < now + busy_s:
        pass
    time.sleep(period_s - busy_s)
"""


# The arrivals' shape: ``poisson`` = bench's own Poisson schedule (``--rate``); ``smooth`` =
# the same kind of schedule written to a per-request log and replayed (``--replay``);
# ``stalled`` = that log as a generator that stalls for STALL_MS of every STALL_PERIOD_MS
# would send it (`stalled_ns`: what a generator starved of its CPU does), replayed likewise.
# smooth against stalled isolates the effect of the generator's bursts on the daemon.
SHAPES = ("poisson", "smooth", "stalled")
STALL_PERIOD_MS, STALL_MS = 100.0, 20.0


def stalled_ns(times_ns: Sequence[int], period_ns: int, stall_ns: int) -> list[int]:
    """Send times of a generator that stalls for the first ``stall_ns`` of every
    ``period_ns`` and then sends at once what fell due meanwhile."""
    return [t if t % period_ns >= stall_ns else t - t % period_ns + stall_ns for t in times_ns]


def poisson_times_ns(rate_rps: float, duration_s: float, seed: int) -> list[int]:
    """A Poisson schedule (ns from 0) of ``rate_rps`` over ``duration_s``."""
    rng = np.random.default_rng(seed)
    count = rng.poisson(rate_rps * duration_s)
    return sorted(int(t) for t in rng.uniform(0, duration_s * NS_PER_S, count))


def write_schedule(path: Path, times_ns: Sequence[int], model: str) -> Path:
    """A per-request log (`clockwork_async.sim.replay`'s format) of ``times_ns``. A replay
    counts from its first row, so the first request is moved to 0: the others keep their
    times (and a stalled schedule its phase)."""
    rows = [0, *times_ns[1:]] if times_ns else []
    lines = ["timestamp_ms,model", *(f"{t / NS_PER_MS:.6f},{model}" for t in rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def shape_flags(
    shape: str, folder: Path, rate_rps: float, duration_s: float, seed: int
) -> list[str]:
    """bench flags for one run's arrivals of ``shape`` (`SHAPES`)."""
    if shape == "poisson":
        return ["--rate", f"{rate_rps:.3f}"]
    times_ns = poisson_times_ns(rate_rps, duration_s, seed)
    if shape == "stalled":
        times_ns = stalled_ns(
            times_ns, round(STALL_PERIOD_MS * NS_PER_MS), round(STALL_MS * NS_PER_MS)
        )
    path = write_schedule(folder / f"schedule-{shape}-{seed}.csv", times_ns, MODEL)
    return ["--replay", str(path)]


def start_hog(cpu: int, seconds: float) -> subprocess.Popen[bytes]:
    """The disturbance on ``cpu`` for ``seconds``."""
    argv = [sys.executable, "-c", HOG_CODE, str(seconds), str(HOG_BUSY_MS), str(HOG_PERIOD_MS)]
    return subprocess.Popen(argv, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


# --- where the CPU went --------------------------------------------------------------------------


def cpu_busy_ticks() -> dict[int, int]:
    """Busy ticks (all but idle and iowait) of each CPU since boot, from /proc/stat."""
    found = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields]
            found[int(name[3:])] = sum(values) - values[3] - values[4]
    return found


def process_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def tree_ticks(pids: Sequence[int]) -> int:
    """CPU ticks of ``pids`` and their live children."""
    return sum(process_ticks(p) + sum(process_ticks(c) for c in children(p)) for p in pids)


# --- one run -------------------------------------------------------------------------------------


def analyse_rows(rows: Mapping[str, list[Any]], slo_ms: float, duration_s: float) -> dict[str, Any]:
    """What one bench run's rows say: the load as sent and the answers."""
    sent_ns = rows["sent_ns"]
    lag_ns = rows["lag_ns"]
    statuses = Counter(rows["status"])
    slo_ns = slo_ms * NS_PER_MS
    in_slo = sum(
        1
        for status, latency in zip(rows["status"], rows["latency_ns"], strict=True)
        if status == "ok" and latency <= slo_ns
    )
    per_ms = Counter((t - sent_ns[0]) // NS_PER_MS for t in sent_ns) if sent_ns else Counter()
    gaps_ns = [b - a for a, b in pairwise(sent_ns)]
    ok_batches = Counter(
        b for s, b in zip(rows["status"], rows["batch_size"], strict=True) if s == "ok"
    )
    lagged = [lag > 2 * NS_PER_MS for lag in lag_ns]
    refused_when = Counter(
        (late, status)
        for late, status in zip(lagged, rows["status"], strict=True)
        if status in ("infeasible", "overloaded")
    )
    executed = [e for e in rows["execute_ns"] if e]
    predicted = [p for p in rows["predicted_ns"] if p]
    return {
        "requests": len(sent_ns),
        "in_slo": in_slo,
        "in_slo_rps": round(in_slo / duration_s, 1),
        "statuses": dict(statuses.most_common()),
        "send_lag_ms": percentiles_ms(lag_ns, (50, 99)),
        "sent_lagged_over_2ms": sum(lagged),
        "max_sends_per_ms": max(per_ms.values(), default=0),
        "max_gap_ms": round(max(gaps_ns, default=0) / NS_PER_MS, 3),
        "refused_after_lag": sum(n for (late, _), n in refused_when.items() if late),
        "ok_batch_sizes": dict(sorted(ok_batches.items())),
        "ok_mean_batch": round(
            sum(b * n for b, n in ok_batches.items()) / max(1, sum(ok_batches.values())), 2
        ),
        "execute_ms": percentiles_ms(executed, (50, 99)),
        "predicted_ms": percentiles_ms(predicted, (50, 99)),
    }


def stats_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Outcome and core counter deltas; loop lag and prediction error after the run."""
    outcomes = {
        k: v - before["outcomes"].get(k, 0)
        for k, v in after["outcomes"].items()
        if v - before["outcomes"].get(k, 0)
    }
    counters = {
        k: v - before["core_counters"].get(k, 0)
        for k, v in after["core_counters"].items()
        if v - before["core_counters"].get(k, 0)
    }
    lag = after["loop_lag"]
    errors = after["prediction_errors"]
    return {
        "outcomes": outcomes,
        "core_counters": counters,
        "loop_lag_ms": {
            "p50": lag["p50_ns"] / NS_PER_MS,
            "p99": lag["p99_ns"] / NS_PER_MS,
            "max": lag["max_ns"] / NS_PER_MS,
            "timer_late_p99": lag["timer_late_p99_ns"] / NS_PER_MS,
        },
        "prediction_error_ms": {
            "p50": errors["p50_ns"] / NS_PER_MS,
            "p99": errors["p99_ns"] / NS_PER_MS,
            "underpredicted": errors["underpredicted"],
            "count": errors["count"],
        },
    }


def one_run(
    daemon: DaemonProcess,
    folder: Path,
    name: str,
    rate_rps: float,
    slo_ms: float,
    plan: Plan,
    seed: int,
    disturb: str = "none",
    nice: int = GENERATOR_NICE,
    shape: str = "poisson",
) -> dict[str, Any]:
    import json

    rows_path = folder / f"{name}-{seed}-rows.json"
    flags = ["--model", MODEL, *shape_flags(shape, folder, rate_rps, plan.point_s, seed)]
    flags += ["--duration-s", str(plan.point_s)]
    flags += ["--slo-ms", str(slo_ms), "--seed", str(seed), "--rows", str(rows_path)]
    before = run_uvloop(daemon_stats(daemon.api))
    cpus_before, ours_before = cpu_busy_ticks(), tree_ticks([daemon.pid])
    started = time.monotonic()
    cpu = DISTURBANCES[disturb]
    hog = start_hog(cpu, plan.point_s + 1.0) if cpu is not None else None
    try:
        out = folder / f"{name}-{seed}-{disturb}-{nice}-{shape}.json"
        summary = run_bench(daemon.api, out, flags, nice=nice)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    wall_s = time.monotonic() - started
    cpus_after, ours_after = cpu_busy_ticks(), tree_ticks([daemon.pid])
    after = run_uvloop(daemon_stats(daemon.api))
    rows = json.loads(rows_path.read_text())["rows"]
    busy_s = {cpu: (cpus_after[cpu] - cpus_before[cpu]) / TICKS_PER_S for cpu in cpus_after}
    daemon_s = (ours_after - ours_before) / TICKS_PER_S
    bench_s = summary["client"]["cpu_s"]
    return {
        "system": name,
        "seed": seed,
        "disturb": disturb,
        "generator_nice": nice,
        "shape": shape,
        **analyse_rows(rows, slo_ms, plan.point_s),
        "bench": {"send": summary["send"], "client": summary["client"]},
        "daemon": stats_delta(before, after),
        "cpu": {
            "wall_s": round(wall_s, 2),
            "busy_s": {str(c): round(s, 2) for c, s in busy_s.items()},
            "daemon_tree_s": round(daemon_s, 2),
            "bench_s": bench_s,
            "others_s": round(sum(busy_s.values()) - daemon_s - bench_s, 2),
        },
        "load_average": load_average()[0],
    }


# --- the experiment ------------------------------------------------------------------------------


def start_daemons(
    root: Path, model: dict[str, ModelFolder], systems: Sequence[str]
) -> dict[str, DaemonProcess]:
    """A daemon per system, the others on the first's registration profile (copied before
    they start)."""
    daemons: dict[str, DaemonProcess] = {}
    first = root / systems[0]
    policy, keys = VARIANTS[systems[0]]
    daemons[systems[0]] = start_daemon(first, model, policy, keys)
    for system in systems[1:]:
        folder = root / system
        shutil.copytree(first / "profiles", folder / "profiles")
        policy, keys = VARIANTS[system]
        daemons[system] = start_daemon(folder, model, policy, keys)
    return daemons


def run(plan: Plan, root: Path) -> dict[str, Any]:
    onnx = demo_model_bytes(root / "demo", [MODEL])[MODEL]
    model = {MODEL: ModelFolder(onnx)}
    daemons = start_daemons(root, model, plan.systems)
    try:
        profile = registration_profile(root / plan.systems[0])
        rule = rule_capacity(profile, CAPACITY_SLO_MS)
        b1_ms = rule["execute_ms_by_batch"][min(rule["execute_ms_by_batch"])]
        first = daemons[plan.systems[0]]
        flags = ["--model", MODEL, "--rate", f"{SATURATION_FACTOR * rule['rps']:.3f}"]
        flags += ["--duration-s", str(plan.saturation_s), "--slo-ms", str(CAPACITY_SLO_MS)]
        capacity_rps = run_bench(first.api, root / "sat.json", [*flags, "--seed", "1"])[
            "goodput_rps"
        ]
        slo_ms = round(plan.slo_multiple * b1_ms, 3)
        rate_rps = plan.load * capacity_rps
        print(
            f"b1 {b1_ms:.3f} ms, capacity {capacity_rps:.0f} req/s: {rate_rps:.0f} req/s at "
            f"SLO {slo_ms} ms",
            file=sys.stderr,
            flush=True,
        )
        runs = []
        for index in range(plan.rounds):
            order = plan.systems if index % 2 == 0 else plan.systems[::-1]
            variants = [
                (d, n, shape)
                for d in plan.disturb
                for n in plan.generator_nice
                for shape in plan.shapes
            ]
            if index % 2:
                variants.reverse()
            for disturb, nice, shape in variants:
                for system in order:
                    found = one_run(
                        daemons[system],
                        root / system,
                        system,
                        rate_rps,
                        slo_ms,
                        plan,
                        100 + index,
                        disturb,
                        nice,
                        shape,
                    )
                    runs.append(found)
                    print(line(found), file=sys.stderr, flush=True)
    finally:
        for daemon in daemons.values():
            daemon.stop()
    return {
        "b1_ms": b1_ms,
        "capacity_rps": capacity_rps,
        "rule_capacity_rps": rule_capacity(profile, slo_ms)["rps"],
        "slo_ms": slo_ms,
        "rate_rps": rate_rps,
        "runs": runs,
    }


def line(found: Mapping[str, Any]) -> str:
    """One run in a line."""
    statuses, cpu, daemon = found["statuses"], found["cpu"], found["daemon"]
    return (
        f"  {found['system']:>14} {found['shape']:>7} {found['disturb']:>4} "
        f"nice {found['generator_nice']:>2} "
        f"seed {found['seed']}: in SLO "
        f"{found['in_slo_rps']:7.1f}/s "
        f"infeasible {statuses.get('infeasible', 0):5} overloaded "
        f"{statuses.get('overloaded', 0):4} dropped {statuses.get('dropped', 0):4} late "
        f"{statuses.get('late', 0):4} | batch {found['ok_mean_batch']:5.2f} exec p50 "
        f"{found['execute_ms']['p50']} pred p50 {found['predicted_ms']['p50']} | lag p99 "
        f"{found['send_lag_ms']['p99']} ms, >2ms {found['sent_lagged_over_2ms']}, max/ms "
        f"{found['max_sends_per_ms']}, gap {found['max_gap_ms']} ms | loop p99 "
        f"{daemon['loop_lag_ms']['p99']:.2f} ms | cpu0 {cpu['busy_s'].get('0')} cpu1 "
        f"{cpu['busy_s'].get('1')} daemon {cpu['daemon_tree_s']} bench {cpu['bench_s']} "
        f"others {cpu['others_s']} | load {found['load_average']}"
    )


FACTORS = {
    "send lag p99": lambda r: r["send_lag_ms"]["p99"],
    "sent more than 2 ms late": lambda r: r["sent_lagged_over_2ms"],
    "max sends per ms": lambda r: r["max_sends_per_ms"],
    "longest send gap": lambda r: r["max_gap_ms"],
    "predicted / measured execute p50": lambda r: (
        (r["predicted_ms"]["p50"] or 0) / (r["execute_ms"]["p50"] or 1)
    ),
    "prediction error p50": lambda r: r["daemon"]["prediction_error_ms"]["p50"],
    "measured execute p99": lambda r: r["execute_ms"]["p99"] or 0,
    "loop lag p99": lambda r: r["daemon"]["loop_lag_ms"]["p99"],
    "other processes' CPU": lambda r: r["cpu"]["others_s"],
    "ok mean batch": lambda r: r["ok_mean_batch"],
}


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0 (ties share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    found = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            found[i] = (start + end) / 2
        start = end + 1
    return found


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation (None for fewer than 3 pairs or a constant series)."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return round(cov / (vx * vy) ** 0.5, 2) if vx and vy else None


def correlations(runs: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """In-SLO goodput's rank correlation with each of `FACTORS` over the runs."""
    goodput = [r["in_slo_rps"] for r in runs]
    return {name: rank_correlation([f(r) for r in runs], goodput) for name, f in FACTORS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overload_ab", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--rounds", type=int, default=Plan.rounds)
    parser.add_argument("--point-s", type=float, default=Plan.point_s)
    parser.add_argument("--slo-multiple", type=float, default=Plan.slo_multiple)
    parser.add_argument("--load", type=float, default=Plan.load)
    parser.add_argument(
        "--disturb",
        default="none",
        help=f"comma-separated, cycled in every round: {', '.join(DISTURBANCES)}",
    )
    parser.add_argument(
        "--generator-nice",
        default=str(GENERATOR_NICE),
        help="comma-separated nice levels of the generator, cycled in every round",
    )
    parser.add_argument(
        "--shapes", default="poisson", help=f"comma-separated, cycled: {', '.join(SHAPES)}"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--json", type=Path, help="default results/overload_ab.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    disturb = tuple(args.disturb.split(","))
    if unknown := set(disturb) - set(DISTURBANCES):
        raise SystemExit(f"--disturb: unknown {sorted(unknown)}")
    nice = tuple(int(n) for n in args.generator_nice.split(","))
    systems = tuple(args.systems.split(","))
    if unknown := set(systems) - set(VARIANTS):
        raise SystemExit(f"--systems: unknown {sorted(unknown)}")
    shapes = tuple(args.shapes.split(","))
    if unknown := set(shapes) - set(SHAPES):
        raise SystemExit(f"--shapes: unknown {sorted(unknown)}")
    plan = Plan(
        args.rounds,
        args.point_s,
        Plan.saturation_s,
        args.slo_multiple,
        args.load,
        disturb,
        nice,
        shapes,
        systems,
    )
    path = args.json or RESULTS / "overload_ab.json"
    with tempfile.TemporaryDirectory(prefix="clockwork-overload-ab-") as name:
        result = {
            "benchmark": "overload_ab",
            "machine": machine_description(),
            **run(plan, Path(name)),
        }
    result["load_average_after"] = load_average()
    result["correlations"] = correlations(result["runs"])
    for name, value in result["correlations"].items():
        print(f"  in SLO vs {name}: rank correlation {value}")
    written = write_report(path.stem, result, path.parent)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
