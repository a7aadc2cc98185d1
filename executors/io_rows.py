"""An INFER's rows by reference: checked on arrival, gathered from the daemon's IO arena into
the batch the backend runs, and outputs written back into the slots the daemon chose.

Invariants:
- `check_rows` runs on arrival (the loop thread) and raises `Refused(BAD_INPUT)` for any
  reference outside the arena or of the wrong size, so a gather or scatter never faults.
- `gather` copies each row once, into a fresh batch (a lone row at batch 1 is passed as a
  view of the arena: no copy); rows past the last, up to the batch size, repeat it.
- `scatter` writes only rows whose bytes match the reference exactly; an output that does not
  fit is left in the returned mapping, so it still reaches the daemon as bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from clockwork_async.ioarena.shared import HEADER_BYTES, MappedArena, row_nbytes
from clockwork_async.wire.messages import ErrorCode, Infer, TensorSpec

from .backend import Backend, LoadedModel, RegisteredModel
from .validation import Refused, validate_inputs

# Each reference is two ints: offset, nbytes.
REF_INTS = 2


def row_bytes(spec: TensorSpec) -> int | None:
    return row_nbytes(spec.shape, spec.dtype)


def row_count(refs: Sequence[int], tensors: int) -> int:
    """How many rows ``refs`` hold for ``tensors`` tensors per row (0 when malformed)."""
    per_row = REF_INTS * tensors
    if not per_row or len(refs) % per_row:
        return 0
    return len(refs) // per_row


def validate_rows(arena: MappedArena | None, model: RegisteredModel, action: Infer) -> None:
    """Check an INFER's rows, by reference or as bytes. Raises Refused(BAD_INPUT)."""
    if action.arena_inputs:
        check_rows(arena, model, action)
    else:
        validate_inputs(model, action.batch_size, action.inputs)


def run_rows(
    backend: Backend, loaded: LoadedModel, action: Infer, arena: MappedArena | None
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Run a validated INFER: by reference, rows gathered from the arena and outputs written
    back into it (what did not fit is returned); as bytes, as they came."""
    if arena is None or not action.arena_inputs:
        return backend.infer(loaded, action.batch_size, action.inputs)
    model = loaded.model
    outputs, durations_ns = backend.infer(
        loaded, action.batch_size, gather(arena, model.inputs, action)
    )
    return scatter(arena, model.outputs, action, outputs), durations_ns


def check_rows(arena: MappedArena | None, model: RegisteredModel, action: Infer) -> None:
    """Raises Refused(BAD_INPUT) unless ``action``'s references fit the arena and the model."""
    if arena is None:
        raise Refused(ErrorCode.BAD_INPUT, "slot references, but this executor maps no IO arena")
    if action.batch_size not in model.batch_sizes:
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"batch size {action.batch_size} is not one of model {model.name!r}'s "
            f"{model.batch_sizes}",
        )
    rows = row_count(action.arena_inputs, len(model.inputs))
    if not 1 <= rows <= action.batch_size or action.inputs:
        why = f"{len(action.arena_inputs)} ints of input references for {len(model.inputs)} inputs"
        raise Refused(ErrorCode.BAD_INPUT, f"{why} and batch size {action.batch_size}")
    _check_refs(arena, model.inputs, action.arena_inputs, exact=True)
    if action.arena_outputs:
        if row_count(action.arena_outputs, len(model.outputs)) != rows:
            raise Refused(ErrorCode.BAD_INPUT, "output references do not match the input rows")
        _check_refs(arena, model.outputs, action.arena_outputs, exact=False)


def _check_refs(
    arena: MappedArena, specs: Sequence[TensorSpec], refs: Sequence[int], *, exact: bool
) -> None:
    size_bytes = len(arena.buffer)
    for index in range(0, len(refs), REF_INTS):
        offset, nbytes = refs[index], refs[index + 1]
        spec = specs[(index // REF_INTS) % len(specs)]
        if not nbytes and not exact:
            continue  # a row whose outputs are dropped
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > size_bytes:
            raise Refused(ErrorCode.BAD_INPUT, f"{spec.name!r}: a reference outside the arena")
        if exact and nbytes != row_bytes(spec):
            raise Refused(
                ErrorCode.BAD_INPUT,
                f"input {spec.name!r}: a row of {nbytes} B; one row is {row_bytes(spec)} B",
            )


def gather(arena: MappedArena, specs: Sequence[TensorSpec], action: Infer) -> dict[str, np.ndarray]:
    """The batch of ``action`` (checked by `check_rows`), one array per input."""
    rows = row_count(action.arena_inputs, len(specs))
    batch: dict[str, np.ndarray] = {}
    for position, spec in enumerate(specs):
        if action.batch_size == 1:  # a view of the slot: the backend reads it in place
            batch[spec.name] = _row(arena, action.arena_inputs, specs, position, 0)
            continue
        stacked = np.empty((action.batch_size, *spec.shape[1:]), dtype=spec.dtype)
        for index in range(action.batch_size):
            stacked[index] = _row(
                arena, action.arena_inputs, specs, position, min(index, rows - 1)
            )[0]
        batch[spec.name] = stacked
    return batch


def _row(
    arena: MappedArena, refs: Sequence[int], specs: Sequence[TensorSpec], position: int, index: int
) -> np.ndarray:
    """Row ``index`` of input ``position``, a view of the arena shaped ``(1, ...)``."""
    spec = specs[position]
    at = (index * len(specs) + position) * REF_INTS
    raw = arena.view(refs[at], refs[at + 1])
    return raw.view(spec.dtype).reshape((1, *spec.shape[1:]))


def scatter(
    arena: MappedArena,
    specs: Sequence[TensorSpec],
    action: Infer,
    outputs: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Write each output's rows where ``action.arena_outputs`` says; returns the outputs that
    did not fit (they go back as bytes)."""
    refs = action.arena_outputs
    rows = row_count(refs, len(specs))
    left = dict(outputs)
    if not rows:
        return left  # no output references: every output goes back as bytes
    for position, spec in enumerate(specs):
        array = left.get(spec.name)
        if array is None or not _rows_fit(
            array, spec, action.batch_size, refs, position, rows, len(specs)
        ):
            continue
        for index in range(rows):
            at = (index * len(specs) + position) * REF_INTS
            if refs[at + 1]:
                target = arena.view(refs[at], refs[at + 1])
                target[:] = np.ascontiguousarray(array[index]).reshape(-1).view(np.uint8)
        del left[spec.name]
    return left


def _rows_fit(
    array: np.ndarray,
    spec: TensorSpec,
    batch_size: int,
    refs: Sequence[int],
    position: int,
    rows: int,
    tensors: int,
) -> bool:
    if array.dtype != np.dtype(spec.dtype) or array.ndim < 1 or array.shape[0] != batch_size:
        return False
    row_nbytes = array[0].nbytes
    sizes = (refs[(index * tensors + position) * REF_INTS + 1] for index in range(rows))
    return all(nbytes in (0, row_nbytes) for nbytes in sizes)
