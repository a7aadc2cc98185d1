"""Token scopes, deadline conversion, and the client API messages on the wire."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clockwork_async.api.auth import ALL_SCOPES, INFER_ONLY, Scope, TokenAuth
from clockwork_async.api.server import ServerLimits
from clockwork_async.api.session import slo_ms_to_ns
from clockwork_async.runtime.requests import resolve_deadline_ns
from clockwork_async.wire.codec import Decoder, Encoder
from clockwork_async.wire.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    AddModel,
    CancelInfer,
    CancelRegistration,
    GetHealth,
    GetStats,
    HealthReply,
    InferReply,
    InferRequest,
    ListModels,
    Message,
    ModelsReply,
    ModelStatus,
    RemoveModel,
    StatsReply,
    TensorSpec,
)


def test_without_tokens_everyone_has_every_scope() -> None:
    assert TokenAuth().scopes("") == ALL_SCOPES
    assert TokenAuth().scopes("anything") == ALL_SCOPES


def test_tokens_grant_their_scopes_and_nothing_else() -> None:
    auth = TokenAuth(infer_token="i" * 20, admin_token="a" * 20)
    assert auth.scopes("a" * 20) == ALL_SCOPES
    assert auth.scopes("i" * 20) == INFER_ONLY
    for wrong in ("", "i" * 19, "a" * 21, "\udcff", "ï" * 20):
        assert auth.scopes(wrong) is None
    assert Scope.ADMIN not in INFER_ONLY


def test_an_unset_token_never_matches_the_empty_token() -> None:
    admin_only = TokenAuth(admin_token="a" * 20)
    assert admin_only.scopes("") is None
    assert admin_only.scopes("a" * 20) == ALL_SCOPES


def test_tokens_stay_out_of_reprs() -> None:
    assert "secret" not in repr(TokenAuth(infer_token="secret-infer", admin_token="secret"))


def test_deadlines_resolve_from_arrival() -> None:
    now = dict(now_ns=1_000, unix_now_ns=5_000_000)
    assert resolve_deadline_ns(None, None, 700, **now) == 1_700
    assert resolve_deadline_ns(300, None, 700, **now) == 1_300
    assert resolve_deadline_ns(None, 5_000_400, 700, **now) == 1_400
    assert resolve_deadline_ns(None, 4_999_000, 700, **now) == 0  # already past
    assert slo_ms_to_ns(2.5) == 2_500_000 and slo_ms_to_ns(1e-9) == 1
    with pytest.raises(ValueError):
        slo_ms_to_ns(0.0)


def test_server_limits_are_checked() -> None:
    assert ServerLimits(max_frame_bytes=1 << 20).wire_limits().max_tail_bytes == 1 << 20
    with pytest.raises(ValueError):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError):
        ServerLimits(max_frame_bytes=1 << 32)


SPEC = TensorSpec("x", "float32", (-1, 4))
CLIENT_SAMPLES: list[Message] = [
    InferRequest(1, "m", {"x": np.ones((1, 4), np.float32)}, slo_ms=2.5),
    InferRequest(2, "m", {}, deadline_unix_ns=1_700_000_000_000_000_000),
    InferReply(1, "ok", "", {"y": np.arange(3, dtype=np.int64)}, {"total": 9}, "e0", 4),
    InferReply(2, "infeasible", "no executor can meet 1 ms"),
    CancelInfer(1),
    ListModels(3),
    AddModel(4, "m", {"model.onnx": np.frombuffer(b"ONNX", np.uint8)}, "name = 'm'\n"),
    RemoveModel(5, "m"),
    CancelRegistration(8, "m"),
    AddModel(9, "m", {"model.onnx": np.frombuffer(b"ONNX", np.uint8)}, None, True, False),
    ModelsReply(
        3, "ok", "1 models", (ModelStatus("m", "g", "ready", ("e0",), 2, (1, 2), 5, (SPEC,)),)
    ),
    GetStats(6),
    StatsReply(6, "ok", "", b'{"a": 1}'),
    GetHealth(7),
    HealthReply(7, "ok", "not ready", True, False, "no executor"),
]


def test_client_samples_cover_every_client_message() -> None:
    assert {type(m) for m in CLIENT_SAMPLES} == {*CLIENT_REQUESTS, *CLIENT_REPLIES}


@pytest.mark.parametrize("message", CLIENT_SAMPLES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(message: Message) -> None:
    decoder = Decoder()
    decoder.feed(Encoder().encode_bytes(message))
    decoded = decoder.next_message()
    assert type(decoded) is type(message)
    for f in dataclasses.fields(message):
        got, want = getattr(decoded, f.name), getattr(message, f.name)
        if isinstance(want, dict) and want and isinstance(next(iter(want.values())), np.ndarray):
            assert {k: v.tolist() for k, v in got.items()} == {
                k: v.tolist() for k, v in want.items()
            }
        else:
            assert got == want, f.name


def _lists(tensors: dict[str, np.ndarray]) -> dict[str, list[object]]:
    return {name: array.tolist() for name, array in tensors.items()}
