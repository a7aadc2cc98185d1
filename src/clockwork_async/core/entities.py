"""The core's entities: requests, models, executors, and the actions and booked batches
between them (they refer to one another, so they are defined together).

One idea: the core's data model, what each entity holds and its guarded transitions; what
happens to them is decided by the layers above (docs/controller.md, "Layers").

Invariants: a request is QUEUED (in its model's queue), RUNNING (in exactly one outstanding
INFER) or DONE (answered exactly once); ``RequestState.move`` is the one guarded transition
(QUEUED -> RUNNING | DONE, RUNNING -> QUEUED | DONE) and raises on any other. A model's queue is a
sorted list on ``key_ns`` (the policy's order: deadline or arrival; see queues.py);
``ModelState.queued`` counts its live (QUEUED) requests. An executor's lanes keep lanes.py's
invariants; its ``pages_used`` counts loaded and loading copies (a LOAD reserves its pages when
it is sent; an UNLOAD returns them when it is sent, as the executor runs it at once, before any
later LOAD).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from enum import Enum

from .errors import ControllerError
from .events import ModelSpec, StartInfer
from .lanes import Lane, Planned
from .profiles import KindPredictions
from .queues import Queued, RequestQueue, RequestStatus


class RequestState(Queued):
    """One accepted request. ``reply_by_ns`` is its true deadline (it is answered ``ok`` only
    by then); ``deadline_ns`` is that less the return hop at its arrival (by when its result
    must end on an executor); ``internal_deadline_ns`` is ``deadline_ns`` minus the safety
    margin (what the scheduler plans against); ``key_ns`` orders its model's queue."""

    __slots__ = (
        "action_id",
        "arrival_ns",
        "booked_batch",
        "deadline_ns",
        "internal_deadline_ns",
        "model",
        "planned_on",
        "reply_by_ns",
        "request_id",
    )

    def __init__(
        self,
        request_id: int,
        model: ModelState,
        arrival_ns: int,
        deadline_ns: int,
        internal_deadline_ns: int,
        key_ns: int,
        reply_by_ns: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.reply_by_ns = deadline_ns if reply_by_ns is None else reply_by_ns
        self.model = model
        self.arrival_ns = arrival_ns
        self.deadline_ns = deadline_ns
        self.internal_deadline_ns = internal_deadline_ns
        self.key_ns = key_ns
        self.status = RequestStatus.QUEUED
        self.action_id: int | None = None
        # Admission ledger (ledger.py): the executor and the batch this queued request is
        # booked in.
        self.planned_on: ExecutorState | None = None
        self.booked_batch: BookedBatch | None = None

    def queued_for(self) -> object:
        return self.model

    def move(self, new: RequestStatus) -> None:
        """Transition to ``new``. Raises ControllerError on a transition that cannot happen."""
        # The allowed moves (QUEUED -> RUNNING | DONE, RUNNING -> QUEUED | DONE) are exactly
        # those out of a live status to another status: two identity checks, no lookup (an
        # Enum's hash runs in the interpreter, even compiled; twice per request).
        if self.status is RequestStatus.DONE or new is self.status:
            raise ControllerError(
                f"request {self.request_id}: {self.status.value} -> {new.value} is not allowed"
            )
        self.status = new


class ModelState:
    """A registered model: its spec, its queue of QUEUED requests and where its copies are."""

    __slots__ = (
        "_pad_to",
        "by_kind",
        "demand",
        "demand_at_ns",
        "in_order_share",
        "loaded_on",
        "loading_on",
        "name",
        "queue",
        "queued",
        "refused_at_ns",
        "reserved_load_ns",
        "reserved_on",
        "reserved_pages",
        "reserved_ready_ns",
        "retired",
        "spec",
        "version",
    )

    def __init__(self, spec: ModelSpec) -> None:
        self.name = spec.name
        self.queue: RequestQueue[RequestState] = RequestQueue(self)
        self.queued = 0  # live requests in ``queue``
        self.version = 0  # bumped whenever the head of the queue changes
        # Executor ids (dicts as ordered sets, so iteration order is deterministic).
        self.loaded_on: dict[str, None] = {}  # holding a loaded copy
        self.loading_on: dict[str, None] = {}  # with a LOAD outstanding
        self.retired = False  # unregistered; copies unload once idle
        self.demand = 0.0  # arrivals (accepted or not), decayed (see note_arrival)
        self.demand_at_ns = 0
        # Share of its recent bookings that sorted last in its queue, so could join its open
        # batch: the room a new batch is booked with expects this share of arrivals (ledger).
        self.in_order_share = 1.0
        self.refused_at_ns = -(1 << 62)  # last arrival refused ``infeasible`` (admission)
        # A LOAD promised to accepted requests while the model has no copy (ledger.py).
        self.reserved_on: ExecutorState | None = None
        self.reserved_ready_ns = 0  # when that LOAD was predicted to end
        self.reserved_load_ns = 0  # its predicted duration, booked on the executor
        self.reserved_pages = 0  # pages held for it there (counted as used) until it starts
        self.spec = spec
        self.by_kind: dict[str, KindPredictions] = {}  # cache of Predictions.get per kind
        self._pad_to: list[int] = []
        self.set_spec(spec)

    def set_spec(self, spec: ModelSpec) -> None:
        """Adopt ``spec`` (registration or re-registration); predictions are re-seeded."""
        self.spec = spec
        self.by_kind = {}
        sizes = spec.batch_sizes
        self._pad_to = [0] + [min(b for b in sizes if b >= k) for k in range(1, sizes[-1] + 1)]

    @property
    def max_batch(self) -> int:
        return self.spec.batch_sizes[-1]

    def padded_batch(self, count: int) -> int:
        """Return the smallest supported batch size >= ``count`` (1 <= count <= max_batch)."""
        return self._pad_to[count]

    def note_arrival(self, now_ns: int, window_ns: int) -> None:
        """Count an arrival in the decayed demand (time constant ``window_ns``)."""
        self.demand = self.demand_now(now_ns, window_ns) + 1.0
        self.demand_at_ns = now_ns

    def demand_now(self, now_ns: int, window_ns: int) -> float:
        """Return the arrivals of the last ``window_ns`` or so, exponentially decayed."""
        elapsed_ns = now_ns - self.demand_at_ns
        if elapsed_ns <= 0 or not self.demand:
            return self.demand
        return self.demand * math.exp(-elapsed_ns / window_ns)

    def has_copy(self) -> bool:
        return bool(self.loaded_on or self.loading_on)

    def push(self, request: RequestState) -> bool:
        """Queue a QUEUED request; return True when it became the head (version bumped)."""
        head = self.queue.peek()
        self.queue.push(request)
        self.queued += 1
        if head is None or request.key_ns < head.key_ns:
            self.version += 1
            return True
        return False

    def peek(self) -> RequestState | None:
        """Return the live head of the queue (earliest key), or None when empty."""
        return self.queue.peek()

    def take(self, count: int, position: int = 0) -> list[RequestState]:
        """Remove and return up to ``count`` live requests in key order, from ``position``
        (0: the head) on; the head changes, so the version is bumped."""
        taken = self.queue.take_from(position, count)
        self.queued -= len(taken)
        self.version += 1
        return taken

    def drain(self) -> list[RequestState]:
        """Empty the queue; return its live requests in key order, still QUEUED and still
        counted in ``queued`` (the caller answers each, which uncounts it)."""
        self.version += 1
        return self.queue.drain()


class ActionKind(Enum):
    INFER = "infer"
    LOAD = "load"
    UNLOAD = "unload"


class Action(Planned):
    """An action the core sent and has not seen the result of."""

    __slots__ = (
        "action_id",
        "batch_size",
        "executor_id",
        "kind",
        "latest_ns",
        "model",
        "pages",
        "probe",
        "requests",
        "warm_up",
    )

    def __init__(
        self,
        action_id: int,
        kind: ActionKind,
        executor_id: str,
        model: ModelState,
        earliest_ns: int = 0,
        predicted_ns: int = 0,
    ) -> None:
        self.action_id = action_id
        self.kind = kind
        self.executor_id = executor_id
        self.model = model
        self.earliest_ns = earliest_ns
        self.latest_ns = earliest_ns
        self.predicted_ns = predicted_ns
        self.planned_end_ns = earliest_ns + predicted_ns
        self.requests: list[RequestState] = []
        self.batch_size = 0
        self.pages = 0
        self.warm_up = False  # an INFER of no request, to warm its lane (warm_up.py)
        self.probe = False  # an INFER of no request, to measure a stale prediction (ditto)

    def start_infer(self) -> StartInfer:
        """The command that sends this INFER (committed to its lane: ``planned_end_ns`` set)."""
        return StartInfer(
            self.executor_id,
            self.action_id,
            self.model.name,
            self.batch_size,
            tuple(r.request_id for r in self.requests),
            self.earliest_ns,
            self.latest_ns,
            self.predicted_ns,
            self.planned_end_ns - self.predicted_ns,
        )


class Reservation(Planned):
    """A lane (and pages) held for work the core does not plan (`ReserveLane`): planned on
    its lane like an action, so the lane's chain runs through it."""

    __slots__ = ("executor", "hold_ns", "lane", "pages", "reservation_id")

    def __init__(
        self, reservation_id: int, executor: ExecutorState, lane: Lane | None, pages: int
    ) -> None:
        self.reservation_id = reservation_id
        self.executor = executor
        self.lane = lane  # None: pages alone
        self.pages = pages
        self.earliest_ns = 0
        self.predicted_ns = 0
        self.planned_end_ns = 0
        self.hold_ns = 0  # past its predicted end, it is assumed to run this much longer


class BookedBatch:
    """A batch the admission ledger booked queued requests of one model into, on one
    executor: its predicted start and end (pushed back when work before it grows), the
    earliest internal deadline of its members, how many were booked (``size``, the batch it
    is costed as) and how many are still queued (``live``), and its cost (exec of ``size``
    padded)."""

    __slots__ = (
        "cost_ns",
        "deadline_ns",
        "end_ns",
        "index",
        "live",
        "model",
        "room",
        "size",
        "start_ns",
    )

    def __init__(
        self, model: str, index: int, start_ns: int, cost_ns: int, deadline_ns: int, room: int = 1
    ) -> None:
        self.model = model
        self.index = index  # position in the executor's booking order
        self.start_ns = start_ns
        self.end_ns = start_ns + cost_ns
        self.cost_ns = cost_ns
        self.deadline_ns = deadline_ns
        self.size = 1
        self.live = 1
        self.room = room  # rows booked for it: its cost is exec(max(size, room), padded)


class ExecutorState:
    """What the core knows of one executor. ``loaded`` is in LRU order (least recent first)."""

    __slots__ = (
        "actions",
        "alive",
        "backlog_ns",
        "booked",
        "booked_head",
        "busy",
        "busy_at_ns",
        "exec_lane",
        "executor_id",
        "fill_round",
        "fills_in_round",
        "heap",
        "infers_by_model",
        "joined_ns",
        "kind",
        "load_lane",
        "loaded",
        "loading",
        "open_batches",
        "page_bytes",
        "pages_total",
        "pages_used",
        "reserved",
        "reserved_load_ns",
        "timer_at_ns",
        "timer_version",
    )

    def __init__(
        self, executor_id: str, kind: str, pages_total: int, page_bytes: int, joined_ns: int = 0
    ) -> None:
        self.executor_id = executor_id
        self.joined_ns = joined_ns
        self.kind = kind
        self.pages_total = pages_total
        self.page_bytes = page_bytes
        self.pages_used = 0
        self.exec_lane = Lane()
        self.load_lane = Lane()
        self.loaded: OrderedDict[str, int] = OrderedDict()  # model -> pages, LRU first
        self.loading: dict[str, Action] = {}  # model -> its outstanding LOAD
        self.infers_by_model: dict[str, int] = {}  # model -> outstanding INFERs
        self.actions: dict[int, Action] = {}  # every outstanding action here
        # EDF over the models loaded here: (head key, seq, model version, model).
        self.heap: list[tuple[int, int, int, ModelState]] = []
        self.timer_version = 0
        self.timer_at_ns = -1
        # Fills in one `run_fills` call (scheduler.py): its round number, and how many.
        self.fill_round = 0
        self.fills_in_round = 0
        self.busy = 0.0  # decayed committed execute time per unit time
        self.busy_at_ns = joined_ns
        self.alive = True
        # Admission ledger (ledger.py): execute time promised to queued requests, the
        # batches they were booked as, and LOADs promised to cold models (in order).
        self.backlog_ns = 0
        self.booked: list[BookedBatch] = []  # in booking order; dead ones before booked_head
        self.booked_head = 0  # index (as BookedBatch.index) of booked[0]
        self.open_batches: dict[str, BookedBatch] = {}  # model -> its last booked batch
        self.reserved: OrderedDict[str, ModelState] = OrderedDict()
        self.reserved_load_ns = 0

    @property
    def pages_free(self) -> int:
        return self.pages_total - self.pages_used

    def holds(self, name: str) -> bool:
        """Return True when ``name`` is loaded or loading here."""
        return name in self.loaded or name in self.loading

    def is_busy_with(self, name: str) -> bool:
        """Return True when an INFER of ``name`` is outstanding here (it must not be evicted)."""
        return self.infers_by_model.get(name, 0) > 0

    def add_infer(self, name: str) -> None:
        self.infers_by_model[name] = self.infers_by_model.get(name, 0) + 1
        self.loaded.move_to_end(name)

    def remove_infer(self, name: str) -> None:
        left = self.infers_by_model.get(name, 0) - 1
        if left > 0:
            self.infers_by_model[name] = left
        elif name in self.infers_by_model:  # (not pop(name, None): a generic call compiled)
            del self.infers_by_model[name]

    def record_busy(self, now_ns: int, duration_ns: int, window_ns: int) -> None:
        """Add committed execute time to the decayed busy average."""
        self.busy = self.utilisation(now_ns, window_ns) + duration_ns / window_ns
        self.busy_at_ns = now_ns

    def utilisation(self, now_ns: int, window_ns: int) -> float:
        """Return the execute lane's busy fraction, averaged over about ``window_ns`` (over
        the time since it joined, while that is shorter: no warm-up bias towards idle)."""
        elapsed_ns = now_ns - self.busy_at_ns
        busy = self.busy if elapsed_ns <= 0 else self.busy * math.exp(-elapsed_ns / window_ns)
        age_ns = now_ns - self.joined_ns
        if age_ns >= 8 * window_ns:
            return busy
        seen = 1.0 - math.exp(-max(age_ns, window_ns // 100) / window_ns)
        return busy / seen
