"""A loopback TCP proxy a test controls, to cut and restore a link between two processes.

States: ``FORWARDING`` (bytes flow both ways), ``CUT`` (every connection is reset and new ones
are reset as soon as they are accepted: a link that breaks loudly), ``BLACKHOLE`` (connections
stay open but bytes are dropped and new ones are never connected through: a silent partition
that only timeouts can detect). A connection that saw the blackhole never forwards again, since
its byte stream has a hole in it.

Invariant: `close` leaves no task, transport or server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from enum import StrEnum

CHUNK_BYTES = 1 << 16


class ProxyState(StrEnum):
    FORWARDING = "forwarding"
    CUT = "cut"
    BLACKHOLE = "blackhole"


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Pair:
    """One client connection and, once connected through, its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    blackholed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()


class TcpProxy:
    """Forwards connections on ``127.0.0.1:<port>`` to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.state = ProxyState.FORWARDING
        self.accepted = 0  # connections accepted, whatever happened to them

    async def start(self) -> str:
        """Listen on a free loopback port; returns ``tcp:127.0.0.1:PORT``."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"tcp:127.0.0.1:{port}"

    def cut(self) -> None:
        """Reset every connection now, and each new one as it comes."""
        self.state = ProxyState.CUT
        for pair in list(self._pairs):
            pair.abort()

    def blackhole(self) -> None:
        """Drop every byte from now on; keep connections open."""
        self.state = ProxyState.BLACKHOLE
        for pair in self._pairs:
            pair.blackholed = True

    def restore(self) -> None:
        """Forward new connections again."""
        self.state = ProxyState.FORWARDING

    async def close(self) -> None:
        """Stop listening, reset every connection and wait for every task."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pair in list(self._pairs):
            pair.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        pair = _Pair(writer, blackholed=self.state is ProxyState.BLACKHOLE)
        self._pairs.add(pair)
        try:
            await self._serve(pair, reader)
        finally:
            pair.abort()
            self._pairs.discard(pair)
            self._handlers.discard(task)

    async def _serve(self, pair: _Pair, reader: asyncio.StreamReader) -> None:
        if self.state is ProxyState.CUT:
            return
        if pair.blackholed:
            await _swallow(reader)
            return
        try:
            upstream_reader, pair.upstream = await asyncio.open_connection(*self._target)
        except OSError:
            return
        await asyncio.gather(
            self._pump(pair, reader, pair.upstream), self._pump(pair, upstream_reader, pair.client)
        )

    async def _pump(
        self, pair: _Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy ``reader`` to ``writer`` until either end closes; then close both."""
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(CHUNK_BYTES):
                if pair.blackholed:
                    continue
                writer.write(chunk)
                await writer.drain()
        pair.abort()


async def _swallow(reader: asyncio.StreamReader) -> None:
    """Read and drop everything until the peer closes."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(CHUNK_BYTES):
            pass
