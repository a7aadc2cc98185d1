"""Remote executors whose TCP link is cut, or silently partitioned, while an INFER runs, then
restored: through a loopback proxy each test controls (`tcp_proxy.TcpProxy`).

Two remote executors, each behind its own proxy; the one running the batch loses its link.
Asserted: every request answered exactly once (the one whose deadline allows re-planned onto
the other executor and ``ok``, the other a named failure), the link re-established by the
driver's backoff (a reconnect, not a restart: the process never stopped), and the executor
serving again with the model it kept loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clockwork_async.core.outcomes import Outcome
from clockwork_async.demo import start_executor
from clockwork_async.runtime.driver import Driver
from runtime.support import SIM_ARGS, ExecutorProcess, new_driver

from .support import (
    SLOW_INFER,
    TIGHT_ENDINGS,
    Replies,
    busy_executor,
    executor,
    register,
    wait_until,
    write_profiles,
)
from .tcp_proxy import TcpProxy

ROOMY_SLO_MS = 20_000.0
TIGHT_SLO_MS = 230.0  # LOAD 2 ms + INFER 200 ms + margin: hopeless once the INFER ran 50 ms
INFER_INTO_S = 0.05
NAMES = ("remote0", "remote1")
LINK = {
    "heartbeat_interval_ms": 50.0,
    "heartbeat_miss_limit": 6,  # down after 0.325 s of silence
    "connect_timeout_s": 0.5,  # and again the handshake
}


def start_tcp_executor(name: str, profile_file: Path) -> ExecutorProcess:
    """A simulated executor on a free loopback TCP port; returns once it printed ``ready``."""
    listen = ["--name", name, "--listen", "tcp:127.0.0.1:0"]
    return start_executor([*SIM_ARGS, "--profile-file", str(profile_file), *listen])


@dataclass
class Remote:
    process: ExecutorProcess
    proxy: TcpProxy


@dataclass
class Setup:
    driver: Driver
    remotes: dict[str, Remote]


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    profiles = write_profiles(tmp_path)
    remotes: dict[str, Remote] = {}
    driver = new_driver(**LINK)
    try:
        for name in NAMES:
            process = start_tcp_executor(name, profiles)
            host, port = process.address.removeprefix("tcp:").rsplit(":", 1)
            remotes[name] = Remote(process, TcpProxy(host, int(port)))
            await driver.attach_executor(name, await remotes[name].proxy.start())
        await register(driver, SLOW_INFER)
        yield Setup(driver, remotes)
    finally:
        await driver.close()
        for remote in remotes.values():
            await remote.proxy.close()
            assert remote.process.stop() == 0  # it drained cleanly: it never died


async def _fault_during_infer(setup: Setup, inject: str) -> None:
    """Run two requests in one INFER, break the busy executor's link with ``inject`` (a
    TcpProxy method), restore it once the link is down and a reconnect was refused, and
    check every outcome."""
    driver = setup.driver
    replies = Replies()
    roomy = replies.submit(driver, SLOW_INFER, 1.0, ROOMY_SLO_MS)
    tight = replies.submit(driver, SLOW_INFER, 2.0, TIGHT_SLO_MS)
    await wait_until(lambda: driver.snapshot().running > 0, "an INFER to run")
    victim = busy_executor(driver)
    proxy = setup.remotes[victim].proxy
    await asyncio.sleep(INFER_INTO_S)
    getattr(proxy, inject)()
    accepted = proxy.accepted
    await wait_until(lambda: not executor(driver, victim).up, "the link to go down")
    await wait_until(lambda: proxy.accepted > accepted, "a reconnect attempt, refused")
    proxy.restore()
    await wait_until(lambda: executor(driver, victim).up, "the link to come back")
    await replies.wait_for(2, timeout_s=30.0)
    replies.check_each_answered_once()
    assert replies.outcome(roomy) is Outcome.OK  # re-planned onto the other executor
    assert replies.outcome(tight) in TIGHT_ENDINGS
    state = executor(driver, victim)
    assert state.reconnects == 1 and state.restarts == 0
    assert SLOW_INFER in state.loaded  # the process kept its warm copy across the cut
    await _served_by(driver, replies, victim)


async def _served_by(driver: Driver, replies: Replies, victim: str) -> None:
    """The reconnected executor serves again: take the other one away, then ask."""
    other = next(name for name in NAMES if name != victim)
    await driver.detach_executor(other)
    again = replies.submit(driver, SLOW_INFER, 3.0, ROOMY_SLO_MS)
    await replies.wait_for(len(replies.deadlines_ns), timeout_s=30.0)
    replies.check_each_answered_once()
    assert replies.outcome(again) is Outcome.OK
    assert replies.outcomes[again].executor_id == victim


async def test_a_link_reset_during_infer_is_replanned_and_reconnected(setup: Setup) -> None:
    await _fault_during_infer(setup, "cut")


async def test_a_silent_partition_is_found_by_heartbeats_and_reconnected(setup: Setup) -> None:
    await _fault_during_infer(setup, "blackhole")
