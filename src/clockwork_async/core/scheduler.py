"""Filling execute lanes: earliest deadline first across the models loaded on an executor,
the policy's plan for the chosen model carried out (a batch dispatched, heads dropped, a
wait or a handoff), and the timers that bring the core back.

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
from typing import Final

from .agenda import arm_timer, note_pressure, nudge, push_head, push_heads
from .batching import Batch
from .entities import Action, ActionKind, ExecutorState, ModelState, RequestState
from .events import WakeAt
from .ledger import release_if_unwaited, unbook_dispatched
from .outcomes import Outcome
from .policies import Defer, Drop, Handoff, NoBatch, Policy
from .queues import RequestStatus
from .requests import answer
from .state import CoreState, new_action_id, next_seq, predict

# Final: compiled, kept in a C static rather than looked up on the module per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop

# Bound on fills of one executor per event (no ping-pong between copies).
FILLS_PER_EXECUTOR: Final = 4

# No timer is live: later than any (146 years of ns), and still a native int when compiled.
NO_WAKE_NS: Final = (1 << 62) - 1


def run_due(core: CoreState, policy: Policy) -> None:
    """Do everything due at ``core.now_ns``: timers, fills, drops; then ask for the next wake."""
    now_ns = core.now_ns
    timers = core.exec_timers
    while timers and timers[0][0] <= now_ns:
        # Named, not ``_``: compiled, ``_`` is an ``object``, so an int unpacked into it is
        # boxed (a new int object, freed at once); ``_seq`` stays a native int.
        _at_ns, _seq, version, executor = _heappop(timers)
        if version == executor.timer_version and executor.alive:
            executor.timer_at_ns = -1
            core.to_fill[executor.executor_id] = executor
    run_fills(core, policy)
    run_drops(core, policy)


def run_fills(core: CoreState, policy: Policy) -> None:
    """Fill every executor queued in ``core.to_fill`` (fills may queue others)."""
    to_fill = core.to_fill
    if not to_fill:
        return  # (most arrivals under load)
    # Each executor counts its fills of this call on itself (no dict by id per call).
    core.fill_rounds += 1
    fill_round = core.fill_rounds
    while to_fill:
        executor_id = _first_key(to_fill)  # the oldest entry: fills go in the order asked
        executor = to_fill[executor_id]
        del to_fill[executor_id]
        if executor.fill_round != fill_round:
            executor.fill_round, executor.fills_in_round = fill_round, 0
        if not executor.alive:
            continue
        if executor.fills_in_round >= FILLS_PER_EXECUTOR:
            arm_timer(core, executor, core.now_ns + 1)  # finish on the next event
            continue
        executor.fills_in_round += 1
        fill(core, policy, executor)


def _first_key(entries: dict[str, ExecutorState]) -> str:
    """The first key of a non-empty dict (a loop: compiled, ``next(iter(...))`` is two
    generic calls). Raises KeyError when empty."""
    for key in entries:
        return key
    raise KeyError("no entries")


def fill(core: CoreState, policy: Policy, executor: ExecutorState) -> None:
    """Commit work to ``executor``'s execute lane up to the schedule-ahead horizon."""
    now_ns = core.now_ns
    ahead_ns = core.config.schedule_ahead_ns
    horizon_ns = now_ns + ahead_ns
    put_back: list[ModelState] = []
    wake_ns: int | None = None
    while True:
        start_ns = executor.exec_lane.start_for(now_ns)
        if start_ns > horizon_ns and not _cold_and_idle(executor, now_ns, horizon_ns):
            _shed(core, policy, executor, start_ns)
            if executor.heap:
                wake_ns = start_ns - ahead_ns
            break
        model = _pop_model(core, executor)
        if model is None:
            break
        plan = policy.plan(core, executor, model, start_ns)
        while isinstance(plan, Drop):
            drop(core, plan)
            plan = policy.plan(core, executor, model, start_ns)
        if isinstance(plan, Batch):
            dispatch(core, executor, model, plan, start_ns)
        elif isinstance(plan, Defer):
            put_back.append(model)
            wake_ns = plan.until_ns if wake_ns is None else min(wake_ns, plan.until_ns)
        elif isinstance(plan, Handoff):
            nudge(core, plan.executor)
            put_back.append(model)
        elif plan is NoBatch.SKIP:
            put_back.append(model)
    for model in put_back:
        push_head(core, executor, model)
    if wake_ns is not None:
        arm_timer(core, executor, wake_ns)


def _cold_and_idle(executor: ExecutorState, now_ns: int, horizon_ns: int) -> bool:
    """Whether the lane is idle and only its cold extra puts its start past the horizon: that
    start moves with the clock, so waiting for it would never reach it; commit now instead."""
    lane = executor.exec_lane
    return lane.is_cold_now(now_ns) and lane.start_for(now_ns) - lane.cold_extra_ns <= horizon_ns


def drop(core: CoreState, plan: Drop) -> None:
    """Answer the plan's requests ``dropped``: their model's copies could not keep up."""
    for request in plan.requests:
        note_pressure(core, request.model)
        answer(core, request, Outcome.DROPPED, plan.message)


def _shed(core: CoreState, policy: Policy, executor: ExecutorState, start_ns: int) -> None:
    """With the lane full, drop the most urgent queued requests no copy can serve in time
    (now, not later when the lane frees up); stop at the first servable head."""
    if not policy.sheds:
        return
    heap = executor.heap
    while True:
        if heap:  # fast path: the most urgent head still fits after the committed work
            key_ns, _seq, version, top = heap[0]
            fits_ns = start_ns + predict(core, top, executor).exec_ns[top.spec.batch_sizes[0]]
            if version == top.version and key_ns >= fits_ns and top.name in executor.loaded:
                return
        model = _pop_model(core, executor)
        if model is None:
            return
        dropped = False
        plan = policy.shed(core, executor, model, start_ns)
        while isinstance(plan, Drop):
            drop(core, plan)
            dropped = True
            plan = policy.shed(core, executor, model, start_ns)
        if plan is not None:
            nudge(core, plan.executor)
        push_head(core, executor, model)
        if not dropped:
            return


def _pop_model(core: CoreState, executor: ExecutorState) -> ModelState | None:
    """Pop the loaded model with the earliest queue head; drop stale entries on the way."""
    heap = executor.heap
    loaded = executor.loaded
    while heap:
        key_ns, _seq, version, model = _heappop(heap)
        if version != model.version or model.retired or model.name not in loaded:
            continue
        head = model.peek()
        if head is None:
            continue
        if head.key_ns != key_ns:  # the head was answered: re-sort on the real head
            _heappush(heap, (head.key_ns, next_seq(core), version, model))
            continue
        return model
    return None


def dispatch(
    core: CoreState, executor: ExecutorState, model: ModelState, batch: Batch, start_ns: int
) -> None:
    """Take ``batch``'s requests out of the queue and send them to ``executor`` as an INFER
    planned to start at ``start_ns`` (it may start as soon as the work before it ends)."""
    requests = model.take(batch.count, batch.position)
    release_if_unwaited(model)
    action = Action(
        new_action_id(core),
        ActionKind.INFER,
        executor.executor_id,
        model,
        core.now_ns,
        batch.predicted_ns,
    )
    action.latest_ns = batch.latest_ns
    action.batch_size = batch.batch_size
    action.requests = requests
    executor.exec_lane.commit(action, start_ns)
    executor.actions[action.action_id] = action
    core.actions[action.action_id] = action
    executor.add_infer(model.name)
    unbook_dispatched(core, executor, requests, start_ns, batch.predicted_ns)
    for request in requests:
        request.move(RequestStatus.RUNNING)
        request.action_id = action.action_id
    count = len(requests)
    core.queued_total -= count
    core.running_total += count
    core.counters["infers"] += 1
    executor.record_busy(core.now_ns, batch.predicted_ns, core.config.utilisation_window_ns)
    core.out.append(action.start_infer())
    if model.queued:
        push_heads(core, model)
        if count == model.max_batch and model.queued >= model.max_batch:
            note_pressure(core, model)  # a full batch left a full batch behind


def run_drops(core: CoreState, policy: Policy) -> None:
    """Answer ``dropped`` every queued request whose drop time has come."""
    now_ns = core.now_ns
    timers = core.drop_timers
    while timers and timers[0][0] <= now_ns:
        _at_ns, _seq, cold, request = _heappop(timers)
        if request.status is not RequestStatus.QUEUED:
            continue
        model = request.model
        if cold and model.has_copy():
            continue
        if model.has_copy():
            note_pressure(core, model)
        answer(core, request, Outcome.DROPPED, policy.drop_message(cold))


def next_wake_ns(core: CoreState) -> int:
    """Return when the core next needs a Tick (earliest live timer), or NO_WAKE_NS."""
    return min(_first_live_timer_ns(core.exec_timers), _first_live_drop_ns(core.drop_timers))


# The two below unpack each heap head once (compiled, every ``heap[0][i]`` converts the whole
# entry, each int in it, to read one field) and answer a plain int (NO_WAKE_NS for none: an
# ``int | None`` is a boxed int, allocated, every pass).
def _first_live_timer_ns(timers: list[tuple[int, int, int, ExecutorState]]) -> int:
    """Return the earliest live timer's time (stale heads are popped on the way)."""
    while timers:
        at_ns, _seq, version, executor = timers[0]
        if version == executor.timer_version and executor.alive:
            return at_ns
        _heappop(timers)
    return NO_WAKE_NS


def _first_live_drop_ns(drops: list[tuple[int, int, bool, RequestState]]) -> int:
    """Return the earliest live drop timer's time (stale heads are popped on the way)."""
    while drops:
        at_ns, _seq, cold, request = drops[0]
        if request.status is RequestStatus.QUEUED and not (cold and request.model.has_copy()):
            return at_ns
        _heappop(drops)
    return NO_WAKE_NS


def emit_wake(core: CoreState) -> None:
    """Append a WakeAt when the next needed Tick is earlier than the one already asked for."""
    wake_ns = next_wake_ns(core)
    if wake_ns == NO_WAKE_NS:
        return
    pending_ns = core.wake_pending_ns
    if pending_ns is None or pending_ns <= core.now_ns or wake_ns < pending_ns:
        core.wake_pending_ns = wake_ns
        core.out.append(WakeAt(wake_ns))
