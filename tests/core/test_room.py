"""Room for batches (core/room.py): while a model is refused, a new batch is booked as the
rows its expected arrivals fill, so an overloaded executor runs fewer, fuller batches; on the
virtual clock nothing accepted is late or dropped, and equally loaded models get equal
shares (the fairness rule: earliest deadline first over the ledger's promises)."""

from __future__ import annotations

import random
from collections import Counter

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
from clockwork_async.core.room import room_rows, target_ns
from clockwork_async.core.state import predict

from .harness import KIND, MS, SIZES, Harness, MiniSim, make_spec


def _room_setup(rate_per_s: float, refused_ago_ns: int, in_order_share: float) -> int:
    """Rows a new batch starting 75 ms from now (SLO 100 ms) is booked as."""
    h = Harness()
    h.register("a")
    h.join("e1", loaded=("a",))
    h.tick(1000 * MS)
    core = h.ctl._core
    model = core.models["a"]
    model.demand, model.demand_at_ns = rate_per_s, core.now_ns  # 1 s window: per second
    model.refused_at_ns = core.now_ns - refused_ago_ns
    model.in_order_share = in_order_share
    predictions = predict(core, model, core.executors["e1"])
    budget_ns = 95 * MS
    room_ns = target_ns(model, predictions, budget_ns)
    assert room_ns == predictions.exec_ns[16]  # the capacity rule: 2 x 17.33 <= 95 ms
    return room_rows(core, model, predictions.exec_ns, room_ns, budget_ns, core.now_ns + 75 * MS)


def test_a_refused_model_books_the_batch_its_expected_arrivals_fill() -> None:
    # 154 req/s for 75 ms: 12.55 expected; b8 serves 8 / 9.93 ms, b16 12.55 / 17.33 ms: b8.
    assert _room_setup(154.0, 10 * MS, 1.0) == 8
    # 400 req/s: 31 expected, b16 full serves the most per unit of time.
    assert _room_setup(400.0, 10 * MS, 1.0) == 16
    # 20 req/s: 2.5 expected; b2 serves 2 / 4.05 ms, b4 2.5 / 5.88 ms: b2.
    assert _room_setup(20.0, 10 * MS, 1.0) == 2


def test_no_room_unless_refused_lately_and_arrivals_can_join() -> None:
    assert _room_setup(400.0, 48 * MS, 1.0) == 1  # refused more than half the budget ago
    assert _room_setup(400.0, 47 * MS, 1.0) == 16
    assert _room_setup(400.0, 10 * MS, 0.89) == 1  # mixed deadlines: few could join


class _CountingSim(MiniSim):
    """MiniSim that counts the INFERs it runs by batch size."""

    def __init__(self, ctl: Controller) -> None:
        super().__init__(ctl)
        self.batch_sizes: Counter[int] = Counter()

    def _run_action(self, action: StartInfer | StartLoad) -> None:
        if isinstance(action, StartInfer):
            self.batch_sizes[action.batch_size] += 1
        super()._run_action(action)


def test_overload_of_many_models_runs_full_batches_drops_nothing_and_shares_fairly() -> None:
    """12 models on one executor at twice its b16 capacity (the issue 29 overload, 2 s):
    the old ledger opened a small batch for every model at once (mostly b4 in this run, 1,411
    served, one model 27% under the mean share); rooms make them b8 (1,580 served), nothing
    accepted is late or dropped, and every model gets within a quarter of the mean share."""
    rng = random.Random(7)
    sim = _CountingSim(Controller(ControllerConfig()))
    names = [f"m{i}" for i in range(12)]
    for name in names:
        sim.schedule(0, ModelRegistered(make_spec(name)))
    sim.schedule(0, ExecutorJoined("e1", KIND, 7 * 12, 16 << 20, tuple(names)))
    models: dict[int, str] = {}
    now_ns = 0
    for request_id in range(1, 3700):
        now_ns += int(rng.expovariate(1846.0) * 1e9)
        models[request_id] = rng.choice(names)
        sim.schedule(now_ns, RequestArrived(request_id, models[request_id], now_ns + 100 * MS))
    sim.run()
    outcomes = Counter(reply.outcome for reply in sim.replies)
    assert set(outcomes) == {Outcome.OK, Outcome.INFEASIBLE}
    sizes = sim.batch_sizes
    assert sizes[8] > 2 * (sizes[4] + sizes[2] + sizes[1]), sizes  # before: 60 b8, 199 b4
    assert outcomes[Outcome.OK] >= 1550  # before: 1,411
    assert set(sizes) <= set(SIZES)
    served = Counter(models[r.request_id] for r in sim.replies if r.outcome is Outcome.OK)
    mean = outcomes[Outcome.OK] / len(names)
    assert all(abs(served[name] - mean) <= mean / 4 for name in names), served
