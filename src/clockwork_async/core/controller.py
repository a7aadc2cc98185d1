"""The controller core's entry point: ``Controller.handle(event, now_ns) -> commands``.

Invariants: pure — no clock reads, no I/O, no asyncio; the same events at the same times give
the same commands. ``now_ns`` never decreases (TimeWentBackwards otherwise). Each call handles
its event, then everything due at ``now_ns`` (timers, fills, drops, placement), and ends with a
WakeAt when the core needs a Tick earlier than it already asked for. Invalid events raise
InvalidEvent before any state changes.

``handle`` is ``accept`` then ``schedule``. Requests decoded from one socket read come as one
`Arrivals` event: each is admitted, then they are scheduled once, so that arrivals seen
together can share a batch. The runtime enters the core through ``handle`` alone.

The core in layers; a module imports only from its own layer or lower ones (tests/test_layers.py
forbids any import cycle; docs/controller.md, "Layers"):

1. vocabulary: errors, outcomes, events, config, percentile, profiles, capacity, clock, models
   (spec checks), buckets (variants per shape bucket);
2. entities: queues, lanes, entities (requests, models, executors, actions, booked batches);
3. state: the data (CoreState), with lookups that only read it;
4. agenda (what to look at next), feasibility, eviction, room, ledger;
5. request operations: requests (answer, reject, enqueue, requeue, rebook), warm_up;
6. plans: batching, policies (they read the state and return values: a Rejection or a Quote,
   a Batch, Defer, Drop or Handoff);
7. acts: admission, scheduler (carries out the plans), results, membership, placement,
   reservations (lanes held for work the core does not plan: registration's profiling);
8. stats, and this controller, which holds the policy and hands it down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from clockwork_async.build import mypyc_attr

from .admission import on_abandon, on_request_arrived, on_request_cancelled
from .config import ControllerConfig
from .errors import InvalidEvent, TimeWentBackwards
from .events import (
    Abandon,
    ActionFinished,
    Arrivals,
    Command,
    Event,
    ExecutorJoined,
    ExecutorLead,
    ExecutorLeft,
    ModelRegistered,
    ModelUnregistered,
    ReleaseLane,
    RequestArrived,
    RequestCancelled,
    ReserveLane,
    ReturnHop,
    Shutdown,
    Tick,
)
from .membership import (
    on_executor_joined,
    on_executor_lead,
    on_executor_left,
    on_model_registered,
    on_model_unregistered,
)
from .placement import place
from .policies import Policy, make_policy
from .reservations import hold_overdue, on_release_lane, on_reserve_lane
from .results import learn_return_hop, on_action_finished
from .scheduler import emit_wake, run_due
from .state import CoreState
from .stats import ControllerStats, ExecutorStats, executor_stats, snapshot


# Open to Python subclasses when compiled with mypyc (tests and benchmarks wrap the real core);
# a no-op otherwise (clockwork_async.build: stdlib only, never compiled).
@mypyc_attr(allow_interpreted_subclasses=True)
class Controller:
    """Makes every scheduling choice from events and predicted durations."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config if config is not None else ControllerConfig()
        self._core = CoreState(self.config)
        self._policy: Policy = make_policy(self.config.policy)
        core, policy = self._core, self._policy
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            RequestArrived: lambda e: on_request_arrived(core, policy, e),
            Arrivals: self._on_arrivals,
            RequestCancelled: lambda e: on_request_cancelled(core, e),
            ActionFinished: lambda e: on_action_finished(core, policy, e),
            ExecutorJoined: lambda e: on_executor_joined(core, policy, e),
            ExecutorLeft: lambda e: on_executor_left(core, policy, e),
            ExecutorLead: lambda e: on_executor_lead(core, e),
            ReturnHop: self._on_return_hop,
            ModelRegistered: lambda e: on_model_registered(core, e),
            ModelUnregistered: lambda e: on_model_unregistered(core, e),
            Tick: self._on_tick,
            Shutdown: self._on_shutdown,
            Abandon: lambda e: on_abandon(core, e),
            ReserveLane: lambda e: on_reserve_lane(core, e),
            ReleaseLane: lambda e: on_release_lane(core, e),
        }

    def handle(self, event: Event, now_ns: int) -> list[Command]:
        """Handle one event at ``now_ns``; return the commands to perform, in order.

        Raises TimeWentBackwards if ``now_ns`` is earlier than a previous call's, InvalidEvent
        for an event the core cannot accept (unknown type, bad spec, reused request id).
        """
        self.accept(event, now_ns)
        return self.schedule(now_ns)

    def accept(self, event: Event, now_ns: int) -> None:
        """Take in one event at ``now_ns`` without scheduling; its commands come out of the
        next `schedule`. Raises like `handle`, before any state changes."""
        core = self._core
        if now_ns < core.now_ns:
            raise TimeWentBackwards(f"now_ns {now_ns} is before the previous {core.now_ns}")
        event_type = type(event)
        # The per-request events and Tick are called directly (compiled: no dict lookup by
        # type, no lambda); the table, which lists every accepted event, serves the rest.
        handler: Callable[[Any], None] | None = None
        if not (event_type is RequestArrived or event_type is ActionFinished or event_type is Tick):
            handler = self._handlers.get(event_type)
            if handler is None:
                raise InvalidEvent(f"not a controller event: {event!r}")
        core.now_ns = now_ns
        if core.reservations:  # (few, only while registrations profile)
            hold_overdue(core)
        if handler is not None:
            handler(event)
        elif event_type is RequestArrived:
            on_request_arrived(core, self._policy, cast(RequestArrived, event))
        elif event_type is ActionFinished:
            on_action_finished(core, self._policy, cast(ActionFinished, event))
        else:
            self._on_tick(cast(Tick, event))

    def schedule(self, now_ns: int) -> list[Command]:
        """Do everything due at ``now_ns`` after the events accepted so far; return every
        command since the last call, in order. Raises TimeWentBackwards."""
        core = self._core
        if now_ns < core.now_ns:
            raise TimeWentBackwards(f"now_ns {now_ns} is before the previous {core.now_ns}")
        core.now_ns = now_ns
        run_due(core, self._policy)
        if core.placement_dirty:
            place(core)
        emit_wake(core)
        out = core.out
        core.out = []
        return out

    def _on_tick(self, event: Tick) -> None:
        # Whatever timer was pending has fired (maybe a little early): ask again if needed.
        self._core.wake_pending_ns = None

    def _on_arrivals(self, event: Arrivals) -> None:
        ids = [arrival.request_id for arrival in event.requests]
        reused = [i for i in ids if i in self._core.requests]
        if reused or len(set(ids)) != len(ids):
            raise InvalidEvent(f"request ids reused in {event!r}")
        for arrival in event.requests:
            on_request_arrived(self._core, self._policy, arrival)

    def _on_return_hop(self, event: ReturnHop) -> None:
        learn_return_hop(self._core, event.hop_ns)

    def _on_shutdown(self, event: Shutdown) -> None:
        self._core.shutting_down = True

    # --- read-only introspection -----------------------------------------------------------

    def stats(self, with_executors: bool = True) -> ControllerStats:
        """Return a snapshot of counts, queue depth, executors and prediction errors."""
        return snapshot(self._core, with_executors)

    def executor(self, executor_id: str) -> ExecutorStats:
        """Return one executor's stats. Raises KeyError for an unknown id."""
        return executor_stats(self._core, executor_id)

    def queue_depth(self, model: str | None = None) -> int:
        """Return the number of queued requests (of ``model``, or in all)."""
        if model is None:
            return self._core.queued_total
        state = self._core.models.get(model)
        return state.queued if state is not None else 0

    def pending(self) -> int:
        """Return the number of accepted requests not answered yet (0 once drained)."""
        return self._core.queued_total + self._core.running_total

    def predicted_exec_ns(self, model: str, kind: str, batch_size: int) -> int:
        """Return the current execute prediction. Raises KeyError (unknown model or size)."""
        spec = self._core.models[model].spec
        return self._core.predictions.get(spec, kind).exec_ns[batch_size]

    def recent_prediction_errors(self) -> tuple[Any, ...]:
        """Return the most recent prediction errors (PredictionError), oldest first."""
        return tuple(self._core.predictions.recent)
