"""The Open Inference Protocol's tensors in the IO arena (docs/architecture.md, "The data
plane"): each row of a request is copied once into a slot of its own, leased for the
request's connection, so the request path sends it to local executors by reference, as it
does the msgpack API's; outputs the executor wrote into the slot's output region are copied
out before the slot goes back. No I/O: arrays in, slots and arrays out.

Invariants:
- One slot per row (a client batch's rows each have their own): a slot's output region holds
  one row's outputs, so rows must not share one.
- Each input sits at a 64-byte aligned offset in its slot, in the row's order, a C-contiguous
  array of the row's dtype and shape: exactly what `runtime.batching.input_refs` takes.
- All or nothing: when any row finds no room (the arena full, or the connection over its
  share: ``overloaded``; a row larger than one connection may hold: ``bad_input``, as the
  msgpack API refuses them), the slots already leased for the request are released before
  the refusal is raised, and nothing was submitted.
- `detach` leaves no view of the arena in an outcome, so the slot can be released as soon as
  the outcome is in hand (the reply is then written from the copies, not from the slot).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.api.v2_status import V2Error
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import ArenaRefusal, IoArena, Slot
from clockwork_async.ioarena.slots import DEFAULT_ALIGN_BYTES, align_up

Row = Mapping[str, np.ndarray]


def row_layout(row: Row) -> tuple[list[int], int]:
    """Each input's offset in a slot (aligned, in the row's order) and the slot's bytes."""
    offsets: list[int] = []
    total_bytes = 0
    for array in row.values():
        offsets.append(total_bytes)
        total_bytes += align_up(max(array.nbytes, 1), DEFAULT_ALIGN_BYTES)
    return offsets, total_bytes


def into_slots(arena: IoArena, owner: object, rows: Sequence[Row]) -> list[tuple[Row, Slot | None]]:
    """Each row copied once into a slot leased for ``owner`` (a row without bytes keeps its
    arrays and no slot). Raises V2Error (``overloaded``, ``bad_input``) having released every
    slot it leased."""
    placed: list[tuple[Row, Slot | None]] = []
    try:
        for row in rows:
            placed.append(_into_slot(arena, owner, row))
    except V2Error:
        for _, slot in placed:
            if slot is not None:
                slot.release()
        raise
    return placed


def _into_slot(arena: IoArena, owner: object, row: Row) -> tuple[Row, Slot | None]:
    offsets, total_bytes = row_layout(row)
    if not any(array.nbytes for array in row.values()):
        return row, None
    leased = arena.lease(owner, total_bytes)
    if isinstance(leased, ArenaRefusal):
        outcome = Outcome.BAD_INPUT if leased.too_large else Outcome.OVERLOADED
        raise V2Error(outcome, leased.message)
    memory = leased.array
    copied: dict[str, np.ndarray] = {}
    for (name, array), offset in zip(row.items(), offsets, strict=True):
        dtype = array.dtype.newbyteorder("=") if array.dtype.byteorder != "|" else array.dtype
        target = memory[offset : offset + array.nbytes].view(dtype).reshape(array.shape)
        np.copyto(target, array, casting="equiv")
        copied[name] = target
    return copied, leased


def detach(outcome: InferOutcome, arena: IoArena) -> InferOutcome:
    """``outcome`` with its outputs that lie in the arena (its slot's output region) copied
    out; the same outcome when none does."""
    outputs = outcome.outputs
    if not any(arena.offset_of(array) is not None for array in outputs.values()):
        return outcome
    copies = {
        name: array.copy() if arena.offset_of(array) is not None else array
        for name, array in outputs.items()
    }
    return replace(outcome, outputs=copies)
