"""Requests' tensors in and out of batches, as bytes or as IO arena references. Pure: numpy
only (and the arena's slots, read and pinned by the caller).

A request carries exactly one row of every input: the model's TensorSpec shape with the leading
(batch) axis equal to 1. A batch stacks the rows of its requests in the order the core listed
them and pads up to the action's batch size by repeating the last row (a real row keeps every
kernel on its usual numeric path; zeros could hit slow denormal or special-case code). Output
row ``i`` of a batch belongs to the ``i``-th request; a request gets views, not copies, of its
rows.

Invariants: ``validate_request`` accepts exactly what ``assemble_batch`` can stack; a model with
a dynamic axis other than the batch axis accepts requests only if it runs at batch 1 alone
(rows of different lengths cannot be stacked); a model.toml declares such axes, so a model from
the repository has none. A tensor without a batch axis (a scalar, or a fixed shape whose axis 0
is not dynamic) is sent whole: its model runs at batch 1 only (`model_info`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from clockwork_async.ioarena.shared import Slot, row_nbytes
from clockwork_async.wire.dtypes import batch_shape, request_shape
from clockwork_async.wire.messages import TensorSpec


class BadInput(ValueError):
    """A request's tensors do not fit the model; the message names the first problem."""


@lru_cache(maxsize=256)
def _dtype(name: str) -> np.dtype[np.generic]:
    return np.dtype(name)


def validate_request(
    model: str,
    specs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    inputs: Mapping[str, object],
) -> None:
    """Check that ``inputs`` hold exactly one row of every input of ``model``.

    Raises BadInput naming the first problem: a missing or unexpected input, a value that is not
    a numpy array, a wrong dtype, rank or shape.
    """
    if len(inputs) != len(specs) or any(spec.name not in inputs for spec in specs):
        expected = sorted(spec.name for spec in specs)
        missing = [name for name in expected if name not in inputs]
        if missing:
            raise BadInput(f"missing input {missing[0]!r} of model {model!r} (takes {expected})")
        extra = sorted(name for name in inputs if name not in expected)
        raise BadInput(f"unexpected input {extra[0]!r}: model {model!r} takes {expected}")
    for spec in specs:
        _check_row(model, spec, batch_sizes, inputs[spec.name])


def _check_row(model: str, spec: TensorSpec, batch_sizes: Sequence[int], value: object) -> None:
    if not isinstance(value, np.ndarray):
        raise BadInput(f"input {spec.name!r} is a {type(value).__name__}, not a numpy array")
    if value.dtype != _dtype(spec.dtype):
        raise BadInput(f"input {spec.name!r} has dtype {value.dtype}, expected {spec.dtype}")
    want = request_shape(spec.shape)
    if value.ndim != len(want):
        raise BadInput(
            f"input {spec.name!r} has shape {value.shape}, expected {_shape_text(want)} "
            f"(model {model!r} declares {list(spec.shape)})"
        )
    for axis, (expected, got) in enumerate(zip(want, value.shape, strict=True)):
        if expected == got:
            continue
        if expected == -1 and tuple(batch_sizes) == (1,):
            continue  # an undeclared dynamic axis: fine when rows are never stacked
        raise BadInput(
            f"input {spec.name!r} has shape {value.shape}, expected {_shape_text(want)} "
            f"(axis {axis} takes {_length_text(expected)}, got {got})"
        )


def _shape_text(shape: Sequence[int]) -> str:
    """``(1, 512)``, ``()`` for a scalar; ``any`` marks an axis of any length."""
    if not shape:
        return "a scalar, shape ()"
    return "(" + ", ".join("any" if dim == -1 else str(dim) for dim in shape) + ")"


def _length_text(length: int) -> str:
    return "the same length for every request of a batch" if length == -1 else f"only {length}"


def assemble_batch(
    specs: Sequence[TensorSpec],
    rows: Sequence[Mapping[str, np.ndarray]],
    batch_size: int,
) -> dict[str, np.ndarray]:
    """Stack one row per request and pad to ``batch_size`` by repeating the last row.

    A lone request at batch size 1 is passed through without a copy. Raises ValueError if there
    are no rows or more rows than ``batch_size``.
    """
    if not rows or len(rows) > batch_size:
        raise ValueError(f"cannot put {len(rows)} request(s) into a batch of {batch_size}")
    if batch_size == 1:
        return {spec.name: rows[0][spec.name] for spec in specs}
    return {spec.name: _stack(spec.name, rows, batch_size) for spec in specs}


def _stack(name: str, rows: Sequence[Mapping[str, np.ndarray]], batch_size: int) -> np.ndarray:
    first = rows[0][name]
    batch = np.empty((batch_size, *first.shape[1:]), dtype=first.dtype)
    for index, row in enumerate(rows):
        batch[index] = row[name][0]
    if len(rows) < batch_size:
        batch[len(rows) :] = rows[-1][name][0]
    return batch


def output_rows(
    outputs: Mapping[str, np.ndarray], index: int, batch_size: int
) -> dict[str, np.ndarray]:
    """Row ``index`` of every output of a batch of ``batch_size``, keeping the leading axis.

    Read-only views, never copies, so one request cannot change another's rows. An output
    without a leading batch axis (0-d, or a batch-1 model's fixed shape) is returned whole.
    """
    rows: dict[str, np.ndarray] = {}
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != batch_size or batch_size == 1:
            row = array.view()
        else:
            row = array[index : index + 1]
        row.flags.writeable = False
        rows[name] = row
    return rows


def zero_batch(specs: Sequence[TensorSpec], batch_size: int) -> dict[str, np.ndarray]:
    """Zeros shaped like each input at ``batch_size``: the batch axis (a dynamic axis 0) is
    ``batch_size``, every other axis its declared length (an undeclared one: 1); a tensor
    without a batch axis keeps its shape (a scalar stays 0-d)."""
    return {
        spec.name: np.zeros(batch_shape(spec.shape, batch_size), dtype=spec.dtype) for spec in specs
    }


def tensor_bytes(inputs: Mapping[str, object]) -> int:
    """The bytes of a request's tensors (what its frame carried)."""
    return sum(value.nbytes for value in inputs.values() if isinstance(value, np.ndarray))


def row_bytes(spec: TensorSpec) -> int | None:
    """The bytes of one row of ``spec`` (`ioarena.shared.row_nbytes`: None when an axis other
    than the batch's is dynamic, so its rows cannot travel by reference)."""
    return row_nbytes(spec.shape, spec.dtype)


@dataclass(frozen=True, slots=True)
class RowSlot:
    """Where one output's row sits in a request's output region."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # the row's: (1, ...)
    offset_bytes: int  # from the region's start, aligned
    nbytes: int


@lru_cache(maxsize=256)  # per model: asked for every batch sent by reference
def output_layout(
    specs: tuple[TensorSpec, ...], align_bytes: int = 64
) -> tuple[RowSlot, ...] | None:
    """One row of every output, packed and aligned in model order; None when a row's size is
    not fixed (outputs then come back as bytes)."""
    layout: list[RowSlot] = []
    offset_bytes = 0
    for spec in specs:
        nbytes = row_bytes(spec)
        if nbytes is None:
            return None
        layout.append(RowSlot(spec.name, spec.dtype, (1, *spec.shape[1:]), offset_bytes, nbytes))
        offset_bytes += -(-max(nbytes, 1) // align_bytes) * align_bytes
    return tuple(layout)


def region_bytes(layout: Sequence[RowSlot]) -> int:
    """The bytes an output region of ``layout`` takes."""
    return max((row.offset_bytes + row.nbytes for row in layout), default=0)


def region_rows(
    region: np.ndarray, layout: Sequence[RowSlot], skip: Mapping[str, object]
) -> dict[str, np.ndarray]:
    """Read-only views of the rows in ``region`` (a uint8 array), but those named in ``skip``
    (outputs that came back as bytes)."""
    rows: dict[str, np.ndarray] = {}
    for row in layout:
        if row.name in skip:
            continue
        raw = region[row.offset_bytes : row.offset_bytes + row.nbytes]
        view = raw.view(row.dtype).reshape(row.shape)
        view.flags.writeable = False
        rows[row.name] = view
    return rows


def input_refs(
    inputs: Mapping[str, np.ndarray],
    slot: Slot | None,
    specs: Sequence[TensorSpec],
    offset_of: Callable[[np.ndarray], int | None],
) -> list[int] | None:
    """``offset, nbytes`` of each input row in the arena, model order; None unless every row
    is in a live slot with the model's row size."""
    if slot is None or slot.freed:
        return None
    refs: list[int] = []
    for spec in specs:
        array = inputs.get(spec.name)
        offset = offset_of(array) if array is not None else None
        if offset is None or array is None or array.nbytes != row_bytes(spec):
            return None
        refs += (offset, array.nbytes)
    return refs


def output_refs(
    slots: Sequence[Slot | None], live: Sequence[bool], layout: Sequence[RowSlot]
) -> list[int]:
    """Where each row's outputs go (``0, 0`` for a gone request's row); [] when there is no
    layout or a live request could not have an output region (outputs then come as bytes)."""
    if not layout:
        return []
    nbytes = region_bytes(layout)
    refs: list[int] = []
    for slot, alive in zip(slots, live, strict=True):
        region = slot.attach_outputs(nbytes) if alive and slot is not None else None
        if alive and region is None:
            return []
        for row in layout:
            refs += (region.offset + row.offset_bytes, row.nbytes) if region else (0, 0)
    return refs
