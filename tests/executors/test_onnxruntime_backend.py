"""The ONNX Runtime backend: registration, weights that stay in the arena, exact outputs,
UNLOAD that really releases the pages, and named errors."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from clockwork_async.executors import onnxruntime as onnxruntime_backend
from clockwork_async.executors.arena import NumpyArena
from clockwork_async.executors.backend import Backend, BackendError, PageRun
from clockwork_async.executors.onnxruntime import (
    DEFAULT_BATCH_SIZES,
    OnnxRuntimeBackend,
    OrtLoadedModel,
    OrtRegisteredModel,
    Prepacking,
    session_options,
)
from clockwork_async.executors.pages import PageCache
from onnx import TensorProto, helper, numpy_helper

from clockwork_async.models.demo import generate_demo_models
from clockwork_async.wire.messages import ErrorCode, TensorSpec

PAGE_BYTES = 1024  # tiny's 2 KB first weight is larger than a page: it gets a run of 2


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo-models")
    generate_demo_models(directory, names=["tiny"])
    return directory


@pytest.fixture(scope="module")
def tiny_path(models_dir: Path) -> str:
    return str(models_dir / "tiny.onnx")


def make_backend(
    tmp_path: Path, prepacking: Prepacking = "off", pages: int = 8
) -> Iterator[tuple[OnnxRuntimeBackend, PageCache]]:
    backend = OnnxRuntimeBackend(
        NumpyArena(PAGE_BYTES, pages), work_dir=str(tmp_path / "work"), prepacking=prepacking
    )
    try:
        yield backend, PageCache(pages)
    finally:
        backend.close()


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[tuple[OnnxRuntimeBackend, PageCache]]:
    yield from make_backend(tmp_path)


def batch_of(
    specs: tuple[TensorSpec, ...], batch_size: int, seed: int = 1
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        spec.name: rng.standard_normal([batch_size if d == -1 else d for d in spec.shape]).astype(
            spec.dtype
        )
        for spec in specs
    }


def direct_session(model: OrtRegisteredModel) -> ort.InferenceSession:
    """The same optimised graph with its weights put back inline, same session options."""
    graph = onnx.load(str(model.graph_path), load_external_data=False)
    host = {tensor.name: tensor.array for tensor in model.tensors}
    for index, proto in enumerate(graph.graph.initializer):
        if proto.name in host:
            graph.graph.initializer[index].CopyFrom(
                numpy_helper.from_array(host[proto.name], proto.name)
            )
    return ort.InferenceSession(
        graph.SerializeToString(),
        session_options(1, model.prepacked),
        providers=["CPUExecutionProvider"],
    )


def fixed_batch_model(path: Path) -> str:
    """x [1, 2, 4] -> Reshape(int64 shape [1, 8]) -> Add(bias) -> y [1, 8]: no Gemm."""
    shape = numpy_helper.from_array(np.array([1, 8], np.int64), "shape")
    bias = numpy_helper.from_array(np.arange(8, dtype=np.float32), "bias")
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["flat"]),
            helper.make_node("Add", ["flat", "bias"], ["y"]),
        ],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [shape, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return str(path)


def test_backend_satisfies_the_protocol(backend: tuple[OnnxRuntimeBackend, PageCache]) -> None:
    typed: Backend = backend[0]
    assert (typed.name, typed.device, typed.lanes) == ("onnxruntime", "cpu", ("load", "execute"))
    assert typed.kind.startswith(f"onnxruntime-{ort.__version__}-cpu-")


def test_register_reads_specs_pages_and_default_batches(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str
) -> None:
    model = backend[0].register("tiny", tiny_path, [])
    assert model.inputs == (TensorSpec("x", "float32", (-1, 16)),)
    assert model.outputs == (TensorSpec("y", "float32", (-1, 4)),)
    assert model.batch_sizes == DEFAULT_BATCH_SIZES
    assert model.weights_bytes == (16 * 32 + 32 + 32 * 4 + 4) * 4
    assert model.inline_bytes == 0
    assert model.run_pages == (2, 1)  # the 2 KB weight alone; the rest packed in one page
    assert not model.prepacked and model.extra_host_bytes == 0
    offsets = [tensor.placement.offset_bytes for tensor in model.tensors]
    assert all(offset % 64 == 0 for offset in offsets)


def test_requested_batch_sizes_are_sorted_and_unique(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str
) -> None:
    assert backend[0].register("tiny", tiny_path, [8, 2, 2]).batch_sizes == (2, 8)
    with pytest.raises(BackendError) as caught:
        backend[0].register("tiny", tiny_path, [0])
    assert caught.value.code is ErrorCode.BAD_MODEL


def test_fixed_batch_model_runs_batch_one_with_shape_constants_inline(
    backend: tuple[OnnxRuntimeBackend, PageCache], tmp_path: Path
) -> None:
    ort_backend, cache = backend
    path = fixed_batch_model(tmp_path / "fixed.onnx")
    model = ort_backend.register("fixed", path, [])
    assert model.batch_sizes == (1,)
    assert model.inline_bytes == 16 and model.weights_bytes == 32
    assert model.prepack_measurement is None  # nothing ONNX Runtime would prepack
    with pytest.raises(BackendError, match="fixed batch") as caught:
        ort_backend.register("fixed", path, [1, 4])
    assert caught.value.code is ErrorCode.BAD_MODEL
    runs = cache.allocate(model.run_pages)
    loaded, _ = ort_backend.load(model, runs)
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    outputs, _ = ort_backend.infer(loaded, 1, {"x": x})
    np.testing.assert_array_equal(outputs["y"], 2 * np.arange(8, dtype=np.float32)[None])
    ort_backend.unload(loaded)
    cache.free(runs)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "no such file"), (b"not a model", "not a readable ONNX model")],
)
def test_unreadable_files_are_bad_models(
    backend: tuple[OnnxRuntimeBackend, PageCache],
    tmp_path: Path,
    content: bytes | None,
    reason: str,
) -> None:
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(BackendError, match=reason) as caught:
        backend[0].register("m", str(path), [])
    assert caught.value.code is ErrorCode.BAD_MODEL


def test_an_invalid_graph_is_a_bad_model(
    backend: tuple[OnnxRuntimeBackend, PageCache], tmp_path: Path
) -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
    )
    path = tmp_path / "broken.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(BackendError, match="ONNX Runtime cannot load it") as caught:
        backend[0].register("broken", str(path), [])
    assert caught.value.code is ErrorCode.BAD_MODEL


@pytest.mark.parametrize("prepacking", ["off", "on"])
def test_outputs_match_a_direct_run_bit_for_bit_and_a_default_session(
    tmp_path: Path, tiny_path: str, prepacking: Prepacking
) -> None:
    for ort_backend, cache in make_backend(tmp_path, prepacking):
        model = ort_backend.register("tiny", tiny_path, [])
        assert model.prepacked is (prepacking == "on")
        runs = cache.allocate(model.run_pages)
        loaded, durations = ort_backend.load(model, runs)
        assert set(durations) == {"load"} and durations["load"] > 0
        direct = direct_session(model)
        default = ort.InferenceSession(tiny_path, providers=["CPUExecutionProvider"])
        for batch_size in model.batch_sizes:
            inputs = batch_of(model.inputs, batch_size)
            outputs, phases = ort_backend.infer(loaded, batch_size, inputs)
            assert set(phases) == {"copy_in", "execute", "copy_out"}
            assert all(value >= 0 for value in phases.values())
            assert outputs["y"].shape == (batch_size, 4)
            np.testing.assert_array_equal(outputs["y"], direct.run(None, inputs)[0])
            np.testing.assert_allclose(outputs["y"], default.run(None, inputs)[0], rtol=1e-5)
        ort_backend.unload(loaded)
        cache.free(runs)


def test_weights_live_in_the_arena_without_prepacking(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str
) -> None:
    ort_backend, cache = backend
    model = ort_backend.register("tiny", tiny_path, [])
    runs = cache.allocate(model.run_pages)
    loaded, _ = ort_backend.load(model, runs)
    inputs = batch_of(model.inputs, 2)
    before = ort_backend.infer(loaded, 2, inputs)[0]["y"]
    for run in runs:
        ort_backend.arena.view(run)[:] = 0  # every weight and bias becomes zero
    after = ort_backend.infer(loaded, 2, inputs)[0]["y"]
    assert before.any()
    np.testing.assert_array_equal(after, np.zeros_like(before))
    ort_backend.unload(loaded)
    cache.free(runs)


def test_prepacking_copies_exactly_the_gemm_weights_it_counts(
    tmp_path: Path, tiny_path: str
) -> None:
    for ort_backend, cache in make_backend(tmp_path, "on"):
        model = ort_backend.register("tiny", tiny_path, [])
        gemm_weights = {"fc0.weight", "fc1.weight"}
        assert model.extra_host_bytes == (32 * 16 + 4 * 32) * 4
        runs = cache.allocate(model.run_pages)
        loaded = ort_backend.load(model, runs)[0]
        inputs = batch_of(model.inputs, 1)
        before = ort_backend.infer(loaded, 1, inputs)[0]["y"]
        for name, value in loaded.values.items():
            value.numpy()[...] *= 2  # the OrtValue's memory is the arena
            changed = not np.array_equal(before, ort_backend.infer(loaded, 1, inputs)[0]["y"])
            value.numpy()[...] /= 2
            assert changed is (name not in gemm_weights), name
        ort_backend.unload(loaded)
        cache.free(runs)


def test_measured_prepacking_decision_is_recorded(tmp_path: Path, tiny_path: str) -> None:
    for ort_backend, _ in make_backend(tmp_path, "measure"):
        model = ort_backend.register("tiny", tiny_path, [1, 4])
        measurement = model.prepack_measurement
        assert measurement is not None and measurement.batch_size == 4
        assert measurement.in_place_ns > 0 and measurement.prepacked_ns > 0
        assert model.extra_host_bytes == (2560 if model.prepacked else 0)


def test_a_slow_model_is_measured_at_its_smallest_batch(
    tmp_path: Path, tiny_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(onnxruntime_backend, "SLOW_CHECK_NS", 0)  # every model is slow now
    for ort_backend, _ in make_backend(tmp_path, "measure"):
        model = ort_backend.register("tiny", tiny_path, [2, 4])
        measurement = model.prepack_measurement
        assert measurement is not None and measurement.batch_size == 2


def test_unloaded_pages_serve_the_next_model_and_the_old_handle_is_dead(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str, tmp_path: Path
) -> None:
    ort_backend, cache = backend
    model_a = ort_backend.register("a", tiny_path, [])
    generate_demo_models(tmp_path / "other", seed=7, names=["tiny"])
    other_path = str(tmp_path / "other" / "tiny.onnx")
    model_b = ort_backend.register("b", other_path, [])
    runs = cache.allocate(model_a.run_pages)
    loaded_a, _ = ort_backend.load(model_a, runs)
    assert isinstance(loaded_a, OrtLoadedModel)
    session_a = weakref.ref(loaded_a.session)
    ort_backend.unload(loaded_a)
    assert session_a() is None  # nothing can read the pages any more
    cache.free(runs)
    runs_b = cache.allocate(model_b.run_pages)
    assert runs_b == runs
    loaded_b, _ = ort_backend.load(model_b, runs_b)
    inputs = batch_of(model_b.inputs, 4)
    expected = ort.InferenceSession(other_path, providers=["CPUExecutionProvider"]).run(
        None, inputs
    )
    outputs, _ = ort_backend.infer(loaded_b, 4, inputs)
    np.testing.assert_allclose(outputs["y"], expected[0], rtol=1e-5)
    for action in (
        lambda: ort_backend.infer(loaded_a, 4, inputs),
        lambda: ort_backend.unload(loaded_a),
    ):
        with pytest.raises(BackendError, match="not loaded") as caught:
            action()
        assert caught.value.code is ErrorCode.NOT_LOADED
    ort_backend.unload(loaded_b)
    cache.free(runs_b)


def test_load_needs_the_right_runs_and_a_registered_model(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str
) -> None:
    ort_backend, _ = backend
    model = ort_backend.register("tiny", tiny_path, [])
    with pytest.raises(BackendError, match="needs runs of") as caught:
        ort_backend.load(model, [PageRun(0, 1)])
    assert caught.value.code is ErrorCode.INTERNAL
    ort_backend.unregister(model)
    assert not model.graph_path.exists()
    for action in (
        lambda: ort_backend.load(model, [PageRun(0, 2), PageRun(2, 1)]),
        lambda: ort_backend.unregister(model),
    ):
        with pytest.raises(BackendError) as caught:
            action()
        assert caught.value.code is ErrorCode.UNKNOWN_MODEL


def test_inputs_onnx_runtime_rejects_are_bad_input_and_the_model_keeps_serving(
    backend: tuple[OnnxRuntimeBackend, PageCache], tiny_path: str
) -> None:
    ort_backend, cache = backend
    model = ort_backend.register("tiny", tiny_path, [])
    runs = cache.allocate(model.run_pages)
    loaded, _ = ort_backend.load(model, runs)
    bad = {"x": np.zeros((2, 15), np.float32)}
    with pytest.raises(BackendError) as caught:
        ort_backend.infer(loaded, 2, bad)
    assert caught.value.code is ErrorCode.BAD_INPUT
    assert ort_backend.infer(loaded, 2, batch_of(model.inputs, 2))[0]["y"].shape == (2, 4)
    ort_backend.unload(loaded)
    cache.free(runs)


def test_close_removes_a_temporary_work_dir_but_keeps_a_given_one(
    tmp_path: Path, tiny_path: str
) -> None:
    temporary = OnnxRuntimeBackend(NumpyArena(PAGE_BYTES, 4), prepacking="off")
    temporary.register("tiny", tiny_path, [])
    assert temporary.work_dir.is_dir()
    temporary.close()
    assert not temporary.work_dir.exists()
    given = OnnxRuntimeBackend(NumpyArena(PAGE_BYTES, 4), work_dir=str(tmp_path / "w"))
    model = given.register("tiny", tiny_path, [])
    given.close()
    assert (tmp_path / "w").is_dir() and not model.graph_path.exists()


def test_resnet_like_weights_span_pages_and_match_a_default_session(tmp_path: Path) -> None:
    path = generate_demo_models(tmp_path / "models", names=["resnet-like"])["resnet-like"]
    backend = OnnxRuntimeBackend(NumpyArena(16 << 20, 2), work_dir=str(tmp_path / "w"))
    try:
        model = backend.register("resnet-like", str(path), [1, 4])
        assert model.run_pages == (1, 1)
        assert 19_000_000 < model.weights_bytes < 21_000_000
        runs = PageCache(2).allocate(model.run_pages)
        loaded, _ = backend.load(model, runs)
        default = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs = batch_of(model.inputs, 4)
        outputs, _ = backend.infer(loaded, 4, inputs)
        np.testing.assert_allclose(
            outputs["logits"], default.run(None, inputs)[0], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(outputs["logits"], direct_session(model).run(None, inputs)[0])
        backend.unload(loaded)
    finally:
        backend.close()
