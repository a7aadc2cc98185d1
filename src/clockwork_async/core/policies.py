"""Scheduling policies behind one interface: ``clockwork``, ``fifo`` and ``timeout``.

Invariants: a policy decides admission, the order of each model's queue, when a queued request
is given up (``dropped``), and which batch an executor with a free execute lane takes next;
the mechanics (lanes, actions, answers, placement) are shared. Only ``clockwork`` looks at
deadlines when scheduling: ``fifo`` never drops and never rejects (but unknown models and
shutdown), ``timeout`` drops only requests that waited too long in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from .admission import FAR_FUTURE_NS, can_meet, cap_rejection, copies_can_meet, still_servable
from .models import ModelState, RequestState
from .outcomes import Outcome
from .state import CoreState
from .tracker import ExecutorState


@dataclass(slots=True)
class Batch:
    """Run ``requests`` (in queue order) as one INFER of ``batch_size`` rows."""

    requests: list[RequestState]
    batch_size: int
    predicted_ns: int
    latest_ns: int


@dataclass(frozen=True, slots=True)
class Defer:
    """Nothing now; look at this model on this executor again at ``until_ns``."""

    until_ns: int


class NoBatch(Enum):
    EMPTY = "empty"  # nothing queued (any more)
    SKIP = "skip"  # another copy should serve the head


Plan = Batch | Defer | NoBatch


class Policy(Protocol):
    name: str
    sheds: bool  # drops queued requests the moment they become hopeless

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> tuple[Outcome, str] | None:
        """Return a rejection (outcome, sentence), or None to accept."""
        ...

    def plan_keys(self, core: CoreState, model: ModelState, deadline_ns: int) -> tuple[int, int]:
        """Return (internal deadline, queue key) for a request arriving now."""
        ...

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        """Return when a still-queued request is given up, or None for never."""
        ...

    def cold_drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        """Return when a still-queued request of a model with no copy is given up, or None."""
        ...

    def drop_message(self, cold: bool) -> str: ...

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        """Choose the next INFER of ``model`` on ``executor`` starting at ``start_ns``."""
        ...

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> bool:
        """Drop queued requests of ``model`` that no copy can start in time, given that
        ``executor`` is busy until ``start_ns``; return True when any was dropped."""
        ...

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        """Return True when a request whose action failed should be queued again."""
        ...


class ClockworkPolicy:
    """Deadline-aware: admission by feasibility, EDF, largest batch meeting every deadline,
    drop the moment no copy can start a request in time."""

    name = "clockwork"
    sheds = True

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> tuple[Outcome, str] | None:
        capped = cap_rejection(core, model)
        if capped is not None:
            return capped
        internal_ns, _ = self.plan_keys(core, model, deadline_ns)
        if not core.executors:
            return Outcome.INFEASIBLE, "no executor is connected"
        if can_meet(core, model, internal_ns):
            return None
        if model.has_copy():
            core.note_pressure(model)
        slo_ms = (deadline_ns - core.now_ns) / 1e6
        return Outcome.INFEASIBLE, (
            f"no executor can finish {model.name!r} within its {slo_ms:.2f} ms SLO "
            "(including a cold start)"
        )

    def plan_keys(self, core: CoreState, model: ModelState, deadline_ns: int) -> tuple[int, int]:
        internal_ns = deadline_ns - core.config.margin_ns(deadline_ns - core.now_ns)
        return internal_ns, internal_ns

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        # One ns past the last start that can still end by the internal deadline.
        return request.internal_deadline_ns - core.best_exec_b1_ns(request.model) + 1

    def cold_drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        model = request.model
        return (
            request.internal_deadline_ns
            - core.best_exec_b1_ns(model)
            - core.best_load_ns(model)
            + 1
        )

    def drop_message(self, cold: bool) -> str:
        if cold:
            return "its model is loaded nowhere and a load can no longer finish in time"
        return "no executor can start it in time any more"

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        exec_ns = core.predict(model, executor).exec_ns
        head = self._first_servable(core, executor, model, start_ns, exec_ns)
        if isinstance(head, NoBatch):
            return head
        head_count = _fitting_count(model, exec_ns, head.internal_deadline_ns - start_ns)
        head_count = min(head_count, model.queued)
        head_exec_ns = exec_ns[model.padded_batch(head_count)]
        if head_count < min(model.max_batch, model.queued):
            fuller = _fuller_batch(model, exec_ns, start_ns, head_count, head_exec_ns)
            if fuller is not None:
                return fuller
        return _batch_from(model, exec_ns, 0, head_count, head.internal_deadline_ns)

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> bool:
        queued = model.queued
        exec_ns = core.predict(model, executor).exec_ns
        self._first_servable(core, executor, model, start_ns, exec_ns)
        return model.queued < queued

    def _first_servable(
        self,
        core: CoreState,
        executor: ExecutorState,
        model: ModelState,
        start_ns: int,
        exec_ns: dict[int, int],
    ) -> RequestState | NoBatch:
        """Drop queue heads no copy can start in time; return the first servable head here,
        or SKIP when another copy should serve it, or EMPTY."""
        b1_ns = exec_ns[model.spec.batch_sizes[0]]
        while True:
            head = model.peek()
            if head is None:
                return NoBatch.EMPTY
            deadline_ns = head.internal_deadline_ns
            if start_ns + b1_ns <= deadline_ns:
                return head
            other = copies_can_meet(core, model, deadline_ns, exclude=executor)
            if other is not None:
                _nudge(core, other)
                return NoBatch.SKIP
            core.note_pressure(model)
            core.answer(head, Outcome.DROPPED, self.drop_message(cold=False))

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        return still_servable(core, request)


class FifoPolicy:
    """No admission, no deadlines: arrival order, batch what is queued (up to the largest
    supported batch), never drop; a result after the deadline is answered ``late``."""

    name = "fifo"
    sheds = False

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> tuple[Outcome, str] | None:
        return None

    def plan_keys(self, core: CoreState, model: ModelState, deadline_ns: int) -> tuple[int, int]:
        return deadline_ns, core.now_ns

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        return None

    def cold_drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        return None

    def drop_message(self, cold: bool) -> str:
        return "dropped"  # pragma: no cover - fifo never drops

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        if model.peek() is None:
            return NoBatch.EMPTY
        return _take_fifo_batch(core, executor, model)

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> bool:
        return False

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        return not request.model.retired


class TimeoutPolicy(FifoPolicy):
    """Triton-like dynamic batching: arrival order; a batch goes when it is full or its oldest
    request waited ``max_queue_delay_ns``; a request still queued ``queue_timeout_ns`` after
    arrival (0: at its deadline) is dropped; per-model and total queue caps."""

    name = "timeout"

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> tuple[Outcome, str] | None:
        return cap_rejection(core, model)

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        timeout_ns = core.config.queue_timeout_ns
        return request.arrival_ns + timeout_ns if timeout_ns else request.deadline_ns

    def drop_message(self, cold: bool) -> str:
        return "timed out in the queue"

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        head = model.peek()
        if head is None:
            return NoBatch.EMPTY
        ready_ns = head.arrival_ns + core.config.max_queue_delay_ns
        if model.queued < model.max_batch and core.now_ns < ready_ns:
            return Defer(ready_ns)
        return _take_fifo_batch(core, executor, model)


def _fitting_count(model: ModelState, exec_ns: dict[int, int], budget_ns: int) -> int:
    """Return the largest supported batch size whose execution fits ``budget_ns`` (or 0)."""
    fitting = 0
    for size in model.spec.batch_sizes:
        if exec_ns[size] > budget_ns:
            break
        fitting = size
    return fitting


def _batch_from(
    model: ModelState, exec_ns: dict[int, int], position: int, count: int, deadline_ns: int
) -> Batch:
    """Take up to ``count`` requests from ``position`` as one padded batch."""
    requests = model.take(count, position)
    padded = model.padded_batch(len(requests))
    return Batch(requests, padded, exec_ns[padded], deadline_ns - exec_ns[padded])


def _fuller_batch(
    model: ModelState,
    exec_ns: dict[int, int],
    start_ns: int,
    head_count: int,
    head_exec_ns: int,
) -> Batch | None:
    """Return a batch of more than ``head_count`` requests that skips the most urgent ones,
    when serving the head's batch first would make it miss; else None (head first).

    For each batch size b, largest first, the candidate is the b requests from the first whose
    deadline allows a batch of b to start now. The first candidate larger than the head's
    batch decides: if it could still start after the head's batch, the head goes first (no
    loss); otherwise the larger batch goes now and the skipped requests are left to other
    copies or dropped (under overload this keeps batches, hence goodput, at their largest).
    """
    queue = model.queue
    for size in reversed(model.spec.batch_sizes):
        if size <= head_count:
            return None
        position = queue.position_at_least(start_ns + exec_ns[size])
        first = queue.first_from(position)
        if first is None:
            continue
        count = min(size, _live_count_from(model, position, size))
        if count <= head_count:
            continue
        latest_ns = first.internal_deadline_ns - exec_ns[model.padded_batch(count)]
        if latest_ns >= start_ns + head_exec_ns:
            return None
        return _batch_from(model, exec_ns, position, count, first.internal_deadline_ns)
    return None


def _live_count_from(model: ModelState, position: int, limit: int) -> int:
    return model.queue.count_from(position, limit)


def _take_fifo_batch(core: CoreState, executor: ExecutorState, model: ModelState) -> Batch:
    count = min(model.queued, model.max_batch)
    padded = model.padded_batch(count)
    predicted_ns = core.predict(model, executor).exec_ns[padded]
    return Batch(model.take(count), padded, predicted_ns, FAR_FUTURE_NS)


def _nudge(core: CoreState, executor: ExecutorState) -> None:
    """Ask for a fill of ``executor`` if its execute lane wants work now."""
    horizon_ns = core.now_ns + core.config.schedule_ahead_ns
    if executor.exec_lane.free_at(core.now_ns) <= horizon_ns:
        core.to_fill[executor.executor_id] = executor


POLICIES: dict[str, type[ClockworkPolicy] | type[FifoPolicy]] = {
    "clockwork": ClockworkPolicy,
    "fifo": FifoPolicy,
    "timeout": TimeoutPolicy,
}


def make_policy(name: str) -> Policy:
    """Return a new policy by name. Raises KeyError naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
