"""The model repository against hostile uploads, through the real daemon's admin API.

Names that could leave the repository or confuse it (``..``, ``/``, NUL, very long, hidden,
not ASCII) get the named error ``bad_model`` and create nothing; non-ONNX files, ONNX files
that point at external data and uploads over the limits are refused by name; folders copied in
by hand that lead outside through symlinks are skipped on rescan. After all of it nothing was
written outside the repository and no staging folder is left inside it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from clockwork_async.client import ApiError, Client, ConnectionClosedError
from clockwork_async.models.demo import build_tiny

from .support import SLO_MS, DaemonProcess, GoodClient, start_daemon, wait_until

MAX_MODEL_BYTES = 64 * 1024
MAX_FRAME_BYTES = 256 * 1024
TINY = build_tiny(7).SerializeToString()
HOSTILE_NAMES = [
    "..",
    ".",
    "../escape",
    "../../escape",
    "a/b",
    "/tmp/escape",
    "a\x00b",
    "\x00",
    "x" * 65,
    "x" * 60_000,
    "",
    ".hidden",
    ".new-tiny-1",
    "-dash",
    "_under",
    "a b",
    "ünïcode",
    "a\\b",
    "tiny/../tiny",
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    process = start_daemon(
        tmp_path_factory.mktemp("repository-daemon"),
        server=f"max_frame_bytes = {MAX_FRAME_BYTES}",
        repository=f"max_model_bytes = {MAX_MODEL_BYTES}",
    )
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture
def admin(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.api, timeout_s=30.0) as client:
        yield client


@pytest.fixture
def good(daemon: DaemonProcess) -> Iterator[GoodClient]:
    client = GoodClient(daemon.api)
    yield client
    client.check()


def folder_of(daemon: DaemonProcess) -> Path:
    return daemon.log_path.parent


def snapshot(daemon: DaemonProcess) -> tuple[set[str], set[str]]:
    """Paths under the daemon's folder outside its repository and own state, and the names
    beside that folder."""
    folder = folder_of(daemon)
    own = {"models", "profiles", "state", "cache"}
    inside = set()
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if relative.parts[0] not in own and path.suffix != ".log":
            inside.add(str(relative))
    return inside, set(os.listdir(folder.parent))


def served(client: Client) -> set[str]:
    """Models served (a registration still running, or failed, is listed but not served)."""
    return {model.name for model in client.models() if model.state in ("ready", "loaded")}


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_hostile_model_names_are_refused_by_name(
    daemon: DaemonProcess, admin: Client, name: str
) -> None:
    before = snapshot(daemon)
    with pytest.raises(ApiError) as added:
        admin.add_model(name, TINY)
    with pytest.raises(ApiError) as removed:
        admin.remove_model(name)
    assert added.value.code == "bad_model" and "model name" in added.value.message
    assert removed.value.code in {"bad_model", "unknown_model"}
    assert snapshot(daemon) == before
    assert sorted(os.listdir(folder_of(daemon) / "models")) == ["tiny"]
    assert served(admin) == {"tiny"}


def test_a_name_with_a_trailing_newline_is_refused(daemon: DaemonProcess, admin: Client) -> None:
    try:
        with pytest.raises(ApiError) as added:
            admin.add_model("tiny\n", TINY)
        assert added.value.code == "bad_model"
    finally:
        if "tiny\n" in served(admin):
            admin.remove_model("tiny\n")
    assert sorted(os.listdir(folder_of(daemon) / "models")) == ["tiny"]


def external_data_model() -> bytes:
    """``tiny`` with its first initializer moved to an external file outside the folder."""
    model = build_tiny(0)
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../../../etc/passwd"
    return bytes(model.SerializeToString())


@pytest.mark.parametrize(
    ("data", "toml", "words"),
    [
        (b"this is not an onnx file", None, "ONNX"),
        (b"\x00" * 1000, None, "ONNX"),
        (external_data_model(), None, "external data"),
        (bytes(MAX_MODEL_BYTES + 1), None, "max_model_bytes"),
        (TINY, 'name = "../escape"', "name"),
        (TINY, 'group = "../escape"', "group"),
        (TINY, 'sim_profile = "/etc/passwd"', "sim_profile"),
        (TINY, "copies = 100000000", "copies"),
        (TINY, "not = [valid toml", "TOML"),
    ],
    ids=[
        "text",
        "zeros",
        "external-data",
        "over-max-model-bytes",
        "toml-name",
        "toml-group",
        "toml-profile",
        "toml-copies",
        "toml-syntax",
    ],
)
def test_uploads_that_are_not_servable_models_are_refused_by_name(
    daemon: DaemonProcess, admin: Client, good: GoodClient, data: bytes, toml: str, words: str
) -> None:
    before = snapshot(daemon)
    with pytest.raises(ApiError) as refused:
        admin.add_model("upload", data, toml)
    assert refused.value.code == "bad_model"
    assert words.lower() in refused.value.message.lower(), refused.value.message
    assert snapshot(daemon) == before
    assert sorted(os.listdir(folder_of(daemon) / "models")) == ["tiny"]


def test_an_upload_over_the_frame_limit_closes_only_its_connection(
    daemon: DaemonProcess, good: GoodClient
) -> None:
    with (
        Client(daemon.api, timeout_s=30.0) as uploader,
        pytest.raises(ConnectionClosedError) as closed,
    ):
        uploader.add_model("huge", bytes(MAX_FRAME_BYTES + 1))
    assert "frame_too_large" in str(closed.value)
    assert not (folder_of(daemon) / "models" / "huge").exists()


def test_hand_copied_folders_that_lead_outside_are_skipped(
    daemon: DaemonProcess, admin: Client, good: GoodClient, tmp_path: Path
) -> None:
    models = folder_of(daemon) / "models"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(TINY)
    (models / "linked-file").mkdir()
    (models / "linked-file" / "model.onnx").symlink_to(outside / "model.onnx")
    (models / "linked-folder").symlink_to(outside)
    (models / "by-hand").mkdir()
    (models / "by-hand" / "model.onnx").write_bytes(TINY)
    try:
        daemon.signal(signal.SIGHUP)
        assert wait_until(lambda: "by-hand" in served(admin))
        assert served(admin) == {"tiny", "by-hand"}
        row = {"input": np.ones((1, 4), np.float32)}
        assert admin.infer("by-hand", row, slo_ms=SLO_MS).ok
        assert daemon.log().count("leads outside the repository") >= 2
        admin.remove_model("linked-folder")  # removes the link, not what it points at
        assert not (models / "linked-folder").is_symlink()
    finally:
        admin.remove_model("by-hand")
        (models / "linked-file" / "model.onnx").unlink()
        (models / "linked-file").rmdir()
        if (models / "linked-folder").is_symlink():
            (models / "linked-folder").unlink()
    assert (outside / "model.onnx").read_bytes() == TINY  # followed nowhere, removed nothing
    assert sorted(os.listdir(models)) == ["tiny"]
