"""The Open Inference Protocol front ends' status vocabulary: each refusal's code (an outcome
of `core.outcomes`, an `ApiCode`, or one of the front ends' own below), its HTTP status and its
gRPC code, and `V2Error`, which carries one. Pure: no I/O, no grpc import (codes are named).

Invariants: every code a front end raises has an entry in both tables (docs/protocol-v2.md,
"Status codes", lists them with why); the message a client sees is ``"code: sentence"``.
"""

from __future__ import annotations

from collections.abc import Mapping

from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.messages import ApiCode

RETRY_AFTER_S = 1  # what an ``overloaded`` answer asks a client to wait

# The front ends' own codes, beside the outcomes and ApiCode values.
BAD_REQUEST = ApiCode.BAD_REQUEST.value  # a body or message that breaks the protocol
NOT_FOUND = "not_found"  # no such endpoint
METHOD_NOT_ALLOWED = "method_not_allowed"
UNAUTHORIZED = "unauthorized"  # a missing or wrong bearer token
TOO_LARGE = "too_large"  # a body over the front end's limit
REQUEST_TIMEOUT = "request_timeout"  # a request not fully read in time
NOT_READY = "not_ready"  # health and model readiness

# code -> HTTP status (docs/protocol-v2.md, "Status codes").
HTTP_STATUS: Mapping[str, int] = {
    Outcome.OK: 200,
    Outcome.LATE: 200,  # outputs, with the outcome in the response's parameters
    Outcome.BAD_INPUT: 400,
    BAD_REQUEST: 400,
    UNAUTHORIZED: 401,
    ApiCode.FORBIDDEN: 403,
    ApiCode.BAD_MODEL: 400,  # a load whose model cannot be registered
    ApiCode.MODEL_EXISTS: 409,  # a load or unload of an instance name (NAME-0) of a model
    Outcome.UNKNOWN_MODEL: 404,
    NOT_FOUND: 404,
    METHOD_NOT_ALLOWED: 405,
    REQUEST_TIMEOUT: 408,
    TOO_LARGE: 413,
    Outcome.OVERLOADED: 429,
    Outcome.CANCELLED: 499,
    ApiCode.INTERNAL: 500,
    Outcome.SHUTTING_DOWN: 503,
    Outcome.FAILED: 503,
    ApiCode.UNAVAILABLE: 503,
    NOT_READY: 503,
    Outcome.INFEASIBLE: 504,
    Outcome.DROPPED: 504,
}
# code -> the name of a `grpc.StatusCode` member (this module does not import grpc).
GRPC_CODE: Mapping[str, str] = {
    Outcome.OK: "OK",
    Outcome.LATE: "OK",
    Outcome.BAD_INPUT: "INVALID_ARGUMENT",
    BAD_REQUEST: "INVALID_ARGUMENT",
    UNAUTHORIZED: "UNAUTHENTICATED",
    ApiCode.FORBIDDEN: "PERMISSION_DENIED",
    ApiCode.BAD_MODEL: "INVALID_ARGUMENT",
    ApiCode.MODEL_EXISTS: "ALREADY_EXISTS",
    Outcome.UNKNOWN_MODEL: "NOT_FOUND",
    NOT_FOUND: "UNIMPLEMENTED",
    METHOD_NOT_ALLOWED: "UNIMPLEMENTED",
    REQUEST_TIMEOUT: "DEADLINE_EXCEEDED",
    TOO_LARGE: "RESOURCE_EXHAUSTED",
    Outcome.OVERLOADED: "RESOURCE_EXHAUSTED",
    Outcome.CANCELLED: "CANCELLED",
    ApiCode.INTERNAL: "INTERNAL",
    Outcome.SHUTTING_DOWN: "UNAVAILABLE",
    Outcome.FAILED: "UNAVAILABLE",
    ApiCode.UNAVAILABLE: "UNAVAILABLE",
    NOT_READY: "UNAVAILABLE",
    Outcome.INFEASIBLE: "DEADLINE_EXCEEDED",
    Outcome.DROPPED: "DEADLINE_EXCEEDED",
}


class V2Error(Exception):
    """A refusal: ``code`` (a key of `HTTP_STATUS`) and a sentence; the message a client sees
    is ``"code: sentence"``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = str(code)
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @property
    def text(self) -> str:
        return f"{self.code}: {self.message}"
