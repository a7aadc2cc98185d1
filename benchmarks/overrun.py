"""Actions over their profile in virtual time: what admission refuses at low load when every
model is resident and executions run up to 5% over the profile, or now and then stall.

    python -m benchmarks.overrun [--quick] [--seconds 10] [--seed 3]

One executor holding 1 or 5 ResNet50-V100 models (b1 2.73 ms ... b16 17.33 ms), Poisson
arrivals spread evenly over the models, each INFER running its *profile's* time x uniform(lo,
hi) (never the core's prediction x a factor: that ratchets the p99-of-ten window up, see
docs/controller.md, "Durations over the profile"), plus 20 ms for a ``stall`` share of them;
with a lead (the way there, as the daemon sends one) the same delay on each action's way there
and on its result's way back. The production core decides everything; outcomes do not depend
on the machine. Prints one table; writes ``results/overrun[-quick].json``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import Counter
from typing import Any

from benchmarks.lib import RESULTS, table, write_json
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ActionFinished,
    Event,
    ExecutorJoined,
    ExecutorLead,
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

MS = 1_000_000
US = 1_000
KIND = "sim"
EXECUTE_NS = {1: 2_730_000, 2: 4_050_000, 4: 5_880_000, 8: 9_930_000, 16: 17_330_000}
STALL_NS = 20 * MS
WARM = {"warm_gap_ns": 2 * MS, "warm_up_infers": 2}  # the ONNX Runtime CPU defaults

# (label, models, SLO ms, req/s, (lo, hi), stall share, lead us, core config)
CASES: tuple[tuple[str, int, float, float, tuple[float, float], float, int, dict[str, int]], ...]
CASES = tuple(
    (f"{lo}-{hi}x", models, slo_ms, rate, (lo, hi), 0.0, 0, {})
    for slo_ms in (100.0, 25.0, 5.46)
    for models in (1, 5)
    for rate in (100.0, 250.0)
    for lo, hi in ((0.9, 1.0), (0.95, 1.05))
) + tuple(
    (f"stall{' cold-on' if config else ''}", models, 25.0, rate, (0.95, 1.05), 0.005, lead, config)
    for config, lead in (({}, 100), (WARM, 0))
    for models in (1, 5)
    for rate in (100.0, 250.0)
)


def run(
    models: int,
    slo_ns: int,
    rate_rps: float,
    noise: tuple[float, float],
    stall: float,
    lead_ns: int,
    config: dict[str, int],
    duration_s: float,
    seed: int,
) -> tuple[int, Counter[str]]:
    """One run: the number of requests and their outcomes."""
    rng = random.Random(seed)
    ctl = Controller(ControllerConfig(**config))  # type: ignore[arg-type]
    heap: list[tuple[int, int, Event]] = []
    order = itertools.count()
    lane_free_ns = 0
    wake = [-1]  # the Tick the core last asked for (a later one replaces it)
    outcomes: Counter[str] = Counter()

    def push(time_ns: int, event: Event) -> None:
        heapq.heappush(heap, (time_ns, next(order), event))

    def perform(now_ns: int, commands: list[Any]) -> None:
        nonlocal lane_free_ns
        for command in commands:
            if isinstance(command, Reply):
                outcomes[command.outcome.value] += 1
            elif isinstance(command, WakeAt):
                wake[0] = command.time_ns
                push(command.time_ns, Tick())
            elif isinstance(command, StartInfer):
                start_ns = max(now_ns + lead_ns, command.earliest_ns, lane_free_ns)
                if start_ns > command.latest_ns:
                    push(
                        start_ns, ActionFinished(command.executor_id, command.action_id, "too_late")
                    )
                    continue
                took_ns = round(EXECUTE_NS[command.batch_size] * rng.uniform(*noise))
                took_ns += STALL_NS if rng.random() < stall else 0
                lane_free_ns = start_ns + took_ns
                done = ActionFinished(
                    command.executor_id, command.action_id, "", start_ns, lane_free_ns, took_ns
                )
                push(lane_free_ns + lead_ns, done)
            elif isinstance(command, StartLoad):
                raise AssertionError("every model is resident")

    names = tuple(f"m{i}" for i in range(models))
    for name in names:
        profile = ModelProfile(dict(EXECUTE_NS), 8_300_000)
        spec = ModelSpec(name, tuple(EXECUTE_NS), 7, {KIND: profile}, default_slo_ns=slo_ns)
        perform(0, ctl.handle(ModelRegistered(spec), 0))
    perform(0, ctl.handle(ExecutorJoined("e1", KIND, 1376, 16 << 20, names), 0))
    if lead_ns:
        perform(0, ctl.handle(ExecutorLead("e1", lead_ns), 0))
    now_ns, requests, end_ns = 0, 0, round(duration_s * 1e9)
    while True:
        now_ns += round(rng.expovariate(rate_rps) * 1e9)
        if now_ns >= end_ns:
            break
        requests += 1
        push(now_ns, RequestArrived(requests, rng.choice(names), now_ns + slo_ns))
    while heap:
        time_ns, _, event = heapq.heappop(heap)
        if isinstance(event, Tick) and time_ns != wake[0]:
            continue
        perform(time_ns, ctl.handle(event, time_ns))
    assert sum(outcomes.values()) == requests
    return requests, outcomes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 simulated seconds per run")
    parser.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per run")
    parser.add_argument("--seed", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    seconds = 2.0 if args.quick else args.seconds
    rows: list[dict[str, Any]] = []
    for label, models, slo_ms, rate, noise, stall, lead_us, config in CASES:
        requests, outcomes = run(
            models,
            round(slo_ms * MS),
            rate,
            noise,
            stall,
            lead_us * US,
            config,
            seconds,
            args.seed,
        )
        rows.append(
            {
                "case": label,
                "models": models,
                "slo_ms": slo_ms,
                "rate_rps": rate,
                "lead_us": lead_us,
                "requests": requests,
                "outcomes": dict(outcomes),
            }
        )
    write_json(
        "overrun", args.quick, {"seconds": seconds, "seed": args.seed, "runs": rows}, RESULTS
    )
    headers = (
        "case",
        "models",
        "SLO ms",
        "req/s",
        "lead us",
        "requests",
        "ok",
        "infeasible",
        "dropped",
        "late",
    )
    print(
        table(
            headers,
            [
                (
                    r["case"],
                    r["models"],
                    r["slo_ms"],
                    r["rate_rps"],
                    r["lead_us"],
                    r["requests"],
                    *(r["outcomes"].get(k, 0) for k in ("ok", "infeasible", "dropped", "late")),
                )
                for r in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
