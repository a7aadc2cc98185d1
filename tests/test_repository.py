"""The model repository: folders, inferred batch sizes, atomic writes, path safety, budget and
the profile cache. Models are tiny ONNX graphs made here with onnx.helper."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from clockwork_async.models import repository as repo_module
from clockwork_async.models.repository import (
    BudgetExceeded,
    InvalidModel,
    InvalidModelName,
    ModelNotFound,
    ModelTooLarge,
    ProfileCache,
    Repository,
    check_budget,
    machine_key,
)
from clockwork_async.wire.messages import TensorSpec

Dims = list[int | str]


def onnx_bytes(in_dims: Dims, out_dims: Dims | None = None, *, weight: float = 1.0) -> bytes:
    """x -> y = x * w (a scalar initializer); shapes as given, strings are dynamic axes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, in_dims)
    y = helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, in_dims if out_dims is None else out_dims
    )
    w = numpy_helper.from_array(np.array(weight, dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return bytes(model.SerializeToString())


def external_data_bytes() -> bytes:
    model = onnx.load_model_from_string(onnx_bytes(["N", 4]))
    tensor = model.graph.initializer[0]
    external_data_helper.set_external_data(tensor, location="../../etc/passwd")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    return bytes(model.SerializeToString())


def write_folder(root: Path, name: str, model: bytes, toml: str | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model)
    if toml is not None:
        (folder / "model.toml").write_text(toml)
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


def test_scan_reads_tensors_and_offers_batches_when_every_tensor_has_a_batch_axis(
    root: Path,
) -> None:
    data = onnx_bytes(["N", 4])
    write_folder(root, "mlp", data)
    (entry,) = Repository(root).scan()
    assert entry.name == "mlp"
    assert entry.inputs == (TensorSpec("x", "float32", (-1, 4)),)
    assert entry.outputs == (TensorSpec("y", "float32", (-1, 4)),)
    assert entry.batch_sizes == (1, 2, 4, 8, 16)
    assert not entry.batch_sizes_declared
    assert entry.sha256 == hashlib.sha256(data).hexdigest()
    assert entry.size_bytes == len(data)
    assert entry.instances == ("mlp",)
    assert entry.group == "mlp"
    assert entry.default_slo_ns == 100_000_000
    assert entry.onnx_path == root.resolve() / "mlp" / "model.onnx"


@pytest.mark.parametrize(
    ("in_dims", "out_dims", "toml"),
    [
        ([1, 4], None, None),  # a fixed batch of 1
        ([], None, None),  # a scalar input
        (["N", 4], [4], None),  # an output without the batch axis
        ([2, "N", 8], None, "[inputs.x.axes]\nN = [5]"),  # state batched on the second axis
    ],
)
def test_a_tensor_without_a_leading_batch_axis_means_batch_1_only(
    root: Path, in_dims: Dims, out_dims: Dims | None, toml: str | None
) -> None:
    write_folder(root, "m", onnx_bytes(in_dims, out_dims), toml)
    (entry,) = Repository(root).scan()
    assert entry.batch_sizes == (1,)


def test_model_toml_declares_batching_copies_group_and_slo(root: Path) -> None:
    toml = """
name = "rnn"
group = "rnn-family"
copies = 3
batch_sizes = [1, 2, 4]
default_slo_ms = 25.5
sim_profile = "resnet50-v100"
[[inputs]]
name = "x"
dtype = "float32"
shape = [2, 5, 8]
"""
    write_folder(root, "rnn", onnx_bytes([2, "N", 8]), toml)
    (entry,) = Repository(root).scan()
    assert entry.batch_sizes == (1, 2, 4)
    assert entry.batch_sizes_declared
    assert entry.instances == ("rnn-0", "rnn-1", "rnn-2")
    assert entry.group == "rnn-family"
    assert entry.default_slo_ns == 25_500_000
    assert entry.sim_profile == "resnet50-v100"
    assert entry.inputs == (TensorSpec("x", "float32", (2, 5, 8)),)


def test_simulated_executors_run_a_model_as_tiny_sim_unless_it_says_otherwise(root: Path) -> None:
    write_folder(root, "plain", onnx_bytes(["N", 4]))
    (entry,) = Repository(root).scan()
    assert entry.sim_profile == "tiny-sim"


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ("copies = 0", "at least 1"),
        ("bogus = 1", "bogus"),
        ("batch_sizes = [4, 2]", "ascending"),
        ("batch_sizes = [0, 1]", "ascending"),
        ('name = "other"', "other"),
        ('group = "../x"', "group"),
        ("default_slo_ms = 'fast'", "default_slo_ms"),
        ("[[inputs]]\nname = 'z'\ndtype = 'float32'\nshape = [-1, 4]", "differ"),
        ("[[inputs]]\nname = 'x'\ndtype = 'int64'\nshape = [-1, 4]", "int64"),
        ("[[inputs]]\nname = 'x'\ndtype = 'float32'\nshape = [0]", "shape"),
        ("not toml [", "not valid TOML"),
        ('sim_profile = "gpt-9"', "resnet50-v100, tiny-sim"),
    ],
)
def test_bad_model_toml_is_a_named_error(root: Path, toml: str, says: str) -> None:
    repository = Repository(root)
    with pytest.raises(InvalidModel) as raised:
        repository.add("m", onnx_bytes(["N", 4]), toml)
    assert says in str(raised.value)
    assert not (root / "m").exists()


@pytest.mark.parametrize("name", ["", "../x", "a/b", "a.b", ".hidden", "-x", "x" * 65, "é"])
def test_invalid_names_are_refused(root: Path, name: str) -> None:
    repository = Repository(root)
    with pytest.raises(InvalidModelName):
        repository.add(name, onnx_bytes(["N", 4]))
    with pytest.raises(InvalidModelName):
        repository.remove(name)
    assert os.listdir(root) == []


def test_scan_skips_bad_folders_and_reports_why(root: Path, tmp_path: Path) -> None:
    write_folder(root, "good", onnx_bytes(["N", 4]))
    write_folder(root, "bad.name", onnx_bytes(["N", 4]))
    write_folder(root, "garbage", b"\x00\x01 not onnx")
    (root / "empty").mkdir()
    outside = tmp_path / "outside.onnx"
    outside.write_bytes(onnx_bytes(["N", 4]))
    (root / "escape").mkdir()
    (root / "escape" / "model.onnx").symlink_to(outside)
    report = Repository(root).scan_report()
    assert [e.name for e in report.entries] == ["good"]
    reasons = {p.folder: p.reason for p in report.problems}
    assert set(reasons) == {"bad.name", "garbage", "empty", "escape"}
    assert "outside the repository" in reasons["escape"]
    assert "no model.onnx" in reasons["empty"]


def test_a_symlink_inside_the_repository_is_followed(root: Path) -> None:
    write_folder(root, "base", onnx_bytes(["N", 4]))
    (root / "alias").mkdir()
    (root / "alias" / "model.onnx").symlink_to(root / "base" / "model.onnx")
    entries = Repository(root).scan()
    assert [e.name for e in entries] == ["alias", "base"]
    assert entries[0].sha256 == entries[1].sha256


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    (root / "fifo").mkdir(parents=True)
    os.mkfifo(root / "fifo" / "model.onnx")
    report = Repository(root).scan_report()
    assert report.entries == ()
    assert "not a regular file" in report.problems[0].reason


def test_add_stores_the_model_and_a_rescan_sees_it(root: Path) -> None:
    repository = Repository(root)
    entry = repository.add("m", onnx_bytes(["N", 4]), "copies = 2\n")
    assert entry.instances == ("m-0", "m-1")
    assert (root / "m" / "model.toml").read_text() == "copies = 2\n"
    assert Repository(root).scan() == [entry]
    assert sorted(os.listdir(root)) == ["m"]  # no staging left behind


@pytest.mark.parametrize("exchange_supported", [True, False])
def test_replacing_a_model_swaps_the_whole_folder(
    root: Path, monkeypatch: pytest.MonkeyPatch, exchange_supported: bool
) -> None:
    if not exchange_supported:
        monkeypatch.setattr(repo_module, "_exchange", lambda a, b: False)
    repository = Repository(root)
    first = repository.add("m", onnx_bytes(["N", 4], weight=1.0), "copies = 2\n")
    second = repository.add("m", onnx_bytes(["N", 4], weight=2.0))
    assert second.sha256 != first.sha256
    assert not (root / "m" / "model.toml").exists()  # the old folder's files went with it
    assert repository.get("m") == second
    assert sorted(os.listdir(root)) == ["m"]


def test_a_folder_keeps_its_version_and_a_bad_version_file_is_named(root: Path) -> None:
    repository = Repository(root)
    assert repository.add("m", onnx_bytes(["N", 4])).version == 1
    assert not (root / "m" / "version").exists()  # 1 needs no file
    assert repository.add("m", onnx_bytes(["N", 4]), version=3).version == 3
    assert Repository(root).get("m").version == 3  # read back by a new instance
    assert repository.has("m") and not repository.has("n")
    (root / "m" / "version").write_text("³\n")
    with pytest.raises(InvalidModel, match="m/version must hold an integer"):
        Repository(root).get("m")


def test_add_refuses_garbage_oversize_and_external_data(root: Path) -> None:
    repository = Repository(root, max_model_bytes=4096)
    with pytest.raises(InvalidModel, match="not an ONNX"):
        repository.add("m", b"definitely not protobuf \xff\xff\xff")
    with pytest.raises(ModelTooLarge, match="max_model_bytes"):
        repository.add("m", b"\x00" * 4097)
    with pytest.raises(InvalidModel, match="external data"):
        repository.add("m", external_data_bytes())
    assert os.listdir(root) == []


def test_add_refuses_an_instance_name_another_folder_uses(root: Path) -> None:
    repository = Repository(root)
    repository.add("a", onnx_bytes(["N", 4]), "copies = 2\n")
    with pytest.raises(InvalidModel, match="a-1"):
        repository.add("a-1", onnx_bytes(["N", 4]))
    repository.add("a", onnx_bytes(["N", 4]))  # replacing itself is fine


def test_scan_drops_the_later_of_two_clashing_folders(root: Path) -> None:
    write_folder(root, "a", onnx_bytes(["N", 4]), "copies = 2\n")
    write_folder(root, "a-0", onnx_bytes(["N", 4]))
    report = Repository(root).scan_report()
    assert [e.name for e in report.entries] == ["a"]
    assert report.problems[0].folder == "a-0"


def test_remove_deletes_the_folder(root: Path) -> None:
    repository = Repository(root)
    repository.add("m", onnx_bytes(["N", 4]))
    repository.remove("m")
    assert repository.scan() == []
    assert os.listdir(root) == []
    with pytest.raises(ModelNotFound):
        repository.remove("m")
    with pytest.raises(ModelNotFound):
        repository.get("m")


def test_start_up_restores_a_folder_a_crash_left_mid_replace(root: Path) -> None:
    write_folder(root, ".old-m-0a1b2c3d", onnx_bytes(["N", 4]))
    write_folder(root, ".new-x-abc", b"partial")
    write_folder(root, ".del-y-0a1b2c3d", onnx_bytes(["N", 4]))
    entries = Repository(root).scan()
    assert [e.name for e in entries] == ["m"]
    assert sorted(os.listdir(root)) == ["m"]


def test_budget_counts_shared_files_once_and_names_the_overflow(root: Path) -> None:
    repository = Repository(root)
    a = repository.add("a", onnx_bytes(["N", 4]), "copies = 100\n")
    b = repository.add("b", onnx_bytes(["N", 4]))  # same bytes as a
    c = repository.add("c", onnx_bytes(["N", 4], weight=3.0))
    assert check_budget([a, b], a.size_bytes) == a.size_bytes
    with pytest.raises(BudgetExceeded, match="weights_budget_bytes") as raised:
        check_budget([a, b, c], a.size_bytes + c.size_bytes - 1)
    assert str(a.size_bytes + c.size_bytes) in str(raised.value)


def test_profile_cache_round_trip_and_keys(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "profiles")
    digest = hashlib.sha256(b"model").hexdigest()
    document = {"version": 1, "batch_sizes": [1, 2], "kinds": {"cpu": {"load_ns": 5}}}
    cache.put(digest, "machine-a", json.dumps(document))
    assert cache.get(digest, "machine-a", json.loads) == document
    assert cache.get(digest, "machine-b", json.loads) is None
    assert cache.get(hashlib.sha256(b"other").hexdigest(), "machine-a", json.loads) is None
    with pytest.raises(ValueError, match="content hash"):
        cache.get("../../etc/passwd", "machine-a", json.loads)


def test_a_corrupt_or_unparsable_cache_file_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ProfileCache(tmp_path)
    digest = hashlib.sha256(b"model").hexdigest()
    cache.put(digest, "m", {"x": 1})
    cache.path(digest, "m").write_text('{"format": 1, "content_ha')
    with caplog.at_level(logging.WARNING):
        assert cache.get(digest, "m", json.loads) is None
    assert "corrupt" in caplog.text

    def refuse(text: str) -> object:
        raise ValueError("not a profile")

    cache.put(digest, "m", {"x": 1})
    assert cache.get(digest, "m", refuse) is None
    cache.put(digest, "m", {"x": 2})
    assert cache.get(digest, "m", json.loads) == {"x": 2}


def test_machine_key_names_cpu_backend_and_runtime() -> None:
    key = machine_key("onnxruntime", cpu_model="EPYC", runtime_version="onnxruntime 1.0")
    assert key == "cpu=EPYC; backend=onnxruntime; runtime=onnxruntime 1.0"
    assert "onnxruntime" in machine_key("onnxruntime")
    assert machine_key("onnxruntime") != machine_key("simulated")
