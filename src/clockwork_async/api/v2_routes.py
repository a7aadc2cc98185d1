"""The Open Inference Protocol's HTTP endpoints: a parsed request in, a response out (or a
coroutine making one, for an infer). No sockets: `api.v2_http` reads requests and writes what
this returns.

Invariants: every answer is JSON (an infer's may be followed by binary outputs), an error one
being ``{"error": "code: sentence"}`` with the status of `v2_door.HTTP_STATUS` and a
``clockwork-outcome`` header naming the code; health answers need no token, a model's load
and unload the ``admin`` scope, everything else the ``infer`` scope when tokens are
configured; an infer echoes the request's ``id`` in its body and its ``traceparent`` header in
its headers, and both go into the log line of its answer (a request refused before its body
is parsed has no ``id``: it is never read); an infer's SLO is the earliest of its
``clockwork-slo-ms`` header and its body's parameters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import unquote

import httptools

from clockwork_async.api.auth import Scope
from clockwork_async.api.v2_arena import BodyInSlot
from clockwork_async.api.v2_door import Answer, Door
from clockwork_async.api.v2_slo import earliest, header_slo_ns, slo_ns_of
from clockwork_async.api.v2_status import (
    BAD_REQUEST,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    NOT_READY,
    RETRY_AFTER_S,
    V2Error,
)
from clockwork_async.api.v2_tensors import (
    EncodedResponse,
    RequestHeader,
    TensorError,
    build_inputs,
    encode_response,
    error_body,
    parse_request,
    select_outputs,
)
from clockwork_async.core.outcomes import Outcome

log = logging.getLogger("clockwork_async.api.v2")

HEADER_LENGTH = "inference-header-content-length"
SLO_HEADER = "clockwork-slo-ms"  # an SLO known before the body is parsed (docs/protocol-v2.md)


@dataclass(slots=True)
class HttpRequest:
    method: str = ""
    url: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased
    body: bytearray = field(default_factory=bytearray)
    keep_alive: bool = True
    head_bytes: int = 0
    owner: object = None  # its connection: what its IO arena slots count against
    in_slot: BodyInSlot | None = None  # the body, when read into an IO arena slot instead
    turn_ns: int | None = None  # when its answer was started (`time.monotonic_ns`)

    def waited_ns(self) -> int:
        """How long since its answer was started (its task created, its connection's earlier
        requests answered): its wait for the loop (0 when it was not stamped)."""
        return 0 if self.turn_ns is None else max(0, time.monotonic_ns() - self.turn_ns)

    def body_view(self) -> memoryview:
        """The body, wherever it was read."""
        return self.in_slot.view() if self.in_slot is not None else memoryview(self.body)

    def release(self) -> None:
        """Give back the arena slot its body was read into, unless the door took it."""
        if self.in_slot is not None:
            self.in_slot.release()


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: EncodedResponse
    headers: tuple[tuple[str, str], ...] = ()


def json_response(status: int, document: Any, *headers: tuple[str, str]) -> HttpResponse:
    data = json.dumps(document, separators=(",", ":")).encode()
    return HttpResponse(status, EncodedResponse(data), headers)


def error_response(
    error: V2Error, *headers: tuple[str, str], status: int | None = None
) -> HttpResponse:
    """``error`` as the protocol's error object, with its HTTP status (or ``status``)."""
    more = [*headers, ("clockwork-outcome", error.code)]
    if error.code == Outcome.OVERLOADED:
        more.append(("retry-after", str(RETRY_AFTER_S)))
    body = EncodedResponse(error_body(error.text))
    return HttpResponse(status or error.http_status, body, tuple(more))


def route(door: Door, request: HttpRequest) -> HttpResponse | InferCall | Any:
    """The answer to ``request``: a response now, an `InferCall` (an infer: started with a
    callback or awaited), or a coroutine that makes one (a model's load or unload)."""
    try:
        path = httptools.parse_url(bytes(request.url)).path.decode("utf-8")
    except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
        return error_response(V2Error(BAD_REQUEST, "malformed URL"))
    parts = [unquote(part) for part in path.rstrip("/").split("/")[1:]]
    try:
        return _dispatch(door, request, parts)
    except V2Error as error:
        return error_response(error)


def _dispatch(door: Door, request: HttpRequest, parts: list[str]) -> HttpResponse | Any:
    if parts[:1] != ["v2"]:
        raise V2Error(NOT_FOUND, "no such endpoint (the protocol's are under /v2)")
    rest = parts[1:]
    if rest in ([], ["health", "live"], ["health", "ready"]):
        _method(request, "GET")
        if not rest:
            door.authorize(request.headers.get("authorization"))
            return json_response(200, door.server_metadata())
        ok = rest[1] == "live" or door.ready()
        return json_response(200 if ok else 503, {"live": True} if rest[1] == "live" else {})
    if rest[:1] == ["repository"]:
        return _repository(door, request, rest[1:])
    if len(rest) < 2 or rest[0] != "models":
        raise V2Error(NOT_FOUND, f"no such endpoint: /v2/{'/'.join(rest)}")
    model, version, action = _model_path(rest[1:])
    door.authorize(request.headers.get("authorization"))
    if action == "":
        _method(request, "GET")
        return json_response(200, door.model_metadata(model, version))
    if action == "ready":
        _method(request, "GET")
        if door.model_ready(model, version):
            return json_response(200, {})
        raise V2Error(NOT_READY, f"model {model!r} is not ready")
    _method(request, "POST")
    return InferCall(door, request, model, version)


def _repository(door: Door, request: HttpRequest, rest: list[str]) -> HttpResponse | Any:
    """The model repository extension: its index (``infer`` scope), and a model's load and
    unload (``admin`` scope; a coroutine, answered once the daemon has done it)."""
    if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
        door.authorize(request.headers.get("authorization"), Scope.ADMIN)
        _method(request, "POST")
        return _load_or_unload(door, rest[1], rest[2], _json_object(request, rest[2]))
    door.authorize(request.headers.get("authorization"))
    _method(request, "POST")
    if rest != ["index"]:
        raise V2Error(NOT_FOUND, f"no such endpoint: /v2/repository/{'/'.join(rest)}")
    ready_only = _json_object(request, "index").get("ready") is True
    return json_response(200, door.repository_index(ready_only))


def _json_object(request: HttpRequest, what: str) -> dict[str, Any]:
    """The request's body as a JSON object (an empty body is ``{}``). Raises V2Error."""
    try:
        document = json.loads(bytes(request.body_view()) or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise V2Error(BAD_REQUEST, f"the {what} request is not valid JSON") from None
    if not isinstance(document, dict):
        raise V2Error(BAD_REQUEST, f"the {what} request must be a JSON object")
    return document


async def _load_or_unload(
    door: Door, model: str, action: str, document: dict[str, Any]
) -> HttpResponse:
    """Load or unload ``model``: 200 ``{}`` once done. A model that is not in the folder (or
    not served) is 400, as Triton answers a failed load; ``config`` and file parameters (a
    load from other files) are refused."""
    parameters = document.get("parameters") or {}
    if not isinstance(parameters, dict):
        return error_response(V2Error(BAD_REQUEST, "parameters must be a JSON object"))
    others = sorted(name for name in parameters if name != "unload_dependents")
    if others:
        why = f"{action} takes the model's own folder; parameters {others} are not supported"
        return error_response(V2Error(BAD_REQUEST, why))
    try:
        await (door.load(model) if action == "load" else door.unload(model))
    except V2Error as error:
        log.info("repository %s of %r refused: %s", action, model, error.text)
        status = 400 if error.code == Outcome.UNKNOWN_MODEL else error.http_status
        return error_response(error, status=status)
    return json_response(200, {})


def _model_path(rest: list[str]) -> tuple[str, str | None, str]:
    """(model, version or None, "" | "ready" | "infer") from the path after /v2/models."""
    model, tail = rest[0], rest[1:]
    version = None
    if tail[:1] == ["versions"] and len(tail) >= 2:
        version, tail = tail[1], tail[2:]
    if tail in ([], ["ready"], ["infer"]):
        return model, version, tail[0] if tail else ""
    raise V2Error(NOT_FOUND, f"no such endpoint under model {model!r}")


def _method(request: HttpRequest, allowed: str) -> None:
    if request.method != allowed:
        raise V2Error(METHOD_NOT_ALLOWED, f"{request.method} is not allowed here ({allowed} is)")


class InferCall:
    """One infer request, JSON or with the binary tensor data extension, answered through a
    callback (`start`, as `api.v2_http` does: no task, no loop rounds between its outcome
    and its answer) or awaited (a coroutine's way). Every path ends in one answer: an error
    one for a refusal or a bad request, a 500 ``internal`` one for a bug."""

    __slots__ = (
        "_cancel",
        "_door",
        "_echo",
        "_ended",
        "_model",
        "_reply",
        "_request",
        "_request_id",
        "_trace",
        "_version",
    )

    def __init__(self, door: Door, request: HttpRequest, model: str, version: str | None) -> None:
        self._door, self._request = door, request
        self._model, self._version = model, version
        self._trace = request.headers.get("traceparent")
        self._echo = (("traceparent", self._trace),) if self._trace else ()
        self._request_id = ""  # known once its JSON is parsed
        self._reply: Callable[[HttpResponse], None] = _ignore
        self._cancel: Callable[[], None] = _nothing
        self._ended = False  # answered or cancelled: nothing more is delivered

    def start(self, reply: Callable[[HttpResponse], None]) -> None:
        """Take the request; ``reply`` gets its answer once (possibly before this returns)."""
        self._reply = reply
        self._step(self._screen)

    def cancel(self) -> None:
        """Its client went away: cancel it at the door; nothing is delivered."""
        self._ended = True
        self._cancel()

    def __await__(self) -> Generator[Any, None, HttpResponse]:
        return self._awaited().__await__()

    async def _awaited(self) -> HttpResponse:
        answered: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        self.start(answered.set_result)
        try:
            return await answered
        except asyncio.CancelledError:
            self.cancel()
            raise

    def _screen(self) -> HttpResponse | None:
        """JSON tensors: screened before the body is parsed; then on to `_submit`."""
        request = self._request
        nbytes = request.body_view().nbytes
        json_bytes = _header_bytes(request, nbytes)
        head_slo_ns = header_slo_ns(request.headers.get(SLO_HEADER), SLO_HEADER)
        if json_bytes == nbytes:
            waited_ns = request.waited_ns()
            args = (self._model, self._version, head_slo_ns, nbytes, self._refused, waited_ns)
            if self._door.refuse_unread(*args):
                return None  # `_refused` answers
        self._submit(json_bytes, head_slo_ns)
        return None  # its outcome's callback answers

    def _refused(self, answer: Answer) -> None:
        outcome = answer.outcome
        self._step(_raise, V2Error(outcome.outcome.value, outcome.message))

    def _submit(self, json_bytes: int, head_slo_ns: int | None) -> None:
        request = self._request
        body = request.body_view()
        unread = json_bytes == body.nbytes
        header = parse_request(body[:json_bytes])
        self._request_id = header.id
        slo_ns = earliest(head_slo_ns, slo_ns_of(header.parameters))
        self._cancel = self._door.start(
            self._model,
            self._version,
            slo_ns,
            body.nbytes,
            lambda: build_inputs(header, body[json_bytes:]),
            partial(self._step, self._answered, header),
            request.owner,
            request.in_slot.take() if request.in_slot is not None else None,
            request.waited_ns() if unread else 0,  # and again with the SLO its body gives
        )

    def _answered(self, header: RequestHeader, answer: Answer) -> HttpResponse:
        outcome = answer.outcome
        if outcome.outcome not in (Outcome.OK, Outcome.LATE):
            raise V2Error(outcome.outcome.value, outcome.message)
        model = self._model
        document: dict[str, Any] = {"model_name": model, "model_version": str(answer.version)}
        if self._request_id:
            document["id"] = self._request_id
        if outcome.outcome is Outcome.LATE:
            document["parameters"] = {"outcome": Outcome.LATE.value}
        encoded = encode_response(document, select_outputs(outcome.outputs, header))
        status = outcome.outcome.value
        self._door.answered(model, self._request_id, self._trace, status, "")
        return HttpResponse(200, encoded, (*self._echo, ("clockwork-outcome", status)))

    def _step(self, step: Callable[..., HttpResponse | None], *args: Any) -> None:
        """Run one step; deliver the answer it makes, or the error it raises as one."""
        if self._ended:
            return
        try:
            response = step(*args)
        except (TensorError, V2Error) as error:
            failure = V2Error(BAD_REQUEST, str(error)) if isinstance(error, TensorError) else error
            door = self._door
            door.answered(self._model, self._request_id, self._trace, failure.code, failure.message)
            response = error_response(failure, *self._echo)
        except Exception as error:  # a bug: answered all the same, once
            log.error("HTTP infer failed", exc_info=error)
            response = error_response(V2Error("internal", f"the daemon failed: {error!r}"))
        if response is not None and not self._ended:
            self._ended = True
            self._reply(response)


def _raise(error: V2Error) -> None:
    raise error


def _ignore(response: HttpResponse) -> None:
    pass


def _nothing() -> None:
    pass


def _header_bytes(request: HttpRequest, body_bytes: int) -> int:
    """Where the JSON ends: the Inference-Header-Content-Length, else the whole body."""
    if request.headers.get("content-encoding", "identity").lower() != "identity":
        raise TensorError("compressed request bodies are not supported")
    text = request.headers.get(HEADER_LENGTH)
    if text is None:
        return body_bytes
    if not text.strip().isdigit() or int(text) > body_bytes:
        raise TensorError(f"{HEADER_LENGTH} {text!r} must be an integer <= the body's length")
    return int(text)
