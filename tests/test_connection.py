"""The asyncio adapter over real Unix and TCP loopback sockets: messages both ways, pipelining,
bounded inbound queue with backpressure, peer close, bad bytes surfaced as ProtocolError."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from clockwork_async.api.auth import client_ssl_context, server_ssl_context
from clockwork_async.connection import Connection, ConnectionClosed, ConnectionState
from clockwork_async.endpoints import open_connection, start_server
from clockwork_async.wire.addresses import UnixAddress, parse_address
from clockwork_async.wire.codec import PREFIX, Decoder, Encoder, ProtocolError
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ErrorCode,
    Hello,
    Infer,
    Message,
    Ping,
    Pong,
)

Handler = Callable[[Connection], Awaitable[None]]
Serve = Callable[..., Awaitable[str]]


@pytest_asyncio.fixture(params=["unix", "tcp"])
async def serve(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Serve]:
    """Starts servers on a fresh Unix path or TCP loopback port; closes them afterwards."""
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, **options: object) -> str:
        if request.param == "unix":
            address = f"unix:{tmp_path / f's{len(servers)}.sock'}"
            servers.append(await start_server(handler, address, **options))  # type: ignore[arg-type]
            return address
        servers.append(await start_server(handler, "tcp:127.0.0.1:0", **options))  # type: ignore[arg-type]
        return f"tcp:127.0.0.1:{servers[-1].sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def _echo(connection: Connection) -> None:
    async for message in connection:
        connection.send(message)


async def test_messages_both_ways_pipelined(serve: Serve) -> None:
    client = await open_connection(await serve(_echo))
    sent: list[Message] = [Ping(i, i * 10) for i in range(100)]
    sent.append(Infer(1, "m", 1, {"x": np.arange(150_000, dtype=np.float32)}, 0, 1))
    for message in sent:
        client.send(message)
    await client.drain()
    for want in sent[:-1]:
        assert await client.recv() == want
    infer = await client.recv()
    assert isinstance(infer, Infer)
    np.testing.assert_array_equal(infer.inputs["x"], np.arange(150_000, dtype=np.float32))
    client.close()
    await client.wait_closed()
    assert client.state is ConnectionState.CLOSED


async def _dispatch_echo(connection: Connection) -> None:
    with contextlib.suppress(ConnectionClosed):
        await connection.dispatch(connection.send)


async def test_dispatch_hands_over_every_message_in_order_then_raises_the_ending(
    serve: Serve,
) -> None:
    client = await open_connection(await serve(_dispatch_echo))
    sent: list[Message] = [Ping(i, i) for i in range(200)]
    for message in sent:
        client.send(message)
    assert [await client.recv() for _ in sent] == sent
    client.close()
    await client.wait_closed()

    got: list[Message] = []
    ending: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    async def record(connection: Connection) -> None:
        try:
            await connection.dispatch(got.append)
        except ProtocolError as error:
            ending.set_result(error)

    address = parse_address(await serve(record))
    if isinstance(address, UnixAddress):
        _, writer = await asyncio.open_unix_connection(address.path)
    else:
        _, writer = await asyncio.open_connection(address.host, address.port)
    good = b"".join(Encoder().encode_bytes(m) for m in sent[:3])
    writer.write(good + PREFIX.pack(1, 0) + b"\xc1")
    error = await ending
    writer.close()
    await writer.wait_closed()
    assert got == sent[:3]  # the good messages before the bad bytes, then the error
    assert isinstance(error, ProtocolError) and error.code is ErrorCode.PROTOCOL_ERROR


async def test_dispatch_stops_at_a_handler_exception_and_raises_it(serve: Serve) -> None:
    got: list[Message] = []
    raised: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def handler(message: Message) -> None:
        got.append(message)
        if len(got) == 2:
            raise ValueError("second message refused")

    async def record(connection: Connection) -> None:
        try:
            await connection.dispatch(handler)
        except ValueError as error:
            raised.set_result(error)
        connection.close()

    client = await open_connection(await serve(record))
    for i in range(5):
        client.send(Ping(i, 0))
    assert "second message refused" in str(await raised)
    assert got == [Ping(0, 0), Ping(1, 0)]
    client.close()
    await client.wait_closed()


async def test_dispatch_holds_later_messages_while_a_handler_awaitable_runs(
    serve: Serve,
) -> None:
    """A handler that returns an awaitable (a model change in the API): the messages behind
    it are handed over only once it is done, still in order."""
    got: list[int] = []
    release = asyncio.Event()
    holding: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def held() -> None:
        holding.set_result(None)
        await release.wait()

    def handler(message: Message) -> Awaitable[None] | None:
        assert isinstance(message, Ping)
        got.append(message.seq)
        return held() if message.seq == 1 else None

    async def record(connection: Connection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await connection.dispatch(handler)

    client = await open_connection(await serve(record))
    for i in range(5):
        client.send(Ping(i, 0))
    await client.drain()
    async with asyncio.timeout(30):  # a hang guard, not a timing claim
        await holding
        for _ in range(20):
            await asyncio.sleep(0)  # time for the rest to arrive: none is handed over
        assert got == [0, 1]
        release.set()
        while len(got) < 5:
            await asyncio.sleep(0.001)
    assert got == [0, 1, 2, 3, 4]
    client.close()
    await client.wait_closed()


async def test_dispatch_stops_reading_while_the_peer_does_not_read_the_answers(
    serve: Serve,
) -> None:
    """A peer that sends and never reads: dispatch's answers fill the transport, dispatch
    stops, what arrives queues up to the bound, reading pauses, and the peer feels the
    backpressure, so neither side's memory grows; once it reads, every message is answered."""
    server_side: list[Connection] = []
    answer = {"y": np.zeros(64 << 10, np.uint8)}

    async def answer_each(connection: Connection) -> None:
        server_side.append(connection)
        with contextlib.suppress(ConnectionClosed):
            await connection.dispatch(lambda m: connection.send(ActionResult(0, outputs=answer)))

    client = await open_connection(await serve(answer_each, write_high_water_bytes=1 << 20))
    client._transport.pause_reading()  # type: ignore[union-attr]  # a peer that never reads
    async with asyncio.timeout(30):  # a hang guard, not a timing claim
        sent, request = 0, {"x": np.zeros(16 << 10, np.uint8)}
        while not client.writing_paused:
            assert sent < 20_000, "the sender never felt backpressure"
            client.send(ActionResult(sent, outputs=request))
            sent += 1
            await asyncio.sleep(0)
        (server,) = server_side
        assert server.writing_paused and server.reading_paused
        client._transport.resume_reading()  # type: ignore[union-attr]
        for _ in range(sent):
            assert isinstance(await client.recv(), ActionResult)  # every one answered
        assert not server.reading_paused
    client.close()
    await client.wait_closed()


async def test_dispatch_answers_what_a_half_closed_slow_reader_sent_before_ending() -> None:
    """The peer sends, ends its writing (TCP half-close) and reads only later: the messages
    that waited while the answers backed up are still handed over, then dispatch ends with
    ConnectionClosed."""
    ended: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    answer = {"y": np.zeros(64 << 10, np.uint8)}

    async def answer_each(connection: Connection) -> None:
        try:
            await connection.dispatch(lambda m: connection.send(ActionResult(0, outputs=answer)))
        except Exception as error:
            ended.set_result(error)

    server = await start_server(
        answer_each, "tcp:127.0.0.1:0", write_high_water_bytes=1 << 20, allow_half_close=True
    )
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.transport.pause_reading()  # type: ignore[attr-defined]  # reads nothing yet
        sent = 300  # ~20 MB of answers: far past the transport's high water and the kernel's
        writer.write(b"".join(Encoder().encode_bytes(Ping(i, 0)) for i in range(sent)))
        writer.write_eof()
        await writer.drain()
        await asyncio.sleep(0.2)  # the server gets the end while its answers are backed up
        writer.transport.resume_reading()  # type: ignore[attr-defined]
        decoder, answers = Decoder(), 0
        async with asyncio.timeout(30):  # a hang guard, not a timing claim
            while answers < sent and (chunk := await reader.read(1 << 20)):
                decoder.feed(chunk)
                while decoder.next_message() is not None:
                    answers += 1
            error = await ended
        assert answers == sent, repr(error)
        assert isinstance(error, ConnectionClosed), repr(error)
    finally:
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()


async def test_tcp_connections_disable_nagle_on_both_sides() -> None:
    server_side: list[Connection] = []

    async def keep(connection: Connection) -> None:
        server_side.append(connection)
        await connection.recv()

    server = await start_server(keep, "tcp:127.0.0.1:0")
    try:
        client = await open_connection(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        client.send(Ping(1, 2))
        await client.drain()
        while not server_side:
            await asyncio.sleep(0)
        for connection in (client, server_side[0]):
            sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        client.close()
        await client.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_peer_close_ends_recv_and_iteration(serve: Serve) -> None:
    async def greet_and_close(connection: Connection) -> None:
        connection.send(Hello(PROTOCOL_VERSION, "executor", "ex0"))

    client = await open_connection(await serve(greet_and_close))
    assert [m async for m in client] == [Hello(PROTOCOL_VERSION, "executor", "ex0")]
    with pytest.raises(ConnectionClosed, match="peer closed"):
        await client.recv()
    await client.wait_closed()
    with pytest.raises(ConnectionClosed):
        client.send(Ping(1, 1))
    with pytest.raises(ConnectionClosed):
        await client.drain()


async def test_local_close_wakes_a_waiting_reader(serve: Serve) -> None:
    client = await open_connection(await serve(_echo))
    reader = asyncio.ensure_future(client.recv())
    await asyncio.sleep(0)
    client.close()
    with pytest.raises(ConnectionClosed, match="this side"):
        await reader
    await client.wait_closed()


async def test_bad_bytes_surface_as_protocol_error_and_the_server_answers_error(
    serve: Serve,
) -> None:
    seen: list[object] = []

    async def record(connection: Connection) -> None:
        try:
            async for message in connection:
                seen.append(message)
        except ProtocolError as e:
            seen.append(e.code)
            raise

    address = parse_address(await serve(record))
    if isinstance(address, UnixAddress):
        reader, writer = await asyncio.open_unix_connection(address.path)
    else:
        reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(Encoder().encode_bytes(Ping(1, 2)) + PREFIX.pack(1, 0) + b"\xc1")
    decoder = Decoder()
    async with asyncio.timeout(30):  # a hang guard, not a timing claim
        decoder.feed(await reader.read())  # until the server closes
    writer.close()
    await writer.wait_closed()
    assert seen == [Ping(1, 2), ErrorCode.PROTOCOL_ERROR]
    error = decoder.next_message()
    assert isinstance(error, Error) and error.code == ErrorCode.PROTOCOL_ERROR
    assert decoder.next_message() is None


async def test_a_peer_that_closes_mid_frame_is_reported(serve: Serve) -> None:
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def record(connection: Connection) -> None:
        try:
            await connection.recv()
        except ConnectionClosed as e:
            ended.set_result(str(e))

    client = await open_connection(await serve(record))
    client._transport.write(Encoder().encode_bytes(Ping(1, 2))[:-3])  # type: ignore[union-attr]
    client.close()
    assert "mid-frame" in await ended


async def test_expect_hello_rejects_a_peer_that_does_not_greet(serve: Serve) -> None:
    async def ping_first(connection: Connection) -> None:
        connection.send(Ping(1, 2))
        await connection.recv()

    client = await open_connection(await serve(ping_first), expect_hello=True)
    with pytest.raises(ProtocolError) as info:
        await client.recv()
    assert info.value.code is ErrorCode.PROTOCOL_ERROR
    client.close()
    await client.wait_closed()


async def test_a_slow_consumer_bounds_its_queue_and_pushes_back_on_the_sender(
    serve: Serve,
) -> None:
    max_queued = 4
    go = asyncio.Event()
    server_side: list[Connection] = []

    async def slow_counter(connection: Connection) -> None:
        server_side.append(connection)
        await go.wait()
        count = 0
        async for message in connection:
            assert isinstance(message, ActionResult) and message.action_id == count
            count += 1
            if message.code == "last":
                connection.send(Pong(count, 0, 0))

    client = await open_connection(
        await serve(slow_counter, max_queued_messages=max_queued, max_queued_bytes=1 << 30)
    )
    async with asyncio.timeout(30):  # a hang guard, not a timing claim
        payload = {"y": np.zeros(16 << 10, np.uint8)}
        sent = 0
        while not client.writing_paused:
            assert sent < 20_000, "the sender never felt backpressure"
            client.send(ActionResult(sent, outputs=payload))
            sent += 1
            await asyncio.sleep(0)
        (server,) = server_side
        assert server.reading_paused
        assert server.queued_messages <= max_queued + 1  # + what one read chunk completes
        drained = asyncio.ensure_future(client.drain())
        await asyncio.sleep(0)
        assert not drained.done()
        go.set()
        await drained
        client.send(ActionResult(sent, code="last"))
        assert await client.recv() == Pong(sent + 1, 0, 0)
        client.close()
        await client.wait_closed()


async def test_tls_on_both_sides_with_the_public_functions(
    serve: Serve, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    address = await serve(_echo, ssl=server_ssl_context(cert, key))
    hostname = "localhost" if address.startswith("unix:") else None  # TCP: the host itself
    client = await open_connection(address, ssl=client_ssl_context(cert), server_hostname=hostname)
    client.send(Ping(1, 2))
    assert await asyncio.wait_for(client.recv(), 10) == Ping(1, 2)
    client.close()
    await client.wait_closed()
    plain = await open_connection(address)  # no TLS: the server cannot read it
    plain.send(Ping(3, 4))
    with pytest.raises((ConnectionClosed, ProtocolError)):
        await asyncio.wait_for(plain.recv(), 10)
    plain.abort()
    await plain.wait_closed()


class RecordingTransport(asyncio.Transport):
    """Records the write calls a Connection makes (64 KiB high-water mark, like asyncio's)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed_after = -1  # how many writes came before close()

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.writes.append(b"".join(list_of_data))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (16 << 10, 64 << 10)

    def close(self) -> None:
        self.closed_after = len(self.writes)


def recording_connection() -> tuple[Connection, RecordingTransport]:
    connection, transport = Connection(), RecordingTransport()
    connection._on_connection_made(transport)  # what the protocol does once connected
    return connection, transport


def decoded(writes: list[bytes]) -> list[Message]:
    decoder = Decoder()
    decoder.feed(b"".join(writes))
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


async def test_a_lone_message_is_written_at_once_and_a_burst_in_one_more_write() -> None:
    connection, transport = recording_connection()
    connection.send(Ping(1, 0))
    assert len(transport.writes) == 1  # at once: a lone message never waits for the loop
    for seq in range(2, 6):
        connection.send(Ping(seq, 0))
    assert len(transport.writes) == 1  # held: the same loop iteration
    await asyncio.sleep(0)
    assert len(transport.writes) == 2  # all four, in one call
    connection.send(Ping(6, 0))  # a new iteration: at once again
    assert len(transport.writes) == 3
    assert decoded(transport.writes) == [Ping(seq, 0) for seq in range(1, 7)]
    await asyncio.sleep(0)


async def test_held_messages_go_out_at_the_high_water_mark_and_on_close() -> None:
    connection, transport = recording_connection()
    connection.send(Ping(1, 0))
    big = ActionResult(2, outputs={"y": np.zeros(70 << 10, np.uint8)})
    connection.send(big)  # over the transport's high-water mark: not held
    assert len(transport.writes) == 2
    connection.send(Ping(3, 0))
    connection.close()  # flushes what it held, then closes
    assert transport.closed_after == 3
    assert [getattr(m, "seq", None) for m in decoded(transport.writes)] == [1, None, 3]
    await asyncio.sleep(0)
    assert len(transport.writes) == 3


async def test_when_written_waits_for_the_bytes_to_leave_or_the_connection_to_go() -> None:
    arrived, finished = asyncio.Event(), asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # then never again: the stream stops reading at its limit
        arrived.set()
        await finished.wait()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = await open_connection(f"tcp:127.0.0.1:{port}")
    done: list[str] = []
    try:
        client.send(Ping(1, 0))
        client.when_written(lambda: done.append("small"))
        assert done == []  # never at once: the transport may still hold the bytes
        await arrived.wait()
        await asyncio.sleep(0.05)
        assert done == ["small"]  # it left the process
        big = np.zeros(64 << 20, np.uint8)  # more than the kernel buffers take unread
        client.send(Infer(2, "m", 1, {"x": big}, 0, 1))
        client.when_written(lambda: done.append("big"))
        await asyncio.sleep(0.2)
        assert done == ["small"]  # the transport still points into ``big``
    finally:
        client.abort()
        await client.wait_closed()
        finished.set()
        server.close()
        await server.wait_closed()
    assert done == ["small", "big"]  # the connection went, and the transport's hold with it
    client.when_written(lambda: done.append("after"))
    assert done[-1] == "after"
