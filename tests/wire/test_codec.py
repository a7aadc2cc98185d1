"""The wire codec: every message round-trips, however the bytes are cut; tensors decode as views
of the frame's own buffer; bad frames give named ProtocolErrors; bad messages EncodeErrors."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from clockwork_async.wire.codec import (
    PREFIX,
    WIRE_DTYPES,
    Decoder,
    DecoderState,
    EncodeError,
    Encoder,
    Limits,
    ProtocolError,
)
from clockwork_async.wire.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ActionResult,
    AddModel,
    Error,
    ErrorCode,
    ExecutorInfo,
    GetState,
    Hello,
    Infer,
    InferReply,
    Load,
    Message,
    ModelInfo,
    ModelsReply,
    ModelStatus,
    Ping,
    Pong,
    RegisterModel,
    State,
    TensorSpec,
    Unload,
    UnregisterModel,
)

RNG = np.random.default_rng(7)
IMAGE = RNG.standard_normal((1, 3, 224, 224), dtype=np.float32)  # 602,112 bytes


def _infer(**inputs: np.ndarray) -> Infer:
    return Infer(7, "resnet", 1, inputs, earliest_ns=10, latest_ns=2**63 - 1)


SAMPLES: list[Message] = [
    Hello(PROTOCOL_VERSION, "client", "me", token="s3cret"),
    ExecutorInfo("ex0", "simulated", "sim", "v100", ("load", "execute"), 16 << 20, 64, 60, 123),
    Error(ErrorCode.TOO_LATE.value, "window closed"),
    Ping(1, -5),
    Pong(1, 2, 3),
    RegisterModel(1, "mlp", "/models/mlp.onnx", (1, 2, 4)),
    RegisterModel(2, "mlp", "/models/mlp.onnx"),
    UnregisterModel(3, "mlp"),
    Load(4, "mlp", 100, 200),
    _infer(x=IMAGE),
    _infer(a=np.arange(5, dtype=np.int64), b=np.ones((2, 0), np.float16), c=np.array(True)),
    Unload(5, "mlp"),
    GetState(6),
    ActionResult(7, start_ns=1, end_ns=9, durations_ns={"execute": 8}, outputs={"y": IMAGE[0, 0]}),
    ActionResult(8, code=ErrorCode.NOT_LOADED.value, message="no such model"),
    ModelInfo(9, "mlp", 1000, 1, (TensorSpec("x", "float32", (-1, 784)),), (), (1, 2)),
    State(10, 4096, 8, 8, ("a", "b"), ()),
    RegisterModel(11, "seq", "/models/seq.onnx", (), (TensorSpec("ids", "int64", (-1, 12)),)),
]


def assert_same(got: Message, want: Message) -> None:
    """Field by field; tensors by dtype, shape and exact bytes."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, dict) and b and isinstance(next(iter(b.values())), np.ndarray):
            assert a.keys() == b.keys()
            for key in b:
                assert a[key].dtype == b[key].dtype.newbyteorder("<")
                assert a[key].shape == b[key].shape
                assert a[key].tobytes() == np.ascontiguousarray(b[key], a[key].dtype).tobytes()
        else:
            assert a == b, f.name
            assert type(a) is type(b) or isinstance(b, dict), f.name


def decode_all(data: bytes, decoder: Decoder | None = None) -> list[Message]:
    decoder = decoder or Decoder()
    decoder.feed(data)
    return list(_drain(decoder))


def _drain(decoder: Decoder) -> Iterator[Message]:
    while (message := decoder.next_message()) is not None:
        yield message


def frame(header: Any, tail: bytes = b"") -> bytes:
    """A frame around a hand-made header."""
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(packed), len(tail)) + packed + tail


def receive_into(decoder: Decoder, data: bytes, chunk_bytes: int) -> None:
    """What a BufferedProtocol transport does: recv_into get_buffer(), then buffer_updated."""
    position = 0
    while position < len(data):
        buffer = decoder.get_buffer(chunk_bytes)
        count = min(len(buffer), chunk_bytes, len(data) - position)
        buffer[:count] = data[position : position + count]
        decoder.buffer_updated(count)
        position += count


def test_samples_cover_every_message_type_but_the_client_api() -> None:
    # The client API's messages have their samples in tests/api/test_auth.py.
    client_api = {*CLIENT_REQUESTS, *CLIENT_REPLIES}
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values()) - client_api


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    (decoded,) = decode_all(Encoder().encode_bytes(message))
    assert_same(decoded, message)


def test_lists_decode_to_tuples_and_specs_to_tensor_specs() -> None:
    (info,) = decode_all(Encoder().encode_bytes(SAMPLES[15]))
    assert isinstance(info, ModelInfo)
    assert info.inputs == (TensorSpec("x", "float32", (-1, 784)),)
    assert isinstance(info.inputs[0].shape, tuple)
    assert isinstance(info.batch_sizes, tuple)


@pytest.mark.parametrize("dtype_name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5,), (2, 3, 4)])
def test_tensors_of_every_dtype_and_shape_round_trip(
    dtype_name: str, shape: tuple[int, ...]
) -> None:
    array = (np.arange(int(np.prod(shape))) % 3).astype(dtype_name).reshape(shape)
    message = _infer(x=array, pad=np.ones(3, np.uint8))
    (decoded,) = decode_all(Encoder().encode_bytes(message))
    assert_same(decoded, message)


def test_big_endian_and_non_contiguous_tensors_arrive_as_little_endian_values() -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    transposed = np.arange(12, dtype=np.float64).reshape(3, 4).T
    (decoded,) = decode_all(Encoder().encode_bytes(_infer(a=big_endian, b=transposed)))
    assert isinstance(decoded, Infer)
    assert decoded.inputs["a"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(decoded.inputs["a"], big_endian)
    np.testing.assert_array_equal(decoded.inputs["b"], transposed)


def test_encoder_sends_contiguous_tensors_without_copying_them() -> None:
    pieces = Encoder().encode(_infer(x=IMAGE))
    assert len(pieces) == 2
    assert np.shares_memory(np.frombuffer(pieces[1], np.uint8), IMAGE)


def test_tensors_start_aligned_in_the_tail() -> None:
    message = _infer(a=np.ones(3, np.uint8), b=np.ones(3, np.float64), c=np.ones(1, np.int16))
    header = msgpack.unpackb(Encoder().encode(message)[0][PREFIX.size :])
    assert [ref[2] % 8 for ref in header["inputs"].values()] == [0, 0, 0]


def test_byte_by_byte_feeding_gives_the_same_messages() -> None:
    data = b"".join(Encoder().encode_bytes(m) for m in SAMPLES if not isinstance(m, Infer))
    decoder = Decoder()
    decoded: list[Message] = []
    for i in range(len(data)):
        decoder.feed(data[i : i + 1])
        decoded += _drain(decoder)
    assert len(decoded) == len(SAMPLES) - 2
    for got, want in zip(decoded, [m for m in SAMPLES if not isinstance(m, Infer)], strict=True):
        assert_same(got, want)


def test_many_frames_in_one_feed() -> None:
    encoder = Encoder()
    data = b"".join(encoder.encode_bytes(m) for m in SAMPLES * 3)
    decoder = Decoder()
    decoder.feed(data)
    assert decoder.buffered_messages == len(SAMPLES) * 3
    assert decoder.buffered_bytes == len(data)
    for got, want in zip(_drain(decoder), SAMPLES * 3, strict=True):
        assert_same(got, want)
    assert decoder.buffered_bytes == 0
    assert decoder.state is DecoderState.PREFIX


@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096, 65536, 1 << 22])
def test_get_buffer_path_decodes_every_message(chunk_bytes: int) -> None:
    data = b"".join(Encoder().encode_bytes(m) for m in SAMPLES)
    decoder = Decoder()
    receive_into(decoder, data, chunk_bytes)
    for got, want in zip(_drain(decoder), SAMPLES, strict=True):
        assert_same(got, want)


def test_get_buffer_lends_exactly_the_rest_of_the_tail_and_tensors_view_it() -> None:
    head, tensor = Encoder().encode(_infer(x=IMAGE))
    decoder = Decoder()
    receive_into(decoder, bytes(head) + bytes(tensor[:1000]), 1 << 20)
    assert decoder.state is DecoderState.TAIL
    buffer = decoder.get_buffer(65536)
    assert len(buffer) == IMAGE.nbytes - 1000
    buffer[:] = tensor[1000:]
    decoder.buffer_updated(len(buffer))
    message = decoder.next_message()
    assert isinstance(message, Infer)
    assert np.shares_memory(message.inputs["x"], np.asarray(buffer.obj))
    np.testing.assert_array_equal(message.inputs["x"], IMAGE)


def test_decoded_tensors_are_writable_and_independent_between_messages() -> None:
    data = Encoder().encode_bytes(_infer(x=np.zeros(4, np.float32)))
    first, second = decode_all(data + data)
    assert isinstance(first, Infer) and isinstance(second, Infer)
    first.inputs["x"][:] = 1
    assert not second.inputs["x"].any()


def test_buffer_updated_without_get_buffer_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError):
        Decoder().buffer_updated(1)


def test_omitted_defaulted_fields_take_their_defaults() -> None:
    (result,) = decode_all(frame({"t": "action_result", "action_id": 3}))
    assert result == ActionResult(3)


def _header(message: Message) -> dict[str, Any]:
    header: dict[str, Any] = msgpack.unpackb(Encoder().encode(message)[0][PREFIX.size :])
    return header


def test_added_fields_are_left_out_at_their_default_so_older_peers_read_them() -> None:
    upload = {"model.onnx": np.zeros(3, np.uint8)}
    assert "replace" not in _header(AddModel(1, "m", upload))
    assert _header(AddModel(1, "m", upload, replace=True))["replace"] is True
    assert "model_version" not in _header(InferReply(1, "ok", ""))
    assert _header(InferReply(1, "ok", "", model_version=2))["model_version"] == 2
    plain, versioned = ModelStatus("m", "m", "ready"), ModelStatus("m", "m", "ready", version=3)
    assert "version" not in _header(ModelsReply(1, "ok", "", (plain,)))["models"][0]
    assert _header(ModelsReply(1, "ok", "", (versioned,)))["models"][0]["version"] == 3
    (upload_back,) = decode_all(Encoder().encode_bytes(AddModel(1, "m", upload, replace=True)))
    assert isinstance(upload_back, AddModel) and upload_back.replace
    listed = ModelsReply(1, "ok", "", (versioned,))
    assert decode_all(Encoder().encode_bytes(listed)) == [listed]


def _error_of(data: bytes, decoder: Decoder | None = None) -> ProtocolError:
    decoder = decoder or Decoder()
    decoder.feed(data)
    with pytest.raises(ProtocolError) as info:
        list(_drain(decoder))
    return info.value


@pytest.mark.parametrize(
    "header",
    [
        {"t": "ping", "seq": 1},  # missing field
        {"t": "ping", "seq": 1, "sent_ns": 2, "extra": 3},  # unknown field
        {"t": "ping", "seq": True, "sent_ns": 2},  # bool is not an int
        {"t": "ping", "seq": 1.0, "sent_ns": 2},
        {"t": "nope", "seq": 1},  # unknown tag
        {"seq": 1, "sent_ns": 2},  # no tag
        [1, 2],  # not a map
        {
            "t": "state",
            "action_id": 1,
            "page_bytes": 1,
            "pages_total": 1,
            "pages_free": 1,
            "registered": ["a", 1],
            "loaded": [],
        },
        {"t": "action_result", "action_id": 1, "durations_ns": {"a": "b"}},
        {
            "t": "infer",
            "action_id": 1,
            "model": "m",
            "batch_size": 1,
            "earliest_ns": 0,
            "latest_ns": 0,
            "inputs": {"x": ["complex64", [1], 0, 8]},
        },
    ],
)
def test_headers_that_do_not_match_the_schema_are_protocol_errors(header: Any) -> None:
    error = _error_of(frame(header))
    assert error.code is ErrorCode.PROTOCOL_ERROR


def _infer_header(ref: list[Any]) -> dict[str, Any]:
    return {
        "t": "infer",
        "action_id": 1,
        "model": "m",
        "batch_size": 1,
        "earliest_ns": 0,
        "latest_ns": 0,
        "inputs": {"x": ref},
    }


@pytest.mark.parametrize(
    ("ref", "tail_bytes"),
    [
        (["float32", [2], 0, 4], 8),  # nbytes disagrees with dtype x shape
        (["float32", [2], 4, 8], 8),  # runs past the tail
        (["float32", [-2], 0, -8], 8),
        (["float32", [2], -1, 8], 8),
        (["float32", [1] * 17, 0, 4], 8),  # too many dims
        (["float32", [0, 1 << 40, 1 << 40], 0, 0], 0),  # empty, yet could never exist
        (["float32", [2]], 8),
    ],
)
def test_inconsistent_tensor_descriptions_are_protocol_errors(
    ref: list[Any], tail_bytes: int
) -> None:
    error = _error_of(frame(_infer_header(ref), bytes(tail_bytes)))
    assert error.code is ErrorCode.PROTOCOL_ERROR


def test_overlapping_tensors_are_protocol_errors() -> None:
    header = _infer_header(["float32", [2], 0, 8])
    header["inputs"]["y"] = ["int32", [2], 4, 8]
    assert _error_of(frame(header, bytes(16))).code is ErrorCode.PROTOCOL_ERROR


@pytest.mark.parametrize(("header_len", "tail_len"), [(2**32 - 1, 0), (10, 2**32 - 1)])
def test_oversized_frames_fail_on_their_prefix(header_len: int, tail_len: int) -> None:
    decoder = Decoder(Limits(max_header_bytes=1 << 10, max_tail_bytes=1 << 20))
    assert _error_of(PREFIX.pack(header_len, tail_len), decoder).code is ErrorCode.FRAME_TOO_LARGE


def test_limits_on_strings_and_tensor_counts_hold() -> None:
    limits = Limits(max_str_len=10, max_tensors=2)
    assert _error_of(Encoder().encode_bytes(Unload(1, "m" * 11)), Decoder(limits))
    many = _infer(a=np.ones(1), b=np.ones(1), c=np.ones(1))
    assert _error_of(Encoder().encode_bytes(many), Decoder(limits))


def test_messages_before_a_bad_frame_are_delivered_then_the_decoder_stays_failed() -> None:
    decoder = Decoder()
    good = Encoder().encode_bytes(Ping(1, 2))
    decoder.feed(good + PREFIX.pack(1, 0) + b"\xc1" + good)
    assert decoder.next_message() == Ping(1, 2)
    for _ in range(2):
        with pytest.raises(ProtocolError) as info:
            decoder.next_message()
        assert info.value.code is ErrorCode.PROTOCOL_ERROR
    assert decoder.state is DecoderState.FAILED
    decoder.feed(good)
    assert decoder.buffered_messages == 0
    assert len(decoder.get_buffer(10)) > 0


def test_hello_must_come_first_when_expected() -> None:
    encoder = Encoder()
    error = _error_of(encoder.encode_bytes(Ping(1, 2)), Decoder(expect_hello=True))
    assert error.code is ErrorCode.PROTOCOL_ERROR
    hello = Hello(PROTOCOL_VERSION, "executor", "ex0")
    messages = decode_all(encoder.encode_bytes(hello) + encoder.encode_bytes(Ping(1, 2)))
    assert messages == [hello, Ping(1, 2)]


def test_a_hello_of_another_version_is_unsupported_even_with_unknown_fields() -> None:
    newer = {
        "t": "hello",
        "protocol_version": PROTOCOL_VERSION + 1,
        "role": "x",
        "name": "y",
        "token": "",
        "features": ["z"],
    }
    error = _error_of(frame(newer), Decoder(expect_hello=True))
    assert error.code is ErrorCode.UNSUPPORTED_VERSION
    assert "speaks protocol version 2" in error.message


def test_truncated_frame_waits_for_more_and_reports_mid_frame() -> None:
    data = Encoder().encode_bytes(SAMPLES[0])
    decoder = Decoder()
    assert not decoder.mid_frame
    decoder.feed(data[:-1])
    assert decoder.next_message() is None
    assert decoder.mid_frame
    decoder.feed(data[-1:])
    assert decoder.next_message() == SAMPLES[0]
    assert not decoder.mid_frame


@pytest.mark.parametrize(
    "bad",
    [
        Ping("1", 2),  # type: ignore[arg-type]
        Ping(True, 2),
        Ping(2**64, 2),
        Unload(1, b"m"),  # type: ignore[arg-type]
        _infer(x=np.ones(2, np.complex64)),
        _infer(x=np.array(["a"], dtype=object)),
        _infer(x=[1.0, 2.0]),  # type: ignore[arg-type]
        ModelInfo(1, "m", 1, 1, (("x", "f", (1,)),), (), ()),  # type: ignore[arg-type]
        State(1, 1, 1, 1, "ab", ()),  # type: ignore[arg-type]
    ],
)
def test_messages_that_cannot_be_encoded_raise_encode_error(bad: Message) -> None:
    with pytest.raises(EncodeError):
        Encoder().encode(bad)


def test_encoder_refuses_objects_that_are_not_messages_and_frames_over_limits() -> None:
    with pytest.raises(EncodeError):
        Encoder().encode(TensorSpec("x", "float32", ()))  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        Encoder(Limits(max_tail_bytes=1000)).encode(_infer(x=IMAGE))


def test_numpy_scalars_in_plain_fields_encode_as_plain_values() -> None:
    message = Ping(np.int64(3), np.uint32(4))  # type: ignore[arg-type]
    assert decode_all(Encoder().encode_bytes(message)) == [Ping(3, 4)]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Limits)])
def test_limits_reject_values_outside_u32(field: str) -> None:
    for bad in (0, 2**32):
        with pytest.raises(ValueError, match=field):
            Limits(**{field: bad})
