"""The Dispatcher on a hand-moved clock: held arrivals scheduled together, order kept, actions
before replies, the core as the one judge (the return hop it is told), one book of outcomes.

The real pure core runs; executors are `FakeLink`s that record what was sent (links over real
sockets are tested in test_driver_sim.py and tests/e2e/)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.dispatcher import MAX_HELD_ARRIVALS, Dispatcher
from clockwork_async.runtime.models import RegisteredModel
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.wire.messages import ActionResult, ExecutorInfo, Infer, Message, TensorSpec
from core.harness import KIND, MS, RESNET, SIZES

INPUT = TensorSpec("input", "float32", (-1, 4))
OUTPUT = TensorSpec("output", "float32", (-1, 4))


class FakeLink:
    """Stands in for an `ExecutorLink`: keeps each sent action and its reply callback."""

    def __init__(self, name: str = "e1") -> None:
        self.info = ExecutorInfo(name, "sim", "sim", KIND, ("load", "execute"), 1 << 20, 64, 64, 0)
        self.offset_ns = 0
        self.sent: list[tuple[Message, Callable[[Message], None]]] = []
        self.flushes = 0

    def send_action(
        self, message: Message, action_id: int, on_reply: Callable[[Message], None]
    ) -> None:
        self.sent.append((message, on_reply))

    def flush(self) -> None:
        self.flushes += 1

    def fail(self, reason: str) -> None:
        raise AssertionError(reason)

    def infers(self) -> list[Infer]:
        return [m for m, _ in self.sent if isinstance(m, Infer)]

    def answer(self, index: int, **result: Any) -> None:
        """Reply to the ``index``-th sent action with an ActionResult of ``result``'s fields."""
        message, on_reply = self.sent[index]
        on_reply(ActionResult(message.action_id, **result))  # type: ignore[attr-defined]


def _model(name: str = "a", profile: ModelProfile = RESNET) -> RegisteredModel:
    return RegisteredModel(
        name=name,
        path="",
        group="",
        default_slo_ns=100 * MS,
        batch_sizes=SIZES,
        inputs=(INPUT,),
        outputs=(OUTPUT,),
        weights_bytes=1 << 20,
        weights_pages=7,
        profile=RegistrationProfile(SIZES, {KIND: profile}),
    )


def _row(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, np.float32)}


class Rig:
    """A dispatcher over the real core with one executor that holds model ``a``."""

    def __init__(self) -> None:
        self.now_ns = 1_000 * MS
        self.dispatcher = Dispatcher(ControllerConfig(), now_ns=lambda: self.now_ns)
        self.link = FakeLink()
        self.replies: dict[int, InferOutcome] = {}
        self.dispatcher.add_model(_model())
        self.dispatcher.executor_joined("e1", self.link, ("a",))  # type: ignore[arg-type]

    def submit(self, model: str = "a", slo_ms: float = 100.0, row: Any = None) -> int:
        return self.dispatcher.submit_by(
            model,
            _row() if row is None else row,
            deadline_ns=self.now_ns + int(slo_ms * MS),
            on_reply=lambda outcome: self.replies.__setitem__(outcome.request_id, outcome),
        )


async def _end_of_round() -> None:
    await asyncio.sleep(0)


async def test_arrivals_of_one_round_are_scheduled_together_as_one_batch() -> None:
    rig = Rig()
    ids = [rig.submit() for _ in range(4)]
    assert rig.link.infers() == [] and rig.dispatcher.held_arrivals == 4
    await _end_of_round()
    (infer,) = rig.link.infers()
    assert infer.batch_size == 4 and rig.dispatcher.held_arrivals == 0
    assert rig.dispatcher.book.actions_of("e1")[0].request_ids == tuple(ids)
    assert rig.link.flushes >= 1


async def test_another_event_first_hands_over_the_held_arrivals_in_order() -> None:
    rig = Rig()
    request_id = rig.submit()
    rig.dispatcher.cancel(request_id)  # the core must know the request before it is cancelled
    assert len(rig.link.infers()) == 1  # it went out first ...
    assert rig.replies[request_id].outcome is Outcome.CANCELLED  # ... then the cancel answered
    await _end_of_round()
    assert len(rig.link.infers()) == 1


async def test_a_burst_is_handed_over_every_max_held_arrivals() -> None:
    rig = Rig()
    for _ in range(MAX_HELD_ARRIVALS):
        rig.submit()
    assert rig.dispatcher.held_arrivals == 0  # handed over at the cap, before the round ends
    assert len(rig.link.infers()) == 1


async def test_unknown_models_and_bad_rows_are_answered_once_and_counted_once() -> None:
    rig = Rig()
    ghost = rig.submit(model="ghost")
    bad = rig.submit(row={"input": np.zeros((1, 5), np.float32)})
    good = rig.submit()
    # Refused at the door, before submit returned: the core never sees them.
    assert rig.replies[ghost].outcome is Outcome.UNKNOWN_MODEL
    assert rig.replies[bad].outcome is Outcome.BAD_INPUT
    await _end_of_round()
    assert good not in rig.replies and len(rig.link.infers()) == 1
    assert rig.dispatcher.book.outcomes == {"bad_input": 1, "unknown_model": 1}
    core = rig.dispatcher.controller.stats()
    assert core.arrivals == 1 and sum(core.outcomes.values()) == 0


async def test_the_core_alone_judges_by_the_true_deadline_and_plans_by_the_return_hop() -> None:
    rig = Rig()
    request_id = rig.submit(slo_ms=10.0)
    await _end_of_round()
    (infer,) = rig.link.infers()
    hop_ns = 500_000  # the initial return hop estimate, told to the core at start
    action = rig.dispatcher.book.actions_of("e1")[0]
    assert infer.latest_ns + action.predicted_ns <= rig.now_ns + 10 * MS - hop_ns
    # The result reaches the controller with the return hop left for the reply: ok.
    rig.now_ns += 10 * MS - hop_ns
    outputs = {"output": np.ones((1, 4), np.float32)}
    rig.link.answer(0, outputs=outputs, start_ns=rig.now_ns - 3 * MS, end_ns=rig.now_ns - 1)
    assert rig.replies[request_id].outcome is Outcome.OK
    # A second request whose result comes after its deadline: late, whatever the way out.
    late_id = rig.submit(slo_ms=10.0)
    await _end_of_round()
    rig.now_ns += 10 * MS + 1
    rig.link.answer(1, outputs=outputs, start_ns=rig.now_ns - 3 * MS, end_ns=rig.now_ns - 1)
    late = rig.replies[late_id]
    assert late.outcome is Outcome.LATE and "after the deadline" in late.message
    assert late.outputs["output"].shape == (1, 4)
    core = rig.dispatcher.controller.stats().outcomes
    assert dict(rig.dispatcher.book.outcomes) == {"ok": 1, "late": 1}
    assert core["ok"] == 1 and core["late"] == 1


async def test_an_ok_whose_reply_would_leave_after_its_deadline_leaves_late() -> None:
    rig = Rig()
    first, second = rig.submit(slo_ms=10.0), rig.submit(slo_ms=10.0)
    await _end_of_round()
    rig.link.infers()
    ended_ns = rig.now_ns = rig.now_ns + 5 * MS  # the result comes with 5 ms to spare ...

    def slow_write(outcome: InferOutcome) -> None:
        rig.replies[outcome.request_id] = outcome
        rig.now_ns += 6 * MS  # ... but the first reply's write takes 6 ms

    rig.dispatcher.book.request(first).on_reply = slow_write  # type: ignore[union-attr]
    outputs = {"output": np.ones((2, 4), np.float32)}
    rig.link.answer(0, outputs=outputs, start_ns=ended_ns - 3 * MS, end_ns=ended_ns)
    assert rig.replies[first].outcome is Outcome.OK
    late = rig.replies[second]  # judged ok with the first, it would leave 1 ms late
    assert late.outcome is Outcome.LATE and "1.000 ms after the deadline" in late.message
    assert late.outputs["output"].shape == (1, 4)  # its result still goes with it
    assert dict(rig.dispatcher.book.outcomes) == {"ok": 1, "late": 1}
    # The way it took (the executor's end to the reply out: 6 ms) is a return hop sample.
    assert max(rig.dispatcher._hops.back._samples) == 6 * MS


async def test_a_drain_out_of_time_has_the_core_answer_the_rest() -> None:
    rig = Rig()
    ids = [rig.submit() for _ in range(3)]
    await _end_of_round()
    await rig.dispatcher.drain(timeout_s=0.0)
    assert {rig.replies[i].outcome for i in ids} == {Outcome.SHUTTING_DOWN}
    assert rig.dispatcher.controller.stats().outcomes["shutting_down"] == 3
    later = rig.submit()  # refused at the door while draining
    assert rig.replies[later].outcome is Outcome.SHUTTING_DOWN
    assert rig.dispatcher.book.request_count == 0
    rig.link.answer(0, outputs={"output": np.ones((3, 4), np.float32)})  # too late: ignored
    assert rig.dispatcher.book.outcomes == {"shutting_down": 4}
    rig.dispatcher.close()


async def test_reading_state_never_runs_the_core() -> None:
    rig = Rig()
    rig.submit()
    stats_before = rig.dispatcher.controller.stats()
    assert rig.dispatcher.held_arrivals == 1
    _ = (rig.dispatcher.book.request_count, rig.dispatcher.costs(), rig.dispatcher.models)
    assert rig.dispatcher.held_arrivals == 1 and rig.link.infers() == []
    assert rig.dispatcher.controller.stats().arrivals == stats_before.arrivals
    await _end_of_round()


async def test_deadlines_come_from_the_slo_the_unix_deadline_or_the_model() -> None:
    rig = Rig()
    unix_offset_ns = 5_000_000 * MS  # Unix = monotonic + 5000 s
    rig.dispatcher._unix_now_ns = lambda: rig.now_ns + unix_offset_ns
    unix_deadline_ns = rig.now_ns + unix_offset_ns + 30 * MS
    for slo_ns, deadline_unix_ns in ((20 * MS, None), (None, unix_deadline_ns), (None, None)):
        rig.dispatcher.submit(
            "a", _row(), slo_ns=slo_ns, deadline_unix_ns=deadline_unix_ns, on_reply=print
        )
    requests = [rig.dispatcher.book.request(i) for i in (1, 2, 3)]
    assert [r.deadline_ns - rig.now_ns for r in requests if r] == [20 * MS, 30 * MS, 100 * MS]
    await _end_of_round()


async def test_listeners_get_labels_that_clients_cannot_grow() -> None:
    rig = Rig()
    seen: list[tuple[str, str, Outcome]] = []
    rig.dispatcher.outcome_listeners.append(lambda m, g, _s, o: seen.append((m, g, o.outcome)))
    rig.submit(model="made-up")
    rig.submit(row={})
    assert seen == [
        ("other", "other", Outcome.UNKNOWN_MODEL),
        ("a", "a", Outcome.BAD_INPUT),
    ]
