"""Filling execute lanes: earliest deadline first across the models loaded on an executor,
the policy's batch for the chosen model, and the timers that bring the core back.

Invariants: an executor's execute lane holds committed work only up to ``schedule_ahead_ns``
past now (plus the last action's duration); each INFER's window is ``[now, latest]``, where
``latest`` is the last start that still meets the earliest internal deadline in the batch: it
is planned after the lane's committed work, but may start as soon as that ends (predictions
are a high percentile, so most actions end early; a window opening at the planned start
would leave the lane idle for the difference: 14-43% of the time under overload here); a
fill never looks at models not loaded on the executor (its heap holds only those),
so the cost of an event is independent of the number of models.
"""

from __future__ import annotations

import heapq

from .batching import Batch
from .events import WakeAt
from .ledger import unbook_dispatched
from .models import ModelState
from .outcomes import Outcome
from .policies import Defer, NoBatch
from .queues import RequestStatus
from .state import CoreState
from .tracker import Action, ActionKind, ExecutorState

FILLS_PER_EXECUTOR = 4  # bound on fills of one executor per event (no ping-pong between copies)


def run_due(core: CoreState) -> None:
    """Do everything due at ``core.now_ns``: timers, fills, drops; then ask for the next wake."""
    now_ns = core.now_ns
    timers = core.exec_timers
    while timers and timers[0][0] <= now_ns:
        _, _, version, executor = heapq.heappop(timers)
        if version == executor.timer_version and executor.alive:
            executor.timer_at_ns = -1
            core.to_fill[executor.executor_id] = executor
    run_fills(core)
    run_drops(core)


def run_fills(core: CoreState) -> None:
    """Fill every executor queued in ``core.to_fill`` (fills may queue others)."""
    fills: dict[str, int] = {}
    to_fill = core.to_fill
    while to_fill:
        executor_id = next(iter(to_fill))
        executor = to_fill.pop(executor_id)
        done = fills.get(executor_id, 0)
        if not executor.alive:
            continue
        if done >= FILLS_PER_EXECUTOR:
            core.arm_timer(executor, core.now_ns + 1)  # finish on the next event
            continue
        fills[executor_id] = done + 1
        fill(core, executor)


def fill(core: CoreState, executor: ExecutorState) -> None:
    """Commit work to ``executor``'s execute lane up to the schedule-ahead horizon."""
    now_ns = core.now_ns
    ahead_ns = core.config.schedule_ahead_ns
    horizon_ns = now_ns + ahead_ns
    put_back: list[ModelState] = []
    wake_ns: int | None = None
    while True:
        start_ns = executor.exec_lane.start_for(now_ns)
        if start_ns > horizon_ns:
            _shed(core, executor, start_ns)
            if executor.heap:
                wake_ns = start_ns - ahead_ns
            break
        model = _pop_model(core, executor)
        if model is None:
            break
        plan = core.policy.plan(core, executor, model, start_ns)
        if isinstance(plan, Batch):
            dispatch(core, executor, model, plan, start_ns)
        elif isinstance(plan, Defer):
            put_back.append(model)
            wake_ns = plan.until_ns if wake_ns is None else min(wake_ns, plan.until_ns)
        elif plan is NoBatch.SKIP:
            put_back.append(model)
    for model in put_back:
        core.push_head(executor, model)
    if wake_ns is not None:
        core.arm_timer(executor, wake_ns)


def _shed(core: CoreState, executor: ExecutorState, start_ns: int) -> None:
    """With the lane full, drop the most urgent queued requests no copy can serve in time
    (now, not later when the lane frees up); stop at the first servable head."""
    if not core.policy.sheds:
        return
    heap = executor.heap
    while True:
        if heap:  # fast path: the most urgent head still fits after the committed work
            key_ns, _, version, top = heap[0]
            fits_ns = start_ns + core.predict(top, executor).exec_ns[top.spec.batch_sizes[0]]
            if version == top.version and key_ns >= fits_ns and top.name in executor.loaded:
                return
        model = _pop_model(core, executor)
        if model is None:
            return
        dropped = core.policy.shed(core, executor, model, start_ns)
        core.push_head(executor, model)
        if not dropped:
            return


def _pop_model(core: CoreState, executor: ExecutorState) -> ModelState | None:
    """Pop the loaded model with the earliest queue head; drop stale entries on the way."""
    heap = executor.heap
    loaded = executor.loaded
    while heap:
        key_ns, _, version, model = heapq.heappop(heap)
        if version != model.version or model.retired or model.name not in loaded:
            continue
        head = model.peek()
        if head is None:
            continue
        if head.key_ns != key_ns:  # the head was answered: re-sort on the real head
            heapq.heappush(heap, (head.key_ns, core.seq(), version, model))
            continue
        return model
    return None


def dispatch(
    core: CoreState, executor: ExecutorState, model: ModelState, batch: Batch, start_ns: int
) -> None:
    """Send ``batch`` to ``executor`` as an INFER planned to start at ``start_ns`` (it may
    start as soon as the work before it ends)."""
    action = Action(
        core.new_action_id(),
        ActionKind.INFER,
        executor.executor_id,
        model,
        core.now_ns,
        batch.predicted_ns,
    )
    action.latest_ns = batch.latest_ns
    action.batch_size = batch.batch_size
    action.requests = batch.requests
    executor.exec_lane.commit(action, start_ns)
    executor.actions[action.action_id] = action
    core.actions[action.action_id] = action
    executor.add_infer(model.name)
    unbook_dispatched(core, executor, batch.requests, start_ns, batch.predicted_ns)
    for request in batch.requests:
        request.move(RequestStatus.RUNNING)
        request.action_id = action.action_id
    count = len(batch.requests)
    core.queued_total -= count
    core.running_total += count
    core.counters["infers"] += 1
    executor.record_busy(core.now_ns, batch.predicted_ns, core.config.utilisation_window_ns)
    core.out.append(action.start_infer())
    if model.queued:
        core.push_heads(model)
        if count == model.max_batch and model.queued >= model.max_batch:
            core.note_pressure(model)  # a full batch left a full batch behind


def run_drops(core: CoreState) -> None:
    """Answer ``dropped`` every queued request whose drop time has come."""
    now_ns = core.now_ns
    timers = core.drop_timers
    while timers and timers[0][0] <= now_ns:
        _, _, cold, request = heapq.heappop(timers)
        if request.status is not RequestStatus.QUEUED:
            continue
        model = request.model
        if cold and model.has_copy():
            continue
        if model.has_copy():
            core.note_pressure(model)
        core.answer(request, Outcome.DROPPED, core.policy.drop_message(cold))


def next_wake_ns(core: CoreState) -> int | None:
    """Return when the core next needs a Tick (earliest live timer), or None."""
    timers = core.exec_timers
    while timers and (timers[0][2] != timers[0][3].timer_version or not timers[0][3].alive):
        heapq.heappop(timers)
    drops = core.drop_timers
    while drops and _stale_drop(drops[0][2], drops[0][3].status, drops[0][3].model):
        heapq.heappop(drops)
    candidates = [entry[0][0] for entry in (timers, drops) if entry]
    return min(candidates) if candidates else None


def _stale_drop(cold: bool, status: RequestStatus, model: ModelState) -> bool:
    return status is not RequestStatus.QUEUED or (cold and model.has_copy())


def emit_wake(core: CoreState) -> None:
    """Append a WakeAt when the next needed Tick is earlier than the one already asked for."""
    wake_ns = next_wake_ns(core)
    if wake_ns is None:
        return
    pending_ns = core.wake_pending_ns
    if pending_ns is None or pending_ns <= core.now_ns or wake_ns < pending_ns:
        core.wake_pending_ns = wake_ns
        core.out.append(WakeAt(wake_ns))
