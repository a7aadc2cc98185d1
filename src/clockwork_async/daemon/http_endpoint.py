"""A minimal HTTP/1.1 responder on the daemon's event loop: ``/metrics``, ``/healthz``,
``/readyz``. Not a thread: a scrape reads the live state on the loop that owns it. Requests are
parsed by httptools (llhttp), as the Open Inference Protocol front end's are (`api/v2_http.py`,
which shares `api/http_shared.py` with this module); nothing is parsed by hand.

Invariants: one request per connection (every response says ``Connection: close``; bytes after
the first request's head, a body or pipelined requests, are never read); a request head is at
most ``max_head_bytes`` and ``max_headers`` headers, HTTP/1.0 or 1.1 (1.1 with ``Host``) with an
absolute-path target, else it is answered 400; a head must arrive within ``head_timeout_s`` of
the connection, and an answer be taken by the client within ``write_timeout_s``, else the
connection is closed without a word; only GET and HEAD are served (405 otherwise); at most
``max_connections`` are open at once (more are closed at once). Parsing (``HeadReader``,
``parse_head``) and responses (``respond``, ``encode``) do no I/O; ``HttpEndpoint`` only moves
bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from clockwork_async.api.http_shared import ConnectionTimer, encode_head

log = logging.getLogger(__name__)

_VERSIONS = ("1.0", "1.1")
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_head_bytes: int = 8192
    max_headers: int = 64
    head_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_connections: int = 64


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the daemon should get traffic; ``reason`` says why not."""

    ready: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()


class BadRequest(ValueError):
    """A request head that breaks the rules; the message is sent back with a 400."""


class _Stop(Exception):
    """Raised in a parser callback to stop httptools: the head is complete or refused."""


class HeadReader:
    """One request head, fed as it arrives and parsed by httptools; `feed` returns the
    `Request` once the head is complete (what follows it is not parsed) and raises BadRequest
    naming the problem (the parser's words for malformed HTTP)."""

    def __init__(self, limits: HttpLimits = HttpLimits()) -> None:
        self._limits = limits
        self._parser = httptools.HttpRequestParser(self)
        self._target = bytearray()
        self._headers: dict[str, str] = {}
        self._fed_bytes = 0
        self._field_bytes = 0
        self._header_lines = 0
        self._error: BadRequest | None = None
        self.request: Request | None = None

    def feed(self, data: bytes) -> Request | None:
        if self.request is not None:
            return self.request
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if self._error is not None:
                raise self._error from None
            if self.request is None:  # a callback failed unexpectedly: refuse, do not wait
                raise BadRequest("malformed request") from None
            return self.request
        except httptools.HttpParserError as error:  # also the Upgrade and invalid-method kinds
            raise BadRequest(f"malformed request: {error}") from None
        self._fed_bytes += len(data)
        if self.request is None and self._fed_bytes > self._limits.max_head_bytes:
            raise BadRequest("request head too large")
        return self.request

    def _refuse(self, problem: str) -> None:
        self._error = BadRequest(problem)
        raise _Stop

    def _count(self, field_bytes: int) -> None:
        self._field_bytes += field_bytes
        if self._field_bytes > self._limits.max_head_bytes:
            self._refuse("request head too large")

    # --- httptools' callbacks -----------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        self._header_lines += 1
        if self._header_lines > self._limits.max_headers:
            self._refuse("too many header lines")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")  # llhttp keeps trailing blanks
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        version = self._parser.get_http_version()
        if version not in _VERSIONS:
            self._refuse(f"unsupported HTTP version {version}")
        if not self._target.startswith(b"/"):
            self._refuse("target must be an absolute path")
        if version == "1.1" and "host" not in self._headers:
            self._refuse("HTTP/1.1 request without Host")
        method = self._parser.get_method().decode("ascii")
        path = bytes(self._target).split(b"?", 1)[0].decode("ascii")
        self.request = Request(method, path, self._headers)
        raise _Stop  # no body is read


def parse_head(head: bytes, limits: HttpLimits = HttpLimits()) -> Request:
    """Parse a whole request head (request line and headers, ending with an empty line);
    raises BadRequest naming the problem."""
    request = HeadReader(limits).feed(head)
    if request is None:
        raise BadRequest("request head must end with an empty line")
    return request


def respond(
    request: Request, registry: CollectorRegistry, readiness: Callable[[], Readiness]
) -> Response:
    """The response to a parsed request."""
    routes = {"/metrics", "/healthz", "/readyz"}
    if request.path not in routes:
        return Response(404, b"not found\n")
    if request.method not in ("GET", "HEAD"):
        return Response(405, b"only GET and HEAD\n", headers=(("Allow", "GET, HEAD"),))
    if request.path == "/healthz":
        return Response(200, b"ok\n")
    if request.path == "/readyz":
        return _readyz(readiness)
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(200, encoder(registry), content_type)


def _readyz(readiness: Callable[[], Readiness]) -> Response:
    try:
        state = readiness()
    except Exception:
        log.exception("readiness check failed")
        return Response(503, b"not ready: the readiness check failed\n")
    if state.ready:
        return Response(200, b"ready\n")
    return Response(503, f"not ready: {state.reason}\n".encode())


def encode(response: Response, *, head_only: bool = False) -> bytes:
    """The response's bytes; ``head_only`` leaves out the body (for HEAD)."""
    head = encode_head(
        response.status,
        (
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
            *response.headers,
        ),
    )
    return head if head_only else head + response.body


class HttpEndpoint:
    """Serves ``registry`` and the health checks on one TCP address."""

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Callable[[], Readiness],
        limits: HttpLimits = HttpLimits(),
    ) -> None:
        self.registry = registry
        self.readiness = readiness
        self.limits = limits
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; returns the bound (host, port), useful with port 0. Raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        """Stop listening and close every open connection."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def added(self, connection: _Connection) -> bool:
        if len(self._connections) >= self.limits.max_connections:
            return False
        self._connections.add(connection)
        return True

    def removed(self, connection: _Connection) -> None:
        self._connections.discard(connection)


class _Connection(asyncio.Protocol):
    """One client: its head read until complete, one answer written, then closed. The timer
    bounds the head's arrival, then the answer's delivery; either way it ends in an abort."""

    def __init__(self, endpoint: HttpEndpoint) -> None:
        self._endpoint = endpoint
        self._reader = HeadReader(endpoint.limits)
        self._transport: asyncio.Transport | None = None
        self._timer = ConnectionTimer(self.abort)
        self._done = False  # answered (or refused): nothing more is read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if not self._endpoint.added(self):
            self._done = True
            self._transport.abort()
            return
        self._timer.arm(self._endpoint.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._done = True
        self._timer.stop()
        self._endpoint.removed(self)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        try:
            request = self._reader.feed(data)
        except BadRequest as error:
            self._send(Response(400, f"{error}\n".encode()))
            return
        if request is not None:
            self._send(self._answer(request), head_only=request.method == "HEAD")

    def eof_received(self) -> bool | None:
        return None  # the transport closes once what is written has gone

    def _answer(self, request: Request) -> Response:
        endpoint = self._endpoint
        try:
            return respond(request, endpoint.registry, endpoint.readiness)
        except Exception:
            log.exception("answering %s %s failed", request.method, request.path)
            return Response(500, b"internal error\n")

    def _send(self, response: Response, *, head_only: bool = False) -> None:
        transport = self._transport
        assert transport is not None
        self._done = True
        transport.pause_reading()  # one request per connection: the rest is never read
        transport.write(encode(response, head_only=head_only))
        if transport.can_write_eof():
            transport.write_eof()
        transport.close()  # once the answer is written; a client that does not read it:
        self._timer.arm(self._endpoint.limits.write_timeout_s)  # aborted then

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
