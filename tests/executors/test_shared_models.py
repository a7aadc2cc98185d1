"""Real models no one here wrote (../shared/data/models), when present: each registers, loads
into arena pages and answers like a default ONNX Runtime session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from clockwork_async.executors.arena import NumpyArena
from clockwork_async.executors.onnxruntime import DEFAULT_BATCH_SIZES, OnnxRuntimeBackend
from clockwork_async.executors.pages import PageCache

MODELS_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "models"
PAGE_BYTES = 1 << 20
PAGES = 8

pytestmark = pytest.mark.shared_data


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[OnnxRuntimeBackend]:
    backend = OnnxRuntimeBackend(NumpyArena(PAGE_BYTES, PAGES), work_dir=str(tmp_path))
    try:
        yield backend
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("file_name", "batch_sizes"),
    [
        ("mnist-8.onnx", (1,)),  # fixed batch, an int64 Reshape shape kept inline
        ("cifar10-classifier.onnx", DEFAULT_BATCH_SIZES),
        ("squeezenet-fp16.onnx", (1,)),  # float16 weights and outputs
    ],
)
def test_shared_model_answers_like_a_default_session(
    backend: OnnxRuntimeBackend, file_name: str, batch_sizes: tuple[int, ...]
) -> None:
    path = MODELS_DIR / file_name
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    model = backend.register(file_name, str(path), [])
    assert model.batch_sizes == batch_sizes
    cache = PageCache(PAGES)
    runs = cache.allocate(model.run_pages)
    loaded, _ = backend.load(model, runs)
    default = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for batch_size in sorted({batch_sizes[0], batch_sizes[-1]}):
        inputs = {
            spec.name: rng.random([batch_size if d == -1 else d for d in spec.shape]).astype(
                spec.dtype
            )
            for spec in model.inputs
        }
        outputs, _ = backend.infer(loaded, batch_size, inputs)
        for spec, expected in zip(model.outputs, default.run(None, inputs), strict=True):
            assert outputs[spec.name].dtype == expected.dtype
            np.testing.assert_allclose(outputs[spec.name], expected, rtol=1e-5, atol=1e-6)
    backend.unload(loaded)
    cache.free(runs)
    assert cache.pages_free == PAGES
