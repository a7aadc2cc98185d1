"""What the client API server needs from the daemon: the `Requests` and `Admin` protocols, and
the `InferOutcome` a request is answered with; and what every front end needs of that server
(`RequestHost`).

The server (`api.server`) speaks the wire protocol and enforces connection-level policy
(authentication, scopes, caps, backpressure); everything about serving models is behind these
protocols: the request path (`Requests`: the daemon's dispatcher) and models, stats and health
(`Admin`: the daemon's service). Tests use one small fake for both (`Service`). Nothing here
imports the runtime: the runtime implements these.

Invariants the server relies on:
- ``submit`` calls ``on_reply`` exactly once per call, possibly before it returns, from the
  event loop's thread; ``cancel`` of an unknown or answered id does nothing.
- ``add_model``/``remove_model`` raise only `ServiceError` for refusals a client should see
  (anything else is a bug, reported to the client as ``internal``).
- ``stats`` returns JSON-able data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import Slot
from clockwork_async.wire.messages import ApiCode, ModelStatus

__all__ = [
    "Admin",
    "ApiCode",
    "Health",
    "InferOutcome",
    "ModelRoute",
    "ModelStatus",
    "Requests",
    "Service",
    "ServiceError",
]


@dataclass(frozen=True, slots=True)
class InferOutcome:
    """What a caller gets back, exactly once per submit."""

    request_id: int
    outcome: Outcome
    message: str
    outputs: dict[str, np.ndarray]  # this request's rows (read-only views), for OK and LATE
    timing_ns: dict[str, int]  # total, queue, execute, predicted_execute (+ executor, ...)
    executor_id: str | None
    batch_size: int


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where requests for a served name go: ``target``, the name the request path serves its
    current version under (the name itself, or ``NAME@vN`` once replaced), and ``version``."""

    target: str
    version: int


class ServiceError(Exception):
    """A refusal the client sees: ``code`` (an `ApiCode` value such as ``unknown_model``,
    ``bad_model``, ``model_exists``, ``unavailable``) and a sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Health:
    """``live``: the process serves; ``ready``: executors up and models registered.
    ``reason`` says why it is not ready (empty when ready)."""

    live: bool
    ready: bool
    reason: str = ""


class Requests(Protocol):
    """The request path, as the client API server sees it (the daemon's dispatcher)."""

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        on_reply: Callable[[InferOutcome], None],
        slot: Slot | None = None,
    ) -> int:
        """Accept a request that arrived now (one row per input). At most one of ``slo_ns``
        (relative to now) and ``deadline_unix_ns`` is set; neither means the model's default
        SLO. Returns the request's id; ``on_reply`` is called exactly once, possibly before
        this returns. ``slot``: the IO arena slot its inputs were read into (the caller
        releases it after ``on_reply``; outputs may be views of it)."""
        ...

    def screen(
        self,
        model: str,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        nbytes: int,
        waited_ns: int = 0,
        unread_ns: int = 0,
    ) -> str | None:
        """Whether a request can be taken, from its frame's header alone (before any of its
        ``nbytes`` of tensors are kept): None, or why it is refused ``overloaded`` (the
        daemon's own work is too far behind for its deadline: the work booked ahead, or the
        ``waited_ns`` the request already waited for the loop after it was read, an SLO
        counting from before that wait; or the ``unread_ns`` it at least waited unread in its
        socket, past its share of the SLO). Changes nothing."""
        ...

    def refuse(
        self, model: str, reason: str, nbytes: int, on_reply: Callable[[InferOutcome], None]
    ) -> int:
        """Answer a request `screen` refused ``overloaded`` with ``reason`` (counted like any
        other answer; ``on_reply`` is called before this returns). Returns its id."""
        ...

    def cancel(self, request_id: int) -> None:
        """Cancel a request by the id ``submit`` returned; unknown ids are ignored."""
        ...

    def flush(self) -> None:
        """The requests submitted so far came in together: schedule them now (the server
        calls this when a connection has no more decoded requests)."""
        ...


class Admin(Protocol):
    """Models, stats and health, as the client API server sees them."""

    def list_models(self) -> list[ModelStatus]:
        """Every registered model."""
        ...

    async def add_model(
        self,
        name: str,
        onnx_bytes: bytes,
        model_toml: str | None,
        *,
        replace: bool = False,
        wait: bool = True,
    ) -> ModelStatus:
        """Store a model and register it in a background job; a taken name (or one being
        registered) is ``model_exists`` unless ``replace``. Returns once it is registered
        (``wait``), or at once with its job's status. Raises ServiceError (with ``wait``:
        the job's failure, or ``cancelled``)."""
        ...

    async def cancel_registration(self, name: str) -> ModelStatus:
        """Cancel the running registration of ``name``; returns its job's status once nothing
        of it is left. Raises ServiceError (``unknown_model``: none is running)."""
        ...

    async def remove_model(self, name: str) -> None:
        """Unregister and delete a model. Raises ServiceError."""
        ...

    async def load_model(self, name: str) -> ModelStatus:
        """Serve a model of the repository's folder (registered as a rescan would); returns
        once it is ready, at once if it is served. Raises ServiceError (``unknown_model``: no
        such folder; the registration's failure)."""
        ...

    async def unload_model(self, name: str) -> None:
        """Stop serving a model but keep its folder (requests routed to it finish); a rescan
        leaves it unloaded until a load. Raises ServiceError (``unknown_model``)."""
        ...

    def stats(self) -> dict[str, object]:
        """A JSON-able snapshot of the daemon."""
        ...

    def health(self) -> Health:
        """Liveness and readiness."""
        ...


class Service(Requests, Admin, Protocol):
    """Both, in one object (tests' fakes)."""


class ServerCaps(Protocol):
    """The caps on requests in flight every front end applies, and the smallest request whose
    tensors go through the IO arena (fewer bytes: the byte path, cheaper for tiny rows)."""

    @property
    def max_outstanding_per_connection(self) -> int: ...

    @property
    def max_outstanding_total(self) -> int: ...

    @property
    def io_arena_min_bytes(self) -> int: ...


class RequestHost(Protocol):
    """What every front end (a msgpack session, the v2 door) needs of the client API server
    (`api.server.ApiServer` is one): its services, its limits and the counts it keeps."""

    @property
    def service(self) -> Admin: ...

    @property
    def requests(self) -> Requests: ...

    @property
    def limits(self) -> ServerCaps: ...

    @property
    def accepting_requests(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def routes(self) -> Mapping[str, ModelRoute]: ...

    def request_started(self) -> None: ...

    def request_ended(self) -> None: ...

    def count_answer(self, protocol: str, status: str) -> None: ...
