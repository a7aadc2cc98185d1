"""Model registration on executor links: register, unregister, reconcile on (re)join, profile
(each profiling LOAD and INFER on a lane the core reserved for it, and the LOAD's pages held in
the core from the first LOAD to the last UNLOAD: `LaneBroker`).

Every call on a link goes through ``link.lock``, and ``link.registered`` records what is
registered there (name -> the ModelInfo it answered, or None when found already registered),
so the join path and a registration running at the same time never register a model twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from clockwork_async.core.events import LaneReserved, ModelProfile
from clockwork_async.runtime.executor_link import ExecutorLink, LinkError
from clockwork_async.runtime.profiler import (
    Build,
    ProfilerConfig,
    ProfilingError,
    ProfilingTarget,
    RegistrationProfile,
    measure,
)
from clockwork_async.wire.messages import (
    ActionResult,
    ErrorCode,
    GetState,
    Message,
    ModelInfo,
    RegisterModel,
    State,
    TensorSpec,
    Unload,
    UnregisterModel,
)

log = logging.getLogger(__name__)

REGISTER_HOLD_NS = 50_000_000  # a RegisterModel's first guess: extended until it answers

_GONE = frozenset({ErrorCode.NOT_LOADED.value, ErrorCode.UNKNOWN_MODEL.value})


class RegistrationError(RuntimeError):
    """A model could not be registered (bad file, no executor, profiling failed)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What it takes to register a model on an executor."""

    path: str
    batch_sizes: tuple[int, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()  # declared shapes (model.toml); empty: the file's


async def call(
    link: ExecutorLink, make: Callable[[int], Message], timeout_s: float | None = None
) -> Message:
    """Send ``make(action_id)`` on ``link`` and return its reply. Raises LinkDown, TimeoutError
    (after ``timeout_s``, else the link's call timeout)."""
    action_id = link.next_call_id()
    return await link.call(make(action_id), action_id, timeout_s)


async def register_on(
    link: ExecutorLink,
    name: str,
    source: ModelSource,
    timeout_s: float | None = None,
    broker: LaneBroker | None = None,
) -> ModelInfo | None:
    """Register ``name`` on ``link`` unless it is already, its execute lane held by
    ``broker`` meanwhile (a backend may run the model while registering it: ONNX Runtime's
    prepacking choice, docs/architecture.md). Returns the executor's ModelInfo (None if it
    was registered before). Raises RegistrationError, LinkDown, TimeoutError (no answer
    within ``timeout_s``: the profiling cap, as reading a file has no prediction)."""
    async with link.lock:
        if name in link.registered:
            return link.registered[name]

        def message(action_id: int) -> RegisterModel:
            return RegisterModel(action_id, name, source.path, source.batch_sizes, source.inputs)

        with _held(broker, link.executor_id, "execute", REGISTER_HOLD_NS):
            reply = await call(link, message, timeout_s)
        if isinstance(reply, ModelInfo):
            link.registered[name] = reply
            return reply
        detail = f"{reply.code}: {reply.message}" if isinstance(reply, ActionResult) else reply
        raise RegistrationError(
            f"executor {link.executor_id} cannot register {name!r} from {source.path!r}: {detail}"
        )


async def unregister_on(link: ExecutorLink, name: str) -> None:
    """Unload (if loaded) and unregister ``name`` on ``link``; what is already gone is fine.
    Raises RegistrationError for another refusal, LinkDown, TimeoutError."""
    async with link.lock:
        await _unregister_locked(link, name)


async def _unregister_locked(link: ExecutorLink, name: str) -> None:
    for make in (lambda i: Unload(i, name), lambda i: UnregisterModel(i, name)):
        reply = await call(link, make)
        if isinstance(reply, ActionResult) and reply.code and reply.code not in _GONE:
            raise RegistrationError(
                f"executor {link.executor_id} cannot drop {name!r}: {reply.code}: {reply.message}"
            )
    link.registered.pop(name, None)


async def reconcile(link: ExecutorLink, known: Mapping[str, ModelSource]) -> tuple[str, ...]:
    """Bring a (re)joined executor in line with the controller's models: drop models the
    controller does not know, register the missing ones. Returns the known models already
    loaded there. A model that fails to register is logged and left out (the core's LOAD of
    it is then refused, and the core plans around that). Raises LinkDown, TimeoutError."""
    async with link.lock:
        state = await call(link, GetState)
        if not isinstance(state, State):
            raise RegistrationError(f"executor {link.executor_id}: GetState answered {state}")
        link.registered = {name: None for name in state.registered if name in known}
        for stale in sorted(set(state.registered) - known.keys()):
            log.info("executor %s: dropping stale model %r", link.executor_id, stale)
            await _unregister_locked(link, stale)
    for name, source in list(known.items()):
        try:
            await register_on(link, name, source)
        except RegistrationError as error:
            log.error("%s", error)
    return tuple(name for name in state.loaded if name in link.registered)


@contextlib.contextmanager
def _held(broker: LaneBroker | None, executor_id: str, lane: str, hold_ns: int) -> Iterator[None]:
    """Hold ``lane`` of an executor while the block runs (the core extends the hold past
    ``hold_ns`` until it is released); no hold without a broker or when refused."""
    reserved = broker.reserve(executor_id, lane, hold_ns) if broker is not None else None
    try:
        yield
    finally:
        if broker is not None and reserved is not None and not reserved.refused:
            broker.release(executor_id, reserved.reservation_id)


# --- profiling --------------------------------------------------------------------------------


class LaneBroker(Protocol):
    """Where lanes are reserved for profiling actions: the dispatcher, in front of the core
    (`ReserveLane`, core/reservations.py)."""

    def reserve(
        self, executor_id: str, lane: str, duration_ns: int, pages: int = 0
    ) -> LaneReserved: ...

    def release(self, executor_id: str, reservation_id: int, end_ns: int = 0) -> None: ...


async def profile_model(
    name: str,
    info: ModelInfo,
    links: Sequence[ExecutorLink],
    config: ProfilerConfig,
    broker: LaneBroker,
    now_ns: Callable[[], int],
    cached: RegistrationProfile | None = None,
    progress: Callable[[str], None] = lambda what: None,
) -> RegistrationProfile:
    """Measure ``name`` on one executor of every kind among ``links`` that ``cached`` lacks,
    each action on a lane ``broker`` reserved for it, telling ``progress`` what runs.

    Returns the merged profile. Raises RegistrationError if a kind could not be profiled.
    """
    profile = cached
    by_kind: dict[str, list[ExecutorLink]] = {}
    for link in links:
        by_kind.setdefault(link.info.kind, []).append(link)
    for kind, candidates in sorted(by_kind.items()):
        if profile is not None and kind in profile.kinds:
            continue
        measured = await _profile_kind(
            name, info, kind, candidates, config, Profiling(broker, now_ns, progress)
        )
        profile = measured if profile is None else profile.merged(measured)
    if profile is None:
        raise RegistrationError(f"no executor to profile {name!r} on")
    offered = tuple(b for b in profile.batch_sizes if b in info.batch_sizes)
    if not offered:
        raise RegistrationError(
            f"model {name!r}: its profile offers batch sizes {profile.batch_sizes}, "
            f"but the executors support {info.batch_sizes}"
        )
    if offered == profile.batch_sizes:
        return profile
    return RegistrationProfile(offered, profile.kinds)


@dataclass(frozen=True, slots=True)
class Profiling:
    """What profiling runs with: the lanes' broker, the controller's clock, a progress hook."""

    broker: LaneBroker
    now_ns: Callable[[], int]
    progress: Callable[[str], None]


def _target(link: ExecutorLink, profiling: Profiling) -> ProfilingTarget:
    broker, now_ns = profiling.broker, profiling.now_ns

    async def run(lane: str, reserve_ns: int, wait_ns: int, build: Build) -> Message:
        wait_s = wait_ns / 1e9
        if not lane:  # an UNLOAD: no lane of the core's to hold
            message = build(0, 0)
            return await link.call(message, _action_id(message), timeout_s=wait_s)
        reserved = broker.reserve(link.executor_id, lane, reserve_ns)
        if reserved.refused:
            raise ProfilingError(f"no {lane} lane reserved: {reserved.refused}")
        end_ns = 0
        try:
            message = build(
                link.clock.to_executor_ns(now_ns()), link.clock.to_executor_ns(reserved.start_ns)
            )
            try:
                reply = await link.call(message, _action_id(message), timeout_s=wait_s)
            except TimeoutError:
                raise ProfilingError(
                    f"no reply from {link.executor_id} within {wait_s:.1f} s "
                    f"({lane} lane reserved for {reserve_ns / 1e6:.0f} ms)"
                ) from None
            if isinstance(reply, ActionResult) and reply.end_ns:
                end_ns = link.clock.to_controller_ns(reply.end_ns)
            return reply
        except asyncio.CancelledError:
            # Cut short (a cancel, a stop): the action may still run there; the lane stays
            # held until its predicted end at least.
            end_ns = max(reserved.end_ns, now_ns())
            raise
        finally:
            broker.release(link.executor_id, reserved.reservation_id, end_ns)

    def progress(what: str) -> None:
        profiling.progress(f"{what} on {link.executor_id}")

    return ProfilingTarget(run, link.next_call_id, now_ns, progress)


def _action_id(message: Message) -> int:
    return int(getattr(message, "action_id"))  # noqa: B009


async def _profile_kind(
    name: str,
    info: ModelInfo,
    kind: str,
    candidates: Sequence[ExecutorLink],
    config: ProfilerConfig,
    profiling: Profiling,
) -> RegistrationProfile:
    errors = []
    for link in candidates:
        try:
            model_profile, sizes = await _measure_on(name, info, link, config, profiling)
        except (ProfilingError, LinkError) as error:
            errors.append(f"{link.executor_id}: {error}")
            continue
        log.info("profiled %r on %s (%s): %s", name, link.executor_id, kind, model_profile)
        return RegistrationProfile(sizes, {kind: model_profile})
    raise RegistrationError(f"cannot profile {name!r} on kind {kind!r}: {'; '.join(errors)}")


async def _measure_on(
    name: str,
    info: ModelInfo,
    link: ExecutorLink,
    config: ProfilerConfig,
    profiling: Profiling,
) -> tuple[ModelProfile, tuple[int, ...]]:
    """`measure` on one executor, its LOAD's pages held in the core meanwhile. Raises
    ProfilingError."""
    broker = profiling.broker
    pages = broker.reserve(link.executor_id, "", 0, info.pages_needed)
    if pages.refused:
        raise ProfilingError(f"no pages for its LOAD: {pages.refused}")
    try:
        target = _target(link, profiling)
        return await measure(target, name, info.inputs, info.batch_sizes, config)
    finally:
        broker.release(link.executor_id, pages.reservation_id)
