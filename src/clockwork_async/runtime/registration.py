"""Model registration on executor links: register, unregister, reconcile on (re)join, profile.

Every call on a link goes through ``link.lock``, and ``link.registered`` records what is
registered there (name -> the ModelInfo it answered, or None when found already registered),
so the join path and a registration running at the same time never register a model twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from clockwork_async.runtime.executor_link import ExecutorLink
from clockwork_async.runtime.profiler import (
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

_GONE = frozenset({ErrorCode.NOT_LOADED.value, ErrorCode.UNKNOWN_MODEL.value})


class RegistrationError(RuntimeError):
    """A model could not be registered (bad file, no executor, profiling failed)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What it takes to register a model on an executor."""

    path: str
    batch_sizes: tuple[int, ...] = ()
    inputs: tuple[TensorSpec, ...] = ()  # declared shapes (model.toml); empty: the file's


async def call(link: ExecutorLink, make: Callable[[int], Message]) -> Message:
    """Send ``make(action_id)`` on ``link`` and return its reply. Raises LinkDown, TimeoutError."""
    action_id = link.next_call_id()
    return await link.call(make(action_id), action_id)


async def register_on(link: ExecutorLink, name: str, source: ModelSource) -> ModelInfo | None:
    """Register ``name`` on ``link`` unless it is already. Returns the executor's ModelInfo
    (None if it was registered before). Raises RegistrationError, LinkDown, TimeoutError."""
    async with link.lock:
        if name in link.registered:
            return link.registered[name]
        reply = await call(
            link, lambda i: RegisterModel(i, name, source.path, source.batch_sizes, source.inputs)
        )
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


# --- profiling --------------------------------------------------------------------------------


async def profile_model(
    name: str,
    info: ModelInfo,
    links: Sequence[ExecutorLink],
    config: ProfilerConfig,
    executor_now_ns: Callable[[ExecutorLink], int],
    cached: RegistrationProfile | None = None,
) -> RegistrationProfile:
    """Measure ``name`` on one executor of every kind among ``links`` that ``cached`` lacks.

    Returns the merged profile. Raises RegistrationError if a kind could not be profiled.
    """
    profile = cached
    by_kind: dict[str, list[ExecutorLink]] = {}
    for link in links:
        by_kind.setdefault(link.info.kind, []).append(link)
    for kind, candidates in sorted(by_kind.items()):
        if profile is not None and kind in profile.kinds:
            continue
        measured = await _profile_kind(name, info, kind, candidates, config, executor_now_ns)
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


def _target(link: ExecutorLink, executor_now_ns: Callable[[ExecutorLink], int]) -> ProfilingTarget:
    async def act(message: Message) -> Message:
        return await link.call(message, getattr(message, "action_id"))  # noqa: B009

    return ProfilingTarget(act, link.next_call_id, lambda: executor_now_ns(link))


async def _profile_kind(
    name: str,
    info: ModelInfo,
    kind: str,
    candidates: Sequence[ExecutorLink],
    config: ProfilerConfig,
    executor_now_ns: Callable[[ExecutorLink], int],
) -> RegistrationProfile:
    errors = []
    for link in candidates:
        target = _target(link, executor_now_ns)
        try:
            async with link.lock:
                model_profile, sizes = await measure(
                    target, name, info.inputs, info.batch_sizes, config
                )
        except ProfilingError as error:
            errors.append(f"{link.executor_id}: {error}")
            continue
        log.info("profiled %r on %s (%s): %s", name, link.executor_id, kind, model_profile)
        return RegistrationProfile(sizes, {kind: model_profile})
    raise RegistrationError(f"cannot profile {name!r} on kind {kind!r}: {'; '.join(errors)}")
