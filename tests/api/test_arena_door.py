"""The API session and the IO arena: a request's tensors are read into a slot leased from its
header; no room is a named refusal from the header (``overloaded`` with its cause, or
``bad_input`` for a request larger than a connection's share), never a wait; and every slot
comes back (answered, cancelled, or its connection gone)."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest_asyncio

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.api.server import ApiServer, ServerLimits
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.wire.messages import InferRequest

from .conftest import eventually, raw_client
from .fakes import FakeService

KIB = 1024
ROW_14K = np.zeros((1, 3584), np.float32)  # 14 KiB: two fit a connection's 32 KiB share


@pytest_asyncio.fixture
async def arena() -> AsyncIterator[IoArena]:
    arena = IoArena(64 * KIB, owner_share=0.5)  # one connection: 32 KiB
    yield arena
    arena.close()


@pytest_asyncio.fixture
async def server(service: FakeService, arena: IoArena) -> AsyncIterator[ApiServer]:
    api = ApiServer(service, limits=ServerLimits(io_arena_min_bytes=0))  # tiny rows too
    api.io_arena = arena
    await api.start("127.0.0.1:0")
    yield api
    await api.close(0.5)


@pytest_asyncio.fixture
async def default_server(service: FakeService, arena: IoArena) -> AsyncIterator[ApiServer]:
    api = ApiServer(service)  # io_arena_min_bytes: 16 KiB
    api.io_arena = arena
    await api.start("127.0.0.1:0")
    yield api
    await api.close(0.5)


async def test_a_request_under_io_arena_min_bytes_is_read_as_bytes(
    default_server: ApiServer, service: FakeService, arena: IoArena
) -> None:
    assert default_server.limits.io_arena_min_bytes == 16 * KIB
    under = np.ones((1, 4 * KIB - 4), np.float32)  # 16 bytes short of 16 KiB
    at = np.ones((1, 4 * KIB), np.float32)  # 16 KiB
    async with AsyncClient(default_server.address) as client:
        held = client.start_infer("hold", {"x": under})
        await eventually(lambda: len(service.held) == 1)
        (submitted,) = service.submitted
        assert submitted.slot is None and arena.offset_of(submitted.inputs["x"]) is None
        assert arena.used_bytes == 0 and arena.live_slots == 0
        held.cancel()
        assert (await held).status == "cancelled"
        held = client.start_infer("hold", {"x": at})
        await eventually(lambda: len(service.held) == 1)
        submitted = service.submitted[1]
        assert isinstance(submitted.slot, Slot)
        assert arena.offset_of(submitted.inputs["x"]) == submitted.slot.offset
        assert arena.used_bytes >= 16 * KIB
        held.cancel()
        assert (await held).status == "cancelled"
    await eventually(lambda: arena.used_bytes == 0)


async def test_tensors_land_in_a_slot_that_is_released_after_the_reply(
    server: ApiServer, service: FakeService, arena: IoArena
) -> None:
    async with AsyncClient(server.address) as client:
        result = await client.infer("echo", {"x": np.ones((1, 4), np.float32)})
    assert result.ok
    (submitted,) = service.submitted
    assert isinstance(submitted.slot, Slot)
    assert arena.offset_of(submitted.inputs["x"]) == submitted.slot.offset
    await eventually(lambda: arena.used_bytes == 0)


async def test_share_full_and_too_large_are_refused_from_the_header(
    server: ApiServer, service: FakeService, arena: IoArena
) -> None:
    async with (
        AsyncClient(server.address) as first,
        AsyncClient(server.address) as second,
        AsyncClient(server.address) as third,
    ):
        held = [first.start_infer("hold", {"x": ROW_14K}) for _ in range(2)]
        over_share = await first.infer("hold", {"x": ROW_14K})
        assert over_share.status == "overloaded", over_share
        assert "this connection holds" in over_share.message
        held += [second.start_infer("hold", {"x": ROW_14K}) for _ in range(2)]
        await eventually(lambda: len(service.held) == 4)
        full = await third.infer("hold", {"x": ROW_14K})  # 8 KiB left
        assert full.status == "overloaded" and "the IO arena is full" in full.message, full
        too_large = await third.infer("echo", {"x": np.zeros((1, 9 * KIB), np.float32)})
        assert too_large.status == "bad_input", too_large
        assert "one request may hold at most" in too_large.message
        assert len(service.submitted) == 4  # the refused ones never reached the service
        assert dict(arena.refusals) == {"share": 1, "full": 1, "too_large": 1}
        for infer in held:
            infer.cancel()
        assert {(await infer).status for infer in held} == {"cancelled"}
        await eventually(lambda: arena.used_bytes == 0)
        assert (await third.infer("echo", {"x": ROW_14K})).ok  # room again
    await eventually(lambda: arena.used_bytes == 0)
    assert arena.live_slots == 0


async def test_slots_of_a_connection_that_goes_come_back(
    server: ApiServer, service: FakeService, arena: IoArena
) -> None:
    connection = await raw_client(server.address)
    connection.send(InferRequest(1, "hold", {"x": ROW_14K}))
    await eventually(lambda: len(service.held) == 1 and arena.used_bytes > 0)
    sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.abort()  # a reset: the daemon sees it gone (a plain close reads as half-close)
    await eventually(lambda: arena.used_bytes == 0)
    assert service.cancelled and arena.live_slots == 0
