"""The blocking client against a server in its own thread, and TLS on both sides."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient, ConnectError
from clockwork_async.api.auth import client_ssl_context, server_ssl_context
from clockwork_async.api.server import ApiServer
from clockwork_async.client import ApiError, Client, ConnectionClosedError

from .conftest import ThreadedServer
from .fakes import FakeService

ROW = np.arange(4, dtype=np.float32).reshape(1, 4)


def _release_all_reversed(threaded: ThreadedServer) -> None:
    def release() -> None:
        for submitted in reversed(threaded.service.submitted):
            if submitted.service_id in threaded.service.held:
                threaded.service.release(submitted.service_id)

    threaded.loop.call_soon_threadsafe(release)


def _wait_held(threaded: ThreadedServer, count: int) -> None:
    done = threading.Event()

    def check() -> None:
        if len(threaded.service.held) >= count:
            done.set()
        else:
            threaded.loop.call_later(0.001, check)

    threaded.loop.call_soon_threadsafe(check)
    assert done.wait(5)


def test_blocking_calls(threaded_server: ThreadedServer) -> None:
    with Client(threaded_server.address) as client:
        result = client.infer("echo", {"x": ROW}, slo_ms=10)
        assert result.ok
        np.testing.assert_array_equal(result.outputs["y"], ROW * 2)
        assert {m.name for m in client.models()} == {"echo", "hold", "big", "odd"}
        assert client.add_model("new", b"ONNX!").name == "new"
        client.remove_model("new")
        with pytest.raises(ApiError):
            client.remove_model("new")
        assert client.stats()["api"]["connections"] == 1
        assert client.health().ready
        assert client.ping() > 0
    client.close()  # idempotent


def test_blocking_client_pipelines_from_one_thread(threaded_server: ThreadedServer) -> None:
    with Client(threaded_server.address) as client:
        futures = [client.submit("hold", {"x": ROW}) for _ in range(8)]
        _wait_held(threaded_server, 8)
        _release_all_reversed(threaded_server)
        results = [f.result(5) for f in futures]
        ids = [int(r.outputs["y"][0, 0]) for r in results]
        assert ids == [s.service_id for s in threaded_server.service.submitted]


def test_a_call_that_times_out_is_cancelled(threaded_server: ThreadedServer) -> None:
    with Client(threaded_server.address, timeout_s=0.05) as client:
        with pytest.raises(TimeoutError):
            client.infer("hold", {"x": ROW})
        service = threaded_server.service
        deadline_ok = threading.Event()

        def check() -> None:
            if service.cancelled:
                deadline_ok.set()
            else:
                threaded_server.loop.call_later(0.001, check)

        threaded_server.loop.call_soon_threadsafe(check)
        assert deadline_ok.wait(5)
        assert service.cancelled == [service.submitted[0].service_id]


def test_blocking_client_sees_a_drop_as_an_error(threaded_server: ThreadedServer) -> None:
    client = Client(threaded_server.address)
    pending = client.submit("hold", {"x": ROW})
    _wait_held(threaded_server, 1)
    threaded_server.loop.call_soon_threadsafe(_abort_all_sessions, threaded_server)
    with pytest.raises(ConnectionClosedError):
        pending.result(5)
    with pytest.raises(ConnectionClosedError):
        client.infer("echo", {"x": ROW})
    client.close()


def _abort_all_sessions(threaded: ThreadedServer) -> None:
    for connection in list(threaded.api._handlers):
        connection.abort()


def test_connecting_to_nothing_raises_and_leaves_no_thread() -> None:
    before = threading.active_count()
    with pytest.raises(ConnectError):
        Client("127.0.0.1:1", connect_timeout_s=2)
    assert threading.active_count() == before


async def test_tls_on_both_sides(certificate: tuple[Path, Path], service: FakeService) -> None:
    cert, key = certificate
    api = ApiServer(service)
    await api.start("127.0.0.1:0", ssl=server_ssl_context(cert, key))
    try:
        client = await AsyncClient.connect(api.address, ssl=client_ssl_context(cert))
        assert (await client.infer("echo", {"x": ROW})).ok
        await client.close()
        with pytest.raises(ConnectError):  # plain TCP to a TLS listener
            await AsyncClient.connect(api.address, timeout_s=1)
        with pytest.raises(ConnectError):  # a server this client does not trust
            await AsyncClient.connect(api.address, ssl=client_ssl_context(), timeout_s=2)
    finally:
        await api.close(0.5)
