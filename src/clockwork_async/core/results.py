"""Action results: answer requests, correct the lanes, learn durations, re-plan failures.

Invariants: every result settles exactly one outstanding action (unknown ids are counted as
stray and ignored: e.g. a result racing an ExecutorLeft). A successful INFER answers each of
its still-running requests ``ok`` when the result arrived early enough for its reply to go
out by the request's true deadline (the return hop before it, `ReturnHop`), else ``late``
(outputs attached either way). A failed INFER re-queues its requests when they can
still be served (``too_late``, ``not_loaded``) and otherwise ends them: ``dropped`` when the
executor refused in time, ``failed`` on any other error.
"""

from __future__ import annotations

from .agenda import mark_cold, push_head
from .entities import Action, ActionKind, ExecutorState, RequestState
from .errors import InvalidEvent
from .events import ActionFinished, ExecutionTimes
from .eviction import forget_if_gone, send_unload
from .outcomes import Outcome
from .policies import Policy
from .queues import RequestStatus
from .requests import answer, requeue
from .state import CoreState, predict

REPLANNABLE = frozenset({"too_late", "not_loaded"})
ALREADY_LOADED = "already_loaded"


def on_action_finished(core: CoreState, policy: Policy, event: ActionFinished) -> None:
    """Learn the hops the result brought, then settle the action ``event`` reports on.
    Raises InvalidEvent for a negative hop, before any state changes."""
    _learn_hops(core, event)
    action = core.actions.get(event.action_id)
    if action is None or action.executor_id != event.executor_id:
        _on_unload_finished(core, event)
        return
    del core.actions[event.action_id]
    executor = core.executors[action.executor_id]
    del executor.actions[event.action_id]
    if action.kind is ActionKind.INFER:
        _infer_finished(core, policy, executor, action, event)
    else:
        _load_finished(core, executor, action, event)


def _learn_hops(core: CoreState, event: ActionFinished) -> None:
    """The hops that rode with a result, learned as `ReturnHop` and `ExecutorLead` are; both
    checked before either is learned."""
    if min(event.return_hop_ns or 0, event.lead_ns or 0) < 0:
        raise InvalidEvent(f"hops cannot be negative: {event!r}")
    if event.return_hop_ns is not None:
        learn_return_hop(core, event.return_hop_ns)
    if event.lead_ns is not None:
        learn_lead(core, event.executor_id, event.lead_ns)


def learn_return_hop(core: CoreState, hop_ns: int) -> None:
    """Plan each request that arrives from now on to end ``hop_ns`` before its deadline, and
    judge results against the deadline less it. Raises InvalidEvent for a negative hop."""
    if hop_ns < 0:
        raise InvalidEvent(f"a return hop cannot be negative, not {hop_ns}")
    core.return_hop_ns = hop_ns


def learn_lead(core: CoreState, executor_id: str, lead_ns: int) -> None:
    """Plan new actions on the executor's lanes ``lead_ns`` ahead at least; the work already
    committed keeps its plan. An unknown executor (it left meanwhile) is ignored. Raises
    InvalidEvent for a negative lead."""
    if lead_ns < 0:
        raise InvalidEvent(f"lead_ns must be >= 0, not {lead_ns}")
    executor = core.executors.get(executor_id)
    if executor is not None:
        executor.exec_lane.lead_ns = executor.load_lane.lead_ns = lead_ns


def _on_unload_finished(core: CoreState, event: ActionFinished) -> None:
    unload = core.unloads.get(event.action_id)
    if unload is None or unload[0] != event.executor_id:
        core.counters["stray_results"] += 1
        return
    del core.unloads[event.action_id]
    if event.code and event.code != "not_loaded":
        core.counters["unload_failures"] += 1


def _infer_finished(
    core: CoreState,
    policy: Policy,
    executor: ExecutorState,
    action: Action,
    event: ActionFinished,
) -> None:
    model = action.model
    lane = executor.exec_lane
    cold = lane.is_cold_start(event.start_ns)  # before finish moves base_ns past this one
    lane.finish(action, event.end_ns or core.now_ns)
    executor.remove_infer(model.name)
    if not event.code:
        if event.duration_ns > 0:
            _learn_execute(core, executor, action, event.duration_ns, cold)
        _answer_batch(core, action, event)
    else:
        _infer_failed(core, policy, executor, action, event.code)
    if model.retired and model.name in executor.loaded and not executor.is_busy_with(model.name):
        send_unload(core, executor, model.name, eviction=False)
    core.to_fill[executor.executor_id] = executor
    if core.cold or core.reserving or core.demand:
        core.placement_dirty = True  # the model may be evictable now


def _learn_execute(
    core: CoreState, executor: ExecutorState, action: Action, measured_ns: int, cold: bool
) -> None:
    """A back-to-back execution corrects the model's prediction; a cold start (after an idle
    gap, lanes.py) corrects the executor's cold extra instead; a warm-up behind another
    (warm_up.py) corrects nothing."""
    spec, kind, batch_size = action.model.spec, executor.kind, action.batch_size
    if action.probe:  # a cold lane's extra is the lane's, not the model's
        measured_ns -= executor.exec_lane.cold_extra_ns if cold else 0
        factor = core.config.outlier_factor
        core.predictions.record_probe(spec, kind, batch_size, measured_ns, core.now_ns, factor)
        return
    if not cold:
        if not action.warm_up:
            executor.exec_lane.note_overrun(measured_ns - action.predicted_ns)
            # The model's cached predictions (state.predict): no lookup by name and kind.
            windows = predict(core, action.model, executor)
            error_ns = windows.record_execute(batch_size, measured_ns, core.now_ns)
            core.predictions.note_execute_error(spec, kind, batch_size, error_ns)
        return
    lane = executor.exec_lane
    extra_ns = measured_ns - action.predicted_ns
    core.predictions.note_execute_error(spec, kind, batch_size, extra_ns - lane.cold_extra_ns)
    lane.learn_cold_extra(extra_ns, core.now_ns)


def _answer_batch(core: CoreState, action: Action, event: ActionFinished) -> None:
    now_ns = core.now_ns
    for request in action.requests:
        if request.status is not RequestStatus.RUNNING:
            continue  # cancelled while running
        # The one judge of ok and late: the reply must still go out (the return hop's way,
        # the runtime's estimate of one trip through the daemon's loop) by the true deadline.
        on_time = now_ns + core.return_hop_ns <= request.reply_by_ns
        times = ExecutionTimes(
            action.batch_size,
            action.predicted_ns,
            event.duration_ns,
            request.arrival_ns,
            event.start_ns,
            event.end_ns,
        )
        if on_time:
            answer(core, request, Outcome.OK, "", action, times)
        else:
            answer(core, request, Outcome.LATE, _late_message(core, request), action, times)


def _late_message(core: CoreState, request: RequestState) -> str:
    left_ns = request.reply_by_ns - core.now_ns
    if left_ns < 0:
        return f"the result reached the controller {-left_ns / 1e6:.3f} ms after the deadline"
    return (
        f"the result reached the controller {left_ns / 1e6:.3f} ms before the deadline, less "
        f"than the {core.return_hop_ns / 1e6:.3f} ms its reply needs to go out"
    )


def _infer_failed(
    core: CoreState, policy: Policy, executor: ExecutorState, action: Action, code: str
) -> None:
    core.counters["infer_errors"] += 1
    if code == "too_late":
        core.counters["too_late"] += 1
    if code == "not_loaded":
        forget_copy(core, executor, action.model.name)
    who = f"executor {executor.executor_id!r}"
    for request in action.requests:
        if request.status is not RequestStatus.RUNNING:
            continue
        if code in REPLANNABLE:
            why = f"{who} refused its batch ({code})"
            replan_or_end(core, policy, request, Outcome.DROPPED, why)
        else:
            answer(core, request, Outcome.FAILED, f"{who} failed its batch ({code})")


def replan_or_end(
    core: CoreState, policy: Policy, request: RequestState, outcome: Outcome, why: str
) -> None:
    """Queue a RUNNING request again if the policy says it can still be served, else end it."""
    if policy.can_replan(core, request):
        requeue(core, policy, request)
        return
    if request.model.retired:
        answer(core, request, Outcome.FAILED, f"{why}; its model was unregistered")
        return
    answer(core, request, outcome, f"{why}; no executor can serve it in time")


def forget_copy(core: CoreState, executor: ExecutorState, name: str) -> None:
    """The executor does not hold ``name`` after all: forget its copy and pages."""
    pages = executor.loaded.pop(name, None)
    if pages is None:
        return
    executor.pages_used -= pages
    model = core.models.get(name) or core.retiring.get(name)
    if model is not None:
        model.loaded_on.pop(executor.executor_id, None)
        mark_cold(core, model)
        forget_if_gone(core, name)


def _load_finished(
    core: CoreState, executor: ExecutorState, action: Action, event: ActionFinished
) -> None:
    model = action.model
    executor.load_lane.finish(action, event.end_ns or core.now_ns)
    del executor.loading[model.name]
    model.loading_on.pop(executor.executor_id, None)
    core.free_load_slots += 1
    core.placement_dirty = True
    core.to_fill[executor.executor_id] = executor  # work may have waited for this LOAD
    if event.code and event.code != ALREADY_LOADED:
        executor.pages_used -= action.pages
        core.counters["load_failures"] += 1
        mark_cold(core, model)
        forget_if_gone(core, model.name)
        return
    if not event.code and event.duration_ns > 0:
        core.predictions.record_load(model.spec, executor.kind, event.duration_ns, core.now_ns)
    executor.loaded[model.name] = action.pages
    model.loaded_on[executor.executor_id] = None
    if model.retired:
        send_unload(core, executor, model.name, eviction=False)
        return
    push_head(core, executor, model)
