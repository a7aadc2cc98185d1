"""Half-closed clients over real loopback sockets: a client that sends its requests and then
shuts down its writing (``shutdown(SHUT_WR)``, asyncio's ``write_eof``) still gets every reply,
then end of input; one that closed both ways shows itself when a reply meets its reset, and
what it left is cancelled once each."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np

from clockwork_async.api.server import ApiServer
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.codec import Decoder, Encoder
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    InferReply,
    InferRequest,
    Message,
    Ping,
    Pong,
)

from .conftest import eventually, raw_client
from .fakes import FakeService

ROW = np.arange(4, dtype=np.float32).reshape(1, 4)
HELLO = Hello(PROTOCOL_VERSION, "client", "half-closer")


def frames(*messages: Message) -> bytes:
    encoder = Encoder()
    return b"".join(encoder.encode_bytes(message) for message in messages)


async def read_to_end(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> list[Message]:
    """Every message until the server closes (end of input), decoded."""
    decoder = Decoder()
    async with asyncio.timeout(timeout_s):
        while chunk := await reader.read(65536):
            decoder.feed(chunk)
    messages = []
    while (message := decoder.next_message()) is not None:
        messages.append(message)
    return messages


async def half_close(address: str, data: bytes) -> tuple[asyncio.StreamReader, asyncio.Task]:
    """Connect, send ``data``, end writing; returns the reader and a task reading to the end."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    writer.write_eof()
    task = asyncio.get_running_loop().create_task(read_to_end(reader))
    task.add_done_callback(lambda _: writer.close())
    return reader, task


async def test_a_half_closed_client_gets_every_reply_then_end_of_input(
    server: ApiServer, service: FakeService
) -> None:
    requests = [InferRequest(i, "echo", {"x": ROW}) for i in range(3)]
    requests += [InferRequest(10 + i, "hold", {"x": ROW}) for i in range(2)]
    _, reading = await half_close(server.address, frames(HELLO, *requests, Ping(7, 8)))
    await eventually(lambda: len(service.held) == 2)
    await asyncio.sleep(0.05)
    assert not reading.done()  # held requests keep the connection open, writable
    for service_id in list(service.held):
        service.release(service_id)
    messages = await reading
    assert isinstance(messages[0], Hello)
    replies = {m.request_id: m.status for m in messages if isinstance(m, InferReply)}
    assert replies == {0: "ok", 1: "ok", 2: "ok", 10: "ok", 11: "ok"}
    assert any(isinstance(m, Pong) for m in messages)
    assert service.cancelled == [] and all(n == 1 for n in service.answers.values())
    await eventually(lambda: server.outstanding == 0 and server.connection_count == 0)


async def test_a_frame_cut_short_by_the_half_close_leaves_the_whole_ones_answered(
    server: ApiServer, service: FakeService
) -> None:
    whole = frames(HELLO, InferRequest(1, "echo", {"x": ROW}))
    cut = frames(InferRequest(2, "echo", {"x": ROW}))[:-5]
    _, reading = await half_close(server.address, whole + cut)
    messages = await reading
    assert [type(m) for m in messages] == [Hello, InferReply]
    assert messages[1].request_id == 1 and messages[1].status == "ok"  # type: ignore[attr-defined]
    await eventually(lambda: server.connection_count == 0)


async def test_the_error_for_a_bad_frame_before_the_half_close_is_delivered(
    server: ApiServer,
) -> None:
    garbage = struct.pack(">II", 3, 0) + b"\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    _, reading = await half_close(server.address, frames(HELLO) + garbage)
    messages = await reading
    assert isinstance(messages[0], Hello)
    assert isinstance(messages[-1], Error) and messages[-1].code == "protocol_error"


async def test_a_client_closed_both_ways_is_found_by_a_reply_and_the_rest_cancelled(
    server: ApiServer, service: FakeService
) -> None:
    connection = await raw_client(server.address)
    for request_id in range(3):
        connection.send(InferRequest(request_id, "hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 3)
    connection.close()  # a FIN, as a half-close sends: the server cannot tell them apart yet
    await asyncio.sleep(0.05)
    assert service.cancelled == []
    first, second, third = sorted(service.held)
    service.release(first)  # its reply meets the peer's reset
    await asyncio.sleep(0.05)
    if third in service.held:  # the reset is seen on the next write at the latest
        service.release(second, Outcome.OK)
    await eventually(lambda: third not in service.held)
    assert third in service.cancelled
    assert all(count == 1 for count in service.answers.values()), service.answers
    await eventually(lambda: server.outstanding == 0 and server.connection_count == 0)


async def test_a_reset_cancels_at_once(server: ApiServer, service: FakeService) -> None:
    connection = await raw_client(server.address)
    for request_id in range(2):
        connection.send(InferRequest(request_id, "hold", {"x": ROW}))
    await eventually(lambda: len(service.held) == 2)
    sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.abort()
    await eventually(lambda: len(service.cancelled) == 2)
    await eventually(lambda: server.outstanding == 0 and server.connection_count == 0)
