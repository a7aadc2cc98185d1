"""What goes into the controller core (events) and what comes out (commands).

Invariant: the core is a pure function ``Controller.handle(event, now_ns) -> list[Command]``.
Every time here is in the *controller's* clock, in nanoseconds; the runtime translates to and
from each executor's clock. The core never sees tensors: the runtime keeps each request's inputs
and the executor's outputs, keyed by request id and action id.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .outcomes import Outcome

ExecutorId = str
RequestId = int
ActionId = int

# The events and commands made once or more per request (RequestArrived, ActionFinished, Tick,
# StartInfer, Reply, WakeAt) write their own ``__init__`` (``init=False``): compiled with
# mypyc, a dataclass's generated ``__init__`` runs in the interpreter (about 0.8 µs each, a
# sixth of the simulator's time), an explicit one natively (about 0.04 µs). They stay frozen
# dataclasses (fields, equality, repr, hashing as before); ``object.__setattr__`` is how a
# frozen dataclass sets its fields, as the generated ``__init__`` does.


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Seed durations of one model on one kind of executor."""

    execute_ns: Mapping[int, int]  # batch size -> execute duration
    load_ns: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the core knows of a model instance."""

    name: str
    batch_sizes: tuple[int, ...]  # ascending
    weights_pages: int  # pages one loaded copy takes on an executor
    profiles: Mapping[str, ModelProfile]  # executor kind -> seed profile
    group: str = ""  # instances of one file share a group (metrics, host weights)
    default_slo_ns: int = 100_000_000


# --- Events ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExecutorJoined:
    executor_id: ExecutorId
    kind: str
    pages_total: int
    page_bytes: int
    loaded: tuple[str, ...] = ()  # models already resident (after a reconnect)


@dataclass(frozen=True, slots=True)
class ExecutorLeft:
    """The executor failed or went away: its outstanding actions will never finish."""

    executor_id: ExecutorId
    reason: str


@dataclass(frozen=True, slots=True)
class ExecutorLead:
    """The runtime's estimate of the way there changed: an action sent to this executor now
    can start there no earlier than ``lead_ns`` from now (the send, the socket, the executor's
    read). The core plans every new action on its lanes that far ahead at least."""

    executor_id: ExecutorId
    lead_ns: int


@dataclass(frozen=True, slots=True)
class ReturnHop:
    """The runtime's estimate of the way back changed: a result that ends on an executor
    reaches the controller up to ``hop_ns`` later. The core plans each request that arrives
    from now on to end that much before its deadline."""

    hop_ns: int


@dataclass(frozen=True, slots=True)
class ModelRegistered:
    spec: ModelSpec


@dataclass(frozen=True, slots=True)
class ModelUnregistered:
    name: str


@dataclass(frozen=True, slots=True, init=False)
class RequestArrived:
    """A request arrived. ``deadline_ns`` is its true deadline (controller clock): the core
    answers ``ok`` only when it hands out the result by then, and plans it to end by
    ``deadline_ns`` less the return hop it was last told (`ReturnHop`)."""

    request_id: RequestId
    model: str
    deadline_ns: int

    def __init__(self, request_id: RequestId, model: str, deadline_ns: int) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "deadline_ns", deadline_ns)


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Requests that arrived together (one socket read): each is admitted on its own, then
    they are scheduled once, so they can share a batch."""

    requests: tuple[RequestArrived, ...]


@dataclass(frozen=True, slots=True)
class RequestCancelled:
    request_id: RequestId


@dataclass(frozen=True, slots=True, init=False)
class ActionFinished:
    """An executor's result, its times already translated to the controller's clock.

    ``code`` is empty on success, else an ErrorCode value (e.g. ``too_late``).
    ``duration_ns`` is the measured duration of the predicted phase: execute for INFER,
    load for LOAD (0 when the action did not run). ``return_hop_ns`` and ``lead_ns``, when
    set, are what the runtime's estimates of the way back (as `ReturnHop`) and of this
    executor's way there (as `ExecutorLead`) became with this result: they ride with it so
    that learning them costs the core no pass of its own.
    """

    executor_id: ExecutorId
    action_id: ActionId
    code: str = ""
    start_ns: int = 0
    end_ns: int = 0
    duration_ns: int = 0
    return_hop_ns: int | None = None
    lead_ns: int | None = None

    def __init__(
        self,
        executor_id: ExecutorId,
        action_id: ActionId,
        code: str = "",
        start_ns: int = 0,
        end_ns: int = 0,
        duration_ns: int = 0,
        return_hop_ns: int | None = None,
        lead_ns: int | None = None,
    ) -> None:
        object.__setattr__(self, "executor_id", executor_id)
        object.__setattr__(self, "action_id", action_id)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "start_ns", start_ns)
        object.__setattr__(self, "end_ns", end_ns)
        object.__setattr__(self, "duration_ns", duration_ns)
        object.__setattr__(self, "return_hop_ns", return_hop_ns)
        object.__setattr__(self, "lead_ns", lead_ns)


@dataclass(frozen=True, slots=True, init=False)
class Tick:
    """A timer the core asked for (WakeAt) fired, or the runtime just wants a look."""

    def __init__(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The runtime is draining: later arrivals are rejected ``shutting_down``; accepted
    requests are still served (or dropped) as usual."""


@dataclass(frozen=True, slots=True)
class Abandon:
    """The runtime stops waiting (a drain ran out of time, or it closes): every accepted
    request still unanswered is answered ``shutting_down`` with ``message`` now; results of
    their actions that come later are ignored."""

    message: str = "the server is shutting down"


@dataclass(frozen=True, slots=True)
class ReserveLane:
    """Hold one lane of an executor for ``duration_ns`` of work the core does not plan itself
    (registration's profiling actions), and ``pages`` of its weight pages until the release.

    ``lane`` is ``"execute"``, ``"load"``, or ``""`` for pages alone. ``reservation_id`` is
    the runtime's, unique per executor among reservations not yet released. Answered by one
    `LaneReserved` (core/reservations.py).
    """

    executor_id: ExecutorId
    reservation_id: int
    lane: str
    duration_ns: int
    pages: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseLane:
    """The reserved work ended at ``end_ns`` (controller clock; 0: it never ran, or now):
    the lane is planned from there again and the reservation's pages are free."""

    executor_id: ExecutorId
    reservation_id: int
    end_ns: int = 0


Event = (
    ExecutorJoined
    | ExecutorLeft
    | ExecutorLead
    | ReturnHop
    | ModelRegistered
    | ModelUnregistered
    | RequestArrived
    | Arrivals
    | RequestCancelled
    | ActionFinished
    | Tick
    | Shutdown
    | Abandon
    | ReserveLane
    | ReleaseLane
)


# --- Commands -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartLoad:
    executor_id: ExecutorId
    action_id: ActionId
    model: str
    earliest_ns: int
    latest_ns: int


@dataclass(frozen=True, slots=True, init=False)
class StartInfer:
    executor_id: ExecutorId
    action_id: ActionId
    model: str
    batch_size: int  # >= len(request_ids); the runtime pads the rest
    request_ids: tuple[RequestId, ...]
    earliest_ns: int  # may start from here (when sent: as soon as the lane's earlier work ends)
    latest_ns: int
    predicted_ns: int  # predicted execute duration
    planned_start_ns: int = 0  # where the core planned it: after the lane's committed work

    def __init__(
        self,
        executor_id: ExecutorId,
        action_id: ActionId,
        model: str,
        batch_size: int,
        request_ids: tuple[RequestId, ...],
        earliest_ns: int,
        latest_ns: int,
        predicted_ns: int,
        planned_start_ns: int = 0,
    ) -> None:
        object.__setattr__(self, "executor_id", executor_id)
        object.__setattr__(self, "action_id", action_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "earliest_ns", earliest_ns)
        object.__setattr__(self, "latest_ns", latest_ns)
        object.__setattr__(self, "predicted_ns", predicted_ns)
        object.__setattr__(self, "planned_start_ns", planned_start_ns)


@dataclass(frozen=True, slots=True)
class StartUnload:
    executor_id: ExecutorId
    action_id: ActionId
    model: str


@dataclass(slots=True, init=False)
class ExecutionTimes:
    """How the batch that answered an OK or LATE request ran, read as `Reply.details`.

    Kept as native fields and turned into a dict only when read: the core answers every
    request, and nothing but tests and diagnostics reads the dict (building it per answer was
    about 3% of a compiled simulation). Not frozen (plain stores are cheaper interpreted than
    ``object.__setattr__``); nothing changes it after the answer is made."""

    batch_size: int
    predicted_ns: int
    measured_ns: int
    arrival_ns: int
    start_ns: int
    end_ns: int

    def __init__(
        self,
        batch_size: int,
        predicted_ns: int,
        measured_ns: int,
        arrival_ns: int,
        start_ns: int,
        end_ns: int,
    ) -> None:
        self.batch_size = batch_size
        self.predicted_ns = predicted_ns
        self.measured_ns = measured_ns
        self.arrival_ns = arrival_ns
        self.start_ns = start_ns
        self.end_ns = end_ns

    def as_dict(self) -> dict[str, int]:
        return {
            "batch_size": self.batch_size,
            "predicted_ns": self.predicted_ns,
            "measured_ns": self.measured_ns,
            "arrival_ns": self.arrival_ns,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
        }


@dataclass(frozen=True, slots=True, init=False)
class Reply:
    """The one answer to a request. For OK and LATE the runtime attaches the outputs of
    ``action_id`` (the request's row of the batch). ``details`` (e.g. predicted_ns,
    measured_ns) is a mapping given at construction, or built from ``times`` when read."""

    request_id: RequestId
    outcome: Outcome
    message: str = ""
    action_id: ActionId | None = None
    executor_id: ExecutorId | None = None
    given_details: Mapping[str, int] | None = field(default=None, repr=False)
    times: ExecutionTimes | None = None

    def __init__(
        self,
        request_id: RequestId,
        outcome: Outcome,
        message: str = "",
        action_id: ActionId | None = None,
        executor_id: ExecutorId | None = None,
        details: Mapping[str, int] | None = None,
        times: ExecutionTimes | None = None,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "action_id", action_id)
        object.__setattr__(self, "executor_id", executor_id)
        object.__setattr__(self, "given_details", details)
        object.__setattr__(self, "times", times)

    @property
    def details(self) -> Mapping[str, int]:
        """The mapping given, else ``times`` as a new dict, else an empty one."""
        if self.given_details is not None:
            return self.given_details
        return {} if self.times is None else self.times.as_dict()


@dataclass(frozen=True, slots=True, init=False)
class WakeAt:
    """Deliver a Tick at (or soon after) ``time_ns``. A later WakeAt replaces an earlier one."""

    time_ns: int

    def __init__(self, time_ns: int) -> None:
        object.__setattr__(self, "time_ns", time_ns)


@dataclass(frozen=True, slots=True)
class LaneReserved:
    """The answer to `ReserveLane`: the lane is held from ``start_ns`` (after the work
    committed before it) to ``end_ns``, and nothing planned later starts before ``end_ns``
    by the core's plan. The runtime sends the reserved action at once (it starts on the
    executor when the lane's earlier actions end). ``refused`` is set when nothing was
    reserved (unknown executor, pages that do not fit), with why."""

    executor_id: ExecutorId
    reservation_id: int
    start_ns: int
    end_ns: int
    refused: str = ""


Command = StartLoad | StartInfer | StartUnload | Reply | WakeAt | LaneReserved
