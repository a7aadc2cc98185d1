"""The daemon's `Admin` service: the client API's view of models (the repository and their
registration on the driver), stats and health. Requests do not pass here: the client API
sends them to the driver's dispatcher, and the metrics listen to the dispatcher's answers.

Invariants:
- A model *folder* (``ModelEntry``) is served as its instances (``NAME``, or ``NAME-0`` ..
  ``NAME-{copies-1}``); ``_served`` maps folder -> entry and ``_instances`` instance ->
  RegisteredModel, and both change only together, under ``_lock``, which serialises every
  registration change (add, remove, rescan) so two never interleave.
- Repository I/O runs in a worker thread; the event loop never blocks on a disk.
- A registration that fails leaves nothing behind: instances already registered are
  unregistered, and a replaced model's old files and registration are put back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from clockwork_async.api.service import Health, ServiceError
from clockwork_async.metrics import Metrics
from clockwork_async.profile_cache import ProfileCache
from clockwork_async.repository import (
    ModelEntry,
    ModelNotFound,
    Repository,
    RepositoryError,
)
from clockwork_async.runtime.driver import Driver, RegisteredModel
from clockwork_async.runtime.executor_link import LinkError
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import RegistrationError
from clockwork_async.wire.messages import ApiCode, ModelStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RescanReport:
    """What a repository rescan changed: instance-less folder names per list."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Registration:
    """How the daemon registers repository models on its executors."""

    cache: ProfileCache
    machine_for: Callable[[ModelEntry], str]  # profile cache key: CPU, backend, runtime, ...
    budget_bytes: int  # host weights, one copy per content hash
    path_for: Callable[[ModelEntry], str]  # what executors are told to register


class DaemonService:
    """Implements `api.service.Admin` over a Driver, a Repository and Metrics."""

    def __init__(
        self,
        driver: Driver,
        repository: Repository,
        metrics: Metrics,
        registration: Registration,
    ) -> None:
        self._driver = driver
        self._repository = repository
        self._registration = registration
        self._served: dict[str, ModelEntry] = {}
        self._instances: dict[str, RegisteredModel] = {}
        self._lock = asyncio.Lock()
        self.accepting = True  # False once draining: health says so
        self.extra_stats: Callable[[], Mapping[str, object]] = dict
        driver.outcome_listeners.append(metrics.observe_outcome)
        driver.action_listeners.append(metrics.observe_action)

    # --- models: queries -----------------------------------------------------------------------

    def list_models(self) -> list[ModelStatus]:
        """Every registered instance, by name."""
        loaded = {m.name: m.loaded_on for m in self._driver.snapshot().models}
        return [self._status(model, loaded.get(name, ())) for name, model in sorted(self._models())]

    def _models(self) -> list[tuple[str, RegisteredModel]]:
        return list(self._instances.items())

    @staticmethod
    def _status(model: RegisteredModel, loaded_on: tuple[str, ...]) -> ModelStatus:
        return ModelStatus(
            name=model.name,
            group=model.group or model.name,
            state="loaded" if loaded_on else "ready",
            loaded_on=loaded_on,
            pages=model.weights_pages,
            batch_sizes=model.batch_sizes,
            default_slo_ns=model.default_slo_ns,
            inputs=model.inputs,
            outputs=model.outputs,
        )

    @property
    def served(self) -> dict[str, ModelEntry]:
        """Model folders being served, by name (a copy)."""
        return dict(self._served)

    def stats(self) -> dict[str, object]:
        """The driver's snapshot as plain data, with the daemon's own fields under
        ``daemon``."""
        snapshot = dataclasses.asdict(self._driver.snapshot())
        snapshot["daemon"] = dict(self.extra_stats())
        snapshot["folders"] = sorted(self._served)
        return snapshot

    def health(self) -> Health:
        """Ready when accepting, at least one executor is up and a model is registered."""
        executors = self._driver.snapshot().executors
        up = sum(executor.up for executor in executors)
        if not self.accepting:
            return Health(live=True, ready=False, reason="shutting down")
        if not up:
            return Health(live=True, ready=False, reason=f"0 of {len(executors)} executors up")
        if not self._instances:
            return Health(live=True, ready=False, reason="no model registered")
        return Health(live=True, ready=True)

    # --- models: changes -----------------------------------------------------------------------

    async def add_model(self, name: str, onnx_bytes: bytes, model_toml: str | None) -> ModelStatus:
        """Store ``name`` in the repository (replacing one of that name atomically) and
        register it; returns the status of its first instance. Raises ServiceError."""
        async with self._lock:
            self._check_not_instance(name)
            self._check_budget(name, hashlib.sha256(onnx_bytes).hexdigest(), len(onnx_bytes))
            old = self._served.get(name)
            old_files = await asyncio.to_thread(_read_files, old) if old is not None else None
            entry = await self._store(name, onnx_bytes, model_toml)
            if old is not None:
                await self._unregister(old)
            try:
                await self._register(entry)
            except ServiceError:
                await self._restore(name, old_files)
                raise
            return self._status(self._instances[entry.instances[0]], ())

    def _check_not_instance(self, name: str) -> None:
        owner = next((n for n, e in self._served.items() if name in e.instances), name)
        if owner != name:
            raise ServiceError(ApiCode.MODEL_EXISTS, f"{name!r} is an instance of model {owner!r}")

    async def _store(self, name: str, onnx_bytes: bytes, model_toml: str | None) -> ModelEntry:
        try:
            return await asyncio.to_thread(self._repository.add, name, onnx_bytes, model_toml)
        except RepositoryError as error:
            raise ServiceError(error.code, str(error)) from None

    async def _restore(self, name: str, old_files: tuple[bytes, str | None] | None) -> None:
        """Put back what ``add_model`` replaced (or remove what it added)."""
        if old_files is None:
            await asyncio.to_thread(self._repository.remove, name)
            return
        entry = await self._store(name, *old_files)
        try:
            await self._register(entry)
        except ServiceError as error:
            log.error("the replaced model %r could not be registered again: %s", name, error)

    async def remove_model(self, name: str) -> None:
        """Unregister every instance of folder ``name`` (queued requests are answered
        ``unknown_model``, running ones finish), then delete the folder. Raises ServiceError."""
        async with self._lock:
            self._check_not_instance(name)
            entry = self._served.get(name)
            if entry is not None:
                await self._unregister(entry)
            try:
                await asyncio.to_thread(self._repository.remove, name)
            except ModelNotFound as error:
                if entry is None:
                    raise ServiceError(ApiCode.UNKNOWN_MODEL, str(error)) from None
            except RepositoryError as error:
                raise ServiceError(error.code, str(error)) from None

    async def rescan(self) -> RescanReport:
        """Bring the served models in line with the repository: unregister removed or changed
        folders, register new or changed ones. Failures are logged and reported."""
        async with self._lock:
            entries = {
                entry.name: entry for entry in await asyncio.to_thread(self._repository.scan)
            }
            removed = [name for name, old in self._served.items() if entries.get(name) != old]
            for name in removed:
                await self._unregister(self._served[name])
            added, failed = [], []
            for name, entry in entries.items():
                if name in self._served:
                    continue
                try:
                    await self._register(entry)
                except ServiceError as error:
                    log.error("model %r not registered: %s", name, error.message)
                    failed.append(name)
                else:
                    added.append(name)
            return RescanReport(tuple(added), tuple(removed), tuple(failed))

    # --- registration ----------------------------------------------------------------------------

    def _check_budget(self, name: str, sha256: str, size_bytes: int) -> None:
        """Raises ServiceError(unavailable) if weights would go over the host budget."""
        by_hash = {e.sha256: e.size_bytes for n, e in self._served.items() if n != name}
        by_hash[sha256] = size_bytes
        total_bytes = sum(by_hash.values())
        budget_bytes = self._registration.budget_bytes
        if total_bytes > budget_bytes:
            raise ServiceError(
                ApiCode.UNAVAILABLE,
                f"model {name!r} ({size_bytes} bytes) would put host weights at {total_bytes} "
                f"bytes, over the budget of {budget_bytes} (repository.weights_budget_bytes)",
            )

    async def _register(self, entry: ModelEntry) -> None:
        """Register every instance of ``entry`` (profiled once, from the cache if there);
        all or none. Raises ServiceError."""
        self._check_budget(entry.name, entry.sha256, entry.size_bytes)
        if not any(executor.up for executor in self._driver.snapshot().executors):
            raise ServiceError(ApiCode.UNAVAILABLE, f"cannot register {entry.name!r}: no executor")
        cached = await asyncio.to_thread(self._cached_profile, entry)
        profile = cached
        done: list[RegisteredModel] = []
        try:
            for instance in entry.instances:
                model = await self._register_instance(entry, instance, profile)
                done.append(model)
                profile = model.profile
        except BaseException:
            for model in done:
                await self._driver.unregister_model(model.name)
            raise
        if profile is not None and profile != cached:
            await asyncio.to_thread(self._store_profile, entry, profile)
        self._served[entry.name] = entry
        self._instances.update((model.name, model) for model in done)
        log.info("model %r registered as %s", entry.name, ", ".join(entry.instances))

    async def _register_instance(
        self, entry: ModelEntry, instance: str, profile: RegistrationProfile | None
    ) -> RegisteredModel:
        try:
            return await self._driver.register_model(
                instance,
                self._registration.path_for(entry),
                batch_sizes=entry.batch_sizes if entry.batch_sizes_declared else (),
                group=entry.group,
                default_slo_ns=entry.default_slo_ns,
                profile=profile,
            )
        except (RegistrationError, LinkError, TimeoutError) as error:
            raise ServiceError(ApiCode.BAD_MODEL, str(error) or repr(error)) from None

    async def _unregister(self, entry: ModelEntry) -> None:
        """Stop serving every instance of ``entry`` (already gone ones are skipped)."""
        self._served.pop(entry.name, None)
        for instance in entry.instances:
            self._instances.pop(instance, None)
            try:
                await self._driver.unregister_model(instance)
            except KeyError:
                continue
        log.info("model %r unregistered", entry.name)

    def _cached_profile(self, entry: ModelEntry) -> RegistrationProfile | None:
        machine = self._registration.machine_for(entry)
        return self._registration.cache.get(entry.sha256, machine, RegistrationProfile.from_json)

    def _store_profile(self, entry: ModelEntry, profile: RegistrationProfile) -> None:
        machine = self._registration.machine_for(entry)
        try:
            self._registration.cache.put(entry.sha256, machine, profile.to_json())
        except OSError as error:
            log.warning("profile of %r not cached: %s", entry.name, error)


def _read_files(entry: ModelEntry) -> tuple[bytes, str | None]:
    """The bytes of a model folder's model.onnx and the text of its model.toml (if any)."""
    toml_path = entry.onnx_path.with_name("model.toml")
    toml_text = toml_path.read_text(encoding="utf-8") if toml_path.is_file() else None
    return entry.onnx_path.read_bytes(), toml_text
