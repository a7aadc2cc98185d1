"""The asyncio client against bare wire servers: refusals and drops fail every pending call
with a named error, never a hang."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
import pytest_asyncio

from clockwork_async.api.async_client import AsyncClient, ConnectError, ConnectionClosedError
from clockwork_async.connection import Connection
from clockwork_async.endpoints import start_server
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    InferReply,
    InferRequest,
)

ROW = np.zeros((1, 4), np.float32)
Handler = Callable[[Connection], Awaitable[None]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await start_server(handler, "tcp:127.0.0.1:0")
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _greet(connection: Connection) -> None:
    hello = await connection.recv()
    assert isinstance(hello, Hello) and hello.role == "client"
    connection.send(Hello(PROTOCOL_VERSION, "controller", "fake-daemon"))


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectError) as refused:
        await AsyncClient.connect(f"127.0.0.1:{port}")
    assert refused.value.code == "unreachable"


async def test_a_bad_address_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="bad address"):
        await AsyncClient.connect("no-port-here")


async def test_a_refused_hello_names_the_code(serve: Callable[[Handler], Awaitable[str]]) -> None:
    async def refuse(connection: Connection) -> None:
        await connection.recv()
        connection.send(Error("unauthorized", "wrong or missing token"))

    with pytest.raises(ConnectError) as refused:
        await AsyncClient.connect(await serve(refuse), token="x")
    assert refused.value.code == "unauthorized"


async def test_a_silent_daemon_is_a_timeout(serve: Callable[[Handler], Awaitable[str]]) -> None:
    async def silent(connection: Connection) -> None:
        await connection.wait_closed()

    with pytest.raises(ConnectError) as slow:
        await AsyncClient.connect(await serve(silent), timeout_s=0.05)
    assert slow.value.code == "timeout"


async def test_a_drop_fails_every_pending_call_and_every_later_one(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    received = asyncio.Event()

    async def drop_after_two(connection: Connection) -> None:
        await _greet(connection)
        first = await connection.recv()
        await connection.recv()
        assert isinstance(first, InferRequest)
        connection.send(InferReply(first.request_id, "ok", ""))
        received.set()
        connection.abort()

    client = await AsyncClient.connect(await serve(drop_after_two))
    answered = client.start_infer("m", {"x": ROW})
    dropped_infer = client.start_infer("m", {"x": ROW})
    dropped_listing = asyncio.create_task(client.models())
    assert (await answered).ok
    with pytest.raises(ConnectionClosedError, match="closed"):
        await dropped_infer
    with pytest.raises(ConnectionClosedError, match="closed"):
        await dropped_listing
    assert client.closed
    with pytest.raises(ConnectionClosedError):
        await client.infer("m", {"x": ROW})
    await client.close()


async def test_the_daemons_error_is_the_reason_given(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    async def complain(connection: Connection) -> None:
        await _greet(connection)
        await connection.recv()
        connection.send(Error("protocol_error", "that was not a client message"))

    client = await AsyncClient.connect(await serve(complain))
    with pytest.raises(ConnectionClosedError, match="not a client message"):
        await client.infer("m", {"x": ROW})
    await client.close()


async def test_bad_bytes_from_the_daemon_close_the_connection(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    async def garble(connection: Connection) -> None:
        await _greet(connection)
        await connection.recv()
        connection._transport.write(b"\x00\x00\x00\x01\x00\x00\x00\x00\xc1")  # type: ignore[union-attr]
        await connection.wait_closed()

    client = await AsyncClient.connect(await serve(garble))
    with pytest.raises(ConnectionClosedError, match="do not decode"):
        await client.infer("m", {"x": ROW})
    await client.close()
