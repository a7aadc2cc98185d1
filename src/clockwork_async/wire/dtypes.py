"""The tensor element types clockwork-async serves: one table for the wire, model files,
validation, executors and every front end. Pure: numpy and a name table, no I/O.

Invariants: a wire name is numpy's name of the dtype (``np.dtype(name).name == name``); the
bytes on the wire are always little-endian (``WIRE_DTYPES`` holds the little-endian dtype);
a model whose input or output has a type outside the table is refused at registration, so
every tensor a served model takes or gives can travel on the wire.

ONNX element types map onto the table by `onnx_wire_name`; ONNX's own types that numpy lacks
(bfloat16, float8, int4, string, complex) have no wire name. `request_shape` is the one rule
for the shape of a request's value, shared by the daemon's checks and the clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in (
        ("bool", "|b1"),
        ("int8", "|i1"),
        ("int16", "<i2"),
        ("int32", "<i4"),
        ("int64", "<i8"),
        ("uint8", "|u1"),
        ("uint16", "<u2"),
        ("uint32", "<u4"),
        ("uint64", "<u8"),
        ("float16", "<f2"),
        ("float32", "<f4"),
        ("float64", "<f8"),
    )
}
"""Tensor dtypes the wire carries, by wire name; the bytes are always little-endian."""

WIRE_NAMES: dict[np.dtype[Any], str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
"""The wire name of a little-endian (or byte-order free) dtype; a dict lookup is cheaper than
``dtype.name``, which numpy computes in Python on every call."""

# ONNX TensorProto.DataType values of the table (onnx.TensorProto.FLOAT == 1, ...); written
# out so this module needs no onnx import (the client side does not install onnx).
ONNX_ELEMENT_TYPES: dict[int, str] = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
}


def onnx_wire_name(element_type: int) -> str | None:
    """The wire name of an ONNX element type, or None when the wire cannot carry it."""
    return ONNX_ELEMENT_TYPES.get(element_type)


def supported_names() -> str:
    """The wire names, comma separated, for error messages."""
    return ", ".join(WIRE_DTYPES)


def request_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of one request's value of an input declared ``shape``: a dynamic axis 0 (the
    batch) is 1, every other axis as declared (-1: any length, where nothing declared it). An
    input without a batch axis (a scalar, a fixed shape) is sent whole."""
    return tuple(1 if axis == 0 and dim == -1 else dim for axis, dim in enumerate(shape))


def batch_shape(shape: Sequence[int], batch_size: int) -> tuple[int, ...]:
    """The shape of a batch of ``batch_size`` of an input declared ``shape``: the batch axis
    ``batch_size``, any other dynamic axis 1, an input without a batch axis whole."""
    return tuple(
        (batch_size if axis == 0 else 1) if dim == -1 else dim for axis, dim in enumerate(shape)
    )


def random_values(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> np.ndarray:
    """Seeded example values of a wire dtype: normal floats, small integers, random booleans.
    Raises KeyError for a dtype the wire does not carry."""
    wire_dtype = WIRE_DTYPES[dtype]
    if wire_dtype.kind == "f":
        return rng.standard_normal(tuple(shape)).astype(wire_dtype)
    if wire_dtype.kind == "b":
        return np.asarray(rng.random(tuple(shape)) < 0.5)
    return rng.integers(0, 10, tuple(shape)).astype(wire_dtype)
