"""The engine on its own, driven by a stand-in controller: determinism, exactly-once replies,
ticks, message delays, cold starts and closed loops."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest

from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    Reply,
    RequestArrived,
    StartInfer,
    StartLoad,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome
from clockwork_async.sim.engine import SimConfig, Simulation
from clockwork_async.sim.profiles import TINY_SIM
from clockwork_async.sim.report import summarize
from clockwork_async.sim.stats import SimStats
from clockwork_async.sim.workloads import closed_loop, poisson

from .standin import StandInController

MS = 1_000_000


def simulate(controller: object, workload: object, **config: object) -> SimStats:
    settings: dict[str, object] = {"profile": TINY_SIM, "slo_ns": 20 * MS, **config}
    return Simulation(SimConfig(**settings), workload, controller).run()  # type: ignore[arg-type]


def comparable(stats: SimStats) -> dict[str, object]:
    summary = summarize(stats, 10**9, {}, {})
    del summary["wall_seconds"], summary["speedup"]
    return summary


def test_a_run_is_a_function_of_its_seed() -> None:
    workload = poisson(instances=3, rate_rps=300.0, duration_s=2.0)
    first = comparable(simulate(StandInController(), workload, seed=5))
    assert first == comparable(simulate(StandInController(), workload, seed=5))
    assert first != comparable(simulate(StandInController(), workload, seed=6))
    assert first["requests"] > 400


def test_every_request_is_answered_exactly_once() -> None:
    stats = simulate(StandInController(), poisson(instances=2, rate_rps=400.0, duration_s=2.0))
    assert stats.lost == 0 and not stats.violations
    assert sum(stats.outcomes.values()) == stats.requests
    assert stats.outcomes["ok"] > 0.9 * stats.requests


def test_an_unanswered_request_is_reported_lost() -> None:
    controller = StandInController(forget=frozenset({3, 7}))
    stats = simulate(controller, poisson(instances=1, rate_rps=100.0, duration_s=1.0))
    assert stats.lost == 2 and stats.lost_examples == [3, 7]


def test_a_second_reply_is_a_violation() -> None:
    stats = simulate(
        StandInController(double_reply=True), poisson(instances=1, rate_rps=50, duration_s=1)
    )
    assert stats.violations["second_reply"] == stats.outcomes["ok"] > 0


class ScriptedTicks:
    """Answers on Tick; on each arrival asks for two WakeAts, the second replacing the first."""

    def __init__(self, first_ns: int, second_ns: int) -> None:
        self.offsets = (first_ns, second_ns)
        self.waiting: list[int] = []
        self.ticks: list[int] = []
        self.arrivals: list[int] = []

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        if isinstance(event, RequestArrived):
            self.waiting.append(event.request_id)
            self.arrivals.append(now_ns)
            return [WakeAt(now_ns + offset) for offset in self.offsets]
        if isinstance(event, Tick):
            self.ticks.append(now_ns)
            replies = [Reply(r, Outcome.DROPPED) for r in self.waiting]
            self.waiting.clear()
            return replies
        return []


@pytest.mark.parametrize(("first_ms", "second_ms"), [(5, 2), (2, 5)])
def test_only_the_latest_wake_at_fires(first_ms: int, second_ms: int) -> None:
    controller = ScriptedTicks(first_ms * MS, second_ms * MS)
    stats = simulate(controller, poisson(instances=1, rate_rps=200.0, duration_s=1.0))
    expected: list[int] = []
    pending_ns: int | None = None  # the one WakeAt in force
    for arrival_ns in controller.arrivals:
        if pending_ns is not None and pending_ns <= arrival_ns:
            expected.append(pending_ns)
        pending_ns = arrival_ns + second_ms * MS
    assert pending_ns is not None
    assert controller.ticks == [*expected, pending_ns]
    assert len(expected) < len(controller.arrivals) - 10  # some WakeAts were replaced
    assert stats.lost == 0 and stats.outcomes["dropped"] == stats.requests


def test_message_delay_applies_both_ways() -> None:
    controller = StandInController()
    stats = simulate(
        controller, poisson(instances=1, rate_rps=50.0, duration_s=1.0), message_delay_ns=MS
    )
    assert stats.lost == 0
    sent = {
        c.action_id: now
        for now, c in _commands_of(controller)
        if isinstance(c, StartInfer | StartLoad)
    }
    results = [(now, e) for now, e in controller.events if isinstance(e, ActionFinished)]
    assert results
    for now_ns, result in results:
        assert now_ns == result.end_ns + MS
        assert result.start_ns >= sent[result.action_id] + MS


def _commands_of(controller: StandInController) -> list[tuple[int, Command]]:
    """Re-derive what the stand-in sent (its action ids are issued in order)."""
    replay = StandInController()
    return [(now, c) for now, event in controller.events for c in replay.handle(event, now)]


def test_requests_before_the_first_load_completes_are_cold_starts() -> None:
    stats = simulate(StandInController(), poisson(instances=1, rate_rps=2000.0, duration_s=0.5))
    assert stats.loads == 1
    assert 0 < stats.cold_starts < 10  # arrivals during the 1 ms LOAD (+ 0.1 ms dispatch)


class CountingStandIn(StandInController):
    def __init__(self) -> None:
        super().__init__()
        self.outstanding = self.most_outstanding = 0

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        commands = super().handle(event, now_ns)
        self.outstanding += isinstance(event, RequestArrived)
        self.outstanding -= sum(isinstance(c, Reply) for c in commands)
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return commands


def test_a_closed_loop_keeps_at_most_clients_times_in_flight_outstanding() -> None:
    controller = CountingStandIn()
    workload = closed_loop(instances=2, clients=3, in_flight=2, duration_s=1.0)
    stats = simulate(controller, workload)
    assert controller.most_outstanding == 6
    assert stats.lost == 0 and stats.requests > 500


class Forgetful:
    """Never answers and keeps asking for ticks: the drain limit must end the run."""

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        return [WakeAt(now_ns + MS)]


def test_the_drain_limit_ends_a_run_that_never_answers() -> None:
    stats = simulate(Forgetful(), poisson(instances=1, rate_rps=10.0, duration_s=1.0), drain_ns=MS)
    assert stats.lost == stats.requests > 0
    assert stats.simulated_ns <= 10**9 + MS


class WrongExecutor:
    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        if isinstance(event, RequestArrived):
            return [StartLoad("nowhere", 1, event.model, 0, 1), Reply(event.request_id, Outcome.OK)]
        return []


def test_an_action_for_an_unknown_executor_is_a_violation() -> None:
    stats = simulate(WrongExecutor(), poisson(instances=1, rate_rps=10.0, duration_s=1.0))
    assert stats.violations["action_for_unknown_executor"] == stats.requests > 0


def test_progress_prints_a_final_line() -> None:
    out = io.StringIO()
    config = SimConfig(profile=TINY_SIM, slo_ns=20 * MS, progress_s=1.0)
    workload = poisson(instances=1, rate_rps=10.0, duration_s=1.0)
    Simulation(config, workload, StandInController(), progress=out).run()
    assert out.getvalue().startswith("sim: t=")
