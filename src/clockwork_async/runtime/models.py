"""Models as the driver serves them, and registering one on every executor.

Invariant: a `RegisteredModel` exists only once its file registered on every executor that was
up (and answered), its profile covers every kind among them, and its spec passed the core's
validation: handing it to the core (ModelRegistered) cannot be refused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clockwork_async.core.errors import InvalidEvent
from clockwork_async.core.events import ModelSpec
from clockwork_async.core.models import validate_spec
from clockwork_async.runtime.executor_link import ExecutorLink, LinkError
from clockwork_async.runtime.profiler import ProfilerConfig, RegistrationProfile
from clockwork_async.runtime.registration import (
    ModelSource,
    RegistrationError,
    profile_model,
    register_on,
    unregister_on,
)
from clockwork_async.wire.messages import ModelInfo, TensorSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    """A model as the driver serves it (one instance; many may share a file)."""

    name: str
    path: str
    group: str
    default_slo_ns: int
    batch_sizes: tuple[int, ...]  # offered (profiled within the maximum)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights_bytes: int
    weights_pages: int
    profile: RegistrationProfile
    requested_batch_sizes: tuple[int, ...] = ()
    requested_inputs: tuple[TensorSpec, ...] = ()  # declared shapes (model.toml)

    @property
    def source(self) -> ModelSource:
        return ModelSource(self.path, self.requested_batch_sizes, self.requested_inputs)

    def spec(self) -> ModelSpec:
        """The core's view of this model."""
        return ModelSpec(
            name=self.name,
            batch_sizes=self.batch_sizes,
            weights_pages=self.weights_pages,
            profiles=dict(self.profile.kinds),
            group=self.group or self.name,
            default_slo_ns=self.default_slo_ns,
        )


@dataclass(frozen=True, slots=True)
class Registration:
    """What to register: a name, its source, and how it is served."""

    name: str
    source: ModelSource
    group: str = ""
    default_slo_ns: int = 100_000_000
    cached: RegistrationProfile | None = None


async def register_everywhere(
    registration: Registration,
    links: Sequence[ExecutorLink],
    profiler: ProfilerConfig,
    executor_now_ns: Callable[[ExecutorLink], int],
) -> RegisteredModel:
    """Register on every link, profile what the cached profile lacks, validate the spec.

    A link that goes away meanwhile is skipped (it registers the model when it re-joins).
    Raises RegistrationError (the caller drops what was registered).
    """
    name, source = registration.name, registration.source
    if not links:
        raise RegistrationError(f"cannot register {name!r}: no executor is up")
    replies = await asyncio.gather(
        *(register_on(link, name, source) for link in links), return_exceptions=True
    )
    for reply in replies:
        if isinstance(reply, BaseException) and not isinstance(reply, LinkError | TimeoutError):
            raise reply  # a refusal (RegistrationError) or a bug; a vanished link is not
    infos = [reply for reply in replies if isinstance(reply, ModelInfo)]
    if not infos:
        raise RegistrationError(f"cannot register {name!r}: every executor went away")
    info = infos[0]
    registered = [link for link in links if link.up and name in link.registered]
    profile = await profile_model(
        name, info, registered, profiler, executor_now_ns, registration.cached
    )
    model = _model(registration, info, profile, max(i.pages_needed for i in infos))
    try:
        validate_spec(model.spec())
    except InvalidEvent as error:
        raise RegistrationError(f"cannot register {name!r}: {error}") from None
    return model


def _model(
    registration: Registration, info: ModelInfo, profile: RegistrationProfile, pages: int
) -> RegisteredModel:
    return RegisteredModel(
        name=registration.name,
        path=registration.source.path,
        group=registration.group,
        default_slo_ns=registration.default_slo_ns,
        batch_sizes=profile.batch_sizes,
        inputs=info.inputs,
        outputs=info.outputs,
        weights_bytes=info.weights_bytes,
        weights_pages=pages,
        profile=profile,
        requested_batch_sizes=registration.source.batch_sizes,
        requested_inputs=registration.source.inputs,
    )


async def drop_everywhere(name: str, links: Sequence[ExecutorLink]) -> None:
    """Unload and unregister ``name`` wherever it is registered; failures are logged."""
    for link in links:
        if name in link.registered:
            try:
                await unregister_on(link, name)
            except (RegistrationError, LinkError, TimeoutError) as error:
                log.warning("dropping %r on %s: %s", name, link.executor_id, error)
