"""Lanes held for registration: the `runtime.registration.LaneBroker` the dispatcher is.

Registration profiles a model with LOADs and INFERs the core does not plan; each runs on a lane
(and holds pages) that the core reserved for it (core/reservations.py), so no planned action
shares it.

Invariants:
- A reservation is asked for outside event handling and answered before `reserve` returns:
  the core's `LaneReserved` comes back as a command of that very event (`Dispatcher._perform`
  keeps it for `reserve` to take), or a refusal if the core refused the event.
- Each granted reservation is ended by one `release`.
"""

from __future__ import annotations

from clockwork_async.core.events import LaneReserved, ReleaseLane, ReserveLane
from clockwork_async.runtime.dispatch_state import DispatcherHoldings


class LaneReservations(DispatcherHoldings):
    """The dispatcher's lane reservations (`Dispatcher` is one)."""

    def reserve(
        self, executor_id: str, lane: str, duration_ns: int, pages: int = 0
    ) -> LaneReserved:
        """Hold an executor's lane (and pages) for an action the core does not plan, from a
        task of its own (core/reservations.py); returns the core's `LaneReserved`. Each is
        ended by one `release`."""
        if self._handling:  # its answer would come after this returns: a lane never released
            raise RuntimeError("Dispatcher.reserve called while an event is being handled")
        reservation_id = next(self._reservation_ids)
        self._feed(ReserveLane(executor_id, reservation_id, lane, duration_ns, pages))
        refused = LaneReserved(executor_id, reservation_id, 0, 0, "the controller refused it")
        return self._reserved.pop((executor_id, reservation_id), refused)

    def release(self, executor_id: str, reservation_id: int, end_ns: int = 0) -> None:
        """End a reservation: the reserved action ended at ``end_ns`` (0: now)."""
        self._feed(ReleaseLane(executor_id, reservation_id, end_ns))
