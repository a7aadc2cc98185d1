"""The CUDA executor: device flags and named errors, pool and IO arithmetic, graph preparation,
and the IO-bound backend itself. The backend runs here on `HostOps` (host memory, ONNX
Runtime's CPU provider: the same code path, addresses bound by IO binding); the tests marked
``needs_cuda`` run it on a GPU and skip elsewhere with the reason. The conformance suite
runs the CUDA executor as a process (test_conformance.py, ``onnxruntime-cuda``)."""

from __future__ import annotations

import argparse
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from clockwork_async.executors.backend import BackendError, PageRun
from clockwork_async.executors.cuda_arena import (
    IO_ALIGN_BYTES,
    CudaUnavailable,
    import_cupy,
    plan_pools,
)
from clockwork_async.executors.device_ops import (
    HostOps,
    buffer_address,
    cuda_index,
    cuda_unavailable_reason,
    open_cuda,
)
from clockwork_async.executors.flags import parse_device
from clockwork_async.executors.host import ExecutorHost
from clockwork_async.executors.onnxruntime_cuda import BoundLoaded, BoundOrtBackend, WeightsMode
from clockwork_async.executors.ort_binding import (
    host_read_initializers,
    io_layout,
    split_weights,
    weights_as_inputs,
)
from clockwork_async.executors.pages import PageCache
from onnx import TensorProto, helper, numpy_helper

from clockwork_async.models.demo import generate_demo_models
from clockwork_async.runtime.supervisor import ExecutorSpec
from clockwork_async.wire.messages import (
    ActionResult,
    ErrorCode,
    Infer,
    Load,
    Message,
    RegisterModel,
    Unload,
)

from .harness import NEVER_NS, executor_command

MIB = 1 << 20
CUDA_REASON = cuda_unavailable_reason("cuda:0")
needs_cuda = pytest.mark.skipif(CUDA_REASON is not None, reason=f"no CUDA device: {CUDA_REASON}")
MODES: tuple[WeightsMode, ...] = ("inputs", "initializers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return generate_demo_models(tmp_path_factory.mktemp("models"), names=["tiny", "resnet-like"])


def host_backend(
    mode: WeightsMode, page_bytes: int = 1024, pages: int = 8, io_bytes: int = MIB
) -> BoundOrtBackend:
    return BoundOrtBackend(
        HostOps(),
        page_bytes=page_bytes,
        pages_total=pages,
        io_bytes=io_bytes,
        workspace_bytes=64 * MIB,
        weights_mode=mode,
    )


def batch_of(model: Any, batch_size: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        spec.name: rng.standard_normal([batch_size if d == -1 else d for d in spec.shape]).astype(
            spec.dtype
        )
        for spec in model.inputs
    }


# --- flags and named errors -----------------------------------------------------------------


def test_devices_parse() -> None:
    for text in ("cpu", "sim", "cuda:0", "cuda:12"):
        assert parse_device(text) == text
    for bad in ("gpu", "cuda", "cuda:", "cuda:123", "CUDA:0"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a device"):
            parse_device(bad)
    assert cuda_index("cuda:3") == 3
    with pytest.raises(ValueError, match="not a CUDA device"):
        cuda_index("cpu")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--device", "tpu"), ("not a device",)),
        (("--backend", "simulated", "--device", "cuda:0"), ("uses no device",)),
        (("--backend", "onnxruntime", "--device", "sim"), ("runs on cpu or cuda:N",)),
        # Without CuPy, without a GPU, or on a GPU machine (no 99th device): a sentence.
        (("--device", "cuda:99"), ("needs CuPy", "no CUDA device", "does not exist")),
    ],
)
def test_bad_devices_exit_2_with_a_sentence(
    flags: tuple[str, ...], expected: tuple[str, ...]
) -> None:
    done = subprocess.run(executor_command(list(flags)), capture_output=True, timeout=120)
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert any(text in stderr for text in expected), stderr


def test_without_cupy_the_reason_names_it() -> None:
    try:
        import_cupy()
    except CudaUnavailable as error:
        assert "CuPy" in error.message and "clockwork-async[gpu]" in error.message
        with pytest.raises(CudaUnavailable, match="CuPy"):
            open_cuda("cuda:0")
    else:
        pytest.skip("CuPy is installed here")


def test_supervisor_passes_the_device_only_when_not_cpu() -> None:
    assert "--device" not in ExecutorSpec("a").argv("unix:/x")
    argv = ExecutorSpec("g", device="cuda:1").argv("unix:/x")
    assert argv[argv.index("--device") + 1] == "cuda:1"


# --- pools and IO layout ---------------------------------------------------------------------


def test_pools_are_planned_in_pages_and_checked_against_free_memory() -> None:
    plan = plan_pools(16 * MIB, 100 * MIB, 1000, 64 * MIB, free_bytes=1 << 30)
    assert (plan.pages_total, plan.weights_bytes) == (6, 96 * MIB)  # whole pages only
    assert plan.io_bytes == 1024  # rounded up to 256
    assert plan.allocated_bytes == 96 * MIB + 1024
    with pytest.raises(CudaUnavailable, match="MiB free; lower --weights-bytes"):
        plan_pools(16 * MIB, 1 << 30, MIB, 64 * MIB, free_bytes=1 << 30)
    with pytest.raises(ValueError):
        plan_pools(100, MIB, MIB, MIB, free_bytes=1 << 40)


def test_io_layout_puts_inputs_then_outputs_256_aligned() -> None:
    layout = io_layout(
        [("a", "float32", (2, 3)), ("b", "int64", (2,))],
        [("y", "float16", (2, 5)), ("z", "float32", (1,))],
    )
    assert [s.offset_bytes for s in layout.inputs] == [0, 256]
    assert layout.inputs_bytes == 512 and layout.outputs_offset == 512
    assert [s.offset_bytes for s in layout.outputs] == [512, 768]
    assert layout.total_bytes == 1024
    assert all(s.offset_bytes % IO_ALIGN_BYTES == 0 for s in layout.inputs + layout.outputs)
    assert [s.nbytes for s in layout.outputs] == [20, 4]


# --- graph preparation ----------------------------------------------------------------------


def clip_model(path: Path) -> str:
    """x [N, 4] -> MatMul(w) -> Clip(lo, hi) -> y: Clip's float bounds are read on the host."""
    tensors = [
        numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w"),
        numpy_helper.from_array(np.array(-1.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(1.0, np.float32), "hi"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Clip", ["h", "lo", "hi"], ["y"]),
        ],
        "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    return str(path)


def test_host_read_floats_stay_inline_and_weights_become_inputs(tmp_path: Path) -> None:
    model = onnx.load(clip_model(tmp_path / "clip.onnx"))
    assert host_read_initializers(model) == {"lo", "hi"}
    weights, inline_bytes = split_weights(model)
    assert [name for name, _ in weights] == ["w"] and inline_bytes == 8
    weights_as_inputs(model, ["w"])
    assert [p.name for p in model.graph.initializer] == ["lo", "hi"]
    assert [v.name for v in model.graph.input] == ["x", "w"]
    shape = model.graph.input[1].type.tensor_type.shape
    assert [d.dim_value for d in shape.dim] == [4, 4]


# --- the backend on the host ----------------------------------------------------------------


@pytest.fixture(params=MODES)
def backend(request: pytest.FixtureRequest) -> Iterator[BoundOrtBackend]:
    backend = host_backend(request.param)
    try:
        yield backend
    finally:
        backend.close()


def test_backend_names_itself(backend: BoundOrtBackend) -> None:
    assert (backend.name, backend.device, backend.lanes) == (
        "onnxruntime",
        "cpu",
        ("load", "execute"),
    )
    assert backend.kind == f"onnxruntime-{ort.__version__}-cpu-{backend.weights_mode}"
    assert backend.device_clock_mhz() == 0


def test_outputs_match_a_default_session_and_weights_stay_in_the_pages(
    backend: BoundOrtBackend, models: dict[str, Path]
) -> None:
    model = backend.register("tiny", str(models["tiny"]), [])
    assert model.run_pages == (2, 1) and model.batch_sizes == (1, 2, 4, 8, 16)
    cache = PageCache(backend.arena.pages_total)
    runs = cache.allocate(model.run_pages)
    loaded, durations = backend.load(model, runs)
    assert set(durations) == {"load"} and durations["load"] > 0
    default = ort.InferenceSession(str(models["tiny"]), providers=["CPUExecutionProvider"])
    for batch_size in model.batch_sizes:
        inputs = batch_of(model, batch_size)
        outputs, phases = backend.infer(loaded, batch_size, inputs)
        assert set(phases) == {"copy_in", "execute", "copy_out"}
        np.testing.assert_allclose(outputs["y"], default.run(None, inputs)[0], rtol=1e-5, atol=1e-6)
    for address in loaded.addresses.values():  # every weight is bound inside the pages
        views = [backend.arena.view(run) for run in runs]
        assert any(buffer_address(v) <= address < buffer_address(v) + v.nbytes for v in views)
    for run in runs:
        backend.arena.view(run)[:] = 0  # weights and biases become zero: so must the output
    outputs, _ = backend.infer(loaded, 2, batch_of(model, 2))
    np.testing.assert_array_equal(outputs["y"], np.zeros((2, 4), np.float32))
    backend.unload(loaded)
    cache.free(runs)


def test_outputs_are_owned_by_the_caller(backend: BoundOrtBackend, models: dict[str, Path]) -> None:
    model = backend.register("tiny", str(models["tiny"]), [1])
    runs = PageCache(backend.arena.pages_total).allocate(model.run_pages)
    loaded, _ = backend.load(model, runs)
    first, _ = backend.infer(loaded, 1, batch_of(model, 1, seed=1))
    kept = first["y"].copy()
    backend.infer(loaded, 1, batch_of(model, 1, seed=2))  # reuses the IO buffer and staging
    np.testing.assert_array_equal(first["y"], kept)
    backend.unload(loaded)


def test_an_unloaded_handle_is_dead(backend: BoundOrtBackend, models: dict[str, Path]) -> None:
    model = backend.register("tiny", str(models["tiny"]), [])
    runs = PageCache(backend.arena.pages_total).allocate(model.run_pages)
    loaded, _ = backend.load(model, runs)
    assert isinstance(loaded, BoundLoaded)
    backend.unload(loaded)
    assert loaded.binding is None and loaded.session is None and not loaded.values
    for action in (
        lambda: backend.infer(loaded, 1, batch_of(model, 1)),
        lambda: backend.unload(loaded),
    ):
        with pytest.raises(BackendError, match="not loaded") as caught:
            action()
        assert caught.value.code is ErrorCode.NOT_LOADED
    again, _ = backend.load(model, runs)  # the same model loads again into the same pages
    assert backend.infer(again, 4, batch_of(model, 4))[0]["y"].shape == (4, 4)
    backend.unload(again)
    backend.unregister(model)
    assert not model.graph_path.exists()
    with pytest.raises(BackendError) as caught:
        backend.load(model, runs)
    assert caught.value.code is ErrorCode.UNKNOWN_MODEL


def test_the_io_buffer_bounds_the_batch_sizes(models: dict[str, Path]) -> None:
    # resnet-like: 12 KiB of image and 4 KB of logits per item; b4 needs 65,280 bytes.
    backend = host_backend("inputs", page_bytes=16 * MIB, pages=2, io_bytes=48 * 1024)
    try:
        model = backend.register("r", str(models["resnet-like"]), [])
        assert model.batch_sizes == (1, 2)  # 4, 8 and 16 are dropped from the defaults
        assert model.layouts[2].total_bytes == 32_768
        with pytest.raises(
            BackendError, match=r"batch size 4 needs 65280 bytes .*\(--io-bytes\)"
        ) as caught:
            backend.register("r4", str(models["resnet-like"]), [1, 4])
        assert caught.value.code is ErrorCode.BAD_MODEL
    finally:
        backend.close()


def test_host_read_inputs_run_and_dynamic_axes_are_refused(tmp_path: Path) -> None:
    backend = host_backend("inputs")
    try:
        model = backend.register("clip", clip_model(tmp_path / "clip.onnx"), [])
        assert model.inline_bytes == 8 and model.weights_bytes == 64
        runs = PageCache(8).allocate(model.run_pages)
        loaded, _ = backend.load(model, runs)
        x = np.array([[0.25, -3.0, 3.0, 0.125]], np.float32)
        expected = np.array([[0.5, -1, 1, 0.25]], np.float32)  # 2x, clipped to [-1, 1]
        np.testing.assert_array_equal(backend.infer(loaded, 1, {"x": x})[0]["y"], expected)
        backend.unload(loaded)
        graph = onnx.load(str(tmp_path / "clip.onnx"))
        graph.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "K"
        onnx.save(graph, str(tmp_path / "dynamic.onnx"))
        with pytest.raises(BackendError, match="dynamic axis after the batch axis") as caught:
            backend.register("dynamic", str(tmp_path / "dynamic.onnx"), [])
        assert caught.value.code is ErrorCode.BAD_MODEL
    finally:
        backend.close()


class Replies:
    """The host's replies (delivered in lane threads here) by action id."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.by_id: dict[int, list[Message]] = {}

    def __call__(self, message: Message) -> None:
        with self._cond:
            self.by_id.setdefault(getattr(message, "action_id", -1), []).append(message)
            self._cond.notify_all()

    def wait(self, action_id: int, timeout_s: float = 30.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: action_id in self.by_id, timeout_s)


class _ClockedHostOps(HostOps):
    """Host ops that report a device clock, to see the host carry it into results."""

    def clock_mhz(self) -> int:
        return 1980


def test_the_host_reports_the_device_clock_with_each_result(models: dict[str, Path]) -> None:
    backend = BoundOrtBackend(
        _ClockedHostOps(), page_bytes=1024, pages_total=4, io_bytes=MIB, workspace_bytes=MIB
    )
    host = ExecutorHost(backend, PageCache(4))
    replies = Replies()
    host.start(lambda callback: callback())
    x = np.ones((1, 16), np.float32)
    try:
        for action in (
            RegisterModel(1, "tiny", str(models["tiny"])),
            Load(2, "tiny", 0, NEVER_NS),
            Infer(3, "tiny", 1, {"x": x}, 0, NEVER_NS),
            Infer(4, "tiny", 2, {"x": x}, 0, NEVER_NS),  # refused on arrival: never ran
            Unload(5, "tiny"),
        ):
            host.submit(action, replies)
            replies.wait(action.action_id)
    finally:
        host.close()
    results = {i: replies.by_id[i][0] for i in (2, 3, 4)}
    assert all(isinstance(r, ActionResult) for r in results.values())
    assert results[2].ok and results[3].ok, results  # type: ignore[union-attr]
    assert [r.device_clock_mhz for r in results.values()] == [1980, 1980, 0]  # type: ignore[union-attr]
    assert results[4].code == ErrorCode.BAD_INPUT  # type: ignore[union-attr]


# --- on a GPU -------------------------------------------------------------------------------


@needs_cuda
def test_cupy_arena_views_are_device_memory_without_copies() -> None:
    cupy = import_cupy()
    from clockwork_async.executors.arena import ArenaRangeError
    from clockwork_async.executors.cuda_arena import CupyArena, pinned_host_array

    arena = CupyArena(4096, 4, device_id=0)
    part = arena.view(PageRun(1, 2))
    assert isinstance(part, cupy.ndarray) and part.nbytes == 2 * 4096
    assert (
        arena.address(PageRun(1, 2)) == buffer_address(part) == arena.address(PageRun(0, 1)) + 4096
    )
    part[:] = 7
    whole = cupy.asnumpy(arena.view(PageRun(0, 4)))
    assert (whole[4096 : 3 * 4096] == 7).all() and not whole[:4096].any()
    with pytest.raises(ArenaRangeError):
        arena.view(PageRun(3, 2))
    arena.close()
    pinned = pinned_host_array(1000)
    assert pinned.nbytes == 1000 and not pinned.any()


@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["tiny", "resnet-like"])
def test_on_the_gpu_outputs_match_and_weights_stay_in_device_pages(
    models: dict[str, Path], mode: WeightsMode, name: str
) -> None:
    from clockwork_async.executors.onnxruntime_cuda import make_cuda_backend

    backend = make_cuda_backend(
        "cuda:0",
        page_bytes=16 * MIB,
        weights_bytes=64 * MIB,
        io_bytes=16 * MIB,
        workspace_bytes=256 * MIB,
        weights_mode=mode,
    )
    try:
        assert backend.device == "cuda:0" and "-cuda-" in backend.kind
        model = backend.register(name, str(models[name]), [1, 4])
        cache = PageCache(backend.arena.pages_total)
        runs = cache.allocate(model.run_pages)
        loaded, durations = backend.load(model, runs)
        assert durations["load"] >= durations["load_gpu"] > 0
        reference = ort.InferenceSession(str(models[name]), providers=["CPUExecutionProvider"])
        output = model.outputs[0].name
        for batch_size in model.batch_sizes:
            inputs = batch_of(model, batch_size)
            outputs, phases = backend.infer(loaded, batch_size, inputs)
            assert {"copy_in", "execute", "copy_out", "execute_gpu", "copy_in_gpu"} <= set(phases)
            assert phases["execute"] >= phases["execute_gpu"] > 0
            expected = reference.run(None, inputs)[0]
            # TF32 convolutions and matrix products: compare at the outputs' own scale.
            scale = float(np.abs(expected).max())
            np.testing.assert_allclose(outputs[output], expected, atol=5e-2 * scale)
        for run in runs:
            backend.arena.view(run)[:] = 0
        zeroed, _ = backend.infer(loaded, 1, batch_of(model, 1))
        assert not zeroed[output].any()  # every weight is read from the pages
        backend.unload(loaded)
        cache.free(runs)
    finally:
        backend.close()
