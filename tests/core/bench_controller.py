"""Micro-benchmark of the controller core (not a test): Poisson arrivals over many models on
simulated executors in virtual time; reports the core's own cost per request (time inside
``Controller.handle`` divided by requests) and its throughput.

    python -m tests.core.bench_controller --quick
    python -m tests.core.bench_controller --executors 12 --models 1000 --load 0.8 --seconds 10
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

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

from .harness import KIND, MS, RESNET, SIZES, MiniSim, make_spec


class RecordingController(Controller):
    """A Controller that records every (event, now) it is given, for replay."""

    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config)
        self.log: list[tuple[Event, int]] = []

    def handle(self, event: Event, now_ns: int) -> list[Command]:
        self.log.append((event, now_ns))
        return super().handle(event, now_ns)


def replay_s(config: ControllerConfig, log: list[tuple[Event, int]], repeats: int) -> float:
    """Return the least CPU time, over ``repeats``, a fresh core takes for the whole log."""
    best_s = float("inf")
    for _ in range(repeats):
        ctl = Controller(config)
        handle = ctl.handle
        started = time.process_time()
        for event, now_ns in log:
            handle(event, now_ns)
        best_s = min(best_s, time.process_time() - started)
    return best_s


def run(
    executors: int, models: int, load: float, seconds: float, policy: str, seed: int, cold: bool
) -> None:
    config = ControllerConfig(policy=policy)
    ctl = RecordingController(config)
    sim = MiniSim(ctl)
    for index in range(models):
        sim.schedule(0, ModelRegistered(make_spec(f"m{index}")))
    names = [f"m{index}" for index in range(models)]
    for index in range(executors):
        resident = () if cold else tuple(names[index::executors][:190])
        sim.schedule(0, ExecutorJoined(f"e{index}", KIND, 1376, 16 << 20, resident))
    rate_rps = load * executors * capacity_rps(RESNET, SIZES, 100 * MS)
    rng = random.Random(seed)
    now_ns, requests, horizon_ns = 0, 0, int(seconds * 1e9)
    while True:
        now_ns += int(rng.expovariate(rate_rps) * 1e9)
        if now_ns > horizon_ns:
            break
        requests += 1
        sim.schedule(now_ns, RequestArrived(requests, rng.choice(names), now_ns + 100 * MS))
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    outcomes = Counter(r.outcome.value for r in sim.replies)
    core_s = replay_s(config, ctl.log, repeats=3)
    per_request_us = core_s / requests * 1e6
    print(
        f"{policy}: {executors} executors, {models} models, {requests} requests at "
        f"{rate_rps:.0f} req/s ({load:.0%} of capacity) for {seconds:g} s virtual"
    )
    print(
        f"  core (replayed, best of 3, CPU time): {per_request_us:.1f} us/request, "
        f"{requests / core_s:,.0f} requests/s; {len(ctl.log)} events; simulation {wall:.2f} s"
    )
    print(f"  outcomes: {dict(outcomes)}")
    print(f"  counters: {dict(ctl.stats(with_executors=False).counters)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", type=int, default=12)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity")
    parser.add_argument("--seconds", type=float, default=10.0, help="virtual seconds")
    parser.add_argument("--policy", default="clockwork")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cold", action="store_true", help="no model loaded at start")
    parser.add_argument("--quick", action="store_true", help="2 virtual seconds")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    run(args.executors, args.models, args.load, seconds, args.policy, args.seed, args.cold)


if __name__ == "__main__":
    main()
