"""Controller core cost per request: Poisson arrivals over many models on simulated executors in
virtual time; every event handed to the core is recorded, then the log is replayed into a fresh
core (best of 3) and timed, so only the core's own work is measured.

    python -m benchmarks.controller [--quick] [--json results/controller.json]
    python -m benchmarks.controller --executors 12 --models 1000 --load 0.8 --seconds 10

Reports, per case: CPU time per request (the whole replay divided by requests), the median and
p99 time of one ``handle`` call for an arrival (wall clock), requests per second of core time,
and what became of the requests (the admission rejects what it cannot serve: ``infeasible``).
Offered load is a fraction of the executors' b16 capacity at 100 ms (923 req/s each), which
many lightly loaded models cannot reach (they rarely batch). Numbers depend on the machine;
on a shared one, compare runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.core.harness import KIND, MS, RESNET, SIZES, MiniSim, make_spec

from benchmarks.lib import percentile
from clockwork_async.core.capacity import capacity_rps
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    Command,
    Event,
    ExecutorJoined,
    ModelRegistered,
    RequestArrived,
)

RESULTS = Path("results")
RESIDENT_PER_EXECUTOR = 190  # copies preloaded per executor (pages for 196)


@dataclass(frozen=True)
class Case:
    executors: int
    models: int
    load: float  # fraction of capacity
    seconds: float  # virtual
    cold: bool = False  # no model resident at start
    policy: str = "clockwork"

    @property
    def name(self) -> str:
        cold = ", cold" if self.cold else ""
        return f"{self.models} models x {self.executors} executors, {self.load:.0%}{cold}"


class RecordingController(Controller):
    """A Controller that records every (event, now) it is given, for replay."""

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config)
        self.log: list[tuple[Event, int]] = []

    def handle(self, event: Event, now_ns: int) -> list[Command]:
        self.log.append((event, now_ns))
        return super().handle(event, now_ns)


def replay(config: ControllerConfig, log: list[tuple[Event, int]]) -> tuple[float, list[int]]:
    """Replay ``log`` into a fresh core; return its CPU seconds and the wall ns of each
    arrival's ``handle`` call."""
    ctl = Controller(config)
    handle = ctl.handle
    arrival_ns: list[int] = []
    clock = time.perf_counter_ns
    started = time.process_time()
    for event, now_ns in log:
        before = clock()
        handle(event, now_ns)
        if type(event) is RequestArrived:
            arrival_ns.append(clock() - before)
    return time.process_time() - started, arrival_ns


def simulate(case: Case, seed: int) -> tuple[RecordingController, int, Counter[str], float]:
    """Run the case on MiniSim; return the recording core, requests, outcomes, offered rps."""
    config = ControllerConfig(policy=case.policy)
    ctl = RecordingController(config)
    sim = MiniSim(ctl)
    names = [f"m{index}" for index in range(case.models)]
    for name in names:
        sim.schedule(0, ModelRegistered(make_spec(name)))
    for index in range(case.executors):
        resident = (
            () if case.cold else tuple(names[index :: case.executors][:RESIDENT_PER_EXECUTOR])
        )
        sim.schedule(0, ExecutorJoined(f"e{index}", KIND, 1376, 16 << 20, resident))
    rate_rps = case.load * case.executors * capacity_rps(RESNET, SIZES, 100 * MS)
    rng = random.Random(seed)
    now_ns, requests, horizon_ns = 0, 0, int(case.seconds * 1e9)
    while True:
        now_ns += int(rng.expovariate(rate_rps) * 1e9)
        if now_ns > horizon_ns:
            break
        requests += 1
        sim.schedule(now_ns, RequestArrived(requests, rng.choice(names), now_ns + 100 * MS))
    sim.run()
    return ctl, requests, Counter(reply.outcome.value for reply in sim.replies), rate_rps


def measure(case: Case, seed: int, repeats: int) -> dict[str, Any]:
    """Simulate ``case``, replay it ``repeats`` times; return its row (best replay)."""
    ctl, requests, outcomes, rate_rps = simulate(case, seed)
    runs = [replay(ctl.config, ctl.log) for _ in range(repeats)]
    cpu_s, arrival_ns = min(runs, key=lambda run: run[0])
    ordered = sorted(arrival_ns)
    return {
        "case": case.name,
        "executors": case.executors,
        "models": case.models,
        "load": case.load,
        "cold": case.cold,
        "policy": case.policy,
        "virtual_seconds": case.seconds,
        "offered_rps": round(rate_rps, 1),
        "requests": requests,
        "events": len(ctl.log),
        "us_per_request": cpu_s / requests * 1e6,
        "arrival_median_us": percentile(ordered, 50) / 1e3,
        "arrival_p99_us": percentile(ordered, 99) / 1e3,
        "core_requests_per_s": requests / cpu_s,
        "outcomes": dict(outcomes),
        "counters": dict(ctl.stats(with_executors=False).counters),
    }


def default_cases(quick: bool) -> list[Case]:
    seconds = 2.0 if quick else 10.0
    growth_s = 0.25 if quick else 2.0
    return [
        Case(1, 1, 0.8, seconds),
        Case(12, 1000, 0.8, seconds),
        Case(12, 1000, 0.3, seconds),
        Case(12, 1000, 0.8, seconds, cold=True),
        Case(10, 1000, 0.5, growth_s),
        Case(150, 1000, 0.5, growth_s),
    ]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'case':<42}{'requests':>9}{'us/req':>8}{'med us':>8}{'p99 us':>8}"
        f"{'req/s core':>12}{'ok %':>7}{'infeas %':>9}{'drop %':>7}"
    )
    for row in rows:
        outcomes, requests = row["outcomes"], row["requests"]
        print(
            f"{row['case'][:41]:<42}{requests:>9}{row['us_per_request']:>8.1f}"
            f"{row['arrival_median_us']:>8.1f}{row['arrival_p99_us']:>8.1f}"
            f"{row['core_requests_per_s']:>12,.0f}"
            f"{100 * outcomes.get('ok', 0) / requests:>7.1f}"
            f"{100 * outcomes.get('infeasible', 0) / requests:>9.1f}"
            f"{100 * outcomes.get('dropped', 0) / requests:>7.1f}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute)")
    parser.add_argument("--executors", type=int, help="one case: this many executors")
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity")
    parser.add_argument("--seconds", type=float, default=10.0, help="virtual seconds")
    parser.add_argument("--cold", action="store_true", help="no model resident at start")
    parser.add_argument("--policy", default="clockwork", choices=("clockwork", "fifo", "timeout"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="replays per case (best kept)")
    parser.add_argument("--json", type=Path, help="default: results/controller[-quick].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.executors is not None:
        seconds = 2.0 if args.quick else args.seconds
        cases = [Case(args.executors, args.models, args.load, seconds, args.cold, args.policy)]
    else:
        cases = default_cases(args.quick)
    rows = [measure(case, args.seed, args.repeats) for case in cases]
    print_table(rows)
    path = args.json or RESULTS / f"controller{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = {"python": platform.python_version(), "cpus": os.cpu_count()}
    path.write_text(json.dumps({"quick": args.quick, "machine": machine, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
