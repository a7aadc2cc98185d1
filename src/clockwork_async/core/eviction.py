"""Eviction: which loaded copies to unload from an executor to free pages, and the UNLOAD.

Invariants: never a model with an INFER outstanding on that executor; models with no queued
request go first, least recently used first; a model with queued requests only when another
copy of it exists (and only when the caller allows it). An UNLOAD's pages count as free when
it is sent (the executor runs it at once, before any later LOAD).
"""

from __future__ import annotations

from .entities import ExecutorState, ModelState
from .events import StartUnload
from .state import CoreState, new_action_id


def choose_victims(
    core: CoreState,
    executor: ExecutorState,
    need_pages: int,
    demanded_too: bool,
    for_model: ModelState | None = None,
) -> list[str] | None:
    """Return the models to evict from ``executor`` to free ``need_pages`` (maybe none), or
    None when it cannot be done. Models with no queued requests go first, then (if
    ``demanded_too``) models with queued requests and another copy; least recently used first
    within each; never a model with an outstanding INFER here, nor (when ``for_model`` is
    given) one whose recent demand is higher than ``for_model``'s: a hot model idle for a
    moment is not traded for a colder one."""
    free_pages = executor.pages_free
    if free_pages >= need_pages:
        return []
    victims: list[str] = []
    tiers = (_idle_model, _spare_copy) if demanded_too else (_idle_model,)
    now_ns, window_ns = core.now_ns, core.config.utilisation_window_ns
    ceiling = for_model.demand_now(now_ns, window_ns) if for_model is not None else None
    for tier in tiers:
        for name, pages in executor.loaded.items():
            if name in victims or executor.is_busy_with(name) or not tier(core, name):
                continue
            if ceiling is not None and _demand(core, name, now_ns, window_ns) > ceiling:
                continue
            victims.append(name)
            free_pages += pages
            if free_pages >= need_pages:
                return victims
    return None


def _demand(core: CoreState, name: str, now_ns: int, window_ns: int) -> float:
    model = core.models.get(name)
    return model.demand_now(now_ns, window_ns) if model is not None else 0.0


def _idle_model(core: CoreState, name: str) -> bool:
    model = core.models.get(name)
    return model is None or model.queued == 0


def _spare_copy(core: CoreState, name: str) -> bool:
    model = core.models.get(name)
    return model is not None and len(model.loaded_on) + len(model.loading_on) > 1


def send_unload(core: CoreState, executor: ExecutorState, name: str, eviction: bool) -> None:
    """Forget the copy of ``name`` on ``executor`` (if tracked) and send an UNLOAD."""
    pages = executor.loaded.pop(name, 0)
    executor.pages_used -= pages
    model = core.models.get(name) or core.retiring.get(name)
    if model is not None:
        model.loaded_on.pop(executor.executor_id, None)
        forget_if_gone(core, name)
    action_id = new_action_id(core)
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
