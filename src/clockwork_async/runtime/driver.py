"""Drives the pure controller core in real time against executor processes.

Every event goes to ``Controller.handle(event, now_ns)`` with ``now_ns`` read from the injected
monotonic clock at that moment; the commands it returns are performed at once: StartInfer,
StartLoad and StartUnload go to `actions.Actions` (rows stacked into a batch, the window
converted to the executor's clock, the message sent; results come back as ActionFinished in
controller time); Reply answers a request; WakeAt arms the one `WakeTimer`.

Invariants:
- Each submitted request's ``on_reply`` is called exactly once: an accepted request leaves the
  book before its callback runs, and every answer (core Reply, rejection at submit, drain,
  close) goes through `_deliver`.
- No answer says ``ok`` once its deadline has passed: the core plans by each deadline moved
  earlier by the measured way back from the executors (`hop.HopEstimate`), and `_deliver` judges
  every answer by the true deadline when it is delivered (`hop.judge`) before it is counted,
  passed to listeners or the caller, so snapshot counts, metrics and replies agree.
- Events reach the core one at a time, in order (`dispatch.CoreRunner`); arrivals of one
  loop round are scheduled together, so requests that came in one read can share a batch.
- An executor whose link goes down is reported to the core as ExecutorLeft exactly once per
  join; the core resolves its outstanding actions (re-planned or answered), and the driver
  forgets them, so a late reply can never resolve an action twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

import numpy as np

from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    ExecutorJoined,
    ExecutorLeft,
    ModelRegistered,
    ModelUnregistered,
    Reply,
    RequestArrived,
    RequestCancelled,
    Shutdown,
    StartInfer,
    StartLoad,
    StartUnload,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome
from clockwork_async.logs import request_extra
from clockwork_async.runtime.actions import ActionListener, Actions
from clockwork_async.runtime.batching import BadInput, validate_request
from clockwork_async.runtime.config import RuntimeConfig
from clockwork_async.runtime.dispatch import CoreRunner
from clockwork_async.runtime.executor_link import ExecutorLink
from clockwork_async.runtime.executors import ExecutorPool
from clockwork_async.runtime.hop import judge
from clockwork_async.runtime.models import (
    RegisteredModel,
    Registration,
    drop_everywhere,
    register_everywhere,
)
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import ModelSource, RegistrationError
from clockwork_async.runtime.requests import (
    InferOutcome,
    PendingRequest,
    RequestBook,
)
from clockwork_async.runtime.snapshot import (
    DriverSnapshot,
    ExecutorRecord,
    model_snapshot,
)
from clockwork_async.runtime.supervisor import Supervisor
from clockwork_async.runtime.timers import BusyPoll, LagProbe, WakeTimer

log = logging.getLogger(__name__)

__all__ = ["Driver", "InferOutcome", "RegisteredModel", "RegistrationError", "RuntimeConfig"]


class DriverState(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"  # new requests are refused; outstanding ones finish
    CLOSED = "closed"


_MOVES = {
    DriverState.RUNNING: {DriverState.DRAINING, DriverState.CLOSED},
    DriverState.DRAINING: {DriverState.CLOSED},
    DriverState.CLOSED: set(),
}


OutcomeListener = Callable[[str, InferOutcome], None]  # (model, outcome)
ExecutorListener = Callable[[str, bool, str], None]  # (executor id, up, reason)


class Driver:
    """The controller core, executor links and requests, on one asyncio loop."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        now_ns: Callable[[], int] = time.monotonic_ns,
        runtime: RuntimeConfig | None = None,
        controller: Controller | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime or RuntimeConfig()
        self._now_ns = now_ns
        controller = controller if controller is not None else Controller(config)
        self._runner = CoreRunner(
            controller,
            now_ns,
            self._perform,
            self._after_event,
            defer=_call_soon,
            performed=self._actions_performed,
        )
        self._feed = self._runner.feed
        self._state = DriverState.RUNNING
        self._book = RequestBook()
        self._models: dict[str, RegisteredModel] = {}
        self._registering: dict[str, ModelSource] = {}
        self._pool = ExecutorPool(
            self.runtime.link,
            now_ns,
            known_models=self._known_models,
            joined=self._executor_joined,
            left=self._executor_left,
        )
        self._request_ids = itertools.count(1)
        self._timer = WakeTimer(
            self._on_wake,
            now_ns=now_ns,
            arm_early_ns=self.runtime.timer_arm_early_ns,
            spin_below_ns=self.runtime.timer_spin_below_ns,
        )
        self._lag = LagProbe(interval_s=self.runtime.lag_probe_interval_s, now_ns=now_ns)
        self._poll = BusyPoll(now_ns=now_ns)  # off until `busy_poll`
        self._drained = asyncio.Event()
        self._idle_models: dict[str, asyncio.Event] = {}
        self.outcome_listeners: list[OutcomeListener] = []
        self.action_listeners: list[ActionListener] = []
        self.executor_listeners: list[ExecutorListener] = []
        self._actions = Actions(
            self._book, self._pool, self._models, self._feed, now_ns, self.action_listeners
        )

    # --- executors ------------------------------------------------------------------------

    async def attach_executor(self, executor_id: str, address: str, *, token: str = "") -> None:
        """Connect to an executor and keep it connected; returns once it joined the core.

        Raises ValueError for a duplicate id, LinkError if the first connection failed.
        """
        self._start()
        await self._pool.attach(executor_id, address, token=token)

    async def detach_executor(self, executor_id: str) -> None:
        """Stop using an executor: its work is re-planned or answered. Raises KeyError."""
        await self._pool.detach(executor_id)

    async def attach_supervised(self, supervisor: Supervisor) -> None:
        """Attach every executor of a started `Supervisor`; restarted ones reconnect at once,
        and one whose link fails (dead, hung) is killed to be restarted. Raises LinkError."""
        self._start()
        await self._pool.attach_supervised(supervisor)

    def executor_restarted(self, executor_id: str, address: str) -> None:
        """A local executor's process was restarted and is ready at ``address``: reconnect
        now rather than after the link's backoff."""
        self._pool.restarted(executor_id, address)

    def _known_models(self) -> dict[str, ModelSource]:
        known = {name: model.source for name, model in self._models.items()}
        known.update(self._registering)
        return known

    def _executor_joined(self, record: ExecutorRecord) -> None:
        assert record.link is not None
        info = record.link.info
        record.loaded &= self._models.keys()
        loaded = tuple(sorted(record.loaded))
        self._feed(
            ExecutorJoined(
                record.executor_id, info.kind, info.pages_total, info.page_bytes, loaded=loaded
            )
        )
        _call_all(self.executor_listeners, record.executor_id, True, "joined")

    def _executor_left(self, record: ExecutorRecord, reason: str) -> None:
        for action in self._book.actions_of(record.executor_id):
            self._book.finish_action(action.action_id)
            self._model_action_done(action.model)
        self._actions.way_there.pop(record.executor_id, None)  # a re-join measures afresh
        self._feed(ExecutorLeft(record.executor_id, reason))
        _call_all(self.executor_listeners, record.executor_id, False, reason)

    # --- models -----------------------------------------------------------------------------

    async def register_model(
        self,
        name: str,
        path: str,
        *,
        batch_sizes: Sequence[int] = (),
        group: str = "",
        default_slo_ns: int = 100_000_000,
        profile: RegistrationProfile | None = None,
    ) -> RegisteredModel:
        """Register ``path`` as model ``name`` on every executor, profile it where ``profile``
        lacks the executors' kinds, then hand it to the core. Returns the RegisteredModel
        (its ``profile`` is what to cache). Raises RegistrationError."""
        self._start()
        if name in self._models or name in self._registering:
            raise RegistrationError(f"model {name!r} is already registered")
        source = ModelSource(path, tuple(batch_sizes))
        self._registering[name] = source
        registration = Registration(name, source, group, default_slo_ns, profile)
        try:
            model = await register_everywhere(
                registration,
                self._pool.joined_links(),
                self.runtime.profiler,
                self._executor_now_ns,
            )
        except BaseException:
            await drop_everywhere(name, self._pool.joined_links())
            raise
        finally:
            del self._registering[name]
        self._models[name] = model
        self._feed(ModelRegistered(model.spec()))
        return model

    def _executor_now_ns(self, link: ExecutorLink) -> int:
        return link.clock.to_executor_ns(self._now_ns())

    async def unregister_model(self, name: str) -> None:
        """Stop serving ``name``: queued requests are answered ``unknown_model`` by the core,
        running ones finish; then it is unloaded and unregistered everywhere. Raises KeyError."""
        if name not in self._models:
            raise KeyError(f"model {name!r} is not registered")
        del self._models[name]
        self._feed(ModelUnregistered(name))
        await self._wait_model_idle(name)
        await drop_everywhere(name, self._pool.joined_links())
        for record in self._pool.records.values():
            record.loaded.discard(name)

    async def _wait_model_idle(self, name: str) -> None:
        while self._book.actions_for_model(name):
            event = self._idle_models.setdefault(name, asyncio.Event())
            await event.wait()
            self._idle_models.pop(name, None)

    def _model_action_done(self, model: str) -> None:
        event = self._idle_models.get(model)
        if event is not None and not self._book.actions_for_model(model):
            event.set()

    def models(self) -> dict[str, RegisteredModel]:
        return dict(self._models)

    # --- requests ---------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_ns: int,
        on_reply: Callable[[InferOutcome], None],
    ) -> int:
        """Accept a request (one row per input) due by ``deadline_ns`` (controller clock).

        Returns its id. ``on_reply`` is called exactly once, possibly before this returns. The
        inputs must not be changed until then (they may go out without a copy).
        """
        request_id = next(self._request_ids)
        now_ns = self._now_ns()
        request = PendingRequest(request_id, model, inputs, on_reply, now_ns, deadline_ns)
        served = self._models.get(model)
        if self._state is not DriverState.RUNNING:
            self._reject(request, Outcome.SHUTTING_DOWN, "the server is shutting down")
        elif served is None:
            self._reject(request, Outcome.UNKNOWN_MODEL, f"model {model!r} is not registered")
        else:
            try:
                validate_request(model, served.inputs, served.batch_sizes, inputs)
            except BadInput as error:
                self._reject(request, Outcome.BAD_INPUT, str(error))
            else:
                self._start()
                self._book.add_request(request)
                self._actions.relieve(now_ns)  # nothing measured for a while: forget tails
                core_deadline_ns = deadline_ns - self._actions.return_hop.estimate_ns
                self._runner.feed_arrival(RequestArrived(request_id, model, core_deadline_ns))
        return request_id

    def flush_arrivals(self) -> None:
        """Schedule the requests submitted so far now, together, rather than at the end of
        this loop round (a caller that knows no more are coming: its read is done)."""
        self._runner.flush()

    def cancel(self, request_id: int) -> None:
        """Ask the core to cancel a request; it is answered ``cancelled`` unless it is already
        running (then its result still comes). Unknown or answered ids are ignored."""
        if self._book.request(request_id) is not None:
            self._feed(RequestCancelled(request_id))

    def _reject(self, request: PendingRequest, outcome: Outcome, message: str) -> None:
        now_ns = self._now_ns()
        self._deliver(request, self._book.rejection(request, outcome, message, now_ns), now_ns)

    # --- the core ------------------------------------------------------------------------------

    def _after_event(self, event: Event) -> None:
        if isinstance(event, ActionFinished):  # its replies are out: its outputs can go
            action = self._book.finish_action(event.action_id)
            if action is not None:
                self._model_action_done(action.model)

    def _perform(self, command: Command, now_ns: int) -> int:
        """Carry out one command; returns ns spent in callers' callbacks."""
        if isinstance(command, StartInfer):
            self._actions.start_infer(command, now_ns)
        elif isinstance(command, Reply):
            return self._reply(command)
        elif isinstance(command, WakeAt):
            self._timer.arm(command.time_ns)
        elif isinstance(command, StartLoad | StartUnload):
            self._actions.start_weights(command, now_ns)
        else:
            log.error("unknown command %r", command)
        return 0

    def _on_wake(self) -> None:
        self._feed(Tick())

    def _actions_performed(self) -> None:
        self._actions.flush()
        self._poll.touch()  # a result or the next request is likely soon: do not sleep

    # --- replies ----------------------------------------------------------------------------

    def _reply(self, reply: Reply) -> int:
        request = self._book.pop_request(reply.request_id)
        if request is None:
            log.debug("reply to unknown request %d (%s) ignored", reply.request_id, reply.outcome)
            return 0
        now_ns = self._now_ns()
        outcome = self._book.outcome(request, reply, now_ns)
        started_ns = time.perf_counter_ns()
        self._deliver(request, outcome, now_ns)
        return time.perf_counter_ns() - started_ns

    def _deliver(self, request: PendingRequest, outcome: InferOutcome, now_ns: int) -> None:
        """The one way out for an answer, read at ``now_ns``: never ``ok`` past its deadline."""
        judged = judge(outcome, request.deadline_ns, now_ns)
        if judged.outcome is Outcome.LATE and outcome.outcome is Outcome.OK:
            log.warning("%s", judged.message, extra=request_extra(request.request_id))
        outcome = judged
        self._book.count(outcome.outcome)
        _call_quietly(request.on_reply, outcome)
        _call_all(self.outcome_listeners, request.model, outcome)
        if self._state is DriverState.DRAINING and not self._book.request_count:
            self._drained.set()

    # --- lifecycle ---------------------------------------------------------------------------

    def _enter(self, state: DriverState) -> None:
        """The one state transition. Raises RuntimeError for a move that cannot happen."""
        if state not in _MOVES[self._state]:
            raise RuntimeError(f"driver cannot go from {self._state} to {state}")
        self._state = state

    def _start(self) -> None:
        if not self._lag.running and self._state is not DriverState.CLOSED:
            self._lag.start()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (``shutting_down``); wait up to ``timeout_s`` for the outstanding
        ones, then answer the rest ``shutting_down``."""
        if self._state is DriverState.RUNNING:
            self._enter(DriverState.DRAINING)
            self._feed(Shutdown())
        if self._book.request_count:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout_s)
        self._answer_all(Outcome.SHUTTING_DOWN, "the server is shutting down")

    def _answer_all(self, outcome: Outcome, message: str) -> None:
        for request in self._book.pop_all_requests():
            now_ns = self._now_ns()
            self._deliver(request, self._book.rejection(request, outcome, message, now_ns), now_ns)
            self._feed(RequestCancelled(request.request_id))  # the core forgets it

    def busy_poll(self, window_ns: int) -> None:
        """After each handling, keep the loop polling its sockets for ``window_ns`` instead of
        sleeping (0: off). Only for a controller with a CPU of its own: the polling uses it."""
        self._poll.set_window(window_ns)

    async def close(self) -> None:
        """Answer what is left ``shutting_down``, stop timers and close every link."""
        if self._state is DriverState.CLOSED:
            return
        self._enter(DriverState.CLOSED)
        self._answer_all(Outcome.SHUTTING_DOWN, "the server is shutting down")
        self._timer.cancel()
        self._poll.cancel()
        self._lag.stop()
        await self._pool.close()

    # --- observation ---------------------------------------------------------------------------

    def snapshot(self) -> DriverSnapshot:
        """Executors, models, queued/running requests, outcome and core counts, prediction
        errors, loop lag, cost."""
        self._runner.flush()  # held arrivals count as queued
        submitted = self._book.submitted
        core = self._runner.controller
        records = self._pool.records.values()
        queued = core.queue_depth()
        return DriverSnapshot(
            state=self._state.value,
            executors=tuple(r.snapshot(len(self._book.actions_of(r.executor_id))) for r in records),
            models=tuple(
                model_snapshot(m, records, core.queue_depth(m.name)) for m in self._models.values()
            ),
            outstanding=self._book.request_count,
            queued=queued,
            running=core.pending() - queued,
            submitted=submitted,
            outcomes=dict(self._book.outcomes),
            core_counters=dict(core.stats(with_executors=False).counters),
            prediction_errors=self._actions.prediction_errors.snapshot(),
            loop_lag=self._lag.stats(),
            timer=self._timer.stats(),
            busy_poll=self._poll.stats(),
            core_ns_per_request=self._runner.core_ns / submitted if submitted else 0.0,
            driver_ns_per_request=self._runner.dispatch_ns / submitted if submitted else 0.0,
            send_ns_per_request=self._actions.send_ns / submitted if submitted else 0.0,
        )


def _call_soon(callback: Callable[[], None]) -> None:
    """Run ``callback`` at the end of this loop round (at once when no loop runs)."""
    try:
        asyncio.get_running_loop().call_soon(callback)
    except RuntimeError:
        callback()


def _call_quietly(callback: Callable[..., object], *args: object) -> None:
    """Run a caller's callback; its exception is logged, never propagated into the driver."""
    try:
        callback(*args)
    except Exception:
        log.exception("a callback raised")


def _call_all(listeners: Sequence[Callable[..., object]], *args: object) -> None:
    for listener in listeners:
        _call_quietly(listener, *args)
