"""The Open Inference Protocol's (KServe v2) tensors, as JSON and as the binary tensor data
extension: request bodies in, response bodies out. Pure: bytes and numpy, no I/O, no clock.
One idea: the protocol's tensor codec, both ways.

A request body is one JSON object, or (binary extension) a JSON object of
``header_bytes`` bytes followed by the raw bytes of the inputs whose ``parameters`` carry a
``binary_data_size``, back to back in the order the inputs are listed. A response is built the
same way: outputs asked for as binary (per output ``binary_data``, or the request's
``binary_data_output``) follow the JSON header; the others are JSON ``data`` lists.

Invariants: every bad body raises `TensorError` (a 400 for HTTP, INVALID_ARGUMENT for gRPC)
with a sentence naming the first problem, and nothing else; a tensor's bytes are checked
against its datatype and shape before an array is made; binary sizes must add up to exactly the
bytes after the header; arrays built from binary data are read-only views of the body (no
copy); element bytes are little-endian as on the wire protocol (docs/protocol.md, section 4);
a JSON ``data`` list, parsed back as doubles and cast to the datatype (as clients do), gives the
output's values bit for bit (`json_data`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from clockwork_async.wire.dtypes import WIRE_DTYPES, WIRE_NAMES

# The protocol's datatypes the daemon carries, and the wire dtype each one is: every one of
# `wire.dtypes` has one. BYTES (strings) and BF16 have no wire dtype (docs/protocol-v2.md).
DATATYPES: Mapping[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
DATATYPE_OF_DTYPE: Mapping[str, str] = {dtype: name for name, dtype in DATATYPES.items()}
# The wire's own table (`wire.dtypes`), by the protocol's names: looked up per tensor, where
# numpy's dtype constructor and ``dtype.name`` would cost microseconds each.
_DTYPES: Mapping[str, np.dtype[Any]] = {name: WIRE_DTYPES[wire] for name, wire in DATATYPES.items()}
MAX_NDIM = 16  # as the wire protocol's max_ndim
MAX_TENSORS = 256  # as the wire protocol's max_tensors


class TensorError(ValueError):
    """A request body or tensor that breaks the protocol; the message says what."""


@dataclass(frozen=True, slots=True)
class InputHeader:
    """One input as its JSON header describes it (the data itself comes later)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    binary_bytes: int | None  # bytes in the binary section; None: ``data`` is in the JSON
    data: Any = None  # the JSON ``data`` (nested or flat list) when not binary


@dataclass(frozen=True, slots=True)
class RequestHeader:
    """An infer request's JSON header, parsed; its tensors are built by `build_inputs`."""

    id: str
    inputs: tuple[InputHeader, ...]
    outputs: tuple[tuple[str, bool | None], ...] | None  # asked-for outputs, binary or not
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @property
    def binary_bytes(self) -> int:
        return sum(spec.binary_bytes or 0 for spec in self.inputs)

    def binary_output_default(self) -> bool:
        return self.parameters.get("binary_data_output") is True


def dtype_of(datatype: str) -> np.dtype[Any]:
    """The numpy dtype (little-endian) of a protocol datatype. Raises TensorError."""
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        known = ", ".join(DATATYPES)
        raise TensorError(f"datatype {datatype!r} is not supported (supported: {known})")
    return dtype


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The protocol datatype of a numpy dtype. Raises TensorError."""
    name = DATATYPE_OF_DTYPE.get(WIRE_NAMES.get(dtype, ""))
    if name is None:
        raise TensorError(f"dtype {dtype} has no Open Inference Protocol datatype")
    return name


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints. Raises TensorError."""
    if not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM:
        raise TensorError(f"input {name!r}: shape must be a list of at most {MAX_NDIM} integers")
    dims = tuple(shape)
    if not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in dims):
        raise TensorError(f"input {name!r}: shape {list(dims)} must hold integers >= 0")
    return dims


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


# --- requests in ------------------------------------------------------------------------------


def parse_request(json_bytes: bytes | memoryview) -> RequestHeader:
    """Parse an infer request's JSON (the whole body, or the binary extension's header).
    Raises TensorError."""
    try:
        document = _loads(json_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TensorError(f"the request is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise TensorError("the request must be a JSON object")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise TensorError("id must be a string")
    parameters = _parameters(document, "the request")
    inputs = document.get("inputs")
    if not isinstance(inputs, list) or not inputs or len(inputs) > MAX_TENSORS:
        raise TensorError(f"inputs must be a list of 1 to {MAX_TENSORS} tensors")
    headers = tuple(_input_header(item) for item in inputs)
    if len({header.name for header in headers}) != len(headers):
        raise TensorError("inputs must have distinct names")
    return RequestHeader(request_id, headers, _requested_outputs(document), parameters)


def _loads(json_bytes: bytes | memoryview) -> Any:
    """orjson (C, reads the view without a copy: a tenth of the time on long ``data`` lists);
    what it refuses and the standard library accepts (``NaN``, integers over 64 bits) is read
    by the standard library, which also words the error."""
    try:
        return orjson.loads(json_bytes)
    except orjson.JSONDecodeError:
        return json.loads(bytes(json_bytes))


def _parameters(document: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise TensorError(f"parameters of {what} must be a JSON object")
    return parameters


def _input_header(item: object) -> InputHeader:
    if not isinstance(item, dict):
        raise TensorError("each input must be a JSON object")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise TensorError("each input needs a name (a non-empty string)")
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise TensorError(f"input {name!r} needs a datatype (a string)")
    dtype = dtype_of(datatype)
    shape = check_shape(name, item.get("shape"))
    binary = _parameters(item, f"input {name!r}").get("binary_data_size")
    if binary is None:
        if "data" not in item:
            raise TensorError(f"input {name!r} has neither data nor binary_data_size")
        return InputHeader(name, datatype, shape, None, item["data"])
    if not isinstance(binary, int) or isinstance(binary, bool) or binary < 0:
        raise TensorError(f"input {name!r}: binary_data_size must be an integer >= 0")
    expected = element_count(shape) * dtype.itemsize
    if binary != expected:
        raise TensorError(
            f"input {name!r}: binary_data_size {binary} does not match its shape "
            f"{list(shape)} of {datatype} ({expected} bytes)"
        )
    return InputHeader(name, datatype, shape, binary)


def _requested_outputs(document: Mapping[str, Any]) -> tuple[tuple[str, bool | None], ...] | None:
    outputs = document.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list) or len(outputs) > MAX_TENSORS:
        raise TensorError(f"outputs must be a list of at most {MAX_TENSORS} entries")
    asked = []
    for item in outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise TensorError("each requested output must be an object with a name")
        binary = _parameters(item, f"output {item['name']!r}").get("binary_data")
        asked.append((item["name"], binary if isinstance(binary, bool) else None))
    return tuple(asked)


def build_inputs(header: RequestHeader, binary: bytes | memoryview = b"") -> dict[str, np.ndarray]:
    """The request's input tensors: JSON ``data`` converted, binary ones as read-only views
    of ``binary`` (the bytes after the JSON header, exactly the binary inputs' sizes added up).
    Raises TensorError."""
    view = memoryview(binary)
    if view.nbytes != header.binary_bytes:
        raise TensorError(
            f"the binary section holds {view.nbytes} bytes but the inputs' binary_data_size "
            f"add up to {header.binary_bytes}"
        )
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for spec in header.inputs:
        dtype = dtype_of(spec.datatype)
        if spec.binary_bytes is None:
            arrays[spec.name] = _from_json(spec, dtype)
            continue
        chunk = view[offset : offset + spec.binary_bytes]
        offset += spec.binary_bytes
        array = np.frombuffer(chunk, dtype=dtype).reshape(spec.shape)
        arrays[spec.name] = _native(array)
    return arrays


def array_from_bytes(
    name: str, datatype: str, shape: Sequence[int], raw: bytes | memoryview
) -> np.ndarray:
    """One tensor from its raw little-endian bytes (gRPC ``raw_input_contents``), a read-only
    view of them. Raises TensorError when the byte count does not fit the shape."""
    dtype = dtype_of(datatype)
    dims = check_shape(name, list(shape))
    expected = element_count(dims) * dtype.itemsize
    if len(raw) != expected:
        raise TensorError(
            f"input {name!r}: {len(raw)} bytes of raw contents do not match its shape "
            f"{list(dims)} of {datatype} ({expected} bytes)"
        )
    return _native(np.frombuffer(raw, dtype=dtype).reshape(dims))


def array_from_values(
    name: str, datatype: str, shape: Sequence[int], values: Sequence[Any]
) -> np.ndarray:
    """One tensor from a flat or nested list of values. Raises TensorError."""
    spec = InputHeader(name, datatype, check_shape(name, list(shape)), None, values)
    return _from_json(spec, dtype_of(datatype))


def _from_json(spec: InputHeader, dtype: np.dtype[Any]) -> np.ndarray:
    try:  # a value the datatype cannot hold (300 as INT8, 1e300 as FP16) is refused
        with np.errstate(over="raise", invalid="raise"):
            array = np.asarray(spec.data, dtype=dtype.newbyteorder("="))
    except (ValueError, TypeError, OverflowError, FloatingPointError) as error:
        why = f"input {spec.name!r}: data are not {spec.datatype} values: {error}"
        raise TensorError(why) from None
    if array.size != element_count(spec.shape):
        raise TensorError(
            f"input {spec.name!r}: {array.size} values do not fill its shape {list(spec.shape)}"
        )
    if dtype.kind == "b" and not _is_bool_data(spec.data):
        raise TensorError(f"input {spec.name!r}: BOOL data must be true or false")
    return array.reshape(spec.shape)


def _is_bool_data(data: Any) -> bool:
    if isinstance(data, list):
        return all(_is_bool_data(item) for item in data)
    return isinstance(data, bool)


def _native(array: np.ndarray) -> np.ndarray:
    """A little-endian array as the machine's own dtype (itself on little-endian hosts)."""
    if sys.byteorder == "little":
        return array
    return array.astype(array.dtype.newbyteorder("="))


# --- responses out ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EncodedResponse:
    """A response body: ``json`` then ``binary`` chunks; ``header_bytes`` is the JSON's length
    when there are binary chunks (the ``Inference-Header-Content-Length``), else None."""

    json: bytes
    binary: tuple[memoryview, ...] = ()

    @property
    def header_bytes(self) -> int | None:
        return len(self.json) if self.binary else None

    @property
    def nbytes(self) -> int:
        return len(self.json) + sum(chunk.nbytes for chunk in self.binary)


def select_outputs(
    outputs: Mapping[str, np.ndarray], header: RequestHeader
) -> list[tuple[str, np.ndarray, bool]]:
    """The outputs to send, each with whether it goes binary: all of them (binary as the
    request's ``binary_data_output``) unless the request named some. Raises TensorError for
    a name the model does not have."""
    default = header.binary_output_default()
    if header.outputs is None:
        return [(name, array, default) for name, array in outputs.items()]
    chosen = []
    for name, binary in header.outputs:
        if name not in outputs:
            raise TensorError(f"unknown output {name!r} (the model has {sorted(outputs)})")
        chosen.append((name, outputs[name], default if binary is None else binary))
    return chosen


def encode_response(
    document: dict[str, Any], outputs: Sequence[tuple[str, np.ndarray, bool]]
) -> EncodedResponse:
    """``document`` (model_name, id, ...) with an ``outputs`` list added: JSON ``data`` or a
    ``binary_data_size`` and the bytes after the JSON."""
    entries = []
    chunks = []
    finite = True
    for name, array, binary in outputs:
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array.dtype),
            "shape": list(array.shape),
        }
        if binary:
            little = np.ascontiguousarray(array, array.dtype.newbyteorder("<"))
            raw = memoryview(little.view(np.uint8).reshape(-1))  # type: ignore[arg-type]
            entry["parameters"] = {"binary_data_size": raw.nbytes}
            chunks.append(raw)
        else:
            entry["data"] = json_data(array)
            finite = finite and _finite(entry["data"])
        entries.append(entry)
    document = {**document, "outputs": entries}
    if not finite:  # NaN and Infinity as the standard library writes them (orjson: null)
        body = json.dumps(document, separators=(",", ":"), default=_as_list).encode()
    else:
        body = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    return EncodedResponse(body, tuple(chunks))


# float32 magnitudes whose shortest float32 decimal (at most 9 digits), read as a double and
# rounded to float32, is the value again: a double read can land on the midpoint between two
# float32s (and round the wrong way) only for decimals within 2**-53 of it, which needs 13
# or more decimals after the point (|x| < 1e-4) or a value over 2**63. With margin, as the
# bits of |x| (ordered as |x| is, NaN above infinity) from the lowest, so one unsigned
# comparison checks the range:
_SHORT_FP32_LOW_BITS = int(np.float32(2e-4).view(np.uint32))
_SHORT_FP32_SPAN_BITS = int(np.float32(1e18).view(np.uint32)) - _SHORT_FP32_LOW_BITS
_ABS_BITS = 0x7FFF_FFFF
# The same range as doubles (its ends are float32s, so the comparisons agree with the bits'),
# checked in Python for small arrays, where numpy's few array operations cost microseconds
# each (a request's output is often a handful of values).
_SHORT_FP32_LOW = float(np.float32(2e-4))
_SHORT_FP32_HIGH = float(np.float32(1e18))
_SMALL_ELEMENTS = 32


def json_data(array: np.ndarray) -> np.ndarray:
    """``array`` flat, in a dtype orjson writes as a JSON list (OPT_SERIALIZE_NUMPY) whose
    values read back as the array's, bit for bit: float32 as its shortest float32 decimals
    when every value is 0 or in [2e-4, 1e18] (about half the text and time of doubles), other
    floats as doubles (exact: each float16 or float32 is one), integers and bools as they
    are."""
    flat = np.ascontiguousarray(array, array.dtype.newbyteorder("=")).reshape(-1)
    if flat.dtype.kind != "f":
        return flat
    if flat.dtype == np.float32 and _short_fp32(flat):
        return flat
    return flat.astype(np.float64)


def _short_fp32(flat: np.ndarray) -> bool:
    """Whether every value of a float32 array is 0 or has a magnitude in [2e-4, 1e18]."""
    if flat.size <= _SMALL_ELEMENTS:  # NaN compares false: out of the range, as its bits are
        low, high = _SHORT_FP32_LOW, _SHORT_FP32_HIGH
        return all(value == 0.0 or low <= abs(value) <= high for value in flat.tolist())
    bits = flat.view(np.uint32) & np.uint32(_ABS_BITS)
    offset = bits - np.uint32(_SHORT_FP32_LOW_BITS)  # wraps: below the range is huge
    if offset.size == 0 or int(offset.max()) <= _SHORT_FP32_SPAN_BITS:
        return True
    return bool(((offset <= _SHORT_FP32_SPAN_BITS) | (bits == 0)).all())


def _finite(data: np.ndarray) -> bool:
    """Whether `json_data`'s ``data`` holds no NaN or infinity (float32 there never does)."""
    return data.dtype != np.float64 or bool(np.isfinite(data).all())


def _as_list(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def error_body(message: str) -> bytes:
    """The protocol's error object, ``{"error": message}``."""
    return json.dumps({"error": message}, separators=(",", ":")).encode()
