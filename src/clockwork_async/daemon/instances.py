"""Registering a model folder's instances on the driver: each instance (``NAME``, or the
copies ``NAME-0`` ..) once, its profile measured once for all copies and cached by file and
shapes; a model served by shape buckets (core/buckets.py) as one variant per bucket, each
registered on the executors with its inputs at its bucket's lengths and profiled there.

Invariants: the buckets are registered from the largest down, all within one profiling cap
(``profiler.max_profile_ns``, as for a model of one shape): a bucket is profiled only while the
time spent so far plus what the largest bucket's registration took still fits in it (a shorter
bucket's profiling is no longer than the largest's); the rest are seeded by the neighbour rule
(core/buckets.py: the next longer profiled bucket's times) and corrected by their own
measurements once served. A bucket's measured profile is cached under its own key (the file's
hash mixed with its shapes); a seeded one is not cached. Copies share profiles. However a
registration ends short of done, what it registered is unregistered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from clockwork_async.api.service import ServiceError
from clockwork_async.core.buckets import Bucket, neighbour_profiles, variant_name
from clockwork_async.daemon.registration_jobs import Job, JobState
from clockwork_async.models.profile_cache import ProfileCache
from clockwork_async.models.repository import ModelEntry
from clockwork_async.runtime.buckets import BucketedModel
from clockwork_async.runtime.driver import Driver, RegisteredModel
from clockwork_async.runtime.executor_link import LinkError
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import RegistrationError
from clockwork_async.wire.messages import ApiCode

log = logging.getLogger(__name__)

# (the entry at one bucket, the variant's name, a profile to use or None) -> registered
RegisterOne = Callable[[ModelEntry, str, RegistrationProfile | None], Awaitable[RegisteredModel]]
Variants = dict[str, tuple[RegisteredModel, ...]]  # instance -> its variants, smallest first


@dataclass(frozen=True, slots=True)
class Registration:
    """How the daemon registers repository models on its executors."""

    cache: ProfileCache
    machine_for: Callable[[ModelEntry], str]  # profile cache key: CPU, backend, runtime, ...
    budget_bytes: int  # host weights, one copy per content hash
    path_for: Callable[[ModelEntry], str]  # what executors are told to register
    max_concurrent: int = 2  # registration jobs at once (profiler.max_concurrent)


def served_name(instance: str, version: int) -> str:
    """The name the request path serves ``version`` of ``instance`` under."""
    return instance if version == 1 else f"{instance}@v{version}"


class Registrar:
    """Registers the instances of model folders on ``driver`` (`register`)."""

    def __init__(
        self, driver: Driver, registration: Registration, on_change: Callable[[], None]
    ) -> None:
        self._driver = driver
        self._registration = registration
        self._on_change = on_change

    async def register(self, entry: ModelEntry, job: Job) -> tuple[list[RegisteredModel], Variants]:
        """Register every instance of ``entry``; returns the model per instance (a bucketed
        one's largest variant) and, for a bucketed model, every variant per instance.
        Raises ServiceError."""
        if entry.buckets:
            return await self._buckets(entry, job)
        return await self._plain(entry, job), {}

    async def _plain(self, entry: ModelEntry, job: Job) -> list[RegisteredModel]:
        cached = await asyncio.to_thread(self._cached_profile, entry)
        profile = cached
        done: list[RegisteredModel] = []
        try:
            for instance in entry.instances:
                target = served_name(instance, entry.version)
                model = await self._one(entry, target, profile, job)
                done.append(model)
                profile = model.profile
        except BaseException:
            await self._unregister_all(done)
            raise
        if profile is not None and profile != cached:
            await asyncio.to_thread(self._store_profile, entry, profile)
        return done

    async def _buckets(self, entry: ModelEntry, job: Job) -> tuple[list[RegisteredModel], Variants]:
        at = {bucket: entry.at_bucket(bucket) for bucket in entry.buckets}
        cached = {b: await asyncio.to_thread(self._cached_profile, e) for b, e in at.items()}
        profiles = dict(cached)
        seeded: set[Bucket] = set()
        variants: Variants = {}

        async def one(
            at_bucket: ModelEntry, name: str, profile: RegistrationProfile | None
        ) -> RegisteredModel:
            return await self._one(at_bucket, name, profile, job)

        cap_ns = self._driver.runtime.profiler.max_profile_ns
        try:
            for instance in entry.instances:
                target = served_name(instance, entry.version)
                variants[instance] = await register_variants(
                    entry, target, one, profiles, seeded, cap_ns
                )
        except BaseException:
            await self._unregister_all([m for done in variants.values() for m in done])
            raise
        for bucket, profile in profiles.items():
            if profile is not None and profile != cached[bucket] and bucket not in seeded:
                await asyncio.to_thread(self._store_profile, at[bucket], profile)
        return [done[-1] for done in variants.values()], variants

    async def _unregister_all(self, models: list[RegisteredModel]) -> None:
        for model in models:
            await self._driver.unregister_model(model.name)

    async def _one(
        self, entry: ModelEntry, target: str, profile: RegistrationProfile | None, job: Job
    ) -> RegisteredModel:
        def on_stage(stage: str) -> None:  # "profiling", then what it runs
            job.progress = stage
            if job.state is JobState.REGISTERING:
                job.move(JobState.PROFILING, time.monotonic_ns())
                self._on_change()

        try:
            return await self._driver.register_model(
                target,
                self._registration.path_for(entry),
                batch_sizes=entry.batch_sizes if entry.batch_sizes_declared else (),
                group=entry.group,
                default_slo_ns=entry.default_slo_ns,
                profile=profile,
                inputs=entry.inputs if entry.axes else (),  # declared lengths, if any
                derive_slo=not entry.default_slo_declared,
                on_stage=on_stage,
            )
        except (RegistrationError, LinkError, TimeoutError) as error:
            raise ServiceError(ApiCode.BAD_MODEL, str(error) or repr(error)) from None

    def _cached_profile(self, entry: ModelEntry) -> RegistrationProfile | None:
        machine = self._registration.machine_for(entry)
        return self._registration.cache.get(
            entry.profile_key, machine, RegistrationProfile.from_json
        )

    def _store_profile(self, entry: ModelEntry, profile: RegistrationProfile) -> None:
        machine = self._registration.machine_for(entry)
        try:
            self._registration.cache.put(entry.profile_key, machine, profile.to_json())
        except OSError as error:
            log.warning("profile of %r not cached: %s", entry.name, error)


async def register_variants(
    entry: ModelEntry,
    target: str,
    register_one: RegisterOne,
    profiles: dict[Bucket, RegistrationProfile | None],
    seeded: set[Bucket],
    max_profile_ns: int,
    now_ns: Callable[[], int] = time.monotonic_ns,
) -> tuple[RegisteredModel, ...]:
    """Register every bucket of ``entry`` as a variant of ``target``; returns them in bucket
    order (smallest first). ``profiles`` holds a profile per bucket to reuse (cached, or from
    an earlier copy) and receives each bucket's; ``seeded`` receives the buckets whose profile
    came from the neighbour rule (not measured: not to be cached). Raises what
    ``register_one`` raises (the caller drops what was registered)."""
    registered: dict[Bucket, RegisteredModel] = {}
    spent_ns = largest_ns = 0
    for bucket in reversed(entry.buckets):
        profile = profiles.get(bucket)
        measured = {b: p for b, p in profiles.items() if p is not None and b not in seeded}
        if profile is None and measured and spent_ns + largest_ns > max_profile_ns:
            profile = seeded_profile(entry.buckets, measured)[bucket]
            seeded.add(bucket)
        started_ns = now_ns()
        model = await register_one(entry.at_bucket(bucket), variant_name(target, bucket), profile)
        took_ns = now_ns() - started_ns
        spent_ns += took_ns
        largest_ns = largest_ns or took_ns
        registered[bucket] = model
        profiles[bucket] = model.profile
    return tuple(registered[bucket] for bucket in entry.buckets)


def seeded_profile(
    buckets: tuple[Bucket, ...], measured: Mapping[Bucket, RegistrationProfile]
) -> dict[Bucket, RegistrationProfile]:
    """A profile per bucket by the neighbour rule, per executor kind, offering the batch
    sizes every kind has."""
    kinds = {kind for profile in measured.values() for kind in profile.kinds}
    by_kind = {
        kind: neighbour_profiles(
            buckets, {b: p.kinds[kind] for b, p in measured.items() if kind in p.kinds}
        )
        for kind in kinds
    }
    seeded: dict[Bucket, RegistrationProfile] = {}
    for bucket in buckets:
        per_kind = {kind: profiles[bucket] for kind, profiles in by_kind.items()}
        sizes = sorted(set.intersection(*(set(p.execute_ns) for p in per_kind.values())))
        seeded[bucket] = RegistrationProfile(tuple(sizes), per_kind)
    return seeded


def bucketed_model(
    target: str, entry: ModelEntry, variants: tuple[RegisteredModel, ...]
) -> BucketedModel:
    """The door's view of ``target``: its plan and its variant per bucket."""
    assert entry.shapes is not None
    names = {bucket: model.name for bucket, model in zip(entry.buckets, variants, strict=True)}
    return BucketedModel(target, entry.shapes, names)
