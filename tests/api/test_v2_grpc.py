"""The Open Inference Protocol over gRPC (`api.v2_grpc`) on the test's loop, in front of a real
`ApiServer` over the fake service, driven by tritonclient's asyncio gRPC client: tokens as
metadata, the gRPC deadline as an SLO, the door's refusal, typed contents, a cancelled call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from clockwork_async.api.auth import TokenAuth
from clockwork_async.api.server import ApiServer
from clockwork_async.api.v2_config import GrpcConfig
from clockwork_async.api.v2_door import Door
from clockwork_async.api.v2_grpc import GrpcFrontEnd
from clockwork_async.wire.addresses import TcpAddress

from .conftest import eventually
from .fakes import FakeService

TOKEN = "infer-token-0123456789"


@dataclass
class Front:
    api: ApiServer
    grpc: GrpcFrontEnd
    client: triton_aio.InferenceServerClient


async def start(service: FakeService, auth: TokenAuth | None = None) -> Front:
    api = ApiServer(service, auth=auth)
    await api.start("127.0.0.1:0")
    config = GrpcConfig(listen=TcpAddress("127.0.0.1", 0))
    front = GrpcFrontEnd(Door(api, "grpc", server_version="test"), config)
    address = await front.bind(config.listen)
    await front.serve()
    return Front(api, front, triton_aio.InferenceServerClient(address))


@pytest_asyncio.fixture
async def front(service: FakeService) -> AsyncIterator[Front]:
    started = await start(service)
    yield started
    await close(started)


async def close(front: Front) -> None:
    await front.client.close()
    await front.grpc.close(0.5)
    await front.api.close(0.5)


def x_input(values: np.ndarray) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("x", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return tensor


async def test_raw_and_typed_contents_both_reach_the_service(
    front: Front, service: FakeService
) -> None:
    x = np.array([[1, 2, 3, 4]], np.float32)
    result = await front.client.infer("echo", [x_input(x)], request_id="a")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    assert result.get_response().id == "a"
    typed = triton_grpc.service_pb2.ModelInferRequest(model_name="echo")
    tensor = typed.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([5, 6, 7, 8])
    response = await front.client._client_stub.ModelInfer(typed)
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [10, 12, 14, 16]
    assert [s.slo_ns for s in service.submitted] == [None, None]  # no SLO given: the model's


async def test_the_earliest_of_deadline_and_parameters_is_the_slo(
    front: Front, service: FakeService
) -> None:
    x = np.ones((1, 4), np.float32)
    await front.client.infer("echo", [x_input(x)], client_timeout=2.0, parameters={"slo_ms": 50})
    await front.client.infer("echo", [x_input(x)], client_timeout=0.5, parameters={"slo_ms": 5000})
    first, second = (s.slo_ns for s in service.submitted)
    assert first == 50_000_000
    # The deadline (500 ms, as gRPC carries it: rounded to its timeout header's units), not 5 s.
    assert second is not None and 0 < second < 1_000_000_000


async def test_the_doors_refusal_and_unknown_models_are_grpc_codes(
    front: Front, service: FakeService
) -> None:
    x = np.ones((1, 4), np.float32)
    for model, code in (("door", "RESOURCE_EXHAUSTED"), ("nope", "NOT_FOUND")):
        with pytest.raises(InferenceServerException) as raised:
            await front.client.infer(model, [x_input(x)])
        assert raised.value.status() == f"StatusCode.{code}", raised.value
    assert service.screened == [("door", service.screened[0][1])]


@pytest.mark.parametrize("method", ["ModelInfer", "ServerLive", "RepositoryModelLoad"])
async def test_a_message_that_does_not_parse_is_invalid_argument(
    front: Front, service: FakeService, method: str
) -> None:
    """Not grpcio's UNKNOWN: the protocol's bad_request, and the front end serves on."""
    async with grpc.aio.insecure_channel(front.grpc.address) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(b"\xff\xff\xff\xff")  # field 31, wire type 7: no such wire type
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("bad_request: the message does not parse")
        metadata = dict(raised.value.trailing_metadata() or ())
        assert metadata.get("clockwork-outcome") == "bad_request"
    assert await front.client.is_server_live()
    assert service.submitted == []


async def test_a_cancelled_call_cancels_its_request(front: Front, service: FakeService) -> None:
    call = asyncio.ensure_future(front.client.infer("hold", [x_input(np.ones((1, 4), np.float32))]))
    await eventually(lambda: service.held)
    call.cancel()
    await eventually(lambda: service.cancelled)
    await eventually(lambda: front.api.outstanding == 0)


async def test_tokens_are_bearer_metadata(service: FakeService) -> None:
    front = await start(service, TokenAuth(infer_token=TOKEN))
    try:
        assert await front.client.is_server_live()  # health needs no token
        x = np.ones((1, 4), np.float32)
        with pytest.raises(InferenceServerException) as raised:
            await front.client.infer("echo", [x_input(x)])
        assert raised.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException):
            await front.client.get_model_metadata("echo")
        headers = {"authorization": f"Bearer {TOKEN}"}
        result = await front.client.infer("echo", [x_input(x)], headers=headers)
        np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    finally:
        await close(front)


async def test_load_and_unload_need_the_admin_scope(service: FakeService) -> None:
    front = await start(service, TokenAuth(infer_token=TOKEN, admin_token="admin-token-0123456"))
    try:
        for token, status in [("", "UNAUTHENTICATED"), (TOKEN, "PERMISSION_DENIED")]:
            with pytest.raises(InferenceServerException) as raised:
                await front.client.unload_model(
                    "echo", headers={"authorization": f"Bearer {token}"}
                )
            assert raised.value.status() == f"StatusCode.{status}"
        assert service.models["echo"].state == "ready"
        admin = {"authorization": "Bearer admin-token-0123456"}
        await front.client.unload_model("echo", headers=admin)
        index = await front.client.get_model_repository_index(headers=admin, as_json=True)
        assert {"name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in (
            index["models"]
        )
        await front.client.load_model("echo", headers=admin)
        assert service.models["echo"].state == "ready"
        with pytest.raises(InferenceServerException) as raised:
            await front.client.load_model("nope", headers=admin)
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert "unknown_model" in str(raised.value.message())
    finally:
        await close(front)
