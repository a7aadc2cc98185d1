"""A minimal HTTP/1.1 responder on the daemon's event loop: ``/metrics``, ``/healthz``,
``/readyz``. Not a thread: a scrape reads the live state on the loop that owns it.

Invariants: one request per connection (every response says ``Connection: close``); a request
head is at most ``max_head_bytes`` and ``max_headers`` lines and must arrive within
``head_timeout_s``, or the connection is answered 400 or closed; no body is ever read; only
GET and HEAD are served (405 otherwise); at most ``max_connections`` are open at once (more
are closed at once). Parsing (``parse_head``) and responses (``respond``, ``encode``) are pure
functions; ``HttpEndpoint`` only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_TARGET = re.compile(rb"^/[\x21-\x7e]*\Z")
_VERSIONS = (b"HTTP/1.0", b"HTTP/1.1")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
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


def parse_head(head: bytes, limits: HttpLimits = HttpLimits()) -> Request:
    """Parse a request head (request line and headers, ending with an empty line); raises
    BadRequest naming the problem."""
    if len(head) > limits.max_head_bytes:
        raise BadRequest("request head too large")
    lines = head.split(b"\r\n")
    if lines[-2:] != [b"", b""]:
        raise BadRequest("request head must end with an empty line")
    lines = lines[:-2]
    if len(lines) - 1 > limits.max_headers:
        raise BadRequest("too many header lines")
    method, path, version = _request_line(lines[0])
    headers = dict(_header(line) for line in lines[1:])
    if version == b"HTTP/1.1" and "host" not in headers:
        raise BadRequest("HTTP/1.1 request without Host")
    return Request(method, path, headers)


def _request_line(line: bytes) -> tuple[str, str, bytes]:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise BadRequest("request line must be METHOD SP TARGET SP VERSION")
    method, target, version = parts
    if not _TOKEN.match(method):
        raise BadRequest("malformed method")
    if not _TARGET.match(target):
        raise BadRequest("target must be an absolute path")
    if version not in _VERSIONS:
        raise BadRequest("unsupported HTTP version")
    path = target.split(b"?", 1)[0]
    return method.decode("ascii"), path.decode("ascii"), version


def _header(line: bytes) -> tuple[str, str]:
    name, sep, value = line.partition(b":")
    if not sep or not _TOKEN.match(name):
        raise BadRequest("malformed header line")  # also obs-fold continuation lines
    try:
        text = value.strip(b" \t").decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest("undecodable header") from None
    if any(ord(ch) < 0x20 and ch != "\t" for ch in text):
        raise BadRequest("control character in header")
    return name.decode("ascii").lower(), text


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
    reason = _REASONS.get(response.status, "")
    lines = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Cache-Control: no-store",
        "Connection: close",
        *(f"{name}: {value}" for name, value in response.headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


class HttpEndpoint:
    """Serves ``registry`` and the health checks on one TCP address."""

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Callable[[], Readiness],
        limits: HttpLimits = HttpLimits(),
    ) -> None:
        self._registry = registry
        self._readiness = readiness
        self._limits = limits
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen; returns the bound (host, port), useful with port 0. Raises OSError."""
        self._server = await asyncio.start_server(
            self._accept, host, port, limit=self._limits.max_head_bytes
        )
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        """Stop listening and close every open connection."""
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.transport.abort()  # its handler sees the connection end and returns
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self._limits.max_connections:
            writer.transport.abort()
            return
        self._connections[task] = writer
        try:
            await self._serve(reader, writer)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the peer went away or was too slow: nothing to answer
        finally:
            self._connections.pop(task, None)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self._limits.head_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
            request = parse_head(head, self._limits)
        except asyncio.LimitOverrunError:
            await self._send(writer, Response(400, b"request head too large\n"))
            return
        except BadRequest as error:
            await self._send(writer, Response(400, f"{error}\n".encode()))
            return
        try:
            response = respond(request, self._registry, self._readiness)
        except Exception:
            log.exception("answering %s %s failed", request.method, request.path)
            response = Response(500, b"internal error\n")
        await self._send(writer, response, head_only=request.method == "HEAD")

    async def _send(
        self, writer: asyncio.StreamWriter, response: Response, *, head_only: bool = False
    ) -> None:
        writer.write(encode(response, head_only=head_only))
        async with asyncio.timeout(self._limits.write_timeout_s):
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        writer.close()
        with contextlib.suppress(ConnectionError):
            async with asyncio.timeout(self._limits.write_timeout_s):
                await writer.wait_closed()
