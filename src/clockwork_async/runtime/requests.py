"""The dispatcher's book of outstanding requests and actions, what a caller gets back, and the
prediction errors of the INFERs it saw finish.

One idea: what is outstanding between the core and the callers, and the answer each gets.

Invariants: a request is in the book from acceptance until it is popped to be answered (so it
is answered once); an action is in the book from the moment it is sent until its ActionFinished
has been handled or its executor left; ``actions_of``/``actions_for_model`` index exactly the
actions in the book. An INFER sent by reference pins its requests' IO arena slots until it
leaves the book (`finish_action`): no slot an executor may use is freed under it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.events import ActionFinished, Reply, StartInfer, StartLoad, StartUnload
from clockwork_async.core.outcomes import Outcome
from clockwork_async.core.percentile import percentile
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.runtime.batching import (
    RowSlot,
    assemble_batch,
    input_refs,
    output_layout,
    output_refs,
    output_rows,
    region_rows,
    zero_batch,
)
from clockwork_async.runtime.snapshot import PredictionErrorStats
from clockwork_async.wire.messages import ActionResult, Infer, Load, TensorSpec, Unload

_WITH_OUTPUTS = frozenset({Outcome.OK, Outcome.LATE})


@dataclass(slots=True)
class PendingRequest:
    request_id: int
    model: str
    inputs: Mapping[str, np.ndarray]
    on_reply: Callable[[InferOutcome], None]
    arrival_ns: int
    deadline_ns: int
    sent_ns: int = 0  # when the last INFER carrying it went out
    slot: Slot | None = None  # the IO arena slot its inputs are in (its caller releases it)


@dataclass(slots=True)
class ActionRecord:
    """An action sent to an executor and not resolved yet."""

    kind: str  # "infer" | "load" | "unload"
    executor_id: str
    action_id: int
    model: str
    sent_ns: int
    earliest_ns: int = 0
    latest_ns: int = 0
    request_ids: tuple[int, ...] = ()
    batch_size: int = 0
    predicted_ns: int = 0
    result: ActionResult | None = None
    received_ns: int = 0  # when its result reached the controller
    offset_ns: int = 0  # the executor's clock minus ours, when the result came
    slots: tuple[Slot, ...] = ()  # IO arena slots pinned while it is out (sent by reference)
    outputs_in: tuple[RowSlot, ...] = ()  # how its requests' outputs lie in their slots

    @classmethod
    def infer(cls, command: StartInfer, now_ns: int) -> ActionRecord:
        return cls(
            "infer",
            command.executor_id,
            command.action_id,
            command.model,
            now_ns,
            command.earliest_ns,
            command.latest_ns,
            command.request_ids,
            command.batch_size,
            command.predicted_ns,
        )

    @classmethod
    def load(cls, command: StartLoad, now_ns: int) -> ActionRecord:
        return cls(
            "load",
            command.executor_id,
            command.action_id,
            command.model,
            now_ns,
            command.earliest_ns,
            command.latest_ns,
        )

    @classmethod
    def unload(cls, command: StartUnload, now_ns: int) -> ActionRecord:
        return cls("unload", command.executor_id, command.action_id, command.model, now_ns)

    def load_message(self, offset_ns: int) -> Load:
        """The Load, its window in the executor's clock (``offset_ns`` = executor - ours)."""
        return Load(
            self.action_id, self.model, self.earliest_ns + offset_ns, self.latest_ns + offset_ns
        )

    def unload_message(self) -> Unload:
        return Unload(self.action_id, self.model)

    def finished_event(
        self,
        result: ActionResult,
        offset_ns: int,
        hops: tuple[int | None, int | None] = (None, None),
    ) -> ActionFinished:
        """The core's view of ``result``: controller-clock times, the predicted phase, and
        the hop estimates (way back, way there) that changed with it."""
        phase = {"infer": "execute", "load": "load"}.get(self.kind, "")
        return ActionFinished(
            self.executor_id,
            self.action_id,
            code=result.code,
            start_ns=result.start_ns - offset_ns if result.start_ns else 0,
            end_ns=result.end_ns - offset_ns if result.end_ns else 0,
            duration_ns=result.durations_ns.get(phase, 0) if phase else 0,
            return_hop_ns=hops[0],
            lead_ns=hops[1],
        )

    def track_loaded(self, loaded: set[str], result: ActionResult) -> None:
        """Keep an executor's set of loaded models in step with this action's result."""
        if result.ok and self.kind == "load":
            loaded.add(self.model)
        elif result.ok and self.kind == "unload":
            loaded.discard(self.model)


@dataclass(slots=True)
class RequestBook:
    """Outstanding requests and actions, with the indexes the dispatcher asks about."""

    _requests: dict[int, PendingRequest] = field(default_factory=dict)
    _actions: dict[int, ActionRecord] = field(default_factory=dict)
    _by_executor: dict[str, dict[int, ActionRecord]] = field(default_factory=dict)
    _by_model: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # every answer, counted once
    submitted: int = 0  # requests accepted into the book

    # Requests.

    @property
    def request_count(self) -> int:
        return len(self._requests)

    def add_request(self, request: PendingRequest) -> None:
        self._requests[request.request_id] = request
        self.submitted += 1

    def request(self, request_id: int) -> PendingRequest | None:
        return self._requests.get(request_id)

    def pop_request(self, request_id: int) -> PendingRequest | None:
        return self._requests.pop(request_id, None)

    def pop_all_requests(self) -> list[PendingRequest]:
        requests = list(self._requests.values())
        self._requests.clear()
        return requests

    def count(self, outcome: Outcome) -> None:
        self.outcomes[outcome.value] += 1

    # Actions.

    def add_action(self, action: ActionRecord) -> None:
        self._actions[action.action_id] = action
        self._by_executor.setdefault(action.executor_id, {})[action.action_id] = action
        self._by_model[action.model] += 1

    def action(self, action_id: int) -> ActionRecord | None:
        return self._actions.get(action_id)

    def finish_action(self, action_id: int) -> ActionRecord | None:
        """Forget an action and unpin its slots; returns it (None if it was not in the book)."""
        action = self._actions.pop(action_id, None)
        if action is not None:
            slots, action.slots = action.slots, ()
            for slot in slots:
                slot.unpin()
            self._by_executor[action.executor_id].pop(action_id, None)
            self._by_model[action.model] -= 1
            if not self._by_model[action.model]:
                del self._by_model[action.model]
        return action

    def unpin_all(self) -> None:
        """Let go of every action's slots (the dispatcher closed: no result will be read and
        nothing is leased any more)."""
        for action in self._actions.values():
            slots, action.slots = action.slots, ()
            for slot in slots:
                slot.unpin()

    def actions_of(self, executor_id: str) -> list[ActionRecord]:
        return list(self._by_executor.get(executor_id, {}).values())

    def actions_for_model(self, model: str) -> int:
        return self._by_model.get(model, 0)

    # Messages and outcomes.

    def infer_message(
        self,
        action: ActionRecord,
        specs: Sequence[TensorSpec],
        offset_ns: int,
        *,
        arena: IoArena | None = None,
        outputs: Sequence[TensorSpec] = (),
    ) -> Infer | None:
        """The Infer for ``action``: its requests' rows in order, padded to its batch size
        (a gone request's row filled by another), by reference into ``arena`` if it can
        (`_by_reference`); zeros for a warm-up (core/warm_up.py). None if all are gone."""
        if not action.request_ids:
            return self._infer(action, zero_batch(specs, action.batch_size), offset_ns)
        rows: list[Mapping[str, np.ndarray] | None] = []
        live: list[PendingRequest | None] = []
        filler: Mapping[str, np.ndarray] | None = None
        for request_id in action.request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                request.sent_ns = action.sent_ns
                filler = request.inputs if filler is None else filler
            rows.append(request.inputs if request is not None else None)
            live.append(request)
        if filler is None:
            return None
        if arena is not None:
            message = _by_reference(action, live, specs, outputs, arena, offset_ns)
            if message is not None:
                return message
        batch = assemble_batch(
            specs, [row if row is not None else filler for row in rows], action.batch_size
        )
        return self._infer(action, batch, offset_ns)

    @staticmethod
    def _infer(
        action: ActionRecord,
        batch: Mapping[str, np.ndarray],
        offset_ns: int,
        arena_inputs: tuple[int, ...] = (),
        arena_outputs: tuple[int, ...] = (),
    ) -> Infer:
        return Infer(
            action.action_id,
            action.model,
            action.batch_size,
            batch,
            action.earliest_ns + offset_ns,
            action.latest_ns + offset_ns,
            arena_inputs,
            arena_outputs,
        )

    def outcome(self, request: PendingRequest, reply: Reply, now_ns: int) -> InferOutcome:
        """The InferOutcome for the core's ``reply`` to ``request``."""
        action = self._actions.get(reply.action_id) if reply.action_id is not None else None
        result = action.result if action is not None else None
        outcome, message = reply.outcome, reply.message
        outputs: dict[str, np.ndarray] = {}
        timing = _timing(request, now_ns)
        if action is not None and result is not None:
            timing.update(_action_timing(action, result))
            if outcome in _WITH_OUTPUTS and result.ok:
                index = action.request_ids.index(request.request_id)
                outputs = output_rows(result.outputs, index, action.batch_size)
                region = request.slot.outputs if request.slot is not None else None
                if action.outputs_in and region is not None:  # the rest are in its slot
                    outputs.update(region_rows(region.array, action.outputs_in, outputs))
        if outcome in _WITH_OUTPUTS and (result is None or not result.ok):
            outcome, message = Outcome.FAILED, "internal error: the result of its batch is missing"
        if outcome is Outcome.OK and now_ns > request.deadline_ns:
            outcome, message = Outcome.LATE, _left_late(now_ns - request.deadline_ns)
        executor_id = reply.executor_id or (action.executor_id if action is not None else None)
        batch_size = action.batch_size if action is not None else 0
        return InferOutcome(
            request.request_id, outcome, message, outputs, timing, executor_id, batch_size
        )

    def rejection(
        self, request: PendingRequest, outcome: Outcome, message: str, now_ns: int
    ) -> InferOutcome:
        """An answer without a result (rejected at arrival, or answered while shutting down)."""
        return InferOutcome(
            request.request_id, outcome, message, {}, _timing(request, now_ns), None, 0
        )


def _by_reference(
    action: ActionRecord,
    live: Sequence[PendingRequest | None],
    specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
    arena: IoArena,
    offset_ns: int,
) -> Infer | None:
    """The Infer of ``action`` by reference (`Infer.arena_inputs`), pinning its requests'
    slots; None when a live request's rows are not all in the arena (it goes as bytes). A
    gone request's row repeats the first live one's; its outputs are dropped."""
    requests = [r for r in live if r is not None]
    refs = [input_refs(r.inputs, r.slot, specs, arena.offset_of) for r in requests]
    by_id = {r.request_id: row for r, row in zip(requests, refs, strict=True) if row is not None}
    if len(by_id) < len(requests):
        return None
    filler = by_id[requests[0].request_id]
    arena_inputs = [i for r in live for i in (by_id[r.request_id] if r else filler)]
    layout = output_layout(tuple(output_specs)) or ()
    slots = [r.slot if r is not None else None for r in live]
    arena_outputs = output_refs(slots, [r is not None for r in live], layout)
    action.slots = tuple(r.slot for r in requests if r.slot is not None)
    for slot in action.slots:
        slot.pin()
    action.outputs_in = layout if arena_outputs else ()
    return RequestBook._infer(action, {}, offset_ns, tuple(arena_inputs), tuple(arena_outputs))


def _left_late(over_ns: int) -> str:
    """The core judged the answer on time (its result came with the return hop to spare), but
    the replies and actions handled before it took longer than that hop: it leaves ``late``,
    never as an ``ok`` after its deadline."""
    return (
        f"the reply left the controller {over_ns / 1e6:.3f} ms after the deadline "
        "(its result came in time; the way out took longer than the return hop)"
    )


def _timing(request: PendingRequest, now_ns: int) -> dict[str, int]:
    queued_until_ns = request.sent_ns or now_ns
    return {
        "total": now_ns - request.arrival_ns,
        "queue": queued_until_ns - request.arrival_ns,
        "execute": 0,
        "predicted_execute": 0,
    }


def _action_timing(action: ActionRecord, result: ActionResult) -> dict[str, int]:
    timing = {
        "predicted_execute": action.predicted_ns,
        "executor": max(0, result.end_ns - result.start_ns) if result.start_ns else 0,
    }
    if result.start_ns and action.received_ns:
        # The two hops, in controller time: sent -> started on the executor (the way there,
        # the executor's dispatch and any wait for the window), ended -> result received.
        timing["to_executor"] = result.start_ns - action.offset_ns - action.sent_ns
        timing["from_executor"] = action.received_ns - (result.end_ns - action.offset_ns)
    timing.update(result.durations_ns)  # execute, copy_in, copy_out as measured
    return timing


class PredictionErrors:
    """Accumulates prediction errors; `snapshot` summarises them."""

    def __init__(self, window: int = 4096) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._count = 0
        self._total_ns = 0
        self._under = 0
        self._min_ns = 0
        self._max_ns = 0

    def add(self, model: str, error_ns: int) -> None:
        del model  # kept in the signature for per-model breakdowns later
        self._recent.append(error_ns)
        self._min_ns = error_ns if not self._count else min(self._min_ns, error_ns)
        self._max_ns = error_ns if not self._count else max(self._max_ns, error_ns)
        self._count += 1
        self._total_ns += error_ns
        self._under += error_ns > 0

    def snapshot(self) -> PredictionErrorStats:
        if not self._count:
            return PredictionErrorStats(0, 0.0, 0, 0, 0, 0, 0)
        ordered = sorted(self._recent)
        return PredictionErrorStats(
            count=self._count,
            mean_ns=self._total_ns / self._count,
            p50_ns=percentile(ordered, 50.0),
            p99_ns=percentile(ordered, 99.0),
            min_ns=self._min_ns,
            max_ns=self._max_ns,
            underpredicted=self._under,
        )


def resolve_deadline_ns(
    slo_ns: int | None,
    deadline_unix_ns: int | None,
    default_slo_ns: int,
    *,
    now_ns: int,
    unix_now_ns: int,
) -> int:
    """The request's deadline in the monotonic clock of ``now_ns`` (its arrival): ``slo_ns``
    after arrival, or ``deadline_unix_ns`` moved from Unix time (``unix_now_ns`` read at the
    same moment as ``now_ns``), or ``default_slo_ns`` after arrival when neither is set."""
    if deadline_unix_ns is not None:
        return now_ns + (deadline_unix_ns - unix_now_ns)
    return now_ns + (default_slo_ns if slo_ns is None else slo_ns)
