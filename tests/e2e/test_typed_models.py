"""Every served tensor type and a declared sequence axis, end to end: a real daemon with one
ONNX Runtime executor serves generated models (fp16; int64 + bool + a scalar; six input types
at once; an embedding over ``tokens``; an audio model that needs ``samples`` >= 2), added
through the client API, and must answer exactly what ONNX Runtime computes directly with the
same session options at the same shapes. Wrong types and shapes get ``bad_input`` naming the
input, the expected and the given; an undeclared axis is refused at registration (several
lengths: tests/e2e/test_buckets.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from clockwork_async.api.async_client import ApiError
from clockwork_async.client import Client
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.dtypes import random_values
from typed_models import (
    AUDIO_TOML,
    SAMPLES,
    SEQUENCE_TOML,
    TOKENS,
    audio_model,
    fp16_model,
    ids_mask_scale_model,
    mixed_model,
    sequence_model,
)

from .harness import DaemonProcess, ort_executor, write_config

pytestmark = pytest.mark.slow
SLO_MS = 10_000.0
FAST_PROFILING = """
[profiler]
warmup_iterations = 1
iterations = 2
load_iterations = 1
"""
MODELS: dict[str, tuple[bytes, str | None]] = {
    "half": (fp16_model(), None),
    "masked": (ids_mask_scale_model(), None),
    "mixed": (mixed_model(), None),
    "seq": (sequence_model(), SEQUENCE_TOML),
    "vad": (audio_model(), AUDIO_TOML),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    folder = tmp_path_factory.mktemp("typed")
    config = write_config(folder, ort_executor(), sections=FAST_PROFILING)
    daemon = DaemonProcess.start(folder, config)
    try:
        with Client(daemon.api, timeout_s=120.0) as connected:
            for name, (data, toml) in MODELS.items():
                connected.add_model(name, data, toml)
            yield connected
    finally:
        assert daemon.stop() == 0, daemon.log()


def direct_run(data: bytes, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime on the file itself, as the executor runs it: fully optimised, sequential,
    one thread."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(None, dict(inputs)), strict=True))


def request_inputs(client: Client, model: str, seed: int) -> dict[str, np.ndarray]:
    """Random values at the shapes the daemon lists for ``model`` (ids kept in the table)."""
    (status,) = [m for m in client.models() if m.name == model]
    rng = np.random.default_rng(seed)
    shapes = {spec.name: tuple(1 if d == -1 else d for d in spec.shape) for spec in status.inputs}
    return {spec.name: random_values(rng, shapes[spec.name], spec.dtype) for spec in status.inputs}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_outputs_equal_onnx_runtime_run_directly(client: Client, model: str) -> None:
    for seed in range(3):
        inputs = request_inputs(client, model, seed)
        result = client.infer(model, inputs, slo_ms=SLO_MS)
        assert result.status == Outcome.OK, result.message
        expected = direct_run(MODELS[model][0], inputs)
        assert result.outputs.keys() == expected.keys()
        for name, array in expected.items():
            assert result.outputs[name].dtype == array.dtype, name
            np.testing.assert_array_equal(result.outputs[name], array, err_msg=name)


def test_the_daemon_lists_types_scalars_and_declared_lengths(client: Client) -> None:
    listed = {m.name: m for m in client.models()}
    assert [(s.name, s.dtype, s.shape) for s in listed["masked"].inputs] == [
        ("ids", "int64", (-1, 6)),
        ("mask", "bool", (-1, 6)),
        ("scale", "float32", ()),
    ]
    assert listed["masked"].batch_sizes == (1,)
    assert listed["half"].outputs[0].dtype == "float16"
    assert listed["seq"].inputs[0].shape == (-1, TOKENS)
    assert listed["vad"].inputs[0].shape == (-1, SAMPLES)
    assert max(listed["vad"].batch_sizes) > 1  # one declared length: requests batch


def test_batched_requests_of_the_declared_length_equal_a_direct_run(client: Client) -> None:
    rows = [request_inputs(client, "vad", seed) for seed in range(12)]
    futures = [client.submit("vad", row, slo_ms=SLO_MS) for row in rows]
    for row, future in zip(rows, futures, strict=True):
        result = future.result(60)
        assert result.status == Outcome.OK, result.message
        expected = direct_run(MODELS["vad"][0], row)["energy"]
        np.testing.assert_allclose(result.outputs["energy"], expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("model", "name", "value", "says"),
    [
        (
            "half",
            "x",
            np.zeros((1, 8), np.float32),
            "input 'x' has dtype float32, expected float16",
        ),
        (
            "masked",
            "mask",
            np.zeros((1, 6), np.uint8),
            "input 'mask' has dtype uint8, expected bool",
        ),
        (
            "masked",
            "scale",
            np.ones(1, np.float32),
            "input 'scale' has shape (1,), expected a scalar",
        ),
        ("mixed", "a", np.zeros((1, 3), np.int16), "input 'a' has dtype int16, expected int8"),
        (
            "seq",
            "ids",
            np.zeros((1, 7), np.int64),
            f"expected (1, {TOKENS}) (axis 1 takes only {TOKENS}, got 7)",
        ),
        ("vad", "audio", np.zeros((1, 300), np.float32), f"axis 1 takes only {SAMPLES}, got 300"),
    ],
)
def test_a_wrong_type_or_shape_is_bad_input_naming_input_expected_and_given(
    client: Client, model: str, name: str, value: np.ndarray, says: str
) -> None:
    inputs = {**request_inputs(client, model, 0), name: value}
    result = client.infer(model, inputs, slo_ms=SLO_MS)
    assert result.status == Outcome.BAD_INPUT
    assert says in result.message


def test_an_undeclared_axis_is_refused_at_registration(client: Client) -> None:
    with pytest.raises(ApiError, match=r"\[inputs.audio.axes\] samples = \[LENGTH\]") as caught:
        client.add_model("vad-undeclared", audio_model())
    assert caught.value.code == "bad_model"


@pytest.mark.shared_data
def test_a_real_fp16_model_is_served_like_a_direct_run(client: Client) -> None:
    path = (
        Path(__file__).resolve().parents[3] / "shared" / "data" / "models" / "squeezenet-fp16.onnx"
    )
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    data = path.read_bytes()
    status = client.add_model("squeezenet-fp16", data)
    try:
        assert [(s.dtype, s.shape) for s in status.inputs] == [("float16", (1, 3, 224, 224))]
        inputs = {"data_0": random_values(np.random.default_rng(5), (1, 3, 224, 224), "float16")}
        result = client.infer("squeezenet-fp16", inputs, slo_ms=SLO_MS)
        assert result.status == Outcome.OK, result.message
        (expected,) = direct_run(data, inputs).values()
        assert result.outputs["softmaxout_1"].dtype == np.float16
        np.testing.assert_array_equal(result.outputs["softmaxout_1"], expected)
    finally:
        client.remove_model("squeezenet-fp16")
