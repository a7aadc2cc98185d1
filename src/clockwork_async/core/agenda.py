"""The core's agenda: notes of what to look at next (fills, timers, queue heads, placement).

Invariants: these functions only note work; the scheduler and placement do it. An executor is
told (an entry in its heap) whenever the head of a model loaded on it may have changed; stale
entries are skipped when popped (scheduler.py). An executor whose execute lane wants work
within ``schedule_ahead_ns`` goes in ``to_fill``, else gets a timer for when it will (one live
timer each: arming one replaces the last). A model with queued requests and no copy (nor
reserved LOAD) goes in ``cold``; ``placement_dirty`` is set whenever placement may have
something to do.
"""

from __future__ import annotations

import heapq
from typing import Final

from .entities import ExecutorState, ModelState
from .state import CoreState, next_seq

# Final: compiled, kept in a C static rather than looked up on the module per call.
_heappush: Final = heapq.heappush


def push_heads(core: CoreState, model: ModelState) -> None:
    """Tell every executor holding ``model`` about its (new) queue head."""
    head = model.peek()
    if head is None:
        return
    entry_key = head.key_ns
    for executor_id in model.loaded_on:
        executor = core.executors[executor_id]
        _heappush(executor.heap, (entry_key, next_seq(core), model.version, model))


def push_head(core: CoreState, executor: ExecutorState, model: ModelState) -> None:
    """Tell ``executor`` (holding ``model``) about the model's queue head, if any."""
    head = model.peek()
    if head is not None:
        entry = (head.key_ns, next_seq(core), model.version, model)
        _heappush(executor.heap, entry)


def fill_hungry_copies(core: CoreState, model: ModelState) -> None:
    """Queue a fill for every loaded copy whose execute lane wants more work now; make sure
    the others have a timer for when theirs will."""
    ahead_ns = core.config.schedule_ahead_ns
    horizon_ns = core.now_ns + ahead_ns
    for executor_id in model.loaded_on:
        executor = core.executors[executor_id]
        free_ns = executor.exec_lane.free_at(core.now_ns)
        if free_ns <= horizon_ns:
            core.to_fill[executor_id] = executor
        elif executor.timer_at_ns < 0 or executor.timer_at_ns > free_ns - ahead_ns:
            arm_timer(core, executor, free_ns - ahead_ns)


def nudge(core: CoreState, executor: ExecutorState) -> None:
    """Ask for a fill of ``executor`` if its execute lane wants work now."""
    horizon_ns = core.now_ns + core.config.schedule_ahead_ns
    if executor.exec_lane.free_at(core.now_ns) <= horizon_ns:
        core.to_fill[executor.executor_id] = executor


def arm_timer(core: CoreState, executor: ExecutorState, at_ns: int) -> None:
    """Ask for a fill of ``executor`` at ``at_ns`` (replaces its previous timer)."""
    if executor.timer_at_ns == at_ns:
        return
    executor.timer_version += 1
    executor.timer_at_ns = at_ns
    entry = (at_ns, next_seq(core), executor.timer_version, executor)
    _heappush(core.exec_timers, entry)


def mark_cold(core: CoreState, model: ModelState) -> None:
    """Ask placement for a first copy of ``model`` if it has queued requests and none."""
    if model.name in core.cold or model.reserved_on is not None:
        return
    if model.queued and not model.has_copy() and not model.retired:
        core.cold[model.name] = model
        core.placement_dirty = True


def note_pressure(core: CoreState, model: ModelState) -> None:
    """The copies of ``model`` cannot keep up: ask placement for another copy."""
    if core.now_ns < core.copies_blocked_until_ns:
        return
    if not model.retired and model.name not in core.wants_copy:
        core.wants_copy[model.name] = model
        core.placement_dirty = True
