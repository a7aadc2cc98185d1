"""Lane reservations: an executor's lane (and pages) held for work the core does not plan
itself — registration's profiling LOADs and INFERs of a model that is not registered yet.

Invariants: a reservation is committed to its lane exactly as an action is (after the work
committed before it, `Lane.commit`), so admission, the ledger, batching and placement all see
the lane busy until its predicted end, and everything planned later starts after it: no
request is planned under it, so none is made late by it. Its pages count as used from
`ReserveLane` to `ReleaseLane`, so placement never plans a LOAD into them. Each `ReserveLane`
is answered by exactly one `LaneReserved` (``refused`` set when nothing was held). A
reservation ends once: at its `ReleaseLane` (the lane re-chained from the measured end, as a
result does), or with its executor (`ExecutorLeft` drops the whole executor state); a release
of a reservation that is gone is ignored. A reservation holds its lane until it is released:
one still outstanding at or past its predicted end is assumed to run its duration again
(`hold_overdue`, before every event is handled), so the lane is never resynchronised under
it and no work is planned where it may still be running. (Work planned behind it that still
finds it running is refused ``too_late`` by the executor's window, and re-planned, never late.)
"""

from __future__ import annotations

from .entities import ExecutorState, Reservation
from .errors import InvalidEvent
from .events import LaneReserved, ReleaseLane, ReserveLane
from .lanes import Lane
from .state import CoreState

LANES = ("execute", "load", "")
MIN_HOLD_NS = 1_000_000  # an overdue reservation is extended by its duration, at least this


def on_reserve_lane(core: CoreState, event: ReserveLane) -> None:
    """Hold the lane and pages ``event`` asks for and answer `LaneReserved`. Raises
    InvalidEvent (bad lane, negative duration or pages, an id in use) before any change."""
    key = (event.executor_id, event.reservation_id)
    if event.lane not in LANES or event.duration_ns < 0 or event.pages < 0:
        raise InvalidEvent(f"not a reservation: {event!r}")
    if key in core.reservations:
        raise InvalidEvent(f"reservation id in use: {event!r}")
    executor = core.executors.get(event.executor_id)
    refused = _refusal(executor, event)
    if executor is None or refused:
        core.out.append(LaneReserved(event.executor_id, event.reservation_id, 0, 0, refused))
        return
    lane = _lane(executor, event.lane)
    reservation = Reservation(event.reservation_id, executor, lane, event.pages)
    reservation.earliest_ns = core.now_ns
    reservation.predicted_ns = event.duration_ns
    reservation.hold_ns = max(MIN_HOLD_NS, event.duration_ns)
    start_ns = core.now_ns
    if lane is not None:
        start_ns = lane.start_for(core.now_ns)
        lane.commit(reservation, start_ns)
    executor.pages_used += event.pages
    core.reservations[key] = reservation
    end_ns = start_ns + event.duration_ns
    core.out.append(LaneReserved(event.executor_id, event.reservation_id, start_ns, end_ns))


def on_release_lane(core: CoreState, event: ReleaseLane) -> None:
    """End a reservation: its lane is planned from ``end_ns`` (or now) again, its pages are
    free, and the executor's lanes are filled again. A reservation that is gone (released,
    or its executor left) is ignored."""
    reservation = core.reservations.pop((event.executor_id, event.reservation_id), None)
    if reservation is None:
        return
    executor = reservation.executor
    if core.executors.get(event.executor_id) is not executor:
        return  # it left (perhaps joined again): the reservation went with it
    if reservation.lane is not None:
        reservation.lane.finish(reservation, event.end_ns or core.now_ns)
    executor.pages_used -= reservation.pages
    core.to_fill[executor.executor_id] = executor
    core.placement_dirty = True


def hold_overdue(core: CoreState) -> None:
    """Every lane reservation at or past its predicted end is assumed to run its own duration
    longer (the work behind it moves back)."""
    now_ns = core.now_ns
    for reservation in core.reservations.values():
        lane, executor = reservation.lane, reservation.executor
        if lane is None or reservation.planned_end_ns > now_ns:
            continue
        if core.executors.get(executor.executor_id) is executor:  # (not gone with it)
            lane.hold(reservation, now_ns + reservation.hold_ns)


def _refusal(executor: ExecutorState | None, event: ReserveLane) -> str:
    if executor is None:
        return f"executor {event.executor_id!r} is not joined"
    if event.pages > executor.pages_free:
        return (
            f"executor {event.executor_id!r} has {executor.pages_free} free pages, "
            f"{event.pages} needed"
        )
    return ""


def _lane(executor: ExecutorState, name: str) -> Lane | None:
    if name == "execute":
        return executor.exec_lane
    if name == "load":
        return executor.load_lane
    return None
