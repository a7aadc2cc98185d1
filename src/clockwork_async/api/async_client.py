"""The asyncio client of the daemon's client API (`clockwork_async.client` is the public
facade, with the blocking `Client`).

One idea: one connection to the daemon, as a client program uses it.

It pipelines: many calls may be in flight on one connection at once, each matched to its
reply by a request id the client chooses; replies may come in any order.

Invariants:
- Every call in flight is in ``_waiters`` until its reply arrives or the connection ends; when
  it ends, every waiter fails with `ConnectionClosedError` naming the reason (never a hang),
  and so does every later call.
- An `infer` whose awaiting task is cancelled sends ``cancel_infer`` for its request, so the
  daemon stops working on it; its reply, if one still comes, is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl as ssl_module
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np

from clockwork_async.api.service import Health
from clockwork_async.connection import Connection, ConnectionClosed
from clockwork_async.core.outcomes import Outcome
from clockwork_async.endpoints import open_connection
from clockwork_async.wire.codec import DEFAULT_LIMITS, Limits, ProtocolError
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    AddModel,
    ApiCode,
    CancelInfer,
    CancelRegistration,
    Error,
    GetHealth,
    GetStats,
    HealthReply,
    Hello,
    InferReply,
    InferRequest,
    ListModels,
    Message,
    ModelsReply,
    ModelStatus,
    Ping,
    Pong,
    RemoveModel,
    Role,
    StatsReply,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "ApiError",
    "AsyncClient",
    "ClientError",
    "ConnectError",
    "ConnectOptions",
    "ConnectionClosedError",
    "Deadline",
    "Health",
    "InferResult",
    "ModelStatus",
    "PendingInfer",
]

DEFAULT_ADDRESS = "127.0.0.1:7470"
_Reply = InferReply | ModelsReply | StatsReply | HealthReply


class ConnectOptions(TypedDict, total=False):
    """How `AsyncClient.connect` and `client.Client` connect; every key may be left out."""

    token: str  # the daemon's infer or admin token; default "" (no authentication)
    ssl: ssl_module.SSLContext | None  # TLS (`api.auth.client_ssl_context`); default None
    server_hostname: str | None  # the name the certificate must carry; default: the host
    name: str  # this client's name in the daemon's logs; default "python-client"
    max_frame_bytes: int  # the largest frame accepted; default DEFAULT_LIMITS.max_tail_bytes


class Deadline(TypedDict, total=False):
    """When an infer is due: ``slo_ms`` after it reaches the daemon, or at
    ``deadline_unix_ns`` (Unix time); neither: the model's default SLO."""

    slo_ms: float | None
    deadline_unix_ns: int | None


class ClientError(Exception):
    """Base of the client's errors."""


class ConnectError(ClientError):
    """No connection: nothing listens there (``code`` ``unreachable``), it took too long
    (``timeout``), or the daemon refused the hello (its code: ``unauthorized``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConnectionClosedError(ClientError):
    """The connection ended while a call was in flight, or before it was made."""


class ApiError(ClientError):
    """The daemon answered a model, stats or health call with a status other than ``ok``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class InferResult:
    """The daemon's answer to one infer. ``status`` is an Outcome value (``ok``, ``dropped``,
    ``infeasible``, ...) or an ApiCode value (``duplicate_id``, ``internal``)."""

    request_id: int
    status: str
    message: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    timing_ns: dict[str, int] = field(default_factory=dict)
    executor_id: str = ""
    batch_size: int = 0
    model_version: int = 0  # the version of the model that answered (0: not told)

    @property
    def ok(self) -> bool:
        return self.status == Outcome.OK

    @property
    def outcome(self) -> Outcome | None:
        """The status as an Outcome; None for statuses that are not request outcomes."""
        try:
            return Outcome(self.status)
        except ValueError:
            return None

    @classmethod
    def from_reply(cls, reply: InferReply) -> InferResult:
        return cls(
            reply.request_id,
            reply.status,
            reply.message,
            dict(reply.outputs),
            dict(reply.timing_ns),
            reply.executor_id,
            reply.batch_size,
            reply.model_version,
        )


class PendingInfer:
    """An infer that was sent: await it for its `InferResult`, or `cancel` it."""

    def __init__(self, client: AsyncClient, request_id: int, future: asyncio.Future[Message]):
        self.request_id = request_id
        self._client = client
        self._future = future

    def __await__(self) -> Generator[Any, None, InferResult]:
        reply = yield from self._client._wait(self.request_id, self._future).__await__()
        assert isinstance(reply, InferReply)
        return InferResult.from_reply(reply)

    def cancel(self) -> None:
        """Ask the daemon to cancel it; the reply (``cancelled``, or a result) still comes."""
        self._client._send(CancelInfer(self.request_id))

    def add_done_callback(self, callback: Callable[[InferResult | ClientError], None]) -> None:
        """Call ``callback`` with the result, or with the ConnectionClosedError, once known
        (instead of awaiting; for senders that never wait)."""

        def done(future: asyncio.Future[Message]) -> None:
            if future.cancelled():
                return
            error = future.exception()
            if error is not None:
                callback(error if isinstance(error, ClientError) else ClientError(repr(error)))
                return
            reply = future.result()
            assert isinstance(reply, InferReply)
            callback(InferResult.from_reply(reply))

        self._future.add_done_callback(done)


NOT_CONNECTED = "not connected: use `async with AsyncClient(address)` or AsyncClient.connect"


class AsyncClient:
    """One connection to the daemon, the asyncio twin of `client.Client`: ``async with
    AsyncClient(address) as client:`` connects on entry, as does ``await
    AsyncClient.connect(address)``. Use it from one event loop."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        connect_timeout_s: float = 10.0,
        **options: Unpack[ConnectOptions],
    ) -> None:
        """Nothing is sent until `open` (``async with`` calls it)."""
        self.address = address
        self.server_name = ""
        self._connect_timeout_s = connect_timeout_s
        self._options = options
        self._connection: Connection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future[Message]] = {}
        self._pings: dict[int, asyncio.Future[Message]] = {}
        self._ended: str | None = NOT_CONNECTED
        self._server_error = ""

    @classmethod
    async def connect(
        cls,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = 10.0,
        **options: Unpack[ConnectOptions],
    ) -> AsyncClient:
        """A client connected by `open` within ``timeout_s`` (`ConnectOptions` says the
        rest). Raises ConnectError; ValueError for a bad address."""
        client = cls(address, connect_timeout_s=timeout_s, **options)
        await client.open()
        return client

    async def open(self) -> None:
        """Connect and exchange hellos within the connect timeout. Raises ConnectError;
        ValueError for a bad address; RuntimeError if it was opened before."""
        if self._connection is not None:
            raise RuntimeError("this AsyncClient was opened already")
        options, address, timeout_s = self._options, self.address, self._connect_timeout_s
        limits = Limits(
            max_tail_bytes=options.get("max_frame_bytes", DEFAULT_LIMITS.max_tail_bytes)
        )
        hello = (options.get("token", ""), options.get("name", "python-client"))
        tls = (options.get("ssl"), options.get("server_hostname"))
        try:
            connection, server = await asyncio.wait_for(
                _open(address, limits, *hello, *tls), timeout_s
            )
        except TimeoutError:
            raise ConnectError("timeout", f"no answer from {address} in {timeout_s:g} s") from None
        except OSError as error:
            raise ConnectError("unreachable", f"cannot connect to {address}: {error}") from None
        self._connection, self.server_name, self._ended = connection, server, None
        self._reader = asyncio.get_running_loop().create_task(self._read(connection))

    # --- infer --------------------------------------------------------------------------------

    def start_infer(
        self, model: str, inputs: Mapping[str, np.ndarray], **deadline: Unpack[Deadline]
    ) -> PendingInfer:
        """Send an infer now, without waiting (open-loop senders use this). The inputs go out
        without a copy: do not change them until the result is in. Raises
        ConnectionClosedError, and EncodeError (a ValueError) for inputs the wire cannot carry."""
        request_id = next(self._ids)
        slo_ms, deadline_unix_ns = deadline.get("slo_ms"), deadline.get("deadline_unix_ns")
        request = InferRequest(request_id, model, inputs, slo_ms, deadline_unix_ns)
        return PendingInfer(self, request_id, self._call(request_id, request))

    async def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], **deadline: Unpack[Deadline]
    ) -> InferResult:
        """Run ``model`` on one row of every input, or N rows (docs/protocol.md): the daemon's
        answer whatever its status (check ``.ok``). Raises ConnectionClosedError."""
        await self._drain()
        return await self.start_infer(model, inputs, **deadline)

    async def cancel(self, request_id: int) -> None:
        """Cancel an infer in flight by its id (see `PendingInfer.request_id`)."""
        self._send(CancelInfer(request_id))

    # --- models, stats, health ----------------------------------------------------------------

    async def models(self) -> list[ModelStatus]:
        """Every model the daemon serves. Raises ApiError, ConnectionClosedError."""
        reply = await self._request(ListModels)
        assert isinstance(reply, ModelsReply)
        return list(reply.models)

    async def add_model(
        self,
        name: str,
        path_or_bytes: str | Path | bytes,
        model_toml: str | None = None,
        *,
        replace: bool = False,
        wait: bool = True,
    ) -> ModelStatus:
        """Upload an ONNX model (a file, read here, or its bytes) as ``name``; returns its status
        once registered (``wait=False``: once its job started), ``replace``: taking the name.
        Raises ApiError (``bad_model``, ``model_exists``, ...), OSError, ConnectionClosedError."""
        data = (
            path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
        )
        files = {"model.onnx": np.frombuffer(data, dtype=np.uint8)}
        await self._drain()
        reply = await self._request(lambda i: AddModel(i, name, files, model_toml, replace, wait))
        assert isinstance(reply, ModelsReply)
        return reply.models[0]

    async def cancel_registration(self, name: str) -> ModelStatus:
        """Cancel the running registration of ``name``; returns its status once nothing of it
        is left. Raises ApiError (``unknown_model``: none runs)."""
        reply = await self._request(lambda i: CancelRegistration(i, name))
        assert isinstance(reply, ModelsReply)
        return reply.models[0]

    async def remove_model(self, name: str) -> None:
        """Unregister ``name``. Raises ApiError (``unknown_model``, ``forbidden``, ...)."""
        await self._request(lambda i: RemoveModel(i, name))

    async def stats(self) -> dict[str, Any]:
        """The daemon's stats (a JSON object). Raises ApiError, ConnectionClosedError."""
        reply = await self._request(GetStats)
        assert isinstance(reply, StatsReply)
        stats: dict[str, Any] = json.loads(reply.stats_json)
        return stats

    async def health(self) -> Health:
        """Liveness and readiness. Raises ApiError, ConnectionClosedError."""
        reply = await self._request(GetHealth)
        assert isinstance(reply, HealthReply)
        return Health(reply.live, reply.ready, reply.reason)

    async def ping(self) -> int:
        """One round trip to the daemon, in ns."""
        seq = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pings[seq] = future
        self._send(Ping(seq, time.monotonic_ns()))
        pong = await self._wait(seq, future, self._pings)
        assert isinstance(pong, Pong)
        return time.monotonic_ns() - pong.sent_ns

    # --- closing ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ended is not None

    async def close(self, flush_timeout_s: float = 5.0) -> None:
        """Close the connection, flushing what was sent for up to ``flush_timeout_s``; calls
        in flight fail with ConnectionClosedError."""
        connection, reader = self._connection, self._reader
        if connection is None or reader is None:
            return  # never opened
        connection.close()
        await reader
        try:
            await asyncio.wait_for(connection.wait_closed(), flush_timeout_s)
        except TimeoutError:
            connection.abort()
            await connection.wait_closed()

    async def __aenter__(self) -> AsyncClient:
        if self._connection is None:
            await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- internals ----------------------------------------------------------------------------

    async def _request(self, make: Callable[[int], Message]) -> _Reply:
        request_id = next(self._ids)
        return _checked(await self._wait(request_id, self._call(request_id, make(request_id))))

    def _call(self, request_id: int, message: Message) -> asyncio.Future[Message]:
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._send(message)
        self._waiters[request_id] = future
        return future

    async def _wait(
        self,
        request_id: int,
        future: asyncio.Future[Message],
        waiters: dict[int, asyncio.Future[Message]] | None = None,
    ) -> Message:
        try:
            return await future
        except asyncio.CancelledError:
            (self._waiters if waiters is None else waiters).pop(request_id, None)
            if waiters is None and not self.closed:
                with contextlib.suppress(ClientError):
                    self._send(CancelInfer(request_id))  # ignored unless it was an infer
            raise

    def _open_connection(self) -> Connection:
        """The connection; raises ConnectionClosedError once it ended (or before `open`)."""
        if self._ended is not None or self._connection is None:
            raise ConnectionClosedError(self._ended or NOT_CONNECTED)
        return self._connection

    def _send(self, message: Message) -> None:
        connection = self._open_connection()
        try:
            connection.send(message)
        except ConnectionClosed as error:
            raise ConnectionClosedError(self._closed_reason(str(error))) from None

    async def _drain(self) -> None:
        connection = self._open_connection()
        try:
            await connection.drain()
        except ConnectionClosed as error:
            raise ConnectionClosedError(self._closed_reason(str(error))) from None

    async def _read(self, connection: Connection) -> None:
        try:
            while True:
                self._dispatch(await connection.recv())
        except ConnectionClosed as error:
            reason = str(error)
        except ProtocolError as error:
            reason = f"the daemon sent bytes that do not decode ({error})"
            connection.abort()
        self._end(self._closed_reason(reason))

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Pong):
            future = self._pings.pop(message.seq, None)
        elif isinstance(message, InferReply | ModelsReply | StatsReply | HealthReply):
            future = self._waiters.pop(message.request_id, None)
        elif isinstance(message, Error):
            self._server_error = f"{message.code}: {message.message}"
            return
        else:
            future = None
        if future is not None and not future.done():
            future.set_result(message)

    def _closed_reason(self, reason: str) -> str:
        why = f"the daemon said {self._server_error}" if self._server_error else reason
        return f"connection to {self.address} closed: {why}"

    def _end(self, reason: str) -> None:
        self._ended = reason
        for waiters in (self._waiters, self._pings):
            for future in waiters.values():
                if not future.done():
                    future.set_exception(ConnectionClosedError(reason))
            waiters.clear()


def _checked(reply: Message) -> _Reply:
    """``reply`` if its status is ok; raises ApiError otherwise."""
    assert isinstance(reply, ModelsReply | StatsReply | HealthReply | InferReply)
    if reply.status != ApiCode.OK:
        raise ApiError(reply.status, reply.message)
    return reply


async def _open(
    address: str,
    limits: Limits,
    token: str,
    name: str,
    ssl: ssl_module.SSLContext | None,
    server_hostname: str | None,
) -> tuple[Connection, str]:
    """A connection past its hello, and the daemon's name (ConnectError, OSError, ValueError)."""
    # The daemon may answer with an Error instead of a Hello: no hello check in the decoder.
    connection = await open_connection(address, limits, ssl=ssl, server_hostname=server_hostname)
    try:
        return connection, await _handshake(connection, token, name)
    except BaseException:
        connection.abort()
        raise


async def _handshake(connection: Connection, token: str, name: str) -> str:
    connection.send(Hello(PROTOCOL_VERSION, Role.CLIENT.value, name, token))
    try:
        answer = await connection.recv()
    except (ConnectionClosed, ProtocolError) as error:
        raise ConnectError("protocol_error", f"no hello from the daemon: {error}") from None
    if isinstance(answer, Error):
        raise ConnectError(answer.code, answer.message)
    if not isinstance(answer, Hello) or answer.protocol_version != PROTOCOL_VERSION:
        raise ConnectError("protocol_error", f"expected a version-1 hello, got {answer!r}")
    return answer.name
