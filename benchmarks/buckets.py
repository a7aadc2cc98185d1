"""Shape buckets in virtual time (issue 31): a text model whose requests vary in length, served
by buckets (each request at the smallest of 32, 64, 128, 256, 512 tokens that holds it, one
core variant per bucket) against the same workload forced to one bucket (every request padded
to 512 tokens: the one-length model of before).

    python -m benchmarks.buckets [--quick] [--seeds 1,2]
    python -m benchmarks.buckets --real [--quick] [--seeds 1]

``--real`` runs the real-time part instead (`benchmarks.buckets_real`): one ONNX Runtime
sequence model on a real daemon, served by buckets against the same model forced to one
bucket, with the same open-loop arrivals and lengths (quick: about two minutes).

Simulated profile, per (batch size, bucket): 0.5 ms + 20 us per row and 32 tokens (b1 at 32
tokens 0.52 ms; b16 at 512 tokens 5.62 ms); LOAD 10 ms. One executor with every variant
resident; each action runs its profile's time x uniform(0.9, 1.0), as the core's soak tests
(durations over the profile are another benchmark's subject). Lengths: half up to 32 tokens,
then halving per bucket (a long tail: 1/16 over 256). Poisson arrivals at several rates,
25 ms SLO, 10 s (quick: 2 s).
The production core (`Controller`) decides everything; this file only plays the executor and
the clients on a virtual clock, so the outcomes do not depend on the machine's load (the wall
seconds do). Writes ``results/buckets[-quick].json`` and prints the table.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import time
from collections import Counter
from typing import Any

from benchmarks.lib import RESULTS, table, write_json
from clockwork_async.core.buckets import variant_name
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ActionFinished,
    Event,
    ExecutorJoined,
    ModelProfile,
    ModelRegistered,
    ModelSpec,
    Reply,
    RequestArrived,
    StartInfer,
    StartLoad,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome

US = 1_000
MS = 1_000_000
BUCKETS = (32, 64, 128, 256, 512)
SIZES = (1, 2, 4, 8, 16)
LENGTH_SHARES = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # of requests per bucket
SLO_NS = 25 * MS
RATES_RPS = (1000, 2000, 4000, 8000, 12000, 16000)
KIND = "sim"
NOISE = (0.9, 1.0)


def execute_ns(batch_size: int, length: int) -> int:
    """The simulated profile: 0.5 ms + 20 us per row and 32 tokens."""
    return 500 * US + 20 * US * batch_size * length // 32


def specs() -> list[ModelSpec]:
    """One core variant per bucket, each with its own profile."""
    return [
        ModelSpec(
            variant_name("text", (length,)),
            SIZES,
            1,
            {KIND: ModelProfile({b: execute_ns(b, length) for b in SIZES}, 10 * MS)},
            group="text",
            default_slo_ns=SLO_NS,
        )
        for length in BUCKETS
    ]


def run(rate_rps: float, duration_s: float, seed: int, one_bucket: bool) -> dict[str, Any]:
    """One run: outcome counts, goodput and what the batches looked like."""
    rng = random.Random(seed)
    ctl = Controller(ControllerConfig())
    heap: list[tuple[int, int, Event]] = []
    order = itertools.count()
    lane_free_ns = 0
    wake: list[int] = [-1]  # the Tick the core last asked for (a later one replaces it)
    outcomes: Counter[str] = Counter()
    rows = padded_rows = batches = 0
    late_ns: list[int] = []
    deadlines: dict[int, int] = {}

    def push(time_ns: int, event: Event) -> None:
        heapq.heappush(heap, (time_ns, next(order), event))

    def perform(now_ns: int, commands: list[Any]) -> None:
        nonlocal lane_free_ns, rows, padded_rows, batches
        for command in commands:
            if isinstance(command, Reply):
                outcomes[command.outcome.value] += 1
                if command.outcome is Outcome.LATE:
                    late_ns.append(now_ns - deadlines[command.request_id])
            elif isinstance(command, WakeAt):
                wake[0] = command.time_ns
                push(command.time_ns, Tick())
            elif isinstance(command, StartInfer):
                start_ns = max(now_ns, command.earliest_ns, lane_free_ns)
                if start_ns > command.latest_ns:
                    push(
                        start_ns, ActionFinished(command.executor_id, command.action_id, "too_late")
                    )
                    continue
                length = int(command.model.rsplit("~", 1)[1])
                took_ns = round(execute_ns(command.batch_size, length) * rng.uniform(*NOISE))
                lane_free_ns = start_ns + took_ns
                batches += 1
                rows += len(command.request_ids)
                padded_rows += command.batch_size
                done = ActionFinished(
                    command.executor_id, command.action_id, "", start_ns, lane_free_ns, took_ns
                )
                push(lane_free_ns, done)
            elif isinstance(command, StartLoad):
                raise AssertionError("every variant is resident")

    for spec in specs():
        perform(0, ctl.handle(ModelRegistered(spec), 0))
    names = tuple(spec.name for spec in specs())
    perform(0, ctl.handle(ExecutorJoined("e1", KIND, len(names), 1 << 24, names), 0))
    now_ns, request_id = 0, 0
    end_ns = round(duration_s * 1e9)
    while True:
        now_ns += round(rng.expovariate(rate_rps) * 1e9)
        if now_ns >= end_ns:
            break
        request_id += 1
        bucket = rng.choices(BUCKETS, LENGTH_SHARES)[0]
        model = names[-1] if one_bucket else variant_name("text", (bucket,))
        deadlines[request_id] = now_ns + SLO_NS
        push(now_ns, RequestArrived(request_id, model, now_ns + SLO_NS))
    while heap:
        time_ns, _, event = heapq.heappop(heap)
        if isinstance(event, Tick) and time_ns != wake[0]:
            continue  # replaced by a later WakeAt
        perform(time_ns, ctl.handle(event, time_ns))
    answered = sum(outcomes.values())
    assert answered == request_id, (answered, request_id)
    return {
        "rate_rps": rate_rps,
        "requests": request_id,
        "goodput_rps": outcomes[Outcome.OK.value] / duration_s,
        "late": outcomes[Outcome.LATE.value],
        "late_max_ms": max(late_ns, default=0) / MS,
        "outcomes": dict(outcomes),
        "mean_batch": rows / batches if batches else 0.0,
        "padding_share": 1 - rows / padded_rows if padded_rows else 0.0,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per run instead of 10 s")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds")
    parser.add_argument(
        "--real", action="store_true", help="a real daemon and ONNX Runtime model instead"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.real:
        from benchmarks.buckets_real import print_real, run_real

        for seed in (int(s) for s in args.seeds.split(",")):
            print_real(run_real(args.quick, seed))
        return
    duration_s = 2.0 if args.quick else 10.0
    results: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for rate in RATES_RPS:
            for one_bucket in (False, True):
                started = time.perf_counter()
                row = run(rate, duration_s, seed, one_bucket)
                row.update(
                    seed=seed,
                    serving="one bucket (512)" if one_bucket else "buckets",
                    wall_s=round(time.perf_counter() - started, 1),
                )
                results.append(row)
    write_json("buckets", args.quick, {"duration_s": duration_s, "runs": results}, RESULTS)
    headers = ("rate", "serving", "seed", "goodput/s", "ok %", "late", "infeasible %", "batch")
    print(
        table(
            headers,
            [
                (
                    r["rate_rps"],
                    r["serving"],
                    r["seed"],
                    round(r["goodput_rps"]),
                    round(100 * r["outcomes"].get("ok", 0) / r["requests"], 1),
                    r["late"],
                    round(100 * r["outcomes"].get("infeasible", 0) / r["requests"], 1),
                    round(r["mean_batch"], 2),
                )
                for r in results
            ],
        )
    )


if __name__ == "__main__":
    main()
