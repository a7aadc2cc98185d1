"""Feasibility: whether some executor could still serve a request of a model in time.

Invariant: "can meet" always means: some executor could *start* the request's batch-1
execution early enough that it ends by the request's internal deadline (deadline minus
margin), given only the work already committed to its lanes ("even now": the queue of waiting
requests is ignored). These functions only read the state (a lane behind its predictions is
resynchronised on the way, as any read of it does).
"""

from __future__ import annotations

from .entities import ExecutorState, ModelState, RequestState
from .state import CoreState, predict


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
    b1_ns = predict(core, model, executor).exec_ns[model.spec.batch_sizes[0]]
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
        predictions = predict(core, model, executor)
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
