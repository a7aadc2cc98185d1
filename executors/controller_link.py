"""The controller link: one controller connection at a time, from Hello to close.

Invariants:
- Every connection must open with a controller `Hello` of our protocol version (and the
  ``--token`` where one is set, compared in constant time); anything else gets an `Error` and
  the connection closes. The executor answers `Hello` then `ExecutorInfo`.
- One controller at a time: a newly authenticated controller connection replaces the current
  one, which gets `Error(protocol_error, "replaced ...")` and is closed; replies to actions it
  sent are dropped. (A restarted controller must never be locked out by its dead predecessor's
  half-open connection; the token keeps strangers out.)
- `Ping` is answered with `Pong` at once, from the event loop; every action goes to the host
  (`host.py`), which replies exactly once; a reply that cannot be encoded becomes INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from functools import partial

from clockwork_async.connection import Connection, ConnectionClosed
from clockwork_async.wire.codec import EncodeError, ProtocolError
from clockwork_async.wire.messages import (
    EXECUTOR_ACTIONS,
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ErrorCode,
    Hello,
    Message,
    Ping,
    Pong,
    Role,
)

from .executor_config import ExecutorConfig
from .host import ExecutorAction, ExecutorHost

log = logging.getLogger("clockwork_async.executor")

HELLO_TIMEOUT_S = 10.0


class ControllerLink:
    """Serves controller connections for one host: handshake, pings, actions, replies."""

    def __init__(self, config: ExecutorConfig, host: ExecutorHost) -> None:
        self._config = config
        self._host = host
        self._current: Connection | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def handle(self, conn: Connection) -> None:
        """One connection, from Hello to close."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            if await self._handshake(conn):
                await self._serve(conn)
        finally:
            if self._current is conn:
                self._current = None
            conn.close()
            if task is not None:
                self._handlers.discard(task)

    async def close(self) -> None:
        """Flush and close the current connection; wait for every handler to end."""
        current, self._current = self._current, None
        if current is not None:
            await _flush(current)
            current.close()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5.0)

    async def _handshake(self, conn: Connection) -> bool:
        try:
            hello = await asyncio.wait_for(conn.recv(), HELLO_TIMEOUT_S)
        except (ConnectionClosed, TimeoutError):
            return False
        except ProtocolError as error:
            await _refuse(conn, error.code, error.message)
            return False
        refusal = self._check_hello(hello)
        if refusal is not None:
            await _refuse(conn, *refusal)
            return False
        await self._replace_current(conn)
        conn.send(Hello(PROTOCOL_VERSION, Role.EXECUTOR.value, self._config.name))
        conn.send(self._host.info(self._config.name))
        return True

    def _check_hello(self, hello: Message) -> tuple[ErrorCode, str] | None:
        if not isinstance(hello, Hello):
            return ErrorCode.PROTOCOL_ERROR, f"the first message must be hello, got {hello.TAG}"
        if hello.protocol_version != PROTOCOL_VERSION:
            return ErrorCode.UNSUPPORTED_VERSION, (
                f"peer speaks protocol version {hello.protocol_version}; "
                f"this executor speaks {PROTOCOL_VERSION}"
            )
        if hello.role != Role.CONTROLLER:
            return ErrorCode.PROTOCOL_ERROR, f"an executor serves controllers, not {hello.role!r}"
        token = self._config.token
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            return ErrorCode.UNAUTHORIZED, "wrong or missing token"
        return None

    async def _replace_current(self, conn: Connection) -> None:
        previous, self._current = self._current, conn
        if previous is not None:
            log.warning("a new controller connection replaces the current one")
            message = "replaced by a newer controller connection"
            await _refuse(previous, ErrorCode.PROTOCOL_ERROR, message)

    async def _serve(self, conn: Connection) -> None:
        """Handle each message as it is decoded (`Connection.dispatch`: no task wake-up per
        action); while the controller does not read our replies, its actions wait unread
        within the connection's bounds."""
        try:
            await conn.dispatch(partial(self._handle_message, conn))
        except _Refusal as refusal:
            await _refuse(conn, refusal.code, refusal.message)
        except ProtocolError as error:
            await _refuse(conn, error.code, error.message)
        except ConnectionClosed:
            pass

    def _handle_message(self, conn: Connection, message: Message) -> None:
        if self._current is not conn:
            return  # replaced: _replace_current refused and closed it
        refusal = self._on_message(conn, message)
        if refusal is not None:
            raise _Refusal(*refusal)

    def _on_message(self, conn: Connection, message: Message) -> tuple[ErrorCode, str] | None:
        """Handle one message; a refusal (code, sentence) for one out of place."""
        if isinstance(message, Ping):
            conn.send(Pong(message.seq, message.sent_ns, time.monotonic_ns()))
        elif isinstance(message, EXECUTOR_ACTIONS):
            action: ExecutorAction = message  # type: ignore[assignment]
            self._host.submit(action, partial(self._reply, conn))
        else:
            text = f"{message.TAG} is not something a controller sends an executor"
            return ErrorCode.PROTOCOL_ERROR, text
        return None

    def _reply(self, conn: Connection, message: Message) -> None:
        """Send an action's one reply; one that cannot be encoded becomes INTERNAL."""
        if self._current is not conn:
            log.info("dropped %s for a connection that was replaced", message.TAG)
            return
        try:
            conn.send(message)
        except EncodeError as error:
            log.error("cannot encode %s: %s", message.TAG, error)
            text = f"the result could not be encoded: {error}"
            conn.send(ActionResult(getattr(message, "action_id", 0), ErrorCode.INTERNAL, text))
        except ConnectionClosed:
            log.info("dropped %s: the connection closed", message.TAG)


class _Refusal(Exception):
    """A message out of place: the connection gets an Error and closes."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def _flush(conn: Connection) -> None:
    with contextlib.suppress(ConnectionClosed, ConnectionError, TimeoutError):
        await asyncio.wait_for(conn.drain(), 2.0)


async def _refuse(conn: Connection, code: ErrorCode, message: str) -> None:
    """Send a connection-level Error, flush it (bounded) and close."""
    with contextlib.suppress(ConnectionClosed, ConnectionError):
        conn.send(Error(code.value, message))
    await _flush(conn)
    conn.close()
