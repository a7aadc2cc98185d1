"""The daemon's `Admin` service: the client API's view of models (the repository and their
registration on the driver), stats and health. Requests do not pass here: the client API
sends them to the driver's dispatcher, routed by `routes`, and the metrics listen to the
dispatcher's answers.

Invariants:
- A model *folder* (``ModelEntry``) is served as its instances (``NAME``, or ``NAME-0`` ..
  ``NAME-{copies-1}``); ``_served`` maps folder -> entry, ``_instances`` instance ->
  RegisteredModel and ``routes`` instance -> where its requests go, and all three change only
  together, in one step with no await inside, under ``_lock``, which serialises every
  registration change (add, replace, remove, rescan) so two never interleave.
- Version 1 of an instance is served under its own name, version N > 1 under ``NAME@vN``
  (``@`` is not allowed in model names, so no folder can take it). A replace registers the new
  version beside the old, then switches ``routes`` in one step: no request finds the name
  unserved; requests routed before the switch finish on the old version, which is
  unregistered once none is left (or after `RETIRE_TIMEOUT_S`).
- Repository I/O runs in a worker thread; the event loop never blocks on a disk.
- A registration that fails leaves nothing behind: instances already registered are
  unregistered, and a replaced model's old files are put back (its registration was kept).

One idea: what the daemon serves under which name, changed under one lock: folders, their
instances and versions, and the routes the client API follows (stats and health only read).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial

from clockwork_async import build
from clockwork_async.api.service import Health, ModelRoute, ServiceError
from clockwork_async.daemon.instances import Registrar, Registration, bucketed_model, served_name
from clockwork_async.daemon.metrics import Metrics
from clockwork_async.daemon.registration_jobs import Job, JobError, Jobs, JobState, job_status
from clockwork_async.models.repository import (
    ModelEntry,
    ModelNotFound,
    Repository,
    RepositoryError,
    ScanProblem,
)
from clockwork_async.runtime.driver import Driver, RegisteredModel
from clockwork_async.wire.messages import ApiCode, ModelStatus

log = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 30.0  # a replaced version's queued requests may take this long to finish


@dataclass(frozen=True, slots=True)
class RescanReport:
    """What a repository rescan changed: instance-less folder names per list, and the folders
    it skipped (not a valid model folder) with why."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # valid folders whose registration failed
    skipped: tuple[ScanProblem, ...] = ()

    def summary(self) -> str:
        """One line for the log: every list, skipped folders with their reasons."""
        return f"added {list(self.added)}, removed {list(self.removed)}, {self.problems()}"

    def problems(self) -> str:
        skipped = "; ".join(f"{problem.folder} ({problem.reason})" for problem in self.skipped)
        return f"failed {list(self.failed)}, skipped [{skipped}]"


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
        self._instances: dict[str, RegisteredModel] = {}  # by instance name
        self._variants: dict[str, tuple[RegisteredModel, ...]] = {}  # bucketed instances'
        # Instance name -> where its requests go; the client API reads it (never rebound).
        self.routes: dict[str, ModelRoute] = {}
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self._jobs = Jobs(registration.max_concurrent)
        self._registrar = Registrar(driver, registration, lambda: self.on_change())
        self.accepting = True  # False once draining: health says so
        self.extra_stats: Callable[[], Mapping[str, object]] = dict
        self.on_change: Callable[[], None] = _nothing  # after every add, remove and rescan
        driver.outcome_listeners.append(metrics.observe_outcome)
        driver.action_listeners.append(metrics.observe_action)

    # --- models: queries -----------------------------------------------------------------------

    def list_models(self) -> list[ModelStatus]:
        """Every registered instance, by name."""
        loaded = {m.name: m.loaded_on for m in self._driver.snapshot().models}
        served = [
            self._status(name, _loaded_on(loaded, self._models_of(name)))
            for name in sorted(self._instances)
        ]
        jobs = [job_status(job) for job in self._jobs.all() if job.state is not JobState.READY]
        return sorted(served + jobs, key=lambda status: (status.name, status.version))

    def _status(self, instance: str, loaded_on: tuple[str, ...]) -> ModelStatus:
        model = self._instances[instance]
        return ModelStatus(
            name=instance,
            group=model.group or instance,
            state="loaded" if loaded_on else "ready",
            loaded_on=loaded_on,
            pages=model.weights_pages,
            batch_sizes=model.batch_sizes,
            default_slo_ns=model.default_slo_ns,
            inputs=model.inputs,
            outputs=model.outputs,
            version=self.routes[instance].version,
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
        snapshot["build"] = {"version": build.version(), "core": build.core_label()}
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

    async def add_model(
        self,
        name: str,
        onnx_bytes: bytes,
        model_toml: str | None,
        *,
        replace: bool = False,
        wait: bool = True,
    ) -> ModelStatus:
        """Store ``name`` in the repository and register it in a background job (`Jobs`);
        returns the status of its first instance once it is ready (``wait``), or its job's
        status at once. A taken name, or one being registered, is ``model_exists`` unless
        ``replace``: then the new version is registered beside the old one and takes its name
        in one step (`_switch`). Raises ServiceError (with ``wait``: why the job failed)."""
        async with self._lock:
            self._check_not_instance(name)
            if (running := self._jobs.running(name)) is not None:
                raise ServiceError(ApiCode.MODEL_EXISTS, running.busy_message())
            old = self._served.get(name)
            if not replace:
                await self._check_name_free(name, old)
            self._check_budget(name, hashlib.sha256(onnx_bytes).hexdigest(), len(onnx_bytes))
            old_files = await asyncio.to_thread(_read_files, old) if old is not None else None
            version = old.version + 1 if old is not None else 1
            entry = await self._store(name, onnx_bytes, model_toml, version)
            job = self._jobs.start(name, version, partial(self._add_job, entry, old, old_files))
            self.on_change()
        if not wait:
            return job_status(job)
        await job.done.wait()
        if job.state is not JobState.READY:
            raise ServiceError(job.code, job.reason)
        return self._status(entry.instances[0], ())

    async def _add_job(
        self,
        entry: ModelEntry,
        old: ModelEntry | None,
        old_files: tuple[bytes, str | None] | None,
        job: Job,
    ) -> None:
        """The job of an add: register (ready when routed), retire the version it replaced;
        on failure or cancel, put the old files back. Raises JobError."""
        retired = [m for i in old.instances for m in self._models_of(i)] if old else []
        try:
            async with self._changing():
                await self._register(entry, job)
        except BaseException as error:
            async with self._lock:
                await asyncio.shield(self._restore(entry.name, old_files, old))
            if isinstance(error, ServiceError):
                raise JobError(error.code, error.message) from None
            raise
        await self._retire(retired)

    async def cancel_registration(self, name: str) -> ModelStatus:
        """Cancel the running registration of ``name``; returns its job's status once nothing
        of it is left on any executor. Raises ServiceError (``unknown_model``)."""
        try:
            return job_status(await self._jobs.cancel(name, "cancelled by a client"))
        except KeyError:
            why = f"no registration of {name!r} is running"
            raise ServiceError(ApiCode.UNKNOWN_MODEL, why) from None

    async def cancel_registrations(self, reason: str) -> None:
        """Cancel every running registration (a stop); returns once each has cleaned up."""
        await self._jobs.cancel_all(reason)

    @contextlib.asynccontextmanager
    async def _changing(self) -> AsyncIterator[None]:
        """Tell `on_change` when a change ends, however it ends."""
        try:
            yield
        finally:
            self.on_change()

    async def _check_name_free(self, name: str, served: ModelEntry | None) -> None:
        """Raises ServiceError: ``model_exists`` if ``name`` is served or has a folder, the
        repository's code for a name it refuses."""
        try:
            taken = served is not None or await asyncio.to_thread(self._repository.has, name)
        except RepositoryError as error:
            raise ServiceError(error.code, str(error)) from None
        if not taken:
            return
        what = f"version {served.version}" if served is not None else "a folder not served"
        raise ServiceError(
            ApiCode.MODEL_EXISTS,
            f"model {name!r} exists ({what}); add it with replace "
            "(`clockwork-async models add --replace`) to swap it",
        )

    def _check_not_instance(self, name: str) -> None:
        owner = next((n for n, e in self._served.items() if name in e.instances), name)
        if owner != name:
            raise ServiceError(ApiCode.MODEL_EXISTS, f"{name!r} is an instance of model {owner!r}")

    async def _store(
        self, name: str, onnx_bytes: bytes, model_toml: str | None, version: int
    ) -> ModelEntry:
        try:
            return await asyncio.to_thread(
                self._repository.add, name, onnx_bytes, model_toml, version=version
            )
        except RepositoryError as error:
            raise ServiceError(error.code, str(error)) from None

    async def _restore(
        self, name: str, old_files: tuple[bytes, str | None] | None, old: ModelEntry | None
    ) -> None:
        """Put back the files ``add_model`` replaced (their registration was kept), or remove
        what it added."""
        if old_files is None or old is None:
            await asyncio.to_thread(self._repository.remove, name)
            return
        try:
            await self._store(name, *old_files, old.version)
        except ServiceError as error:
            log.error("the replaced model %r could not be put back on disk: %s", name, error)

    async def _retire(self, models: list[RegisteredModel]) -> None:
        """Unregister replaced versions once the requests routed to them are answered: their
        queued ones here, their running ones in `Driver.unregister_model`."""
        if not models:
            return
        names = {model.name for model in models}
        answered = asyncio.Event()

        def on_outcome(model: str, *_: object) -> None:
            if model in names:
                answered.set()

        listeners = self._driver.outcome_listeners
        listeners.append(on_outcome)  # only while retiring: not on every request's way
        try:
            async with asyncio.timeout(RETIRE_TIMEOUT_S):
                while self._queued(names):
                    answered.clear()
                    await answered.wait()
        except TimeoutError:
            log.warning("replaced %s: queued requests left after %.0f s", names, RETIRE_TIMEOUT_S)
        finally:
            listeners.remove(on_outcome)
        for model in models:
            await self._drop(model.name)

    def _queued(self, names: set[str]) -> int:
        return sum(m.queued for m in self._driver.snapshot().models if m.name in names)

    async def _drop(self, target: str) -> None:
        self._metrics.instance_aliases.pop(target, None)
        with contextlib.suppress(KeyError):  # already gone
            await self._driver.unregister_model(target)

    async def remove_model(self, name: str) -> None:
        """Unregister every instance of folder ``name`` (queued requests are answered
        ``unknown_model``, running ones finish), then delete the folder. Raises ServiceError."""
        cancelled = self._jobs.running(name) is not None
        with contextlib.suppress(KeyError):  # a registration of it: cancelled, and undone
            await self._jobs.cancel(name, "its model was removed")
        async with self._lock, self._changing():
            self._check_not_instance(name)
            self._jobs.forget(name)
            entry = self._served.get(name)
            if entry is not None:
                await self._unregister(entry)
            try:
                await asyncio.to_thread(self._repository.remove, name)
            except ModelNotFound as error:
                if entry is None and not cancelled:
                    raise ServiceError(ApiCode.UNKNOWN_MODEL, str(error)) from None
            except RepositoryError as error:
                raise ServiceError(error.code, str(error)) from None

    async def rescan(self) -> RescanReport:
        """Bring the served models in line with the repository: unregister removed or changed
        folders, register new or changed ones (each a job; at most ``max_concurrent`` at once;
        names being registered are left alone). Failures are logged and reported."""
        async with self._lock, self._changing():
            scan = await asyncio.to_thread(self._repository.scan_report)
            for problem in scan.problems:
                log.warning("model folder %r skipped: %s", problem.folder, problem.reason)
            entries = {entry.name: entry for entry in scan.entries}
            removed = [name for name, old in self._served.items() if entries.get(name) != old]
            for name in removed:
                await self._unregister(self._served[name])
            jobs = [
                self._jobs.start(name, entry.version, partial(self._rescan_job, entry))
                for name, entry in entries.items()
                if name not in self._served and self._jobs.running(name) is None
            ]
        for job in jobs:
            await job.done.wait()
            if job.state is not JobState.READY:
                log.error("model %r not registered: %s", job.name, job.reason)
        added = tuple(job.name for job in jobs if job.state is JobState.READY)
        failed = tuple(job.name for job in jobs if job.state is not JobState.READY)
        return RescanReport(added, tuple(removed), failed, scan.problems)

    async def _rescan_job(self, entry: ModelEntry, job: Job) -> None:
        try:
            async with self._changing():
                await self._register(entry, job)
        except ServiceError as error:
            raise JobError(error.code, error.message) from None

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

    async def _register(self, entry: ModelEntry, job: Job) -> None:
        """Register every instance of ``entry`` (profiled once, from the cache if there) and
        route its names to them (`_switch`, and ``job`` ready in the same step); all or none.
        Raises ServiceError."""
        self._check_budget(entry.name, entry.sha256, entry.size_bytes)
        if not any(executor.up for executor in self._driver.snapshot().executors):
            raise ServiceError(ApiCode.UNAVAILABLE, f"cannot register {entry.name!r}: no executor")
        done, variants = await self._registrar.register(entry, job)
        self._switch(entry, done, variants)
        job.move(JobState.READY, time.monotonic_ns())
        log.info(
            "model %r version %d registered as %s",
            entry.name,
            entry.version,
            ", ".join(model.name for model in done),
        )

    def _models_of(self, instance: str) -> tuple[RegisteredModel, ...]:
        """The core models serving ``instance``: its variants, or itself."""
        return self._variants.get(instance) or (self._instances[instance],)

    def _switch(
        self,
        entry: ModelEntry,
        models: list[RegisteredModel],
        variants: Mapping[str, tuple[RegisteredModel, ...]],
    ) -> None:
        """Serve ``entry`` as ``models`` from now on, in one step (requests are routed by
        `routes`); the instances of the version it replaces are no longer routed to."""
        old = self._served.get(entry.name)
        if old is not None:
            for instance in old.instances:
                self._forget(instance, old.version)
        self._served[entry.name] = entry
        for instance, model in zip(entry.instances, models, strict=True):
            target = served_name(instance, entry.version)
            self._instances[instance] = model
            self.routes[instance] = ModelRoute(target, entry.version)
            for each in variants.get(instance, (model,)):
                if each.name != instance:
                    self._metrics.instance_aliases[each.name] = instance
            if instance in variants:
                self._variants[instance] = variants[instance]
                buckets = self._driver.dispatcher.buckets
                buckets[target] = bucketed_model(target, entry, variants[instance])

    def _forget(self, instance: str, version: int) -> None:
        """Stop routing to ``instance`` (its models are dropped by the caller)."""
        self._instances.pop(instance, None)
        self.routes.pop(instance, None)
        if self._variants.pop(instance, None) is not None:
            self._driver.dispatcher.buckets.pop(served_name(instance, version), None)

    async def _unregister(self, entry: ModelEntry) -> None:
        """Stop serving every instance of ``entry`` (already gone ones are skipped)."""
        self._served.pop(entry.name, None)
        for instance in entry.instances:
            models = self._models_of(instance) if instance in self._instances else ()
            self._forget(instance, entry.version)
            for model in models:
                await self._drop(model.name)
        log.info("model %r unregistered", entry.name)


def _nothing() -> None:
    pass


def _loaded_on(
    loaded: Mapping[str, tuple[str, ...]], models: tuple[RegisteredModel, ...]
) -> tuple[str, ...]:
    """The executors holding any of ``models`` (an instance's, or its buckets' variants)."""
    return tuple(dict.fromkeys(e for model in models for e in loaded.get(model.name, ())))


def _read_files(entry: ModelEntry) -> tuple[bytes, str | None]:
    """The bytes of a model folder's model.onnx and the text of its model.toml (if any)."""
    toml_path = entry.onnx_path.with_name("model.toml")
    toml_text = toml_path.read_text(encoding="utf-8") if toml_path.is_file() else None
    return entry.onnx_path.read_bytes(), toml_text
