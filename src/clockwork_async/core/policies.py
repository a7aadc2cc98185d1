"""Scheduling policies behind one interface: ``clockwork``, ``fifo`` and ``timeout``.

Invariants: a policy decides admission, the order of each model's queue, when a queued request
is given up (``dropped``), and which batch an executor with a free execute lane takes next;
the mechanics (lanes, actions, answers, placement) are shared. A policy only reads the state:
it answers with a value (a Rejection or a Quote, a Plan: Batch, Defer, NoBatch, Drop or
Handoff) that admission.py and scheduler.py carry out. Only ``clockwork`` looks at
deadlines when scheduling: ``fifo`` never drops and never rejects (but unknown models and
shutdown), ``timeout`` drops only requests that waited too long in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .batching import (
    Batch,
    batch_from,
    count_keeping_promises,
    fifo_batch,
    fitting_count,
    fuller_batch,
    head_first_loses,
)
from .entities import ExecutorState, ModelState, RequestState
from .feasibility import copies_can_meet, still_servable
from .ledger import best_quote, dispatch_fits, waits_for_load_before
from .outcomes import Outcome
from .quotes import Quote
from .requests import QueuePolicy
from .state import CoreState, best_exec_b1_ns, best_load_ns, predict


@dataclass(frozen=True, slots=True)
class Defer:
    """Nothing now; look at this model on this executor again at ``until_ns``."""

    until_ns: int


class NoBatch(Enum):
    EMPTY = "empty"  # nothing queued (any more)
    SKIP = "skip"  # another copy should serve the head


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 us to build; none is mutated
class Drop:
    """Answer ``requests`` (queue heads, in order) ``dropped`` with ``message``, noting that
    their model's copies cannot keep up; then ask the policy again."""

    requests: tuple[RequestState, ...]
    message: str


@dataclass(slots=True)
class Handoff:
    """Another copy, on ``executor``, should serve the head: fill it if its execute lane
    wants work; nothing here now (as NoBatch.SKIP)."""

    executor: ExecutorState


# Reject the arriving request: (outcome, message, wants_copy), ``wants_copy``: its model wants
# one more copy (or, with none, a LOAD) for the requests to come. A plain tuple: a rejection is
# built for most arrivals under overload, and a tuple costs a tenth of a dataclass.
Rejection = tuple[Outcome, str, bool]

Plan = Batch | Defer | NoBatch | Drop | Handoff


class Policy(QueuePolicy):
    """The interface every policy extends (a base class, as `QueuePolicy`)."""

    name: str = ""
    sheds: bool = False  # drops queued requests the moment they become hopeless

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> Rejection | Quote | None:
        """Return a Rejection (a tuple), or accept: a Quote to book the request with
        (ledger.py), or None (the policy keeps no ledger)."""
        raise NotImplementedError

    def plan_keys(self, core: CoreState, model: ModelState, deadline_ns: int) -> tuple[int, int]:
        """Return (internal deadline, queue key) for a request arriving now."""
        raise NotImplementedError

    def drop_message(self, cold: bool) -> str:
        raise NotImplementedError

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        """Choose the next INFER of ``model`` on ``executor`` starting at ``start_ns``."""
        raise NotImplementedError

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Drop | Handoff | None:
        """Return the queued requests of ``model`` that no copy can start in time, given that
        ``executor`` is busy until ``start_ns`` (ask again after dropping them), or where the
        head should go instead, or None."""
        raise NotImplementedError

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        """Return True when a request whose action failed should be queued again."""
        raise NotImplementedError


class ClockworkPolicy(Policy):
    """Deadline-aware: admission by feasibility, EDF, largest batch meeting every deadline,
    drop the moment no copy can start a request in time."""

    name = "clockwork"
    sheds = True

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> Rejection | Quote | None:
        capped = cap_rejection(core, model)
        if capped is not None:
            return capped
        if not core.executors:
            return Outcome.INFEASIBLE, "no executor is connected", False
        internal_ns, _key_ns = self.plan_keys(core, model, deadline_ns)
        quote = best_quote(core, model, internal_ns)
        room_ns = 0 if quote is None else _overrun_ns(core, quote)
        if quote is not None and quote.finish_ns + room_ns <= internal_ns:
            return quote
        message = _infeasible_message(core, model, quote, room_ns, deadline_ns)
        return Outcome.INFEASIBLE, message, True

    def requote(self, core: CoreState, request: RequestState) -> Quote | None:
        return best_quote(core, request.model, request.internal_deadline_ns)

    def plan_keys(self, core: CoreState, model: ModelState, deadline_ns: int) -> tuple[int, int]:
        internal_ns = deadline_ns - core.config.margin_ns(deadline_ns - core.now_ns)
        return internal_ns, internal_ns

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        # One ns past the last start that can still end by the internal deadline.
        return request.internal_deadline_ns - best_exec_b1_ns(core, request.model) + 1

    def cold_drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        model = request.model
        return (
            request.internal_deadline_ns
            - best_exec_b1_ns(core, model)
            - best_load_ns(core, model)
            + 1
        )

    def drop_message(self, cold: bool) -> str:
        if cold:
            return "its model is loaded nowhere and a load can no longer finish in time"
        return "no executor can start it in time any more"

    def plan(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Plan:
        exec_ns = predict(core, model, executor).exec_ns
        head = self._triage(core, executor, model, start_ns, exec_ns)
        if not isinstance(head, RequestState):
            return head
        head_count = fitting_count(model, exec_ns, head.internal_deadline_ns - start_ns)
        head_count = min(head_count, model.queued)
        head_exec_ns = exec_ns[model.padded_batch(head_count)]
        if head_count < min(model.max_batch, model.queued) and head_first_loses(
            model, exec_ns, start_ns + head_exec_ns, head_count
        ):
            fuller = fuller_batch(model, exec_ns, start_ns, head_count, head_exec_ns)
            if fuller is not None:
                return fuller
        count = count_keeping_promises(core, executor, model, exec_ns, start_ns, head_count)
        if executor.loading:
            cost_ns = exec_ns[model.padded_batch(count)]
            wait = _wait_for_load(core, executor, model, head, start_ns, count, cost_ns)
            if wait is not None:
                return wait
        return batch_from(model, exec_ns, 0, count, head.internal_deadline_ns)

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Drop | Handoff | None:
        exec_ns = predict(core, model, executor).exec_ns
        head = self._triage(core, executor, model, start_ns, exec_ns)
        return head if isinstance(head, (Drop, Handoff)) else None

    def _triage(
        self,
        core: CoreState,
        executor: ExecutorState,
        model: ModelState,
        start_ns: int,
        exec_ns: dict[int, int],
    ) -> RequestState | Drop | Handoff | NoBatch:
        """Return the head when it is servable here; else the heads before the first that
        some copy can start in time, to drop (Drop); else the copy that should serve the
        head (Handoff); or EMPTY."""
        b1_ns = exec_ns[model.spec.batch_sizes[0]]
        head = model.peek()
        if head is None:
            return NoBatch.EMPTY
        if start_ns + b1_ns <= head.internal_deadline_ns:
            return head  # the common case: nothing to drop
        hopeless: list[RequestState] = []
        for request in model.queue.live():
            deadline_ns = request.internal_deadline_ns
            if start_ns + b1_ns <= deadline_ns:
                break
            other = copies_can_meet(core, model, deadline_ns, exclude=executor)
            if other is not None:
                if not hopeless:
                    return Handoff(other)
                break
            hopeless.append(request)
        return Drop(tuple(hopeless), self.drop_message(cold=False))

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        if still_servable(core, request):
            return True
        # With no executor left (the only one just failed), wait for one to come back, as
        # queued requests of a model loaded nowhere do, until a load could no longer finish.
        if core.executors or request.model.retired:
            return False
        cold_drop_at_ns = self.cold_drop_at_ns(core, request)
        return cold_drop_at_ns is not None and cold_drop_at_ns > core.now_ns


class FifoPolicy(Policy):
    """No admission, no deadlines: arrival order, batch what is queued (up to the largest
    supported batch), never drop; a result after the deadline is answered ``late``."""

    name = "fifo"
    sheds = False

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> Rejection | Quote | None:
        return None

    def requote(self, core: CoreState, request: RequestState) -> Quote | None:
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
        return fifo_batch(core, executor, model)

    def shed(
        self, core: CoreState, executor: ExecutorState, model: ModelState, start_ns: int
    ) -> Drop | Handoff | None:
        return None

    def can_replan(self, core: CoreState, request: RequestState) -> bool:
        return not request.model.retired


class TimeoutPolicy(FifoPolicy):
    """Triton-like dynamic batching: arrival order; a batch goes when it is full or its oldest
    request waited ``max_queue_delay_ns``; a request still queued ``queue_timeout_ns`` after
    arrival (0: at its deadline) is dropped; per-model and total queue caps."""

    name = "timeout"

    def admit(
        self, core: CoreState, model: ModelState, deadline_ns: int
    ) -> Rejection | Quote | None:
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
        return fifo_batch(core, executor, model)


def _overrun_ns(core: CoreState, quote: Quote) -> int:
    """Room to leave after a quote: with work planned before it, as much as the executor's
    recent INFERs ran over their predictions (0 on an idle lane, and while they keep to
    them). The work ahead running over would otherwise push the request past its deadline
    after it was accepted: refused now instead of dropped later (at SLOs near 2x b1).

    An idle lane's next INFER may start after now (the way there, ``lead_ns``; a cold lane's
    extra): neither is an execution that can run over, so it leaves no room (with a room
    there, one long overrun refused every request and nothing ran to forget it)."""
    lane = quote.executor.exec_lane
    if not lane.overrun_ns:
        return 0
    now_ns = core.now_ns
    committed_ahead = lane.free_at(now_ns) > now_ns + lane.lead_ns
    if not committed_ahead and quote.open_start_ns <= lane.start_for(now_ns):
        return 0
    return lane.overrun_ns


def _infeasible_message(
    core: CoreState, model: ModelState, quote: Quote | None, room_ns: int, deadline_ns: int
) -> str:
    """Why a request was refused, naming only what the best quote counted: a cold start
    (a new LOAD), a reserved or running LOAD, a cold lane's extra, the overrun room."""
    if quote is None:
        pages = model.spec.weights_pages
        where = "free or held by idle models it may evict"
        return f"no executor can hold {model.name!r} now: none has {pages} pages {where}"
    now_ns = core.now_ns
    slo_ms = max(deadline_ns - now_ns, 0) / 1e6
    after = "the work already queued"
    executor_id = quote.executor.executor_id
    if quote.load_ns:
        after = f"a cold start (LOAD {quote.load_ns / 1e6:.2f} ms) and {after}"
    elif quote.ready_ns:
        after = f"its model's reserved LOAD and {after}"
    elif executor_id in model.loading_on:
        after = f"its copy's LOAD in progress and {after}"
    lane = quote.executor.exec_lane
    extra_ns = lane.start_for(now_ns) - max(lane.free_at(now_ns), now_ns + lane.lead_ns)
    if extra_ns > 0:
        after += f", including the idle lane's cold extra ({extra_ns / 1e6:.2f} ms)"
    if room_ns:
        after += f", leaving {room_ns / 1e6:.2f} ms for its execute lane's recent overruns"
    return (
        f"no executor can finish {model.name!r} within its SLO ({slo_ms:.2f} ms left) after {after}"
    )


def cap_rejection(core: CoreState, model: ModelState) -> Rejection | None:
    """Return an ``overloaded`` rejection when a queue cap is reached, else None."""
    config = core.config
    if core.queued_total >= config.max_queued_total:
        return Outcome.OVERLOADED, f"{core.queued_total} requests are queued (the cap)", False
    if model.queued >= config.max_queued_per_model:
        message = f"{model.queued} requests for {model.name!r} are queued"
        return Outcome.OVERLOADED, message, False
    return None


def _wait_for_load(
    core: CoreState,
    executor: ExecutorState,
    model: ModelState,
    head: RequestState,
    start_ns: int,
    count: int,
    cost_ns: int,
) -> Defer | NoBatch | None:
    """When work booked on ``executor`` before the head's own batch waits for a LOAD there
    and running this batch (``count`` requests, ``cost_ns``) in the gap would push that work
    past its deadline, return how to wait: until the LOAD's predicted end, or, past it, for
    its result (which brings a fill). Else None: the batch goes."""
    if head.planned_on is not executor:
        return None
    load_end_ns = waits_for_load_before(executor, head.booked_batch)
    if load_end_ns is None:
        return None
    if dispatch_fits(core, executor, model.queue.first_live(count), start_ns, cost_ns):
        return None
    return Defer(load_end_ns) if load_end_ns > core.now_ns else NoBatch.SKIP


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
