"""CoreRunner: held arrivals scheduled together, order kept, actions before replies (the real
pure core on a hand-moved clock; the loop's call_soon is a list the test runs)."""

from __future__ import annotations

from collections.abc import Callable

from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    Command,
    ExecutorJoined,
    ModelRegistered,
    Reply,
    RequestArrived,
    RequestCancelled,
    StartInfer,
)
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.dispatch import CoreRunner
from core.harness import KIND, MS, make_spec


class Rig:
    """A runner over a core with one executor that holds model ``a``."""

    def __init__(self, max_held: int = 32) -> None:
        self.now_ns = 0
        self.performed: list[Command] = []
        self.handlings = 0
        self.deferred: list[Callable[[], None]] = []
        self.runner = CoreRunner(
            Controller(ControllerConfig()),
            lambda: self.now_ns,
            self._perform,
            defer=self.deferred.append,
            max_held=max_held,
            performed=self._handled,
        )
        self.runner.feed(ModelRegistered(make_spec("a")))
        self.runner.feed(ExecutorJoined("e1", KIND, 1376, 16 << 20, ("a",)))
        self.performed.clear()
        self.handlings = 0

    def _perform(self, command: Command, now_ns: int) -> int:
        self.performed.append(command)
        return 0

    def _handled(self) -> None:
        self.handlings += 1

    def arrive(self, request_id: int, model: str = "a") -> None:
        self.runner.feed_arrival(RequestArrived(request_id, model, self.now_ns + 100 * MS))

    def end_of_round(self) -> None:
        callbacks, self.deferred = self.deferred, []
        for callback in callbacks:
            callback()

    def infers(self) -> list[StartInfer]:
        return [c for c in self.performed if isinstance(c, StartInfer)]


def test_arrivals_of_one_round_are_scheduled_together_as_one_batch() -> None:
    rig = Rig()
    for request_id in range(4):
        rig.arrive(request_id)
    assert rig.performed == [] and len(rig.deferred) == 1  # one flush asked for, not four
    rig.end_of_round()
    (infer,) = rig.infers()
    assert infer.batch_size == 4 and infer.request_ids == (0, 1, 2, 3)
    assert rig.handlings == 1


def test_another_event_first_hands_over_the_held_arrivals_in_order() -> None:
    rig = Rig()
    rig.arrive(1)
    rig.runner.feed(RequestCancelled(1))  # the core must know request 1 before it is cancelled
    assert [(type(c), getattr(c, "outcome", None)) for c in rig.performed] == [
        (StartInfer, None),  # it went out first ...
        (Reply, Outcome.CANCELLED),  # ... and the cancel answered it (its row is dropped)
    ]
    rig.end_of_round()  # the deferred flush finds nothing left to do
    assert len(rig.infers()) == 1


def test_a_burst_is_flushed_every_max_held_arrivals() -> None:
    rig = Rig(max_held=3)
    for request_id in range(7):
        rig.arrive(request_id)
    assert [i.request_ids for i in rig.infers()] == [(0, 1, 2)]  # the second 3 wait: lane busy
    rig.end_of_round()
    assert rig.handlings == 3  # at 3, at 6, and the end of the round


def test_actions_go_out_before_the_replies_of_the_same_handling() -> None:
    rig = Rig()
    rig.arrive(1, model="ghost")  # rejected: unknown model
    rig.arrive(2)
    rig.arrive(3, model="ghost")
    rig.end_of_round()
    kinds = [type(c) for c in rig.performed]
    assert kinds == [StartInfer, Reply, Reply]
    replies = [c for c in rig.performed if isinstance(c, Reply)]
    assert [(r.request_id, r.outcome) for r in replies] == [
        (1, Outcome.UNKNOWN_MODEL),
        (3, Outcome.UNKNOWN_MODEL),
    ]


def test_without_defer_an_arrival_is_handled_at_once() -> None:
    performed: list[Command] = []
    runner = CoreRunner(
        Controller(ControllerConfig()), lambda: 0, lambda c, _t: performed.append(c) or 0
    )
    runner.feed(RequestArrived(1, "ghost", 100 * MS))
    assert [type(c) for c in performed] == [Reply]
