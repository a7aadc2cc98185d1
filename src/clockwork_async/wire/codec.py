"""Framing and message codec of the clockwork-async wire protocol. No I/O, no asyncio, no clock.

One idea: bytes to messages and messages to bytes.

A frame is ``prefix | header | tail``: the prefix is two big-endian u32 (``header_len``,
``tail_len``); the header one msgpack map ``{"t": TAG, field: value, ...}``; the tail raw bytes
that the header's tensors reference as ``[dtype, shape, offset, nbytes]`` (docs/protocol.md).

Invariants:
- `Decoder`: any bytes either yield messages whose every field has its declared type, or a
  `ProtocolError`; never another exception. Declared lengths are checked against `Limits`
  before anything is allocated, so memory stays bounded.
- After a `ProtocolError` the decoder is `FAILED` for good: it discards input and re-raises.
- A decoded tensor is a numpy view of its frame's own tail buffer, fresh for every frame.
- `Encoder` never copies a C-contiguous little-endian tensor: its buffer goes out as is, so the
  caller must not mutate it until the bytes are written.
- A `Screen` sees each frame's header before its tail: a frame it refuses keeps none of its
  tail's bytes (they are read into a scratch buffer and dropped) and comes out as `Screened`
  (its class, its non-tensor fields and the screen's reason) in its place, in order.
- A `Lend` hook, asked right after a frame's screen passed it, may hand the buffer its tail
  is read into (a slot of the daemon's IO arena): the tensors are then views of that memory,
  and whoever lent it owns it. Otherwise the tail gets a fresh buffer of its own.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import numpy as np

from clockwork_async.wire.dtypes import WIRE_DTYPES
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    Hello,
    Message,
)
from clockwork_async.wire.schema import (
    DEFAULT_LIMITS,
    SCHEMA_BY_CLASS,
    SCHEMAS,
    TENSOR_ALIGN_BYTES,
    Field,
    Limits,
    Schema,
    SchemaError,
    TailBuilder,
    TensorRef,
    check_keys,
    check_tensor_layout,
    decode_field,
    expect,
    parse_tensor_map,
    tensor_view,
)

__all__ = [
    "DEFAULT_LIMITS",
    "PREFIX",
    "PREFIX_BYTES",
    "WIRE_DTYPES",
    "Decoder",
    "DecoderState",
    "EncodeError",
    "Encoder",
    "Lend",
    "Limits",
    "ProtocolError",
    "Screen",
    "Screened",
]

PREFIX = struct.Struct(">II")
PREFIX_BYTES = PREFIX.size
_SCRATCH_BYTES = 16 * 1024  # get_buffer's buffer outside a tail: small, so little is copied twice
_DISCARD_BYTES = 256 * 1024  # where a screened-out tail is read, in few system calls

# (message class, its non-tensor fields, tail bytes) -> None to decode it, or why not
Screen = Callable[[type[Any], Mapping[str, Any], int], "str | None"]
# (tail bytes) -> a uint8 buffer of exactly that many bytes to read the tail into, or None
Lend = Callable[[int], "np.ndarray | None"]


@dataclass(frozen=True, slots=True)
class Screened:
    """A frame a `Screen` refused from its header: its tensors were never kept."""

    cls: type[Any]
    fields: Mapping[str, Any]
    reason: str
    frame_bytes: int


class ProtocolError(Exception):
    """Bytes from a peer that do not decode. ``code`` is PROTOCOL_ERROR, FRAME_TOO_LARGE or
    UNSUPPORTED_VERSION; ``message`` is for people."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class EncodeError(ValueError):
    """A message this side cannot encode: a field of the wrong type, an unsupported dtype, or
    a frame over the encoder's limits."""


# --- Encoder ---------------------------------------------------------------------------------


class Encoder:
    """Messages to frames. Reuses one msgpack Packer; not thread-safe (one per connection)."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)

    def encode(self, message: Message) -> list[bytes | memoryview]:
        """The frame of ``message``: prefix+header, then the tensors' own buffers (for
        ``transport.writelines``). Raises EncodeError for a message that cannot go out."""
        schema = SCHEMA_BY_CLASS.get(type(message))
        if schema is None:
            raise EncodeError(f"{type(message).__name__} is not a wire message")
        tail = TailBuilder()
        try:
            header = self._header(schema, message, tail)
        except SchemaError as e:
            raise EncodeError(f"{schema.cls.__name__}: {e}") from None
        self._check_size(len(header), tail)
        return [PREFIX.pack(len(header), tail.nbytes) + header, *tail.pieces]

    def encode_bytes(self, message: Message) -> bytes:
        """The whole frame of ``message`` as one bytes object (copies the tensors)."""
        return b"".join(self.encode(message))

    def _header(self, schema: Schema, message: Message, tail: TailBuilder) -> bytes:
        header: dict[str, Any] = {"t": schema.cls.TAG}
        for f in schema.fields:
            value = getattr(message, f.name)
            if f.omit_at_default and value == f.default:
                continue  # a peer that predates the field reads the message too
            if type(value) is f.exact_type and f.exact_type is not int:
                header[f.name] = value  # str, bool, bytes: already what the wire carries
                continue
            try:
                header[f.name] = tail.add_map(value) if f.tensors else f.encode(value)
            except SchemaError as e:
                raise SchemaError(f"field {f.name!r}: {e}") from None
        packed: bytes = self._packer.pack(header)
        return packed

    def _check_size(self, header_bytes: int, tail: TailBuilder) -> None:
        limits = self._limits
        if header_bytes > limits.max_header_bytes or tail.nbytes > limits.max_tail_bytes:
            raise EncodeError(
                f"frame of header {header_bytes} B and tail {tail.nbytes} B exceeds limits "
                f"({limits.max_header_bytes} B, {limits.max_tail_bytes} B)"
            )
        if tail.count > limits.max_tensors:
            raise EncodeError(f"{tail.count} tensors; at most {limits.max_tensors}")


# --- Decoder ---------------------------------------------------------------------------------


class DecoderState(Enum):
    PREFIX = "prefix"  # reading the 8-byte prefix of the next frame
    HEADER = "header"  # reading header_len bytes of msgpack header
    TAIL = "tail"  # reading tail_len bytes of tensors into the frame's own buffer
    FAILED = "failed"  # a ProtocolError was found; nothing more decodes


_TRANSITIONS: dict[DecoderState, tuple[DecoderState, ...]] = {
    DecoderState.PREFIX: (DecoderState.HEADER, DecoderState.FAILED),
    DecoderState.HEADER: (DecoderState.TAIL, DecoderState.PREFIX, DecoderState.FAILED),
    DecoderState.TAIL: (DecoderState.PREFIX, DecoderState.FAILED),
    DecoderState.FAILED: (),
}


class _Lent(Enum):
    SCRATCH = "scratch"
    TAIL = "tail"
    DISCARD = "discard"


@dataclass(slots=True)
class _Frame:
    """A frame whose header is decoded and checked, waiting for its tail."""

    cls: type[Any]
    kwargs: dict[str, Any]
    tensors: dict[str, dict[str, TensorRef]]
    frame_bytes: int
    screened: str | None = None  # why its tail is dropped (a `Screen` refused it)


def _protocol_error(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.PROTOCOL_ERROR, message)


def _check_hello(header: Any) -> None:
    """The first header must be a Hello of our version. Reads only ``t`` and
    ``protocol_version``, so a future Hello with new fields still gets UNSUPPORTED_VERSION."""
    tag = header.get("t") if type(header) is dict else None
    if tag != Hello.TAG:
        raise _protocol_error(f"the first message must be {Hello.TAG!r}, got {tag!r}")
    version = header.get("protocol_version")
    if type(version) is int and version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"peer speaks protocol version {version}; this side speaks {PROTOCOL_VERSION}",
        )


def _check_tail_holds_tensors(refs: list[TensorRef], tail_len: int) -> None:
    """A tail holds its message's tensors and their alignment padding, nothing more, so no
    frame makes the receiver buffer bytes nothing refers to (a ``hello`` declaring a 64 MiB
    tail, before any token is checked). Raises SchemaError."""
    most = sum(r.nbytes for r in refs) + TENSOR_ALIGN_BYTES * len(refs)
    if tail_len > most:
        raise SchemaError(f"a tail of {tail_len} B for {len(refs)} tensors of at most {most} B")


class Decoder:
    """Bytes to messages, fed by `feed` or by the BufferedProtocol pair `get_buffer` /
    `buffer_updated`. Neither raises ProtocolError: `next_message` returns every message
    decoded before the error, then raises it (every call from then on)."""

    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        *,
        expect_hello: bool = False,
        screen: Screen | None = None,
    ) -> None:
        self._limits = limits
        self.screen = screen  # may be set later (a server's session, after the hello)
        self.lend: Lend | None = None  # where a screened-in tail is read (`Lend`)
        self._unpack_options = limits.unpack_options()
        self._hello_pending = expect_hello
        self._state = DecoderState.PREFIX
        self._pending = bytearray()  # prefix or header bytes of the current frame
        self._header_len = 0
        self._tail_len = 0
        self._frame: _Frame | None = None
        self._tail: np.ndarray[Any, Any] = np.empty(0, np.uint8)
        self._tail_view = memoryview(b"")
        self._tail_filled = 0
        self._ready: deque[tuple[Message | Screened, int]] = deque()
        self._ready_bytes = 0
        self._error: ProtocolError | None = None
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._discard: memoryview | None = None  # made at the first screened-out tail
        self._lent: _Lent | None = None

    # Public state.

    @property
    def state(self) -> DecoderState:
        return self._state

    @property
    def error(self) -> ProtocolError | None:
        return self._error

    @property
    def buffered_messages(self) -> int:
        """Messages decoded and not yet taken by `next_message`."""
        return len(self._ready)

    @property
    def buffered_bytes(self) -> int:
        """Frame bytes of the messages decoded and not yet taken."""
        return self._ready_bytes

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has arrived and the rest has not."""
        started = self._state is not DecoderState.PREFIX or bool(self._pending)
        return started and self._state is not DecoderState.FAILED

    # Input.

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Decode ``data`` (copied as needed; the caller may reuse it). Ignored once FAILED."""
        self._lent = None
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self._consume(view)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should go: the rest of the current tail (so tensor
        bytes land in their final buffer), else a scratch buffer. Never empty."""
        if self._state is DecoderState.TAIL:
            if self._frame is not None and self._frame.screened is not None:
                self._lent = _Lent.DISCARD
                discard = self._discard_buffer()
                return discard[: self._tail_len - self._tail_filled]
            self._lent = _Lent.TAIL
            return self._tail_view[self._tail_filled :]
        self._lent = _Lent.SCRATCH
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written at the start of the last `get_buffer`'s buffer."""
        lent, self._lent = self._lent, None
        if lent is None:
            raise RuntimeError("buffer_updated() without a get_buffer() before it")
        if lent is not _Lent.SCRATCH:
            self._advance_tail(nbytes)
        else:
            self._consume(self._scratch[:nbytes])

    # Output.

    def next_frame(self) -> tuple[Message | Screened, int] | None:
        """The next decoded message and its frame's size in bytes; None when more bytes are
        needed. Raises ProtocolError once every message before a bad frame has been taken."""
        if self._ready:
            message, frame_bytes = self._ready.popleft()
            self._ready_bytes -= frame_bytes
            return message, frame_bytes
        if self._error is not None:
            raise ProtocolError(self._error.code, self._error.message)
        return None

    def next_message(self) -> Message | Screened | None:
        """The next decoded message, or None; raises like `next_frame`."""
        frame = self.next_frame()
        return None if frame is None else frame[0]

    # Internals.

    def _enter(self, state: DecoderState) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"decoder cannot go from {self._state.name} to {state.name}")
        self._state = state

    def _fail(self, error: ProtocolError) -> None:
        self._error = error
        self._enter(DecoderState.FAILED)
        self._pending = bytearray()
        self._frame = None
        self._tail, self._tail_view = np.empty(0, np.uint8), memoryview(b"")

    def _consume(self, data: memoryview) -> None:
        position = 0
        while position < len(data) and self._state is not DecoderState.FAILED:
            if self._state is DecoderState.TAIL:
                position = self._copy_tail(data, position)
            else:
                position = self._copy_head(data, position)

    def _copy_head(self, data: memoryview, position: int) -> int:
        goal = PREFIX_BYTES if self._state is DecoderState.PREFIX else self._header_len
        if not self._pending and len(data) - position >= goal:
            self._on_head(data[position : position + goal])  # whole in the input: no copy
            return position + goal
        chunk = data[position : position + goal - len(self._pending)]
        self._pending += chunk
        if len(self._pending) == goal:
            head, self._pending = bytes(self._pending), bytearray()
            self._on_head(head)
        return position + len(chunk)

    def _copy_tail(self, data: memoryview, position: int) -> int:
        count = min(len(data) - position, self._tail_len - self._tail_filled)
        start = self._tail_filled
        if self._frame is None or self._frame.screened is None:
            self._tail_view[start : start + count] = data[position : position + count]
        self._advance_tail(count)
        return position + count

    def _discard_buffer(self) -> memoryview:
        if self._discard is None:
            self._discard = memoryview(bytearray(_DISCARD_BYTES))
        return self._discard

    def _advance_tail(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self._tail_len - self._tail_filled:
            raise RuntimeError(f"buffer_updated({nbytes}) beyond the buffer lent")
        self._tail_filled += nbytes
        if self._tail_filled == self._tail_len:
            self._finish_frame()

    def _on_head(self, head: bytes | memoryview) -> None:
        """A whole prefix or header has arrived."""
        try:
            if self._state is DecoderState.PREFIX:
                self._on_prefix(head)
            else:
                self._on_header(head)
        except ProtocolError as e:
            self._fail(e)

    def _on_prefix(self, prefix: bytes | memoryview) -> None:
        header_len, tail_len = PREFIX.unpack(prefix)
        limits = self._limits
        if header_len > limits.max_header_bytes or tail_len > limits.max_tail_bytes:
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame declares header {header_len} B and tail {tail_len} B; limits are "
                f"{limits.max_header_bytes} B and {limits.max_tail_bytes} B",
            )
        if header_len == 0:
            raise _protocol_error("frame with an empty header")
        self._header_len, self._tail_len = header_len, tail_len
        self._enter(DecoderState.HEADER)

    def _on_header(self, header_bytes: bytes | memoryview) -> None:
        header = self._unpack(header_bytes)
        if self._hello_pending:
            _check_hello(header)
            self._hello_pending = False
        try:
            self._frame = frame = self._parse_header(header)
        except SchemaError as e:
            raise _protocol_error(str(e)) from None
        if self.screen is not None:
            frame.screened = self.screen(frame.cls, frame.kwargs, self._tail_len)
        if self._tail_len:
            if frame.screened is None:  # not zeroed: every byte is received
                lent = self._lent_tail()
                self._tail = np.empty(self._tail_len, np.uint8) if lent is None else lent
                self._tail_view = self._tail.data
            self._tail_filled = 0
            self._enter(DecoderState.TAIL)
        else:
            self._enter(DecoderState.TAIL)
            self._finish_frame()

    def _lent_tail(self) -> np.ndarray | None:
        """The buffer `lend` hands for this tail, if it is one of exactly its size."""
        lent = self.lend(self._tail_len) if self.lend is not None else None
        if lent is None or lent.shape != (self._tail_len,) or lent.dtype != np.uint8:
            return None
        return lent

    def _unpack(self, header_bytes: bytes | memoryview) -> Any:
        try:
            return msgpack.unpackb(header_bytes, **self._unpack_options)
        except Exception as e:  # msgpack's errors vary by input; all mean "bad header"
            raise _protocol_error(f"header is not valid msgpack: {e!r}") from None

    def _parse_header(self, header: Any) -> _Frame:
        expect(type(header) is dict, "a header map", header)
        tag = header.pop("t", None)
        schema = SCHEMAS.get(tag) if type(tag) is str else None
        if schema is None:
            raise SchemaError(f"unknown message tag {tag!r}")
        check_keys(schema, set(header))
        kwargs: dict[str, Any] = {}
        tensors: dict[str, dict[str, TensorRef]] = {}
        for f in schema.fields:
            if f.name not in header:
                continue
            value = header[f.name]
            if type(value) is f.exact_type:
                kwargs[f.name] = value  # the common case, without a call
            elif f.tensors:
                tensors[f.name] = self._parse_tensors(f, value)
            else:
                kwargs[f.name] = decode_field(f, value)
        refs = [r for refs in tensors.values() for r in refs.values()]
        check_tensor_layout(refs, self._limits)
        if self._tail_len:
            _check_tail_holds_tensors(refs, self._tail_len)
        frame_bytes = PREFIX_BYTES + self._header_len + self._tail_len
        return _Frame(schema.cls, kwargs, tensors, frame_bytes)

    def _parse_tensors(self, f: Field, value: Any) -> dict[str, TensorRef]:
        try:
            return parse_tensor_map(value, self._limits, self._tail_len)
        except SchemaError as e:
            raise SchemaError(f"field {f.name!r}: {e}") from None

    def _finish_frame(self) -> None:
        frame, self._frame = self._frame, None
        assert frame is not None  # set by _on_header before the tail
        if frame.screened is not None:
            screened = Screened(frame.cls, frame.kwargs, frame.screened, frame.frame_bytes)
            self._ready.append((screened, frame.frame_bytes))
            self._ready_bytes += frame.frame_bytes
            self._enter(DecoderState.PREFIX)
            return
        for name, refs in frame.tensors.items():
            frame.kwargs[name] = {key: tensor_view(self._tail, r) for key, r in refs.items()}
        self._ready.append((frame.cls(**frame.kwargs), frame.frame_bytes))
        self._ready_bytes += frame.frame_bytes
        self._tail, self._tail_view = np.empty(0, np.uint8), memoryview(b"")
        self._enter(DecoderState.PREFIX)
