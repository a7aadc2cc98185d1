"""Open-loop replay of an Azure Functions trace against a running daemon, as a process of its
own (the load generator of `benchmarks.azure`):

    python -m benchmarks.trace_load --address A --prefix r50 --instances 4026 \
        --trace invocations.csv --minutes 3 --load-scale 1.0 --slo-ms 100 --seed 1 --out F.json

It drives `clockwork_async.bench` (its `Run`: sends on schedule, never waits for replies,
counts every request once) with the trace workload of `sim.workloads.trace_replay`, the one
the simulator replays. Instance ``i`` is the daemon's model ``PREFIX-i`` (``copies`` in a
model.toml); ``--instances 1`` with ``--prefix NAME`` sends to ``NAME`` itself.

Differences from ``clockwork-async bench --trace``: every instance shares one input array
(thousands of ResNet50 copies would otherwise hold one 602 KB image each), and the result
adds what the generator achieved against its schedule: requests scheduled and sent per
second, and the send lag, so a generator that falls behind is seen, not mistaken for the
daemon.

Invariants: arrivals leave on their schedule (lag recorded), never waiting for a reply; the
summary counts every request sent exactly once (outcome, error status or ``lost``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.bench import Run, summarize
from clockwork_async.cli_client import random_inputs
from clockwork_async.sim.report import timeline_arrays
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import trace_replay

NS_PER_S = 1_000_000_000


def instance_names(prefix: str, instances: int) -> list[str]:
    """The daemon's names of the instances: ``PREFIX-i``, or ``PREFIX`` for one instance."""
    return [prefix] if instances == 1 else [f"{prefix}-{i}" for i in range(instances)]


class ScheduleCounter:
    """Counts the arrivals it passes on, per second of their scheduled time."""

    def __init__(self) -> None:
        self.per_s: Counter[int] = Counter()
        self.total = 0

    def wrap(self, pieces: Iterator[tuple[list[int], list[int]]]) -> Iterator[Any]:
        for times_ns, instances in pieces:
            for time_ns in times_ns:
                self.per_s[time_ns // NS_PER_S] += 1
            self.total += len(times_ns)
            yield times_ns, instances

    def series(self, seconds: int) -> list[int]:
        return [self.per_s[second] for second in range(seconds)]


def client_within_slo(run: Run, slo_ms: float) -> dict[str, Any]:
    """ok replies whose latency as this client measured it (socket to reply, so the transport
    both ways included) was within the SLO, over all requests sent."""
    limit_us = round(slo_ms * 1000)
    within = sum(n for us, n in run.recorder.stats.latency_us.items() if us <= limit_us)
    sent = run.recorder.sent
    return {"ok_within": within, "share": within / sent if sent else None}


async def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Replay the trace; returns the bench summary plus schedule and timeline series."""
    names = instance_names(args.prefix, args.instances)
    mapping = TraceMapping(read_azure_trace(args.trace, args.minutes), args.instances)
    duration_s = args.minutes * 60.0
    workload = trace_replay(mapping, duration_s, args.load_scale)
    rng = np.random.default_rng(args.seed)
    async with await AsyncClient.connect(args.address) as client:
        served = {model.name: model for model in await client.models()}
        missing = [name for name in names if name not in served]
        if missing:
            raise SystemExit(f"trace_load: the daemon serves no model {missing[0]!r}")
        shared = random_inputs(served[names[0]].inputs, rng)
        run = Run(client, dict.fromkeys(names, shared))
        schedule = ScheduleCounter()
        await run.open_loop(schedule.wrap(workload.open_arrivals(rng)), args.slo_ms)
        await run.finish(args.grace_s)
    duration_ns = round(duration_s * NS_PER_S)
    summary = summarize(run, duration_ns, workload.describe())
    seconds = round(duration_s)
    summary["scheduled"] = {
        "requests": schedule.total,
        "rps": round(schedule.total / duration_s, 3),
        "per_s": schedule.series(seconds),
    }
    summary["client_within_slo"] = client_within_slo(run, args.slo_ms)
    summary["sent_per_s"] = [i.requests for i in run.recorder.stats.timeline.intervals][:seconds]
    summary["timeline"] = timeline_arrays(run.recorder.stats, duration_ns)
    summary["config"] = {
        "address": args.address,
        "instances": args.instances,
        "minutes": args.minutes,
        "load_scale": args.load_scale,
        "slo_ms": args.slo_ms,
        "seed": args.seed,
    }
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--address", required=True)
    add("--prefix", required=True, help="instance i is model PREFIX-i")
    add("--instances", type=int, required=True)
    add("--trace", type=Path, required=True)
    add("--minutes", type=float, required=True, help="window from the trace's first minute")
    add("--load-scale", type=float, default=1.0)
    add("--slo-ms", type=float, default=100.0)
    add("--seed", type=int, default=1)
    add("--grace-s", type=float, default=5.0, help="wait this long for the last replies")
    add("--out", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.instances < 1 or args.minutes <= 0 or args.load_scale < 0:
        print("trace_load: instances >= 1, minutes > 0, load scale >= 0", file=sys.stderr)
        return 2
    from benchmarks.common import run_uvloop

    summary = run_uvloop(replay(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary) + "\n")
    return 1 if summary["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
