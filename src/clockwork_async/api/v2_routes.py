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

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httptools

from clockwork_async.api.auth import Scope
from clockwork_async.api.v2_arena import BodyInSlot
from clockwork_async.api.v2_door import Door, earliest, header_slo_ns, slo_ns_of
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


def route(door: Door, request: HttpRequest) -> HttpResponse | Any:
    """The answer to ``request``: a response now, or a coroutine that makes one (infer)."""
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
    return infer(door, request, model, version)


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


async def infer(door: Door, request: HttpRequest, model: str, version: str | None) -> HttpResponse:
    """One infer request, JSON or with the binary tensor data extension."""
    trace = request.headers.get("traceparent")
    echo = (("traceparent", trace),) if trace else ()
    request_id = ""
    try:
        body = request.body_view()
        json_bytes = _header_bytes(request, body.nbytes)
        head_slo_ns = header_slo_ns(request.headers.get(SLO_HEADER), SLO_HEADER)
        unread = json_bytes == body.nbytes  # JSON tensors: screened before the body is parsed
        if unread:
            waited_ns = request.waited_ns()
            refused = await door.refused_unread(model, version, head_slo_ns, body.nbytes, waited_ns)
            if refused is not None:
                raise V2Error(refused.outcome.outcome.value, refused.outcome.message)
        header = parse_request(body[:json_bytes])
        request_id = header.id
        slo_ns = earliest(head_slo_ns, slo_ns_of(header.parameters))
        answer = await door.infer(
            model,
            version,
            slo_ns,
            body.nbytes,
            lambda: build_inputs(header, body[json_bytes:]),
            request.owner,
            request.in_slot.take() if request.in_slot is not None else None,
            request.waited_ns() if unread else 0,  # and again with the SLO its body gives
        )
        outcome = answer.outcome
        if outcome.outcome not in (Outcome.OK, Outcome.LATE):
            raise V2Error(outcome.outcome.value, outcome.message)
        document: dict[str, Any] = {"model_name": model, "model_version": str(answer.version)}
        if request_id:
            document["id"] = request_id
        if outcome.outcome is Outcome.LATE:
            document["parameters"] = {"outcome": Outcome.LATE.value}
        encoded = encode_response(document, select_outputs(outcome.outputs, header))
    except TensorError as error:
        failure = V2Error(BAD_REQUEST, str(error))
        door.answered(model, request_id, trace, failure.code, failure.message)
        return error_response(failure, *echo)
    except V2Error as error:
        door.answered(model, request_id, trace, error.code, error.message)
        return error_response(error, *echo)
    door.answered(model, request_id, trace, outcome.outcome.value, "")
    return HttpResponse(200, encoded, (*echo, ("clockwork-outcome", outcome.outcome.value)))


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
