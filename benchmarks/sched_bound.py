"""Goodput against an upper bound (issue 29, point 2): `clockwork`, `fifo`, `timeout` and the
greedy baseline, each as a share of what any scheduler could answer in time.

    python -m benchmarks.sched_bound [--quick] [--seeds 1,2] [--only overload,mmpp]

Cases, all one ResNet50-V100 executor, 12 instances, 100 ms SLO, in virtual time:
- ``overload``: Poisson at 1,846 req/s (2x the batch-16 capacity) (the issue's command:
  ``clockwork-async simulate --workload poisson --executors 1 --instances 12 --profile
  resnet50-v100 --slo-ms 100 --rate 1846 --seed 1``);
- ``mmpp-50`` .. ``mmpp-100``: the bursty MMPP of `sim.mmpp` (levels 1 and 6, mean sojourns
  2 s and 0.25 s, Pareto bursts with shape 1.5) at a long-run mean of 50, 75 and 100% of the
  batch-1 capacity (366 req/s), so bursts (3.9x the mean) reach 1.9x to 3.9x it.

The bound (`sim.bound`) and the greedy baseline (`sim.greedy`) see the very arrivals of the
runs (the same seed). Minutes: 5 (quick: 1). Writes ``results/sched_bound[-quick].json`` and
prints the table. Outcomes are virtual-time results, whatever the machine's load; the wall
seconds are from whatever machine ran it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.lib import RESULTS, percent, table, write_json
from benchmarks.lib.sim import PROFILE, Row, run_sim
from clockwork_async.sim.compare import compare
from clockwork_async.sim.engine import SimConfig
from clockwork_async.sim.mmpp import mmpp
from clockwork_async.sim.workloads import Workload, poisson

POLICIES = ("clockwork", "fifo", "timeout")
INSTANCES = 12
SLO_MS = 100.0
OVERLOAD_RPS = 1846.0
B1_CAPACITY_RPS = 1e9 / PROFILE.execute_ns[1]
MMPP_SHARES = (0.5, 0.75, 1.0)
NS_PER_MS = 1_000_000


def cases(minutes: float, only: set[str]) -> list[tuple[str, Workload]]:
    """(name, workload) of every case asked for."""
    duration_s = minutes * 60.0
    found: list[tuple[str, Workload]] = []
    if "overload" in only:
        found.append(("overload", poisson(INSTANCES, OVERLOAD_RPS, duration_s)))
    if "mmpp" in only:
        for share in MMPP_SHARES:
            rate = share * B1_CAPACITY_RPS
            found.append((f"mmpp-{round(share * 100)}", mmpp(INSTANCES, rate, duration_s)))
    return found


def run_case(name: str, workload: Workload, seed: int) -> list[Row]:
    """One row per scheduler (the core's policies, then greedy) on one case and seed."""
    config = SimConfig(profile=PROFILE, slo_ns=round(SLO_MS * NS_PER_MS), seed=seed)
    rows: list[Row] = []
    baseline = compare(config, workload, 0, with_greedy=True)
    bound = baseline["bound"]
    greedy = baseline["greedy"]
    for policy in POLICIES:
        started = time.perf_counter()
        run = run_sim(
            workload,
            executors=1,
            slo_ms=SLO_MS,
            policy=policy,
            seed=seed,
            progress_s=0.0,
            count_cold=False,
        )
        summary = run.summary
        rows.append(_row(name, seed, policy, summary, bound, time.perf_counter() - started))
        print(f"  {name} seed {seed} {policy}: {summary['goodput_rps']:.1f} req/s",
              file=sys.stderr, flush=True)  # fmt: skip
    requests = rows[0]["requests"]
    rows.append(
        {
            "case": name,
            "seed": seed,
            "scheduler": "greedy",
            "requests": requests,
            "ok": greedy["ok"],
            "goodput_rps": greedy["goodput_rps"],
            "bound_ok": bound["ok"],
            "bound_rps": bound["goodput_rps"],
            "share_of_bound": greedy["over_bound"],
            "late": 0,
            "batch_sizes": greedy["batch_sizes"],
            "wall_s": None,
        }
    )
    return rows


def _row(
    name: str, seed: int, policy: str, summary: Row, bound: dict[str, Any], wall_s: float
) -> Row:
    return {
        "case": name,
        "seed": seed,
        "scheduler": policy,
        "requests": summary["requests"],
        "ok": summary["ok"],
        "goodput_rps": summary["goodput_rps"],
        "bound_ok": bound["ok"],
        "bound_rps": bound["goodput_rps"],
        "share_of_bound": summary["ok"] / bound["ok"] if bound["ok"] else None,
        "late": summary["late"],
        "batch_sizes": summary["batch_sizes"],
        "wall_s": round(wall_s, 1),
    }


def print_table(rows: list[Row]) -> None:
    headers = ("case", "seed", "scheduler", "offered", "goodput", "bound", "% of bound", "late",
               "b16", "b8", "b4", "wall s")  # fmt: skip
    print(
        table(
            headers,
            (
                (
                    row["case"],
                    row["seed"],
                    row["scheduler"],
                    row["requests"],
                    row["goodput_rps"],
                    row["bound_rps"],
                    percent(row["share_of_bound"], 1),
                    row["late"],
                    *(row["batch_sizes"].get(b, 0) for b in ("16", "8", "4")),
                    row["wall_s"],
                )
                for row in rows
            ),
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 simulated minute, not 5")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds")
    parser.add_argument("--only", default="overload,mmpp", help="overload, mmpp")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    minutes = 1.0 if args.quick else 5.0
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows: list[Row] = []
    for name, workload in cases(minutes, set(args.only.split(","))):
        for seed in seeds:
            rows += run_case(name, workload, seed)
    print_table(rows)
    result = {
        "minutes": minutes,
        "instances": INSTANCES,
        "slo_ms": SLO_MS,
        "profile": PROFILE.name,
        "b1_capacity_rps": round(B1_CAPACITY_RPS, 1),
        "rows": rows,
    }
    path = write_json("sched_bound", args.quick, result, RESULTS)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
