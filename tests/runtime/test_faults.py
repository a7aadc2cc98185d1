"""Executor faults under a supervisor: SIGKILL mid-run, a hung process, a wrong token.

Every request must be answered exactly once, whatever happens to its executor, and the
executor must come back (restarted by the supervisor, re-joined by the driver). Outcomes are
asserted, never recovery times.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.driver import Driver
from clockwork_async.runtime.executor_link import LinkError
from clockwork_async.runtime.supervisor import ExecutorSpec, Supervisor, SupervisorConfig

from .support import Collector, deadline_in, new_driver, sim_row, start_executor

TOKEN = "test-token-0123456789"
SIM_SPEC = ExecutorSpec(
    "sim0",
    backend="simulated",
    page_bytes=1 << 20,
    weights_bytes=16 << 20,
    token=TOKEN,
)
FAST_RESTART = SupervisorConfig(backoff=BackoffConfig(initial_s=0.0, max_s=0.5, healthy_s=5.0))
EVERY_OUTCOME = ACCEPTED_ENDINGS | REJECTED_AT_ARRIVAL


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    supervisor = Supervisor([SIM_SPEC], FAST_RESTART)
    await supervisor.start()
    try:
        yield supervisor
    finally:
        await supervisor.close()
    assert all(
        child.process is None or child.process.returncode is not None
        for child in supervisor.children.values()
    )


async def _wait_rejoined(driver: Driver, restarts: int, timeout_s: float = 20.0) -> None:
    async def rejoined() -> None:
        while True:
            (executor,) = driver.snapshot().executors
            if executor.up and executor.restarts >= restarts:
                return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(rejoined(), timeout_s)


async def _stream(driver: Driver, replies: Collector, count: int, start: int = 0) -> list[int]:
    ids = []
    for value in range(start, start + count):
        ids.append(
            driver.submit("tiny", sim_row(value), deadline_ns=deadline_in(1_000), on_reply=replies)
        )
        await asyncio.sleep(0.001)
    return ids


async def test_sigkill_mid_run_answers_everything_once_and_restarts(
    supervisor: Supervisor,
) -> None:
    driver = new_driver()
    try:
        await driver.attach_supervised(supervisor)
        await driver.register_model("tiny", "tiny-sim")
        replies = Collector()
        ids = await _stream(driver, replies, 60)
        pid = supervisor.children["sim0"].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        ids += await _stream(driver, replies, 60, start=60)
        await replies.wait_for(len(ids), timeout_s=20.0)
        assert set(replies.outcomes) == set(ids)
        assert replies.duplicates == []
        assert set(replies.counts()) <= EVERY_OUTCOME
        await _wait_rejoined(driver, restarts=1)
        after = await _stream(driver, replies, 20, start=1_000)
        await replies.wait_for(len(ids) + len(after))
        assert {replies.outcomes[i].outcome for i in after} == {Outcome.OK}
        assert supervisor.children["sim0"].restarts == 1
    finally:
        await driver.close()


async def test_hung_executor_is_detected_killed_and_restarted(supervisor: Supervisor) -> None:
    driver = new_driver(heartbeat_interval_ms=50.0, heartbeat_miss_limit=6)
    try:
        await driver.attach_supervised(supervisor)
        await driver.register_model("tiny", "tiny-sim")
        replies = Collector()
        pid = supervisor.children["sim0"].pid
        assert pid is not None
        ids = await _stream(driver, replies, 20)
        os.kill(pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
        ids += await _stream(driver, replies, 20, start=20)
        await replies.wait_for(len(ids), timeout_s=20.0)
        assert replies.duplicates == []
        await _wait_rejoined(driver, restarts=1)
        assert supervisor.children["sim0"].pid != pid
        after = await _stream(driver, replies, 10, start=1_000)
        await replies.wait_for(len(ids) + len(after))
        assert {replies.outcomes[i].outcome for i in after} == {Outcome.OK}
    finally:
        await driver.close()


async def test_wrong_token_is_refused(supervisor: Supervisor) -> None:
    driver = new_driver()
    try:
        address = supervisor.children["sim0"].address
        with pytest.raises(LinkError, match="unauthorized"):
            await driver.attach_executor("sim0", address, token="not-the-token-at-all")
        await driver.attach_executor("sim0", address, token=TOKEN)
        assert driver.snapshot().executors[0].up
    finally:
        await driver.close()


async def test_a_remote_executor_that_comes_back_is_reconnected(tmp_path: Path) -> None:
    socket_path = tmp_path / "remote.sock"
    first = start_executor(socket_path, "remote")
    second = None
    driver = new_driver()
    try:
        await driver.attach_executor("remote", first.address)
        await driver.register_model("tiny", "tiny-sim")
        first.process.kill()  # nobody restarts it: the link keeps retrying with backoff
        first.stop()
        await asyncio.sleep(0.2)
        assert not driver.snapshot().executors[0].up
        replies = Collector()
        down = driver.submit("tiny", sim_row(1), deadline_ns=deadline_in(50), on_reply=replies)
        await replies.wait_for(1)
        assert replies.outcomes[down].outcome in EVERY_OUTCOME - {Outcome.OK}
        second = start_executor(socket_path, "remote")  # a new process: nothing registered
        for _ in range(500):
            if driver.snapshot().executors[0].up:
                break
            await asyncio.sleep(0.02)
        (executor,) = driver.snapshot().executors
        assert executor.up and executor.reconnects == 1 and executor.restarts == 0
        ok = driver.submit("tiny", sim_row(2), deadline_ns=deadline_in(1_000), on_reply=replies)
        await replies.wait_for(2)
        assert replies.outcomes[ok].outcome is Outcome.OK  # re-registered on re-join
    finally:
        await driver.close()
        first.stop()
        if second is not None:
            assert second.stop() == 0
