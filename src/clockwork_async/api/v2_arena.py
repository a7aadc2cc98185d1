"""The Open Inference Protocol's tensors in the IO arena (docs/architecture.md, "The data
plane"): each row of a request is copied once into a slot of its own, leased for the
request's connection, so the request path sends it to local executors by reference, as it
does the msgpack API's; outputs the executor wrote into the slot's output region are copied
out before the slot goes back. No I/O: arrays in, slots and arrays out.

Invariants:
- One slot per row, or one part of a shared slot per row (`Slot.part`): an output region holds
  one row's outputs, so rows never share one.
- Each input sits at a 64-byte aligned offset in its slot, in the row's order, a C-contiguous
  array of the row's dtype and shape: exactly what `runtime.batching.input_refs` takes.
- An HTTP body may be read straight into a slot (`BodyInSlot`, one copy from httptools'
  chunks); the door takes it over and keeps it (a part per row for a client batch) when every
  row's inputs are aligned views of it, else copies the rows out and releases it.
- All or nothing: when any row finds no room (the arena full, or the connection over its
  share: ``overloaded``; a row larger than one connection may hold: ``bad_input``, as the
  msgpack API refuses them), the slots already leased for the request are released before
  the refusal is raised, and nothing was submitted.
- `detach` leaves no view of the arena in an outcome, so the slot can be released as soon as
  the outcome is in hand (the reply is then written from the copies, not from the slot).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.api.v2_status import V2Error
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import ArenaRefusal, IoArena, Slot
from clockwork_async.ioarena.slots import DEFAULT_ALIGN_BYTES, align_up

Row = Mapping[str, np.ndarray]
# A row as submitted: its inputs, its slot (or None), what to call once it has its outcome.
Placed = tuple[Row, Slot | None, Callable[[], None]]


def row_layout(row: Row) -> tuple[list[int], int]:
    """Each input's offset in a slot (aligned, in the row's order) and the slot's bytes."""
    offsets: list[int] = []
    total_bytes = 0
    for array in row.values():
        offsets.append(total_bytes)
        total_bytes += align_up(max(array.nbytes, 1), DEFAULT_ALIGN_BYTES)
    return offsets, total_bytes


def into_slots(
    arena: IoArena, owner: object, rows: Sequence[Row], body: Slot | None = None
) -> list[Placed]:
    """Each row copied once into a slot leased for ``owner`` (a row without bytes keeps its
    arrays and no slot), with what to call once that row has its outcome (`Placed`).
    ``body``: a slot the request's body was read into (`BodyInSlot`), taken over: when every
    input of every row is an aligned view of it, no copy: a request of one row keeps it as its
    slot, a client batch's rows each take a part of it (`Slot.part`: an output region of its
    own), and it is released once the last row has its outcome; otherwise it is released once
    the rows are copied. Raises V2Error (``overloaded``, ``bad_input``) having released every
    slot it leased, and ``body``."""
    if body is not None:
        if all(_in_slot(arena, body, array) for row in rows for array in row.values()):
            return _shared(body, rows)
        try:
            return into_slots(arena, owner, rows)
        finally:
            body.release()  # the rows are copied out of it (or refused)
    placed: list[Placed] = []
    try:
        for row in rows:
            copied, slot = _into_slot(arena, owner, row)
            placed.append((copied, slot, slot.release if slot is not None else _nothing))
    except V2Error:
        for _, _, release in placed:
            release()
        raise
    return placed


def _shared(slot: Slot, rows: Sequence[Row]) -> list[Placed]:
    """``rows``, all in ``slot``: one row keeps it; several take a part each, and the slot is
    released once each row's release was called."""
    if len(rows) == 1:
        return [(rows[0], slot, slot.release)]
    left = [len(rows)]

    def row_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            slot.release()

    return [(row, slot.part(), row_done) for row in rows]


def _nothing() -> None:
    pass


def _into_slot(arena: IoArena, owner: object, row: Row) -> tuple[Row, Slot | None]:
    offsets, total_bytes = row_layout(row)
    if not any(array.nbytes for array in row.values()):
        return row, None
    leased = arena.lease(owner, total_bytes)
    if isinstance(leased, ArenaRefusal):
        outcome = Outcome.BAD_INPUT if leased.too_large else Outcome.OVERLOADED
        raise V2Error(outcome, leased.message)
    copied: dict[str, np.ndarray] = {}
    for (name, array), offset in zip(row.items(), offsets, strict=True):
        dtype = array.dtype if array.dtype.isnative else array.dtype.newbyteorder("=")
        # A view made in one call (slicing, view and reshape cost three times as much).
        target = np.ndarray(array.shape, dtype, arena.buffer, leased.offset + offset)
        target[...] = array
        copied[name] = target
    return copied, leased


def _in_slot(arena: IoArena, slot: Slot, array: np.ndarray) -> bool:
    """Whether ``array`` is a contiguous, aligned view of ``slot``'s bytes (as a row's input
    must be to go by reference: `runtime.batching.input_refs`)."""
    offset = arena.offset_of(array)
    if offset is None or not array.flags.aligned:
        return False
    return slot.offset <= offset and offset + array.nbytes <= slot.offset + slot.nbytes


class BodyInSlot:
    """An HTTP request's body read straight into an arena slot as its chunks arrive (one copy,
    chunk to slot), placed so that the body's binary section (after its JSON header of
    ``json_bytes``) starts 64-byte aligned: a request's first binary input is then a view of
    the slot the executor can read by reference."""

    __slots__ = ("_pad", "length", "received", "slot")

    def __init__(self, slot: Slot, pad: int, length: int) -> None:
        self.slot: Slot | None = slot
        self._pad = pad
        self.length = length
        self.received = 0

    @classmethod
    def lease(
        cls, arena: IoArena, owner: object, length: int, json_bytes: int
    ) -> BodyInSlot | None:
        """A slot for a body of ``length`` bytes, or None when the arena has no room for it
        now (not counted as a refusal: the body is then read as bytes, and the door copies
        its rows into slots, or refuses them)."""
        pad = -json_bytes % DEFAULT_ALIGN_BYTES
        leased = arena.lease(owner, pad + length, count=False)
        return None if isinstance(leased, ArenaRefusal) else cls(leased, pad, length)

    def write(self, chunk: bytes) -> bool:
        """Copy the next chunk in; False (nothing copied) when it would pass ``length``."""
        if self.slot is None or self.received + len(chunk) > self.length:
            return False
        start = self._pad + self.received
        self.slot.array[start : start + len(chunk)] = np.frombuffer(chunk, np.uint8)
        self.received += len(chunk)
        return True

    def view(self) -> memoryview:
        """The body received so far."""
        if self.slot is None:
            return memoryview(b"")
        return self.slot.array[self._pad : self._pad + self.received].data

    def take(self) -> Slot | None:
        """Hand the slot over (to `into_slots`, through the door): from now on the taker
        releases it. None when taken or released already."""
        slot, self.slot = self.slot, None
        return slot

    def release(self) -> None:
        """Give the slot back, unless it was taken (a second call does nothing)."""
        slot = self.take()
        if slot is not None:
            slot.release()


def detach(outcome: InferOutcome, slot: Slot) -> InferOutcome:
    """``outcome`` with its outputs copied out when ``slot`` has an output region (the
    executor may have written them there: all are copied, a few KB, rather than each one's
    address looked up); the same outcome when it has none."""
    if slot.outputs is None or not outcome.outputs:
        return outcome
    copies = {name: array.copy() for name, array in outcome.outputs.items()}
    return InferOutcome(
        outcome.request_id,
        outcome.outcome,
        outcome.message,
        copies,
        outcome.timing_ns,
        outcome.executor_id,
        outcome.batch_size,
    )
