"""What the dispatcher holds, how it goes from running to closed, and how it is read.

`Dispatcher` (runtime/dispatcher.py) is assembled from parts that each live in a module of
their own: this base holds its state and lifecycle, `Door` (runtime/door.py) answers what the
core never sees, `LaneReservations` (runtime/reservations.py) holds lanes for registration,
and runtime/dispatcher.py is the request path between the API and the executor links. The
parts reach the request path's methods only through the declarations below.

Invariants:
- All of the dispatcher's state is built here (`DispatcherHoldings.__init__`), once; the parts
  act on it and add none of their own.
- The state moves only through `_enter`: running -> draining -> closed, or running -> closed.
- `drain` and `close` leave no request unanswered: what the core does not answer in time is
  answered ``shutting_down`` (by the core, or here if it refused `Abandon`); `close` unpins
  the requests' IO arena slots only after that.
- Reading (the properties, `joined`, `costs`, `prediction_errors`, `timers`) never runs the
  core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import Abandon, Event, LaneReserved, RequestArrived, Shutdown
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import IoArena
from clockwork_async.runtime.buckets import BucketedModel
from clockwork_async.runtime.config import RuntimeConfig
from clockwork_async.runtime.executor_link import ExecutorLink
from clockwork_async.runtime.hop import Hops
from clockwork_async.runtime.models import RegisteredModel
from clockwork_async.runtime.requests import (
    ActionRecord,
    PendingRequest,
    PredictionErrors,
    RequestBook,
)
from clockwork_async.runtime.timers import BusyPoll, LagProbe, LoopLane, WakeTimer
from clockwork_async.wire.messages import ActionResult, ExecutorInfo

# (model label, group label, ns from the answer to the deadline, outcome)
OutcomeListener = Callable[[str, str, int, InferOutcome], None]
# (group label, the action, its result)
ActionListener = Callable[[str, ActionRecord, ActionResult], None]
ExecutorListener = Callable[[str, bool, str], None]  # (executor id, up, reason)


class DispatcherState(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"  # the core refuses new requests; outstanding ones finish
    CLOSED = "closed"


_MOVES = {
    DispatcherState.RUNNING: {DispatcherState.DRAINING, DispatcherState.CLOSED},
    DispatcherState.DRAINING: {DispatcherState.CLOSED},
    DispatcherState.CLOSED: set(),
}


@dataclass(slots=True)
class JoinedExecutor:
    """A joined executor as the dispatcher uses it: its link and what its results said of its
    pages and models."""

    link: ExecutorLink
    info: ExecutorInfo
    pages_free: int
    loaded: set[str] = field(default_factory=set)
    shares_arena: bool = False  # it maps the daemon's IO arena: rows go by reference


@dataclass(frozen=True, slots=True)
class CostCounters:
    """Where the dispatcher's time went, summed since start (``perf_counter`` ns)."""

    core_ns: int  # inside Controller.handle
    dispatch_ns: int  # all event handling (core and sends), less callers' reply callbacks
    send_ns: int  # encoding and writing actions to executor sockets


class DispatcherHoldings:
    """The dispatcher's state and lifecycle, and the read-only view of it: the base of
    `Dispatcher`, never used alone (the methods declared under TYPE_CHECKING are the request
    path's)."""

    def __init__(
        self,
        config: ControllerConfig,
        runtime: RuntimeConfig | None = None,
        *,
        now_ns: Callable[[], int] = time.monotonic_ns,
        unix_now_ns: Callable[[], int] = time.time_ns,
        controller: Controller | None = None,
    ) -> None:
        self.runtime = runtime or RuntimeConfig()
        self._core = controller if controller is not None else Controller(config)
        self._now_ns = now_ns
        self._unix_now_ns = unix_now_ns
        self._state = DispatcherState.RUNNING
        self._book = RequestBook()
        self._models: dict[str, RegisteredModel] = {}
        self._executors: dict[str, JoinedExecutor] = {}
        self._hops = Hops()
        self._prediction_errors = PredictionErrors()
        self._request_ids = itertools.count(1)
        self._events: deque[Event] = deque()
        self._arrivals: list[RequestArrived] = []  # held until the end of the loop round
        self._handling = False
        self._written: set[ExecutorLink] = set()  # links with actions written this handling
        self._core_ns = self._dispatch_ns = self._send_ns = 0
        self._timer = WakeTimer(
            self._on_wake,
            now_ns=now_ns,
            arm_early_ns=self.runtime.timer_arm_early_ns,
            spin_below_ns=self.runtime.timer_spin_below_ns,
        )
        self._lag = LagProbe(interval_s=self.runtime.lag_probe_interval_s, now_ns=now_ns)
        self._poll = BusyPoll(now_ns=now_ns)  # off until `busy_poll`
        self._loop = LoopLane(now_ns=now_ns, poll_ns=self._poll_ns)
        self._drained = asyncio.Event()
        self._idle_models: dict[str, asyncio.Event] = {}
        self._reservation_ids = itertools.count(1)
        self._reserved: dict[tuple[str, int], LaneReserved] = {}  # answers, until taken
        self.outcome_listeners: list[OutcomeListener] = []
        self.action_listeners: list[ActionListener] = []
        self.executor_listeners: list[ExecutorListener] = []
        self._arena: IoArena | None = None
        self.buckets: dict[str, BucketedModel] = {}  # served by shape buckets, by request name
        self._feed(self._hops.initial())

    def use_arena(self, arena: IoArena | None) -> None:
        """Requests' tensors that are in ``arena`` go to the executors that map it as slot
        references, and their outputs come back into it (before any executor joins)."""
        self._arena = arena

    if TYPE_CHECKING:  # the request path's, in runtime/dispatcher.py

        def _feed(self, event: Event) -> None: ...

        def _on_wake(self) -> None: ...

        def _poll_ns(self) -> int: ...

        def _answer_here(self, request: PendingRequest, outcome: Outcome, message: str) -> None: ...

        def _deliver(self, request: PendingRequest, outcome: InferOutcome, now_ns: int) -> None: ...

    # --- lifecycle -------------------------------------------------------------------------------

    def _enter(self, state: DispatcherState) -> None:
        """The one state transition. Raises RuntimeError for a move that cannot happen."""
        if state not in _MOVES[self._state]:
            raise RuntimeError(f"dispatcher cannot go from {self._state} to {state}")
        self._state = state

    def busy_poll(self, window_ns: int) -> None:
        """After each handling, keep the loop polling its sockets for ``window_ns`` instead of
        sleeping (0: off). Only for a controller with a CPU of its own: the polling uses it."""
        self._poll.set_window(window_ns)

    async def drain(self, timeout_s: float) -> None:
        """Have the core refuse new requests (``shutting_down``); wait up to ``timeout_s`` for
        the outstanding ones, then have it answer the rest ``shutting_down``."""
        if self._state is DispatcherState.RUNNING:
            self._enter(DispatcherState.DRAINING)
            self._feed(Shutdown())
        if self._book.request_count:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout_s)
        self._abandon()

    def _abandon(self) -> None:
        self._feed(Shutdown())
        self._feed(Abandon())
        for request in self._book.pop_all_requests():  # none, unless the core refused Abandon
            now_ns = self._now_ns()
            message = "the server is shutting down"
            rejection = self._book.rejection(request, Outcome.SHUTTING_DOWN, message, now_ns)
            self._deliver(request, rejection, now_ns)

    def close(self) -> None:
        """Answer what is left ``shutting_down`` (by the core) and stop the timers."""
        if self._state is DispatcherState.CLOSED:
            return
        self._enter(DispatcherState.CLOSED)
        self._abandon()
        self._book.unpin_all()  # every request is answered: their slots may go
        self._timer.cancel()
        self._poll.cancel()
        self._lag.stop()
        self._loop.stop()

    # --- reading (never runs the core) -----------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state.value

    @property
    def book(self) -> RequestBook:
        """The request book, to read (outcome counts, outstanding requests and actions)."""
        return self._book

    @property
    def controller(self) -> Controller:
        """The core, to read (its stats and queue depths); feed it only through the dispatcher."""
        return self._core

    @property
    def models(self) -> dict[str, RegisteredModel]:
        """The served models, by name (a copy)."""
        return dict(self._models)

    @property
    def held_arrivals(self) -> int:
        """Requests submitted in this loop round, not handed to the core yet."""
        return len(self._arrivals)

    def held_arrivals_of(self, model: str) -> int:
        """`held_arrivals` of ``model``."""
        return sum(arrival.model == model for arrival in self._arrivals)

    def joined(self, executor_id: str) -> JoinedExecutor | None:
        return self._executors.get(executor_id)

    def costs(self) -> CostCounters:
        return CostCounters(self._core_ns, self._dispatch_ns, self._send_ns)

    def prediction_errors(self) -> PredictionErrors:
        return self._prediction_errors

    def timers(self) -> tuple[LagProbe, WakeTimer, BusyPoll]:
        return self._lag, self._timer, self._poll

    @property
    def loop_lane(self) -> LoopLane:
        """The loop as a lane: its learned cost and how far behind it is (to read)."""
        return self._loop
