"""Read-only snapshots of the controller's state, for metrics, the simulator and tests.

Invariant: a snapshot is immutable and detached from the core (later events do not change it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .profiles import PredictionErrorStats
from .state import CoreState


@dataclass(frozen=True, slots=True)
class ExecutorStats:
    executor_id: str
    kind: str
    pages_used: int
    pages_total: int
    loaded: tuple[str, ...]  # least recently used first
    loading: tuple[str, ...]
    outstanding_actions: int
    exec_free_at_ns: int  # predicted end of committed execute work
    booked_ns: int  # execute time the admission ledger booked for queued requests here
    reserved_loads: int  # LOADs promised to accepted requests, not started yet
    reserved_pages: int  # pages held for them (included in pages_used)
    utilisation: float  # execute lane busy fraction, decayed average
    resyncs: int  # times the core found it behind its predictions
    lead_ns: int  # the way there: new actions are planned at least this far ahead
    cold_extra_ns: int  # how much later an INFER after an idle gap is planned (warm_gap_ns)


@dataclass(frozen=True, slots=True)
class ControllerStats:
    """Counts since start. ``outcomes`` has every Outcome value as a key."""

    now_ns: int
    arrivals: int
    outcomes: Mapping[str, int]
    accepted: int
    queued: int
    running: int
    models: int
    counters: Mapping[str, int]  # infers, loads, cold_starts, unloads, evictions, ...
    prediction_errors: Mapping[str, PredictionErrorStats]  # "infer" / "load"
    fallback_seeds: int
    executors: Mapping[str, ExecutorStats]


def snapshot(core: CoreState, with_executors: bool = True) -> ControllerStats:
    """Return a ControllerStats of ``core`` now."""
    outcomes = {outcome.value: count for outcome, count in core.outcomes.items()}
    executors = (
        {e.executor_id: executor_stats(core, e.executor_id) for e in core.executors.values()}
        if with_executors
        else {}
    )
    return ControllerStats(
        now_ns=core.now_ns,
        arrivals=core.arrivals,
        outcomes=outcomes,
        accepted=core.arrivals - core.rejected,
        queued=core.queued_total,
        running=core.running_total,
        models=len(core.models),
        counters=dict(core.counters),
        prediction_errors=core.predictions.error_stats(),
        fallback_seeds=core.predictions.fallback_seeds,
        executors=executors,
    )


def executor_stats(core: CoreState, executor_id: str) -> ExecutorStats:
    """Return the stats of one executor. Raises KeyError for an unknown id."""
    executor = core.executors[executor_id]
    return ExecutorStats(
        executor_id=executor_id,
        kind=executor.kind,
        pages_used=executor.pages_used,
        pages_total=executor.pages_total,
        loaded=tuple(executor.loaded),
        loading=tuple(executor.loading),
        outstanding_actions=len(executor.actions),
        exec_free_at_ns=executor.exec_lane.end_ns,
        booked_ns=executor.backlog_ns,
        reserved_loads=len(executor.reserved),
        reserved_pages=sum(model.reserved_pages for model in executor.reserved.values()),
        utilisation=executor.utilisation(core.now_ns, core.config.utilisation_window_ns),
        resyncs=executor.exec_lane.resyncs + executor.load_lane.resyncs,
        lead_ns=executor.exec_lane.lead_ns,
        cold_extra_ns=executor.exec_lane.cold_extra_ns,
    )
