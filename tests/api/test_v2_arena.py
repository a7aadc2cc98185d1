"""The Open Inference Protocol's front ends and the IO arena (`api.v2_arena`), over the fake
service: each row's tensors are copied once into a slot of its own, leased for its connection;
no room is a refusal (``overloaded``: the arena full or the connection over its share;
``bad_input``: a row larger than a connection may hold), never a wait; every slot comes back,
answered or cancelled; outputs in a slot are copied out before it goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc.aio as triton_aio
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from clockwork_async.api.server import ApiServer, ServerLimits
from clockwork_async.api.service import InferOutcome
from clockwork_async.api.v2_arena import detach, into_slots
from clockwork_async.api.v2_config import GrpcConfig, HttpConfig
from clockwork_async.api.v2_door import Door
from clockwork_async.api.v2_grpc import GrpcFrontEnd
from clockwork_async.api.v2_http import HttpFrontEnd
from clockwork_async.api.v2_status import V2Error
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.wire.addresses import TcpAddress

from .conftest import eventually
from .fakes import FakeService

KIB = 1024
ROW_14K = np.arange(3584, dtype=np.float32)[None]  # 14 KiB: four fill the 64 KiB arena


@dataclass
class Fronts:
    api: ApiServer
    arena: IoArena
    http: str
    grpc: str


@pytest_asyncio.fixture
async def fronts(service: FakeService) -> AsyncIterator[Fronts]:
    async with serving(service, ServerLimits(io_arena_min_bytes=0)) as served:  # tiny rows too
        yield served


@pytest_asyncio.fixture
async def default_fronts(service: FakeService) -> AsyncIterator[Fronts]:
    async with serving(service, ServerLimits()) as served:  # io_arena_min_bytes: 16 KiB
        yield served


@asynccontextmanager
async def serving(service: FakeService, limits: ServerLimits) -> AsyncIterator[Fronts]:
    arena = IoArena(64 * KIB, owner_share=0.5)  # one connection: 32 KiB
    api = ApiServer(service, limits=limits)
    api.io_arena = arena
    await api.start("127.0.0.1:0")
    listen = TcpAddress("127.0.0.1", 0)
    http = HttpFrontEnd(Door(api, "http", server_version="test"), HttpConfig(listen=listen))
    grpc = GrpcFrontEnd(Door(api, "grpc", server_version="test"), GrpcConfig(listen=listen))
    addresses = [await http.bind(listen), await grpc.bind(listen)]
    await http.serve()
    await grpc.serve()
    yield Fronts(api, arena, *addresses)
    await http.close(0.5)
    await grpc.close(0.5)
    await api.close(0.5)
    arena.close()


def http_infer(address: str, model: str, row: np.ndarray, binary: bool = True) -> np.ndarray:
    client = triton_http.InferenceServerClient(address, network_timeout=30.0)
    try:
        tensor = triton_http.InferInput("x", list(row.shape), "FP32")
        tensor.set_data_from_numpy(row, binary_data=binary)
        return np.asarray(client.infer(model, [tensor]).as_numpy("y"))
    finally:
        client.close()


def grpc_input(row: np.ndarray) -> triton_aio.InferInput:
    tensor = triton_aio.InferInput("x", list(row.shape), "FP32")
    tensor.set_data_from_numpy(row)
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_http_rows_are_copied_once_into_a_slot_released_with_the_answer(
    fronts: Fronts, service: FakeService, binary: bool
) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)  # a client batch: a slot (part) per row
    y = await asyncio.to_thread(http_infer, fronts.http, "echo", x, binary)
    np.testing.assert_array_equal(y, x * 2)
    slots = [submitted.slot for submitted in service.submitted]
    assert len(slots) == 2 and all(isinstance(slot, Slot) for slot in slots)
    assert slots[0] is not slots[1]  # an output region each
    for index, submitted in enumerate(service.submitted):
        assert isinstance(submitted.slot, Slot)
        offset = fronts.arena.offset_of(submitted.inputs["x"])
        if binary:  # parts of the slot the body was read into: its rows, in place
            assert submitted.slot.offset == slots[0].offset and offset is not None
            assert offset == fronts.arena.offset_of(service.submitted[0].inputs["x"]) + 16 * index
        else:  # copied, each row into a slot of its own
            assert offset == submitted.slot.offset
    assert fronts.arena.used_bytes == 0 and fronts.arena.live_slots == 0


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_http_rows_under_io_arena_min_bytes_stay_bytes(
    default_fronts: Fronts, service: FakeService, binary: bool
) -> None:
    arena = default_fronts.arena
    # 8 KiB: its rows' bytes and its body (binary: the Content-Length, JSON header included)
    # are both under 16 KiB.
    under = np.arange(2 * KIB, dtype=np.float32)[None]
    holding = asyncio.to_thread(http_infer, default_fronts.http, "hold", under, binary)
    held = asyncio.ensure_future(holding)
    await eventually(lambda: len(service.held) == 1)
    (submitted,) = service.submitted
    assert submitted.slot is None and arena.offset_of(submitted.inputs["x"]) is None
    assert arena.used_bytes == 0 and arena.live_slots == 0
    service.release(next(iter(service.held)))
    await held
    at = np.arange(4 * KIB, dtype=np.float32)[None]  # 16 KiB: through the arena
    y = await asyncio.to_thread(http_infer, default_fronts.http, "echo", at, binary)
    np.testing.assert_array_equal(y, at * 2)
    slot = service.submitted[1].slot
    assert isinstance(slot, Slot) and arena.offset_of(service.submitted[1].inputs["x"]) is not None
    await eventually(lambda: arena.used_bytes == 0)
    assert arena.refusals.total() == 0


async def test_a_binary_body_is_read_into_the_slot_its_row_keeps(
    fronts: Fronts, service: FakeService
) -> None:
    x = np.arange(4, dtype=np.float32)[None]
    y = await asyncio.to_thread(http_infer, fronts.http, "echo", x)
    np.testing.assert_array_equal(y, x * 2)
    ((submitted),) = service.submitted
    assert isinstance(submitted.slot, Slot)
    offset = fronts.arena.offset_of(submitted.inputs["x"])
    assert offset is not None and offset % 64 == 0
    assert offset > submitted.slot.offset  # after the body's JSON header, in the same slot
    assert fronts.arena.used_bytes == 0 and fronts.arena.refusals.total() == 0


async def test_http_full_arena_is_overloaded_and_too_large_is_bad_input(
    fronts: Fronts, service: FakeService
) -> None:
    held = [asyncio.to_thread(http_infer, fronts.http, "hold", ROW_14K) for _ in range(4)]
    holding = asyncio.gather(*held)
    await eventually(lambda: len(service.held) == 4)  # four connections, 56 KiB
    with pytest.raises(InferenceServerException) as raised:
        await asyncio.to_thread(http_infer, fronts.http, "echo", ROW_14K)
    assert raised.value.status() == "429" and "IO arena is full" in str(raised.value.message())
    with pytest.raises(InferenceServerException) as raised:
        await asyncio.to_thread(http_infer, fronts.http, "echo", np.zeros((1, 9000), np.float32))
    assert raised.value.status() == "400" and "bad_input" in str(raised.value.message())
    for service_id in list(service.held):
        service.release(service_id)
    await holding
    assert fronts.arena.used_bytes == 0


async def test_grpc_share_refusal_and_a_cancelled_call_give_every_slot_back(
    fronts: Fronts, service: FakeService
) -> None:
    client = triton_aio.InferenceServerClient(fronts.grpc)
    try:
        first = asyncio.ensure_future(client.infer("hold", [grpc_input(ROW_14K)]))
        second = asyncio.ensure_future(client.infer("hold", [grpc_input(ROW_14K)]))
        await eventually(lambda: len(service.held) == 2)
        with pytest.raises(InferenceServerException) as raised:  # one connection: 32 KiB
            await client.infer("echo", [grpc_input(ROW_14K)])
        assert raised.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert fronts.arena.live_slots == 2
        first.cancel()
        await eventually(lambda: fronts.arena.live_slots == 1)
        (service_id,) = service.held
        service.release(service_id)
        np.testing.assert_array_equal((await second).as_numpy("y"), np.full((1, 4), service_id))
    finally:
        await client.close()
    assert fronts.arena.used_bytes == 0


async def test_a_refused_row_releases_the_rows_leased_before_it() -> None:
    arena = IoArena(64 * KIB, owner_share=1.0)
    try:
        rows = [{"x": ROW_14K} for _ in range(5)]  # the fifth does not fit
        with pytest.raises(V2Error) as raised:
            into_slots(arena, "a connection", rows)
        assert raised.value.code == Outcome.OVERLOADED and arena.used_bytes == 0
        ((copied, slot, release),) = into_slots(arena, "a connection", rows[:1])
        assert slot is not None and copied["x"].base is not None
        region = slot.attach_outputs(16)  # as the request path attaches it
        assert region is not None
        region.array[:] = slot.array[:16]  # as the executor writes the outputs
        output = region.array.view(np.float32)
        outcome = InferOutcome(1, Outcome.OK, "", {"y": output}, {}, None, 1)
        kept = detach(outcome, slot)
        release()
        assert arena.offset_of(kept.outputs["y"]) is None
        np.testing.assert_array_equal(kept.outputs["y"], ROW_14K[0, :4])
    finally:
        arena.close()
