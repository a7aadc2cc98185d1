"""The runtime's façade: a `Dispatcher` (the core, the request book, joined links) beside an
`ExecutorPool` (links kept connected) and the registration jobs that put models on executors.

The façade owns no request state of its own: requests go straight to the dispatcher (the
client API is handed `Driver.dispatcher` as its request path), the pool reports joins and
leaves to the dispatcher, and a registration ends by handing the model to it. What it keeps is
the set of names being registered (so that a joining executor registers them too).

Invariant: `snapshot` reads the dispatcher, its book, the core's counters and the pool; it never
runs the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.runtime.config import RuntimeConfig
from clockwork_async.runtime.dispatch_state import (
    ActionListener,
    ExecutorListener,
    OutcomeListener,
)
from clockwork_async.runtime.dispatcher import Dispatcher
from clockwork_async.runtime.executors import ExecutorPool, ExecutorRecord
from clockwork_async.runtime.models import (
    RegisteredModel,
    Registration,
    drop_everywhere,
    register_everywhere,
)
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import ModelSource, RegistrationError
from clockwork_async.runtime.snapshot import (
    DriverSnapshot,
    ExecutorSnapshot,
    ModelSnapshot,
)
from clockwork_async.runtime.supervisor import Supervisor
from clockwork_async.wire.messages import TensorSpec

log = logging.getLogger(__name__)

__all__ = ["Driver", "InferOutcome", "RegisteredModel", "RegistrationError", "RuntimeConfig"]


class Driver:
    """The controller core, executor links and requests, on one asyncio loop."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        now_ns: Callable[[], int] = time.monotonic_ns,
        unix_now_ns: Callable[[], int] = time.time_ns,
        runtime: RuntimeConfig | None = None,
        controller: Controller | None = None,
    ) -> None:
        self.config = config
        self.runtime = runtime or RuntimeConfig()
        self._now_ns = now_ns
        self.dispatcher = Dispatcher(
            config, self.runtime, now_ns=now_ns, unix_now_ns=unix_now_ns, controller=controller
        )
        self._registering: dict[str, ModelSource] = {}
        self._pool = ExecutorPool(
            self.runtime.link, now_ns, known_models=self._known_models, events=self.dispatcher
        )

    @property
    def outcome_listeners(self) -> list[OutcomeListener]:
        return self.dispatcher.outcome_listeners

    @property
    def action_listeners(self) -> list[ActionListener]:
        return self.dispatcher.action_listeners

    @property
    def executor_listeners(self) -> list[ExecutorListener]:
        return self.dispatcher.executor_listeners

    # --- executors ------------------------------------------------------------------------

    async def attach_executor(self, executor_id: str, address: str, *, token: str = "") -> None:
        """Connect to an executor and keep it connected; returns once it joined the core.

        Raises ValueError for a duplicate id, LinkError if the first connection failed.
        """
        await self._pool.attach(executor_id, address, token=token)

    async def detach_executor(self, executor_id: str) -> None:
        """Stop using an executor: its work is re-planned or answered. Raises KeyError."""
        await self._pool.detach(executor_id)

    async def attach_supervised(self, supervisor: Supervisor) -> None:
        """Attach every executor of a started `Supervisor`; restarted ones reconnect at once,
        and one whose link fails (dead, hung) is killed to be restarted. Raises LinkError."""
        await self._pool.attach_supervised(supervisor)

    def executor_restarted(self, executor_id: str, address: str) -> None:
        """A local executor's process was restarted and is ready at ``address``: reconnect
        now rather than after the link's backoff."""
        self._pool.restarted(executor_id, address)

    def _known_models(self) -> dict[str, ModelSource]:
        known = {name: model.source for name, model in self.dispatcher.models.items()}
        known.update(self._registering)
        return known

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
        inputs: Sequence[TensorSpec] = (),
        derive_slo: bool = False,
        on_stage: Callable[[str], None] = lambda stage: None,
    ) -> RegisteredModel:
        """Register ``path`` as model ``name`` on every executor (its inputs at the declared
        ``inputs`` shapes, if any), profile it where ``profile`` lacks the executors' kinds
        (``on_stage("profiling")`` then), then hand it to the dispatcher. Returns the
        RegisteredModel (its ``profile`` is what to cache). Raises RegistrationError. However
        it ends short of that (an error, a cancel), nothing of ``name`` is left on any
        executor."""
        if name in self.dispatcher.models or name in self._registering:
            raise RegistrationError(f"model {name!r} is already registered")
        source = ModelSource(path, tuple(batch_sizes), tuple(inputs))
        self._registering[name] = source
        registration = Registration(name, source, group, default_slo_ns, profile, derive_slo)
        try:
            model = await register_everywhere(
                registration,
                self._pool.joined_links(),
                self.runtime.profiler,
                self.dispatcher,
                self._now_ns,
                on_stage,
            )
        except BaseException:
            # A RegisterModel may still be on its way (cancelled while waiting): unregister on
            # every link, after it in the executor's register lane.
            await asyncio.shield(drop_everywhere(name, self._pool.joined_links(), anyway=True))
            raise
        finally:
            del self._registering[name]
        self.dispatcher.add_model(model)
        return model

    async def unregister_model(self, name: str) -> None:
        """Stop serving ``name``: queued requests are answered ``unknown_model`` by the core,
        running ones finish; then it is unloaded and unregistered everywhere. Raises KeyError."""
        await self.dispatcher.remove_model(name)
        await drop_everywhere(name, self._pool.joined_links())

    def models(self) -> dict[str, RegisteredModel]:
        return self.dispatcher.models

    # --- requests ---------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_ns: int,
        on_reply: Callable[[InferOutcome], None],
    ) -> int:
        """`Dispatcher.submit_by`: a request due by ``deadline_ns`` (monotonic clock)."""
        return self.dispatcher.submit_by(model, inputs, deadline_ns=deadline_ns, on_reply=on_reply)

    def flush_arrivals(self) -> None:
        self.dispatcher.flush()

    def cancel(self, request_id: int) -> None:
        self.dispatcher.cancel(request_id)

    # --- lifecycle ---------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """`Dispatcher.drain`."""
        await self.dispatcher.drain(timeout_s)

    def busy_poll(self, window_ns: int) -> None:
        self.dispatcher.busy_poll(window_ns)

    async def close(self) -> None:
        """Answer what is left ``shutting_down``, stop timers and close every link."""
        self.dispatcher.close()
        await self._pool.close()

    # --- observation ---------------------------------------------------------------------------

    def snapshot(self) -> DriverSnapshot:
        """Executors, models, queued/running requests, outcome and core counts, prediction
        errors, loop lag, cost. Reads only: held arrivals count as queued."""
        dispatcher = self.dispatcher
        book, core = dispatcher.book, dispatcher.controller
        submitted = book.submitted
        queued = core.queue_depth() + dispatcher.held_arrivals
        costs = dispatcher.costs()
        lag, timer, poll = dispatcher.timers()
        return DriverSnapshot(
            state=dispatcher.state,
            executors=tuple(self._executor(r) for r in self._pool.records.values()),
            models=tuple(
                self._model(m, core.queue_depth(m.name) + dispatcher.held_arrivals_of(m.name))
                for m in dispatcher.models.values()
            ),
            outstanding=book.request_count,
            queued=queued,
            running=max(0, core.pending() - core.queue_depth()),
            submitted=submitted,
            outcomes=dict(book.outcomes),
            core_counters=dict(core.stats(with_executors=False).counters),
            prediction_errors=dispatcher.prediction_errors().snapshot(),
            loop_lag=lag.stats(),
            timer=timer.stats(),
            busy_poll=poll.stats(),
            core_ns_per_request=costs.core_ns / submitted if submitted else 0.0,
            driver_ns_per_request=costs.dispatch_ns / submitted if submitted else 0.0,
            send_ns_per_request=costs.send_ns / submitted if submitted else 0.0,
            loop_delay_ns=dispatcher.loop_lane.delay_ns(self._now_ns()),
            loop_cost_ns=_loop_cost(dispatcher),
        )

    def _executor(self, record: ExecutorRecord) -> ExecutorSnapshot:
        joined = self.dispatcher.joined(record.executor_id)
        link, keeper = record.link, record.keeper
        pages_total = joined.info.pages_total if joined is not None else 0
        return ExecutorSnapshot(
            executor_id=record.executor_id,
            address=keeper.address if keeper is not None else "",
            up=link is not None and link.up,
            kind=joined.info.kind if joined is not None else "",
            pages_used=pages_total - joined.pages_free if joined is not None else 0,
            pages_total=pages_total,
            loaded=tuple(sorted(joined.loaded)) if joined is not None else (),
            restarts=record.restarts,
            reconnects=max(0, (keeper.connects if keeper is not None else 0) - 1),
            outstanding_actions=len(self.dispatcher.book.actions_of(record.executor_id)),
            clock_offset_ns=link.clock.offset_ns if link is not None else 0,
            clock_error_ns=link.clock.error_bound_ns if link is not None else 0,
            rtt_ns=link.last_rtt_ns if link is not None else 0,
            last_error=keeper.last_error if keeper is not None else "",
        )

    def _model(self, model: RegisteredModel, queued: int) -> ModelSnapshot:
        loaded_on = tuple(
            executor_id
            for executor_id in self._pool.records
            if (joined := self.dispatcher.joined(executor_id)) is not None
            and model.name in joined.loaded
        )
        group = model.group or model.name
        return ModelSnapshot(
            model.name, group, model.batch_sizes, model.weights_pages, loaded_on, queued
        )


def _loop_cost(dispatcher: Dispatcher) -> dict[str, float]:
    cost = dispatcher.loop_lane.cost
    return {"request": cost.request_ns, "byte": cost.byte_ns, "refusal": cost.refusal_ns}
