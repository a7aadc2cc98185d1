"""The Open Inference Protocol over HTTP (`api.v2_http`, `api.v2_routes`) on the test's loop,
in front of a real `ApiServer` over the fake service: health, metadata, JSON and binary infers,
SLO parameters, tokens, the door, and clients that misbehave (bad bodies, too large, too slow,
gone), each answered in the protocol's error format with the connection or server still up."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httptools
import numpy as np
import pytest
import pytest_asyncio

from clockwork_async.api.auth import TokenAuth
from clockwork_async.api.server import ApiServer
from clockwork_async.api.v2_config import HttpConfig
from clockwork_async.api.v2_door import Door
from clockwork_async.api.v2_http import HttpFrontEnd
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.addresses import TcpAddress
from clockwork_async.wire.messages import ModelStatus, TensorSpec

from .conftest import eventually
from .fakes import FakeService

TOKEN = "infer-token-0123456789"
ADMIN = "admin-token-0123456789"
CONFIG = HttpConfig(
    listen=TcpAddress("127.0.0.1", 0),
    max_body_bytes=4096,
    request_timeout_s=0.3,
    idle_timeout_s=5.0,
)


@dataclass
class Front:
    api: ApiServer
    http: HttpFrontEnd
    service: FakeService
    answers: list[tuple[str, str]] = field(default_factory=list)
    clients: list[asyncio.StreamWriter] = field(default_factory=list)

    async def close(self) -> None:
        for writer in self.clients:
            writer.close()
        await self.http.close(0.5)
        await self.api.close(0.5)
        for writer in self.clients:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.http.address.rsplit(":", 1)
        return host, int(port)


async def start_front(service: FakeService, auth: TokenAuth | None = None) -> Front:
    api = ApiServer(service, auth=auth)
    await api.start("127.0.0.1:0")
    http = HttpFrontEnd(Door(api, "http", server_version="test"), CONFIG)
    await http.bind(CONFIG.listen)
    await http.serve()
    front = Front(api, http, service)
    api.on_answer = lambda protocol, status: front.answers.append((protocol, status))
    return front


@pytest_asyncio.fixture
async def front(service: FakeService) -> AsyncIterator[Front]:
    started = await start_front(service)
    yield started
    await started.close()


@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True

    def json(self) -> object:
        length = self.headers.get("inference-header-content-length")
        return json.loads(bytes(self.body[: int(length)] if length else self.body))


class Conn:
    """One client connection; `ask` writes bytes and reads one response (httptools)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._replies: list[Reply] = []
        self._parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._replies.append(Reply())

    def on_header(self, name: bytes, value: bytes) -> None:
        self._replies[-1].on_header(name, value)

    def on_headers_complete(self) -> None:
        self._replies[-1].status = self._parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        self._replies[-1].on_body(data)

    def on_message_complete(self) -> None:
        self._replies[-1].complete = True

    async def read(self, timeout_s: float = 5.0) -> Reply:
        async with asyncio.timeout(timeout_s):
            while not (self._replies and self._replies[0].complete):
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("closed")
                self._parser.feed_data(data)
        return self._replies.pop(0)

    async def ask(self, raw: bytes) -> Reply:
        self.writer.write(raw)
        return await self.read()

    async def closed(self, timeout_s: float = 5.0) -> bool:
        async with asyncio.timeout(timeout_s):
            return await self.reader.read() == b""


async def connect(front: Front) -> Conn:
    reader, writer = await asyncio.open_connection(*front.host_port)
    front.clients.append(writer)
    return Conn(reader, writer)


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: test", f"content-length: {len(body)}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def infer_body(values: list[float] | list[list[float]], **rest: object) -> bytes:
    shape = [len(values), 4] if isinstance(values[0], list) else [1, 4]
    tensor = {"name": "x", "shape": shape, "datatype": "FP32", "data": values}
    return json.dumps({"inputs": [tensor], **rest}).encode()


async def test_health_and_metadata_answer_at_once(front: Front) -> None:
    conn = await connect(front)
    assert (await conn.ask(request("GET", "/v2/health/live"))).status == 200
    assert (await conn.ask(request("GET", "/v2/health/ready"))).status == 200
    meta = (await conn.ask(request("GET", "/v2"))).json()
    assert meta == {
        "name": "clockwork-async",
        "version": "test",
        "extensions": ["binary_tensor_data", "parameters"],
    }
    model = (await conn.ask(request("GET", "/v2/models/echo"))).json()
    assert model == {
        "name": "echo",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
    }
    assert (await conn.ask(request("GET", "/v2/models/echo/ready"))).status == 200
    missing = await conn.ask(request("GET", "/v2/models/nope"))
    assert missing.status == 404 and missing.json() == {
        "error": "unknown_model: unknown model 'nope'"
    }
    front.service.health_now = front.service.health_now.__class__(True, False, "no executor")
    assert (await conn.ask(request("GET", "/v2/health/ready"))).status == 503


async def test_a_json_infer_is_submitted_and_answered_with_its_id_and_trace(front: Front) -> None:
    conn = await connect(front)
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    body = infer_body(
        [1, 2, 3, 4], id="req-7", parameters={"timeout": 5000, "slo_ms": 20, "priority": 3}
    )
    reply = await conn.ask(request("POST", "/v2/models/echo/infer", body, traceparent=trace))
    assert reply.status == 200, reply.body
    assert reply.headers["traceparent"] == trace and reply.headers["clockwork-outcome"] == "ok"
    document = reply.json()
    assert document == {
        "model_name": "echo",
        "model_version": "0",
        "id": "req-7",
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [2.0, 4.0, 6.0, 8.0]}
        ],
    }
    (submitted,) = front.service.submitted
    assert submitted.slo_ns == 5_000_000  # the earliest: timeout 5000 µs before slo_ms 20
    assert front.answers == [("http", "ok")] and front.api.outstanding == 0


async def test_binary_tensors_both_ways(front: Front) -> None:
    conn = await connect(front)
    x = np.array([[0.5, 1.5, 2.5, 3.5]], np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    reply = await conn.ask(
        request(
            "POST",
            "/v2/models/echo/infer",
            header + x.tobytes(),
            inference_header_content_length=str(len(header)),
        )
    )
    assert reply.status == 200 and reply.headers["content-type"] == "application/octet-stream"
    start = int(reply.headers["inference-header-content-length"])
    (output,) = json.loads(bytes(reply.body[:start]))["outputs"]
    assert output["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(
        np.frombuffer(bytes(reply.body[start:]), np.float32), (x * 2).ravel()
    )


@pytest.mark.parametrize(
    ("raw", "status", "words"),
    [
        (request("POST", "/v2/models/echo/infer", b"{bad"), 400, "not valid JSON"),
        (request("POST", "/v2/models/echo/infer", b'{"inputs": []}'), 400, "inputs must be"),
        (request("POST", "/v2/models/echo/infer", infer_body([1, 2])), 400, "do not fill"),
        (
            request(
                "POST",
                "/v2/models/echo/infer",
                infer_body([1, 2, 3, 4], parameters={"timeout": -1}),
            ),
            400,
            "timeout",
        ),
        (
            request(
                "POST",
                "/v2/models/echo/infer",
                infer_body([1, 2, 3, 4], parameters={"slo_ms": "x"}),
            ),
            400,
            "slo_ms",
        ),
        (
            request("POST", "/v2/models/echo/infer", b"{}", inference_header_content_length="9"),
            400,
            "must be an integer",
        ),
        (
            request("POST", "/v2/models/echo/versions/3/infer", infer_body([1, 2, 3, 4])),
            404,
            "version 3",
        ),
        (request("POST", "/v2/models/nope/infer", infer_body([1, 2, 3, 4])), 404, "unknown_model"),
        (request("GET", "/v2/models/echo/infer"), 405, "POST is"),
        (request("GET", "/v3/health"), 404, "under /v2"),
        (
            request("POST", "/v2/models/echo/infer", b"{}", content_encoding="gzip"),
            400,
            "compressed",
        ),
    ],
)
async def test_bad_requests_get_the_protocols_error_and_the_connection_serves_on(
    front: Front, raw: bytes, status: int, words: str
) -> None:
    conn = await connect(front)
    reply = await conn.ask(raw)
    assert reply.status == status and words in reply.json()["error"], reply.body  # type: ignore[index]
    assert (await conn.ask(request("GET", "/v2/health/live"))).status == 200


async def test_binary_sizes_that_disagree_with_the_bytes_are_refused(front: Front) -> None:
    conn = await connect(front)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    reply = await conn.ask(
        request(
            "POST",
            "/v2/models/echo/infer",
            header + bytes(12),
            inference_header_content_length=str(len(header)),
        )
    )
    assert reply.status == 400 and "binary section holds 12 bytes" in reply.json()["error"]  # type: ignore[index]
    assert not front.service.submitted


async def test_a_body_over_the_limit_is_refused_from_its_length_and_the_connection_closed(
    front: Front,
) -> None:
    conn = await connect(front)
    conn.writer.write(
        request("POST", "/v2/models/echo/infer").replace(
            b"content-length: 0", b"content-length: 5000"
        )
    )
    reply = await conn.read()
    assert reply.status == 413 and reply.headers["connection"] == "close"
    assert await conn.closed()
    chunked = (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    conn = await connect(front)
    conn.writer.write(chunked + b"1388\r\n" + bytes(5000) + b"\r\n0\r\n\r\n")
    assert (await conn.read()).status == 413


async def test_a_slow_client_gets_408_and_an_idle_one_is_closed(front: Front) -> None:
    slow = await connect(front)
    slow.writer.write(
        b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{"
    )
    reply = await slow.read(timeout_s=3.0)
    assert reply.status == 408 and await slow.closed()
    garbage = await connect(front)
    assert (await garbage.ask(b"\x16\x03\x01 not http\r\n\r\n")).status == 400
    fresh = await connect(front)  # others are served meanwhile
    assert (await fresh.ask(request("GET", "/v2/health/live"))).status == 200


async def test_tokens_guard_everything_but_health(service: FakeService) -> None:
    front = await start_front(service, TokenAuth(infer_token=TOKEN))
    try:
        conn = await connect(front)
        assert (await conn.ask(request("GET", "/v2/health/ready"))).status == 200
        denied = await conn.ask(request("POST", "/v2/models/echo/infer", infer_body([1, 2, 3, 4])))
        assert denied.status == 401 and denied.json() == {
            "error": "unauthorized: a bearer token with the infer scope is required"
        }
        wrong = request("GET", "/v2/models/echo", authorization="Bearer not-the-token-at-all")
        assert (await conn.ask(wrong)).status == 401
        allowed = request(
            "POST",
            "/v2/models/echo/infer",
            infer_body([1, 2, 3, 4]),
            authorization=f"Bearer {TOKEN}",
        )
        assert (await conn.ask(allowed)).status == 200
        assert (
            not [s for s in service.submitted if s.model != "echo"] and len(service.submitted) == 1
        )
    finally:
        await front.close()


async def test_the_door_refuses_from_the_header_with_429_and_retry_after(front: Front) -> None:
    front.service.models["door"] = front.service.models["echo"]
    conn = await connect(front)
    reply = await conn.ask(request("POST", "/v2/models/door/infer", infer_body([1, 2, 3, 4])))
    assert reply.status == 429 and reply.headers["retry-after"] == "1"
    assert reply.json() == {"error": "overloaded: the fake is overloaded"}
    assert front.service.screened and not front.service.submitted
    assert front.answers == [("http", "overloaded")]


async def test_a_client_that_goes_away_cancels_its_request(front: Front) -> None:
    conn = await connect(front)
    conn.writer.write(request("POST", "/v2/models/hold/infer", infer_body([1, 2, 3, 4])))
    await eventually(lambda: front.service.held)
    conn.writer.close()
    await eventually(lambda: front.service.cancelled)
    await eventually(lambda: front.api.outstanding == 0 and front.http.in_flight == 0)


async def test_pipelined_requests_are_answered_in_order(front: Front) -> None:
    conn = await connect(front)
    conn.writer.write(
        request("POST", "/v2/models/hold/infer", infer_body([1, 2, 3, 4]))
        + request("GET", "/v2/health/live")
        + request("POST", "/v2/models/echo/infer", infer_body([1, 1, 1, 1]))
    )
    await eventually(lambda: front.service.held)
    (held,) = front.service.held
    front.service.release(held)
    first, second, third = [await conn.read() for _ in range(3)]
    assert first.json()["outputs"][0]["data"] == [held] * 4  # type: ignore[index]
    assert second.json() == {"live": True} and third.status == 200


@pytest.mark.parametrize(
    "unreadable",
    [
        b"\x16\x03\x01 not http\r\n\r\n",  # malformed: 400
        request("POST", "/v2/models/echo/infer").replace(
            b"content-length: 0", b"content-length: 5000"
        ),  # over the body limit: 413
        request("GET", "/v2/health/live", **{f"x_{i}": "1" for i in range(101)}),  # 400
    ],
    ids=["malformed", "too-large", "too-many-headers"],
)
async def test_requests_before_an_unreadable_one_are_answered_first(
    front: Front, unreadable: bytes
) -> None:
    """The unreadable request's error is the last answer, then the connection closes: the
    pipelined requests read before it are never dropped."""
    conn = await connect(front)
    conn.writer.write(
        request("POST", "/v2/models/hold/infer", infer_body([1, 2, 3, 4]))
        + request("GET", "/v2/health/live")
        + unreadable
    )
    await eventually(lambda: front.service.held)
    (held,) = front.service.held
    front.service.release(held)
    first, second, last = [await conn.read() for _ in range(3)]
    assert first.status == 200 and first.json()["outputs"][0]["data"] == [held] * 4  # type: ignore[index]
    assert second.json() == {"live": True}
    assert last.status in (400, 413) and last.headers["connection"] == "close"
    assert await conn.closed()
    assert front.api.outstanding == 0


async def test_a_drain_answers_requests_in_flight_and_refuses_new_ones(front: Front) -> None:
    held = await connect(front)
    held.writer.write(request("POST", "/v2/models/hold/infer", infer_body([1, 2, 3, 4])))
    await eventually(lambda: front.service.held)
    other = await connect(front)
    assert (await other.ask(request("GET", "/v2/health/live"))).status == 200
    closing = asyncio.ensure_future(asyncio.gather(front.api.close(5.0), front.http.close(5.0)))
    await eventually(lambda: not front.api.accepting_requests)
    assert await other.closed()  # an idle connection is closed at once
    (service_id,) = front.service.held
    front.service.release(service_id)
    reply = await held.read()
    assert reply.status == 200 and reply.headers["connection"] == "close"
    await closing


async def test_a_client_batch_is_submitted_as_rows_and_answered_stacked(front: Front) -> None:
    conn = await connect(front)
    rows = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    tensor = {"name": "x", "shape": [3, 4], "datatype": "FP32", "data": rows}
    body = json.dumps({"inputs": [tensor], "parameters": {"slo_ms": 30}}).encode()
    reply = await conn.ask(request("POST", "/v2/models/echo/infer", body))
    (output,) = reply.json()["outputs"]  # type: ignore[index]
    assert output["shape"] == [3, 4]
    assert output["data"] == [2.0 * value for row in rows for value in row]
    assert [s.inputs["x"].tolist() for s in front.service.submitted] == [[row] for row in rows]
    assert {s.slo_ns for s in front.service.submitted} == {30_000_000}
    assert front.answers == [("http", "ok")] and front.api.outstanding == 0


async def test_one_refused_row_refuses_the_batch(front: Front) -> None:
    conn = await connect(front)
    conn.writer.write(request("POST", "/v2/models/hold/infer", infer_body([[1] * 4, [2] * 4])))
    await eventually(lambda: len(front.service.held) == 2)
    first, second = front.service.held
    front.service.release(first)
    front.service.release(second, Outcome.DROPPED)
    reply = await conn.read()
    assert reply.status == 504 and reply.json()["error"].startswith("dropped")  # type: ignore[index]


async def test_random_bytes_get_an_error_or_a_close_and_the_front_end_serves_on(
    front: Front,
) -> None:
    """Fuzzed requests (seeded): garbage, truncated heads, bit-flipped infers. Each connection
    ends in bounded time with an answer or a close; nothing reaches the service malformed."""
    rng = random.Random(32)
    valid = request("POST", "/v2/models/echo/infer", infer_body([1, 2, 3, 4]))
    for case in range(60):
        if case % 3 == 0:
            data = rng.randbytes(rng.randrange(1, 400))
        elif case % 3 == 1:
            data = valid[: rng.randrange(1, len(valid))]
        else:
            flipped = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            data = bytes(flipped)
        conn = await connect(front)
        conn.writer.write(data)
        conn.writer.write_eof()
        async with asyncio.timeout(5.0):
            rest = await conn.reader.read()  # whatever it answered, then the close
        assert rest == b"" or rest.startswith(b"HTTP/1.1 "), (case, rest[:80])
        conn.writer.close()
    for submitted in front.service.submitted:
        assert submitted.inputs["x"].shape == (1, 4)
    fresh = await connect(front)
    assert (await fresh.ask(request("GET", "/v2/health/ready"))).status == 200
    await eventually(lambda: front.api.outstanding == 0)


async def test_a_model_without_a_batch_axis_gets_its_tensor_whole(front: Front) -> None:
    fixed = (TensorSpec("x", "float32", (3, 4)),)
    front.service.models["fixed"] = ModelStatus("fixed", "fixed", "ready", inputs=fixed)
    conn = await connect(front)
    await conn.ask(request("POST", "/v2/models/fixed/infer", infer_body([[1] * 4] * 3)))
    (submitted,) = front.service.submitted
    assert submitted.inputs["x"].shape == (3, 4)


async def test_too_many_headers_or_connections_are_refused(service: FakeService) -> None:
    api = ApiServer(service)
    await api.start("127.0.0.1:0")
    config = HttpConfig(listen=TcpAddress("127.0.0.1", 0), max_connections=2)
    http = HttpFrontEnd(Door(api, "http", server_version="test"), config)
    await http.bind(config.listen)
    await http.serve()
    front = Front(api, http, service)
    try:
        first, second = await connect(front), await connect(front)
        assert (await second.ask(request("GET", "/v2/health/live"))).status == 200
        third = await connect(front)
        assert await third.closed()  # over max_connections: closed at once
        flood = {f"x_{i}": "y" for i in range(101)}
        reply = await first.ask(request("GET", "/v2/health/live", **flood))
        assert reply.status == 400 and "more than 100 headers" in reply.json()["error"]  # type: ignore[index]
        assert (await second.ask(request("GET", "/v2/health/live"))).status == 200
    finally:
        await front.close()


async def test_the_repository_index_lists_the_served_models(front: Front) -> None:
    conn = await connect(front)
    index = (await conn.ask(request("POST", "/v2/repository/index", b'{"ready": true}'))).json()
    assert {(m["name"], m["state"]) for m in index} == {  # type: ignore[index, union-attr]
        (name, "READY") for name in front.service.models
    }
    unload = await conn.ask(request("POST", "/v2/repository/models/echo/unload"))
    assert unload.status == 200 and unload.json() == {}
    index = (await conn.ask(request("POST", "/v2/repository/index"))).json()
    assert {"name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index  # type: ignore[operator]
    load = await conn.ask(request("POST", "/v2/repository/models/echo/load", b"{}"))
    assert load.status == 200 and front.service.models["echo"].state == "ready"
    hold = front.service.models["hold"]
    front.service.models["hold"] = dataclasses.replace(hold, state="profiling", reason="batch 4")
    index = (await conn.ask(request("POST", "/v2/repository/index"))).json()
    assert {"name": "hold", "version": "1", "state": "LOADING", "reason": "batch 4"} in index  # type: ignore[operator]
    missing = await conn.ask(request("POST", "/v2/repository/models/nope/load"))
    assert missing.status == 400 and missing.headers["clockwork-outcome"] == "unknown_model"
    config = b'{"parameters": {"config": "{}"}}'
    refused = await conn.ask(request("POST", "/v2/repository/models/echo/load", config))
    assert refused.status == 400 and "not supported" in refused.json()["error"]  # type: ignore[index]


async def test_load_and_unload_need_the_admin_scope(service: FakeService) -> None:
    front = await start_front(service, TokenAuth(infer_token=TOKEN, admin_token=ADMIN))
    try:
        conn = await connect(front)
        path = "/v2/repository/models/echo/unload"
        assert (await conn.ask(request("POST", path))).status == 401
        infer_only = await conn.ask(request("POST", path, authorization=f"Bearer {TOKEN}"))
        assert infer_only.status == 403 and service.models["echo"].state == "ready"
        admin = await conn.ask(request("POST", path, authorization=f"Bearer {ADMIN}"))
        assert admin.status == 200 and service.models["echo"].state == "unloaded"
    finally:
        await front.close()
