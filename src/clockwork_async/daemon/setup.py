"""How the daemon's parts are built from its frozen `DaemonConfig`: executor specs, runtime
timing, model registration, the embedded demo repository, the metrics' live view, and where
the controller's loop thread runs (`ControllerPlacement`).

Pure mapping where it can be (config in, runtime dataclasses out); the only I/O is
`seed_demo_models` (files, called from a worker thread) and `ControllerPlacement` (the
process's CPU affinity). Invariant: what the daemon cannot
serve from a config it refuses here, at start, with a `ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path

from clockwork_async.api.auth import TokenAuth, server_ssl_context
from clockwork_async.api.server import ApiServer
from clockwork_async.api.service import Requests
from clockwork_async.config.daemon import (
    DaemonConfig,
    LocalExecutorConfig,
    RemoteExecutorConfig,
    ServerConfig,
)
from clockwork_async.daemon.admin import DaemonService
from clockwork_async.daemon.instances import Registration
from clockwork_async.daemon.metrics import ExecutorGauges, LiveSnapshot
from clockwork_async.ioarena.shared import IoArena
from clockwork_async.models.profile_cache import ProfileCache, machine_key
from clockwork_async.models.repository import ModelEntry, Repository
from clockwork_async.runtime.driver import RuntimeConfig
from clockwork_async.runtime.snapshot import DriverSnapshot
from clockwork_async.runtime.supervisor import ExecutorSpec, SupervisorConfig, pin_controller

log = logging.getLogger(__name__)

DEMO_SEEDED_MARKER = ".demo-models-seeded"  # dot-files are not model folders


def local_executors(config: DaemonConfig) -> list[LocalExecutorConfig]:
    return [e for e in config.executors if isinstance(e, LocalExecutorConfig)]


def remote_executors(config: DaemonConfig) -> list[RemoteExecutorConfig]:
    return [e for e in config.executors if isinstance(e, RemoteExecutorConfig)]


def is_simulated(config: DaemonConfig) -> bool:
    return any(e.backend == "simulated" for e in local_executors(config))


def executor_specs(
    config: DaemonConfig, unpinned_cpus: tuple[int, ...] = (), controller_cpu: int | None = None
) -> list[ExecutorSpec]:
    """One supervisor spec per local executor; one without ``cpus`` gets ``unpinned_cpus``
    (the CPUs the daemon could use before it pinned itself), so it does not inherit the
    controller's pin. Lane threads run idle-class only on CPUs an executor has to itself
    (`own_cpus`)."""
    shared = (
        "name",
        "backend",
        "page_bytes",
        "weights_bytes",
        "intra_op_threads",
        "slowdown",
        "keep_warm_ms",
    )
    return [
        ExecutorSpec(
            **{key: getattr(e, key) for key in shared},
            device=e.device,
            cpus=e.cpus or unpinned_cpus,
            lane_scheduling="idle" if own_cpus(config, e, controller_cpu) else "normal",
        )
        for e in local_executors(config)
    ]


def own_cpus(
    config: DaemonConfig, executor: LocalExecutorConfig, controller_cpu: int | None
) -> bool:
    """Whether ``executor`` is pinned to CPUs that no other local executor and not the
    controller (pinned elsewhere: ``controller_cpu``) may run on."""
    if not executor.cpus or controller_cpu is None or controller_cpu in executor.cpus:
        return False
    others = (e for e in local_executors(config) if e is not executor)
    return not any(not e.cpus or set(e.cpus) & set(executor.cpus) for e in others)


def pinned_executor_cpus(config: DaemonConfig) -> set[int]:
    """The CPUs local executors are pinned to (the controller keeps off them)."""
    return {cpu for executor in local_executors(config) for cpu in executor.cpus}


def supervisor_config(config: DaemonConfig, io_arena: IoArena | None = None) -> SupervisorConfig:
    """Local executors restart with the links' backoff (``[executor_link]``), logging at the
    daemon's level, and inherit the IO arena if there is one."""
    return SupervisorConfig(
        backoff=config.executor_link.reconnect_backoff,
        log_level=config.server.log_level.value.upper(),
        io_arena_fd=io_arena.fd if io_arena is not None else None,
    )


def io_arena(config: DaemonConfig, local_executors: int) -> IoArena | None:
    """The IO arena of ``server.io_arena_bytes`` when local executors will map it (none for
    remote executors alone, or a size of 0). Raises ArenaError."""
    limits = config.server.limits
    if not local_executors or not limits.io_arena_bytes:
        return None
    return IoArena(limits.io_arena_bytes, owner_share=limits.io_arena_connection_share)


def runtime_config(config: DaemonConfig) -> RuntimeConfig:
    """The runtime's settings: ``[executor_link]`` and ``[profiler]`` as they are."""
    return RuntimeConfig(link=config.executor_link, profiler=config.profiler)


def registration(config: DaemonConfig) -> Registration:
    """How repository models are registered: the profile cache and its machine key, the host
    budget, and the path executors are told: the file, or for simulated executors (which time
    a model by a duration profile, not by its file) the model.toml's ``sim_profile``."""
    cache = ProfileCache(config.repository.profile_cache_dir)
    budget_bytes = config.repository.weights_budget_bytes
    at_once = config.profiler.max_concurrent
    if is_simulated(config):
        slowdowns = sorted({e.slowdown for e in local_executors(config)})
        machine = machine_key("simulated")

        def simulated_machine(entry: ModelEntry) -> str:
            return f"{machine}; profile={entry.sim_profile}; x{slowdowns}"

        return Registration(cache, simulated_machine, budget_bytes, _sim_profile, at_once)
    onnxruntime_machine = machine_key("onnxruntime")
    return Registration(
        cache, lambda _entry: onnxruntime_machine, budget_bytes, _file_path, at_once
    )


def _file_path(entry: ModelEntry) -> str:
    return str(entry.onnx_path)


def _sim_profile(entry: ModelEntry) -> str:
    return entry.sim_profile


def seed_demo_models(repository: Repository, cache_dir: Path) -> list[str]:
    """On the first run of the embedded default, generate the demo models into ``cache_dir``
    and add those missing to ``repository``; a marker file makes later runs leave it alone
    (a removed demo model stays removed). Returns the names added."""
    from clockwork_async.models.demo import generate_demo_models

    marker = repository.root / DEMO_SEEDED_MARKER
    if marker.exists():
        return []
    present = {entry.name for entry in repository.scan()}
    added = []
    for name, path in generate_demo_models(cache_dir).items():
        if name not in present:
            repository.add(name, path.read_bytes())
            added.append(name)
    marker.write_text("the demo models were added on the first run\n", encoding="utf-8")
    return added


def live_snapshot(snapshot: DriverSnapshot, connections: int) -> LiveSnapshot:
    """The metrics' live gauges (and the core's cold-start count) from a driver snapshot."""
    by_group: dict[str, int] = {}
    for model in snapshot.models:
        by_group[model.group] = by_group.get(model.group, 0) + model.queued
    return LiveSnapshot(
        executors=tuple(
            ExecutorGauges(e.executor_id, e.up, e.pages_used, e.pages_total, len(e.loaded))
            for e in snapshot.executors
        ),
        queue_depth=snapshot.queued,
        queue_depth_by_group=by_group,
        running_requests=snapshot.running,
        outstanding_requests=snapshot.outstanding,
        models_registered=len(snapshot.models),
        client_connections=connections,
        cold_starts=snapshot.core_counters.get("cold_starts", 0),
        warm_ups=snapshot.core_counters.get("warm_ups", 0),
        loop_delay_ns=snapshot.loop_delay_ns,
        loop_request_ns=snapshot.loop_cost_ns.get("request", 0.0),
    )


def snapshot_source(
    snapshot: Callable[[], DriverSnapshot], connections: Callable[[], int]
) -> Callable[[], LiveSnapshot]:
    return lambda: live_snapshot(snapshot(), connections())


class ControllerPlacement:
    """Where the controller's loop thread runs: pinned (``server.pin_controller``) to a CPU no
    local executor is pinned to, and busy-polling (``server.busy_poll_us``) only where that CPU
    is its own. `unpin` restores the affinity the process had before `pin`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.cpu: int | None = None  # where the controller is pinned, if it is
        self._affinity_before: set[int] | None = None

    def pin(self, cpus: tuple[int, ...]) -> None:
        """Pin the calling thread to one of ``cpus``, if configured; a refusal is logged."""
        if not self.config.server.pin_controller:
            return
        before = os.sched_getaffinity(0)
        try:
            cpu = pin_controller(cpus, taken=pinned_executor_cpus(self.config))
        except OSError as error:
            log.warning("the controller is not pinned: %s", error)
            return
        self._affinity_before, self.cpu = before, cpu
        log.info("controller pinned to CPU %d", cpu)

    def busy_poll_window_ns(self) -> int:
        """How long to busy-poll after work: ``server.busy_poll_us``, or 0 (with the reason
        logged) when the controller's CPU may not be its own: polling uses the CPU it runs on."""
        window_us = self.config.server.busy_poll_us
        if not window_us:
            return 0
        if why_not := self._shared_cpu():
            log.info("busy polling off: %s", why_not)
            return 0
        log.info("busy polling %.0f us after work", window_us)
        return round(window_us * 1000)

    def _shared_cpu(self) -> str:
        """Why the controller's CPU may not be its own ("" when it is)."""
        if self.cpu is None:
            return "the controller is not pinned"
        if self.cpu in pinned_executor_cpus(self.config):
            return f"the controller shares CPU {self.cpu} with an executor"
        if not all(executor.cpus for executor in local_executors(self.config)):
            return "a local executor without cpus may run on the controller's CPU"
        return ""

    def unpin(self) -> None:
        if self._affinity_before is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._affinity_before)
            self._affinity_before = None


def api_server(config: DaemonConfig, service: DaemonService, requests: Requests) -> ApiServer:
    """The client API's server over ``service`` (admin) and ``requests`` (the dispatcher)."""
    server = config.server
    auth = TokenAuth(infer_token=server.infer_token, admin_token=server.admin_token)
    return ApiServer(
        service, requests=requests, routes=service.routes, limits=server.limits, auth=auth
    )


def server_tls(server: ServerConfig) -> tuple[ssl.SSLContext | None, tuple[Path, Path] | None]:
    """The TLS context of ``[server]`` and its (cert, key) paths, or (None, None) without TLS.
    Raises OSError for files it cannot read."""
    if server.tls_cert_path is None or server.tls_key_path is None:
        return None, None
    paths = (server.tls_cert_path, server.tls_key_path)
    return server_ssl_context(*paths), paths
