"""Request operations: answer, reject, enqueue, requeue, rebook; the one way a request moves.

Invariants: an accepted request is answered through ``answer`` exactly once
(``RequestState.move`` raises on a second answer), which uncounts it, takes it off the ledger
and forgets it; a request rejected at arrival is answered through ``reject`` and was never
accepted. ``enqueue`` puts a QUEUED request in its model's queue with the drop timers its
policy asks for. What a policy decides here it decides through ``QueuePolicy`` (pure
questions); these functions carry out the answers.
"""

from __future__ import annotations

import heapq
from typing import Final

from .agenda import fill_hungry_copies, mark_cold, push_heads
from .entities import Action, RequestState
from .events import ExecutionTimes, Reply
from .ledger import book, release_if_unwaited, unbook
from .outcomes import Outcome
from .queues import RequestStatus
from .quotes import Quote
from .state import CoreState, next_seq

# Final: compiled, kept in a C static rather than looked up on the module per call.
_heappush: Final = heapq.heappush


class QueuePolicy:
    """What queueing asks of the policy (policies.py); each question only reads the state.

    A base class that the policies extend, not a Protocol: compiled with mypyc, its methods are
    called through the class's method table instead of looked up by name on every call."""

    def drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        """Return when a still-queued request is given up, or None for never."""
        raise NotImplementedError

    def cold_drop_at_ns(self, core: CoreState, request: RequestState) -> int | None:
        """Return when a still-queued request of a model with no copy is given up, or None."""
        raise NotImplementedError

    def requote(self, core: CoreState, request: RequestState) -> Quote | None:
        """Return where to book a request going back to its queue, or None (no ledger)."""
        raise NotImplementedError


def reject(core: CoreState, request_id: int, outcome: Outcome, message: str) -> None:
    """Answer a request that was never accepted."""
    core.rejected += 1
    core.outcomes[outcome] += 1
    core.out.append(Reply(request_id, outcome, message))


def answer(
    core: CoreState,
    request: RequestState,
    outcome: Outcome,
    message: str = "",
    action: Action | None = None,
    times: ExecutionTimes | None = None,
) -> None:
    """Answer an accepted request (QUEUED or RUNNING) and forget it."""
    if request.status is RequestStatus.QUEUED:
        model = request.model
        model.queued -= 1
        core.queued_total -= 1
        unbook(request)
        release_if_unwaited(model)
    elif request.status is RequestStatus.RUNNING:
        core.running_total -= 1
    request.move(RequestStatus.DONE)
    del core.requests[request.request_id]
    core.outcomes[outcome] += 1
    core.out.append(
        Reply(
            request.request_id,
            outcome,
            message,
            action.action_id if action is not None else None,
            action.executor_id if action is not None else None,
            None,
            times,
        )
    )


def enqueue(core: CoreState, policy: QueuePolicy, request: RequestState) -> None:
    """Put a QUEUED request into its model's queue, with its drop timers and fills."""
    model = request.model
    core.queued_total += 1
    if model.push(request):
        push_heads(core, model)
    fill_hungry_copies(core, model)
    drop_at_ns = policy.drop_at_ns(core, request)
    if drop_at_ns is not None:
        _heappush(core.drop_timers, (drop_at_ns, next_seq(core), False, request))
    if not model.has_copy():
        mark_cold(core, model)
        cold_at_ns = policy.cold_drop_at_ns(core, request)
        if cold_at_ns is not None:
            _heappush(core.drop_timers, (cold_at_ns, next_seq(core), True, request))


def requeue(core: CoreState, policy: QueuePolicy, request: RequestState) -> None:
    """Return a RUNNING request to its queue (its action failed but it may still be met)."""
    request.move(RequestStatus.QUEUED)
    request.action_id = None
    core.running_total -= 1
    core.counters["replans"] += 1
    rebook(core, policy, request)
    enqueue(core, policy, request)


def rebook(core: CoreState, policy: QueuePolicy, request: RequestState) -> None:
    """Book a QUEUED request (not booked now) again, where the policy quotes it, if anywhere."""
    quote = policy.requote(core, request)
    if quote is not None:
        book(core, request, quote)
