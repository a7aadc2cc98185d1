"""Every served tensor type and declared sequence lengths on each ONNX Runtime backend, in
process: the CPU backend, the IO-bound (CUDA) backend on host memory in both weight modes,
and on a GPU where there is one. Each registers the generated models (tests/typed_models.py)
at the declared input shapes, runs them at batch 1 and at the largest batch, and must give
what ONNX Runtime computes directly on the file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from clockwork_async.executors.arena import NumpyArena
from clockwork_async.executors.backend import Backend, BackendError
from clockwork_async.executors.device_ops import HostOps, cuda_unavailable_reason, open_cuda
from clockwork_async.executors.onnxruntime import OnnxRuntimeBackend
from clockwork_async.executors.onnxruntime_cuda import BoundOrtBackend
from clockwork_async.executors.pages import PageCache

from clockwork_async.wire.dtypes import batch_shape, random_values
from clockwork_async.wire.messages import ErrorCode, TensorSpec
from typed_models import (
    SAMPLES,
    TOKENS,
    audio_model,
    fp16_model,
    ids_mask_scale_model,
    mixed_model,
    sequence_model,
)

MIB = 1 << 20
PAGES = 16
CUDA_REASON = cuda_unavailable_reason("cuda:0")
MODELS: dict[str, tuple[Callable[[], bytes], tuple[TensorSpec, ...]]] = {
    "half": (fp16_model, ()),
    "masked": (ids_mask_scale_model, ()),
    "mixed": (mixed_model, ()),
    "seq": (sequence_model, (TensorSpec("ids", "int64", (-1, TOKENS)),)),
    "vad": (audio_model, (TensorSpec("audio", "float32", (-1, SAMPLES)),)),
}


def _bound(ops: Any, mode: str) -> BoundOrtBackend:
    return BoundOrtBackend(
        ops,
        page_bytes=4096,
        pages_total=PAGES,
        io_bytes=MIB,
        workspace_bytes=64 * MIB,
        weights_mode=mode,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module", params=["cpu", "bound-inputs", "bound-initializers", "cuda-inputs"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    if request.param == "cpu":
        work = tmp_path_factory.mktemp("work")
        made: Backend = OnnxRuntimeBackend(NumpyArena(4096, PAGES), work_dir=str(work))
    elif request.param == "cuda-inputs":
        if CUDA_REASON is not None:
            pytest.skip(f"no CUDA device: {CUDA_REASON}")
        made = _bound(open_cuda("cuda:0"), "inputs")
    else:
        made = _bound(HostOps(), request.param.removeprefix("bound-"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("typed")
    paths = {}
    for name, (build, _) in MODELS.items():
        paths[name] = folder / f"{name}.onnx"
        paths[name].write_bytes(build())
    return paths


def direct_run(path: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return list(session.run(None, inputs))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_equal_a_direct_run_at_the_declared_shapes(
    backend: Backend, files: dict[str, Path], name: str
) -> None:
    declared = MODELS[name][1]
    model = backend.register(name, str(files[name]), [], declared)
    assert not declared or tuple(model.inputs) == declared
    runs = PageCache(PAGES).allocate(model.run_pages)
    loaded, _ = backend.load(model, runs)
    try:
        for batch_size in sorted({1, max(model.batch_sizes)}):
            rng = np.random.default_rng(batch_size)
            inputs = {
                spec.name: random_values(rng, batch_shape(spec.shape, batch_size), spec.dtype)
                for spec in model.inputs
            }
            outputs, _ = backend.infer(loaded, batch_size, inputs)
            expected = direct_run(files[name], inputs)
            for spec, want in zip(model.outputs, expected, strict=True):
                got = outputs[spec.name]
                assert got.dtype == want.dtype and got.shape == want.shape, spec.name
                if want.dtype.kind == "f":
                    np.testing.assert_allclose(got, want, rtol=2e-3 if want.itemsize == 2 else 1e-5)
                else:
                    np.testing.assert_array_equal(got, want)
    finally:
        backend.unload(loaded)
        backend.unregister(model)


def test_declared_shapes_that_do_not_fit_the_file_are_bad_model(
    backend: Backend, files: dict[str, Path]
) -> None:
    wrong = (TensorSpec("ids", "int32", (-1, TOKENS)),)
    with pytest.raises(BackendError, match="declared int32") as caught:
        backend.register("wrong", str(files["seq"]), [], wrong)
    assert caught.value.code is ErrorCode.BAD_MODEL
