"""The msgpack API's admin verbs for one connection (`api.session.ApiSession` owns one): list,
add, remove and cancel the registration of models; stats and health. A model change runs as a
task; everything else is answered at once.

Invariants:
- A model change's request id is in ``tasks`` from acceptance until its one reply is queued (or
  dropped, the connection being gone); the session counts these ids as in flight and refuses a
  second use of one as ``duplicate_id`` (`AdminGate.busy`).
- A model change needs the ``admin`` scope; refusals come in a fixed order: forbidden,
  duplicate id, shutting down, over the connection's cap.
- An ``add_model`` holds its share of the server's upload budget (`AdminHost.admit_upload`)
  from acceptance until its reply, and only the model's bytes (not the message, nor its frame)
  while it waits for the service.
- A failure of the service (other than `ServiceError`) or of encoding is answered
  ``internal``, never raised into the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from clockwork_async.api.auth import Scope
from clockwork_async.api.service import RequestHost, ServiceError
from clockwork_async.wire.codec import EncodeError
from clockwork_async.wire.messages import (
    AddModel,
    ApiCode,
    CancelRegistration,
    GetHealth,
    GetStats,
    HealthReply,
    ListModels,
    Message,
    ModelsReply,
    ModelStatus,
    RemoveModel,
    StatsReply,
)

log = logging.getLogger("clockwork_async.api.session")

ONNX_FILE = "model.onnx"  # the key of AddModel.files that holds the model
MODEL_CHANGES = (AddModel, RemoveModel, CancelRegistration)


class AdminHost(RequestHost, Protocol):
    """What the admin verbs need of the server besides what every front end does: the upload
    budget, admin tasks and the server's snapshot."""

    def admit_upload(self, nbytes: int) -> tuple[str, str] | None: ...

    def upload_ended(self, nbytes: int) -> None: ...

    def track_admin(self, task: asyncio.Task[None]) -> None: ...

    def snapshot(self) -> dict[str, object]: ...


class AdminGate(Protocol):
    """What the admin verbs ask of their session: whether an id is in flight (either kind),
    how many are, and a word when a model change has been accepted or answered."""

    def busy(self, request_id: int) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    def admin_changed(self) -> None: ...


@dataclass(slots=True)
class _UploadHold:
    """One add_model's share of the server's upload budget, given back exactly once."""

    server: AdminHost
    nbytes: int
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.server.upload_ended(self.nbytes)

    def release_on_done(self, _task: asyncio.Task[None]) -> None:
        self.release()


class AdminVerbs:
    """Answers one connection's admin messages (see the module's invariants)."""

    def __init__(
        self,
        server: AdminHost,
        scopes: frozenset[Scope],
        gate: AdminGate,
        send: Callable[[Message], None],
    ) -> None:
        self._server = server
        self._service = server.service
        self._scopes = scopes
        self._gate = gate
        self._send = send  # queues a message unless the connection is gone; raises EncodeError
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def handlers(self) -> dict[type[Any], Callable[[Any], None]]:
        """The message types these verbs answer, and their handlers."""
        return {
            ListModels: self._list_models,
            AddModel: self._add_model,
            RemoveModel: self._remove_model,
            CancelRegistration: self._cancel_registration,
            GetStats: self._stats,
            GetHealth: self._health,
        }

    async def settled(self, request_id: int) -> None:
        """Return once the model change ``request_id`` is answered: the session reads nothing
        more meanwhile (one change at a time per connection, so pipelined uploads wait in the
        socket, bounded by the kernel and the decoder's queue, not in memory as tasks holding
        their bytes)."""
        task = self.tasks.get(request_id)
        if task is not None:
            await asyncio.wait({task})  # run() being cancelled must not cancel the change

    # --- models -----------------------------------------------------------------------------

    def _list_models(self, request: ListModels) -> None:
        def answer() -> ModelsReply:
            models = tuple(self._service.list_models())
            return ModelsReply(request.request_id, ApiCode.OK, f"{len(models)} models", models)

        self._answer_now(request.request_id, answer, ModelsReply)

    def _add_model(self, request: AddModel) -> None:
        request_id = request.request_id
        onnx = request.files.get(ONNX_FILE)
        if set(request.files) != {ONNX_FILE} or onnx is None or not _is_byte_vector(onnx):
            why = f"add_model takes exactly one file, {ONNX_FILE!r}, as a 1-D uint8 tensor"
            self._send(ModelsReply(request_id, ApiCode.BAD_REQUEST, why))
            return
        refusal = self._refusal(request_id, "add_model")
        refusal = refusal or self._server.admit_upload(onnx.nbytes)
        if refusal is not None:
            self._send(ModelsReply(request_id, *refusal))
            return
        # The task holds a copy of the model's bytes, never the message (nor its frame).
        self._start_upload(request, onnx.tobytes())

    def _start_upload(self, request: AddModel, onnx_bytes: bytes) -> None:
        """Run an admitted upload; its share of the server's budget is given back once."""
        hold = _UploadHold(self._server, len(onnx_bytes))
        request_id, name, model_toml = request.request_id, request.name, request.model_toml
        replace, wait = request.replace, request.wait

        async def add() -> ModelsReply:
            try:
                status = await self._service.add_model(
                    name, onnx_bytes, model_toml, replace=replace, wait=wait
                )
            finally:
                hold.release()  # before the reply: the client may upload again at once
            done = f"replaced by version {status.version}" if replace else "added"
            done = done if wait else f"stored as version {status.version}; {status.state}"
            return _models_reply(request_id, f"model {name!r} {done}", status)

        task = self._spawn(request_id, "add_model", add)
        task.add_done_callback(hold.release_on_done)  # also when cancelled before it ran

    def _remove_model(self, request: RemoveModel) -> None:
        async def remove() -> ModelsReply:
            await self._service.remove_model(request.name)
            return _models_reply(request.request_id, f"model {request.name!r} removed")

        self._start(request.request_id, "remove_model", remove)

    def _cancel_registration(self, request: CancelRegistration) -> None:
        async def cancel() -> ModelsReply:
            status = await self._service.cancel_registration(request.name)
            return _models_reply(request.request_id, f"registration of {request.name!r}", status)

        self._start(request.request_id, "cancel_registration", cancel)

    def _start(
        self, request_id: int, what: str, work: Callable[[], Awaitable[ModelsReply]]
    ) -> None:
        refusal = self._refusal(request_id, what)
        if refusal is not None:
            self._send(ModelsReply(request_id, *refusal))
            return
        self._spawn(request_id, what, work)

    def _spawn(
        self, request_id: int, what: str, work: Callable[[], Awaitable[ModelsReply]]
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._run(request_id, what, work))
        self.tasks[request_id] = task
        self._gate.admin_changed()
        self._server.track_admin(task)
        return task

    def _refusal(self, request_id: int, what: str) -> tuple[str, str] | None:
        if Scope.ADMIN not in self._scopes:
            return ApiCode.FORBIDDEN, f"{what} needs a token with the admin scope"
        if self._gate.busy(request_id):
            return ApiCode.DUPLICATE_ID, f"request id {request_id} is already in flight"
        if not self._server.accepting_requests:
            return ApiCode.SHUTTING_DOWN, "the server is shutting down"
        if self._gate.in_flight >= self._server.limits.max_outstanding_per_connection:
            return ApiCode.OVERLOADED, "this connection has too many requests in flight"
        return None

    async def _run(
        self, request_id: int, what: str, work: Callable[[], Awaitable[ModelsReply]]
    ) -> None:
        try:
            reply = await work()
        except ServiceError as error:
            reply = ModelsReply(request_id, error.code, error.message)
        except Exception as error:
            log.exception("%s (request %d) failed", what, request_id)
            reply = ModelsReply(request_id, ApiCode.INTERNAL, f"{what} failed: {error!r}")
        finally:
            self.tasks.pop(request_id, None)
        self._send_quietly(reply)
        self._gate.admin_changed()

    # --- stats, health ------------------------------------------------------------------------

    def _stats(self, request: GetStats) -> None:
        def answer() -> StatsReply:
            stats = dict(self._service.stats())
            stats.setdefault("api", self._server.snapshot())
            data = json.dumps(stats, separators=(",", ":"), default=str).encode()
            return StatsReply(request.request_id, ApiCode.OK, "stats", data)

        self._answer_now(request.request_id, answer, StatsReply)

    def _health(self, request: GetHealth) -> None:
        def answer() -> HealthReply:
            health = self._service.health()
            sentence = "ready" if health.ready else f"not ready: {health.reason}"
            return HealthReply(
                request.request_id, ApiCode.OK, sentence, health.live, health.ready, health.reason
            )

        self._answer_now(request.request_id, answer, HealthReply)

    # --- sending --------------------------------------------------------------------------------

    def _answer_now(
        self,
        request_id: int,
        answer: Callable[[], Message],
        reply_type: type[ModelsReply] | type[StatsReply] | type[HealthReply],
    ) -> None:
        """Send ``answer()``; a failure of the service or of encoding becomes ``internal``."""
        if self._gate.busy(request_id):
            why = f"request id {request_id} is already in flight"
            self._send(reply_type(request_id, ApiCode.DUPLICATE_ID, why))
            return
        try:
            self._send(answer())
        except Exception as error:  # a bug in the service, or a reply too large to encode
            log.exception("%s (request %d) failed", reply_type.TAG, request_id)
            self._send(reply_type(request_id, ApiCode.INTERNAL, f"failed: {error!r}"))

    def _send_quietly(self, reply: ModelsReply) -> None:
        try:
            self._send(reply)
        except EncodeError as error:
            self._send(ModelsReply(reply.request_id, ApiCode.INTERNAL, f"unencodable: {error}"))


def _is_byte_vector(array: np.ndarray) -> bool:
    return bool(array.dtype == np.uint8 and array.ndim == 1)


def _models_reply(request_id: int, sentence: str, *models: ModelStatus) -> ModelsReply:
    return ModelsReply(request_id, ApiCode.OK, sentence, models)
