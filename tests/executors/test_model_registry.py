"""The one model registry of the backends: models by identity, their files; and every
in-process backend refusing a model it did not register."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clockwork_async.executors.arena import CountingArena, NumpyArena
from clockwork_async.executors.backend import Backend, BackendError, PageRun
from clockwork_async.executors.model_registry import ModelFiles, ModelRegistry
from clockwork_async.executors.onnxruntime import OnnxRuntimeBackend
from clockwork_async.executors.simulated import SimulatedBackend

from clockwork_async.models.demo import generate_demo_models
from clockwork_async.wire.messages import ErrorCode


@dataclass(eq=False)
class Model:
    name: str


def test_a_registry_owns_exactly_the_objects_added_until_removed() -> None:
    registry = ModelRegistry(Model)
    model, twin = Model("m"), Model("m")
    registry.add(model)
    assert registry.own(model) is model
    with pytest.raises(BackendError) as refused:
        registry.own(twin)  # type: ignore[arg-type]  # same name, another object
    assert refused.value.code == ErrorCode.UNKNOWN_MODEL
    assert registry.remove(model) is model
    with pytest.raises(BackendError):
        registry.remove(model)  # type: ignore[arg-type]
    assert len(registry) == 0


def test_clear_returns_every_model() -> None:
    registry = ModelRegistry(Model)
    models = [Model("a"), Model("b")]
    for model in models:
        registry.add(model)
    assert registry.clear() == models
    assert len(registry) == 0


def test_files_get_unique_safe_stems(tmp_path: Path) -> None:
    files = ModelFiles(str(tmp_path), prefix="x-", placeholders=())
    assert [files.stem("a/b c"), files.stem("a/b c")] == ["00000-a_b_c", "00001-a_b_c"]
    assert files.stem("n" * 100) == "00002-" + "n" * 64


def test_close_removes_a_folder_it_made_and_only_its_placeholders_in_a_given_one(
    tmp_path: Path,
) -> None:
    made = ModelFiles(None, prefix="clockwork-test-", placeholders=("p.bin",))
    assert (made.path / "p.bin").is_file()
    made.close()
    assert not made.path.exists()
    given = ModelFiles(str(tmp_path / "w"), prefix="x-", placeholders=("p.bin",))
    (given.path / "kept").touch()
    given.close()
    assert sorted(p.name for p in given.path.iterdir()) == ["kept"]


# --- every in-process backend -------------------------------------------------------------------


def _simulated(_tmp_path: Path) -> tuple[Backend, str]:
    return SimulatedBackend(CountingArena(1 << 20, 8), wait_ns=lambda ns: ns), "tiny-sim"


def _onnxruntime(tmp_path: Path) -> tuple[Backend, str]:
    path = generate_demo_models(tmp_path / "models", names=["tiny"])["tiny"]
    backend = OnnxRuntimeBackend(
        NumpyArena(4096, 8), work_dir=str(tmp_path / "work"), prepacking="off"
    )
    return backend, str(path)


@pytest.fixture(params=[_simulated, _onnxruntime], ids=["simulated", "onnxruntime"])
def two_backends(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Backend, Backend, str]]:
    make: Callable[[Path], tuple[Backend, str]] = request.param
    first, path = make(tmp_path / "first")
    second, _ = make(tmp_path / "second")
    try:
        yield first, second, path
    finally:
        first.close()
        second.close()


def test_a_backend_refuses_a_model_it_did_not_register(
    two_backends: tuple[Backend, Backend, str],
) -> None:
    first, second, path = two_backends
    model = first.register("m", path, ())
    runs = [PageRun(index, count) for index, count in enumerate(model.run_pages)]
    for call in (lambda: second.load(model, runs), lambda: second.unregister(model)):
        with pytest.raises(BackendError) as refused:
            call()
        assert refused.value.code == ErrorCode.UNKNOWN_MODEL
    first.unregister(model)
    with pytest.raises(BackendError) as again:
        first.unregister(model)
    assert again.value.code == ErrorCode.UNKNOWN_MODEL
