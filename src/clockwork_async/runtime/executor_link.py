"""The controller's connection to one executor: handshake, clock offset, heartbeats, actions.

`ExecutorLink` is one connection's life: ``open`` connects, exchanges Hello (with the token),
reads ExecutorInfo, takes ``sync_samples`` ping round trips for a first clock offset (min-RTT,
`clock_sync`), then reads replies in a task and pings every ``heartbeat_interval_ms``. Any
message received counts as a heartbeat. The link goes DOWN, once, when its socket closes, the
peer sends bytes that do not decode, or nothing was heard for ``heartbeat_timeout_s``; then
every action still waiting for its reply is dropped (the driver resolves them through the core),
every `call` waiting raises `LinkDown`, and ``on_down`` is called exactly once.

A `call` that stops waiting before its reply (its task cancelled, as a registration's is when it
is cancelled, or timed out) abandons its action; the link remembers the last
`ABANDONED_REMEMBERED` such ids, so the executor's late reply to one is expected (logged at
debug) while a reply to an id never sent, or long forgotten, still warns.

`runtime/link_keeper.py` keeps an executor connected (a link at a time, with backoff).

States of a link: ``OPENING -> UP -> DOWN``, or ``-> CLOSED`` from any (closed by us).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from clockwork_async.config.keys import internal, nested, ranged
from clockwork_async.connection import Connection, ConnectionClosed
from clockwork_async.core.config import ConfigError
from clockwork_async.endpoints import open_connection
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.clock_sync import ClockSync, ClockSyncError
from clockwork_async.wire.codec import ProtocolError
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ExecutorInfo,
    Hello,
    Message,
    ModelInfo,
    Ping,
    Pong,
    Role,
    State,
)
from clockwork_async.wire.schema import DEFAULT_LIMITS, Limits

log = logging.getLogger(__name__)

ReplyCallback = Callable[[Message], None]
ActionReply = ActionResult | ModelInfo | State
_M = TypeVar("_M", Hello, ExecutorInfo, Pong)
FIRST_CALL_ID = 1 << 62
MIN_MISSED_PINGS = 2  # the driver's own actions; the core numbers its actions from 0 up
ABANDONED_REMEMBERED = 1024  # ids of calls given up on, whose late replies are expected


class LinkState(StrEnum):
    OPENING = "opening"
    UP = "up"
    DOWN = "down"
    CLOSED = "closed"


class LinkError(Exception):
    """Could not bring a link up: connection refused, handshake refused or timed out."""


class _LinkWentDown(Exception):
    """A message took the link down: stop reading (`_go_down` already ran)."""


class LinkDown(LinkError):
    """The link went down (or was closed) before an action's reply came."""


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Timing of executor links: the daemon's ``[executor_link]`` section, key for key
    (`config_keys`; the backoff's keys are ``reconnect_backoff_<field>``). Units in names."""

    heartbeat_interval_ms: float = ranged(200.0, 1.0, 60_000.0)  # ping period
    heartbeat_miss_limit: int = ranged(3, 1, 1000)  # pings missed before the link is down
    connect_timeout_s: float = ranged(5.0, 0.01, 600.0)  # connecting; then again the handshake
    reconnect_backoff: BackoffConfig = nested(BackoffConfig)
    sync_samples: int = internal(16)  # back-to-back pings before a link is up
    sync_window: int = internal(64)  # recent samples the offset estimate picks the min-RTT from
    call_timeout_s: float = internal(60.0)  # RegisterModel reads a file; profiling runs batches
    controller_name: str = internal("controller")
    limits: Limits = internal(DEFAULT_LIMITS)

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms <= 0:
            raise ConfigError("heartbeat_interval_ms", self.heartbeat_interval_ms, "> 0")
        if self.heartbeat_miss_limit < 1:
            raise ConfigError("heartbeat_miss_limit", self.heartbeat_miss_limit, ">= 1")
        if self.sync_samples < 1 or self.sync_window < 1:
            raise ConfigError("sync_samples", (self.sync_samples, self.sync_window), ">= 1 each")

    @property
    def heartbeat_interval_s(self) -> float:
        return self.heartbeat_interval_ms / 1000.0

    @property
    def heartbeat_timeout_s(self) -> float:
        """Silence after which the link is down: ``heartbeat_miss_limit`` periods, plus half a
        period so that a limit of 1 is still longer than the interval."""
        return self.heartbeat_interval_s * (self.heartbeat_miss_limit + 0.5)

    @property
    def handshake_timeout_s(self) -> float:
        return self.connect_timeout_s


class ExecutorLink:
    """One live connection to an executor. Create with `ExecutorLink.open`."""

    def __init__(
        self,
        executor_id: str,
        connection: Connection,
        info: ExecutorInfo,
        sync: ClockSync,
        config: LinkConfig,
        now_ns: Callable[[], int],
    ) -> None:
        self.executor_id = executor_id
        self.info = info
        self.clock = sync
        self.config = config
        self.state = LinkState.UP
        self.down_reason = ""
        self.last_rtt_ns = sync.best.rtt_ns
        # The executor's clock minus ours (`ClockSync.offset_ns`), refreshed at each pong: a
        # plain attribute, read for every action sent and every result.
        self.offset_ns = sync.offset_ns
        self.on_down: Callable[[ExecutorLink, str], None] = lambda _link, _reason: None
        self._connection = connection
        self._now_ns = now_ns
        self._pending: dict[int, ReplyCallback] = {}
        self._calls: dict[int, asyncio.Future[Message]] = {}
        self._abandoned: dict[int, bool] = {}  # insertion-ordered, at most ABANDONED_REMEMBERED
        self._call_ids = itertools.count(FIRST_CALL_ID)
        self._ping_seq = itertools.count(1_000_000)
        self._last_heard_ns = now_ns()
        self._unanswered_pings = 0
        self._tasks: list[asyncio.Task[None]] = []
        # Models registered on it and the ModelInfo each answered (None: found registered).
        self.registered: dict[str, ModelInfo | None] = {}
        self.lock = asyncio.Lock()  # serialises registration and profiling calls

    # --- opening ---------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        executor_id: str,
        address: str,
        *,
        token: str = "",
        config: LinkConfig | None = None,
        now_ns: Callable[[], int] = time.monotonic_ns,
    ) -> ExecutorLink:
        """Connect, handshake and sync clocks; returns an UP link (reader and heartbeat started).

        Raises LinkError when the executor cannot be reached, refuses us, or is too slow.
        """
        config = config or LinkConfig()
        try:
            connection = await asyncio.wait_for(
                open_connection(address, limits=config.limits), config.connect_timeout_s
            )
        except (OSError, TimeoutError, ValueError) as error:
            message = f"cannot connect to executor {executor_id} at {address}: {error!r}"
            raise LinkError(message) from None
        try:
            info, sync = await asyncio.wait_for(
                _handshake(connection, token, config, now_ns), config.handshake_timeout_s
            )
        except BaseException as error:
            connection.close()
            if isinstance(error, TimeoutError):
                raise LinkError(f"executor {executor_id}: handshake timed out") from None
            if isinstance(error, (ConnectionClosed, ProtocolError, ClockSyncError, OSError)):
                raise LinkError(f"executor {executor_id}: handshake failed: {error}") from None
            raise
        link = cls(executor_id, connection, info, sync, config, now_ns)
        link._start()
        return link

    def _start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read(), name=f"link-read-{self.executor_id}"),
            asyncio.create_task(self._heartbeat(), name=f"link-ping-{self.executor_id}"),
        ]

    # --- actions -----------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    def send_action(self, message: Message, action_id: int, on_reply: ReplyCallback) -> None:
        """Send an action; ``on_reply`` gets its one reply, unless the link goes down first.

        Raises LinkDown if the link is not up.
        """
        if self.state is not LinkState.UP:
            raise LinkDown(f"executor {self.executor_id} is {self.state.value}")
        self._pending[action_id] = on_reply
        self._connection.send(message)

    def flush(self) -> None:
        """Write the actions held back in this loop round now."""
        if self.state is LinkState.UP:
            self._connection.flush()

    def next_call_id(self) -> int:
        """An action id for the driver's own calls, apart from the core's ids."""
        return next(self._call_ids)

    async def call(
        self, message: Message, action_id: int, timeout_s: float | None = None
    ) -> Message:
        """Send an action and wait for its reply. Raises LinkDown, or TimeoutError after
        ``timeout_s`` (profiling: what its prediction allows), else ``call_timeout_s``."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._calls[action_id] = future
        try:
            self.send_action(message, action_id, future.set_result)
            wait_s = self.config.call_timeout_s if timeout_s is None else timeout_s
            return await asyncio.wait_for(future, wait_s)
        finally:
            self._calls.pop(action_id, None)
            if self._pending.pop(action_id, None) is not None and self.state is LinkState.UP:
                self._abandon(action_id)  # sent, and no reply came: one may come late

    def _abandon(self, action_id: int) -> None:
        self._abandoned[action_id] = True
        if len(self._abandoned) > ABANDONED_REMEMBERED:
            del self._abandoned[next(iter(self._abandoned))]  # the oldest

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    # --- reading -----------------------------------------------------------------------------

    async def _read(self) -> None:
        """Handle each message as its bytes are decoded (`Connection.dispatch`), until the
        connection ends or the link goes down."""
        reason = "connection closed by the executor"
        try:
            await self._connection.dispatch(self._on_message)
        except _LinkWentDown:
            return
        except ConnectionClosed as error:
            reason = f"connection closed: {error}"
        except ProtocolError as error:
            reason = f"protocol error from the executor: {error}"
        except OSError as error:
            reason = f"socket error: {error}"
        self._go_down(reason)

    def _on_message(self, message: Message) -> None:
        """Raises _LinkWentDown once handling it took the link down."""
        self._last_heard_ns = self._now_ns()
        self._unanswered_pings = 0
        self._dispatch(message)
        if self.state is not LinkState.UP:
            raise _LinkWentDown

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Pong):
            self._on_pong(message)
        elif isinstance(message, (ActionResult, ModelInfo, State)):
            action_id = message.action_id
            callback = self._pending.pop(action_id, None)
            if callback is not None:
                callback(message)
            elif self._abandoned.pop(action_id, False):
                log.debug("executor %s: reply to abandoned action %d", self.executor_id, action_id)
            else:
                log.warning("executor %s: reply to unknown action %d", self.executor_id, action_id)
        elif isinstance(message, Error):
            self._go_down(f"executor sent error {message.code}: {message.message}")
        else:
            self._go_down(f"unexpected {type(message).__name__} from the executor")

    def _on_pong(self, pong: Pong) -> None:
        try:
            sample = self.clock.add(pong.sent_ns, pong.peer_ns, self._now_ns())
        except ClockSyncError as error:
            log.warning("executor %s: bad pong: %s", self.executor_id, error)
            return
        self.last_rtt_ns = sample.rtt_ns
        self.offset_ns = self.clock.offset_ns

    async def _heartbeat(self) -> None:
        """Ping every interval; down after ``heartbeat_timeout_s`` of silence *and* at least
        `MIN_MISSED_PINGS` pings unanswered, so a stall of our own loop (which sends no pings
        and reads no pongs meanwhile) is not blamed on the executor."""
        interval_s = self.config.heartbeat_interval_s
        timeout_ns = int(self.config.heartbeat_timeout_s * 1e9)
        while self.state is LinkState.UP:
            await asyncio.sleep(interval_s)
            silent_ns = self._now_ns() - self._last_heard_ns
            if silent_ns > timeout_ns and self._unanswered_pings >= MIN_MISSED_PINGS:
                self._go_down(f"no heartbeat for {silent_ns / 1e9:.3f} s")
                return
            if self.state is LinkState.UP:
                self._connection.send(Ping(seq=next(self._ping_seq), sent_ns=self._now_ns()))
                self._unanswered_pings += 1

    # --- going down --------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Take the link down now (e.g. a send found the socket closed before the reader did):
        ``on_down`` runs, as for any other failure."""
        self._go_down(reason)

    def _go_down(self, reason: str) -> None:
        if self.state is not LinkState.UP:
            return
        self.state = LinkState.DOWN
        self.down_reason = reason
        log.warning("executor %s link down: %s", self.executor_id, reason)
        self._release(LinkDown(f"executor {self.executor_id}: {reason}"), abort=True)
        self.on_down(self, reason)

    def close(self) -> None:
        """Close from our side: no ``on_down``; pending calls raise LinkDown."""
        if self.state in (LinkState.DOWN, LinkState.CLOSED):
            self.state = LinkState.CLOSED
            return
        self.state = LinkState.CLOSED
        self.down_reason = "closed by the controller"
        self._release(LinkDown(f"executor {self.executor_id}: link closed"), abort=False)

    def _release(self, error: LinkDown, *, abort: bool) -> None:
        """Drop pending actions, fail waiting calls, stop the tasks, close the socket (abort
        a failed one: a hung peer would never take the buffered bytes)."""
        self._pending.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if abort:
            self._connection.abort()
        else:
            self._connection.close()

    async def wait_closed(self) -> None:
        """Wait until the tasks and the socket are finished."""
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._connection.wait_closed()


async def _handshake(
    connection: Connection, token: str, config: LinkConfig, now_ns: Callable[[], int]
) -> tuple[ExecutorInfo, ClockSync]:
    """Hello both ways, then ExecutorInfo, then ``sync_samples`` ping round trips."""
    connection.send(
        Hello(PROTOCOL_VERSION, Role.CONTROLLER.value, config.controller_name, token=token)
    )
    hello = await _expect(connection, Hello)
    if hello.role != Role.EXECUTOR.value:
        raise LinkError(f"peer is a {hello.role!r}, not an executor")
    info = await _expect(connection, ExecutorInfo)
    sync = ClockSync(window=config.sync_window)
    for seq in range(config.sync_samples):
        connection.send(Ping(seq=seq, sent_ns=now_ns()))
        pong = await _expect(connection, Pong)
        sync.add(pong.sent_ns, pong.peer_ns, now_ns())
    return info, sync


async def _expect(connection: Connection, kind: type[_M]) -> _M:
    message = await connection.recv()
    if isinstance(message, Error):
        raise LinkError(f"executor refused: {message.code}: {message.message}")
    if not isinstance(message, kind):
        raise LinkError(f"expected {kind.__name__}, got {type(message).__name__}")
    return message
