"""The Open Inference Protocol's model repository extension on the real daemon, driven by
``tritonclient`` (HTTP and gRPC): load and unload map onto the daemon's registration of the
folders in its models folder; an unloaded model keeps its files and a SIGHUP rescan leaves it
unloaded; both need the admin token."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from .harness import DaemonProcess, add_tiny, sim_executor, write_config

INFER_TOKEN = "infer-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"


# tritonclient adds its own headers to the dict it is given: each call gets a fresh one.
def admin() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_TOKEN}"}


def infer() -> dict[str, str]:
    return {"authorization": f"Bearer {INFER_TOKEN}"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("v2-repository")


@pytest.fixture(scope="module")
def daemon(folder: Path) -> Iterator[DaemonProcess]:
    add_tiny(folder / "models", "tiny")
    add_tiny(folder / "models", "other", seed=1)
    (folder / "models" / "broken").mkdir()
    (folder / "models" / "broken" / "model.onnx").write_bytes(b"not an onnx file")
    config = write_config(folder, sim_executor())
    tokens = f'[server]\ninfer_token = "{INFER_TOKEN}"\nadmin_token = "{ADMIN_TOKEN}"\n'
    config.write_text(config.read_text().replace("[server]\n", tokens, 1))
    process = DaemonProcess.start(folder, config)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def http(daemon: DaemonProcess) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(daemon.http, network_timeout=60.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def grpc(daemon: DaemonProcess) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(daemon.grpc)
    try:
        yield client
    finally:
        client.close()


def states(http: triton_http.InferenceServerClient) -> dict[str, tuple[str, str]]:
    index = http.get_model_repository_index(headers=infer())
    return {entry["name"]: (entry["state"], entry.get("reason", "")) for entry in index}


def infer_status(http: triton_http.InferenceServerClient, model: str) -> str:
    tensor = triton_http.InferInput("input", [1, 4], "FP32")  # the simulated model's
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    try:
        http.infer(model, [tensor], headers=infer(), parameters={"slo_ms": 5_000})
    except InferenceServerException as error:
        return f"{error.status()} {error.message()}"
    return "200"


def refusal(call: object, *args: object, **kwargs: object) -> tuple[str, str]:
    """(status, the message's code) of a call that must fail."""
    with pytest.raises(InferenceServerException) as raised:
        call(*args, **kwargs)  # type: ignore[operator]
    message = str(raised.value.message())
    return str(raised.value.status()), message.split(":")[0].strip()


def test_unload_keeps_the_files_and_a_rescan_leaves_it_unloaded(
    folder: Path,
    daemon: DaemonProcess,
    http: triton_http.InferenceServerClient,
    grpc: triton_grpc.InferenceServerClient,
) -> None:
    assert states(http)["tiny"] == ("READY", "")
    http.unload_model("tiny", headers=admin())
    state, reason = states(http)["tiny"]
    assert state == "UNAVAILABLE" and "unloaded" in reason
    assert not http.is_model_ready("tiny", headers=infer())
    assert infer_status(http, "tiny").startswith("404 unknown_model")  # not served
    assert (folder / "models" / "tiny" / "model.onnx").is_file()
    http.unload_model("tiny", headers=admin())  # again: still success, still unloaded

    rescans = daemon.log().count("rescan: ")
    daemon.signal(signal.SIGHUP)
    deadline = time.monotonic() + 60.0
    while daemon.log().count("rescan: ") == rescans and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.log().count("rescan: ") > rescans, daemon.log()
    assert states(http)["tiny"][0] == "UNAVAILABLE"  # not silently registered again

    grpc.load_model("tiny", headers=admin())  # answers once it is served
    assert states(http)["tiny"] == ("READY", "")
    assert grpc.is_model_ready("tiny", headers=infer()) and infer_status(http, "tiny") == "200"
    http.load_model("tiny", headers=admin())  # already served: success at once


def test_grpc_unload_then_http_load(
    http: triton_http.InferenceServerClient, grpc: triton_grpc.InferenceServerClient
) -> None:
    grpc.unload_model("other", headers=admin())
    index = grpc.get_model_repository_index(headers=infer(), as_json=True)["models"]
    assert {"name": "other", "version": "1", "state": "UNAVAILABLE"}.items() <= next(
        entry for entry in index if entry["name"] == "other"
    ).items()
    assert infer_status(http, "other").startswith("404 unknown_model")
    http.load_model("other", headers=admin())
    assert states(http)["other"] == ("READY", "") and infer_status(http, "other") == "200"


def test_loads_that_cannot_be_done_say_why(
    http: triton_http.InferenceServerClient, grpc: triton_grpc.InferenceServerClient
) -> None:
    assert refusal(http.load_model, "nope", headers=admin()) == ("400", "unknown_model")
    assert refusal(grpc.load_model, "nope", headers=admin()) == (
        "StatusCode.NOT_FOUND",
        "unknown_model",
    )
    assert refusal(http.unload_model, "nope", headers=admin()) == ("400", "unknown_model")
    assert refusal(http.load_model, "broken", headers=admin()) == ("400", "bad_model")
    assert refusal(grpc.load_model, "broken", headers=admin())[0] == "StatusCode.INVALID_ARGUMENT"
    assert "broken" not in states(http)  # a folder that is not a model is not in the index


def test_load_and_unload_need_the_admin_token(
    http: triton_http.InferenceServerClient, grpc: triton_grpc.InferenceServerClient
) -> None:
    assert refusal(http.unload_model, "tiny", headers=infer()) == ("403", "forbidden")
    assert refusal(http.unload_model, "tiny") == ("401", "unauthorized")
    assert refusal(grpc.unload_model, "tiny", headers=infer())[0] == "StatusCode.PERMISSION_DENIED"
    assert states(http)["tiny"] == ("READY", "")
