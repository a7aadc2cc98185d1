"""Fuzzing the decoder: whatever the bytes and however they are cut, it yields well-typed
messages or raises ProtocolError, nothing else; what it yields encodes back to equal messages."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from clockwork_async.wire.codec import PREFIX, Decoder, Encoder, Limits, ProtocolError
from clockwork_async.wire.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ActionResult,
    Hello,
    Infer,
    Message,
    ModelInfo,
    Ping,
    State,
    TensorSpec,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = Limits(max_header_bytes=4096, max_tail_bytes=1 << 16)

VALID: list[Message] = [
    Hello(PROTOCOL_VERSION, "client", "c"),
    Ping(1, 2),
    State(1, 4096, 8, 7, ("a",), ("a",)),
    ModelInfo(2, "m", 10, 1, (TensorSpec("x", "float32", (-1, 3)),), (), (1,)),
    Infer(3, "m", 2, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, 0, 10),
    ActionResult(4, durations_ns={"execute": 5}, outputs={"y": np.ones(3, np.int16)}),
]
VALID_BYTES = [Encoder().encode_bytes(m) for m in VALID]


def run_decoder(data: bytes, cuts: list[int], *, buffered: bool) -> list[Message]:
    """Decode ``data`` cut at ``cuts`` through feed or get_buffer; return what decoded and
    fail the test on any exception but ProtocolError."""
    decoder = Decoder(LIMITS)
    decoded: list[Message] = []
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for start, end in itertools.pairwise(bounds):
        if buffered:
            _receive(decoder, data[start:end])
        else:
            decoder.feed(data[start:end])
        try:
            while (message := decoder.next_message()) is not None:
                decoded.append(message)
        except ProtocolError:
            assert decoder.error is not None
            return decoded
    return decoded


def _receive(decoder: Decoder, data: bytes) -> None:
    while data:
        buffer = decoder.get_buffer(-1)
        assert len(buffer) > 0
        count = min(len(buffer), len(data))
        buffer[:count] = data[:count]
        decoder.buffer_updated(count)
        data = data[count:]


def assert_well_typed(messages: list[Message]) -> None:
    """A decoded message re-encodes, and decodes again to the same fields."""
    for message in messages:
        assert type(message) in MESSAGE_TYPES.values()
        again = Decoder(LIMITS)
        again.feed(Encoder(LIMITS).encode_bytes(message))
        twin = again.next_message()
        for f in dataclasses.fields(message):
            a, b = getattr(message, f.name), getattr(twin, f.name)
            if isinstance(a, dict) and any(isinstance(v, np.ndarray) for v in a.values()):
                assert {k: v.tobytes() for k, v in a.items()} == {
                    k: v.tobytes() for k, v in b.items()
                }
            else:
                assert a == b


def frame(header: Any, tail: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(packed), len(tail)) + packed + tail


CUTS = st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=8)
MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(data=st.binary(max_size=512), cuts=CUTS, buffered=st.booleans())
def test_arbitrary_bytes(data: bytes, cuts: list[int], buffered: bool) -> None:
    assert_well_typed(run_decoder(data, cuts, buffered=buffered))


@FUZZ
@given(
    index=st.integers(min_value=0, max_value=len(VALID) - 1),
    mutations=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1),
    cuts=CUTS,
    buffered=st.booleans(),
)
def test_mutated_valid_frames(
    index: int, mutations: list[tuple[int, int]], cuts: list[int], buffered: bool
) -> None:
    data = bytearray(VALID_BYTES[index])
    for position, value in mutations:
        data[position % len(data)] = value
    assert_well_typed(run_decoder(bytes(data), cuts, buffered=buffered))


@FUZZ
@given(index=st.integers(min_value=0, max_value=len(VALID) - 1), data=st.data())
def test_truncated_frames_wait_for_more(index: int, data: st.DataObject) -> None:
    whole = VALID_BYTES[index]
    length = data.draw(st.integers(min_value=1, max_value=len(whole) - 1))
    decoder = Decoder(LIMITS)
    decoder.feed(whole[:length])
    assert decoder.next_message() is None
    assert decoder.mid_frame


@FUZZ
@given(
    header_len=st.integers(min_value=0, max_value=2**32 - 1),
    tail_len=st.integers(min_value=0, max_value=2**32 - 1),
    rest=st.binary(max_size=64),
)
def test_declared_lengths_of_any_size(header_len: int, tail_len: int, rest: bytes) -> None:
    decoder = Decoder(LIMITS)
    decoder.feed(PREFIX.pack(header_len, tail_len) + rest)
    too_large = header_len > LIMITS.max_header_bytes or tail_len > LIMITS.max_tail_bytes
    with contextlib.suppress(ProtocolError):
        decoder.next_message()
    if too_large:
        assert decoder.error is not None and decoder.error.code.value == "frame_too_large"


@FUZZ
@given(depth=st.integers(min_value=1, max_value=3000), as_map=st.booleans())
def test_deep_nesting(depth: int, as_map: bool) -> None:
    opener = b"\x81\xa1k" if as_map else b"\x91"  # {"k": ...} or [...]
    header = b"\x83\xa1t\xa4ping\xa3seq" + opener * depth + b"\x01\xa7sent_ns\x02"
    data = PREFIX.pack(len(header), 0) + header
    assert run_decoder(data, [], buffered=False) == []


@FUZZ
@given(
    tag=st.sampled_from(sorted(MESSAGE_TYPES)),
    values=st.dictionaries(st.text(max_size=12), MSGPACK_VALUES, max_size=6),
    data=st.data(),
)
def test_wrong_field_types(tag: str, values: dict[str, Any], data: st.DataObject) -> None:
    names = [f.name for f in dataclasses.fields(MESSAGE_TYPES[tag])]
    named = data.draw(st.dictionaries(st.sampled_from(names), MSGPACK_VALUES, max_size=len(names)))
    header = {"t": tag, **values, **named}
    assert_well_typed(run_decoder(frame(header, bytes(16)), [], buffered=True))


@FUZZ
@given(tag=MSGPACK_VALUES, values=st.dictionaries(st.text(max_size=8), MSGPACK_VALUES))
def test_unknown_tags(tag: Any, values: dict[str, Any]) -> None:
    assume(not (isinstance(tag, str) and tag in MESSAGE_TYPES))
    assert run_decoder(frame({**values, "t": tag}), [], buffered=False) == []


@FUZZ
@given(
    dtype=st.sampled_from(["float32", "int8", "float64", "bool", "uint16", "x", ""]),
    shape=st.lists(st.integers(min_value=-2, max_value=1 << 20), max_size=5),
    offset=st.integers(min_value=-8, max_value=80),
    nbytes=st.integers(min_value=-8, max_value=80),
    tail=st.binary(max_size=64),
)
def test_tensor_descriptions_disagreeing_with_their_bytes(
    dtype: str, shape: list[int], offset: int, nbytes: int, tail: bytes
) -> None:
    ref = [dtype, shape, offset, nbytes]
    header = {"t": "action_result", "action_id": 1, "outputs": {"y": ref}}
    decoded = run_decoder(frame(header, tail), [], buffered=True)
    assert_well_typed(decoded)
    for message in decoded:
        assert isinstance(message, ActionResult)
        array = message.outputs["y"]
        assert array.nbytes == nbytes and list(array.shape) == shape
        assert array.tobytes() == tail[offset : offset + nbytes]
