"""The IO arena in a running daemon (one simulated executor process): the executor maps the
daemon's memfd and proves it with the arena's token; nothing is named in /dev/shm; requests'
tensors travel through slots; and occupancy returns to zero after every case."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.daemon.lifecycle import Daemon, DaemonState
from clockwork_async.ioarena.shared import IoArena
from clockwork_async.wire.messages import Infer, Message
from hostile.support import RawClient, infer_frame, infer_frames

from .harness import add_tiny
from .test_daemon_inprocess import sim_daemon

# Tiny's rows are 64 bytes, under the default server.io_arena_min_bytes: these tests
# want every request with tensor bytes in the arena.
ARENA_FOR_ALL = {"server.io_arena_min_bytes": "0"}


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path, **{"metrics.enabled": "false", **ARENA_FOR_ALL})
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    yield daemon
    daemon.request_stop()
    assert await run == 0


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


async def test_the_local_executor_maps_the_arena_and_nothing_is_named(daemon: Daemon) -> None:
    arena = daemon.io_arena
    assert arena is not None and arena.capacity_bytes >= 1 << 20
    supervisor = daemon.supervisor
    assert supervisor is not None
    (name, child) = next(iter(supervisor.children.items()))
    joined = daemon.driver.dispatcher.joined(name)
    assert joined is not None and joined.info.io_arena == arena.token
    maps = Path(f"/proc/{child.pid}/maps").read_text()
    assert "/memfd:clockwork-io-arena" in maps
    assert not any("clockwork" in entry for entry in _shm_names())


async def _until_empty(arena: IoArena, timeout_s: float = 5.0) -> None:
    """Occupancy back to zero (a reply's slot goes once its bytes left the process)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while arena.used_bytes and loop.time() < give_up:
        await asyncio.sleep(0.01)
    assert arena.used_bytes == 0 and arena.live_slots == 0, (arena.used_bytes, arena.live_slots)


def _spy_infers(daemon: Daemon) -> list[Infer]:
    """Every INFER the dispatcher sends from now on."""
    supervisor = daemon.supervisor
    assert supervisor is not None
    joined = daemon.driver.dispatcher.joined(next(iter(supervisor.children)))
    assert joined is not None
    sent: list[Infer] = []
    send = joined.link.send_action

    def spy(message: Message, action_id: int, on_result: Any) -> None:
        if isinstance(message, Infer):
            sent.append(message)
        send(message, action_id, on_result)

    joined.link.send_action = spy  # type: ignore[method-assign]
    return sent


async def test_tensors_go_by_reference_and_every_slot_comes_back(daemon: Daemon) -> None:
    arena = daemon.io_arena
    assert arena is not None
    async with AsyncClient(daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=2_000)
        assert warm.ok, warm  # the LOAD
        sent = _spy_infers(daemon)
        rows = [np.full((1, 4), float(i), np.float32) for i in range(40)]
        results = await asyncio.gather(
            *(client.infer("tiny", {"input": row}, slo_ms=2_000) for row in rows)
        )
    assert all(result.ok for result in results), [r.message for r in results if not r.ok]
    for i, result in enumerate(results):
        assert result.outputs["output"].shape == (1, 1000)
        assert result.outputs["output"][0, 0] == float(i)  # its own row, from its own slot
        assert result.outputs["output"][0, 1] == 1.0
    assert sent and all(m.arena_inputs and m.arena_outputs and not m.inputs for m in sent)
    await _until_empty(arena)


async def test_a_row_under_io_arena_min_bytes_goes_as_bytes(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path, **{"metrics.enabled": "false"})  # the default threshold
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    try:
        arena = _arena(daemon)
        async with AsyncClient(daemon.api_address) as client:
            warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=2_000)
            assert warm.ok, warm  # the LOAD
            sent = _spy_infers(daemon)
            result = await client.infer("tiny", {"input": np.full((1, 4), 3.0, np.float32)})
        assert result.ok and result.outputs["output"][0, 0] == 3.0, result
        (infer,) = sent
        assert infer.inputs and not infer.arena_inputs and not infer.arena_outputs
        assert arena.used_bytes == 0 and arena.live_slots == 0 and arena.refusals.total() == 0
    finally:
        daemon.request_stop()
        assert await run == 0


# tiny-sim's 0.5 ms execute becomes 20 ms: a batch is in the executor's hands a while (more
# would make registration's profiling slow).
SLOW_EXECUTORS = (
    '[{backend = "simulated", page_bytes = 1048576, weights_bytes = 16777216, slowdown = 40.0}]'
)


@pytest.fixture
async def slow_daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    add_tiny(tmp_path / "models")
    settings = {"metrics.enabled": "false", "executors": SLOW_EXECUTORS, **ARENA_FOR_ALL}
    daemon = sim_daemon(tmp_path, **settings)
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    yield daemon
    daemon.request_stop()
    assert await run in (0, 1)


def _arena(daemon: Daemon) -> IoArena:
    assert daemon.io_arena is not None
    return daemon.io_arena


async def test_a_client_gone_mid_tensor_leaves_nothing(daemon: Daemon) -> None:
    arena = _arena(daemon)
    whole = infer_frame(1, 1.0)

    def cut_short() -> None:
        with RawClient(daemon.api_address) as raw:
            assert raw.hello()["t"] == "hello"
            raw.send(whole[:-8])  # the header and half of its tensor
            time.sleep(0.2)  # the daemon has read it into a slot

    await asyncio.to_thread(cut_short)
    await _until_empty(arena)
    assert arena.live_slots == 0


async def test_a_client_that_never_reads_its_replies_holds_only_until_it_goes(
    daemon: Daemon,
) -> None:
    arena = _arena(daemon)
    async with AsyncClient(daemon.api_address) as client:  # the LOAD first
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=5_000)
        assert warm.ok, warm
    answered = daemon.driver.dispatcher.book.outcomes

    def flood_without_reading() -> None:
        with RawClient(daemon.api_address) as raw:
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            assert raw.hello()["t"] == "hello"
            before = sum(answered.values())
            raw.send(infer_frames(200))
            deadline = time.monotonic() + 20
            while sum(answered.values()) < before + 200 and time.monotonic() < deadline:
                time.sleep(0.05)  # the daemon answers; nobody reads the replies

    await asyncio.to_thread(flood_without_reading)
    await _until_empty(arena)


async def test_an_executor_killed_with_slots_in_its_hands_gives_them_back(
    slow_daemon: Daemon,
) -> None:
    arena = _arena(slow_daemon)
    supervisor = slow_daemon.supervisor
    assert supervisor is not None
    child = next(iter(supervisor.children.values()))
    async with AsyncClient(slow_daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
        assert warm.ok, warm
        sent = _spy_infers(slow_daemon)
        rows = [np.full((1, 4), float(i), np.float32) for i in range(8)]
        pending = [
            asyncio.ensure_future(client.infer("tiny", {"input": row}, slo_ms=20_000))
            for row in rows
        ]
        while not sent:
            await asyncio.sleep(0.005)
        assert child.pid is not None and arena.used_bytes
        os.kill(child.pid, signal.SIGKILL)  # mid-INFER: its slots are in the executor's hands
        results = await asyncio.gather(*pending)
    assert {r.status for r in results} <= {"ok", "failed", "dropped", "infeasible"}, results
    for i, result in enumerate(results):
        if result.ok:
            assert result.outputs["output"][0, 0] == float(i)
    await _until_empty(arena)


async def test_cancelled_requests_give_their_slots_back(slow_daemon: Daemon) -> None:
    arena = _arena(slow_daemon)
    async with AsyncClient(slow_daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
        assert warm.ok, warm
        pending = [
            client.start_infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
            for _ in range(20)
        ]
        await asyncio.sleep(0.05)  # some running, most queued behind them
        for infer in pending:
            infer.cancel()
        results = await asyncio.gather(*pending)
    statuses = {r.status for r in results}
    assert "cancelled" in statuses and statuses <= {"ok", "cancelled"}, statuses
    await _until_empty(arena)


async def test_a_drain_with_slots_in_use_answers_all_and_frees_all(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    settings = {"metrics.enabled": "false", "executors": SLOW_EXECUTORS, **ARENA_FOR_ALL}
    daemon = sim_daemon(tmp_path, **{**settings, "server.drain_timeout_s": "0.1"})
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    arena = _arena(daemon)
    async with AsyncClient(daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
        assert warm.ok, warm
        pending = [
            client.start_infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
            for _ in range(30)
        ]
        await asyncio.sleep(0.05)
        assert arena.used_bytes
        daemon.request_stop()
        results = await asyncio.gather(*pending)
    assert await run == 0
    assert {r.status for r in results} <= {"ok", "shutting_down"}, {r.status for r in results}
    assert arena.used_bytes == 0 and arena.live_slots == 0


async def test_a_frame_larger_than_a_request_may_hold_is_refused_before_its_bytes(
    tmp_path: Path,
) -> None:
    add_tiny(tmp_path / "models")
    settings = {"metrics.enabled": "false", "server.io_arena_bytes": str(1 << 20), **ARENA_FOR_ALL}
    daemon = sim_daemon(tmp_path, **settings)
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.state is DaemonState.SERVING, await run
    arena = _arena(daemon)
    try:
        async with AsyncClient(daemon.api_address) as client:
            huge = {"input": np.zeros((1, 200_000), np.float32)}  # 800 KB > half of 1 MiB
            refused = await client.infer("tiny", huge)
            assert refused.status == "bad_input", refused
            assert "one request may hold at most" in refused.message
            assert arena.refusals["too_large"] == 1 and arena.used_bytes == 0
            fine = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=5_000)
            assert fine.ok, fine  # the same connection goes on
    finally:
        daemon.request_stop()
        assert await run == 0
    assert arena.used_bytes == 0
