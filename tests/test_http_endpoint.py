"""The metrics/health HTTP responder: pure parsing and responses, then real HTTP on loopback
(including `promtool check metrics` on a scrape where promtool is installed)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from clockwork_async.daemon.http_endpoint import (
    BadRequest,
    HeadReader,
    HttpEndpoint,
    HttpLimits,
    Readiness,
    Request,
    encode,
    parse_head,
    respond,
)
from clockwork_async.daemon.metrics import ExecutorGauges, LiveSnapshot, Metrics

GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


# --- Pure parsing ---------------------------------------------------------------------------


def test_parse_a_well_formed_head() -> None:
    head = b"GET /metrics?name=x HTTP/1.1\r\nHost: h\r\nAccept:  text/plain \r\n\r\n"
    assert parse_head(head) == Request("GET", "/metrics", {"host": "h", "accept": "text/plain"})
    assert parse_head(b"HEAD /healthz HTTP/1.0\r\n\r\n").method == "HEAD"


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (b"GET /metrics\r\n\r\n", "version 0.9"),  # llhttp reads it as HTTP/0.9
        (b"GET /metrics HTTP/1.1 x\r\nHost: x\r\n\r\n", "malformed request"),
        (b"G(T /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "method"),
        (b"GET http://x/metrics HTTP/1.1\r\nHost: x\r\n\r\n", "absolute path"),
        (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", "version"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", "Host"),
        (b"GET /metrics HTTP/1.1\r\nHost x\r\n\r\n", "header"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", "header"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\x01\r\n\r\n", "header value"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n", "empty line"),
        (b"GET /metrics HTTP/1.1\r\n" + b"A: b\r\n" * 65 + b"Host: x\r\n\r\n", "too many"),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "too large"),
    ],
)
def test_parse_refuses_malformed_heads(head: bytes, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        parse_head(head)


def test_a_head_fed_in_pieces_is_read_once_complete_and_what_follows_is_not() -> None:
    reader = HeadReader()
    assert reader.feed(b"GE") is None
    assert reader.feed(b"T /healthz HTTP/1.1\r\nHo") is None
    request = reader.feed(b"st: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert request == Request("GET", "/healthz", {"host": "x"})
    assert reader.feed(b"anything at all") == request  # the head is read: nothing more is


def test_a_head_that_never_ends_is_refused_once_over_the_limit() -> None:
    reader = HeadReader(HttpLimits(max_head_bytes=100))
    assert reader.feed(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Long: ") is None
    with pytest.raises(BadRequest, match="too large"):
        reader.feed(b"a" * 100)  # the header has not ended, so llhttp has not called back


def ready() -> Readiness:
    return Readiness(True)


def test_routes_and_methods() -> None:
    registry = CollectorRegistry()
    assert respond(Request("GET", "/nope"), registry, ready).status == 404
    not_allowed = respond(Request("POST", "/metrics"), registry, ready)
    assert not_allowed.status == 405
    assert ("Allow", "GET, HEAD") in not_allowed.headers
    assert respond(Request("GET", "/healthz"), registry, ready).body == b"ok\n"


def test_readyz_reports_the_reason_and_survives_a_failing_check() -> None:
    registry = CollectorRegistry()
    waiting = respond(Request("GET", "/readyz"), registry, lambda: Readiness(False, "0/2 up"))
    assert (waiting.status, waiting.body) == (503, b"not ready: 0/2 up\n")

    def broken() -> Readiness:
        raise RuntimeError("boom")

    assert respond(Request("GET", "/readyz"), registry, broken).status == 503


def test_encode_sets_length_and_closes() -> None:
    response = respond(Request("GET", "/healthz"), CollectorRegistry(), ready)
    data = encode(response)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: 3\r\n" in data
    assert b"Connection: close\r\n" in data
    assert data.endswith(b"\r\n\r\nok\n")
    assert encode(response, head_only=True).endswith(b"\r\n\r\n")


# --- Real HTTP on loopback ------------------------------------------------------------------


class Served:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry, instance_label_limit=50)
        self.readiness = Readiness(False, "executors starting")
        self.endpoint = HttpEndpoint(
            self.registry,
            lambda: self.readiness,
            HttpLimits(head_timeout_s=0.3, max_connections=4),
        )
        self.port = 0

    async def get(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(raw)
        await writer.drain()
        data = await reader.read()  # the server closes after one response
        writer.close()
        await writer.wait_closed()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers, body


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    server = Served()
    _, server.port = await server.endpoint.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.endpoint.close()


async def test_scrape_over_http(served: Served) -> None:
    served.metrics.observe_reply("m-0", "m", "ok", 0.01, 0.001, 0.005, 0.09)
    status, headers, body = await served.get(GET)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=")
    assert int(headers["Content-Length"]) == len(body)
    assert b'clockwork_requests_total{group="m",outcome="ok"} 1.0' in body


async def test_openmetrics_is_negotiated(served: Served) -> None:
    accept = b"Accept: application/openmetrics-text;version=1.0.0\r\n"
    status, headers, body = await served.get(GET.replace(b"\r\n\r\n", b"\r\n" + accept + b"\r\n"))
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


async def test_health_and_readiness_over_http(served: Served) -> None:
    assert (await served.get(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 200
    status, _, body = await served.get(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (503, b"not ready: executors starting\n")
    served.readiness = Readiness(True)
    assert (await served.get(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 200


async def test_head_has_headers_and_no_body(served: Served) -> None:
    status, headers, body = await served.get(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, headers["Content-Length"], body) == (200, "3", b"")


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 405),
        (b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (b"\x16\x03\x01 tls hello\r\n\r\n", 400),
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n", 400),
    ],
)
async def test_bad_requests_get_an_error_status(served: Served, raw: bytes, status: int) -> None:
    assert (await served.get(raw))[0] == status


async def exchange(port: int, *chunks: bytes) -> bytes:
    """Send ``chunks`` one write each; everything the server sends until it closes (which
    the guard bounds: a server that neither answers nor closes fails the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(10):
            for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
                await asyncio.sleep(0)
            return await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"GET /metrics HTTP/1.1 extra\r\nHost: x\r\n\r\n", b"malformed request"),
        (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", b"version"),
        (b"GET http://x/metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"absolute path"),
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"without Host"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"too large"),
        (b"GET /metrics HTTP/1.1\r\n" + b"A: b\r\n" * 65 + b"Host: x\r\n\r\n", b"too many"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n", b"header token"),
    ],
)
async def test_malformed_requests_are_answered_400_naming_the_problem(
    served: Served, raw: bytes, says: bytes
) -> None:
    data = await exchange(served.port, raw)
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert says in data.partition(b"\r\n\r\n")[2]


async def test_a_head_over_the_limit_that_never_ends_is_answered_400(served: Served) -> None:
    start = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Long: "
    data = await exchange(served.port, start, *[b"a" * 1024] * 9)  # no end of line, ever
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert data.endswith(b"request head too large\n")


async def test_a_head_in_pieces_is_answered(served: Served) -> None:
    data = await exchange(served.port, b"GET /hea", b"lthz HTTP/1.1\r\nHo", b"st: x\r\n\r", b"\n")
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert data.endswith(b"\r\n\r\nok\n")


async def test_pipelined_requests_get_one_answer_then_the_connection_closes(
    served: Served,
) -> None:
    healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    data = await exchange(served.port, healthz + GET + b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert data.count(b"HTTP/1.1 ") == 1
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert data.endswith(b"\r\nConnection: close\r\n\r\nok\n")


async def test_a_body_is_not_waited_for(served: Served) -> None:
    raw = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\nab"
    data = await exchange(served.port, raw)  # a gigabyte announced, two bytes sent
    assert data.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n")
    assert b"\r\nAllow: GET, HEAD\r\n" in data


async def test_an_idle_client_is_disconnected_without_an_answer(served: Served) -> None:
    assert await exchange(served.port) == b""  # closed by the server after head_timeout_s


async def test_a_slow_client_is_disconnected(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
    await writer.drain()
    assert await reader.read() == b""  # closed by the server after head_timeout_s
    writer.close()
    await writer.wait_closed()


async def test_a_client_that_does_not_take_its_answer_is_disconnected() -> None:
    body_bytes = 32 << 20  # more than loopback's socket buffers hold
    endpoint = HttpEndpoint(
        CollectorRegistry(),
        lambda: Readiness(False, "x" * body_bytes),
        HttpLimits(write_timeout_s=0.2),
    )
    _, port = await endpoint.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(1.0)  # not reading; the server's write timer is on this same loop
        received_bytes = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(1 << 20):
                received_bytes += len(chunk)
        assert received_bytes < body_bytes  # cut off, not delivered late
        writer.close()
    finally:
        await endpoint.close()


async def test_connections_over_the_limit_are_closed_and_close_ends_idle_ones(
    served: Served,
) -> None:
    idle = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(4)]
    await asyncio.sleep(0.05)  # let the server accept them
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(GET)
    assert await closed_without_answer(reader)
    writer.close()
    await served.endpoint.close()
    for idle_reader, idle_writer in idle:
        assert await closed_without_answer(idle_reader)
        idle_writer.close()


async def closed_without_answer(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read() == b""
    except ConnectionResetError:
        return True


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
async def test_promtool_accepts_a_full_scrape(served: Served) -> None:
    metrics = served.metrics
    for i in range(200):
        metrics.observe_reply(f"inst-{i}", f"group-{i % 7}", "ok", 0.01, 0.002, 0.004, 0.05)
        metrics.observe_reply(f"inst-{i}", f"group-{i % 7}", "dropped", 0.03)
    metrics.observe_prediction("infer", 0.0003)
    metrics.observe_prediction("load", -0.002)
    metrics.observe_load("group-1", 0.004)
    metrics.observe_eviction("group-1")
    metrics.observe_loop_lag(0.0002)
    metrics.executor_restarted("local-0")
    gauges = ExecutorGauges("local-0", True, 10, 64, 3)
    live = LiveSnapshot((gauges,), 2, {"group-1": 2}, 1, 4, 200, 1, cold_starts=3)
    metrics.set_snapshot_source(lambda: live)
    status, _, body = await served.get(GET)
    assert status == 200
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
