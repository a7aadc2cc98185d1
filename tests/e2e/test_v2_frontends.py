"""The Open Inference Protocol on the real daemon, driven by clients no one here wrote:
``tritonclient`` (HTTP) and ``curl``. One daemon (an ONNX Runtime executor, the demo models
``tiny`` and ``mlp``) serves the module; its outputs must equal the msgpack client's. A slowed
simulated daemon shows that SIGTERM answers HTTP requests in flight before it closes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from clockwork_async.client import Client
from clockwork_async.daemon.lifecycle import DaemonState
from clockwork_async.models.demo import build_mlp, build_tiny

from .harness import (
    DaemonProcess,
    add_tiny,
    children,
    metric_value,
    ort_executor,
    sim_executor,
    write_config,
)
from .test_daemon_inprocess import sim_daemon

SLO_MS = 5_000.0
MODELS = {"tiny": build_tiny, "mlp": build_mlp}
INPUT_WIDTH = {"tiny": 16, "mlp": 784}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("v2")
    for name, build in MODELS.items():
        (folder / "models" / name).mkdir(parents=True)
        (folder / "models" / name / "model.onnx").write_bytes(build(0).SerializeToString())
    config = write_config(folder, ort_executor())
    limits = "[http]\nmax_body_bytes = 1048576\nrequest_timeout_s = 1.0\n"
    text = config.read_text().replace("[http]\n", limits, 1)
    config.write_text(text.replace("[grpc]\n", "[grpc]\nmax_message_bytes = 1048576\n", 1))
    process = DaemonProcess.start(folder, config)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def msgpack(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.api, timeout_s=60.0) as client:
        for model, width in INPUT_WIDTH.items():  # loaded once before the comparisons
            client.infer(model, {"x": np.zeros((1, width), np.float32)}, slo_ms=SLO_MS)
        yield client


@pytest.fixture(scope="module")
def http(daemon: DaemonProcess) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(daemon.http, network_timeout=30.0)
    try:
        yield client
    finally:
        client.close()


def rows(model: str, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal((1, INPUT_WIDTH[model])).astype(np.float32) for _ in range(count)]


def test_health_and_metadata(http: triton_http.InferenceServerClient, msgpack: Client) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert http.get_server_metadata()["name"] == "clockwork-async"
    assert http.is_model_ready("tiny") and http.is_model_ready("tiny", "1")
    assert not http.is_model_ready("tiny", "2") and not http.is_model_ready("nope")
    index = {(m["name"], m["version"], m["state"]) for m in http.get_model_repository_index()}
    assert index == {("tiny", "1", "READY"), ("mlp", "1", "READY")}
    meta = http.get_model_metadata("mlp")
    assert meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert [tensor["datatype"] for tensor in meta["inputs"]] == ["FP32"]
    assert meta["inputs"][0]["shape"] == [-1, INPUT_WIDTH["mlp"]]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_outputs_equal_the_msgpack_clients(
    http: triton_http.InferenceServerClient, msgpack: Client, model: str, binary: bool
) -> None:
    meta = http.get_model_metadata(model)
    input_name, output_name = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
    for row in rows(model, 3):
        tensor = triton_http.InferInput(input_name, list(row.shape), "FP32")
        tensor.set_data_from_numpy(row, binary_data=binary)
        wanted = triton_http.InferRequestedOutput(output_name, binary_data=binary)
        result = http.infer(
            model, [tensor], outputs=[wanted], request_id="r-1", parameters={"slo_ms": SLO_MS}
        )
        assert result.get_response()["id"] == "r-1"
        expected = msgpack.infer(model, {input_name: row}, slo_ms=SLO_MS)
        assert expected.ok, expected.message
        # Both ran at batch 1 on the same executor: the same kernels, the same bits.
        np.testing.assert_array_equal(result.as_numpy(output_name), expected.outputs[output_name])


def test_a_client_batch_equals_its_rows_one_by_one(
    http: triton_http.InferenceServerClient, msgpack: Client
) -> None:
    batch = np.concatenate(rows("mlp", 4))
    tensor = triton_http.InferInput("x", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch, binary_data=True)
    result = http.infer("mlp", [tensor], parameters={"slo_ms": SLO_MS}).as_numpy("logits")
    assert result.shape == (4, 10)
    for row, got in zip(batch, result, strict=True):
        expected = msgpack.infer("mlp", {"x": row[None]}, slo_ms=SLO_MS).outputs["logits"][0]
        # Rows may run in batches of other sizes: float32 rounding at the output's scale.
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)


def test_refusals_carry_the_protocols_status(http: triton_http.InferenceServerClient) -> None:
    row = rows("tiny", 1)[0]
    cases = [
        ("nope", "FP32", row, {}, "404", "unknown_model"),
        ("tiny", "FP64", row.astype(np.float64), {}, "400", "bad_input"),
        ("tiny", "FP32", np.ones((1, 3), np.float32), {}, "400", "bad_input"),
        ("tiny", "FP32", row, {"timeout": 1}, "504", "infeasible"),  # Triton's, in µs
    ]
    for model, datatype, data, parameters, status, code in cases:
        tensor = triton_http.InferInput("x", list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as raised:
            http.infer(model, [tensor], timeout=parameters.get("timeout"))
        got = (raised.value.status(), raised.value.message().split(":")[0])
        assert got in {(status, code), *loop_behind(parameters, "429")}, raised.value


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_speaks_to_it(daemon: DaemonProcess, msgpack: Client) -> None:
    base = f"http://{daemon.http}/v2"
    assert curl(f"{base}/health/ready")[0] == 200
    row = rows("tiny", 1)[0]
    body = {
        "id": "c",
        "inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": row.tolist()}],
    }
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    status, headers, text = curl(
        f"{base}/models/tiny/infer", "-d", json.dumps(body), "-H", f"traceparent: {trace}"
    )
    assert status == 200 and headers["traceparent"] == trace, text
    (output,) = json.loads(text)["outputs"]
    expected = msgpack.infer("tiny", {"x": row}, slo_ms=SLO_MS).outputs[output["name"]]
    np.testing.assert_array_equal(
        np.array(output["data"], np.float32).reshape(output["shape"]), expected
    )
    status, _, text = curl(f"{base}/models/tiny/infer", "-d", "{not json")
    assert status == 400 and json.loads(text)["error"].startswith("bad_request: ")
    answered = [line for line in daemon.log().splitlines() if "infer 'tiny' answered ok" in line]
    assert any("[request c]" in line and f"traceparent={trace}" in line for line in answered)


def test_hostile_clients_are_answered_in_bounded_time_and_others_served(
    daemon: DaemonProcess, http: triton_http.InferenceServerClient
) -> None:
    big = curl(
        f"http://{daemon.http}/v2/models/tiny/infer", "--data-binary", "@-", stdin=bytes(2 << 20)
    )
    assert big[0] == 413
    host, port = daemon.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        idle.sendall(
            b"POST /v2/models/tiny/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{"
        )
        answer = idle.recv(4096)  # request_timeout_s = 1: a 408, then the close
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert http.is_server_ready()


@pytest.fixture(scope="module")
def grpc(daemon: DaemonProcess) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(daemon.grpc)
    try:
        yield client
    finally:
        client.close()


def test_grpc_health_and_metadata(grpc: triton_grpc.InferenceServerClient) -> None:
    assert grpc.is_server_live() and grpc.is_server_ready()
    assert grpc.get_server_metadata().name == "clockwork-async"
    assert grpc.is_model_ready("tiny") and not grpc.is_model_ready("tiny", "2")
    index = grpc.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("tiny", "1", "READY"),
        ("mlp", "1", "READY"),
    }
    meta = grpc.get_model_metadata("mlp", as_json=True)
    assert meta["versions"] == ["1"] and meta["inputs"][0]["datatype"] == "FP32"
    assert [int(dim) for dim in meta["inputs"][0]["shape"]] == [-1, INPUT_WIDTH["mlp"]]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_grpc_outputs_equal_the_msgpack_clients(
    grpc: triton_grpc.InferenceServerClient, msgpack: Client, model: str
) -> None:
    meta = grpc.get_model_metadata(model, as_json=True)
    input_name, output_name = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
    for row in rows(model, 3):
        tensor = triton_grpc.InferInput(input_name, list(row.shape), "FP32")
        tensor.set_data_from_numpy(row)
        result = grpc.infer(model, [tensor], request_id="g-1", client_timeout=30.0)
        assert result.get_response().id == "g-1"
        expected = msgpack.infer(model, {input_name: row}, slo_ms=SLO_MS)
        np.testing.assert_array_equal(result.as_numpy(output_name), expected.outputs[output_name])


def loop_behind(parameters: dict[str, int], status: str) -> set[tuple[str, str]]:
    """A deadline of 1 µs may also meet the door's own refusal first, when the daemon's loop
    is busy (this machine is shared): ``overloaded``, from the header."""
    return {(status, "overloaded")} if "timeout" in parameters else set()


def test_grpc_refusals_carry_their_codes(grpc: triton_grpc.InferenceServerClient) -> None:
    row = rows("tiny", 1)[0]
    cases = [
        ("nope", "FP32", row, {}, "StatusCode.NOT_FOUND", "unknown_model"),
        ("tiny", "FP64", row.astype(np.float64), {}, "StatusCode.INVALID_ARGUMENT", "bad_input"),
        ("tiny", "FP32", row, {"timeout": 1}, "StatusCode.DEADLINE_EXCEEDED", "infeasible"),
        (
            "tiny",
            "FP32",
            np.ones((1, 300_000), np.float32),
            {},
            "StatusCode.RESOURCE_EXHAUSTED",
            "",
        ),
    ]
    for model, datatype, data, parameters, status, code in cases:
        tensor = triton_grpc.InferInput("x", list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as raised:
            grpc.infer(model, [tensor], timeout=parameters.get("timeout"))
        got = (raised.value.status(), code and raised.value.message().split(":")[0])
        assert got in {(status, code), *loop_behind(parameters, "StatusCode.RESOURCE_EXHAUSTED")}
    assert grpc.is_server_ready()  # and it serves on


def test_the_metrics_count_answers_by_front_end(daemon: DaemonProcess) -> None:
    _, text = daemon.http_get("/metrics")
    assert (
        metric_value(text, "clockwork_api_requests_total", {"protocol": "http", "status": "ok"})
        or 0
    ) >= 12
    assert (
        metric_value(text, "clockwork_api_requests_total", {"protocol": "msgpack", "status": "ok"})
        or 0
    ) >= 12
    assert (
        metric_value(
            text, "clockwork_api_requests_total", {"protocol": "http", "status": "unknown_model"}
        )
        or 0
    ) >= 1


def test_sigterm_answers_http_and_grpc_requests_in_flight_then_closes(tmp_path: Path) -> None:
    """The executor is stopped (SIGSTOP) while 64 requests arrive, so all are in flight when
    SIGTERM comes; it goes on (SIGCONT) and the drain answers every one of them."""
    add_tiny(tmp_path / "models")
    patient = "[executor_link]\nheartbeat_miss_limit = 1000\n"  # a stopped executor stays up
    config = write_config(tmp_path, sim_executor(), drain_timeout_s=10.0, sections=patient)
    daemon = DaemonProcess.start(tmp_path, config)
    (executor,) = children(daemon.pid)
    body = json.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
            ],
            "parameters": {"slo_ms": 30_000},
        }
    ).encode()
    url = f"http://{daemon.http}/v2/models/tiny/infer"
    try:
        with ThreadPoolExecutor(64) as pool:
            os.kill(executor, signal.SIGSTOP)
            pending = [pool.submit(grpc_infer, daemon.grpc) for _ in range(16)]
            pending += [pool.submit(post, url, body) for _ in range(48)]
            wait_until(lambda: outstanding(daemon) >= 64)
            daemon.signal(signal.SIGTERM)
            wait_until(lambda: "stop signal received" in daemon.log())
            os.kill(executor, signal.SIGCONT)
            statuses = [request.result(60) for request in pending]
        assert daemon.wait() == 0, daemon.log()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(executor, signal.SIGCONT)
        daemon.stop()
    assert statuses == [200] * 64, statuses


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    give_up_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < give_up_s, "not in time"
        time.sleep(0.01)


def outstanding(daemon: DaemonProcess) -> float:
    text = daemon.http_get("/metrics")[1]
    return metric_value(text, "clockwork_outstanding_requests") or 0.0


def grpc_infer(address: str) -> int:
    """One gRPC infer on its own channel: 200 when answered, 503 UNAVAILABLE, else 0 (a
    call that reaches a stopped server is CANCELLED by gRPC itself)."""
    client = triton_grpc.InferenceServerClient(address)
    tensor = triton_grpc.InferInput("input", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    try:
        client.infer("tiny", [tensor], client_timeout=30.0, parameters={"slo_ms": 10_000})
        return 200
    except InferenceServerException as error:
        return 503 if error.status() == "StatusCode.UNAVAILABLE" else 0
    finally:
        client.close()


def post(url: str, body: bytes) -> int:
    """POST ``body``; the status, or 0 when the connection was refused or closed."""
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError):
        return 0


def curl(url: str, *args: str, stdin: bytes | None = None) -> tuple[int, dict[str, str], str]:
    done = subprocess.run(
        ["curl", "-s", "-i", "--max-time", "20", *args, url],
        input=stdin,
        capture_output=True,
        timeout=30,
        check=False,
    )
    head, _, body = (
        done.stdout.decode(errors="replace")
        .replace("HTTP/1.1 100 Continue\r\n\r\n", "")
        .partition("\r\n\r\n")
    )
    lines = head.split("\r\n")
    pairs = [line.split(": ", 1) for line in lines[1:] if ": " in line]
    headers = {name.lower(): value for name, value in pairs}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("key", ["http.listen", "grpc.listen"])
async def test_a_taken_port_fails_the_start_naming_its_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    add_tiny(tmp_path / "models")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        daemon = sim_daemon(tmp_path, **{key: address})
        assert await daemon.run() == 1
    assert daemon.supervisor is None  # before any executor was spawned
    assert f"{key} = {address}: the" in caplog.text and "cannot listen there" in caplog.text


async def test_front_ends_can_be_switched_off(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    daemon = sim_daemon(tmp_path, **{"http.enabled": "false", "grpc.enabled": "false"})
    run = asyncio.ensure_future(daemon.run())
    while daemon.state is DaemonState.STARTING and not run.done():
        await asyncio.sleep(0.05)
    assert daemon.front_ends is not None and daemon.front_ends.describe() == " http=off grpc=off"
    daemon.request_stop()
    assert await run == 0
