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
    LaneBroker,
    ModelSource,
    RegistrationError,
    profile_model,
    register_on,
    unregister_on,
)
from clockwork_async.wire.messages import ModelInfo, TensorSpec

log = logging.getLogger(__name__)

MS_NS = 1_000_000
DEFAULT_SLO_NS = 100 * MS_NS
SLO_PER_B1 = 5  # a slow model's derived default SLO, in batch-1 execute times


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
    default_slo_ns: int = DEFAULT_SLO_NS
    cached: RegistrationProfile | None = None
    derive_slo: bool = False  # raise default_slo_ns for a slow model (`derived_slo_ns`)


async def register_everywhere(
    registration: Registration,
    links: Sequence[ExecutorLink],
    profiler: ProfilerConfig,
    broker: LaneBroker,
    now_ns: Callable[[], int],
    on_stage: Callable[[str], None] = lambda stage: None,
) -> RegisteredModel:
    """Register on every link, profile what the cached profile lacks, validate the spec.

    A link that goes away meanwhile is skipped (it registers the model when it re-joins).
    Raises RegistrationError (the caller drops what was registered).
    """
    name, source = registration.name, registration.source
    if not links:
        raise RegistrationError(f"cannot register {name!r}: no executor is up")
    wait_s = profiler.max_profile_ns / 1e9  # reading a file has no prediction: the cap
    replies = await asyncio.gather(
        *(register_on(link, name, source, wait_s, broker) for link in links),
        return_exceptions=True,
    )
    for reply in replies:
        if isinstance(reply, TimeoutError):
            raise RegistrationError(f"cannot register {name!r}: no answer within {wait_s:.0f} s")
        if isinstance(reply, BaseException) and not isinstance(reply, LinkError):
            raise reply  # a refusal (RegistrationError) or a bug; a vanished link is not
    infos = [reply for reply in replies if isinstance(reply, ModelInfo)]
    if not infos:
        raise RegistrationError(f"cannot register {name!r}: every executor went away")
    info = infos[0]
    registered = [link for link in links if link.up and name in link.registered]
    if registration.cached is None or {link.info.kind for link in registered} - set(
        registration.cached.kinds
    ):
        on_stage("profiling")
    profile = await profile_model(
        name, info, registered, profiler, broker, now_ns, registration.cached, on_stage
    )
    model = _model(registration, info, profile, max(i.pages_needed for i in infos))
    try:
        validate_spec(model.spec())
    except InvalidEvent as error:
        raise RegistrationError(f"cannot register {name!r}: {error}") from None
    return model


def derived_slo_ns(default_slo_ns: int, profile: RegistrationProfile) -> int:
    """The default SLO of a model whose model.toml sets none: ``default_slo_ns``, or
    `SLO_PER_B1` times its batch-1 execute time on its slowest kind, rounded up to a
    millisecond, when that is longer (a model slower than its SLO would refuse every
    request)."""
    b1 = profile.batch_sizes[0]
    slowest_ns = max(kind.execute_ns[b1] for kind in profile.kinds.values())
    own_ns = -(-SLO_PER_B1 * slowest_ns // MS_NS) * MS_NS
    return max(default_slo_ns, own_ns)


def _model(
    registration: Registration, info: ModelInfo, profile: RegistrationProfile, pages: int
) -> RegisteredModel:
    slo_ns = registration.default_slo_ns
    if registration.derive_slo:
        slo_ns = derived_slo_ns(slo_ns, profile)
    return RegisteredModel(
        name=registration.name,
        path=registration.source.path,
        group=registration.group,
        default_slo_ns=slo_ns,
        batch_sizes=profile.batch_sizes,
        inputs=info.inputs,
        outputs=info.outputs,
        weights_bytes=info.weights_bytes,
        weights_pages=pages,
        profile=profile,
        requested_batch_sizes=registration.source.batch_sizes,
        requested_inputs=registration.source.inputs,
    )


async def drop_everywhere(
    name: str, links: Sequence[ExecutorLink], *, anyway: bool = False
) -> None:
    """Unload and unregister ``name`` wherever it is registered (``anyway``: on every link,
    for a registration that may not have answered); failures are logged."""
    for link in links:
        if anyway or name in link.registered:
            try:
                await unregister_on(link, name)
            except (RegistrationError, LinkError, TimeoutError) as error:
                log.warning("dropping %r on %s: %s", name, link.executor_id, error)
