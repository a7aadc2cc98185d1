"""Where a `Connection` comes from: `open_connection` dials an address, `start_server` serves
one and runs a handler per accepted connection. The socket adapter itself is
`clockwork_async.connection`; this module only binds it to asyncio's transports.

Invariants:
- Every connection is made by one factory from the caller's limits, so a dialled and an
  accepted connection keep the same memory bounds (`Connection`'s header).
- An accepted connection is closed when its handler returns, whatever it raised: a
  ProtocolError first sends the peer an Error message, ConnectionClosed ends quietly, anything
  else is logged. Each handler's task is referenced until it is done (the loop keeps only weak
  references to tasks).
- A TLS listener gives a peer `TLS_HANDSHAKE_TIMEOUT_S` to finish its handshake, not asyncio's
  default 60 s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from typing import cast

from clockwork_async.connection import (
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_MESSAGES,
    Connection,
    ConnectionClosed,
    ConnectionState,
)
from clockwork_async.wire.addresses import UnixAddress, parse_address
from clockwork_async.wire.codec import DEFAULT_LIMITS, Limits, ProtocolError
from clockwork_async.wire.messages import Error

logger = logging.getLogger(__name__)

TLS_HANDSHAKE_TIMEOUT_S = 10.0  # a silent TLS peer must not hold a slot for 60 s

ConnectionFactory = Callable[[], Connection]
Handler = Callable[[Connection], Awaitable[None]]


def _factory(
    limits: Limits,
    expect_hello: bool,
    max_queued_messages: int,
    max_queued_bytes: int,
    write_high_water_bytes: int | None = None,
    allow_half_close: bool = False,
    read_turn_ns: int = 0,
) -> ConnectionFactory:
    return functools.partial(
        Connection,
        limits,
        expect_hello=expect_hello,
        max_queued_messages=max_queued_messages,
        max_queued_bytes=max_queued_bytes,
        write_high_water_bytes=write_high_water_bytes,
        allow_half_close=allow_half_close,
        read_turn_ns=read_turn_ns,
    )


async def open_connection(
    address: str,
    limits: Limits = DEFAULT_LIMITS,
    *,
    expect_hello: bool = False,
    max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    ssl: ssl_module.SSLContext | None = None,
    server_hostname: str | None = None,
) -> Connection:
    """Connect to ``address`` (see `parse_address`), over TLS with ``ssl``: the certificate is
    checked against ``server_hostname`` (default: the TCP host; a Unix socket needs it).
    Raises ValueError for a bad address (or a ``server_hostname`` without ``ssl``), OSError
    when nothing listens there or the TLS handshake fails (ssl.SSLError is an OSError)."""
    parsed = parse_address(address)
    connection = _factory(limits, expect_hello, max_queued_messages, max_queued_bytes)()
    loop = asyncio.get_running_loop()
    if isinstance(parsed, UnixAddress):
        await loop.create_unix_connection(
            lambda: _WireProtocol(connection),
            parsed.path,
            ssl=ssl,
            server_hostname=server_hostname,
        )
    else:
        await loop.create_connection(
            lambda: _WireProtocol(connection),
            parsed.host,
            parsed.port,
            ssl=ssl,
            server_hostname=server_hostname,
        )
    return connection


async def start_server(
    handler: Handler,
    address: str,
    limits: Limits = DEFAULT_LIMITS,
    *,
    expect_hello: bool = False,
    max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    write_high_water_bytes: int | None = None,
    allow_half_close: bool = False,
    ssl: ssl_module.SSLContext | None = None,
    start_serving: bool = True,
    read_turn_ns: int = 0,
) -> asyncio.Server:
    """Serve ``address`` (over TLS with ``ssl``; with ``start_serving`` false, bound but not
    accepting until ``Server.start_serving``): each accepted connection runs
    ``handler(connection)`` in its own task and is closed when the handler returns (with
    ``allow_half_close``, a handler may still send after its peer ended writing). A handler
    that raises ProtocolError has an Error message sent to its peer first; ConnectionClosed
    ends it quietly; anything else is logged. Raises ValueError for a bad address, OSError if
    it cannot listen there."""
    parsed = parse_address(address)
    new_connection = _factory(
        limits,
        expect_hello,
        max_queued_messages,
        max_queued_bytes,
        write_high_water_bytes,
        allow_half_close,
        read_turn_ns,
    )
    tasks: set[asyncio.Task[None]] = set()

    def protocol() -> _WireProtocol:
        connection = new_connection()
        return _WireProtocol(connection, lambda: _spawn(tasks, handler, connection))

    loop = asyncio.get_running_loop()
    # A silent TLS peer must not hold a connection slot for asyncio's default 60 s.
    handshake_s = TLS_HANDSHAKE_TIMEOUT_S if ssl is not None else None
    if isinstance(parsed, UnixAddress):
        return await loop.create_unix_server(
            protocol,
            parsed.path,
            ssl=ssl,
            ssl_handshake_timeout=handshake_s,
            start_serving=start_serving,
        )
    return await loop.create_server(
        protocol,
        parsed.host,
        parsed.port,
        ssl=ssl,
        ssl_handshake_timeout=handshake_s,
        start_serving=start_serving,
    )


def _spawn(tasks: set[asyncio.Task[None]], handler: Handler, connection: Connection) -> None:
    task = asyncio.get_running_loop().create_task(_serve_one(handler, connection))
    tasks.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(tasks.discard)


async def _serve_one(handler: Handler, connection: Connection) -> None:
    try:
        await handler(connection)
    except ConnectionClosed:
        pass
    except ProtocolError as e:
        if connection.state is ConnectionState.OPEN:
            connection.send(Error(code=e.code.value, message=e.message))
    except Exception:
        logger.exception("connection handler failed (peer %r)", connection.peername)
    finally:
        connection.close()


class _WireProtocol(asyncio.BufferedProtocol):
    """Forwards transport callbacks to its Connection; the decoder lends the read buffers."""

    def __init__(self, connection: Connection, on_made: Callable[[], None] | None = None) -> None:
        self._connection = connection
        self._on_made = on_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connection._on_connection_made(cast(asyncio.Transport, transport))
        if self._on_made is not None:
            self._on_made()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._connection._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._connection._on_bytes(nbytes)

    def eof_received(self) -> bool | None:
        # True keeps the transport open for writing (a half-close the connection allows).
        return self._connection._on_eof() or None

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection._on_connection_lost(exc)

    def pause_writing(self) -> None:
        self._connection._writable.clear()

    def resume_writing(self) -> None:
        self._connection._on_writable()
