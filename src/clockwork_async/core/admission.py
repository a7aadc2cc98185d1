"""Arrivals and cancellations: the policy's verdict on each arriving request, carried out.

Invariants: a request is rejected at arrival (never accepted) with exactly one of
``unknown_model``, ``shutting_down``, ``overloaded`` or ``infeasible``, or accepted, booked as
the policy quoted it (if it keeps a ledger) and queued. Whether it can be served in time is
the policy's question (policies.py, over feasibility.py and the ledger); this module only
acts on the answer.
"""

from __future__ import annotations

from .agenda import note_pressure
from .entities import ModelState, RequestState
from .errors import InvalidEvent
from .events import Abandon, RequestArrived, RequestCancelled
from .ledger import book, note_demand
from .outcomes import Outcome
from .policies import Policy, Rejection
from .requests import answer, enqueue, reject
from .state import CoreState
from .warm_up import probe, warm_up


def on_request_arrived(core: CoreState, policy: Policy, event: RequestArrived) -> None:
    """Admit or reject a request; an admitted one is queued (and maybe dispatched later)."""
    if event.request_id in core.requests:
        raise InvalidEvent(f"request id {event.request_id} is already in use")
    core.arrivals += 1
    if core.shutting_down:
        reject(core, event.request_id, Outcome.SHUTTING_DOWN, "the server is shutting down")
        return
    model = core.models.get(event.model)
    if model is None:
        message = f"model {event.model!r} is not registered"
        reject(core, event.request_id, Outcome.UNKNOWN_MODEL, message)
        return
    model.note_arrival(core.now_ns, core.config.utilisation_window_ns)
    deadline_ns = event.deadline_ns - core.return_hop_ns  # the result must be back by then
    verdict = policy.admit(core, model, deadline_ns)
    if isinstance(verdict, tuple):  # a Rejection
        _refuse(core, policy, model, event.request_id, deadline_ns, verdict)
        return
    internal_ns, key_ns = policy.plan_keys(core, model, deadline_ns)
    request = RequestState(
        event.request_id, model, core.now_ns, deadline_ns, internal_ns, key_ns, event.deadline_ns
    )
    core.requests[event.request_id] = request
    if verdict is not None:
        book(core, request, verdict)
    enqueue(core, policy, request)


def _refuse(
    core: CoreState,
    policy: Policy,
    model: ModelState,
    request_id: int,
    deadline_ns: int,
    rejection: Rejection,
) -> None:
    """Reject an arriving request (``deadline_ns``: its result must end by then) as the
    policy said, noting what its model wants."""
    outcome, message, wants_copy = rejection
    if wants_copy:
        if model.has_copy():
            note_pressure(core, model)
        elif model.reserved_on is None:
            note_demand(core, model)
    reject(core, request_id, outcome, message)
    if outcome is Outcome.INFEASIBLE:  # nothing runs to correct an outlier: relax
        model.refused_at_ns = core.now_ns
        _relax(core, model)
        internal_ns, _key_ns = policy.plan_keys(core, model, deadline_ns)
        if core.config.warm_up_infers:
            warm_up(core, model, internal_ns)
        probe(core, model, internal_ns)


def _relax(core: CoreState, model: ModelState) -> None:
    """Let stale predictions of ``model`` (and the executors' cold starts) forget an outlier."""
    config = core.config
    now_ns, stale_ns, factor = core.now_ns, config.prediction_stale_ns, config.outlier_factor
    core.predictions.relax(model.name, now_ns, stale_ns, factor)
    if config.warm_gap_ns:
        for executor in core.executors.values():
            executor.exec_lane.relax_cold_extra(now_ns, stale_ns, factor)


def on_request_cancelled(core: CoreState, event: RequestCancelled) -> None:
    """Answer a live request ``cancelled`` (a running batch still runs; its row is dropped)."""
    request = core.requests.get(event.request_id)
    if request is None:
        core.counters["stray_cancels"] += 1
        return
    answer(core, request, Outcome.CANCELLED, "cancelled by the client")


def on_abandon(core: CoreState, event: Abandon) -> None:
    """Answer every accepted request ``shutting_down`` now (queued or running)."""
    for request in list(core.requests.values()):
        answer(core, request, Outcome.SHUTTING_DOWN, event.message)
