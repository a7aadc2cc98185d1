"""Demo models: deterministic bytes, idempotent generation, dynamic batch, the CLI verb."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from clockwork_async.models import demo as demo_models
from clockwork_async.models.demo import BUILDERS, generate_demo_models


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights_bytes(path: Path) -> int:
    model = onnx.load(str(path))
    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def test_generation_is_idempotent_and_repairs_a_damaged_file(tmp_path: Path) -> None:
    path = generate_demo_models(tmp_path, names=["tiny"])["tiny"]
    first = path.stat()
    again = generate_demo_models(tmp_path, names=["tiny"])["tiny"]
    assert again == path == tmp_path / "tiny.onnx"
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    good = digest(path)
    path.write_bytes(b"damaged")
    generate_demo_models(tmp_path, names=["tiny"])
    assert digest(path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]  # no temporary left


def test_the_seed_decides_the_weights(tmp_path: Path) -> None:
    a = generate_demo_models(tmp_path / "a", seed=0, names=["tiny"])["tiny"]
    b = generate_demo_models(tmp_path / "b", seed=0, names=["tiny"])["tiny"]
    c = generate_demo_models(tmp_path / "c", seed=1, names=["tiny"])["tiny"]
    assert digest(a) == digest(b) != digest(c)


def test_unknown_names_raise_key_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="no-such"):
        generate_demo_models(tmp_path, names=["tiny", "no-such"])
    assert not (tmp_path / "tiny.onnx").exists()


def test_every_model_runs_with_a_dynamic_batch_and_has_its_size(tmp_path: Path) -> None:
    paths = generate_demo_models(tmp_path)
    assert set(paths) == set(BUILDERS) == {"tiny", "mlp", "resnet-like"}
    sizes = {name: weights_bytes(path) for name, path in paths.items()}
    assert sizes["tiny"] < 10_000
    assert 7_000_000 < sizes["mlp"] < 8_000_000
    assert 19_000_000 < sizes["resnet-like"] < 21_000_000
    for name, path in paths.items():
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (spec,) = session.get_inputs()
        (out_spec,) = session.get_outputs()
        assert isinstance(spec.shape[0], str) and isinstance(out_spec.shape[0], str), name
        for batch_size in (1, 3):
            x = np.ones([batch_size, *spec.shape[1:]], np.float32)
            (y,) = session.run(None, {spec.name: x})
            assert y.shape[0] == batch_size and np.isfinite(y).all() and y.any(), name


def test_cli_writes_the_models_it_is_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo_models.main(["--out", str(tmp_path), "--only", "tiny"]) == 0
    assert capsys.readouterr().out == f"tiny\t{tmp_path / 'tiny.onnx'}\n"
    assert demo_models.main(["--out", str(tmp_path), "--only", "nope"]) == 2
    assert "nope" in capsys.readouterr().out


def test_default_directory_follows_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo_models.default_directory() == tmp_path / "clockwork-async" / "demo-models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert demo_models.default_directory() == Path.home() / ".cache/clockwork-async/demo-models"
