"""One client connection after its hello: requests in, `Service` calls, replies out. Infer
requests are served here; models, stats and health by the admin verbs (`api.session_admin`).

One idea: a connection's requests, from their frames to their one reply each, with the IO
arena slots their tensors are read into.

Invariants (the server's, per connection):
- A request id is in ``_pending`` (infer) or the admin verbs' ``tasks`` (`api.session_admin`)
  from acceptance until its one reply is sent (or dropped, the connection being gone); an id
  in either is refused as ``duplicate_id``, so one in-flight id never has two meanings.
- ``on_reply`` for a request runs once (`_Pending.done` guards it); its reply is dropped if the
  connection is gone, but the server's ``outstanding`` count is settled either way.
- Nothing is read while the connection's transport asks writers to pause (slow reader).
- A peer that half-closes (ends its writing, keeps reading) is answered: `settle` waits until
  every request it sent has its reply queued, or the connection is gone.
- IO arena slots (docs/architecture.md, "The data plane"): an InferRequest whose header passed
  the door is read into a slot this session leases (its owner: the session, for the
  connection's share); the slot is released exactly once: at once when the request is
  refused here, or when it ends without outputs; after the reply's bytes have left the
  process (`Connection.when_written`) when the reply carries outputs from it; and, for slots
  whose frames were never handed over, when the connection goes. The request path may hold
  pins on it meanwhile (an executor reading or writing it), which delay the free, never the
  release.
- A client batch (`api.rows`) is one entry in ``_pending`` for N rows submitted as N
  requests, each in a part of the request's one slot (`Slot.part`: pins go to the slot); it
  is answered once, when its last row is (`RowsJoin`), counted N times in the server's
  ``outstanding``, and cancelled whole (every row, once). Its joined outputs are copies, so
  its slot is released when that reply is queued.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from clockwork_async.api.auth import Scope
from clockwork_async.api.rows import Rows, RowsJoin, RowsRefused, plan_rows, status_in
from clockwork_async.api.service import InferOutcome, ModelRoute
from clockwork_async.api.session_admin import MODEL_CHANGES, AdminHost, AdminVerbs
from clockwork_async.connection import Connection, ConnectionState
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import ArenaRefusal, IoArena, Slot
from clockwork_async.logs import request_extra
from clockwork_async.wire.codec import EncodeError, ProtocolError, Screened
from clockwork_async.wire.messages import (
    ApiCode,
    CancelInfer,
    ErrorCode,
    InferReply,
    InferRequest,
    Message,
    Ping,
    Pong,
)

log = logging.getLogger(__name__)

NS_PER_MS = 1_000_000
# How far from now a deadline may be, either way. The daemon's monotonic clock, an executor's
# clock offset and the deadline each stay under 2**62, so a deadline moved to any executor's
# clock (an action's ``latest_ns``) still fits the wire's signed 64-bit integers.
MAX_DEADLINE_DISTANCE_NS = 1 << 62  # about 146 years
MAX_SLO_MS = MAX_DEADLINE_DISTANCE_NS / NS_PER_MS


def route_to(routes: Mapping[str, ModelRoute], model: str) -> tuple[str, int]:
    """The name ``model``'s current version is served under, and that version (the name
    itself and 0 for a name without a route)."""
    route = routes.get(model)
    return (route.target, route.version) if route is not None else (model, 0)


class SessionHost(AdminHost, Protocol):
    """What a msgpack session needs besides what its admin verbs do: the IO arena and
    clocks."""

    @property
    def io_arena(self) -> IoArena | None: ...

    def now_ns(self) -> int: ...

    def unix_now_ns(self) -> int: ...


@dataclass(slots=True)
class _Pending:
    """An accepted InferRequest waiting for its outcome."""

    received_ns: int
    model_version: int = 0  # the version it was routed to (0: a name without a route)
    slot: Slot | None = None  # the IO arena slot its tensors were read into
    rows: int = 1  # a client batch's rows, each a request of the request path's (`api.rows`)
    service_ids: list[int] = field(default_factory=list)  # its rows', as submit returned them
    done: bool = False
    cancelling: bool = False  # cancelled, or a row was refused: every row is cancelled


class ApiSession:
    """Serves the requests of one connection whose hello was accepted with ``scopes``."""

    def __init__(self, server: SessionHost, connection: Connection, scopes: frozenset[Scope]):
        self._server = server
        self._service = server.service
        self._requests = server.requests
        connection.set_screen(self._screen, self._on_screened, self._lend)
        self._connection = connection
        self._arena = server.io_arena
        self._next_slot: Slot | None = None  # leased by the screen, for `_lend` right after
        self._lent: deque[Slot] = deque()  # read into, not yet handed over, in frame order
        self._refused_here: deque[tuple[Outcome, str] | None] = deque()  # screened, in order
        self._pending: dict[int, _Pending] = {}
        self._admin = AdminVerbs(server, scopes, self, self._send)
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            InferRequest: self._infer,
            CancelInfer: self._cancel,
            Ping: self._ping,
            **self._admin.handlers(),
        }

    @property
    def writing_paused(self) -> bool:
        return self._connection.writing_paused

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._admin.tasks)

    def busy(self, request_id: int) -> bool:
        """Whether ``request_id`` is in flight (an infer or a model change)."""
        return request_id in self._pending or request_id in self._admin.tasks

    def admin_changed(self) -> None:
        """A model change was accepted or answered (`AdminGate`)."""
        if self.in_flight:
            self._idle.clear()
        else:
            self._idle.set()

    async def run(self) -> None:
        """Serve until the connection ends, handling each message as it is decoded
        (`Connection.dispatch`). Raises ProtocolError for a message that is not part of the
        client API (the server answers with an Error and closes)."""
        await self._connection.dispatch(self._on_message)

    def _on_message(self, message: Message) -> Awaitable[None] | None:
        """Handle one message; a model change holds the rest until it is answered."""
        handler = self._handlers.get(type(message))
        if handler is None:
            raise ProtocolError(
                ErrorCode.PROTOCOL_ERROR, f"{message.TAG!r} is not a client API message"
            )
        handler(message)
        if not self._connection.queued_messages:
            self._requests.flush()  # this read's requests are all in: schedule them
        if isinstance(message, MODEL_CHANGES):
            return self._admin.settled(message.request_id)  # its frame is not held meanwhile
        return None  # (a slow reader: dispatch stops reading while our replies back up)

    async def settle(self) -> None:
        """The peer ended its writing: return once every request it sent has had its reply
        queued (the caller then closes, flushing them), or once the connection is gone."""
        self._requests.flush()
        loop = asyncio.get_running_loop()
        waits = {loop.create_task(self._idle.wait()), loop.create_task(self._wait_gone())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _wait_gone(self) -> None:
        await self._connection.wait_closed()

    def disconnected(self) -> None:
        """The connection is gone: cancel what it still waits for (each once), and release
        the slots of frames never handed over (one cut off mid-tensor included)."""
        for entry in list(self._pending.values()):
            self._cancel_rows(entry)
        unclaimed = [*self._lent, *([self._next_slot] if self._next_slot else [])]
        self._lent.clear()
        self._next_slot = None
        for slot in unclaimed:
            slot.release()

    # --- infer ------------------------------------------------------------------------------

    def _infer(self, request: InferRequest) -> None:
        slot = self._claim_slot(request)
        refusal, rows = self._refusal(request), [request.inputs]
        if refusal is None:
            try:
                rows = self._rows(request)
            except RowsRefused as refused:
                refusal = refused.outcome, refused.message
        if refusal is not None:
            self._send_infer_reply(request.request_id, *refusal)
            if slot is not None:
                slot.release()
            return
        model, version = self._route(request.model)  # read here, once: a swap is atomic
        entry = _Pending(self._server.now_ns(), version, slot=slot, rows=len(rows))
        self._pending[request.request_id] = entry
        self._idle.clear()
        for _ in rows:
            self._server.request_started()
        try:
            self._submit(request, model, rows, entry)
        except Exception as error:  # a bug in the service: this request alone fails
            peer = self._connection.peername
            log.exception("submit failed (client %r, its request %d)", peer, request.request_id)
            self._cancel_rows(entry)  # a batch's rows before it (their join never comes)
            if not entry.done:
                self._finish(request.request_id, entry)
                why = f"submit failed: {error!r}"
                self._send_infer_reply(request.request_id, ApiCode.INTERNAL, why)
                self._release(entry, with_outputs=False)

    def _rows(self, request: InferRequest) -> Rows:
        """The request's rows (`api.rows.plan_rows`). Raises RowsRefused."""
        first = next(iter(request.inputs.values()), None)
        if first is None or not first.ndim or first.shape[0] == 1:
            return [request.inputs]  # one row, as plan_rows would say: most requests' way
        room = self._server.limits.max_outstanding_total - self._server.outstanding
        models = self._service.list_models
        return plan_rows(request.inputs, lambda: status_in(models(), request.model), room)

    def _submit(self, request: InferRequest, model: str, rows: Rows, entry: _Pending) -> None:
        """Submit ``rows`` to the request path: one row as it is; a client batch as rows
        whose answers are joined (`RowsJoin`), each row in a part of the request's slot."""
        slo_ns = None if request.slo_ms is None else slo_ms_to_ns(request.slo_ms)
        on_reply = partial(self._on_outcome, request.request_id, entry)
        slot = entry.slot
        replies: list[Callable[[InferOutcome], None]]
        slots: list[Slot | None]
        if len(rows) == 1:
            replies, slots = [on_reply], [slot]
        else:
            join = RowsJoin(len(rows), on_reply, partial(self._cancel_rows, entry))
            replies = [join.on_row(index) for index in range(len(rows))]
            slots = [None if slot is None else slot.part() for _ in rows]
        for row, row_reply, row_slot in zip(rows, replies, slots, strict=True):
            in_slot = {} if row_slot is None else {"slot": row_slot}  # no arena: none
            service_id = self._requests.submit(
                model,
                row,
                slo_ns=slo_ns,
                deadline_unix_ns=request.deadline_unix_ns,
                on_reply=row_reply,
                **in_slot,
            )
            entry.service_ids.append(service_id)
            if entry.cancelling and not entry.done:
                self._requests.cancel(service_id)  # a row before it was refused

    def _cancel_rows(self, entry: _Pending) -> None:
        """Cancel every row of ``entry`` still in the request path, once (answered ones ignore
        it): the request was cancelled or its connection went, or a row of a client batch was
        refused (then so is the answer: the other rows need not run)."""
        if entry.cancelling:
            return
        entry.cancelling = True
        for service_id in entry.service_ids:
            if entry.done:
                return
            self._requests.cancel(service_id)

    def _screen(self, cls: type[Any], fields: Mapping[str, Any], nbytes: int) -> str | None:
        """The door, from an InferRequest's header: the service says whether to keep it."""
        if cls is not InferRequest or not self._server.accepting_requests:
            return None
        slo_ms = fields.get("slo_ms")
        try:
            slo_ns = None if slo_ms is None else slo_ms_to_ns(slo_ms)
        except ValueError:
            return None  # refused bad_input once decoded
        model, _ = self._route(fields.get("model", ""))
        unread_ns = self._connection.backlog_ns()  # it waited unread at least that long
        deadline_unix_ns = fields.get("deadline_unix_ns")
        why = self._requests.screen(model, slo_ns, deadline_unix_ns, nbytes, 0, unread_ns)
        if why is not None:
            self._refused_here.append(None)  # the request path answers it (`refuse`)
            return why
        return self._lease(nbytes)

    def _lease(self, nbytes: int) -> str | None:
        """Lease the slot this frame's tensors will be read into (`_lend`), or say why not:
        the arena is full or this connection used its share (``overloaded``), or the request
        is larger than any one may be (``bad_input``). A request of fewer tensor bytes than
        ``io_arena_min_bytes`` leases none: its tensors are read as bytes (cheaper for tiny
        rows than a slot's lease, pins and release)."""
        if self._arena is None or not nbytes or nbytes < self._server.limits.io_arena_min_bytes:
            return None
        leased = self._arena.lease(self, nbytes)
        if isinstance(leased, ArenaRefusal):
            outcome = Outcome.BAD_INPUT if leased.too_large else Outcome.OVERLOADED
            self._refused_here.append((outcome, leased.message))
            return leased.message
        self._next_slot = leased
        return None

    def _lend(self, nbytes: int) -> np.ndarray | None:
        """The memory the frame the screen just passed is read into: its slot, if leased."""
        slot, self._next_slot = self._next_slot, None
        if slot is None:
            return None
        self._lent.append(slot)
        return slot.array[:nbytes]

    def _claim_slot(self, request: InferRequest) -> Slot | None:
        """The slot ``request``'s tensors were read into (the oldest lent), if any."""
        if not self._lent or self._arena is None or not request.inputs:
            return None
        slot = self._lent[0]
        offset = self._arena.offset_of(next(iter(request.inputs.values())))
        if offset is None or not slot.offset <= offset < slot.offset + slot.nbytes:
            return None
        return self._lent.popleft()

    def _release(self, entry: _Pending, *, with_outputs: bool) -> None:
        """Release ``entry``'s slot once: after the reply's bytes left when they come from
        it (`Connection.when_written`), else now."""
        slot, entry.slot = entry.slot, None
        if slot is None:
            return
        if with_outputs:
            self._connection.when_written(slot.release)
        else:
            slot.release()

    def _on_screened(self, screened: Screened) -> None:
        """An InferRequest refused from its header: answered ``overloaded`` (or, too large
        for the arena, ``bad_input``), like any other request (its tensors were never kept)."""
        request_id = screened.fields["request_id"]
        here = self._refused_here.popleft() if self._refused_here else None
        if self.busy(request_id):
            why = f"request id {request_id} is already in flight"
            self._send_infer_reply(request_id, ApiCode.DUPLICATE_ID, why)
            return
        if here is not None:  # the arena had no room for it: answered here, like the caps
            self._send_infer_reply(request_id, *here)
            return
        model, version = self._route(screened.fields.get("model", ""))
        entry = _Pending(self._server.now_ns(), version)
        self._pending[request_id] = entry
        self._idle.clear()
        self._server.request_started()
        on_reply = partial(self._on_outcome, request_id, entry)
        self._requests.refuse(model, screened.reason, screened.frame_bytes, on_reply)

    def _route(self, model: str) -> tuple[str, int]:
        return route_to(self._server.routes, model)

    def _refusal(self, request: InferRequest) -> tuple[str, str] | None:
        """(status, sentence) when ``request`` is refused before it reaches the service."""
        if self.busy(request.request_id):
            return ApiCode.DUPLICATE_ID, f"request id {request.request_id} is already in flight"
        if not self._server.accepting_requests:
            return Outcome.SHUTTING_DOWN, "the server is shutting down"
        limits = self._server.limits
        if self.in_flight >= limits.max_outstanding_per_connection:
            limit = limits.max_outstanding_per_connection
            return Outcome.OVERLOADED, f"this connection has {limit} requests in flight (limit)"
        if self._server.outstanding >= limits.max_outstanding_total:
            limit = limits.max_outstanding_total
            return Outcome.OVERLOADED, f"the server has {limit} requests in flight (limit)"
        return _deadline_problem(request, self._server.unix_now_ns())

    def _on_outcome(self, request_id: int, entry: _Pending, outcome: InferOutcome) -> None:
        if entry.done:
            extra = request_extra(outcome.request_id)
            log.error("answered twice; the second answer is dropped", extra=extra)
            return
        # A client batch's outputs are its rows' joined (copied) out of the arena: only one
        # row's are views of the slot, which must then outlive the reply's write.
        in_slot = bool(outcome.outputs) and entry.rows == 1
        timing_ns = {key: int(value) for key, value in outcome.timing_ns.items()}
        timing_ns["total"] = self._server.now_ns() - entry.received_ns
        self._send_infer_reply(
            request_id,
            outcome.outcome.value,
            outcome.message,
            outputs=outcome.outputs,
            timing_ns=timing_ns,
            executor_id=outcome.executor_id or "",
            batch_size=outcome.batch_size,
            model_version=entry.model_version,
        )
        self._finish(request_id, entry)  # the bookkeeping after the write: the reply first
        self._release(entry, with_outputs=in_slot)

    def _finish(self, request_id: int, entry: _Pending) -> None:
        entry.done = True
        if self._pending.get(request_id) is entry:
            del self._pending[request_id]
        for _ in range(entry.rows):
            self._server.request_ended()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self._pending and not self._admin.tasks:
            self._idle.set()

    def _send_infer_reply(self, request_id: int, status: str, message: str, **rest: Any) -> None:
        reply = InferReply(request_id, str(status), message, **rest)
        try:
            self._send(reply)
        except EncodeError as error:
            why = f"the reply could not be encoded: {error}"
            self._send(InferReply(request_id, ApiCode.INTERNAL.value, why))
        finally:
            self._server.count_answer("msgpack", str(status))  # counted after the write

    def _cancel(self, request: CancelInfer) -> None:
        entry = self._pending.get(request.request_id)
        if entry is not None:
            self._cancel_rows(entry)

    # --- ping, sending -------------------------------------------------------------------------

    def _ping(self, ping: Ping) -> None:
        self._send(Pong(ping.seq, ping.sent_ns, self._server.now_ns()))

    def _send(self, message: Message) -> None:
        """Queue ``message`` unless the connection is gone. Raises EncodeError."""
        if self._connection.state is ConnectionState.OPEN:
            self._connection.send(message)


def _deadline_problem(request: InferRequest, unix_now_ns: int) -> tuple[str, str] | None:
    """(``bad_input``, why) for a deadline the daemon cannot carry: both kinds given, an SLO
    that is not a positive number, or one further than `MAX_DEADLINE_DISTANCE_NS` from now."""
    if request.slo_ms is not None and request.deadline_unix_ns is not None:
        return Outcome.BAD_INPUT, "give slo_ms or deadline_unix_ns, not both"
    if request.slo_ms is not None:
        try:
            slo_ms_to_ns(request.slo_ms)
        except ValueError as error:
            return Outcome.BAD_INPUT, str(error)
    if request.deadline_unix_ns is not None:
        distance_ns = request.deadline_unix_ns - unix_now_ns
        if abs(distance_ns) > MAX_DEADLINE_DISTANCE_NS:
            when = "ahead of" if distance_ns > 0 else "behind"
            why = (
                f"deadline_unix_ns {request.deadline_unix_ns} is {abs(distance_ns)} ns {when} "
                f"the daemon's clock, over the limit of {MAX_DEADLINE_DISTANCE_NS} ns (146 years)"
            )
            return Outcome.BAD_INPUT, why
    return None


def slo_ms_to_ns(slo_ms: float) -> int:
    """``slo_ms`` in whole nanoseconds; ValueError unless it is finite, positive and at most
    `MAX_SLO_MS`."""
    if not math.isfinite(slo_ms) or slo_ms <= 0:
        raise ValueError(f"slo_ms must be a positive number of milliseconds, got {slo_ms!r}")
    if slo_ms > MAX_SLO_MS:
        raise ValueError(
            f"slo_ms {slo_ms:g} is over the limit of {MAX_SLO_MS:.0f} ms (146 years): "
            "deadlines must fit the wire's 64-bit integers"
        )
    return max(1, round(slo_ms * NS_PER_MS))
