"""The dispatcher: the one owner of the controller core, the request book and the joined
executor links. Everything that happens becomes an event for the core; every command the core
returns becomes a send on a link, a reply to a caller or a timer. One direction, no callbacks
into an owner.

One idea: the request path between the API and the executor links. Events in: `submit`,
`cancel`, `flush` (callers), `executor_joined` / `executor_left` (the executor pool), `add_model`
/ `remove_model` and `reserve` / `release` (registration), action results (from links, for the
actions it sent), ticks (its own timer), `drain` / `close`. Out: actions on links, ``on_reply``
calls and listeners. `Dispatcher` is assembled from parts in modules of their own: its state,
lifecycle and read-only view (runtime/dispatch_state.py), the door (runtime/door.py) and the
lane reservations for registration (runtime/reservations.py); this module is the path itself.

Invariants:
- The core is entered through ``Controller.handle`` alone, one event at a time, in the order
  events are fed; an event fed while another is handled (a caller that submits from its reply
  callback, a result) is handled right after it, so the core is never re-entered. Arrivals are
  held until the end of the event loop's round, the next other event or `MAX_HELD_ARRIVALS`,
  whichever comes first, and handled as one `Arrivals` event so that they can share a batch.
- The core judges ``ok`` and ``late`` (it is told the return hop with `ReturnHop` and plans
  by it); the dispatcher changes one outcome only: an ``ok`` whose reply would leave after its
  deadline leaves ``late`` (`RequestBook.outcome`; its way out teaches the hop). The only
  answers that do not come from the core are the refusals at the door (runtime/door.py:
  ``shutting_down``, ``overloaded`` when the daemon's own loop is too far behind,
  ``unknown_model``, ``bad_input``; answered before `submit` returns) and ``failed`` when the
  core refuses an event (a bug).
- Each submitted request's ``on_reply`` is called exactly once, possibly before `submit`
  returns; it is in the book from acceptance until then, and every answer is counted once in
  the book (``outcomes``) before callers and listeners see it.
- An action is in the book from its send until its ActionFinished was handled or its executor
  left; a result for an action no longer there is ignored, so each is resolved once.
- Reading state (`snapshot` and the read-only properties) never runs the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.connection import ConnectionClosed
from clockwork_async.core.errors import ControllerError
from clockwork_async.core.events import (
    ActionFinished,
    Arrivals,
    Command,
    Event,
    ExecutorJoined,
    ExecutorLeft,
    LaneReserved,
    ModelRegistered,
    ModelUnregistered,
    Reply,
    RequestArrived,
    RequestCancelled,
    StartInfer,
    StartLoad,
    StartUnload,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import Slot
from clockwork_async.logs import request_extra
from clockwork_async.runtime.batching import tensor_bytes
from clockwork_async.runtime.dispatch_state import (
    DispatcherState,
    ExecutorListener,
    JoinedExecutor,
)
from clockwork_async.runtime.door import Door
from clockwork_async.runtime.executor_link import ExecutorLink, LinkDown
from clockwork_async.runtime.models import RegisteredModel
from clockwork_async.runtime.requests import (
    ActionRecord,
    PendingRequest,
)
from clockwork_async.runtime.reservations import LaneReservations
from clockwork_async.wire.messages import ActionResult, Message

log = logging.getLogger(__name__)

MAX_HELD_ARRIVALS = 32  # twice the largest usual batch; more are handed to the core at once
OTHER = "other"  # the metric label of requests for unknown models: clients cannot grow labels
_ACTIONS = (StartUnload, StartLoad, StartInfer)


class Dispatcher(Door, LaneReservations):
    """Runs the controller core in real time against joined executor links."""

    # --- requests in ---------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        on_reply: Callable[[InferOutcome], None],
        slot: Slot | None = None,
    ) -> int:
        """Accept a request that arrived now, due ``slo_ns`` from now, at ``deadline_unix_ns``
        (Unix time) or after its model's default SLO (`api.service.Requests.submit`)."""
        deadline_ns = self._deadline_ns(model, slo_ns, deadline_unix_ns, self._now_ns())
        return self.submit_by(model, inputs, deadline_ns=deadline_ns, on_reply=on_reply, slot=slot)

    def submit_by(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_ns: int,
        on_reply: Callable[[InferOutcome], None],
        slot: Slot | None = None,
    ) -> int:
        """Accept a request (one row per input) due by ``deadline_ns`` (monotonic clock).

        Returns its id. ``on_reply`` is called exactly once, possibly before this returns. The
        inputs must not be changed until then (they may go out without a copy). ``slot``: the
        IO arena slot the inputs are in; the caller releases it after ``on_reply``, and
        actions that use it pin it meanwhile.
        """
        request_id = next(self._request_ids)
        now_ns = self._now_ns()
        routed = self._route(model, inputs, on_reply)  # shape buckets: its bucket's variant
        if routed is not None:
            model, inputs, on_reply = routed.model, routed.inputs, routed.on_reply
        request = PendingRequest(
            request_id, model, inputs, on_reply, now_ns, deadline_ns, slot=slot
        )
        self._book.add_request(request)
        nbytes = tensor_bytes(inputs)
        refusal = self._refusal(model, inputs, deadline_ns - now_ns, now_ns, routed)
        self._loop.book(now_ns, nbytes, admitted=refusal is None)
        if refusal is not None:
            self._answer_here(request, *refusal)
            return request_id
        self._start()
        for event in self._hops.relieve(now_ns):  # nothing measured for a while: tails go
            self._feed(event)
        self._hold(RequestArrived(request_id, model, deadline_ns))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Ask the core to cancel a request; it is answered ``cancelled`` unless it is already
        running (then its result still comes). Unknown or answered ids are ignored."""
        if self._book.request(request_id) is not None:
            self._feed(RequestCancelled(request_id))

    def flush(self) -> None:
        """Hand the requests submitted so far to the core now, together (a caller that knows
        no more are coming: its read is done)."""
        self._take_arrivals()
        self._run()

    # --- executors and models in ---------------------------------------------------------------

    def executor_joined(
        self, executor_id: str, link: ExecutorLink, loaded: tuple[str, ...]
    ) -> None:
        """``link`` is up and reconciled; ``loaded``: models resident there."""
        info = link.info
        resident = tuple(sorted(set(loaded) & self._models.keys()))
        joined = JoinedExecutor(link, info, info.pages_free, set(resident))
        joined.shares_arena = self._arena is not None and info.io_arena == self._arena.token
        self._executors[executor_id] = joined
        self._feed(
            ExecutorJoined(executor_id, info.kind, info.pages_total, info.page_bytes, resident)
        )
        _call_all(self.executor_listeners, executor_id, True, "joined")

    def executor_left(self, executor_id: str, reason: str) -> None:
        """The executor's link went down (or it was detached): its actions will never finish;
        the core re-plans or answers their requests."""
        if self._executors.pop(executor_id, None) is None:
            return
        for action in self._book.actions_of(executor_id):
            self._book.finish_action(action.action_id)
            self._model_action_done(action.model)
        self._hops.forget(executor_id)
        self._feed(ExecutorLeft(executor_id, reason))
        _call_all(self.executor_listeners, executor_id, False, reason)

    def add_model(self, model: RegisteredModel) -> None:
        """Serve ``model`` (registered on the executors). Raises ValueError if taken."""
        if model.name in self._models:
            raise ValueError(f"model {model.name!r} is already served")
        self._models[model.name] = model
        self._feed(ModelRegistered(model.spec()))

    async def remove_model(self, name: str) -> None:
        """Stop serving ``name``: queued requests are answered ``unknown_model`` by the core,
        running ones finish; returns when none of its actions is outstanding. Raises KeyError."""
        if name not in self._models:
            raise KeyError(f"model {name!r} is not registered")
        del self._models[name]
        self._feed(ModelUnregistered(name))
        while self._book.actions_for_model(name):
            idle = self._idle_models.setdefault(name, asyncio.Event())
            await idle.wait()
            self._idle_models.pop(name, None)
        for joined in self._executors.values():
            joined.loaded.discard(name)

    # --- the core --------------------------------------------------------------------------------

    def _hold(self, arrival: RequestArrived) -> None:
        if not self._arrivals:
            _call_soon(self.flush)
        self._arrivals.append(arrival)
        if len(self._arrivals) >= MAX_HELD_ARRIVALS:
            self.flush()  # a burst: schedule what came so far while the rest is decoded

    def _take_arrivals(self) -> None:
        if self._arrivals:
            self._events.append(Arrivals(tuple(self._arrivals)))
            self._arrivals = []

    def _feed(self, event: Event) -> None:
        """Handle ``event`` now (after any held arrivals), or right after the one being
        handled."""
        self._take_arrivals()
        self._events.append(event)
        self._run()

    def _run(self) -> None:
        if self._handling:
            return
        self._handling = True
        try:
            while self._events:
                self._handle(self._events.popleft())
        finally:
            self._handling = False

    def _handle(self, event: Event) -> None:
        started_ns = time.perf_counter_ns()
        now_ns = self._now_ns()
        try:
            commands = self._core.handle(event, now_ns)
        except ControllerError:
            log.exception("the controller refused %r", event)
            commands = _after_refusal(event)
        self._core_ns += time.perf_counter_ns() - started_ns
        callbacks_ns = 0
        for command in _actions_first(commands):
            callbacks_ns += self._perform(command, now_ns)
        for link in self._written:
            link.flush()  # the actions of one handling go out together, now
        self._written.clear()
        self._poll.touch()  # a result or the next request is likely soon: do not sleep
        if isinstance(event, ActionFinished):  # its replies are out: its outputs can go
            action = self._book.finish_action(event.action_id)
            if action is not None:
                self._model_action_done(action.model)
        self._dispatch_ns += time.perf_counter_ns() - started_ns - callbacks_ns

    def _perform(self, command: Command, now_ns: int) -> int:
        """Carry out one command; returns ns spent in callers' callbacks."""
        if isinstance(command, Reply):
            return self._reply(command)
        if isinstance(command, StartInfer):
            self._start_infer(command, now_ns)
        elif isinstance(command, StartLoad | StartUnload):
            self._start_weights(command, now_ns)
        elif isinstance(command, WakeAt):
            self._timer.arm(command.time_ns)
        elif isinstance(command, LaneReserved):
            self._reserved[command.executor_id, command.reservation_id] = command
        else:
            log.error("unknown command %r", command)
        return 0

    def _on_wake(self) -> None:
        self._feed(Tick())

    def _poll_ns(self) -> int:
        """The loop thread's CPU time spent busy-polling, which `LoopLane` does not count."""
        return self._poll.thread_ns

    # --- actions out -----------------------------------------------------------------------------

    def _start_infer(self, command: StartInfer, now_ns: int) -> None:
        joined = self._executors.get(command.executor_id)
        model = self._models.get(command.model)
        if joined is None or model is None:
            self._not_sent(command.executor_id, command.action_id, "no such executor/model")
            return
        link = joined.link
        action = ActionRecord.infer(command, now_ns)
        arena = self._arena if joined.shares_arena else None
        message = self._book.infer_message(
            action, model.inputs, link.offset_ns, arena=arena, outputs=model.outputs
        )
        if message is None:
            self._not_sent(command.executor_id, command.action_id, "its requests are gone")
            return
        self._send(link, action, message)

    def _start_weights(self, command: StartLoad | StartUnload, now_ns: int) -> None:
        joined = self._executors.get(command.executor_id)
        if joined is None:
            self._not_sent(command.executor_id, command.action_id, "no such executor")
        elif isinstance(command, StartLoad):
            action = ActionRecord.load(command, now_ns)
            self._send(joined.link, action, action.load_message(joined.link.offset_ns))
        else:
            action = ActionRecord.unload(command, now_ns)
            self._send(joined.link, action, action.unload_message())

    def _send(self, link: ExecutorLink, action: ActionRecord, message: Message) -> None:
        self._book.add_action(action)
        started_ns = time.perf_counter_ns()
        try:
            link.send_action(message, action.action_id, partial(self._on_result, link, action))
            self._written.add(link)
            self._send_ns += time.perf_counter_ns() - started_ns
        except (LinkDown, ConnectionClosed) as error:
            # The socket died before the reader noticed: the executor leaves now, and the core
            # re-plans this action's requests with the rest of its work.
            link.fail(f"sending failed: {error}")
        except Exception as error:  # EncodeError or a bug: this action alone fails
            log.exception("sending action %d to %s failed", action.action_id, action.executor_id)
            self._book.finish_action(action.action_id)
            self._not_sent(action.executor_id, action.action_id, str(error))

    def _not_sent(self, executor_id: str, action_id: int, why: str) -> None:
        log.debug("action %d on %s not sent: %s", action_id, executor_id, why)
        self._feed(ActionFinished(executor_id, action_id, code="internal"))

    # --- results in ------------------------------------------------------------------------------

    def _on_result(self, link: ExecutorLink, action: ActionRecord, message: Message) -> None:
        if self._book.action(action.action_id) is not action:
            return  # resolved already (its executor left)
        if not isinstance(message, ActionResult):
            message = ActionResult(action.action_id, "internal", f"unexpected {message!r}")
        hops = self._note(link, action, message)
        group = self._group_of(action.model)
        self._feed(action.finished_event(message, link.offset_ns, hops))
        # Listeners (the metrics) only watch: after the core's pass, so its replies go first.
        for listener in self.action_listeners:
            _call_quietly(listener, group, action, message)

    def _note(
        self, link: ExecutorLink, action: ActionRecord, result: ActionResult
    ) -> tuple[int | None, int | None]:
        """Keep what the result tells: timings, pages, loaded models, errors; returns both
        hops' new estimates (they go to the core with the result)."""
        action.result = result
        action.received_ns = now_ns = self._now_ns()
        action.offset_ns = link.offset_ns
        hops = self._hops.on_result(
            action.executor_id, action.sent_ns, link.offset_ns, result, now_ns
        )
        joined = self._executors.get(action.executor_id)
        if joined is not None:
            joined.pages_free = result.pages_free or joined.pages_free
            action.track_loaded(joined.loaded, result)
        if action.kind == "infer" and result.ok:
            error_ns = result.durations_ns.get("execute", 0) - action.predicted_ns
            self._prediction_errors.add(action.model, error_ns)
        return hops

    # --- replies out -----------------------------------------------------------------------------

    def _reply(self, reply: Reply) -> int:
        request = self._book.pop_request(reply.request_id)
        if request is None:
            log.debug("reply to unknown request %d (%s) ignored", reply.request_id, reply.outcome)
            return 0
        now_ns = self._now_ns()
        outcome = self._book.outcome(request, reply, now_ns)
        if outcome.outcome is not reply.outcome and outcome.outcome is Outcome.LATE:
            self._learn_way_out(reply, now_ns)
        started_ns = time.perf_counter_ns()
        self._deliver(request, outcome, now_ns)
        return time.perf_counter_ns() - started_ns

    def _learn_way_out(self, reply: Reply, now_ns: int) -> None:
        """An ok left late: the way back it took teaches the core's return hop."""
        action = self._book.action(reply.action_id) if reply.action_id is not None else None
        result = action.result if action is not None else None
        if action is not None and result is not None and result.end_ns:
            hop = self._hops.on_late_way_out(result.end_ns - action.offset_ns, now_ns)
            if hop is not None:
                self._feed(hop)

    def _answer_here(self, request: PendingRequest, outcome: Outcome, message: str) -> None:
        """Answer a request the core never saw (refused at the door)."""
        now_ns = self._now_ns()
        self._book.pop_request(request.request_id)
        self._deliver(request, self._book.rejection(request, outcome, message, now_ns), now_ns)

    def _deliver(self, request: PendingRequest, outcome: InferOutcome, now_ns: int) -> None:
        """The one way out for an answer: counted once, then the caller, then listeners."""
        self._book.count(outcome.outcome)
        if outcome.outcome is Outcome.LATE:
            _log_late(request, outcome)
        _call_quietly(request.on_reply, outcome)
        served = self._models.get(request.model)
        model_label = request.model if served is not None else OTHER
        group = self._group_of(request.model)
        slack_ns = request.deadline_ns - now_ns
        for listener in self.outcome_listeners:
            _call_quietly(listener, model_label, group, slack_ns, outcome)
        if self._state is DispatcherState.DRAINING and not self._book.request_count:
            self._drained.set()

    def _group_of(self, model: str) -> str:
        served = self._models.get(model)
        return (served.group or served.name) if served is not None else OTHER

    def _model_action_done(self, model: str) -> None:
        idle = self._idle_models.get(model)
        if idle is not None and not self._book.actions_for_model(model):
            idle.set()

    # --- starting (the rest of the lifecycle is in runtime/dispatch_state.py) ---------------

    def _start(self) -> None:
        if not self._lag.running and self._state is not DispatcherState.CLOSED:
            self._lag.start()
            self._loop.start()


def _log_late(request: PendingRequest, outcome: InferOutcome) -> None:
    """Every ``late`` answer is logged with the core's reason and the action's predicted and
    measured execute time, so each one can be traced to a misprediction or a slow hop."""
    timing = outcome.timing_ns
    log.warning(
        "late: %s (predicted execute %.3f ms, measured %.3f ms, batch %d, executor %s)",
        outcome.message,
        timing.get("predicted_execute", 0) / 1e6,
        timing.get("execute", 0) / 1e6,
        outcome.batch_size,
        outcome.executor_id,
        extra=request_extra(request.request_id),
    )


def _call_soon(callback: Callable[[], None]) -> None:
    """Run ``callback`` at the end of this loop round (at once when no loop runs)."""
    try:
        asyncio.get_running_loop().call_soon(callback)
    except RuntimeError:
        callback()


def _actions_first(commands: list[Command]) -> list[Command]:
    """``commands`` with the executors' actions first (in their order: an unload stays before
    the load that needs its pages): answering many requests takes a while, and an action's
    window is reckoned from the moment the core returned it."""
    actions = [c for c in commands if isinstance(c, _ACTIONS)]
    if not actions or len(actions) == len(commands):
        return commands
    return actions + [c for c in commands if not isinstance(c, _ACTIONS)]


def _after_refusal(event: Event) -> list[Command]:
    """Arrivals the core refused are still answered (it keeps no state of them)."""
    if isinstance(event, Arrivals):
        return [
            Reply(arrival.request_id, Outcome.FAILED, "the controller refused it")
            for arrival in event.requests
        ]
    return []


def _call_quietly(callback: Callable[..., object], *args: object) -> None:
    """Run a caller's callback; its exception is logged, never propagated into the core."""
    try:
        callback(*args)
    except Exception:
        log.exception("a callback raised")


def _call_all(listeners: list[ExecutorListener], *args: object) -> None:
    for listener in listeners:
        _call_quietly(listener, *args)
