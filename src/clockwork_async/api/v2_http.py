"""The Open Inference Protocol (KServe v2) over HTTP/1.1, on the daemon's event loop.

Requests are parsed by httptools (llhttp, the parser uvicorn uses: about 3 µs a request here
against about 90 µs for h11, docs/protocol-v2.md); `api.v2_routes` answers them (health and
metadata at once, infers through the shared door, `api.v2_door.Door`); this module moves the
bytes, keeps the connections and their timers.

Invariants: a connection serves one request at a time, in order (pipelined ones wait, and the
socket is not read while one waits or the client does not read its replies; it is read while
a request is answered, so a client that goes away cancels it at once); a request's answer is
stamped when it starts (``HttpRequest.turn_ns``: what it waits from then is the loop's
measured delay for it, judged at the door before a JSON body is parsed); a
request's head and body must arrive within ``request_timeout_s`` of its first byte (else 408
and close) and a kept-alive connection with no request is closed after ``idle_timeout_s``; a
body over ``max_body_bytes`` is refused 413, from its Content-Length before it is read where
there is one, and the connection closed; a request that cannot be read on (malformed, too large,
too slow) is answered after every request read before it, then the connection closes and
nothing more is read; every answer is JSON, an error one being
``{"error": "code: sentence"}`` with the status of `v2_door.HTTP_STATUS`; a connection that
goes away cancels its request in flight; at most ``max_connections`` are open; a body with
binary tensors read into an IO arena slot (`api.v2_arena.BodyInSlot`) goes back exactly once:
taken over by the door, else released when its request is answered, refused or dropped with
its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import time
from collections import deque
from functools import partial
from typing import cast

import httptools

from clockwork_async.api.http_shared import ConnectionTimer, encode_head
from clockwork_async.api.v2_arena import BodyInSlot
from clockwork_async.api.v2_config import HttpConfig
from clockwork_async.api.v2_door import Door
from clockwork_async.api.v2_routes import (
    HEADER_LENGTH,
    HttpRequest,
    HttpResponse,
    error_response,
    route,
)
from clockwork_async.api.v2_status import BAD_REQUEST, REQUEST_TIMEOUT, TOO_LARGE, V2Error
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.addresses import TcpAddress

log = logging.getLogger("clockwork_async.api.v2")

MAX_HEADERS = 100
MAX_HEAD_BYTES = 64 * 1024
JSON = b"application/json"
OCTETS = b"application/octet-stream"


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing (the answer is already written)."""


class HttpFrontEnd:
    """Serves the protocol on one address through ``door``; `bind`, `serve`, `close`."""

    def __init__(
        self, door: Door, config: HttpConfig, *, ssl: ssl_module.SSLContext | None = None
    ) -> None:
        self.door = door
        self.config = config
        self._ssl = ssl
        self._listener: asyncio.AbstractServer | None = None
        self._connections: set[_HttpConnection] = set()
        self._idle = asyncio.Event()  # no infer in flight
        self._idle.set()
        self.in_flight = 0
        self.closing = False
        self.address = ""

    async def bind(self, listen: TcpAddress) -> str:
        """Take ``listen`` without serving yet; returns ``HOST:PORT``. Raises OSError."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: _HttpConnection(self),
            listen.host,
            listen.port,
            ssl=self._ssl,
            start_serving=False,
        )
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.address = str(TcpAddress(host, port))
        return self.address

    async def serve(self) -> None:
        assert self._listener is not None
        await self._listener.start_serving()

    async def close(self, timeout_s: float) -> None:
        """Stop accepting; close idle connections; give requests in flight ``timeout_s`` to be
        answered (new ones on open connections are answered 503), then close the rest."""
        self.closing = True
        if self._listener is not None:
            self._listener.close()
        for connection in list(self._connections):
            connection.close_if_idle()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        for connection in list(self._connections):
            connection.abort()
        if self._listener is not None:
            await self._listener.wait_closed()

    def started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def ended(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    def added(self, connection: _HttpConnection) -> bool:
        if len(self._connections) >= self.config.max_connections:
            return False
        self._connections.add(connection)
        return True

    def removed(self, connection: _HttpConnection) -> None:
        self._connections.discard(connection)


class _HttpConnection(asyncio.Protocol):
    """One client connection: the parser's callbacks, the request queue, the timers."""

    def __init__(self, front: HttpFrontEnd) -> None:
        self._front = front
        self._door = front.door
        self._config = front.config
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._request: HttpRequest | None = None  # being read
        self._queue: deque[HttpRequest] = deque()  # read, not answered
        self._task: asyncio.Task[HttpResponse] | None = None  # the infer being answered
        self._timer = ConnectionTimer(self._timed_out)
        self._writing_paused = False
        self._failure: V2Error | None = None  # the unreadable request's answer, sent last
        self._closed = False

    # --- transport events ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if not self._front.added(self):
            self._transport.abort()
            self._closed = True
            return
        self._arm(self._config.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._timer.stop()
        self._front.removed(self)
        for request in [*self._queue, *([self._request] if self._request else [])]:
            request.release()  # read (or half read) into the arena, never answered
        if self._task is not None:
            self._task.cancel()  # the door cancels the request

    def data_received(self, data: bytes) -> None:
        if self._closed or self._failure is not None:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # _Stop: answered and closing
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as error:
            self._fail(V2Error(BAD_REQUEST, f"malformed HTTP request: {error}"))

    def eof_received(self) -> bool | None:
        return None  # close once the last answer is written (asyncio closes the transport)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._next()

    # --- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._request = HttpRequest(owner=self)
        self._arm(self._config.request_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._head(len(url)).url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._head(len(name) + len(value))
        if len(request.headers) >= MAX_HEADERS:
            self._stop(V2Error(BAD_REQUEST, f"more than {MAX_HEADERS} headers"))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        request.headers[key] = f"{request.headers[key]}, {text}" if key in request.headers else text

    def on_headers_complete(self) -> None:
        request = self._head(0)
        request.method = self._parser.get_method().decode("ascii", "replace")
        request.keep_alive = self._parser.should_keep_alive()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._config.max_body_bytes:
            limit = self._config.max_body_bytes
            self._stop(V2Error(TOO_LARGE, f"a body of {length} bytes is over {limit} bytes"))
        self._read_into_arena(request)
        if request.headers.get("expect", "").lower() == "100-continue" and self._transport:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _read_into_arena(self, request: HttpRequest) -> None:
        """An infer with binary tensors (an ``Inference-Header-Content-Length`` and a
        ``Content-Length``) has its body read straight into an IO arena slot, where the
        daemon has an arena with room (else as bytes: the door copies its rows into slots),
        and the body is not smaller than ``io_arena_min_bytes`` (then it stays bytes)."""
        arena = self._door.host.io_arena
        json_text = request.headers.get(HEADER_LENGTH, "")
        length = request.headers.get("content-length", "")
        if arena is None or request.method != "POST" or not json_text.isdigit():
            return
        if length.isdigit() and int(length) < self._door.host.limits.io_arena_min_bytes:
            return
        if length.isdigit() and int(json_text) < int(length) <= self._config.max_body_bytes:
            request.in_slot = BodyInSlot.lease(arena, self, int(length), int(json_text))

    def on_body(self, body: bytes) -> None:
        request = self._head(0)
        if request.in_slot is not None:
            if request.in_slot.write(body):
                return
            request.body += request.in_slot.view()  # more than announced: read on as bytes
            request.in_slot.release()
            request.in_slot = None
        request.body += body
        if len(request.body) > self._config.max_body_bytes:
            limit = self._config.max_body_bytes
            self._stop(V2Error(TOO_LARGE, f"the body is over {limit} bytes"))

    def on_message_complete(self) -> None:
        request = self._head(0)
        self._request = None
        self._queue.append(request)
        self._disarm()
        self._next()
        if self._queue and self._transport is not None:
            self._transport.pause_reading()  # pipelined: one request at a time

    def _head(self, more_bytes: int) -> HttpRequest:
        request = self._request
        if request is None:  # the parser calls back only inside a message
            raise _Stop
        request.head_bytes += more_bytes
        if request.head_bytes > MAX_HEAD_BYTES:
            self._stop(V2Error(BAD_REQUEST, f"a request head over {MAX_HEAD_BYTES} bytes"))
        return request

    # --- answering ----------------------------------------------------------------------------

    def _next(self) -> None:
        """Answer the next queued request, unless one is being answered or writes wait."""
        while self._queue and self._task is None and not self._writing_paused:
            if self._closed:
                return
            request = self._queue.popleft()
            if self._front.closing and request.method == "POST":
                request.release()
                error = V2Error(Outcome.SHUTTING_DOWN, "the server is shutting down")
                self._door.count(error.code)
                self._write(error_response(error), request, close=True)
                return
            request.turn_ns = time.monotonic_ns()  # what it waits from now is the loop's delay
            answer = route(self._door, request)
            if isinstance(answer, HttpResponse):
                request.release()
                self._write(answer, request)
            else:
                self._task = asyncio.get_running_loop().create_task(answer)
                self._task.add_done_callback(partial(self._answered, request=request))
                self._front.started()
        if self._closed or self._queue:
            return
        if self._failure is not None:
            if self._task is None:  # every request read before it is answered: it is last
                self._write(error_response(self._failure), HttpRequest(keep_alive=False), True)
            return
        if self._transport is not None:  # reading on while one is answered: a close is seen
            self._transport.resume_reading()
        if self._task is None and self._request is None:
            self._arm(self._config.idle_timeout_s)

    def _answered(self, task: asyncio.Task[HttpResponse], *, request: HttpRequest) -> None:
        self._task = None
        self._front.ended()
        request.release()  # unless the door took its slot
        if task.cancelled() or self._closed:
            return
        error = task.exception()
        if error is not None:
            log.error("HTTP infer failed", exc_info=error)
            response = error_response(V2Error("internal", f"the daemon failed: {error!r}"))
        else:
            response = task.result()
        self._write(response, request, close=self._front.closing)
        self._next()

    def _write(self, response: HttpResponse, request: HttpRequest, close: bool = False) -> None:
        transport = self._transport
        if transport is None or self._closed:
            return
        close = close or not request.keep_alive
        body = response.body
        headers = [
            ("content-type", (OCTETS if body.binary else JSON).decode()),
            ("content-length", str(body.nbytes)),
        ]
        if body.header_bytes is not None:
            headers.append((HEADER_LENGTH, str(body.header_bytes)))
        headers += response.headers
        if close:
            headers.append(("connection", "close"))
        transport.writelines([encode_head(response.status, headers), body.json, *body.binary])
        if close:
            self._close()

    def _fail(self, error: V2Error) -> None:
        """Refuse a request that cannot be read on (malformed, too large, too slow): nothing
        more is read, the requests read before it are answered first (pipelined ones are never
        dropped), then ``error`` is, and the connection closes."""
        if self._closed or self._failure is not None:
            return
        self._failure = error
        if self._request is not None:
            self._request.release()  # half read into the arena: never answered
            self._request = None
        self._disarm()
        if self._transport is not None:
            self._transport.pause_reading()
        self._next()

    def _stop(self, error: V2Error) -> None:
        """`_fail` from inside a parser callback, and stop the parser."""
        self._fail(error)
        raise _Stop

    def close_if_idle(self) -> None:
        if self._task is None and self._request is None and not self._queue:
            self._close()

    def abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()

    def _close(self) -> None:
        self._closed = True
        self._disarm()
        if self._transport is not None:
            self._transport.close()  # writes what is buffered first

    def _arm(self, timeout_s: float) -> None:
        self._timer.arm(timeout_s)

    def _disarm(self) -> None:
        self._timer.disarm()

    def _timed_out(self) -> None:
        if self._request is not None:  # a request started and not finished: a slow client
            self._fail(V2Error(REQUEST_TIMEOUT, "the request was not received in time"))
        elif self._task is None and not self._queue:
            self._close()  # idle
