"""The client API's configurable limits: the ``[server]`` keys reach `ServerLimits`, bad values
are named, and each limit takes effect on a real loopback server over the fake service:
uploads in flight (count and bytes, over all connections), the hello timeout, the write buffer
of a slow reader and the queue of decoded messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.api.server import ApiServer, ServerLimits
from clockwork_async.config.daemon import ConfigError, MachineFacts, ServerConfig, load_config
from clockwork_async.endpoints import open_connection
from clockwork_async.wire.messages import AddModel, Error, InferRequest, ModelsReply, Ping

from .conftest import eventually, raw_client, recv
from .fakes import FakeService

MiB = 1 << 20
MACHINE = MachineFacts(cpus=(0, 1), memory_bytes=8 << 30)
ROW = np.arange(4, dtype=np.float32).reshape(1, 4)


def server_config(**flags: str) -> ServerConfig:
    sets = {f"server.{key}": value for key, value in flags.items()}
    return load_config(None, {"HOME": "/home/op"}, sets, machine=MACHINE).server


@pytest.fixture
def gated(service: FakeService) -> FakeService:
    service.add_gate = asyncio.Event()  # add_model waits until the test opens the gate
    return service


async def serving(service: FakeService, limits: ServerLimits) -> ApiServer:
    api = ApiServer(service, limits=limits)
    await api.start("127.0.0.1:0")
    return api


@pytest.fixture
async def clients() -> AsyncIterator[list[AsyncClient]]:
    opened: list[AsyncClient] = []
    yield opened
    for client in opened:
        await client.close()


# --- config keys -----------------------------------------------------------------------------


def test_the_server_keys_reach_the_limits() -> None:
    config = server_config(
        hello_timeout_s="2.5",
        max_write_buffer_bytes="65536",
        max_queued_messages="32",
        max_uploads_in_flight="2",
        max_upload_bytes_in_flight=str(128 * MiB),
    )
    limits = config.limits
    assert limits.hello_timeout_s == 2.5
    assert limits.max_write_buffer_bytes == 65536
    assert limits.max_queued_messages == 32
    assert limits.max_uploads_in_flight == 2
    assert limits.max_upload_bytes_in_flight == 128 * MiB


def test_the_defaults_are_the_documented_ones() -> None:
    limits = server_config().limits
    assert limits.hello_timeout_s == 10.0 and limits.max_queued_messages == 256
    assert limits.max_write_buffer_bytes == MiB
    assert limits.max_uploads_in_flight == 4 and limits.max_upload_bytes_in_flight == 256 * MiB


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("hello_timeout_s", "0", "at least 0.1"),
        ("max_write_buffer_bytes", "100", "at least 4096"),
        ("max_queued_messages", "0", "at least 1"),
        ("max_uploads_in_flight", "0", "at least 1"),
        ("max_upload_bytes_in_flight", str(32 * MiB), "at least server.max_frame_bytes"),
    ],
)
def test_bad_values_are_named(key: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"server.{key}") as raised:
        server_config(**{key: value})
    assert says in str(raised.value)


# --- uploads in flight -----------------------------------------------------------------------


async def test_uploads_in_flight_are_capped_over_all_connections(
    gated: FakeService, clients: list[AsyncClient]
) -> None:
    api = await serving(gated, ServerLimits(max_uploads_in_flight=2))
    try:
        for _ in range(3):
            clients.append(await AsyncClient.connect(api.address))
        first = asyncio.ensure_future(clients[0].add_model("one", b"ONNX 1"))
        second = asyncio.ensure_future(clients[1].add_model("two", b"ONNX 2"))
        await eventually(lambda: api.uploads_in_flight == 2)
        refused = await raw_add_model(api, "three", 6)
        assert refused.status == "overloaded" and "2 model uploads" in refused.message
        assert gated.add_gate is not None
        gated.add_gate.set()
        assert (await first).name == "one" and (await second).name == "two"
        assert api.uploads_in_flight == 0 and api.upload_bytes_in_flight == 0
        assert (await clients[2].add_model("three", b"ONNX 3")).name == "three"
    finally:
        await api.close(0.5)


async def test_upload_bytes_in_flight_are_capped(
    gated: FakeService, clients: list[AsyncClient]
) -> None:
    api = await serving(gated, ServerLimits(max_upload_bytes_in_flight=100_000))
    try:
        clients.append(await AsyncClient.connect(api.address))
        held = asyncio.ensure_future(clients[0].add_model("large", b"ONNX" + bytes(59_996)))
        await eventually(lambda: api.upload_bytes_in_flight == 60_000)
        refused = await raw_add_model(api, "also-big", 60_000)
        assert refused.status == "overloaded" and "100000 limit" in refused.message
        fits = await raw_add_model(api, "small", 30_000, wait=False)
        await eventually(lambda: api.upload_bytes_in_flight == 90_000)
        assert gated.add_gate is not None
        gated.add_gate.set()
        assert (await held).name == "large"
        assert (await fits).status == "ok"
        await eventually(lambda: api.upload_bytes_in_flight == 0 and api.uploads_in_flight == 0)
    finally:
        await api.close(0.5)


async def test_an_upload_cancelled_by_close_gives_its_share_back(gated: FakeService) -> None:
    api = await serving(gated, ServerLimits())
    connection = await raw_client(api.address)
    connection.send(AddModel(1, "m", {"model.onnx": np.frombuffer(b"ONNX", np.uint8)}))
    await eventually(lambda: api.uploads_in_flight == 1)
    await api.close(0.05)  # the gate never opens: the change is cancelled
    assert api.uploads_in_flight == 0 and api.upload_bytes_in_flight == 0


async def raw_add_model(
    api: ApiServer, name: str, nbytes: int, *, wait: bool = True
) -> ModelsReply | asyncio.Future[ModelsReply]:
    """Upload ``nbytes`` on a fresh connection; the reply, or (``wait=False``) its future."""
    connection = await raw_client(api.address)
    data = np.frombuffer(b"ONNX" + bytes(nbytes - 4), np.uint8)
    connection.send(AddModel(1, name, {"model.onnx": data}))

    async def reply() -> ModelsReply:
        try:
            message = await recv(connection)
            assert isinstance(message, ModelsReply), message
            return message
        finally:
            connection.close()

    return await reply() if wait else asyncio.ensure_future(reply())


# --- the other limits take effect ------------------------------------------------------------


async def test_the_configured_hello_timeout_closes_a_silent_connection(
    service: FakeService,
) -> None:
    api = await serving(service, server_config(hello_timeout_s="0.2").limits)
    try:
        connection = await open_connection(api.address)
        error = await recv(connection, timeout_s=5.0)
        assert isinstance(error, Error) and "no hello in time" in error.message
    finally:
        await api.close(0.5)


@pytest.mark.parametrize(("buffer_bytes", "all_read"), [(64 * 1024, False), (256 * MiB, True)])
async def test_the_write_buffer_bounds_what_a_slow_reader_makes_the_server_read(
    service: FakeService, buffer_bytes: int, all_read: bool
) -> None:
    total = 40  # 1 MiB replies: 40 MiB, far above what the kernel's socket buffers take
    flags = server_config(max_write_buffer_bytes=str(buffer_bytes))
    api = await serving(service, flags.limits)
    connection = await raw_client(api.address)
    try:
        connection._transport.pause_reading()  # type: ignore[union-attr]  # reads nothing
        for request_id in range(total):
            connection.send(InferRequest(request_id, "big", {"x": ROW}))
        if all_read:
            await eventually(lambda: len(service.submitted) == total)
        else:
            await eventually(lambda: api.snapshot()["slow_readers"] == 1)
            await asyncio.sleep(0.1)
            assert len(service.submitted) < total / 2
    finally:
        connection.abort()
        await api.close(0.5)


@pytest.mark.parametrize(("queued", "paused"), [(8, 1), (256, 0)])
async def test_the_message_queue_bound_pauses_reading(
    gated: FakeService, queued: int, paused: int
) -> None:
    flags = server_config(max_queued_messages=str(queued))
    api = await serving(gated, flags.limits)
    connection = await raw_client(api.address)
    try:
        # The session waits on the upload; 20 pings behind it are decoded and queued.
        connection.send(AddModel(1, "m", {"model.onnx": np.frombuffer(b"ONNX", np.uint8)}))
        for seq in range(20):
            connection.send(Ping(seq, 0))
        await eventually(lambda: api.uploads_in_flight == 1)
        await asyncio.sleep(0.05)
        assert api.snapshot()["reading_paused"] == paused
        assert gated.add_gate is not None
        gated.add_gate.set()
        replies = [await recv(connection) for _ in range(21)]
        assert isinstance(replies[0], ModelsReply) and replies[0].status == "ok"
        await eventually(lambda: api.snapshot()["reading_paused"] == 0)
    finally:
        connection.close()
        await api.close(0.5)
