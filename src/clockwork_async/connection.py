"""The asyncio adapter of the wire codec: one `Connection` per socket owns its transport, its
`Decoder`/`Encoder` and the events its readers and writers wait on. Policy (hello exchange,
what to do with a bad peer) belongs to the callers: executors, the daemon, the client.

One idea: a stream socket as a bounded, ordered stream of messages (`Connection`, fed by its
asyncio protocol); dialling an address and serving one are `clockwork_async.endpoints`.

Invariants:
- Memory per connection is bounded: reading pauses while the messages decoded and not yet
  taken by `recv` reach ``max_queued_messages`` or ``max_queued_bytes``, and resumes once
  they fall to half; beyond that only one frame in flight and one read chunk are held.
- `recv` returns messages in arrival order, then raises the one ending: `ProtocolError` for
  bad bytes (reading stops, nothing is sent), `ConnectionClosed` once the connection ended.
- `dispatch` is the push twin of `recv`: the same messages in the same order, handed to a
  callback from the transport's read callback as they are decoded (no task wake-up and no
  loop round per message), then the same ending raised. It hands nothing over while the
  callback's hold (an awaitable it returned) is pending or while the transport asks writers
  to pause (a peer that does not read gets no more answers); meanwhile messages queue within
  the same bounds as for `recv`. A connection is read by one of the two at a time.
- A connection made with ``allow_half_close`` stays writable after the peer ends its writing
  (plain sockets; TLS closes both ways): `recv` raises ConnectionClosed after the last
  message, `peer_done_writing` is true and `send` still works until `close`.
- No future is ever failed: waiters sleep on Events and re-check state when woken, so a
  cancelled waiter never leaves an unretrieved exception behind.
- Bytes go out in the order `send` was called. The first message of a loop iteration is
  written at once (a lone message waits for nothing); messages sent after it in the same
  iteration are held and written together, in one call, on the next iteration (or by
  `close`, or as soon as they reach the transport's high-water mark, so backpressure and
  memory bounds are as without holding): a burst costs two write syscalls, not one each.
- `when_written` callbacks run once each, after every byte sent before them has left this
  process (nothing held, the transport's buffer empty) or once the connection is gone: the
  transport may keep a reference to a sent buffer (an IO arena slot) until then.
- With ``read_turn_ns``, `dispatch` hands messages over for at most about that long in one
  loop iteration, then stops reading until the next (`read_turn.ReadTurn`).
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import logging
import socket
import sys
import termios
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, NoReturn

from clockwork_async.read_turn import ReadTurn
from clockwork_async.wire.codec import (
    DEFAULT_LIMITS,
    Decoder,
    Encoder,
    Lend,
    Limits,
    Screen,
    Screened,
)
from clockwork_async.wire.messages import Message

logger = logging.getLogger(__name__)

# `Connection.dispatch`'s callback: None to go on, or an awaitable to hold the rest until done.
DispatchHandler = Callable[[Message], Awaitable[None] | None]
ScreenedHandler = Callable[[Screened], None]  # `dispatch`: a frame the screen refused

DEFAULT_MAX_QUEUED_MESSAGES = 256
DEFAULT_MAX_QUEUED_BYTES = 64 << 20


class ConnectionClosed(Exception):
    """The connection ended: the peer closed it, it broke, or this side closed it."""


class ConnectionState(Enum):
    OPENING = "opening"  # created, no transport yet
    OPEN = "open"
    CLOSING = "closing"  # close() called; buffered bytes are being flushed
    CLOSED = "closed"  # the transport is gone


_TRANSITIONS: dict[ConnectionState, frozenset[ConnectionState]] = {
    ConnectionState.OPENING: frozenset({ConnectionState.OPEN, ConnectionState.CLOSED}),
    ConnectionState.OPEN: frozenset({ConnectionState.CLOSING, ConnectionState.CLOSED}),
    ConnectionState.CLOSING: frozenset({ConnectionState.CLOSED}),
    ConnectionState.CLOSED: frozenset(),
}


class Connection:
    """Messages over one stream socket. `send` never blocks (await `drain` to respect the
    peer's pace); `recv` waits for the next message.

    ``write_high_water_bytes`` bounds the transport's buffer of unsent bytes: above it the
    transport asks writers to pause (`drain` waits, `writing_paused` is true) until it is down
    to a quarter of that. None keeps the transport's default."""

    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        *,
        expect_hello: bool = False,
        max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        write_high_water_bytes: int | None = None,
        allow_half_close: bool = False,
        read_turn_ns: int = 0,
    ) -> None:
        if max_queued_messages < 1 or max_queued_bytes < 1:
            raise ValueError("max_queued_messages and max_queued_bytes must be positive")
        if write_high_water_bytes is not None and write_high_water_bytes < 1:
            raise ValueError("write_high_water_bytes must be positive")
        self._decoder = Decoder(limits, expect_hello=expect_hello)
        self._encoder = Encoder(limits)
        self._max_queued_messages = max_queued_messages
        self._max_queued_bytes = max_queued_bytes
        self._write_high_water_bytes = write_high_water_bytes
        self._allow_half_close = allow_half_close
        self._peer_done_writing = False
        self._state = ConnectionState.OPENING
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: list[bytes | memoryview] = []  # sent this iteration after its first write
        self._held_bytes = 0
        self._hold_limit_bytes = 0  # held beyond this: written at once (the transport's high)
        self._writing_burst = False  # a write went out this iteration; hold the next ones
        self._ended: ConnectionClosed | None = None  # why no more messages will arrive
        self._reading_paused = False
        self._readable = asyncio.Event()  # set when recv has something new to look at
        self._handler: DispatchHandler | None = None  # set while `dispatch` runs
        self._handler_error: BaseException | None = None
        self._hold: Awaitable[None] | None = None  # dispatch: what the handler asked to await
        self._on_screened: ScreenedHandler | None = None
        self._writable = asyncio.Event()  # clear while the transport asks writers to pause
        self._writable.set()
        self._closed = asyncio.Event()
        self._on_written: list[Callable[[], None]] = []  # `when_written`, in order
        self._written_check: asyncio.Handle | None = None
        self._written_delay_s = 0.0
        self._turn = ReadTurn(read_turn_ns, self._next_turn, self._unread) if read_turn_ns else None

    # Public state.

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def peername(self) -> Any:
        """The peer's address as the socket reports it ('' for an unnamed Unix socket)."""
        return None if self._transport is None else self._transport.get_extra_info("peername")

    @property
    def queued_messages(self) -> int:
        """Messages received and decoded that `recv` has not returned yet."""
        return self._decoder.buffered_messages

    @property
    def peer_done_writing(self) -> bool:
        """True once the peer ended its writing and this side may still send (half-close)."""
        return self._peer_done_writing and self._state is ConnectionState.OPEN

    def backlog_ns(self) -> int:
        """At least how long a frame decoded now waited unread (`ReadTurn.backlog_ns`)."""
        return 0 if self._turn is None else self._turn.backlog_ns()

    @property
    def reading_paused(self) -> bool:
        return self._reading_paused

    @property
    def writing_paused(self) -> bool:
        return not self._writable.is_set()

    # Sending.

    def send(self, message: Message) -> None:
        """Queue ``message`` for the socket without copying its tensors (do not mutate them
        until drained). Raises EncodeError for a bad message, ConnectionClosed if closed."""
        transport = self._open_transport()
        frame = self._encoder.encode(message)
        if self._writing_burst:
            self._held += frame
            self._held_bytes += sum(len(piece) for piece in frame)
            if self._held_bytes >= self._hold_limit_bytes:  # keep backpressure as it was
                self._write_held()
            return
        transport.writelines(frame)
        self._writing_burst = True
        assert self._loop is not None
        self._loop.call_soon(self._end_burst)

    def when_written(self, done: Callable[[], None]) -> None:
        """Call ``done`` once every byte sent so far has left this process, or the
        connection is gone (at once if it is): then memory those messages pointed into may
        be reused. Checked on the next loop round, then with backoff up to 50 ms."""
        if self._state is ConnectionState.CLOSED or self._transport is None:
            done()
            return
        self._on_written.append(done)
        if self._written_check is None:
            self._written_delay_s = 0.0
            assert self._loop is not None
            self._written_check = self._loop.call_soon(self._check_written)

    def _check_written(self) -> None:
        self._written_check = None
        transport = self._transport
        if not self._on_written or transport is None:
            return
        if self._state is not ConnectionState.CLOSED and (
            self._held or transport.get_write_buffer_size()
        ):
            if self._state is ConnectionState.OPEN:
                self._recheck_written()
            return  # closing: connection_lost runs them once the transport let go
        self._run_written()

    def _recheck_written(self) -> None:
        self._written_delay_s = min(max(2 * self._written_delay_s, 0.001), 0.05)
        assert self._loop is not None
        self._written_check = self._loop.call_later(self._written_delay_s, self._check_written)

    def _run_written(self) -> None:
        callbacks, self._on_written = self._on_written, []
        for done in callbacks:
            try:
                done()
            except Exception:
                logger.exception("a when_written callback raised")

    def flush(self) -> None:
        """Write now what this loop round held back (a long round must not delay it)."""
        if self._state is ConnectionState.OPEN:
            self._write_held()

    async def drain(self) -> None:
        """Return once the transport's write buffer is below its high-water mark; raises
        ConnectionClosed if the connection is closing or gone."""
        while True:
            self._open_transport()
            if self._writable.is_set():
                return
            await self._writable.wait()

    # Receiving.

    def set_screen(
        self, screen: Screen, on_screened: ScreenedHandler, lend: Lend | None = None
    ) -> None:
        """From now on, ``screen`` sees each frame's header before its tail (`codec.Screen`);
        a frame it refuses keeps none of its tensor bytes and goes to ``on_screened`` in its
        place (`dispatch` only); one it passes is read into what ``lend`` hands, if anything
        (`codec.Lend`)."""
        self._decoder.screen = screen
        self._decoder.lend = lend
        self._on_screened = on_screened

    async def recv(self) -> Message:
        """The next message. Raises ProtocolError when the peer sent bad bytes (after every
        good message before them), ConnectionClosed when the connection ended."""
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                self._maybe_resume_reading()
                message = frame[0]
                if isinstance(message, Screened):
                    raise RuntimeError("a screened frame reached recv(): screen with dispatch")
                return message
            if self._ended is not None:
                raise ConnectionClosed(str(self._ended))
            self._readable.clear()
            await self._readable.wait()

    async def dispatch(self, handler: DispatchHandler) -> None:
        """Call ``handler(message)`` for every message, in arrival order, as soon as its bytes
        are decoded (from the transport's read callback), until the connection ends; then
        raise as `recv` would: ProtocolError for bad bytes, ConnectionClosed at the end. A
        handler that returns an awaitable holds the rest: they queue (within the bounds, as
        for `recv`) until it is done.
        An exception from ``handler`` stops dispatching and is raised here. Raises
        RuntimeError if another `dispatch` is running."""
        if self._handler is not None:
            raise RuntimeError("this connection is already being dispatched")
        self._handler, self._handler_error = handler, None
        try:
            while True:
                self._dispatch_ready()
                if self._hold is not None:
                    await self._hold
                    self._hold = None
                    continue
                if self._handler_error is not None:
                    raise self._handler_error
                ending = self._ended is not None or self._decoder.error is not None
                if ending and not self._decoder.buffered_messages:
                    self._raise_ending()  # (messages left: writers are paused; they wait)
                self._readable.clear()
                await self._readable.wait()
        finally:
            self._handler = None
            if inspect.iscoroutine(self._hold):
                self._hold.close()  # cancelled while holding: never leave it unawaited
            self._hold = None

    def _raise_ending(self) -> NoReturn:
        """Every message was taken: raise ProtocolError (bad bytes) or ConnectionClosed."""
        frame = self._decoder.next_frame()  # raises the decoder's error, if any
        if frame is not None:
            raise RuntimeError("_raise_ending with a message still to take")
        raise ConnectionClosed(str(self._ended))

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    # Closing.

    def close(self) -> None:
        """Close after flushing what was sent; `recv` then raises ConnectionClosed."""
        self._end("closed by this side")
        if self._state is ConnectionState.OPEN and self._transport is not None:
            self._write_held()
            self._enter(ConnectionState.CLOSING)
            self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping unsent bytes."""
        self._end("aborted by this side")
        self._held, self._held_bytes = [], 0
        if self._transport is not None and self._state is not ConnectionState.CLOSED:
            self._transport.abort()

    async def wait_closed(self) -> None:
        """Return once the transport is gone."""
        await self._closed.wait()

    # Transport callbacks (through `endpoints._WireProtocol`).

    def _on_connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        _set_tcp_nodelay(transport)
        high = self._write_high_water_bytes
        if high is not None:
            transport.set_write_buffer_limits(high, high // 4)
        self._hold_limit_bytes = transport.get_write_buffer_limits()[1]
        self._enter(ConnectionState.OPEN)

    def _on_bytes(self, nbytes: int) -> None:
        if self._turn is not None:
            self._turn.received(nbytes)  # first: a frame decoded now ends within them
        self._decoder.buffer_updated(nbytes)
        if self._handler is not None:
            self._dispatch_ready()  # what it cannot hand over yet counts as queued, below
        decoder = self._decoder
        full = (
            decoder.buffered_messages >= self._max_queued_messages
            or decoder.buffered_bytes >= self._max_queued_bytes
        )
        if full or decoder.error is not None:
            self._pause_reading()
        if self._handler is None:
            self._readable.set()

    def _on_eof(self) -> bool:
        """End of input; returns True to keep writing (half-close allowed, plain socket)."""
        mid_frame = " mid-frame" if self._decoder.mid_frame else ""
        self._end(f"the peer closed the connection{mid_frame}")
        transport = self._transport
        tls = transport is not None and transport.get_extra_info("sslcontext") is not None
        self._peer_done_writing = self._allow_half_close and not tls
        return self._peer_done_writing

    def _dispatch_ready(self) -> None:
        """Hand decoded messages to the handler until none is left, it holds the rest or
        writers are paused (the rest wait in the decoder, within its bounds, as for `recv`);
        wake `dispatch` when it has to await or end."""
        decoder, handler = self._decoder, self._handler
        while (
            handler is not None
            and self._hold is None
            and self._handler_error is None
            and self._writable.is_set()
            and decoder.buffered_messages
            and (self._turn is None or not self._turn.over())
        ):
            frame = decoder.next_frame()
            assert frame is not None
            try:
                message = frame[0]
                if isinstance(message, Screened):
                    assert self._on_screened is not None  # set with the screen
                    self._on_screened(message)
                else:
                    self._hold = handler(message)
            except Exception as error:
                self._handler_error = error
        if self._handler_error is not None or (self._turn is not None and self._turn.spent):
            self._pause_reading()  # a spent turn: the rest in the next iteration (`_next_turn`)
        if self._hold is not None or self._handler_error is not None or decoder.error:
            self._readable.set()
        else:
            self._maybe_resume_reading()  # caught up with what a hold or paused writers left

    def _unread(self) -> int:
        """Bytes waiting in the socket (0 if it cannot say)."""
        sock = None if self._transport is None else self._transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return 0
        try:
            waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:  # gone meanwhile: nothing more will be read
            return 0
        return int.from_bytes(waiting, sys.byteorder)

    def _next_turn(self) -> None:
        if self._handler is None:
            self._maybe_resume_reading()
            return
        self._dispatch_ready()  # resumes reading once caught up
        if self._ended is not None:
            self._readable.set()  # `dispatch` ends once the messages a turn left are out

    def _on_writable(self) -> None:
        self._writable.set()
        if self._on_written and self._written_check is None:
            self._check_written()
        if self._handler is not None:
            self._readable.set()  # dispatch hands over what waited meanwhile

    def _on_connection_lost(self, exc: Exception | None) -> None:
        self._end("connection lost" + ("" if exc is None else f": {exc!r}"))
        self._held, self._held_bytes = [], 0
        if self._state is not ConnectionState.CLOSED:
            self._enter(ConnectionState.CLOSED)
        self._writable.set()
        self._closed.set()
        if self._written_check is not None:
            self._written_check.cancel()
            self._written_check = None
        self._run_written()  # the transport is gone, and every buffer it held with it

    # Internals.

    def _enter(self, state: ConnectionState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"connection cannot go from {self._state.name} to {state.name}")
        self._state = state

    def _end(self, reason: str) -> None:
        if self._ended is None:
            self._ended = ConnectionClosed(reason)
        self._readable.set()

    def _end_burst(self) -> None:
        """The iteration that wrote at once is over: write what it held back, in one call."""
        self._writing_burst = False
        if self._state is ConnectionState.OPEN:
            self._write_held()

    def _write_held(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        if held and self._transport is not None:
            self._transport.writelines(held)

    def _open_transport(self) -> asyncio.Transport:
        if self._state is not ConnectionState.OPEN or self._transport is None:
            raise ConnectionClosed(f"connection is {self._state.value}")
        return self._transport

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._state is ConnectionState.OPEN:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True

    def _maybe_resume_reading(self) -> None:
        decoder = self._decoder
        caught_up = (
            (self._turn is None or not self._turn.spent)
            and decoder.buffered_messages <= self._max_queued_messages // 2
            and decoder.buffered_bytes <= self._max_queued_bytes // 2
        )
        if self._reading_paused and caught_up and decoder.error is None:
            self._reading_paused = False
            if self._state is ConnectionState.OPEN and self._transport is not None:
                self._transport.resume_reading()


def _set_tcp_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
