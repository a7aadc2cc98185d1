"""Arrivals, cancellations, and the feasibility tests the policies share.

Invariants: a request is rejected at arrival (never accepted) with exactly one of
``unknown_model``, ``shutting_down``, ``overloaded`` or ``infeasible``, or accepted and queued.
"Can meet" always means: some executor could *start* the request's batch-1 execution early
enough that it ends by the request's internal deadline (deadline minus margin), given only the
work already committed to its lanes ("even now": the queue of waiting requests is ignored).
"""

from __future__ import annotations

from .errors import InvalidEvent
from .events import Abandon, RequestArrived, RequestCancelled
from .ledger import book
from .models import ModelState, RequestState
from .outcomes import Outcome
from .state import CoreState
from .tracker import ExecutorState
from .warm_up import warm_up

FAR_FUTURE_NS = 1 << 62


def on_request_arrived(core: CoreState, event: RequestArrived) -> None:
    """Admit or reject a request; an admitted one is queued (and maybe dispatched later)."""
    if event.request_id in core.requests:
        raise InvalidEvent(f"request id {event.request_id} is already in use")
    core.arrivals += 1
    if core.shutting_down:
        core.reject(event.request_id, Outcome.SHUTTING_DOWN, "the server is shutting down")
        return
    model = core.models.get(event.model)
    if model is None:
        message = f"model {event.model!r} is not registered"
        core.reject(event.request_id, Outcome.UNKNOWN_MODEL, message)
        return
    model.note_arrival(core.now_ns, core.config.utilisation_window_ns)
    deadline_ns = event.deadline_ns - core.return_hop_ns  # the result must be back by then
    verdict = core.policy.admit(core, model, deadline_ns)
    if isinstance(verdict, tuple):
        core.reject(event.request_id, verdict[0], verdict[1])
        if verdict[0] is Outcome.INFEASIBLE:  # nothing runs to correct an outlier: relax
            _relax(core, model)
            if core.config.warm_up_infers:
                warm_up(core, model, deadline_ns)
        return
    internal_ns, key_ns = core.policy.plan_keys(core, model, deadline_ns)
    request = RequestState(
        event.request_id, model, core.now_ns, deadline_ns, internal_ns, key_ns, event.deadline_ns
    )
    core.requests[event.request_id] = request
    if verdict is not None:
        book(core, request, verdict)
    core.enqueue(request)


def _relax(core: CoreState, model: ModelState) -> None:
    """Let stale predictions of ``model`` (and the executors' cold starts) forget an outlier."""
    config = core.config
    now_ns, stale_ns, factor = core.now_ns, config.prediction_stale_ns, config.outlier_factor
    core.predictions.relax(model.name, now_ns, stale_ns, factor)
    if config.warm_gap_ns:
        for executor in core.executors.values():
            executor.exec_lane.relax_cold_extra(now_ns, stale_ns, factor)


def on_request_cancelled(core: CoreState, event: RequestCancelled) -> None:
    """Answer a live request ``cancelled`` (a running batch still runs; its row is dropped)."""
    request = core.requests.get(event.request_id)
    if request is None:
        core.counters["stray_cancels"] += 1
        return
    core.answer(request, Outcome.CANCELLED, "cancelled by the client")


def on_abandon(core: CoreState, event: Abandon) -> None:
    """Answer every accepted request ``shutting_down`` now (queued or running)."""
    for request in list(core.requests.values()):
        core.answer(request, Outcome.SHUTTING_DOWN, event.message)


def cap_rejection(core: CoreState, model: ModelState) -> tuple[Outcome, str] | None:
    """Return an ``overloaded`` rejection when a queue cap is reached, else None."""
    config = core.config
    if core.queued_total >= config.max_queued_total:
        return Outcome.OVERLOADED, f"{core.queued_total} requests are queued (the cap)"
    if model.queued >= config.max_queued_per_model:
        return Outcome.OVERLOADED, f"{model.queued} requests for {model.name!r} are queued"
    return None


def copy_start_ns(core: CoreState, model: ModelState, executor: ExecutorState) -> int:
    """Return the earliest time a new INFER of ``model`` could start on ``executor``
    (loaded there, or loading: after its LOAD is predicted to end)."""
    now_ns = core.now_ns
    start_ns = executor.exec_lane.start_for(now_ns)
    load = executor.loading.get(model.name)
    if load is not None:
        executor.load_lane.free_at(now_ns)  # resynchronises the LOAD's predicted end
        start_ns = max(start_ns, load.planned_end_ns)
    return start_ns


def copy_can_meet(
    core: CoreState, model: ModelState, executor: ExecutorState, internal_deadline_ns: int
) -> bool:
    """Return True when ``executor``'s copy could finish a batch of 1 by the deadline."""
    b1_ns = core.predict(model, executor).exec_ns[model.spec.batch_sizes[0]]
    return copy_start_ns(core, model, executor) + b1_ns <= internal_deadline_ns


def copies_can_meet(
    core: CoreState,
    model: ModelState,
    internal_deadline_ns: int,
    exclude: ExecutorState | None = None,
) -> ExecutorState | None:
    """Return a copy (loaded or loading, not ``exclude``) that can meet the deadline, or None."""
    executors = core.executors
    for executor_id in (*model.loaded_on, *model.loading_on):
        executor = executors[executor_id]
        if executor is not exclude and copy_can_meet(core, model, executor, internal_deadline_ns):
            return executor
    return None


def cold_start_can_meet(core: CoreState, model: ModelState, internal_deadline_ns: int) -> bool:
    """Return True when a LOAD on some executor without a copy, then a batch of 1, could end
    by the deadline (pages permitting at all; eviction is the placement's business)."""
    now_ns = core.now_ns
    need_pages = model.spec.weights_pages
    b1 = model.spec.batch_sizes[0]
    for executor in core.executors.values():
        if executor.pages_total < need_pages or executor.holds(model.name):
            continue
        predictions = core.predict(model, executor)
        ready_ns = executor.load_lane.start_for(now_ns) + predictions.load_ns
        start_ns = max(ready_ns, executor.exec_lane.start_for(now_ns))
        if start_ns + predictions.exec_ns[b1] <= internal_deadline_ns:
            return True
    return False


def can_meet(core: CoreState, model: ModelState, internal_deadline_ns: int) -> bool:
    """Return True when a copy, or else a cold start, could meet the deadline now."""
    if copies_can_meet(core, model, internal_deadline_ns) is not None:
        return True
    return cold_start_can_meet(core, model, internal_deadline_ns)


def still_servable(core: CoreState, request: RequestState) -> bool:
    """Return True when ``request`` could still be served in time (for re-planning)."""
    return not request.model.retired and can_meet(core, request.model, request.internal_deadline_ns)
