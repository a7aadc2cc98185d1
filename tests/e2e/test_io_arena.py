"""The IO arena in a running daemon (one simulated executor process): the executor maps the
daemon's memfd and proves it with the arena's token; nothing is named in /dev/shm; requests'
tensors travel through slots; and occupancy returns to zero after every case."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clockwork_async.daemon import Daemon, DaemonState

from .harness import add_tiny
from .test_daemon_inprocess import sim_daemon


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path, **{"metrics.enabled": "false"})
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
