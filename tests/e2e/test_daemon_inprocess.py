"""`Daemon.run` on the test's own event loop: the paths a subprocess cannot show cheaply (a stop
that arrives while starting, signal handlers and the CPU affinity put back, the lifecycle's
guarded transitions)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clockwork_async.config.daemon import MachineFacts, load_config
from clockwork_async.daemon.lifecycle import Daemon, DaemonState

from .harness import add_tiny, children

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def sim_daemon(folder: Path, **settings: str) -> Daemon:
    overrides = {
        "server.listen": "127.0.0.1:0",
        "metrics.listen": "127.0.0.1:0",
        "http.listen": "127.0.0.1:0",
        "grpc.listen": "127.0.0.1:0",
        "repository.path": str(folder / "models"),
        "repository.profile_cache_dir": str(folder / "profiles"),
        "executors": '[{backend = "simulated", page_bytes = 1048576, weights_bytes = 16777216}]',
        **settings,
    }
    machine = MachineFacts(tuple(sorted(os.sched_getaffinity(0))), 1 << 30)
    config = load_config(None, {}, overrides, machine=machine)
    return Daemon(config, out=io.StringIO())


async def test_a_stop_while_starting_stops_cleanly_and_restores_signal_handlers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path)
    before = {signum: signal.getsignal(signum) for signum in HANDLED_SIGNALS}
    run = asyncio.ensure_future(daemon.run())
    while daemon.supervisor is None and not run.done():  # its executor is being started
        await asyncio.sleep(0.005)
    assert daemon.state is DaemonState.STARTING
    daemon.request_stop()
    assert await run == 0
    assert state_of(daemon) is DaemonState.STOPPED
    assert "stopped while starting" in caplog.text
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert not children(os.getpid())  # even one spawned as the stop came was stopped


@pytest.mark.parametrize("key", ["server.listen", "metrics.listen"])
async def test_a_busy_port_fails_the_start_before_any_executor_is_spawned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    add_tiny(tmp_path / "models")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        daemon = sim_daemon(tmp_path, **{key: address})
        assert await daemon.run() == 1
    assert daemon.supervisor is None  # no executor was spawned
    assert f"{key} = {address}: the" in caplog.text and "cannot listen there" in caplog.text
    assert state_of(daemon) is DaemonState.STOPPED


async def test_a_served_daemon_stops_on_request_and_reports_its_addresses(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    affinity = os.sched_getaffinity(0)
    daemon = sim_daemon(tmp_path)
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    assert daemon.api_address.startswith("127.0.0.1:")
    assert daemon.service is not None and set(daemon.service.served) == {"tiny"}
    # The controller is pinned to the lowest CPU (its executor is not pinned), and the
    # executor keeps every CPU the daemon had.
    assert daemon.controller_cpu == min(affinity)
    assert os.sched_getaffinity(0) == {min(affinity)}
    assert daemon.supervisor is not None
    (executor,) = daemon.supervisor.children.values()
    assert executor.pid is not None and os.sched_getaffinity(executor.pid) == affinity
    daemon.request_stop()
    assert await run == 0
    assert state_of(daemon) is DaemonState.STOPPED
    assert not children(os.getpid())
    assert os.sched_getaffinity(0) == affinity  # put back


async def serving(daemon: Daemon) -> asyncio.Future[int]:
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    return run


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU for the executor")
async def test_a_controller_with_a_cpu_of_its_own_busy_polls_on_it(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    cpus = sorted(os.sched_getaffinity(0))
    executor = f'{{backend = "simulated", cpus = [{cpus[-1]}], weights_bytes = 16777216}}'
    daemon = sim_daemon(tmp_path, executors=f"[{executor}]", **{"server.busy_poll_us": "250"})
    run = await serving(daemon)
    assert daemon.controller_cpu == cpus[0]
    assert daemon.driver.snapshot().busy_poll.window_ns == 250_000
    daemon.request_stop()
    assert await run == 0


async def test_a_controller_that_may_share_its_cpu_does_not_busy_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_tiny(tmp_path / "models")
    caplog.set_level(logging.INFO, logger="clockwork_async")
    for settings in ({}, {"server.pin_controller": "false"}):  # an unpinned executor; no pin
        caplog.clear()
        daemon = sim_daemon(tmp_path, **settings)
        run = await serving(daemon)
        assert daemon.driver.snapshot().busy_poll.window_ns == 0
        assert "busy polling off" in caplog.text
        daemon.request_stop()
        assert await run == 0


async def test_pinning_the_controller_can_be_turned_off(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    affinity = os.sched_getaffinity(0)
    daemon = sim_daemon(tmp_path, **{"server.pin_controller": "false"})
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    assert daemon.controller_cpu is None and os.sched_getaffinity(0) == affinity
    daemon.request_stop()
    assert await run == 0


async def test_readyz_says_why_while_starting_and_the_api_accepts_only_once_serving(
    tmp_path: Path,
) -> None:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path)
    gate = asyncio.Event()
    start_executors = daemon._start_executors

    async def held(cpus: tuple[int, ...]) -> None:
        await gate.wait()
        await start_executors(cpus)

    daemon._start_executors = held  # type: ignore[method-assign]
    run = asyncio.ensure_future(daemon.run())
    while not daemon.metrics_address and not run.done():
        await asyncio.sleep(0.01)
    try:
        assert await asyncio.to_thread(http_get, daemon.metrics_address, "/readyz") == (
            503,
            "not ready: starting executors\n",
        )
        host, port = daemon.api_address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):  # bound, not accepting yet
            await asyncio.open_connection(host, int(port))
    finally:
        gate.set()
    while state_of(daemon) is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert await asyncio.to_thread(http_get, daemon.metrics_address, "/readyz") == (200, "ready\n")
    daemon.request_stop()
    assert await run == 0


def http_get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_impossible_transitions_raise(tmp_path: Path) -> None:
    daemon = sim_daemon(tmp_path)
    with pytest.raises(RuntimeError, match="STARTING to STOPPED"):
        daemon._enter(DaemonState.STOPPED)


def state_of(daemon: Daemon) -> DaemonState:
    """The daemon's state now (a call, so type checkers do not narrow it across awaits)."""
    return daemon.state
