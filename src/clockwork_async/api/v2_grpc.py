"""The Open Inference Protocol (KServe v2) over gRPC: ``inference.GRPCInferenceService``,
served by grpcio's asyncio server on the daemon's own event loop.

The messages and the service's stubs are the ones generated from the published proto and
shipped by tritonclient (``tritonclient.grpc.service_pb2``, ``service_pb2_grpc``), not written
here. Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata,
RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload (``admin`` scope) and
ModelInfer (tensors as ``raw_input_contents`` or typed ``contents``;
outputs always as ``raw_output_contents``, as Triton answers); every other method answers
UNIMPLEMENTED (the base servicer's).

Invariants: an infer passes the shared door (`api.v2_door.Door`) like an HTTP one; the client's
gRPC deadline is one of its SLOs (the earliest wins); a refusal aborts the call with the code
of `v2_door.GRPC_CODE`, details ``"code: sentence"`` and trailing metadata ``clockwork-outcome``;
a call the client cancels (or whose deadline passes in gRPC) cancels its request; messages
over ``max_message_bytes`` are refused by gRPC itself (RESOURCE_EXHAUSTED); a message that does
not parse is ``bad_request`` (INVALID_ARGUMENT, `_DecodeGuard`), not grpcio's UNKNOWN; a port
taken by another process fails the bind (``SO_REUSEPORT`` off).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from clockwork_async.api.auth import Scope
from clockwork_async.api.v2_config import GrpcConfig
from clockwork_async.api.v2_door import EXTENSIONS, PLATFORM, Door, slo_ns_of, tensor_metadata
from clockwork_async.api.v2_status import BAD_REQUEST, GRPC_CODE, V2Error
from clockwork_async.api.v2_tensors import (
    TensorError,
    array_from_bytes,
    array_from_values,
    check_shape,
    datatype_of,
)
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.addresses import TcpAddress

log = logging.getLogger("clockwork_async.api.v2")

# Which typed ``contents`` field carries each datatype (FP16 has none: raw contents only).
CONTENTS_FIELD: Mapping[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class GrpcFrontEnd:
    """Serves the protocol on one address through ``door``; `bind`, `serve`, `close`."""

    def __init__(
        self, door: Door, config: GrpcConfig, *, tls_paths: tuple[Path, Path] | None = None
    ) -> None:
        self.door = door
        self.config = config
        self._tls_paths = tls_paths  # (certificate chain, key)
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def bind(self, listen: TcpAddress) -> str:
        """Take ``listen`` without serving yet; returns ``HOST:PORT``. Raises OSError."""
        limit = self.config.max_message_bytes
        options = [
            ("grpc.so_reuseport", 0),  # a taken port must fail, not be shared
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.max_concurrent_streams", self.config.max_concurrent_streams),
        ]
        server = grpc.aio.server(options=options, interceptors=[_DecodeGuard()])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self.door), server)
        target = str(listen)
        try:
            if self._tls_paths is None:
                port = server.add_insecure_port(target)
            else:
                cert, key = (path.read_bytes() for path in self._tls_paths)
                credentials = grpc.ssl_server_credentials([(key, cert)])
                port = server.add_secure_port(target, credentials)
        except RuntimeError as error:  # grpcio's "Failed to bind to address"
            raise OSError(str(error)) from None
        if not port:
            raise OSError(f"could not bind {target}")
        self._server = server
        self.address = str(TcpAddress(listen.host, port))
        return self.address

    async def serve(self) -> None:
        assert self._server is not None
        await self._server.start()

    async def close(self, timeout_s: float) -> None:
        """Refuse new calls; give those in flight ``timeout_s``, then cancel them."""
        if self._server is not None:
            await self._server.stop(timeout_s)


class _Undecodable:
    """What a request message that does not parse becomes (instead of grpcio's UNKNOWN)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers a unary call whose message does not parse ``bad_request`` (INVALID_ARGUMENT),
    as the protocol's error table says, where grpcio's own deserializer would end it UNKNOWN.
    The guard wraps the generated handler's deserializer and behaviour; the servicer never
    sees such a message."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        return handler._replace(
            request_deserializer=_parsing(handler.request_deserializer),
            unary_unary=_refusing_undecodable(handler.unary_unary),
        )


def _parsing(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return _Undecodable(str(error) or "a malformed message")

    return parse_or_mark


def _refusing_undecodable(behaviour: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            text = f"the message does not parse: {request.reason}"
            await _abort(context, V2Error(BAD_REQUEST, text))
        return await behaviour(request, context)

    return call


class _Servicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The served methods; each reads the door, none keeps state of its own."""

    def __init__(self, door: Door) -> None:
        self._door = door

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self._door.ready())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        ready = self._door.model_ready(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        metadata = self._door.server_metadata()
        return pb.ServerMetadataResponse(
            name=metadata["name"], version=metadata["version"], extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        try:
            status = self._door.model_status(request.name, request.version or None)
        except V2Error as error:
            await _abort(context, error)
        return pb.ModelMetadataResponse(
            name=status.name,
            versions=[str(status.version or 1)],
            platform=PLATFORM,
            inputs=[
                pb.ModelMetadataResponse.TensorMetadata(**tensor_metadata(s)) for s in status.inputs
            ],
            outputs=[
                pb.ModelMetadataResponse.TensorMetadata(**tensor_metadata(s))
                for s in status.outputs
            ],
        )

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._authorize(context)
        index = self._door.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**entry) for entry in index]
        )

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._repository(request, context, "load")
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._repository(request, context, "unload")
        return pb.RepositoryModelUnloadResponse()

    async def _repository(
        self, request: Any, context: grpc.aio.ServicerContext, action: str
    ) -> None:
        """Load or unload ``request.model_name`` (``admin`` scope); aborts the call with the
        refusal (``NOT_FOUND``: no such model in the folder)."""
        metadata = dict(context.invocation_metadata() or ())
        try:
            self._door.authorize(metadata.get("authorization"), Scope.ADMIN)
            others = sorted(name for name in request.parameters if name != "unload_dependents")
            if others:
                why = (
                    f"{action} takes the model's own folder; parameters {others} are not supported"
                )
                raise V2Error(BAD_REQUEST, why)
            if action == "load":
                await self._door.load(request.model_name)
            else:
                await self._door.unload(request.model_name)
        except V2Error as error:
            log.info("repository %s of %r refused: %s", action, request.model_name, error.text)
            await _abort(context, error)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        trace = metadata.get("traceparent")
        if trace:
            await context.send_initial_metadata((("traceparent", trace),))
        model = request.model_name
        try:
            self._door.authorize(metadata.get("authorization"))
            slo_ns = slo_ns_of(_parameters(request.parameters), context.time_remaining())
            nbytes = request.ByteSize()
            answer = await self._door.infer(
                model,
                request.model_version or None,
                slo_ns,
                nbytes,
                lambda: _inputs(request),
                context.peer(),  # its connection: what its IO arena slots count against
            )
            outcome = answer.outcome
            if outcome.outcome not in (Outcome.OK, Outcome.LATE):
                raise V2Error(outcome.outcome.value, outcome.message)
            response = _response(request, answer.version, outcome.outputs)
        except (V2Error, TensorError) as error:
            failure = error if isinstance(error, V2Error) else V2Error(BAD_REQUEST, str(error))
            self._door.answered(model, request.id, trace, failure.code, failure.message)
            await _abort(context, failure)
        if outcome.outcome is Outcome.LATE:
            response.parameters["outcome"].string_param = Outcome.LATE.value
        context.set_trailing_metadata((("clockwork-outcome", outcome.outcome.value),))
        self._door.answered(model, request.id, trace, outcome.outcome.value, "")
        return response

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        try:
            self._door.authorize(metadata.get("authorization"))
        except V2Error as error:
            await _abort(context, error)


async def _abort(context: grpc.aio.ServicerContext, error: V2Error) -> Any:
    """End the call with ``error``'s gRPC code (raises, as `ServicerContext.abort` does)."""
    context.set_trailing_metadata((("clockwork-outcome", error.code),))
    code = getattr(grpc.StatusCode, GRPC_CODE.get(error.code, "INTERNAL"))
    await context.abort(code, error.text)


def _parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """An InferParameter map as plain values."""
    plain = {}
    for name, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        plain[name] = getattr(parameter, choice) if choice else None
    return plain


def _inputs(request: Any) -> dict[str, np.ndarray]:
    """The request's tensors: ``raw_input_contents`` (one per input, in order) as views of
    the message's bytes, or each input's typed ``contents``. Raises TensorError."""
    raw: Sequence[bytes] = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise TensorError(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input"
        )
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in arrays:
            raise TensorError("inputs must have distinct names")
        shape = check_shape(tensor.name, list(tensor.shape))
        if raw:
            arrays[tensor.name] = array_from_bytes(tensor.name, tensor.datatype, shape, raw[index])
            continue
        field = CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            raise TensorError(f"input {tensor.name!r}: {tensor.datatype} needs raw_input_contents")
        values = getattr(tensor.contents, field)
        arrays[tensor.name] = array_from_values(tensor.name, tensor.datatype, shape, list(values))
    if not arrays:
        raise TensorError("inputs must hold at least one tensor")
    return arrays


def _response(request: Any, version: int, outputs: Mapping[str, np.ndarray]) -> Any:
    """The ModelInferResponse: the requested outputs (all when none is named), raw."""
    names = [output.name for output in request.outputs] or list(outputs)
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=str(version), id=request.id
    )
    for name in names:
        if name not in outputs:
            raise TensorError(f"unknown output {name!r} (the model has {sorted(outputs)})")
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(
            np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
        )
    return response
