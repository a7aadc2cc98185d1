"""The client API server: wire connections in, `Service` calls, replies out.

One idea: the listener and what all its connections share (limits, counts, the upload budget,
routes, the drain); each connection's own requests are `api.session`'s.

Each connection starts with a ``hello`` (version checked by the decoder, then the token mapped
to scopes, `api.auth`); then it carries pipelined requests with client-chosen ids, answered in
whatever order they finish. See docs/protocol.md, "Client API".

Invariants:
- An accepted InferRequest is in its session's ``pending`` from ``submit`` until its one
  ``on_reply``; the server's ``outstanding`` counts exactly those, across sessions, including
  sessions whose connection is gone and whose replies have not come back yet.
- A disconnect calls ``Service.cancel`` once for each of its pending requests; their outcomes
  still reach the service's bookkeeping (the replies are dropped, not the outcomes). End of
  input on a plain socket is not a disconnect (it may be a half-close): the session answers
  what it has in flight, then closes; a peer that closed both ways shows itself when a reply
  is written (a reset), and what is left is cancelled then.
- Uploads (``add_model``) in flight over all connections are capped in count and in bytes
  (``max_uploads_in_flight``, ``max_upload_bytes_in_flight``); over a cap, ``overloaded``.
- Memory per connection is bounded: at most ``max_outstanding_per_connection`` requests in
  flight, and no request is read while the transport asks writers to pause (a slow reader),
  so queued replies never grow past that many.
- Every reply carries a status (an Outcome or `ApiCode` value) and a sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import cast

from clockwork_async.api.auth import Scope, TokenAuth
from clockwork_async.api.service import Admin, ModelRoute, Requests
from clockwork_async.api.session import ApiSession
from clockwork_async.config.keys import ranged
from clockwork_async.connection import (
    DEFAULT_MAX_QUEUED_MESSAGES,
    Connection,
    ConnectionClosed,
    ConnectionState,
)
from clockwork_async.endpoints import start_server
from clockwork_async.ioarena.shared import IoArena
from clockwork_async.wire.addresses import TcpAddress, UnixAddress, parse_address
from clockwork_async.wire.codec import DEFAULT_LIMITS, Limits, ProtocolError
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ApiCode,
    Error,
    ErrorCode,
    Hello,
    Role,
)

log = logging.getLogger(__name__)
# How long one loop iteration may hand one client's messages over (`read_turn.ReadTurn`): then
# the core's wake-ups, the executors' results and the other clients come first. 2 ms is a
# dozen or two requests' work; one client kept the loop 0.8 s at a time without it.
READ_TURN_NS = 2_000_000

__all__ = ["ApiServer", "ServerLimits", "ServerState"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Bounds of the client API (docs/protocol.md, "Client API limits"): keys of the daemon's
    ``[server]`` section as they are (`config_keys`; the ranges are what a user may set)."""

    max_connections: int = ranged(4096, 1, 1_000_000)
    max_outstanding_per_connection: int = ranged(1024, 1, 1_000_000)  # in flight, one connection
    max_outstanding_total: int = ranged(65536, 1, 10_000_000)  # accepted, unanswered: all of them
    max_frame_bytes: int = ranged(DEFAULT_LIMITS.max_tail_bytes, 64 * 1024, 2 * GiB)  # a tail
    hello_timeout_s: float = ranged(10.0, 0.1, 3600.0)  # connect to hello, else closed
    drain_timeout_s: float = ranged(10.0, 0.0, 3600.0)  # close(): in-flight requests' time
    flush_timeout_s: float = ranged(2.0, 0.0, 3600.0)  # close(): replies' time to slow readers
    max_queued_messages: int = ranged(DEFAULT_MAX_QUEUED_MESSAGES, 1, 1_000_000)  # not handled
    max_write_buffer_bytes: int = ranged(MiB, 4096, GiB)  # replies unsent: stop reading requests
    max_uploads_in_flight: int = ranged(4, 1, 1024)  # add_model calls unanswered, all connections
    max_upload_bytes_in_flight: int = ranged(256 * MiB, 64 * 1024, 64 * GiB)  # their model bytes
    io_arena_bytes: int = ranged(256 * MiB, 0, 64 * GiB)  # shared tensor memory; 0: none
    io_arena_connection_share: float = ranged(0.5, 0.01, 1.0)  # of it, one connection at most
    io_arena_min_bytes: int = ranged(16 * 1024, 0, 64 * GiB)  # fewer tensor bytes: byte path

    def __post_init__(self) -> None:
        counts = ("max_connections", "max_outstanding_per_connection", "max_queued_messages")
        uploads = ("max_uploads_in_flight", "max_upload_bytes_in_flight")
        # ValueError, not the config's ConfigError (core/config.py): the API imports nothing of
        # the core but its outcomes. The loader's ranges are narrower, so these never name a key.
        for name in (*counts, *uploads, "max_write_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be >= 1")
        if self.max_outstanding_total < 1 or not 1 <= self.max_frame_bytes < 1 << 32:
            raise ValueError("ServerLimits: max_outstanding_total >= 1, max_frame_bytes < 4 GiB")
        if min(self.hello_timeout_s, self.drain_timeout_s, self.flush_timeout_s) < 0:
            raise ValueError("ServerLimits timeouts must be >= 0")

    def wire_limits(self) -> Limits:
        """The codec limits of a client connection: the default ones, with the frame tail
        (all tensors of one message, or one uploaded model) at ``max_frame_bytes``."""
        return Limits(max_tail_bytes=self.max_frame_bytes)


class ServerState(Enum):
    NEW = "new"
    STARTING = "starting"  # binding the listener
    BOUND = "bound"  # the address is ours, not listening: connections are refused until SERVING
    SERVING = "serving"
    CLOSING = "closing"  # not accepting; in-flight requests finishing; new ones shutting_down
    CLOSED = "closed"  # closed, or the listener could not be bound


_TRANSITIONS = {
    ServerState.NEW: (ServerState.STARTING, ServerState.CLOSED),
    ServerState.STARTING: (ServerState.BOUND, ServerState.CLOSED),
    ServerState.BOUND: (ServerState.SERVING, ServerState.CLOSED),
    ServerState.SERVING: (ServerState.CLOSING,),
    ServerState.CLOSING: (ServerState.CLOSED,),
    ServerState.CLOSED: (),
}


class ApiServer:
    """Serves the client API on one address: requests go to ``requests``, model changes,
    stats and health to ``service`` (one object may be both: `api.service.Service`)."""

    def __init__(
        self,
        service: Admin,
        *,
        requests: Requests | None = None,
        limits: ServerLimits | None = None,
        auth: TokenAuth | None = None,
        name: str = "clockwork-async",
        now_ns: Callable[[], int] = time.monotonic_ns,
        unix_now_ns: Callable[[], int] = time.time_ns,
        routes: Mapping[str, ModelRoute] | None = None,
    ) -> None:
        self.service = service
        self.requests: Requests = requests if requests is not None else cast(Requests, service)
        self.limits = limits or ServerLimits()
        self.auth = auth or TokenAuth()
        self.name = name
        self.now_ns = now_ns
        self.unix_now_ns = unix_now_ns  # to bound a request's deadline_unix_ns
        # Model name -> the name its current version is served under (the daemon's service
        # keeps it); a name not in it is submitted as it is.
        self.routes: Mapping[str, ModelRoute] = routes if routes is not None else {}
        self.io_arena: IoArena | None = None  # where requests' tensors are read (the daemon's)
        self._wire_limits = self.limits.wire_limits()
        self._state = ServerState.NEW
        self._listener: asyncio.Server | None = None
        self._address = ""
        self._handlers: dict[Connection, asyncio.Task[None]] = {}
        self._sessions: set[ApiSession] = set()
        self._admin_tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()  # set while nothing is outstanding
        self._idle.set()
        self._closed = asyncio.Event()
        self._start_done = asyncio.Event()
        self.outstanding = 0
        self.uploads_in_flight = 0  # add_model calls accepted and not answered, all sessions
        self.upload_bytes_in_flight = 0  # their model bytes
        self.refused: dict[str, int] = {}  # connections refused, by error code
        # Every infer answered, by front end (msgpack, http, grpc) and status: the metrics'.
        self.on_answer: Callable[[str, str], None] | None = None

    # --- public state ---------------------------------------------------------------------

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def accepting_requests(self) -> bool:
        return self._state is ServerState.SERVING

    @property
    def address(self) -> str:
        """The bound address (``HOST:PORT`` or ``unix:PATH``); empty before `start`."""
        return self._address

    @property
    def connection_count(self) -> int:
        return len(self._handlers)

    def snapshot(self) -> dict[str, object]:
        """JSON-able counters of the API layer."""
        return {
            "state": self._state.value,
            "connections": len(self._handlers),
            "sessions": len(self._sessions),
            "outstanding": self.outstanding,
            "slow_readers": sum(s.writing_paused for s in self._sessions),
            "reading_paused": sum(c.reading_paused for c in self._handlers),
            "uploads_in_flight": self.uploads_in_flight,
            "upload_bytes_in_flight": self.upload_bytes_in_flight,
            "refused_connections": dict(self.refused),
        }

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, address: str, *, ssl: ssl_module.SSLContext | None = None) -> None:
        """`bind` then `serve`."""
        await self.bind(address, ssl=ssl)
        await self.serve()

    async def bind(self, address: str, *, ssl: ssl_module.SSLContext | None = None) -> None:
        """Take ``address`` (``HOST:PORT``, ``tcp:HOST:PORT``, ``unix:PATH``; port 0 picks
        one, see `address`) without accepting connections yet: a daemon takes its ports before
        it starts anything slow. Raises ValueError for a bad address, OSError if busy; the
        server is then CLOSED (`close` returns at once). Raises RuntimeError unless NEW."""
        self._enter(ServerState.STARTING)
        try:
            self._listener = await self._listen(address, ssl)
        except BaseException:
            self._enter(ServerState.CLOSED)
            self._closed.set()
            raise
        else:
            self._enter(ServerState.BOUND)
        finally:
            self._start_done.set()

    async def serve(self) -> None:
        """Accept connections on the bound address. Raises RuntimeError unless BOUND."""
        self._enter(ServerState.SERVING)
        assert self._listener is not None
        await self._listener.start_serving()

    async def _listen(self, address: str, ssl: ssl_module.SSLContext | None) -> asyncio.Server:
        parsed = parse_address(address)
        listener = await start_server(
            self._serve,
            address,
            self._wire_limits,
            expect_hello=True,
            max_queued_messages=self.limits.max_queued_messages,
            max_queued_bytes=self.limits.max_frame_bytes,
            write_high_water_bytes=self.limits.max_write_buffer_bytes,
            allow_half_close=True,  # a client that ends its writing still gets its replies
            ssl=ssl,
            start_serving=False,
            read_turn_ns=READ_TURN_NS,
        )
        if isinstance(parsed, UnixAddress):
            self._address = str(parsed)
        else:
            host, port = listener.sockets[0].getsockname()[:2]
            self._address = str(TcpAddress(host, port))
        return listener

    async def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting; let in-flight requests finish for up to ``timeout_s`` (default
        ``drain_timeout_s``) while new ones are answered ``shutting_down``; then close every
        connection, flushing replies for up to ``flush_timeout_s``."""
        if self._state is ServerState.STARTING:
            await self._start_done.wait()  # then close what it started, or nothing
        if self._state in (ServerState.CLOSING, ServerState.CLOSED):
            await self._closed.wait()
            return
        if self._state is ServerState.NEW:
            self._enter(ServerState.CLOSED)
            self._closed.set()
            return
        if self._state is ServerState.BOUND:  # never served: nothing to drain
            assert self._listener is not None
            self._listener.close()
            await self._listener.wait_closed()
            self._enter(ServerState.CLOSED)
            self._closed.set()
            return
        self._enter(ServerState.CLOSING)
        assert self._listener is not None
        self._listener.close()
        drain_s = self.limits.drain_timeout_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wait_idle(), drain_s)
        await self._close_connections()
        await self._listener.wait_closed()
        self._enter(ServerState.CLOSED)
        self._closed.set()

    async def _wait_idle(self) -> None:
        while self.outstanding or self._admin_tasks:
            self._idle.clear()
            await self._idle.wait()

    async def _close_connections(self) -> None:
        """Close every connection (its handler then cancels what it left in flight); give
        slow readers ``flush_timeout_s`` to take their replies, then abort."""
        connections = list(self._handlers)
        for connection in connections:
            connection.close()
        loop = asyncio.get_running_loop()
        waits = [loop.create_task(c.wait_closed()) for c in connections]
        waits += self._handlers.values()
        if waits:
            await asyncio.wait(waits, timeout=self.limits.flush_timeout_s)
        for connection in connections:
            connection.abort()
        for task in list(self._admin_tasks):
            task.cancel()
        leftovers = [*waits, *self._handlers.values(), *self._admin_tasks]
        if leftovers:
            await asyncio.wait(leftovers)

    def _enter(self, state: ServerState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"server cannot go from {self._state.name} to {state.name}")
        self._state = state

    # --- bookkeeping the sessions call ------------------------------------------------------

    def request_started(self) -> None:
        self.outstanding += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self.outstanding -= 1
        self._maybe_idle()

    def count_answer(self, protocol: str, status: str) -> None:
        """One infer answered through front end ``protocol`` with ``status``."""
        if self.on_answer is not None:
            self.on_answer(protocol, status)

    def admit_upload(self, nbytes: int) -> tuple[str, str] | None:
        """(``overloaded``, why) when an upload of ``nbytes`` would go over the server's caps
        on uploads in flight; otherwise None, and the upload is counted until `upload_ended`."""
        limits = self.limits
        if self.uploads_in_flight >= limits.max_uploads_in_flight:
            count = limits.max_uploads_in_flight
            return ApiCode.OVERLOADED, f"{count} model uploads are in flight (limit); retry later"
        if self.upload_bytes_in_flight + nbytes > limits.max_upload_bytes_in_flight:
            cap = limits.max_upload_bytes_in_flight
            held = self.upload_bytes_in_flight
            why = f"uploads in flight hold {held} bytes; {nbytes} more would pass the {cap} limit"
            return ApiCode.OVERLOADED, why + "; retry later"
        self.uploads_in_flight += 1
        self.upload_bytes_in_flight += nbytes
        return None

    def upload_ended(self, nbytes: int) -> None:
        self.uploads_in_flight -= 1
        self.upload_bytes_in_flight -= nbytes

    def track_admin(self, task: asyncio.Task[None]) -> None:
        self._admin_tasks.add(task)
        self._idle.clear()
        task.add_done_callback(self._admin_done)

    def _admin_done(self, task: asyncio.Task[None]) -> None:
        self._admin_tasks.discard(task)
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.outstanding and not self._admin_tasks:
            self._idle.set()

    # --- connections ------------------------------------------------------------------------

    async def _serve(self, connection: Connection) -> None:
        """One client connection, from hello to close (run by `start_server` in its task)."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers[connection] = task
        try:
            await self._handle(connection)
        except ConnectionClosed:
            pass
        except ProtocolError as error:
            log.info("client %s: %s", connection.peername, error)
            self._refuse(connection, error.code.value, error.message)
        except Exception:
            log.exception("client connection handler failed (peer %r)", connection.peername)
        finally:
            connection.close()
            self._handlers.pop(connection, None)

    async def _handle(self, connection: Connection) -> None:
        if len(self._handlers) > self.limits.max_connections:
            limit = self.limits.max_connections
            self._refuse(connection, ApiCode.OVERLOADED, f"too many connections (limit {limit})")
            return
        scopes = await self._handshake(connection)
        if scopes is None:
            return
        session = ApiSession(self, connection, scopes)
        self._sessions.add(session)
        try:
            await session.run()
        except ConnectionClosed:
            if not connection.peer_done_writing:
                raise
            await session.settle()  # half-closed: answer what it sent, then close
        finally:
            self._sessions.discard(session)
            session.disconnected()

    async def _handshake(self, connection: Connection) -> frozenset[Scope] | None:
        """Receive the client's hello and answer it; returns the scopes, or None after
        refusing the connection. Raises ProtocolError, ConnectionClosed."""
        try:
            hello = await asyncio.wait_for(connection.recv(), self.limits.hello_timeout_s)
        except TimeoutError:
            self._refuse(connection, ErrorCode.PROTOCOL_ERROR, "no hello in time")
            return None
        if not isinstance(hello, Hello) or hello.role != Role.CLIENT:
            what = f"a {hello.role!r} hello" if isinstance(hello, Hello) else "that"
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"expected a client hello, got {what}")
        scopes = self.auth.scopes(hello.token)
        if scopes is None:
            log.warning("client %s (%r): wrong or missing token", connection.peername, hello.name)
            self._refuse(connection, ErrorCode.UNAUTHORIZED, "wrong or missing token")
            return None
        if not self.accepting_requests:
            self._refuse(connection, ApiCode.SHUTTING_DOWN, "the server is shutting down")
            return None
        connection.send(Hello(PROTOCOL_VERSION, Role.CONTROLLER.value, self.name))
        return scopes

    def _refuse(self, connection: Connection, code: str, message: str) -> None:
        """Send an Error (the connection closes right after, in `_serve`)."""
        self.refused[str(code)] = self.refused.get(str(code), 0) + 1
        if connection.state is ConnectionState.OPEN:
            connection.send(Error(code=str(code), message=message))
