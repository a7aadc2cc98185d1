"""docs/protocol.md describes the client API as the code speaks it: every field of every client
message, the `model.toml` keys an upload may carry, the codes a connection can be refused with,
and the timing keys a reply can hold."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from clockwork_async.models.info import ModelSettings
from clockwork_async.wire.messages import CLIENT_REPLIES, CLIENT_REQUESTS, ApiCode, ModelStatus

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
TEXT = DOC.read_text(encoding="utf-8")
CLIENT_API = TEXT[TEXT.index("## 9. Client API") :]


def _named(name: str, text: str) -> bool:
    return f"`{name}`" in text


@pytest.mark.parametrize("cls", [*CLIENT_REQUESTS, *CLIENT_REPLIES, ModelStatus])
def test_every_field_of_every_client_message_is_named(cls: type) -> None:
    missing = [f.name for f in dataclasses.fields(cls) if not _named(f.name, CLIENT_API)]
    assert not missing, f"{cls.__name__}: {missing}"
    if hasattr(cls, "TAG"):
        assert _named(cls.TAG, CLIENT_API)


def test_list_models_says_its_one_field() -> None:
    assert "(`ListModels`: `request_id`)" in CLIENT_API


def test_the_model_toml_keys_of_an_upload_are_listed() -> None:
    upload = CLIENT_API[CLIENT_API.index("| `add_model` field") :]
    upload = upload[: upload.index("**`get_stats`**")]
    keys = [f.name for f in dataclasses.fields(ModelSettings)] + ["[[inputs]]", "[[outputs]]"]
    assert [key for key in keys if not _named(key, upload)] == []


def test_the_connection_error_table_has_the_client_apis_refusals() -> None:
    table = TEXT[TEXT.index("Connection errors, in an `error` message") :]
    table = table[: table.index("## 8.")]
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert {ApiCode.OVERLOADED.value, ApiCode.SHUTTING_DOWN.value} <= rows


def test_every_timing_key_a_reply_can_carry_is_explained() -> None:
    source = Path(__file__).resolve().parents[1] / "src" / "clockwork_async" / "runtime"
    keys = set(re.findall(r'timing\["(\w+)"\]', (source / "requests.py").read_text()))
    keys |= {"total", "queue", "execute", "predicted_execute", "executor", "copy_in", "copy_out"}
    timing = CLIENT_API[CLIENT_API.index("`timing_ns` keys") :][:1500]
    assert sorted(key for key in keys if not _named(key, timing)) == []
