"""The one vocabulary of request outcomes, used by the core, the simulator, daemon replies,
metrics and docs.

A request is either rejected at arrival (it was never accepted) or accepted; an accepted request
ends exactly once, as one of the accepted outcomes.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    # Accepted, then ended exactly once.
    OK = "ok"  # answered within its deadline
    DROPPED = "dropped"  # before its deadline, the moment no executor could serve it in time
    FAILED = "failed"  # an executor failed and the request could not be re-planned
    LATE = "late"  # a result that arrived after the deadline (a bug to count, never ok)
    CANCELLED = "cancelled"  # the client cancelled it or went away
    # Rejected at arrival.
    UNKNOWN_MODEL = "unknown_model"
    BAD_INPUT = "bad_input"
    INFEASIBLE = "infeasible"  # no executor could meet its deadline even now
    OVERLOADED = "overloaded"  # a queue cap was reached
    SHUTTING_DOWN = "shutting_down"

    @property
    def rejected_at_arrival(self) -> bool:
        return self in REJECTED_AT_ARRIVAL


REJECTED_AT_ARRIVAL = frozenset(
    {
        Outcome.UNKNOWN_MODEL,
        Outcome.BAD_INPUT,
        Outcome.INFEASIBLE,
        Outcome.OVERLOADED,
        Outcome.SHUTTING_DOWN,
    }
)

ACCEPTED_ENDINGS = frozenset(
    {Outcome.OK, Outcome.DROPPED, Outcome.FAILED, Outcome.LATE, Outcome.CANCELLED}
)
