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

from .events import StartLoad, StartUnload
from .models import ModelState
from .state import CoreState
from .tracker import Action, ActionKind, ExecutorState

COPY_RETRY_NS = 10_000_000  # after no executor could take an extra copy, wait this long


def place(core: CoreState) -> None:
    """Start the LOADs (and the evictions they need) that demand calls for now."""
    core.placement_dirty = False
    if core.free_load_slots <= 0:
        return
    if core.cold:
        _place_cold(core)
    if core.wants_copy:
        _place_copies(core)


def _place_cold(core: CoreState) -> None:
    for name in [n for n, m in core.cold.items() if not _still_cold(m)]:
        del core.cold[name]
    tries = 2 * core.free_load_slots + 4
    ranked = heapq.nsmallest(tries, core.cold.values(), key=_cold_rank)
    for model in ranked:
        if core.free_load_slots <= 0:
            return
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


def _can_load(core: CoreState, executor: ExecutorState, model: ModelState) -> bool:
    return (
        len(executor.loading) < core.config.max_loads_in_flight
        and executor.pages_total >= model.spec.weights_pages
        and not executor.holds(model.name)
    )


def _choose_for_cold(core: CoreState, model: ModelState) -> tuple[ExecutorState, list[str]] | None:
    """Return (executor, evictions) where the first batch would end soonest, or None."""
    now_ns = core.now_ns
    b1 = model.spec.batch_sizes[0]
    window_ns = core.config.utilisation_window_ns
    ranked: list[tuple[int, float, str, ExecutorState]] = []
    for executor in core.executors.values():
        if not _can_load(core, executor, model):
            continue
        predictions = core.predict(model, executor)
        ready_ns = executor.load_lane.start_for(now_ns) + predictions.load_ns
        end_ns = max(ready_ns, executor.exec_lane.start_for(now_ns)) + predictions.exec_ns[b1]
        busy = executor.utilisation(now_ns, window_ns)
        ranked.append((end_ns, busy, executor.executor_id, executor))
    for *_, executor in sorted(ranked):
        victims = choose_victims(core, executor, model.spec.weights_pages, demanded_too=True)
        if victims is not None:
            return executor, victims
    return None


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
        victims = choose_victims(core, executor, model.spec.weights_pages, demanded_too=False)
        if victims is not None:
            return executor, victims
    return None


def choose_victims(
    core: CoreState, executor: ExecutorState, need_pages: int, demanded_too: bool
) -> list[str] | None:
    """Return the models to evict from ``executor`` to free ``need_pages`` (maybe none), or
    None when it cannot be done. Models with no queued requests go first, then (if
    ``demanded_too``) models with queued requests and another copy; least recently used first
    within each; never a model with an outstanding INFER here."""
    free_pages = executor.pages_free
    if free_pages >= need_pages:
        return []
    victims: list[str] = []
    tiers = (_idle_model, _spare_copy) if demanded_too else (_idle_model,)
    for tier in tiers:
        for name, pages in executor.loaded.items():
            if name in victims or executor.is_busy_with(name) or not tier(core, name):
                continue
            victims.append(name)
            free_pages += pages
            if free_pages >= need_pages:
                return victims
    return None


def _idle_model(core: CoreState, name: str) -> bool:
    model = core.models.get(name)
    return model is None or model.queued == 0


def _spare_copy(core: CoreState, name: str) -> bool:
    model = core.models.get(name)
    return model is not None and len(model.loaded_on) + len(model.loading_on) > 1


def start_load(
    core: CoreState, executor: ExecutorState, model: ModelState, victims: list[str]
) -> None:
    """Evict ``victims`` and send a LOAD of ``model`` to ``executor``."""
    for name in victims:
        send_unload(core, executor, name, eviction=True)
    if not model.has_copy():
        core.counters["cold_starts"] += 1
    predictions = core.predict(model, executor)
    earliest_ns = executor.load_lane.start_for(core.now_ns)
    action = Action(
        core.new_action_id(),
        ActionKind.LOAD,
        executor.executor_id,
        model,
        earliest_ns,
        predictions.load_ns,
    )
    action.latest_ns = earliest_ns + core.config.load_window_ns
    action.pages = model.spec.weights_pages
    executor.load_lane.commit(action)
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


def send_unload(core: CoreState, executor: ExecutorState, name: str, eviction: bool) -> None:
    """Forget the copy of ``name`` on ``executor`` (if tracked) and send an UNLOAD."""
    pages = executor.loaded.pop(name, 0)
    executor.pages_used -= pages
    model = core.models.get(name) or core.retiring.get(name)
    if model is not None:
        model.loaded_on.pop(executor.executor_id, None)
        forget_if_gone(core, name)
    action_id = core.new_action_id()
    core.unloads[action_id] = (executor.executor_id, name)
    core.counters["unloads"] += 1
    core.counters["evictions"] += eviction
    core.out.append(StartUnload(executor.executor_id, action_id, name))


def forget_if_gone(core: CoreState, name: str) -> None:
    """Forget an unregistered model once its last copy is gone."""
    model = core.retiring.get(name)
    if model is not None and not model.has_copy():
        del core.retiring[name]
        core.predictions.forget(name)
