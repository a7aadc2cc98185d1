"""A result sent back with no message delay skips the engine's heap (`Simulation._ready`): the
controller must see exactly the events, times and order that the heap gives, on the virtual
clock. Each case runs twice, shortcut on (the default with no delay) and off (every result
through the heap, as before)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    ExecutorJoined,
    RequestArrived,
    StartInfer,
    Tick,
    WakeAt,
)
from clockwork_async.sim.engine import ControllerLike, SimConfig, Simulation, build_controller
from clockwork_async.sim.profiles import TINY_SIM
from clockwork_async.sim.workloads import Workload, bursty, poisson

MS = 1_000_000


class FixedArrivals:
    """Open-loop arrivals at given times (instance 0 each)."""

    def __init__(self, times_ns: list[int]) -> None:
        self.times_ns = times_ns
        self.instances = 1
        self.duration_ns = times_ns[-1]

    def open_arrivals(self, rng: object) -> Iterator[tuple[list[int], list[int]]]:
        yield list(self.times_ns), [0] * len(self.times_ns)

    def after_reply(self, instance: int, now_ns: int, ok: bool) -> int | None:
        return None

    def describe(self) -> dict[str, object]:
        return {"workload": "fixed"}


class Recorder:
    """Wraps a controller; keeps every event it was handed, with its time."""

    def __init__(self, inner: ControllerLike) -> None:
        self.inner = inner
        self.seen: list[tuple[int, str]] = []

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        self.seen.append((now_ns, repr(event)))
        return self.inner.handle(event, now_ns)


def run(controller: ControllerLike, workload: object, shortcut: bool, **config: object) -> str:
    """The run's summary (stats) as text; the controller records what it saw."""
    settings: dict[str, object] = {"profile": TINY_SIM, "slo_ns": 20 * MS, **config}
    simulation = Simulation(SimConfig(**settings), workload, controller)  # type: ignore[arg-type]
    assert simulation._result_shortcut == (not settings.get("message_delay_ns"))
    simulation._result_shortcut = shortcut
    stats = simulation.run()
    return repr((stats.requests, stats.events, stats.lost, dict(stats.violations), stats.outcomes))


class BadActions:
    """Sends INFERs the executor refuses on delivery (an empty window): each result comes back
    at the very instant, while a Tick may be due at it too.

    Request 0: WakeAt(now), then a bad INFER. Request 1: a bad INFER, then WakeAt(now); its
    result asks for one more bad INFER. Request 2 (the same instant as 1) does nothing."""

    def __init__(self) -> None:
        self.executor = ""
        self.next_action = 0
        self.seen: list[tuple[int, str]] = []

    def _bad_infer(self, now_ns: int) -> StartInfer:
        self.next_action += 1
        return StartInfer(self.executor, self.next_action, "m0", 1, (), now_ns, now_ns - 1, 0)

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        if isinstance(event, ExecutorJoined):
            self.executor = event.executor_id
        elif isinstance(event, RequestArrived):
            self.seen.append((now_ns, f"arrived {event.request_id}"))
            if event.request_id == 0:
                return [WakeAt(now_ns), self._bad_infer(now_ns)]
            if event.request_id == 1:
                return [self._bad_infer(now_ns), WakeAt(now_ns)]
        elif isinstance(event, ActionFinished):
            self.seen.append((now_ns, f"result {event.action_id} {event.code}"))
            if event.action_id == 2:
                return [self._bad_infer(now_ns)]
        elif isinstance(event, Tick):
            self.seen.append((now_ns, "tick"))
        return []


@pytest.mark.parametrize("shortcut", [True, False])
def test_a_result_takes_its_heap_place_among_events_of_its_instant(shortcut: bool) -> None:
    controller = BadActions()
    run(controller, FixedArrivals([1 * MS, 3 * MS, 3 * MS]), shortcut, drain_ns=MS)
    assert controller.seen == [
        (1 * MS, "arrived 0"),
        (1 * MS, "tick"),  # pushed before the result
        (1 * MS, "result 1 bad_input"),
        (3 * MS, "arrived 1"),
        (3 * MS, "result 2 bad_input"),
        (3 * MS, "tick"),  # pushed after the result, before the result it asks for
        (3 * MS, "result 3 bad_input"),
        (3 * MS, "arrived 2"),  # heap events of an instant go before its arrivals
    ]


def _events_both_ways(make: object, workload: Workload, **config: object) -> list[str]:
    runs = []
    for shortcut in (True, False):
        recorder = Recorder(make())  # type: ignore[operator]
        summary = run(recorder, workload, shortcut, **config)
        runs.append((summary, recorder.seen))
    assert runs[0] == runs[1]
    return [text for _, text in runs[0][1]]


@pytest.mark.parametrize("policy", ["clockwork", "fifo", "timeout"])
@pytest.mark.parametrize("preload", [False, True])
def test_the_core_sees_the_same_events_in_the_same_order(policy: str, preload: bool) -> None:
    """No noise and several executors: lane events and ticks often share an instant."""
    workload = bursty(instances=12, rate_rps=6000.0, duration_s=0.5, on_s=0.1, off_s=0.1)
    seen = _events_both_ways(
        lambda: build_controller(policy), workload, executors=3, preload=preload, seed=3
    )
    assert sum(text.startswith("ActionFinished") for text in seen) > 1000


def test_the_same_events_with_noise_and_one_executor_overloaded() -> None:
    workload = poisson(instances=40, rate_rps=5000.0, duration_s=0.5)
    _events_both_ways(lambda: build_controller("clockwork"), workload, noise=0.1, seed=7)
