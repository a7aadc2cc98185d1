"""What the Open Inference Protocol front ends (HTTP in `api.v2_http`, gRPC in `api.v2_grpc`)
share: the door every request passes, the status vocabulary, SLO parameters, metadata.
One idea: a standard-protocol request as the daemon's requests, through one door.

The door is the client API server's (`api.server.ApiServer`, the `DoorHost`): the same
``accepting_requests`` (so a drain answers ``shutting_down`` on every front end), the same
``outstanding`` count and ``max_outstanding_total`` cap (so the server's drain waits for HTTP
and gRPC requests too), the same routes (name -> served version) and tokens. A request is
screened by the dispatcher (`Requests.screen`) from its header before its tensors are built,
and refused there (`Requests.refuse`) or submitted (`Requests.submit`) exactly as a msgpack
request is; an HTTP request with JSON tensors, whose parse is most of its cost, is screened
once before its body is parsed (`Door.refused_unread`, with the SLO its head gives, else only
against the loop's cap) and again, as every request, with the SLO its body gives; a client
batch of N rows is submitted as N requests and answered as one (`api.rows`, as the msgpack
session does). Where the daemon has an IO arena, each row's tensors are copied once into a slot
of their own (`api.v2_arena`), as the msgpack API reads its tensors into one, so local
executors read them by reference.

Invariants: every row the door accepts is counted in the host's ``outstanding`` from submit
until its one outcome; a row's arena slot is released exactly once: with its outcome (after
its outputs are copied out), or before submit when the request is refused; a caller that
goes away (its task cancelled) cancels its request once; an HTTP request's wait for the loop
after its answer started (``waited_ns``) reaches the screen before a JSON body's parse (the
loop's measured delay for it, where a refusal saves the parse) and nothing else; every
refusal is a `V2Error`
whose ``code`` is an outcome or `ApiCode` value (or one of the front ends' own codes below),
mapped to one HTTP status and one gRPC code by `HTTP_STATUS` and `GRPC_CODE`; the earliest
of the SLOs a request gives wins.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from clockwork_async.api.auth import Scope, TokenAuth
from clockwork_async.api.rows import RowsRefused, join_outcomes, plan_rows, status_in
from clockwork_async.api.service import InferOutcome, RequestHost, ServerCaps, ServiceError
from clockwork_async.api.session import MAX_DEADLINE_DISTANCE_NS, MAX_SLO_MS, route_to, slo_ms_to_ns
from clockwork_async.api.v2_arena import Placed, detach, into_slots
from clockwork_async.api.v2_status import UNAUTHORIZED, V2Error
from clockwork_async.api.v2_tensors import DATATYPE_OF_DTYPE, TensorError
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.wire.messages import ApiCode, ModelStatus, TensorSpec

log = logging.getLogger("clockwork_async.api.v2")

NS_PER_US = 1_000
PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ("binary_tensor_data", "parameters")
READY_STATES = frozenset({"ready", "loaded"})
# The screen's SLO for a JSON request whose head gives none (`Door.refused_unread`): the
# longest a body may ask for, so that only the loop's cap (`max_loop_delay_ns`) refuses it.
UNREAD_SLO_NS = MAX_DEADLINE_DISTANCE_NS
# The daemon's model states (`list_models`) as the repository index's; any other (failed,
# cancelled, unloaded) is UNAVAILABLE.
INDEX_STATE = {
    "ready": "READY",
    "loaded": "READY",
    "registering": "LOADING",
    "profiling": "LOADING",
}


def _bytes_only(
    rows: Sequence[Mapping[str, np.ndarray]], body: Slot | None, caps: ServerCaps
) -> bool:
    """Whether rows stay as they are, out of the arena: fewer input bytes than
    ``io_arena_min_bytes`` (for tiny rows a slot costs more than it saves), and not already
    in a slot (a body read into the arena stays there: its arrays are views of it)."""
    if body is not None:
        return False
    return sum(array.nbytes for row in rows for array in row.values()) < caps.io_arena_min_bytes


class DoorHost(RequestHost, Protocol):
    """What the door needs of the client API server besides what every front end does."""

    @property
    def auth(self) -> TokenAuth: ...

    @property
    def io_arena(self) -> IoArena | None: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """An infer's one outcome, and the version of the model it was routed to."""

    outcome: InferOutcome
    version: int


@dataclass(slots=True)
class _Ticket:
    service_id: int | None = None
    done: bool = False


class Door:
    """The Open Inference Protocol's way into the daemon, for one front end (``protocol``:
    ``http`` or ``grpc``, the metrics' label)."""

    def __init__(self, host: DoorHost, protocol: str, *, server_version: str) -> None:
        self.host = host
        self.protocol = protocol
        self.server_version = server_version

    # --- who may ----------------------------------------------------------------------------

    def authorize(self, authorization: str | None, scope: Scope = Scope.INFER) -> None:
        """Check an ``Authorization: Bearer TOKEN`` value for ``scope`` (``admin``: loading
        and unloading models, as the msgpack API's admin verbs). Raises V2Error
        (``unauthorized``: no token or a wrong one; ``forbidden``: a token without the scope)."""
        if not self.host.auth.enabled:
            return
        token = ""
        if authorization is not None:
            scheme, _, value = authorization.strip().partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else ""
        scopes = self.host.auth.scopes(token)
        if scopes is None:
            raise V2Error(UNAUTHORIZED, f"a bearer token with the {scope} scope is required")
        if scope not in scopes:
            raise V2Error(ApiCode.FORBIDDEN, f"this needs a token with the {scope} scope")

    # --- infer --------------------------------------------------------------------------------

    def route(self, model: str, version: str | None) -> tuple[str, int]:
        """Where requests for ``model`` (at ``version``, if given) go: the served name and its
        version. Raises V2Error (``unknown_model``) for a version not served."""
        if version is None or version == "":
            return route_to(self.host.routes, model)
        route = self.host.routes.get(model)
        if route is None or version != str(route.version):
            serving = f"; version {route.version} is" if route is not None else ""
            raise V2Error(
                Outcome.UNKNOWN_MODEL, f"model {model!r} version {version} is not served{serving}"
            )
        return route.target, route.version

    async def infer(
        self,
        model: str,
        version: str | None,
        slo_ns: int | None,
        nbytes: int,
        build: Callable[[], Mapping[str, np.ndarray]],
        owner: object = None,
        body: Slot | None = None,
        waited_ns: int = 0,
    ) -> Answer:
        """Take one request: the caps, the dispatcher's screen (from the header alone), then
        ``build()`` its tensors, copy each row into an IO arena slot of ``owner``'s (its
        connection: the share is per connection; `api.v2_arena`) where the daemon has an
        arena, and submit them; returns its outcome. Raises V2Error for a refusal before the
        request path (shutting down, over the cap, a bad version or tensors, no room in the
        arena); cancelling the awaiting task cancels the request. ``body``: the arena slot
        the request's body was read into (HTTP), taken over (`v2_arena.into_slots`);
        ``waited_ns``: its wait for the loop, for the screen (`refused_unread`)."""
        target, served_version, reason, placed = self._placed(
            model, version, slo_ns, nbytes, build, owner, body, waited_ns
        )
        tickets = [_Ticket() for _ in placed]
        futures: list[asyncio.Future[InferOutcome]] = []
        try:
            for (row, slot, release), ticket in zip(placed, tickets, strict=True):
                started = self._start(target, row, slo_ns, reason, nbytes, ticket, slot, release)
                futures.append(started)
        except BaseException:  # a submit failed (a bug): the rows not started give theirs back
            for _, _, release in placed[len(futures) + 1 :]:
                release()
            raise
        try:
            if len(futures) == 1:  # one row (most requests): no gathering future around it
                return Answer(join_outcomes([await futures[0]]), served_version)
            return Answer(join_outcomes(await asyncio.gather(*futures)), served_version)
        except asyncio.CancelledError:
            for ticket in tickets:
                if ticket.service_id is not None and not ticket.done:
                    self.host.requests.cancel(ticket.service_id)
            raise

    def _placed(
        self,
        model: str,
        version: str | None,
        slo_ns: int | None,
        nbytes: int,
        build: Callable[[], Mapping[str, np.ndarray]],
        owner: object,
        body: Slot | None,
        waited_ns: int = 0,
    ) -> tuple[str, int, str | None, list[Placed]]:
        """The request up to its submit: where it goes, the screen's refusal (if any), and its
        rows, each with its arena slot. ``body`` ends kept as a row's slot or released,
        whatever happens. Raises V2Error."""
        handed = False
        try:
            host = self.host
            screened = self._screened(model, version, slo_ns, nbytes, waited_ns)
            target, served_version, reason = screened
            inputs: Mapping[str, np.ndarray] = {}
            if reason is None:
                try:
                    inputs = build()
                except TensorError as error:
                    raise V2Error(Outcome.BAD_INPUT, str(error)) from None
            rows = self._rows(model, inputs)
            arena = host.io_arena
            if arena is None or reason is not None or _bytes_only(rows, body, host.limits):
                return target, served_version, reason, [(row, None, _nothing) for row in rows]
            handed = True
            owner = owner if owner is not None else self
            return target, served_version, reason, into_slots(arena, owner, rows, body)
        finally:
            if body is not None and not handed:
                body.release()

    def _screened(
        self, model: str, version: str | None, slo_ns: int | None, nbytes: int, waited_ns: int = 0
    ) -> tuple[str, int, str | None]:
        """Where a request goes (served name, version) and the dispatcher's screen's refusal
        (`Requests.screen`, from what is known before its tensors, and how long it waited for
        the loop after its answer started), or None. Raises V2Error (shutting down, over the cap on
        requests in flight, a version not served)."""
        host = self.host
        if not host.accepting_requests:
            raise V2Error(Outcome.SHUTTING_DOWN, "the server is shutting down")
        if host.outstanding >= host.limits.max_outstanding_total:
            limit = host.limits.max_outstanding_total
            raise V2Error(Outcome.OVERLOADED, f"the server has {limit} requests in flight (limit)")
        target, served_version = self.route(model, version)
        reason = host.requests.screen(target, slo_ns, None, nbytes, waited_ns)
        return target, served_version, reason

    async def refused_unread(
        self, model: str, version: str | None, slo_ns: int | None, nbytes: int, waited_ns: int = 0
    ) -> Answer | None:
        """Screen a request whose body is not parsed yet (HTTP with JSON tensors: parsing is
        most of its cost) from what its head says: ``slo_ns``, the SLO it gives outside its
        body (None: not known before the parse, so the longest a body may ask for, and only
        the loop's cap refuses it: its body may ask for longer than its model's default),
        its body's ``nbytes`` and how long it waited
        for the loop after its answer started (``waited_ns``, `Requests.screen`: a wait the
        work booked ahead does not show, as JSON bodies parsed before their door are not
        booked). Returns the answer of a request the screen refuses ``overloaded``, refused
        as `infer` refuses (counted, booked as a refusal, answered through the request book);
        None when it may go on to be parsed and to `infer`, which screens it again with the
        SLO its body gives. Raises V2Error as `infer` does before its tensors are built."""
        slo_ns = UNREAD_SLO_NS if slo_ns is None else slo_ns
        target, served_version, reason = self._screened(model, version, slo_ns, nbytes, waited_ns)
        if reason is None:
            return None
        refused = self._start(target, {}, slo_ns, reason, nbytes, _Ticket(), None, _nothing)
        return Answer(join_outcomes([await refused]), served_version)

    def _rows(self, model: str, inputs: Mapping[str, np.ndarray]) -> list[Mapping[str, np.ndarray]]:
        """A client batch as rows (`api.rows.plan_rows`: at most the model's largest batch,
        within the cap on requests in flight). Raises V2Error."""
        host = self.host
        room = host.limits.max_outstanding_total - host.outstanding
        try:
            return plan_rows(inputs, lambda: status_in(host.service.list_models(), model), room)
        except RowsRefused as refused:
            raise V2Error(refused.outcome, refused.message) from None

    def _start(
        self,
        target: str,
        inputs: Mapping[str, np.ndarray],
        slo_ns: int | None,
        reason: str | None,
        nbytes: int,
        ticket: _Ticket,
        slot: Slot | None,
        release: Callable[[], None],
    ) -> asyncio.Future[InferOutcome]:
        """Submit one row (or refuse it with the screen's ``reason``); its outcome's future.
        ``slot``: the arena slot (or part) the row's inputs are in; ``release`` gives it back
        (`v2_arena.Placed`), called once with its outcome (its outputs copied out of the slot
        first), whoever awaits it or not."""
        host = self.host
        future: asyncio.Future[InferOutcome] = asyncio.get_running_loop().create_future()
        host.request_started()

        def on_reply(outcome: InferOutcome) -> None:
            if ticket.done:
                return
            ticket.done = True
            host.request_ended()
            if slot is not None:
                outcome = detach(outcome, slot)
            release()
            if not future.done():
                future.set_result(outcome)

        if reason is not None:
            host.requests.refuse(target, reason, nbytes, on_reply)
            return future
        in_slot = {} if slot is None else {"slot": slot}
        try:
            service_id = host.requests.submit(
                target, inputs, slo_ns=slo_ns, deadline_unix_ns=None, on_reply=on_reply, **in_slot
            )
        except BaseException:
            if not ticket.done:
                release()
            raise
        ticket.service_id = None if ticket.done else service_id
        return future

    def count(self, status: str) -> None:
        """One infer answered with ``status`` (an outcome or a front end's code)."""
        self.host.count_answer(self.protocol, status)

    def answered(
        self, model: str, request_id: str, trace: str | None, status: str, message: str
    ) -> None:
        """One infer answered: counted (`count`), and logged at debug with its request id and
        trace parent."""
        self.count(status)
        if log.isEnabledFor(logging.DEBUG):
            extra = {"request_id": request_id, "traceparent": trace or ""}
            extra["protocol"] = self.protocol
            log.debug("infer %r answered %s %s", model, status, message, extra=extra)

    # --- health and metadata -----------------------------------------------------------------

    def ready(self) -> bool:
        return self.host.accepting_requests and self.host.service.health().ready

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "clockwork-async", "version": self.server_version, "extensions": EXTENSIONS}

    def model_status(self, model: str, version: str | None) -> ModelStatus:
        """The served model ``model`` (at ``version``, if given). Raises V2Error."""
        self.route(model, version)
        for status in self.host.service.list_models():
            if status.name == model:
                return status
        raise V2Error(Outcome.UNKNOWN_MODEL, f"unknown model {model!r}")

    def model_ready(self, model: str, version: str | None) -> bool:
        try:
            status = self.model_status(model, version)
        except V2Error:
            return False
        return self.host.accepting_requests and status.state in READY_STATES

    def repository_index(self, ready_only: bool) -> list[dict[str, str]]:
        """The repository extension's index: every model the daemon knows, its version and
        state: ``READY`` (served), ``LOADING`` (a registration in progress) or ``UNAVAILABLE``
        (a registration that failed or was cancelled, or a model unloaded), with the reason."""
        index = []
        for status in self.host.service.list_models():
            state = INDEX_STATE.get(status.state, "UNAVAILABLE")
            if state == "READY" or not ready_only:
                entry = {"name": status.name, "version": str(status.version or 1)}
                index.append({**entry, "state": state, "reason": status.reason})
        return index

    async def load(self, model: str) -> None:
        """The repository extension's load: serve ``model`` from the daemon's models folder;
        returns once it is served. Raises V2Error (``unknown_model``: not in the folder; the
        registration's failure with its code and reason)."""
        if not self.host.accepting_requests:
            raise V2Error(Outcome.SHUTTING_DOWN, "the server is shutting down")
        try:  # shielded: a client that goes away does not stop the load half done
            await asyncio.shield(self.host.service.load_model(model))
        except ServiceError as error:
            raise V2Error(error.code, error.message) from None

    async def unload(self, model: str) -> None:
        """The repository extension's unload: stop serving ``model``, keep its files (requests
        routed to it finish first). Raises V2Error (``unknown_model``)."""
        try:  # shielded: a client that goes away does not stop the unload half done
            await asyncio.shield(self.host.service.unload_model(model))
        except ServiceError as error:
            raise V2Error(error.code, error.message) from None

    def model_metadata(self, model: str, version: str | None) -> dict[str, Any]:
        """The protocol's model metadata object. Raises V2Error."""
        status = self.model_status(model, version)
        return {
            "name": status.name,
            "versions": [str(status.version or 1)],
            "platform": PLATFORM,
            "inputs": [tensor_metadata(spec) for spec in status.inputs],
            "outputs": [tensor_metadata(spec) for spec in status.outputs],
        }


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "datatype": DATATYPE_OF_DTYPE.get(spec.dtype, spec.dtype.upper()),
        "shape": list(spec.shape),
    }


def slo_ns_of(parameters: Mapping[str, Any], deadline_left_s: float | None = None) -> int | None:
    """A request's SLO from its parameters (Triton's ``timeout`` in microseconds, ``slo_ms``)
    and a transport deadline (gRPC's time remaining), the earliest of those given; None when
    none is (the model's default SLO). Checks ``priority`` (accepted, not used: the deadline
    orders requests). Raises V2Error (``bad_input``)."""
    candidates = []
    timeout_us = parameters.get("timeout")
    if timeout_us is not None:
        if not _is_int(timeout_us) or timeout_us <= 0:
            raise V2Error(
                Outcome.BAD_INPUT, f"timeout must be microseconds > 0, not {timeout_us!r}"
            )
        candidates.append(_slo_ns(timeout_us / 1000.0, "timeout"))
    slo_ms = parameters.get("slo_ms")
    if slo_ms is not None:
        if not isinstance(slo_ms, int | float) or isinstance(slo_ms, bool):
            raise V2Error(Outcome.BAD_INPUT, f"slo_ms must be a number, not {slo_ms!r}")
        candidates.append(_slo_ns(float(slo_ms), "slo_ms"))
    if deadline_left_s is not None:
        if deadline_left_s <= 0:
            raise V2Error(Outcome.INFEASIBLE, "the request's deadline has passed")
        candidates.append(_slo_ns(deadline_left_s * 1000.0, "the deadline"))
    priority = parameters.get("priority")
    if priority is not None and (not _is_int(priority) or priority < 0):
        raise V2Error(Outcome.BAD_INPUT, f"priority must be an integer >= 0, not {priority!r}")
    return min(candidates) if candidates else None


def header_slo_ns(value: str | None, name: str) -> int | None:
    """The SLO of an HTTP header ``name`` (milliseconds, a number > 0), or None when it is
    absent. Raises V2Error (``bad_input``)."""
    if value is None:
        return None
    try:
        slo_ms = float(value)
    except ValueError:
        raise V2Error(Outcome.BAD_INPUT, f"{name} must be milliseconds, not {value!r}") from None
    return _slo_ns(slo_ms, name)


def earliest(*slos_ns: int | None) -> int | None:
    """The earliest of the SLOs given (None: not given), or None when none is."""
    given = [slo_ns for slo_ns in slos_ns if slo_ns is not None]
    return min(given) if given else None


def _slo_ns(slo_ms: float, what: str) -> int:
    try:
        return slo_ms_to_ns(min(slo_ms, MAX_SLO_MS) if math.isfinite(slo_ms) else slo_ms)
    except ValueError as error:
        raise V2Error(Outcome.BAD_INPUT, f"{what}: {error}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nothing() -> None:
    pass
