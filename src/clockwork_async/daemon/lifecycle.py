"""`clockwork-async serve`: the daemon. Starts, serves, drains; signals, systemd, watchdog.

One idea: the daemon's lifecycle, its start order and its ending; how each part is built from
the config is `daemon_setup`'s.

Start order: the ports first (the client API's address bound, not yet accepting; the metrics
endpoint serving, its ``/readyz`` answering 503 with the phase), so a busy port fails the start
before any executor is spawned -> executors up and attached -> repository models registered
(profiles from the on-disk cache, else measured and cached) -> client API accepting -> systemd
``READY=1`` with ``STATUS=``. ``STATUS=`` follows ``/readyz``'s state from then on (models
added or removed, executors up or down). Then it serves until SIGTERM/SIGINT: ``STOPPING=1``, new
requests are answered ``shutting_down``, in-flight ones get up to ``server.drain_timeout_s``,
the rest are answered ``shutting_down``, the executors stop, and `Daemon.run` returns 0. A
second signal skips the drain (everything left is answered ``shutting_down`` at once, the
executors are killed) and it returns 1. SIGHUP rescans the model repository.

Before the executors start, the daemon pins its event loop's thread (the controller) to one
CPU no local executor is pinned to (``server.pin_controller``, `daemon_setup.ControllerPlacement`);
executors without ``cpus`` get every CPU the daemon had, so they do not inherit that pin.

Invariants: the lifecycle is explicit (STARTING -> SERVING -> DRAINING -> STOPPED, or
STARTING -> DRAINING when stopped while starting) with one guarded transition; the daemon waits
on events, never polls; signal handlers and the CPU affinity are the daemon's only while it
runs, and the previous ones are restored when `run` returns; whatever was started is stopped,
whatever path `run` takes out. `daemon.serve` (the CLI verb) reads the config and the environment
and runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry

from clockwork_async.api.server import ApiServer
from clockwork_async.config.daemon import DaemonConfig, redacted
from clockwork_async.daemon import setup
from clockwork_async.daemon.admin import DaemonService
from clockwork_async.daemon.frontends import FrontEndError, FrontEnds
from clockwork_async.daemon.http_endpoint import HttpEndpoint, Readiness
from clockwork_async.daemon.metrics import Metrics, probe_loop_lag
from clockwork_async.daemon.systemd import Notifier
from clockwork_async.ioarena.shared import ArenaError, IoArena
from clockwork_async.models.repository import Repository
from clockwork_async.runtime.driver import Driver
from clockwork_async.runtime.executor_link import LinkError
from clockwork_async.runtime.supervisor import Supervisor, SupervisorError
from clockwork_async.wire.addresses import TcpAddress

log = logging.getLogger("clockwork_async.daemon")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FLUSH_MARGIN_S = 1.0  # the API server waits this much past the drain for the last replies
EXIT_OK, EXIT_FAILED, EXIT_FORCED, EXIT_CONFIG = 0, 1, 1, 2


class DaemonState(StrEnum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_TRANSITIONS = {
    DaemonState.STARTING: {DaemonState.SERVING, DaemonState.DRAINING},
    DaemonState.SERVING: {DaemonState.DRAINING},
    DaemonState.DRAINING: {DaemonState.STOPPED},
    DaemonState.STOPPED: set(),
}


class StartError(RuntimeError):
    """The daemon could not start: an executor did not come up, or a port was busy."""


class Daemon:
    """One daemon run over a frozen config. Call `run` once, on the loop it will use."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        notifier: Notifier | None = None,
        demo_cache_dir: Path | None = None,
        out: TextIO | None = None,
    ) -> None:
        """``demo_cache_dir``: seed the repository with the demo models (embedded default)."""
        self.config = config
        self._notifier = notifier or Notifier({})
        self._demo_cache_dir = demo_cache_dir
        self._out = out if out is not None else sys.stdout
        self._state = DaemonState.STARTING
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._started_s = time.monotonic()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self.registry = CollectorRegistry()
        self.metrics = Metrics(
            self.registry, instance_label_limit=config.metrics.instance_label_limit
        )
        self.driver = Driver(config.controller, runtime=setup.runtime_config(config))
        self.supervisor: Supervisor | None = None
        self.io_arena: IoArena | None = None  # shared tensor memory of the local executors
        self.service: DaemonService | None = None
        self.api: ApiServer | None = None
        self.front_ends: FrontEnds | None = None  # HTTP and gRPC (frontends.py)
        self.endpoint: HttpEndpoint | None = None
        self.api_address = ""
        self.metrics_address = ""
        self.placement = setup.ControllerPlacement(config)
        self._phase = "starting"  # why not ready while STARTING (/readyz, STATUS=)
        self._status_sent = ""

    @property
    def state(self) -> DaemonState:
        return self._state

    @property
    def controller_cpu(self) -> int | None:
        """Where the controller's loop thread is pinned, if it is."""
        return self.placement.cpu

    def _enter(self, state: DaemonState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"daemon cannot go from {self._state.name} to {state.name}")
        log.info("daemon %s", state.value)
        self._state = state

    # --- the whole run -------------------------------------------------------------------------

    async def run(self) -> int:
        """Start, serve until a stop signal (or `request_stop`), drain and stop. Returns the
        exit status: 0 after a drain, 1 if the start failed or a second signal forced it."""
        previous = self._install_signals()
        status = EXIT_OK
        try:
            try:
                started = await self._start_unless_stopped()
            except StartError as error:
                log.error("cannot start: %s", error)
                started, status = False, EXIT_FAILED
            if started:
                await self._stop.wait()
            await self._shutdown()
        except BaseException:
            await self._stop_all()  # a bug or a cancellation: still leave no process behind
            raise
        finally:
            self._restore_signals(previous)
            self.placement.unpin()
            self._notifier.close()
        return EXIT_FORCED if self._force.is_set() else status

    def request_stop(self) -> None:
        """Begin the drain (as SIGTERM does); a second call skips what is left of it."""
        if self._stop.is_set() and not self._force.is_set():
            log.warning("second stop request: stopping now, without waiting for the drain")
            self._force.set()
        self._stop.set()

    def request_rescan(self) -> None:
        """Rescan the model repository (as SIGHUP does); ignored unless serving."""
        if self._state is DaemonState.SERVING and self.service is not None:
            self._spawn(self._rescan())

    # --- signals ---------------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        loop = asyncio.get_running_loop()
        handlers: dict[signal.Signals, Callable[[], None]] = {
            signal.SIGHUP: self._on_hup,
            **{signum: self._on_stop_signal for signum in STOP_SIGNALS},
        }
        previous: dict[int, Any] = {signum: signal.getsignal(signum) for signum in handlers}
        for signum, handler in handlers.items():
            loop.add_signal_handler(signum, handler)
        return previous

    def _restore_signals(self, previous: Mapping[int, Any]) -> None:
        loop = asyncio.get_running_loop()
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            if handler is not None:  # None: installed outside Python, left at the default
                signal.signal(signum, handler)

    def _on_stop_signal(self) -> None:
        log.info("stop signal received")
        self.request_stop()

    def _on_hup(self) -> None:
        log.info("SIGHUP: rescanning the model repository")
        self.request_rescan()

    # --- start -----------------------------------------------------------------------------------

    async def _start_unless_stopped(self) -> bool:
        """Run `_start`; a stop request meanwhile cancels it. Returns whether it started."""
        start = asyncio.ensure_future(self._start())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not start.done():
            log.warning("stopped while starting")
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartError):
                await start
            return False
        start.result()  # raises StartError
        return True

    async def _start(self) -> None:
        log.info("starting with %s", redacted(self.config))
        for warning in self.config.warnings():
            log.warning("config: %s", warning)
        repository = await asyncio.to_thread(self._open_repository)
        self._make_service(repository)
        await self._bind_api()
        await self._start_metrics()
        self._enter_phase("starting executors")
        unpinned_cpus = tuple(sorted(os.sched_getaffinity(0)))
        self.placement.pin(unpinned_cpus)
        if window_ns := self.placement.busy_poll_window_ns():
            self.driver.busy_poll(window_ns)
        await self._start_executors(unpinned_cpus if self.controller_cpu is not None else ())
        self._enter_phase("registering models")
        await self._register_models(repository)
        await self._serve_api()
        self._enter(DaemonState.SERVING)
        self._announce()

    def _enter_phase(self, phase: str) -> None:
        """A step of the start: ``/readyz`` and systemd's ``STATUS=`` say it."""
        self._phase = phase
        self._notifier.status(phase)

    async def _start_executors(self, unpinned_cpus: tuple[int, ...]) -> None:
        specs = setup.executor_specs(self.config, unpinned_cpus, self.controller_cpu)
        try:
            self._open_arena(len(specs))
            if specs:
                supervisor_config = setup.supervisor_config(self.config, self.io_arena)
                self.supervisor = Supervisor(specs, supervisor_config)
                await self.supervisor.start()
                await self.driver.attach_supervised(self.supervisor)
                self._count_restarts(self.supervisor)
            for remote in setup.remote_executors(self.config):
                address = str(remote.address)
                await self.driver.attach_executor(remote.name, address, token=remote.token)
        except (SupervisorError, LinkError, OSError) as error:
            raise StartError(f"executors: {error}") from error

    def _open_arena(self, local_executors: int) -> None:
        """The IO arena, handed to the request path (API, dispatcher), the metrics and, at
        spawn, the local executors. Raises StartError naming the key."""
        try:
            self.io_arena = setup.io_arena(self.config, local_executors)
        except ArenaError as error:
            raise StartError(f"server.io_arena_bytes: {error}") from error
        self.driver.dispatcher.use_arena(self.io_arena)
        if self.api is not None:
            self.api.io_arena = self.io_arena
        self.metrics.set_arena(self.io_arena)

    def _count_restarts(self, supervisor: Supervisor) -> None:
        for name in supervisor.children:
            self.metrics.track_executor(name)
        reconnect = supervisor.on_ready

        def on_ready(name: str, address: str) -> None:
            self.metrics.executor_restarted(name)
            reconnect(name, address)

        supervisor.on_ready = on_ready

    def _make_service(self, repository: Repository) -> None:
        self.service = DaemonService(
            self.driver, repository, self.metrics, setup.registration(self.config)
        )
        self.service.extra_stats = self._daemon_stats
        self.service.on_change = self._publish_status
        self.driver.executor_listeners.append(lambda *_: self._publish_status())

    async def _register_models(self, repository: Repository) -> None:
        assert self.service is not None
        if self._demo_cache_dir is not None:
            added = await asyncio.to_thread(
                setup.seed_demo_models, repository, self._demo_cache_dir
            )
            if added:
                log.info("demo models added to %s: %s", repository.root, ", ".join(added))
        report = await self.service.rescan()
        if not self.service.served:
            log.warning("no model registered; add one with `clockwork-async models add`")
        if report.failed or report.skipped:
            log.error("models not registered: %s", report.problems())

    def _open_repository(self) -> Repository:
        repository_config = self.config.repository
        return Repository(repository_config.path, repository_config.max_model_bytes)

    async def _bind_api(self) -> None:
        """Take the client API's address (connections wait until `_serve_api`). Raises
        StartError naming the key."""
        assert self.service is not None
        server = self.config.server
        self.api = api = setup.api_server(self.config, self.service, self.driver.dispatcher)
        try:
            context, tls = setup.server_tls(server)
            await api.bind(str(server.listen), ssl=context)
            self.front_ends = FrontEnds(
                api, self.config.http, self.config.grpc, ssl=context, tls_paths=tls
            )
            await self.front_ends.bind()
        except OSError as error:  # the server is CLOSED then: closing it returns at once
            raise StartError(
                f"server.listen = {server.listen}: the client API cannot listen there: {error}"
            ) from error
        except FrontEndError as error:
            raise StartError(str(error)) from error
        api.on_answer = self.metrics.observe_answer
        self.api_address = api.address
        self.metrics.set_snapshot_source(
            setup.snapshot_source(self.driver.snapshot, lambda: api.connection_count)
        )

    async def _serve_api(self) -> None:
        assert self.api is not None and self.front_ends is not None
        await self.api.serve()
        await self.front_ends.serve()

    async def _start_metrics(self) -> None:
        self._spawn(probe_loop_lag(self.metrics.observe_loop_lag))
        if not self.config.metrics.enabled:
            return
        self.endpoint = HttpEndpoint(self.registry, self._readiness)
        listen = self.config.metrics.listen
        try:
            host, port = await self.endpoint.start(listen.host, listen.port)
        except OSError as error:
            raise StartError(
                f"metrics.listen = {listen}: the metrics endpoint cannot listen there: {error}"
            ) from error
        self.metrics_address = str(TcpAddress(host, port))

    def _announce(self) -> None:
        assert self.service is not None
        models = _served_count(self.service)
        print(f"clockwork-async serving: {self._addresses(models)}", file=self._out, flush=True)
        self._status_sent = self._status_line()
        self._notifier.ready(self._status_sent)
        self._arm_watchdog()

    def _addresses(self, models: int) -> str:
        metrics = f"http://{self.metrics_address}/metrics" if self.metrics_address else "off"
        executors = len(self.config.executors)
        v2 = self.front_ends.describe() if self.front_ends is not None else ""
        return f"api={self.api_address} metrics={metrics}{v2} models={models} executors={executors}"

    def _status_line(self) -> str:
        """systemd's ``STATUS=`` while serving: ``/readyz``'s state, models and executors."""
        assert self.service is not None
        models = _served_count(self.service)
        executors = self.driver.snapshot().executors
        up = sum(executor.up for executor in executors)
        readiness = self._readiness()
        state = "serving" if readiness.ready else f"not ready ({readiness.reason}):"
        where = self._addresses(models)
        return f"{state} {models} models on {len(executors)} executors ({up} up) at {where}"

    def _publish_status(self) -> None:
        """Send ``STATUS=`` again if models, executors or readiness changed (after the start;
        while starting, the phase is the status)."""
        if self._state is not DaemonState.SERVING:
            return
        line = self._status_line()
        if line != self._status_sent:
            self._status_sent = line
            self._notifier.status(line)

    def _arm_watchdog(self) -> None:
        interval_s = self._notifier.watchdog_interval_s
        if interval_s is None or self._state is DaemonState.STOPPED:
            return  # pings go on while draining: systemd still watches a stopping service
        self._notifier.watchdog()
        self._watchdog = asyncio.get_running_loop().call_later(interval_s, self._arm_watchdog)

    # --- serving ---------------------------------------------------------------------------------

    def _readiness(self) -> Readiness:
        if self._state is DaemonState.STARTING or self.service is None:
            return Readiness(False, self._phase)
        health = self.service.health()
        return Readiness(health.ready, health.reason)

    def _daemon_stats(self) -> dict[str, object]:
        return {
            "state": self._state.value,
            "uptime_s": round(time.monotonic() - self._started_s, 3),
            "api": self.api.snapshot() if self.api is not None else {},
            "api_address": self.api_address,
            "metrics_address": self.metrics_address,
            "controller_cpu": self.controller_cpu,
        }

    async def _rescan(self) -> None:
        assert self.service is not None
        report = await self.service.rescan()
        log.info("rescan: %s", report.summary())

    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # --- stop ------------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Drain (bounded; skipped when forced), then stop everything that was started."""
        self._enter(DaemonState.DRAINING)
        if self.service is not None:
            self.service.accepting = False
        self._notifier.stopping(f"draining {self.driver.snapshot().outstanding} requests")
        if self.service is not None:  # nothing of a registration cut short stays anywhere
            stopping = self.service.cancel_registrations("the daemon is shutting down")
            await self._until_forced(stopping)
        await self._drain()
        await self._stop_all()
        self._enter(DaemonState.STOPPED)

    async def _drain(self) -> None:
        """Let in-flight requests finish (new ones are answered ``shutting_down``) for up to
        the drain timeout, then answer the rest; the API server flushes their replies."""
        drain_s = self.config.server.limits.drain_timeout_s
        closing: list[asyncio.Future[None]] = []
        if self.api is not None:
            closing.append(asyncio.ensure_future(self.api.close(drain_s + FLUSH_MARGIN_S)))
        if self.front_ends is not None:
            closing.append(asyncio.ensure_future(self.front_ends.close(drain_s + FLUSH_MARGIN_S)))
        await self._until_forced(self.driver.drain(drain_s))
        if self._force.is_set():
            await self.driver.close()  # answers everything left, at once
        if closing:
            await asyncio.gather(*closing)

    async def _until_forced(self, work: Coroutine[Any, Any, None]) -> None:
        """Await ``work`` unless a second stop request comes first (then cancel it)."""
        task = asyncio.ensure_future(work)
        forced = asyncio.ensure_future(self._force.wait())
        await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _stop_all(self) -> None:
        """Close the API, background tasks, the metrics endpoint, the driver and executors."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.api is not None:
            await self.api.close(0.0)
        if self.front_ends is not None:
            await self.front_ends.close(0.0)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.endpoint is not None:
            await self.endpoint.close()
        await self.driver.close()
        if self.supervisor is not None:
            await self.supervisor.close(force=self._force.is_set())
        if self.io_arena is not None:
            self.io_arena.close()  # no executor maps it any more; its memory goes with the fd


def _served_count(service: DaemonService) -> int:
    """Model instances served (registrations still running or failed are not)."""
    return sum(status.state in ("ready", "loaded") for status in service.list_models())
