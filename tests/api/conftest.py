"""Fixtures: a real `ApiServer` on loopback over the fake service, in the test's loop or (for
the blocking CLI) in a thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
import uvloop

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.api.server import ApiServer
from clockwork_async.connection import Connection
from clockwork_async.endpoints import open_connection
from clockwork_async.wire.messages import PROTOCOL_VERSION, Hello, Message

from .fakes import FakeService


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest_asyncio.fixture
async def server(service: FakeService) -> AsyncIterator[ApiServer]:
    api = ApiServer(service)
    await api.start("127.0.0.1:0")
    yield api
    await api.close(0.5)


@pytest_asyncio.fixture
async def client(server: ApiServer) -> AsyncIterator[AsyncClient]:
    connected = await AsyncClient.connect(server.address)
    yield connected
    await connected.close()


async def raw_client(address: str, token: str = "") -> Connection:
    """A bare wire connection whose hello was accepted."""
    connection = await open_connection(address)
    connection.send(Hello(PROTOCOL_VERSION, "client", "raw", token))
    answer = await recv(connection)
    assert isinstance(answer, Hello), answer
    return connection


async def recv(connection: Connection, timeout_s: float = 5.0) -> Message:
    return await asyncio.wait_for(connection.recv(), timeout_s)


async def eventually(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Wait (yielding to the loop) until ``condition()`` is true."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


@dataclass
class ThreadedServer:
    address: str
    service: FakeService
    loop: asyncio.AbstractEventLoop
    api: ApiServer


@pytest.fixture
def threaded_server() -> Iterator[ThreadedServer]:
    """An ApiServer on its own loop in a thread, for code that blocks (the CLI)."""
    loop = uvloop.new_event_loop()
    service = FakeService()
    api = ApiServer(service)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(api.start("127.0.0.1:0"), loop).result(10)
        yield ThreadedServer(api.address, service, loop, api)
    finally:
        asyncio.run_coroutine_threadsafe(api.close(0.5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
