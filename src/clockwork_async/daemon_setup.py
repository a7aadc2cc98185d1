"""How the daemon's parts are built from its frozen `DaemonConfig`: executor specs, runtime
timing, model registration, the embedded demo repository and the metrics' live view.

Pure mapping where it can be (config in, runtime dataclasses out); the only I/O is
`seed_demo_models` (files, called from a worker thread). Invariant: what the daemon cannot
serve from a config it refuses here, at start, with a `ConfigError` naming the key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from clockwork_async.config import (
    DaemonConfig,
    ExecutorLinkConfig,
    LocalExecutorConfig,
    RemoteExecutorConfig,
)
from clockwork_async.metrics import ExecutorGauges, LiveSnapshot
from clockwork_async.profile_cache import ProfileCache, machine_key
from clockwork_async.repository import ModelEntry, Repository
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.driver import RuntimeConfig
from clockwork_async.runtime.executor_link import LinkConfig
from clockwork_async.runtime.profiler import ProfilerConfig
from clockwork_async.runtime.snapshot import DriverSnapshot
from clockwork_async.runtime.supervisor import ExecutorSpec, SupervisorConfig
from clockwork_async.service_impl import Registration

log = logging.getLogger(__name__)

MS_NS = 1_000_000
# Simulated executors time a model by a duration profile, not by its file: every repository
# model is registered on them as this built-in profile (fast, for tests and overhead runs).
SIMULATED_PROFILE = "tiny-sim"
DEMO_SEEDED_MARKER = ".demo-models-seeded"  # dot-files are not model folders


def local_executors(config: DaemonConfig) -> list[LocalExecutorConfig]:
    return [e for e in config.executors if isinstance(e, LocalExecutorConfig)]


def remote_executors(config: DaemonConfig) -> list[RemoteExecutorConfig]:
    return [e for e in config.executors if isinstance(e, RemoteExecutorConfig)]


def is_simulated(config: DaemonConfig) -> bool:
    return any(e.backend == "simulated" for e in local_executors(config))


def executor_specs(config: DaemonConfig) -> list[ExecutorSpec]:
    """One supervisor spec per local executor."""
    return [
        ExecutorSpec(
            name=e.name,
            backend=e.backend,
            cpus=e.cpus,
            page_bytes=e.page_bytes,
            weights_bytes=e.weights_bytes,
            intra_op_threads=e.intra_op_threads,
            slowdown=e.slowdown,
        )
        for e in local_executors(config)
    ]


def _backoff(link: ExecutorLinkConfig) -> BackoffConfig:
    return BackoffConfig(
        initial_s=link.reconnect_backoff_initial_s,
        factor=link.reconnect_backoff_factor,
        max_s=max(link.reconnect_backoff_max_s, link.reconnect_backoff_initial_s),
        healthy_s=link.reconnect_backoff_healthy_s,
    )


def supervisor_config(config: DaemonConfig) -> SupervisorConfig:
    return SupervisorConfig(
        backoff=_backoff(config.executor_link),
        log_level=config.server.log_level.value.upper(),
    )


def runtime_config(config: DaemonConfig) -> RuntimeConfig:
    """Link timing from ``[executor_link]``; profiling bounded by ``max_profile_execute_ms``.
    An executor is down after ``heartbeat_miss_limit`` missed heartbeats (plus half a period,
    so a limit of 1 is still a timeout longer than the interval)."""
    link = config.executor_link
    interval_s = link.heartbeat_interval_ms / 1000.0
    max_execute_ns = max(1, round(config.repository.max_profile_execute_ms * MS_NS))
    return RuntimeConfig(
        link=LinkConfig(
            connect_timeout_s=link.connect_timeout_s,
            handshake_timeout_s=link.connect_timeout_s,
            heartbeat_interval_s=interval_s,
            heartbeat_timeout_s=interval_s * (link.heartbeat_miss_limit + 0.5),
            reconnect=_backoff(link),
        ),
        profiler=ProfilerConfig(max_execute_ns=max_execute_ns),
    )


def registration(config: DaemonConfig) -> Registration:
    """How repository models are registered: the profile cache and its machine key, the host
    budget, and the path executors are told (the file, or the simulated profile)."""
    cache = ProfileCache(config.repository.profile_cache_dir)
    budget_bytes = config.repository.weights_budget_bytes
    if is_simulated(config):
        slowdowns = sorted({e.slowdown for e in local_executors(config)})
        machine = machine_key("simulated") + f"; profile={SIMULATED_PROFILE}; x{slowdowns}"
        return Registration(cache, machine, budget_bytes, lambda _entry: SIMULATED_PROFILE)
    return Registration(cache, machine_key("onnxruntime"), budget_bytes, _file_path)


def _file_path(entry: ModelEntry) -> str:
    return str(entry.onnx_path)


def seed_demo_models(repository: Repository, cache_dir: Path) -> list[str]:
    """On the first run of the embedded default, generate the demo models into ``cache_dir``
    and add those missing to ``repository``; a marker file makes later runs leave it alone
    (a removed demo model stays removed). Returns the names added."""
    from clockwork_async.demo_models import generate_demo_models

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
    """The metrics' live gauges from a driver snapshot. The driver counts requests accepted
    and not yet answered; that is both the outstanding count and (an upper bound of) the
    queue depth."""
    by_group: dict[str, int] = {}
    return LiveSnapshot(
        executors=tuple(
            ExecutorGauges(e.executor_id, e.up, e.pages_used, e.pages_total, len(e.loaded))
            for e in snapshot.executors
        ),
        queue_depth=snapshot.queue_depth,
        queue_depth_by_group=by_group,
        outstanding_requests=snapshot.queue_depth,
        models_registered=len(snapshot.models),
        client_connections=connections,
    )


def snapshot_source(
    snapshot: Callable[[], DriverSnapshot], connections: Callable[[], int]
) -> Callable[[], LiveSnapshot]:
    return lambda: live_snapshot(snapshot(), connections())
