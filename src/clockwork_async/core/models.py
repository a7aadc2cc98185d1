"""Requests and models as the core tracks them.

Invariants: a request is QUEUED (in its model's queue), RUNNING (in exactly one outstanding
INFER) or DONE (answered exactly once); ``RequestState.move`` is the one guarded transition
(QUEUED -> RUNNING | DONE, RUNNING -> QUEUED | DONE) and raises on any other. A model's queue is a
sorted list on ``key_ns`` (the policy's order: deadline or arrival; see queues.py);
``ModelState.queued`` counts its live (QUEUED) requests.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import ControllerError, InvalidEvent
from .events import ModelSpec
from .profiles import KindPredictions
from .queues import RequestQueue, RequestStatus

if TYPE_CHECKING:
    from .tracker import BookedBatch, ExecutorState

_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset({RequestStatus.RUNNING, RequestStatus.DONE}),
    RequestStatus.RUNNING: frozenset({RequestStatus.QUEUED, RequestStatus.DONE}),
    RequestStatus.DONE: frozenset(),
}


class RequestState:
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
        "key_ns",
        "model",
        "planned_on",
        "reply_by_ns",
        "request_id",
        "status",
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

    def move(self, new: RequestStatus) -> None:
        """Transition to ``new``. Raises ControllerError on a transition that cannot happen."""
        if new not in _ALLOWED[self.status]:
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
        "loaded_on",
        "loading_on",
        "name",
        "queue",
        "queued",
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
        self.queue = RequestQueue(self)
        self.queued = 0  # live requests in ``queue``
        self.version = 0  # bumped whenever the head of the queue changes
        # Executor ids (dicts as ordered sets, so iteration order is deterministic).
        self.loaded_on: dict[str, None] = {}  # holding a loaded copy
        self.loading_on: dict[str, None] = {}  # with a LOAD outstanding
        self.retired = False  # unregistered; copies unload once idle
        self.demand = 0.0  # arrivals (accepted or not), decayed (see note_arrival)
        self.demand_at_ns = 0
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


def validate_spec(spec: ModelSpec) -> None:
    """Raise InvalidEvent unless ``spec`` can be scheduled (sizes, pages, profiles)."""
    sizes = spec.batch_sizes
    if not spec.name:
        raise InvalidEvent("a model needs a name")
    if not sizes or any(b <= 0 for b in sizes) or list(sizes) != sorted(set(sizes)):
        raise InvalidEvent(f"model {spec.name!r}: batch_sizes must be ascending, unique, > 0")
    if spec.weights_pages < 0:
        raise InvalidEvent(f"model {spec.name!r}: weights_pages must be >= 0")
    if not spec.profiles:
        raise InvalidEvent(f"model {spec.name!r}: needs a profile for at least one kind")
    for kind, profile in spec.profiles.items():
        missing = [b for b in sizes if profile.execute_ns.get(b, 0) <= 0]
        if missing or profile.load_ns < 0:
            raise InvalidEvent(
                f"model {spec.name!r}, kind {kind!r}: profile lacks positive durations for "
                f"batch sizes {missing} or has a negative load_ns"
            )
