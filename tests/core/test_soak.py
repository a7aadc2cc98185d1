"""Seeded overload runs on simulated executors that keep to their predictions (or beat them),
with message delays: nothing is late, every request is answered once, and what admission
accepts is served: nothing accepted is dropped."""

from __future__ import annotations

import random

import pytest

from clockwork_async.core.capacity import capacity_rps
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ExecutorJoined,
    ModelRegistered,
    RequestArrived,
    StartInfer,
    StartLoad,
)
from clockwork_async.core.outcomes import Outcome

from .harness import KIND, MS, RESNET, SIZES, US, MiniSim, make_spec


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_overload_with_cold_starts_is_never_late_and_drops_nothing_accepted(seed: int) -> None:
    rng = random.Random(seed)

    def duration_ns(action: StartInfer | StartLoad, start_ns: int) -> int:
        predicted_ns = action.predicted_ns if isinstance(action, StartInfer) else RESNET.load_ns
        return int(predicted_ns * rng.uniform(0.8, 1.0))

    sim = MiniSim(Controller(ControllerConfig()), duration_ns, delay_ns=50 * US)
    names = [f"m{i}" for i in range(8)]
    for name in names:
        sim.schedule(0, ModelRegistered(make_spec(name)))
    sim.schedule(0, ExecutorJoined("e1", KIND, 7 * 3, 16 << 20, ("m0", "m1")))
    sim.schedule(0, ExecutorJoined("e2", KIND, 7 * 3, 16 << 20, ("m2",)))
    deadlines: dict[int, int] = {}
    now_ns = 0
    for request_id in range(1, 3000):
        now_ns += int(rng.expovariate(2500.0) * 1e9)  # ~1.4x two executors' b16 capacity
        deadlines[request_id] = now_ns + rng.randrange(10 * MS, 100 * MS)
        model = rng.choice(names[:3]) if rng.random() < 0.8 else rng.choice(names)
        sim.schedule(now_ns, RequestArrived(request_id, model, deadlines[request_id]))
    sim.run()
    outcomes = {reply.request_id: reply.outcome for reply in sim.replies}
    assert len(sim.replies) == len(outcomes) == len(deadlines)
    assert Outcome.LATE not in outcomes.values()
    for request_id, outcome in outcomes.items():
        if outcome in (Outcome.OK, Outcome.DROPPED):
            assert sim.replied_at_ns[request_id] <= deadlines[request_id], outcome
    counts = {o: list(outcomes.values()).count(o) for o in set(outcomes.values())}
    # About 1.4x what two executors can do, on 10-100 ms deadlines, 8 models on executors
    # that hold 3: roughly half is rejected at arrival (infeasible), the rest is served.
    assert set(counts) == {Outcome.OK, Outcome.INFEASIBLE}
    assert counts[Outcome.OK] > len(deadlines) // 2
    assert sim.ctl.stats().counters["evictions"] > 0


def test_twice_the_capacity_of_one_copy_keeps_full_batches_and_drops_nothing() -> None:
    capacity = capacity_rps(RESNET, SIZES, 100 * MS)  # b16: 923 req/s
    sim = MiniSim(Controller(ControllerConfig()))
    sim.schedule(0, ModelRegistered(make_spec("a")))
    sim.schedule(0, ExecutorJoined("e1", KIND, 1376, 16 << 20, ("a",)))
    rng = random.Random(7)
    now_ns, request_id, end_ns = 0, 0, 1_000 * MS
    while now_ns < end_ns:
        now_ns += int(rng.expovariate(2 * capacity) * 1e9)
        request_id += 1
        sim.schedule(now_ns, RequestArrived(request_id, "a", now_ns + 100 * MS))
    sim.run()
    ok = sum(reply.outcome is Outcome.OK for reply in sim.replies)
    dropped = sum(reply.outcome is Outcome.DROPPED for reply in sim.replies)
    assert dropped == 0 and ok >= 0.95 * capacity * (end_ns / 1e9)
