"""Client batches on the msgpack API, against the fake service: a request of N rows is N
one-row requests (`api.rows`) answered once, with outputs stacked in order; at most the
model's largest batch of rows (more: ``bad_input`` naming the limit); a refused row refuses
the whole answer and cancels the rest; a cancel or a disconnect cancels every row; with an IO
arena the rows are parts of the request's one slot, released once."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest_asyncio

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.api.server import ApiServer, ServerLimits
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.wire.messages import InferRequest

from .conftest import eventually, raw_client
from .fakes import FakeService

ROWS_3 = np.arange(12, dtype=np.float32).reshape(3, 4)


async def test_a_batch_is_submitted_as_rows_and_answered_stacked(
    client: AsyncClient, server: ApiServer, service: FakeService
) -> None:
    result = await client.infer("echo", {"x": ROWS_3}, slo_ms=30)
    assert result.ok, result
    np.testing.assert_array_equal(result.outputs["y"], 2 * ROWS_3)
    assert [s.inputs["x"].tolist() for s in service.submitted] == [[row] for row in ROWS_3.tolist()]
    assert {s.slo_ns for s in service.submitted} == {30_000_000}
    assert service.flushes == [3]  # the rows reach the request path together
    assert server.outstanding == 0


async def test_more_rows_than_the_largest_batch_are_bad_input(
    client: AsyncClient, service: FakeService
) -> None:
    refused = await client.infer("echo", {"x": np.zeros((5, 4), np.float32)})
    assert refused.status == "bad_input", refused
    assert "limit of 4 rows" in refused.message and "'echo'" in refused.message
    assert not service.submitted
    assert (await client.infer("echo", {"x": np.zeros((4, 4), np.float32)})).ok  # at the limit


async def test_a_refused_row_refuses_the_answer_and_cancels_the_others(
    client: AsyncClient, server: ApiServer, service: FakeService
) -> None:
    pending = client.start_infer("hold", {"x": ROWS_3})
    await eventually(lambda: len(service.held) == 3)
    first, second, third = sorted(service.held)
    service.release(first)
    service.release(second, Outcome.INFEASIBLE)
    result = await pending
    assert result.status == "infeasible" and not result.outputs, result
    assert service.cancelled == [first, second, third]  # only the third was still held
    assert all(service.answers[s.service_id] == 1 for s in service.submitted)
    assert server.outstanding == 0


async def test_a_cancel_and_a_disconnect_cancel_every_row(
    server: ApiServer, service: FakeService
) -> None:
    async with AsyncClient(server.address) as client:
        pending = client.start_infer("hold", {"x": ROWS_3})
        await eventually(lambda: len(service.held) == 3)
        pending.cancel()
        result = await pending
        assert result.status == "cancelled", result
        assert not service.held
    await _reset_mid_batch(server, service)
    await eventually(lambda: not service.held and server.outstanding == 0)
    assert len(service.cancelled) == 6  # 3 by the cancel, 3 by the reset
    assert all(count == 1 for count in service.answers.values())


async def _reset_mid_batch(server: ApiServer, service: FakeService) -> None:
    """A client sends a batch of 3 rows to ``hold`` and resets its connection (a half-close
    would be answered: tests/api/test_half_close.py)."""
    connection = await raw_client(server.address)
    connection.send(InferRequest(1, "hold", {"x": ROWS_3}))
    await eventually(lambda: len(service.held) == 3)
    sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.abort()


@pytest_asyncio.fixture
async def arena() -> AsyncIterator[IoArena]:
    arena = IoArena(64 * 1024)
    yield arena
    arena.close()


@pytest_asyncio.fixture
async def arena_server(service: FakeService, arena: IoArena) -> AsyncIterator[ApiServer]:
    api = ApiServer(service, limits=ServerLimits(io_arena_min_bytes=0))  # tiny rows too
    api.io_arena = arena
    await api.start("127.0.0.1:0")
    yield api
    await api.close(0.5)


async def test_rows_are_parts_of_the_one_slot_released_once(
    arena_server: ApiServer, service: FakeService, arena: IoArena
) -> None:
    async with AsyncClient(arena_server.address) as client:
        pending = client.start_infer("hold", {"x": ROWS_3})
        await eventually(lambda: len(service.held) == 3)
        assert arena.live_slots == 1
        parts = [s.slot for s in service.submitted]
        assert all(isinstance(part, Slot) for part in parts) and len(set(map(id, parts))) == 3
        offsets = [arena.offset_of(s.inputs["x"]) for s in service.submitted]
        first = offsets[0]
        assert first is not None and offsets == [first, first + 16, first + 32]  # no copy
        for service_id in sorted(service.held):
            service.release(service_id)
        result = await pending
        assert result.ok and result.outputs["y"].shape == (3, 4), result
        await eventually(lambda: arena.used_bytes == 0)
    await _reset_mid_batch(arena_server, service)
    await eventually(lambda: not service.held and arena.used_bytes == 0)
    assert arena.live_slots == 0
