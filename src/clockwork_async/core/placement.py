"""Placement: which model to LOAD where, and what to evict for it.

Invariants: at most ``max_loads_in_flight`` LOADs outstanding per executor; a LOAD is sent only
when its pages are free, after the UNLOADs that free them (emitted first, in the same batch of
commands); a model with an outstanding INFER on an executor is never evicted there, nor is the
only copy of a model with queued requests. Cold models (queued requests, no copy) are placed
first, most queued requests first, each where its first batch would end soonest; then models
whose copies could not keep up get one more copy each, on the least busy executor that has
spare capacity (utilisation below ``copy_max_utilisation``).
"""

from __future__ import annotations

import heapq

from .agenda import mark_cold
from .entities import Action, ActionKind, ExecutorState, ModelState
from .events import StartLoad
from .eviction import choose_victims, send_unload
from .ledger import release
from .state import CoreState, new_action_id, predict

COPY_RETRY_NS = 10_000_000  # after no executor could take an extra copy, wait this long


def place(core: CoreState) -> None:
    """Start the LOADs (and the evictions they need) that demand calls for now: reserved
    LOADs first (accepted requests wait for them), then other cold models, extra copies, and
    models wanted by rejected requests."""
    core.placement_dirty = False
    if core.free_load_slots <= 0:
        return
    if core.reserving:
        _place_reserved(core)
    if core.cold:
        _place_cold(core)
    if core.wants_copy:
        _place_copies(core)
    if core.demand:
        _place_demand(core)


def _place_reserved(core: CoreState) -> None:
    """Start reserved LOADs, in reservation order, where they were reserved."""
    max_loads = core.config.max_loads_in_flight
    for executor_id, executor in list(core.reserving.items()):
        reserved = executor.reserved
        while reserved and len(executor.loading) < max_loads:
            model = next(iter(reserved.values()))
            release(model)  # its held pages are free again, for its LOAD
            if model.has_copy() or model.retired or not model.queued:
                continue
            victims = choose_victims(core, executor, model.spec.weights_pages, demanded_too=True)
            if victims is None:  # cannot happen while the pages were held; be safe
                mark_cold(core, model)
                continue
            start_load(core, executor, model, victims)
        if not reserved:
            del core.reserving[executor_id]


def _place_demand(core: CoreState) -> None:
    """Load models wanted by rejected requests, oldest first, on load lanes that have
    nothing promised to do (no reservation, fewer LOADs out than the cap less one)."""
    demand = core.demand
    while demand and core.free_load_slots > 0:
        name, model = next(iter(demand.items()))
        if model.has_copy() or model.reserved_on is not None or core.models.get(name) is not model:
            del demand[name]
            continue
        choice = _choose_for_demand(core, model)
        if choice is None:
            return
        del demand[name]
        start_load(core, choice[0], model, choice[1])


def _place_cold(core: CoreState) -> None:
    for name in [n for n, m in core.cold.items() if not _still_cold(m)]:
        del core.cold[name]
    tries = 2 * core.free_load_slots + 4
    ranked = heapq.nsmallest(tries, core.cold.values(), key=_cold_rank)
    for model in ranked:
        if core.free_load_slots <= 0:
            return
        if model.reserved_on is not None:
            del core.cold[model.name]  # placed by its reservation
            continue
        choice = _choose_for_cold(core, model)
        if choice is not None:
            start_load(core, choice[0], model, choice[1])
            del core.cold[model.name]


def _still_cold(model: ModelState) -> bool:
    return bool(model.queued) and not model.has_copy() and not model.retired


def _cold_rank(model: ModelState) -> tuple[int, int]:
    head = model.peek()
    return -model.queued, head.key_ns if head is not None else 0


def _place_copies(core: CoreState) -> None:
    wanted = list(core.wants_copy.values())
    core.wants_copy.clear()
    for model in wanted:
        if core.free_load_slots <= 0:
            return
        if model.retired or model.loading_on or not model.loaded_on:
            continue  # a cold model is _place_cold's; one extra copy at a time
        choice = _choose_for_copy(core, model)
        if choice is None:  # every executor is busy or full: do not look again at once
            core.copies_blocked_until_ns = core.now_ns + COPY_RETRY_NS
            return
        start_load(core, choice[0], model, choice[1])


def _can_load(
    core: CoreState, executor: ExecutorState, model: ModelState, max_loads: int | None = None
) -> bool:
    """Return True when ``executor`` may start a LOAD of ``model`` that nobody reserved: a
    free load slot, no reserved LOAD waiting there, pages enough (once others are evicted)."""
    limit = core.config.max_loads_in_flight if max_loads is None else max_loads
    return (
        len(executor.loading) < limit
        and not executor.reserved
        and executor.pages_total >= model.spec.weights_pages
        and not executor.holds(model.name)
    )


def _choose_for_cold(
    core: CoreState, model: ModelState, demanded_too: bool = True, max_loads: int | None = None
) -> tuple[ExecutorState, list[str]] | None:
    """Return (executor, evictions) where the first batch would end soonest, or None."""
    now_ns = core.now_ns
    b1 = model.spec.batch_sizes[0]
    window_ns = core.config.utilisation_window_ns
    ranked: list[tuple[int, float, str, ExecutorState]] = []
    for executor in core.executors.values():
        if not _can_load(core, executor, model, max_loads):
            continue
        predictions = predict(core, model, executor)
        ready_ns = executor.load_lane.start_for(now_ns) + predictions.load_ns
        end_ns = max(ready_ns, executor.exec_lane.start_for(now_ns)) + predictions.exec_ns[b1]
        busy = executor.utilisation(now_ns, window_ns)
        ranked.append((end_ns, busy, executor.executor_id, executor))
    for *_, executor in sorted(ranked):
        victims = choose_victims(core, executor, model.spec.weights_pages, demanded_too, model)
        if victims is not None:
            return executor, victims
    return None


def _choose_for_demand(
    core: CoreState, model: ModelState
) -> tuple[ExecutorState, list[str]] | None:
    """Like a cold model, but only where a load lane has a slot to spare and only evicting
    models nobody waits for."""
    spare = max(1, core.config.max_loads_in_flight - 1)
    return _choose_for_cold(core, model, demanded_too=False, max_loads=spare)


def _choose_for_copy(core: CoreState, model: ModelState) -> tuple[ExecutorState, list[str]] | None:
    """Return (executor, evictions) for one more copy on a not-too-busy executor, or None."""
    now_ns = core.now_ns
    config = core.config
    ranked: list[tuple[float, str, ExecutorState]] = []
    for executor in core.executors.values():
        busy = executor.utilisation(now_ns, config.utilisation_window_ns)
        if busy < config.copy_max_utilisation and _can_load(core, executor, model):
            ranked.append((busy, executor.executor_id, executor))
    for *_, executor in sorted(ranked):
        victims = choose_victims(core, executor, model.spec.weights_pages, False, model)
        if victims is not None:
            return executor, victims
    return None


def start_load(
    core: CoreState, executor: ExecutorState, model: ModelState, victims: list[str]
) -> None:
    """Evict ``victims`` and send a LOAD of ``model`` to ``executor``."""
    for name in victims:
        send_unload(core, executor, name, eviction=True)
    release(model)
    if not model.has_copy():
        core.counters["cold_starts"] += 1
    predictions = predict(core, model, executor)
    earliest_ns = executor.load_lane.start_for(core.now_ns)
    action = Action(
        new_action_id(core),
        ActionKind.LOAD,
        executor.executor_id,
        model,
        earliest_ns,
        predictions.load_ns,
    )
    action.latest_ns = earliest_ns + core.config.load_window_ns
    action.pages = model.spec.weights_pages
    executor.load_lane.commit(action, earliest_ns)
    executor.loading[model.name] = action
    executor.actions[action.action_id] = action
    executor.pages_used += action.pages
    core.actions[action.action_id] = action
    core.free_load_slots -= 1
    model.loading_on[executor.executor_id] = None
    core.counters["loads"] += 1
    core.out.append(
        StartLoad(executor.executor_id, action.action_id, model.name, earliest_ns, action.latest_ns)
    )
