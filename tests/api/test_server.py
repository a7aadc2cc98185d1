"""The client API server on loopback, over the fake service: pipelining, ids, cancel,
disconnects, caps, scopes, bad peers, slow readers, graceful close."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

from clockwork_async.api.async_client import (
    ApiError,
    AsyncClient,
    ConnectError,
    ConnectionClosedError,
)
from clockwork_async.api.auth import TokenAuth
from clockwork_async.api.server import ApiServer, ServerLimits, ServerState
from clockwork_async.connection import ConnectionClosed
from clockwork_async.endpoints import open_connection
from clockwork_async.wire.codec import Encoder
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    AddModel,
    CancelInfer,
    Error,
    GetStats,
    Hello,
    InferReply,
    InferRequest,
    ListModels,
    Load,
    ModelsReply,
    Ping,
    Pong,
    StatsReply,
)

from .conftest import eventually, raw_client, recv
from .fakes import FakeService

ROW = np.arange(4, dtype=np.float32).reshape(1, 4)


async def _serve(service: FakeService, **kwargs: object) -> ApiServer:
    api = ApiServer(service, **kwargs)  # type: ignore[arg-type]
    await api.start("127.0.0.1:0")
    return api


async def test_infer_round_trip_carries_outputs_timing_and_deadline(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    result = await client.infer("echo", {"x": ROW}, slo_ms=2.5)
    assert result.ok and result.message == ""
    np.testing.assert_array_equal(result.outputs["y"], ROW * 2)
    assert result.executor_id == "e0" and result.batch_size == 1
    assert set(result.timing_ns) >= {"total", "queue", "execute", "predicted_execute"}
    assert result.timing_ns["total"] >= 0
    assert service.submitted[0].slo_ns == 2_500_000
    assert service.submitted[0].deadline_unix_ns is None
    await client.infer("echo", {"x": ROW}, deadline_unix_ns=123)
    assert service.submitted[1].slo_ns is None and service.submitted[1].deadline_unix_ns == 123


async def test_async_client_is_the_twin_of_client_made_from_an_address(server: ApiServer) -> None:
    async with AsyncClient(server.address, name="twin") as client:
        assert (await client.infer("echo", {"x": ROW})).ok
        assert client.server_name == "clockwork-async"
    unopened = AsyncClient(server.address)
    with pytest.raises(ConnectionClosedError, match="not connected"):
        await unopened.infer("echo", {"x": ROW})
    await unopened.close()  # nothing to close
    with pytest.raises(ConnectError):
        async with AsyncClient(server.address, connect_timeout_s=0.0):
            pass


async def test_a_request_screened_at_the_door_is_answered_overloaded_without_its_tensors(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    refused = await client.infer("door", {"x": ROW}, slo_ms=5.0)
    assert refused.status == "overloaded" and refused.message == "the fake is overloaded"
    assert service.submitted == []  # never decoded into a submit
    ((model, frame_bytes),) = service.screened
    assert model == "door" and frame_bytes > ROW.nbytes
    assert (await client.infer("echo", {"x": ROW})).ok  # the connection goes on
    assert server.outstanding == 0


async def test_unknown_model_and_bad_deadlines_are_named(client: AsyncClient) -> None:
    assert (await client.infer("nope", {"x": ROW})).status == "unknown_model"
    both = await client.infer("echo", {"x": ROW}, slo_ms=1.0, deadline_unix_ns=5)
    assert both.status == "bad_input" and "not both" in both.message
    for slo_ms in (0.0, -1.0, float("nan"), float("inf")):
        assert (await client.infer("echo", {"x": ROW}, slo_ms=slo_ms)).status == "bad_input"


async def test_deadlines_that_do_not_fit_64_bits_are_bad_input_naming_the_limit(
    service: FakeService,
) -> None:
    api = await _serve(service, unix_now_ns=lambda: 10**18)
    try:
        async with await AsyncClient.connect(api.address) as client:
            huge = await client.infer("echo", {"x": ROW}, slo_ms=1e15)
            assert huge.status == "bad_input"
            assert "1e+15" in huge.message and "4611686018427 ms" in huge.message
            for deadline_unix_ns in (10**18 + (1 << 62) + 1, 10**18 - (1 << 62) - 1):
                far = await client.infer("echo", {"x": ROW}, deadline_unix_ns=deadline_unix_ns)
                assert far.status == "bad_input", far
                assert str(deadline_unix_ns) in far.message and str(1 << 62) in far.message
            edge = await client.infer("echo", {"x": ROW}, deadline_unix_ns=10**18 + (1 << 62))
            assert edge.ok
            assert [s.deadline_unix_ns for s in service.submitted] == [10**18 + (1 << 62)]
    finally:
        await api.close(0.5)


async def test_pipelined_requests_are_answered_out_of_order(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    for request_id in (1, 2, 3):
        connection.send(InferRequest(request_id, "hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 3)
    for submitted in reversed(service.submitted):
        service.release(submitted.service_id)
    replies = [await recv(connection) for _ in range(3)]
    assert [r.request_id for r in replies if isinstance(r, InferReply)] == [3, 2, 1]
    assert all(isinstance(r, InferReply) and r.ok for r in replies)
    connection.close()


async def test_the_service_is_told_when_a_read_s_requests_are_all_in(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    for request_id in (1, 2, 3):
        connection.send(InferRequest(request_id, "hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 3)
    await eventually(lambda: service.flushes and service.flushes[-1] == 3)
    assert 1 <= len(service.flushes) <= 3  # once per read, not once per request
    assert service.flushes == sorted(service.flushes)
    connection.close()


async def test_async_client_matches_concurrent_replies(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    pending = [client.start_infer("hold", {"x": ROW}) for _ in range(5)]
    await eventually(lambda: len(service.held) == 5)
    for submitted in reversed(service.submitted):
        service.release(submitted.service_id)
    results = [await p for p in pending]
    ids = [int(r.outputs["y"][0, 0]) for r in results]
    assert ids == [s.service_id for s in service.submitted]  # each got its own reply


async def test_duplicate_in_flight_id_is_rejected_and_the_first_still_answered(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    connection.send(InferRequest(7, "hold", {"x": ROW}))
    connection.send(InferRequest(7, "echo", {"x": ROW}))
    duplicate = await recv(connection)
    assert isinstance(duplicate, InferReply) and duplicate.request_id == 7
    assert duplicate.status == "duplicate_id"
    assert [s.model for s in service.submitted] == ["hold"]
    service.release(service.submitted[0].service_id)
    first = await recv(connection)
    assert isinstance(first, InferReply) and first.request_id == 7 and first.ok
    connection.send(InferRequest(7, "echo", {"x": ROW}))  # free again once answered
    again = await recv(connection)
    assert isinstance(again, InferReply) and again.ok
    connection.close()


async def test_cancel_reaches_the_service_and_the_reply_says_cancelled(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    pending = client.start_infer("hold", {"x": ROW})
    await eventually(lambda: len(service.held) == 1)
    pending.cancel()
    result = await pending
    assert result.status == "cancelled"
    assert service.cancelled == [service.submitted[0].service_id]
    assert server.outstanding == 0


async def test_cancelling_the_awaiting_task_cancels_the_request(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    task = asyncio.create_task(client.infer("hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: service.cancelled == [service.submitted[0].service_id])
    assert (await client.infer("echo", {"x": ROW})).ok  # the connection is still fine


async def test_disconnect_cancels_each_queued_request_once(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    for request_id in range(3):
        connection.send(InferRequest(request_id, "hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 3)
    sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.abort()  # a reset (an end of input alone may be a half-close: test_half_close)
    await eventually(lambda: len(service.cancelled) == 3)
    assert sorted(service.cancelled) == sorted(s.service_id for s in service.submitted)
    assert all(count == 1 for count in service.answers.values())
    await eventually(lambda: server.outstanding == 0 and server.connection_count == 0)


async def test_per_connection_and_global_caps_answer_overloaded(service: FakeService) -> None:
    limits = ServerLimits(max_outstanding_per_connection=2, max_outstanding_total=3)
    api = await _serve(service, limits=limits)
    try:
        first = await AsyncClient.connect(api.address)
        held = [first.start_infer("hold", {"x": ROW}) for _ in range(2)]
        over = await first.infer("echo", {"x": ROW})
        assert over.status == "overloaded" and "connection" in over.message
        second = await AsyncClient.connect(api.address)
        held.append(second.start_infer("hold", {"x": ROW}))
        await eventually(lambda: len(service.held) == 3)
        global_over = await second.infer("echo", {"x": ROW})
        assert global_over.status == "overloaded" and "server" in global_over.message
        for submitted in service.submitted:
            service.release(submitted.service_id)
        assert all(result.ok for result in [await p for p in held])
        assert (await second.infer("echo", {"x": ROW})).ok
        await first.close()
        await second.close()
    finally:
        await api.close(0.5)


async def test_max_connections_refuses_with_overloaded(service: FakeService) -> None:
    api = await _serve(service, limits=ServerLimits(max_connections=1))
    try:
        first = await AsyncClient.connect(api.address)
        with pytest.raises(ConnectError) as refused:
            await AsyncClient.connect(api.address)
        assert refused.value.code == "overloaded"
        assert (await first.infer("echo", {"x": ROW})).ok
        await first.close()
        await eventually(lambda: api.connection_count == 0)
        again = await AsyncClient.connect(api.address)
        await again.close()
    finally:
        await api.close(0.5)


async def test_tokens_map_to_scopes(service: FakeService) -> None:
    auth = TokenAuth(infer_token="infer-token-0123456789", admin_token="admin-token-0123456789")
    api = await _serve(service, auth=auth)
    try:
        for token in ("", "wrong", "infer-token-012345678", "é"):
            with pytest.raises(ConnectError) as refused:
                await AsyncClient.connect(api.address, token=token)
            assert refused.value.code == "unauthorized"
        infer_only = await AsyncClient.connect(api.address, token=auth.infer_token)
        assert (await infer_only.infer("echo", {"x": ROW})).ok
        assert len(await infer_only.models()) == 4
        with pytest.raises(ApiError) as forbidden:
            await infer_only.add_model("new", b"ONNX...")
        assert forbidden.value.code == "forbidden"
        with pytest.raises(ApiError):
            await infer_only.remove_model("echo")
        assert "echo" in service.models
        admin = await AsyncClient.connect(api.address, token=auth.admin_token)
        assert (await admin.add_model("new", b"ONNX...")).name == "new"
        assert (await admin.infer("echo", {"x": ROW})).ok
        await infer_only.close()
        await admin.close()
    finally:
        await api.close(0.5)


async def test_admin_operations_and_their_errors(
    service: FakeService, client: AsyncClient, tmp_path: object
) -> None:
    status = await client.add_model("fresh", b"ONNX bytes", "group-a")
    assert status.name == "fresh" and status.group == "group-a"
    assert "fresh" in {m.name for m in await client.models()}
    with pytest.raises(ApiError) as exists:
        await client.add_model("fresh", b"ONNX bytes")
    assert exists.value.code == "model_exists"
    with pytest.raises(ApiError) as bad:
        await client.add_model("other", b"not onnx")
    assert bad.value.code == "bad_model"
    await client.remove_model("fresh")
    with pytest.raises(ApiError) as unknown:
        await client.remove_model("fresh")
    assert unknown.value.code == "unknown_model"


async def test_add_model_needs_exactly_one_byte_file(server: ApiServer) -> None:
    connection = await raw_client(server.address)
    files = {"model.onnx": np.zeros(3, np.uint8), "extra": np.zeros(1, np.uint8)}
    connection.send(AddModel(1, "m", files))
    connection.send(AddModel(2, "m", {"model.onnx": np.zeros((2, 2), np.uint8)}))
    for request_id in (1, 2):
        reply = await recv(connection)
        assert isinstance(reply, ModelsReply) and reply.request_id == request_id
        assert reply.status == "bad_request"
    connection.close()


async def test_stats_health_and_ping(service: FakeService, client: AsyncClient) -> None:
    stats = await client.stats()
    assert stats["models"] == ["big", "echo", "hold", "odd"]
    assert stats["api"]["connections"] == 1
    health = await client.health()
    assert health.ready and health.live
    service.health_now = type(health)(live=True, ready=False, reason="no executor is up")
    assert (await client.health()).reason == "no executor is up"
    assert await client.ping() > 0


async def test_a_service_or_encoding_failure_fails_that_request_alone(
    client: AsyncClient,
) -> None:
    broken = await client.infer("boom", {"x": ROW})
    assert broken.status == "internal" and "broke" in broken.message
    unencodable = await client.infer("odd", {"x": ROW})
    assert unencodable.status == "internal" and "encoded" in unencodable.message
    assert (await client.infer("echo", {"x": ROW})).ok


async def test_a_non_client_message_gets_an_error_and_others_are_still_served(
    server: ApiServer,
) -> None:
    connection = await raw_client(server.address)
    connection.send(Load(1, "m", 0, 1))
    error = await recv(connection)
    assert isinstance(error, Error) and error.code == "protocol_error"
    with pytest.raises(ConnectionClosed):
        await recv(connection)
    other = await AsyncClient.connect(server.address)
    assert (await other.infer("echo", {"x": ROW})).ok
    await other.close()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (struct.pack(">II", 5, 0) + b"\xc1\xc1\xc1\xc1\xc1", b"protocol_error"),  # not msgpack
        (struct.pack(">II", 1 << 30, 0), b"frame_too_large"),  # a huge declared header
        (struct.pack(">II", 16, 0) + bytes(16), b"protocol_error"),  # 16 nils: not one map
    ],
)
async def test_garbage_after_hello_gets_a_named_error(
    server: ApiServer, frame: bytes, code: bytes
) -> None:
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(Encoder().encode_bytes(Hello(PROTOCOL_VERSION, "client", "raw")) + frame)
    data = await asyncio.wait_for(reader.read(), 5)
    assert code in data
    writer.close()
    await writer.wait_closed()
    assert server.state is ServerState.SERVING


async def test_wrong_hellos_are_refused(server: ApiServer) -> None:
    for hello, code in (
        (Hello(PROTOCOL_VERSION + 1, "client", "future"), "unsupported_version"),
        (Hello(PROTOCOL_VERSION, "executor", "lost"), "protocol_error"),
        (Ping(1, 2), "protocol_error"),
    ):
        connection = await open_connection(server.address)
        connection.send(hello)
        error = await recv(connection)
        assert isinstance(error, Error) and error.code == code
        connection.close()


async def test_a_silent_connection_is_closed_after_the_hello_timeout(service: FakeService) -> None:
    api = await _serve(service, limits=ServerLimits(hello_timeout_s=0.05))
    try:
        connection = await open_connection(api.address)
        error = await recv(connection)
        assert isinstance(error, Error) and "hello" in error.message
    finally:
        await api.close(0.5)


async def test_a_slow_reader_stops_being_read_and_catches_up(
    server: ApiServer, service: FakeService
) -> None:
    total = 400  # 1 MiB replies: 400 MiB if nothing held the server back
    connection = await raw_client(server.address)
    for request_id in range(total):
        connection.send(InferRequest(request_id, "big", {"x": ROW}))
    connection._transport.pause_reading()  # type: ignore[union-attr]  # a reader that stalls
    await eventually(lambda: server.snapshot()["slow_readers"] == 1)
    await asyncio.sleep(0.05)
    assert len(service.submitted) < total / 2
    connection._transport.resume_reading()  # type: ignore[union-attr]
    replies = [await recv(connection) for _ in range(total)]
    assert sorted(r.request_id for r in replies if isinstance(r, InferReply)) == list(range(total))
    assert len(service.submitted) == total
    connection.close()


async def test_close_finishes_in_flight_requests_then_closes(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    pending = client.start_infer("hold", {"x": ROW})
    await eventually(lambda: len(service.held) == 1)
    closing = asyncio.create_task(server.close(5.0))
    await eventually(lambda: server.state is ServerState.CLOSING)
    late = await client.infer("echo", {"x": ROW})
    assert late.status == "shutting_down"
    with pytest.raises(ConnectError):
        await AsyncClient.connect(server.address)
    service.release(service.submitted[0].service_id)
    assert (await pending).ok
    await closing
    assert server.state is ServerState.CLOSED
    with pytest.raises(ConnectionClosedError, match="closed"):
        await client.infer("echo", {"x": ROW})


async def test_close_times_out_and_cancels_what_is_left(
    server: ApiServer, service: FakeService, client: AsyncClient
) -> None:
    pending = client.start_infer("hold", {"x": ROW})
    await eventually(lambda: len(service.held) == 1)
    await server.close(0.01)
    assert service.cancelled == [service.submitted[0].service_id]
    with pytest.raises(ConnectionClosedError, match="closed"):
        await pending


async def test_stats_request_ids_share_the_in_flight_space(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    connection.send(InferRequest(1, "hold", {"x": ROW}))
    connection.send(GetStats(1))
    connection.send(ListModels(2))
    connection.send(CancelInfer(99))  # unknown: ignored
    stats, models = await recv(connection), await recv(connection)
    assert isinstance(stats, StatsReply) and stats.status == "duplicate_id"
    assert isinstance(models, ModelsReply) and models.status == "ok" and len(models.models) == 4
    connection.send(Ping(5, 6))
    pong = await recv(connection)
    assert isinstance(pong, Pong) and pong.seq == 5
    connection.close()


async def test_close_does_not_wait_forever_on_a_reader_that_stalls(service: FakeService) -> None:
    api = await _serve(service, limits=ServerLimits(flush_timeout_s=0.05))
    connection = await raw_client(api.address)
    for request_id in range(50):
        connection.send(InferRequest(request_id, "big", {"x": ROW}))
    connection._transport.pause_reading()  # type: ignore[union-attr]
    await eventually(lambda: api.snapshot()["slow_readers"] == 1)
    await asyncio.wait_for(api.close(0.0), 5)
    assert api.state is ServerState.CLOSED and api.connection_count == 0
    connection.abort()


async def test_a_second_answer_from_the_service_is_not_passed_on(server: ApiServer) -> None:
    connection = await raw_client(server.address)
    connection.send(InferRequest(1, "twice", {"x": ROW}))
    connection.send(Ping(2, 0))
    first, second = await recv(connection), await recv(connection)
    assert isinstance(first, InferReply) and first.ok
    assert isinstance(second, Pong)
    assert server.outstanding == 0
    connection.close()


async def test_a_start_that_cannot_bind_leaves_the_server_closed(
    server: ApiServer, service: FakeService
) -> None:
    second = ApiServer(service)
    with pytest.raises(OSError):
        await second.start(server.address)  # taken by the fixture's server
    assert second.state is ServerState.CLOSED and not second.accepting_requests
    async with asyncio.timeout(5):  # a hang guard: nothing to drain, it returns at once
        await second.close()
    with pytest.raises(RuntimeError, match="CLOSED to STARTING"):
        await second.start("127.0.0.1:0")
