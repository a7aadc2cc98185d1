"""Hostile frames over real sockets to the real daemon's client API.

Each example opens a connection, sends the bytes a strategy made (most after a valid hello),
and reads until the daemon closes it. The oracle is the codec itself plus the client API's
rules (docs/protocol.md, sections 8 and 9): feeding the same bytes to a local `Decoder` says
which named error the daemon must send (``protocol_error``, ``frame_too_large``,
``unsupported_version``), or that every frame was valid or cut short, in which case the
daemon sends no error and closes once this side stops writing. Meanwhile a well-behaved client
on another connection gets ``ok`` for every infer, and the daemon process stays up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from clockwork_async.wire.codec import DEFAULT_LIMITS, Decoder, Encoder, ProtocolError
from clockwork_async.wire.messages import (
    MESSAGE_TYPES,
    AddModel,
    CancelInfer,
    Error,
    GetHealth,
    GetStats,
    Hello,
    Infer,
    InferReply,
    InferRequest,
    ListModels,
    Load,
    Message,
    Ping,
    Pong,
    RemoveModel,
)
from clockwork_async.wire.schema import WIRE_DTYPES

from .support import (
    PREFIX,
    DaemonProcess,
    GoodClient,
    RawClient,
    frame,
    hello_frame,
    infer_frame,
    start_daemon,
)

HOSTILE = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CLIENT_API = (InferRequest, CancelInfer, ListModels, AddModel, RemoveModel, GetStats, GetHealth)
CLIENT_TYPES = (*CLIENT_API, Ping)
REPLY_TAGS = {"hello", "error", "infer_reply", "models_reply", "stats_reply", "health_reply"}
REPLY_TAGS.add("pong")
HELLO = hello_frame()
TAIL = np.arange(4, dtype=np.float32).tobytes()
INFER_HEADER: dict[str, Any] = {
    "t": "infer_request",
    "request_id": 9,
    "model": "tiny",
    "inputs": {"input": ["float32", [1, 4], 0, 16]},
    "slo_ms": 5000.0,
    "deadline_unix_ns": None,
}
TEMPLATES: list[tuple[dict[str, Any], bytes]] = [
    ({"t": "list_models", "request_id": 1}, b""),
    ({"t": "get_stats", "request_id": 2}, b""),
    ({"t": "get_health", "request_id": 3}, b""),
    ({"t": "cancel_infer", "request_id": 4}, b""),
    ({"t": "ping", "seq": 5, "sent_ns": 6}, b""),
    (INFER_HEADER, TAIL),
]
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
    max_leaves=10,
)


# --- the oracle ------------------------------------------------------------------------------


def expected_error(data: bytes) -> str | None:
    """The error code the daemon must answer ``data`` (a whole connection's input) with, or
    None when every frame is a valid client API message or the last one is cut short."""
    decoder = Decoder(DEFAULT_LIMITS, expect_hello=True)
    decoder.feed(data)
    first = True
    while True:
        try:
            message = decoder.next_message()
        except ProtocolError as error:
            return error.code.value
        if message is None:
            return None
        allowed = isinstance(message, Hello) and message.role == "client"
        if not first:
            allowed = isinstance(message, CLIENT_TYPES)
        if not allowed:
            return "protocol_error"
        first = False


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path_factory.mktemp("fuzz-daemon"))
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture
def good(daemon: DaemonProcess) -> Iterator[GoodClient]:
    """A well-behaved client busy throughout the test; all its answers must be ok."""
    client = GoodClient(daemon.api)
    yield client
    client.check()
    assert daemon.process.poll() is None, "the daemon died"


def exchange(daemon: DaemonProcess, data: bytes) -> None:
    """Send ``data`` on a fresh connection and check the daemon's answer against the oracle."""
    expected = expected_error(data)
    with RawClient(daemon.api) as raw:
        raw.send(data)
        if expected is None:
            raw.end_writing()  # the daemon sees end of input (mid-frame, or after valid ones)
        ending = raw.read_until_closed()
    assert ending.how != "timeout", f"the daemon kept the connection open: {ending.headers}"
    assert set(ending.tags()) <= REPLY_TAGS, ending.tags()
    if expected is None:
        assert ending.errors == [], ending.headers
    elif ending.how == "eof":  # after a reset (bytes it never read) the error may be lost
        assert ending.errors == [expected], ending.headers
    else:
        assert set(ending.errors) <= {expected}, ending.headers
    assert daemon.process.poll() is None, "the daemon died"


def raw_header(body: bytes, tail: bytes = b"") -> bytes:
    """A frame whose header is the raw bytes ``body`` (not necessarily valid msgpack)."""
    return PREFIX.pack(len(body), len(tail)) + body + tail


# --- strategies and tests --------------------------------------------------------------------


@HOSTILE
@given(data=st.binary(min_size=1, max_size=300))
def test_garbage_before_the_hello(daemon: DaemonProcess, good: GoodClient, data: bytes) -> None:
    exchange(daemon, data)


@HOSTILE
@given(data=st.binary(min_size=1, max_size=300), valid_first=st.booleans())
def test_garbage_after_the_hello(
    daemon: DaemonProcess, good: GoodClient, data: bytes, valid_first: bool
) -> None:
    exchange(daemon, HELLO + (infer_frame(1) if valid_first else b"") + data)


@HOSTILE
@given(index=st.integers(0, len(TEMPLATES) - 1), cut=st.integers(min_value=1))
def test_truncated_frames(daemon: DaemonProcess, good: GoodClient, index: int, cut: int) -> None:
    whole = frame(*TEMPLATES[index])
    exchange(daemon, HELLO + whole[: cut % len(whole)])


@HOSTILE
@given(
    header_len=st.integers(0, 2**32 - 1),
    tail_len=st.integers(0, 2**32 - 1),
    rest=st.binary(max_size=64),
    in_hello=st.booleans(),
)
def test_oversized_and_huge_declared_frame_lengths(
    daemon: DaemonProcess,
    good: GoodClient,
    header_len: int,
    tail_len: int,
    rest: bytes,
    in_hello: bool,
) -> None:
    limits = DEFAULT_LIMITS
    assume(header_len > limits.max_header_bytes or tail_len > limits.max_tail_bytes)
    data = PREFIX.pack(header_len, tail_len) + rest
    exchange(daemon, data if in_hello else HELLO + data)


@HOSTILE
@given(
    index=st.integers(0, len(TEMPLATES) - 1),
    key=st.sampled_from(["request_id", "seq", "model", "inputs", "slo_ms", "extra", "t"]),
    value=MSGPACK_VALUES,
    drop=st.booleans(),
)
def test_fields_of_the_wrong_type_missing_or_unknown(
    daemon: DaemonProcess, good: GoodClient, index: int, key: str, value: Any, drop: bool
) -> None:
    header, tail = TEMPLATES[index]
    header = dict(header)
    if drop and key in header:
        del header[key]
    else:
        header[key] = value
    exchange(daemon, HELLO + frame(header, tail))


@HOSTILE
@given(
    version=st.integers(-(2**63), 2**64 - 1) | MSGPACK_VALUES,
    role=st.sampled_from(["client", "executor", "controller", "", 1]),
    token=st.text(max_size=4) | st.none(),
)
def test_hellos_of_other_versions_roles_and_types(
    daemon: DaemonProcess, good: GoodClient, version: Any, role: Any, token: Any
) -> None:
    assume(not (version == 1 and role == "client" and isinstance(token, str)))
    exchange(daemon, hello_frame(version=version, role=role, token=token))


@HOSTILE
@given(depth=st.integers(1, 5000), kind=st.sampled_from(["array", "map"]))
def test_deeply_nested_headers(
    daemon: DaemonProcess, good: GoodClient, depth: int, kind: str
) -> None:
    opener = b"\x91" if kind == "array" else b"\x81\xa1k"  # fixarray(1) / fixmap(1) {"k": ...}
    body = b"\x82\xa1t\xablist_models\xaarequest_id" + opener * depth + b"\x01"
    exchange(daemon, HELLO + raw_header(body))


@HOSTILE
@given(
    marker=st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]),  # str32, bin32, array32, map32
    length=st.integers(0, 2**32 - 1),
    rest=st.binary(max_size=32),
)
def test_msgpack_objects_declaring_huge_lengths(
    daemon: DaemonProcess, good: GoodClient, marker: bytes, length: int, rest: bytes
) -> None:
    body = b"\x82\xa1t\xablist_models\xaarequest_id" + marker + length.to_bytes(4, "big") + rest
    exchange(daemon, HELLO + raw_header(body))


EXECUTOR_SIDE: list[Message] = [
    Infer(1, "tiny", 1, {"input": np.zeros((1, 4), np.float32)}, 0, 10),
    Load(2, "tiny", 0, 10),
    Hello(1, "client", "second hello"),
    Pong(1, 2, 3),
    InferReply(1, "ok", ""),
    Error("protocol_error", "from a client"),
]


@HOSTILE
@given(
    tag=st.text(max_size=16)
    | st.integers(-(2**63), 2**64 - 1)
    | st.none()
    | st.sampled_from(sorted(MESSAGE_TYPES)),
    executor_side=st.integers(0, len(EXECUTOR_SIDE)),
)
def test_unknown_and_out_of_place_message_types(
    daemon: DaemonProcess, good: GoodClient, tag: Any, executor_side: int
) -> None:
    if executor_side < len(EXECUTOR_SIDE):
        data = Encoder().encode_bytes(EXECUTOR_SIDE[executor_side])
    else:
        data = frame({"t": tag, "request_id": 1})
    exchange(daemon, HELLO + data)


@HOSTILE
@given(
    dtype=st.sampled_from([*WIRE_DTYPES, "float128", "object", "<f4", "complex64", ""]),
    shape=st.lists(st.integers(0, 8) | st.integers(-3, 2**63 - 1), max_size=4),
    offset=st.integers(0, 64) | st.integers(-(2**63), 2**64 - 1),
    nbytes=st.integers(0, 256) | st.integers(-(2**63), 2**64 - 1),
    tail_len=st.integers(0, 256),
)
def test_tensors_whose_bytes_disagree_with_dtype_and_shape(
    daemon: DaemonProcess,
    good: GoodClient,
    dtype: str,
    shape: list[int],
    offset: int,
    nbytes: int,
    tail_len: int,
) -> None:
    header = dict(INFER_HEADER, inputs={"input": [dtype, shape, offset, nbytes]})
    exchange(daemon, HELLO + frame(header, bytes(tail_len)))


def test_a_consistent_tensor_of_the_wrong_shape_is_a_bad_input_reply(
    daemon: DaemonProcess, good: GoodClient
) -> None:
    header = dict(INFER_HEADER, inputs={"input": ["float32", [1, 3], 0, 12]})
    with RawClient(daemon.api) as raw:
        assert raw.hello()["t"] == "hello"
        raw.send(frame(header, bytes(12)))
        reply = raw.read_frame(15.0)
    assert reply is not None and reply["t"] == "infer_reply"
    assert reply["status"] == "bad_input" and reply["message"]


def test_a_tail_nothing_refers_to_is_refused_before_it_is_read(
    daemon: DaemonProcess, good: GoodClient
) -> None:
    # A hello (no tensors, no token checked yet) declaring 60 MiB of tail, and an infer whose
    # tail is far longer than its one tensor: each is refused on its header, so the daemon
    # never buffers bytes nothing refers to.
    hello = msgpack.packb(
        {"t": "hello", "protocol_version": 1, "role": "client", "name": "x", "token": ""}
    )
    for data in (PREFIX.pack(len(hello), 60 << 20) + hello, HELLO + frame(INFER_HEADER, TAIL * 64)):
        with RawClient(daemon.api) as raw:
            raw.send(data)
            ending = raw.read_until_closed()
        assert ending.how == "eof" and ending.errors == ["protocol_error"], ending.headers
        assert "tail" in ending.headers[-1]["message"]


def test_the_oracle_names_what_it_should() -> None:
    assert expected_error(HELLO + infer_frame(1)) is None
    assert expected_error(hello_frame(version=2)) == "unsupported_version"
    assert expected_error(HELLO + PREFIX.pack(2**31, 0)) == "frame_too_large"
    assert expected_error(HELLO + frame({"t": "load", "action_id": 1})) == "protocol_error"
    assert expected_error(HELLO + msgpack.packb({"t": 1})[:1]) is None  # cut short
