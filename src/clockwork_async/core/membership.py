"""Executors joining and leaving; models registered and unregistered.

Invariants: nothing is left unanswered. When an executor leaves, each of its outstanding
INFERs' running requests is queued again if it can still be served elsewhere, else answered
``failed``; its copies are forgotten (their models turn cold if they still have queued
requests). When a model is unregistered its queued requests are answered ``unknown_model`` (the
model they named is gone; documented in docs/controller.md), running ones finish, and each copy
is unloaded as soon as no INFER of it is outstanding.
"""

from __future__ import annotations

from .agenda import mark_cold, push_head
from .entities import ActionKind, ExecutorState, ModelState
from .errors import InvalidEvent
from .events import (
    ExecutorJoined,
    ExecutorLead,
    ExecutorLeft,
    ModelRegistered,
    ModelUnregistered,
)
from .eviction import forget_if_gone, send_unload
from .lanes import Lane
from .ledger import release, unbook
from .models import validate_spec
from .outcomes import Outcome
from .policies import Policy
from .queues import RequestStatus
from .requests import answer, rebook
from .results import learn_lead, replan_or_end
from .state import CoreState


def on_executor_joined(core: CoreState, policy: Policy, event: ExecutorJoined) -> None:
    """Start tracking an executor (a re-join first settles the old one as left)."""
    if event.pages_total < 0 or event.page_bytes < 0:
        raise InvalidEvent(f"executor {event.executor_id!r}: negative pages or page size")
    if event.executor_id in core.executors:
        on_executor_left(core, policy, ExecutorLeft(event.executor_id, "joined again"))
    executor = ExecutorState(
        event.executor_id, event.kind, event.pages_total, event.page_bytes, core.now_ns
    )
    config = core.config
    executor.exec_lane = Lane(config.warm_gap_ns, config.window_size, config.percentile)
    core.executors[event.executor_id] = executor
    core.kinds[event.kind] = core.kinds.get(event.kind, 0) + 1
    core.free_load_slots += core.config.max_loads_in_flight
    for name in event.loaded:
        _adopt_resident(core, executor, name)
    core.placement_dirty = True
    core.to_fill[executor.executor_id] = executor


def _adopt_resident(core: CoreState, executor: ExecutorState, name: str) -> None:
    model = core.models.get(name)
    pages = model.spec.weights_pages if model is not None else 0
    if model is None or executor.holds(name) or pages > executor.pages_free:
        core.counters["resident_unknown"] += 1
        send_unload(core, executor, name, eviction=False)
        return
    executor.loaded[name] = pages
    executor.pages_used += pages
    model.loaded_on[executor.executor_id] = None
    push_head(core, executor, model)


def on_executor_lead(core: CoreState, event: ExecutorLead) -> None:
    """`results.learn_lead`: the way there to plan new actions on that executor by."""
    learn_lead(core, event.executor_id, event.lead_ns)


def on_executor_left(core: CoreState, policy: Policy, event: ExecutorLeft) -> None:
    """Settle everything outstanding on a departed executor."""
    executor = core.executors.pop(event.executor_id, None)
    if executor is None:
        return
    executor.alive = False
    core.kinds[executor.kind] -= 1
    if not core.kinds[executor.kind]:
        del core.kinds[executor.kind]
    core.free_load_slots -= core.config.max_loads_in_flight - len(executor.loading)
    core.to_fill.pop(executor.executor_id, None)
    core.reserving.pop(executor.executor_id, None)
    touched = _forget_copies(core, executor)
    for model in list(executor.reserved.values()):
        release(model)
        touched.append(model)
    _rebook_queued(core, policy, executor, touched)
    for action_id in [a for a, (e, _) in core.unloads.items() if e == executor.executor_id]:
        del core.unloads[action_id]
    why = f"executor {executor.executor_id!r} left ({event.reason})"
    for action in executor.actions.values():
        del core.actions[action.action_id]
        if action.kind is not ActionKind.INFER:
            continue
        for request in action.requests:
            if request.status is RequestStatus.RUNNING:
                replan_or_end(core, policy, request, Outcome.FAILED, why)
    for model in touched:
        mark_cold(core, model)
        forget_if_gone(core, model.name)


def _rebook_queued(
    core: CoreState, policy: Policy, executor: ExecutorState, models: list[ModelState]
) -> None:
    """Book again, elsewhere, the queued requests of ``models`` booked on a departed
    executor (only models it held or had reserved can have them)."""
    for model in models:
        for request in model.queue.first_live(model.queued):
            if request.planned_on is executor:
                unbook(request)
                rebook(core, policy, request)


def _forget_copies(core: CoreState, executor: ExecutorState) -> list[ModelState]:
    touched: list[ModelState] = []
    for name in (*executor.loaded, *executor.loading):
        model = core.models.get(name) or core.retiring.get(name)
        if model is None:
            continue
        model.loaded_on.pop(executor.executor_id, None)
        model.loading_on.pop(executor.executor_id, None)
        touched.append(model)
    return touched


def on_model_registered(core: CoreState, event: ModelRegistered) -> None:
    """Register a model; registering a name again replaces its spec (and re-seeds)."""
    spec = event.spec
    validate_spec(spec)
    model = core.models.get(spec.name) or core.retiring.pop(spec.name, None)
    if model is None:
        core.models[spec.name] = ModelState(spec)
        return
    core.predictions.forget(spec.name)
    model.set_spec(spec)
    model.retired = False
    core.models[spec.name] = model
    for executor_id in model.loaded_on:
        push_head(core, core.executors[executor_id], model)
    mark_cold(core, model)


def on_model_unregistered(core: CoreState, event: ModelUnregistered) -> None:
    """Unregister a model: answer its queue, unload its idle copies."""
    model = core.models.pop(event.name, None)
    if model is None:
        return
    model.retired = True
    core.cold.pop(model.name, None)
    core.wants_copy.pop(model.name, None)
    message = f"model {model.name!r} was unregistered"
    for request in model.drain():
        answer(core, request, Outcome.UNKNOWN_MODEL, message)
    core.retiring[model.name] = model  # until its last copy is unloaded
    for executor_id in list(model.loaded_on):
        executor = core.executors[executor_id]
        if not executor.is_busy_with(model.name):
            send_unload(core, executor, model.name, eviction=False)
    forget_if_gone(core, model.name)
