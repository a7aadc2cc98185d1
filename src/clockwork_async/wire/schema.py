"""The wire schema: how each message field is checked on the way in and converted on the way
out, and how tensors are laid out in a frame's tail. No I/O.

Invariants: a field's decoder accepts exactly the msgpack values of its annotated type (lists
become tuples; ``bool`` is never an ``int``) and raises `SchemaError` for anything else; a
`TensorRef` that `parse_tensor_map` returns lies wholly inside the tail, and its byte count
equals its dtype's itemsize times the product of its shape.

One idea: a message field as the wire carries it, its checks and conversions both ways,
tensors' places in the tail included; split, the two directions would drift apart.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any, Union, get_args, get_origin, get_type_hints

import numpy as np

from clockwork_async.wire.dtypes import WIRE_DTYPES
from clockwork_async.wire.dtypes import WIRE_NAMES as _WIRE_NAMES
from clockwork_async.wire.messages import MESSAGE_TYPES, OMIT_AT_DEFAULT

TENSOR_ALIGN_BYTES = 8  # the encoder starts every non-empty tensor at a multiple of this
_PADDING = bytes(TENSOR_ALIGN_BYTES)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a peer may send. Nesting depth needs no bound of its own: the schema
    accepts nothing deeper than a tensor's shape (header map > tensor map > tensor > shape),
    and msgpack's parser stops at its fixed stack depth, within ``max_header_bytes``."""

    max_header_bytes: int = 1 << 20
    max_tail_bytes: int = 64 << 20  # per frame: all tensors of one message
    max_tensors: int = 256  # per message, all tensor fields together
    max_ndim: int = 16
    max_str_len: int = 64 << 10  # bytes of one msgpack str
    max_bin_len: int = 1 << 20  # bytes of one msgpack bin
    max_array_len: int = 1 << 16  # elements of one msgpack array
    max_map_len: int = 1 << 12  # entries of one msgpack map

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or not 0 < value < 1 << 32:
                raise ValueError(f"Limits.{f.name} must be an int in [1, 2**32), got {value!r}")

    def unpack_options(self) -> dict[str, Any]:
        """Keyword arguments that bound ``msgpack.unpackb`` by these limits."""
        return {
            "raw": False,
            "strict_map_key": True,
            "max_str_len": self.max_str_len,
            "max_bin_len": self.max_bin_len,
            "max_array_len": self.max_array_len,
            "max_map_len": self.max_map_len,
            "max_ext_len": 0,
        }


DEFAULT_LIMITS = Limits()


# --- Schema: per field, a wire -> value check and a value -> wire conversion ----------------

Convert = Callable[[Any], Any]


class SchemaError(Exception):
    """A value that does not match its field's type (PROTOCOL_ERROR or EncodeError)."""


def expect(ok: bool, what: str, value: Any) -> None:
    """Raises SchemaError("expected <what>, got <type>") unless ``ok``."""
    if not ok:
        raise SchemaError(f"expected {what}, got {type(value).__name__}")


def _dec_int(value: Any) -> int:
    expect(type(value) is int, "an integer", value)
    return int(value)


def _enc_int(value: Any) -> int:
    is_int = isinstance(value, int | np.integer) and not isinstance(value, bool)
    expect(is_int, "an integer", value)
    if not -(1 << 63) <= int(value) < 1 << 64:
        raise SchemaError(f"integer {value} does not fit in 64 bits")
    return int(value)


def _dec_float(value: Any) -> float:
    expect(type(value) in (float, int), "a number", value)
    return float(value)


def _enc_float(value: Any) -> float:
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    expect(ok, "a number", value)
    return float(value)


def _dec_str(value: Any) -> str:
    expect(type(value) is str, "a string", value)
    return str(value)


def _enc_str(value: Any) -> str:
    expect(isinstance(value, str), "a string", value)
    return str(value)


def _dec_bool(value: Any) -> bool:
    expect(type(value) is bool, "a boolean", value)
    return bool(value)


def _enc_bool(value: Any) -> bool:
    expect(isinstance(value, bool | np.bool_), "a boolean", value)
    return bool(value)


def _dec_bytes(value: Any) -> bytes:
    expect(type(value) is bytes, "bytes (msgpack bin)", value)
    return bytes(value)


def _enc_bytes(value: Any) -> bytes:
    expect(isinstance(value, bytes | bytearray | memoryview), "bytes", value)
    return bytes(value)


_SCALARS: dict[Any, tuple[Convert, Convert]] = {
    int: (_dec_int, _enc_int),
    float: (_dec_float, _enc_float),
    str: (_dec_str, _enc_str),
    bool: (_dec_bool, _enc_bool),
    bytes: (_dec_bytes, _enc_bytes),
}


def _optional(inner: tuple[Convert, Convert]) -> tuple[Convert, Convert]:
    dec, enc = inner
    return (lambda v: None if v is None else dec(v)), (lambda v: None if v is None else enc(v))


def _sequence(inner: tuple[Convert, Convert]) -> tuple[Convert, Convert]:
    dec, enc = inner

    def decode(value: Any) -> tuple[Any, ...]:
        expect(type(value) is list, "an array", value)
        return tuple(dec(item) for item in value)

    def encode(value: Any) -> list[Any]:
        expect(isinstance(value, tuple | list), "a tuple", value)
        return [enc(item) for item in value]

    return decode, encode


def _mapping(inner: tuple[Convert, Convert]) -> tuple[Convert, Convert]:
    dec, enc = inner

    def decode(value: Any) -> dict[str, Any]:
        expect(type(value) is dict, "a map", value)
        return {_dec_str(key): dec(item) for key, item in value.items()}

    def encode(value: Any) -> dict[str, Any]:
        expect(isinstance(value, Mapping), "a mapping", value)
        return {_enc_str(key): enc(item) for key, item in value.items()}

    return decode, encode


def _record(cls: type[Any]) -> tuple[Convert, Convert]:
    """A nested frozen dataclass (TensorSpec) travels as a map of its fields."""
    schema = _schema_of(cls)

    def encode(value: Any) -> dict[str, Any]:
        expect(isinstance(value, cls), cls.__name__, value)
        items = ((f, getattr(value, f.name)) for f in schema.fields)
        return {f.name: f.encode(v) for f, v in items if not f.omitted(v)}

    return (lambda value: cls(**_decode_plain_fields(schema, value))), encode


def _is_tensor_map(tp: Any) -> bool:
    return get_origin(tp) is Mapping and get_args(tp) == (str, np.ndarray)


def _converters(tp: Any) -> tuple[Convert, Convert]:
    """The (decode, encode) pair for one annotation; TypeError for a type the wire lacks."""
    origin, args = get_origin(tp), get_args(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _optional(_converters(args[0] if args[1] is type(None) else args[1]))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence(_converters(args[0]))
    if origin is Mapping and len(args) == 2 and args[0] is str and not _is_tensor_map(tp):
        return _mapping(_converters(args[1]))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _record(tp)
    raise TypeError(f"the wire codec cannot carry fields of type {tp!r}")


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    decode: Convert
    encode: Convert
    required: bool
    tensors: bool  # Mapping[str, np.ndarray]: carried in the tail
    exact_type: type | None = None  # a wire value of exactly this type is already the value
    omit_at_default: bool = False  # an added field: not written while it holds its default
    default: Any = None

    def omitted(self, value: Any) -> bool:
        """Whether the encoder leaves out this field holding ``value``."""
        return self.omit_at_default and value == self.default


@dataclass(frozen=True, slots=True)
class Schema:
    cls: type[Any]
    fields: tuple[Field, ...]
    names: frozenset[str]


def _tensors_not_plain(value: Any) -> Any:
    raise RuntimeError("tensor fields go through parse_tensor_map / TailBuilder")


def _field_of(f: dataclasses.Field[Any], tp: Any) -> Field:
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if _is_tensor_map(tp):
        return Field(f.name, _tensors_not_plain, _tensors_not_plain, required, tensors=True)
    decode, encode = _converters(tp)
    exact_type = tp if tp in (int, str, bool, bytes) else None
    omit = bool(f.metadata.get(OMIT_AT_DEFAULT))
    return Field(f.name, decode, encode, required, False, exact_type, omit, f.default)


def _schema_of(cls: type[Any]) -> Schema:
    hints = get_type_hints(cls)
    fields = tuple(_field_of(f, hints[f.name]) for f in dataclasses.fields(cls))
    return Schema(cls, fields, frozenset(f.name for f in fields))


SCHEMAS: dict[str, Schema] = {tag: _schema_of(cls) for tag, cls in MESSAGE_TYPES.items()}
SCHEMA_BY_CLASS: dict[type[Any], Schema] = {s.cls: s for s in SCHEMAS.values()}


def check_keys(schema: Schema, keys: set[str]) -> None:
    """Raises SchemaError for an unknown key or a missing required field."""
    unknown = keys - schema.names
    if unknown:
        raise SchemaError(f"unknown field(s) {sorted(map(str, unknown))} in {schema.cls.__name__}")
    missing = [f.name for f in schema.fields if f.required and f.name not in keys]
    if missing:
        raise SchemaError(f"missing field(s) {missing} in {schema.cls.__name__}")


def _decode_plain_fields(schema: Schema, obj: Any) -> dict[str, Any]:
    """Checked keyword arguments for ``schema.cls`` from a map without tensors."""
    expect(type(obj) is dict, "a map", obj)
    check_keys(schema, set(obj))
    return {f.name: decode_field(f, obj[f.name]) for f in schema.fields if f.name in obj}


def decode_field(f: Field, value: Any) -> Any:
    """``value`` checked and converted for field ``f``; the SchemaError names the field."""
    try:
        return f.decode(value)
    except SchemaError as e:
        raise SchemaError(f"field {f.name!r}: {e}") from None


# --- Tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor as the header declares it: ``nbytes`` bytes of the tail from ``offset``."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _parse_shape(value: Any, limits: Limits) -> tuple[int, ...]:
    expect(type(value) is list, "a shape array", value)
    if len(value) > limits.max_ndim:
        raise SchemaError(f"tensor of {len(value)} dims; at most {limits.max_ndim}")
    shape = tuple(_dec_int(dim) for dim in value)
    if any(dim < 0 for dim in shape):
        raise SchemaError(f"negative dimension in shape {shape}")
    return shape


def _parse_tensor_ref(value: Any, limits: Limits, tail_len: int) -> TensorRef:
    """Raises SchemaError unless ``value`` is a tensor lying wholly inside a tail of tail_len."""
    ok = type(value) is list and len(value) == 4
    expect(ok, "a tensor [dtype, shape, offset, nbytes]", value)
    dtype_name, shape_value, offset_value, nbytes_value = value
    dtype = WIRE_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise SchemaError(f"unsupported tensor dtype {dtype_name!r}")
    shape = _parse_shape(shape_value, limits)
    offset, nbytes = _dec_int(offset_value), _dec_int(nbytes_value)
    if nbytes != prod(shape) * dtype.itemsize:
        raise SchemaError(f"nbytes {nbytes} != {dtype_name} x {shape}")
    if prod(max(dim, 1) for dim in shape) * dtype.itemsize > limits.max_tail_bytes:
        raise SchemaError(f"shape {shape} could never fit in a tail")  # numpy could not build it
    if offset < 0 or offset + nbytes > tail_len:
        raise SchemaError(f"tensor bytes [{offset}, {offset + nbytes}) outside tail of {tail_len}")
    return TensorRef(dtype, shape, offset, nbytes)


def parse_tensor_map(value: Any, limits: Limits, tail_len: int) -> dict[str, TensorRef]:
    """A tensor field's checked descriptors by tensor name; raises SchemaError."""
    expect(type(value) is dict, "a map of tensors", value)
    return {_dec_str(k): _parse_tensor_ref(v, limits, tail_len) for k, v in value.items()}


def check_tensor_layout(refs: list[TensorRef], limits: Limits) -> None:
    """Raises SchemaError for too many tensors in one message, or overlapping bytes."""
    if len(refs) > limits.max_tensors:
        raise SchemaError(f"{len(refs)} tensors in one message; at most {limits.max_tensors}")
    spans = sorted((r.offset, r.offset + r.nbytes) for r in refs if r.nbytes)
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            raise SchemaError("tensors overlap in the tail")


def tensor_view(tail: np.ndarray[Any, Any], ref: TensorRef) -> np.ndarray[Any, Any]:
    """A view of ``ref``'s bytes of ``tail`` (no copy)."""
    flat = tail[ref.offset : ref.offset + ref.nbytes].view(ref.dtype)
    return flat.reshape(ref.shape)


def _wire_array(value: Any) -> tuple[str, np.ndarray[Any, Any]]:
    """``value``'s wire dtype name and the value as a C-contiguous little-endian array of that
    dtype; copies only if needed."""
    expect(isinstance(value, np.ndarray), "a numpy array", value)
    array: np.ndarray[Any, Any] = value
    name = _WIRE_NAMES.get(array.dtype)  # the common case: already a wire dtype
    if name is None:
        name = array.dtype.name
        wire_dtype = WIRE_DTYPES.get(name)
        if wire_dtype is None or array.dtype.fields is not None:
            raise SchemaError(f"unsupported tensor dtype {array.dtype!s}")
        array = array.astype(wire_dtype)  # another byte order
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return name, array


class TailBuilder:
    """The tail being built by the encoder: the pieces to write and where each tensor lies."""

    def __init__(self) -> None:
        self.pieces: list[bytes | memoryview] = []
        self.nbytes = 0
        self.count = 0

    def add(self, dtype_name: str, array: np.ndarray[Any, Any]) -> list[Any]:
        """Append ``array``'s bytes (8-byte aligned; a wire array, see `_wire_array`); return
        its header entry."""
        self.count += 1
        nbytes = array.nbytes
        if nbytes == 0:
            return [dtype_name, list(array.shape), self.nbytes, 0]
        pad = -self.nbytes % TENSOR_ALIGN_BYTES
        if pad:
            self.pieces.append(_PADDING[:pad])
            self.nbytes += pad
        ref = [dtype_name, list(array.shape), self.nbytes, nbytes]
        self.pieces.append(array.data.cast("B"))
        self.nbytes += nbytes
        return ref

    def add_map(self, value: Any) -> dict[str, list[Any]]:
        expect(isinstance(value, Mapping), "a mapping of name -> numpy array", value)
        return {_enc_str(name): self.add(*_wire_array(array)) for name, array in value.items()}
