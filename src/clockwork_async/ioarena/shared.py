"""The IO arena: one preallocated block of shared memory that holds requests' tensor bytes
between the client's socket, the local executors and the reply (docs/architecture.md, "The
data plane").

The memory is an anonymous ``memfd`` (``MFD_CLOEXEC``), sized at start and never grown: no
name in any file system, so nothing else can open it and nothing is left behind after any
exit, SIGKILL included (the kernel frees it with the last descriptor and mapping). Local
executors inherit the descriptor at spawn (``pass_fds``) and map it (`map_shared`); the first
`HEADER_BYTES` carry a random token the executor reports back, which proves to the daemon that
an executor maps this very memory before any slot reference goes to it.

Invariants:
- A `Slot` has one owner at a time (the connection whose request it holds) and is freed
  exactly once: when its owner `release`\\ s it and no action holds a `pin` on it, whichever
  comes last. Its output region (`Slot.attach_outputs`) goes with it.
- A client batch's rows share their request's slot through its parts (`Slot.part`): a part
  is the same memory with an output region of its own; its pins are the slot's, releasing it
  does nothing (the owner releases the slot, once), and it is freed with the slot, output
  region included.
- Fairness: one owner holds at most ``owner_share`` of the arena's slot bytes (inputs; output
  regions are best effort and not refused); a request larger than that share is refused as
  too large, whatever the occupancy. A full arena or an owner over its share is a refusal
  (`ArenaRefusal`), never a wait.
- ``used_bytes`` is the allocator's: it returns to zero once every slot is freed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from clockwork_async.ioarena.slots import DEFAULT_ALIGN_BYTES, SlotAllocator, align_up

log = logging.getLogger(__name__)

HEADER_BYTES = 64  # magic and token; slots start after it, so offset 0 is never a slot
MAGIC = b"clockwork-io-arena\0"
TOKEN_CHARS = 32
DEFAULT_OWNER_SHARE = 0.5


class ArenaError(RuntimeError):
    """The arena could not be made or mapped (no memfd, no memory, a foreign descriptor)."""


@dataclass(frozen=True, slots=True)
class ArenaRefusal:
    """Why a slot was not lent: ``cause`` is ``full``, ``share`` or ``too_large``."""

    cause: str
    message: str

    @property
    def too_large(self) -> bool:
        return self.cause == "too_large"


class Slot:
    """``nbytes`` of the arena at ``offset`` (from the arena's start), lent to ``owner``."""

    __slots__ = (
        "_arena",
        "_parent",
        "_parts",
        "_pins",
        "_released",
        "counted_bytes",
        "freed",
        "nbytes",
        "offset",
        "outputs",
        "owner",
    )

    def __init__(self, arena: IoArena, owner: object, offset: int, nbytes: int) -> None:
        self._arena = arena
        self.owner = owner
        self.offset = offset
        self.nbytes = nbytes
        self.outputs: Slot | None = None  # where an executor writes this request's outputs
        self.counted_bytes = 0  # what it counts against its owner's share
        self._pins = 0
        self._released = False
        self.freed = False
        self._parent: Slot | None = None  # set on a part: the slot its pins go to
        self._parts: list[Slot] = []

    @property
    def array(self) -> np.ndarray:
        """The slot's bytes, a writable uint8 view of the arena (no copy)."""
        return self._arena.view(self.offset, self.nbytes)

    @property
    def pinned(self) -> bool:
        return self._pins > 0

    def part(self) -> Slot:
        """A part of this slot for one row of a client batch (see the module's invariants)."""
        if self.freed or self._parent is not None:
            raise RuntimeError(f"part of a freed slot, or of a part, at {self.offset}")
        part = Slot(self._arena, self.owner, self.offset, self.nbytes)
        part._parent = self
        self._parts.append(part)
        return part

    def pin(self) -> None:
        """An action that reads or writes this slot was sent: it is not freed until `unpin`."""
        if self._parent is not None:
            self._parent.pin()
            return
        if self.freed:
            raise RuntimeError(f"pin of a freed slot at {self.offset}")
        self._pins += 1

    def unpin(self) -> None:
        """The action is resolved (its result came, or its executor left)."""
        if self._parent is not None:
            self._parent.unpin()
            return
        if self._pins <= 0:
            raise RuntimeError(f"unpin of an unpinned slot at {self.offset}")
        self._pins -= 1
        self._maybe_free()

    def release(self) -> None:
        """The owner is done with it (its reply is written, or the request ended without
        one); freed now, or when the last pin goes. A second call does nothing, and so does
        a part's (its slot is released)."""
        if self._parent is not None:
            return
        self._released = True
        self._maybe_free()

    def attach_outputs(self, nbytes: int) -> Slot | None:
        """An output region of ``nbytes`` freed with this slot (kept if already there and
        large enough); None when the arena has no room (outputs then travel as bytes)."""
        if self.outputs is not None and self.outputs.nbytes >= nbytes:
            return self.outputs
        if self.outputs is not None or self.freed:
            return None
        self.outputs = self._arena.lease_unchecked(self.owner, nbytes)
        return self.outputs

    def _maybe_free(self) -> None:
        if self._released and not self._pins and not self.freed:
            for part in self._parts:
                part.freed = True
                if part.outputs is not None:
                    self._arena.free(part.outputs)
            self._parts.clear()
            self.freed = True
            if self.outputs is not None:
                self._arena.free(self.outputs)
            self._arena.free(self)


class IoArena:
    """The daemon's side of the arena: the memfd, its mapping and the slots lent from it."""

    def __init__(self, capacity_bytes: int, *, owner_share: float = DEFAULT_OWNER_SHARE) -> None:
        """Make and map ``capacity_bytes`` of slot memory (plus the header). Raises
        ArenaError when the memory cannot be had."""
        if not 0.0 < owner_share <= 1.0:
            raise ValueError(f"owner_share must be in (0, 1], got {owner_share}")
        slot_bytes = align_up(capacity_bytes, DEFAULT_ALIGN_BYTES)
        self.token = secrets.token_hex(TOKEN_CHARS // 2)
        self.fd, self._mmap = _make_memfd(HEADER_BYTES + slot_bytes)
        self.buffer: np.ndarray = np.frombuffer(self._mmap, np.uint8)
        self.buffer[: len(MAGIC)] = np.frombuffer(MAGIC, np.uint8)
        token = self.token.encode()
        self.buffer[len(MAGIC) : len(MAGIC) + len(token)] = np.frombuffer(token, np.uint8)
        self._base_address = _address(self.buffer)
        self._slots = SlotAllocator(slot_bytes)
        self.owner_share_bytes = (
            int(slot_bytes * owner_share) // DEFAULT_ALIGN_BYTES * DEFAULT_ALIGN_BYTES
        )
        self._held_bytes: Counter[object] = Counter()  # input slots' bytes, by owner
        self.refusals: Counter[str] = Counter()  # by cause
        self.closed = False

    # --- sizes ---------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._slots.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    @property
    def live_slots(self) -> int:
        return self._slots.live_slots

    @property
    def size_bytes(self) -> int:
        """The whole mapping (header included): what an executor maps."""
        return HEADER_BYTES + self._slots.capacity_bytes

    @property
    def max_request_bytes(self) -> int:
        """The most one request's tensors may take (one owner's share)."""
        return self.owner_share_bytes

    def held_by(self, owner: object) -> int:
        return self._held_bytes.get(owner, 0)

    # --- lending -------------------------------------------------------------------------

    def lease(self, owner: object, nbytes: int) -> Slot | ArenaRefusal:
        """A slot of ``nbytes`` for ``owner``'s request, or why not (never a wait)."""
        refusal = self._refusal(owner, nbytes)
        if refusal is not None:
            self.refusals[refusal.cause] += 1
            return refusal
        slot = self.lease_unchecked(owner, nbytes)
        if slot is None:
            self.refusals["full"] += 1
            return ArenaRefusal("full", self._full_message(nbytes))
        slot.counted_bytes = self._slots.size_of(slot.offset - HEADER_BYTES)
        self._held_bytes[owner] += slot.counted_bytes
        return slot

    def _refusal(self, owner: object, nbytes: int) -> ArenaRefusal | None:
        share = self.owner_share_bytes
        if nbytes > share:
            why = f"the request's tensors take {nbytes} B; one request may hold at most {share} B"
            return ArenaRefusal("too_large", why + " of the IO arena")
        held = self._held_bytes.get(owner, 0)
        if held + nbytes > share:
            why = f"this connection holds {held} B of the IO arena; its share is {share} B"
            return ArenaRefusal("share", why)
        return None

    def _full_message(self, nbytes: int) -> str:
        used, capacity = self.used_bytes, self.capacity_bytes
        return f"the IO arena is full ({used} of {capacity} B in use; {nbytes} B asked)"

    def lease_unchecked(self, owner: object, nbytes: int) -> Slot | None:
        """A slot without the fairness check (output regions); None when none fits."""
        if self.closed:
            return None
        offset = self._slots.allocate(nbytes)
        if offset is None:
            return None
        return Slot(self, owner, HEADER_BYTES + offset, nbytes)

    def free(self, slot: Slot) -> None:
        """Called once per slot, by the slot (`Slot.release`/`unpin`)."""
        self._slots.free(slot.offset - HEADER_BYTES)
        if slot.counted_bytes:
            remaining = self._held_bytes[slot.owner] - slot.counted_bytes
            if remaining > 0:
                self._held_bytes[slot.owner] = remaining
            else:
                del self._held_bytes[slot.owner]

    # --- addresses -----------------------------------------------------------------------

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset : offset + nbytes]

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array``'s bytes start in the arena, or None if they are not all in it
        (or not contiguous)."""
        if not array.flags.c_contiguous:
            return None
        offset = _address(array) - self._base_address
        inside = HEADER_BYTES <= offset and offset + array.nbytes <= len(self.buffer)
        return offset if inside else None

    def close(self) -> None:
        """Unmap and close the descriptor (views still alive keep the mapping until they go)."""
        if self.closed:
            return
        self.closed = True
        self.buffer = np.empty(0, np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # views still exported: the mapping goes with the last of them
            log.debug("the IO arena is unmapped when its last view goes")
        os.close(self.fd)


@dataclass(slots=True)
class MappedArena:
    """An executor's side: the arena mapped from an inherited descriptor."""

    buffer: np.ndarray
    token: str
    _mmap: mmap.mmap

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` at ``offset``. Raises ValueError outside the slots."""
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > len(self.buffer):
            raise ValueError(f"[{offset}, +{nbytes}) is outside the IO arena")
        return self.buffer[offset : offset + nbytes]

    def close(self) -> None:
        self.buffer = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):  # views still exported: unmapped with the last
            self._mmap.close()


def row_nbytes(shape: tuple[int, ...], dtype: str) -> int | None:
    """The bytes of one row (the leading axis taken as 1) of a tensor of ``shape`` and
    ``dtype``; None when the leading axis is not a dynamic batch axis (a scalar or a fixed
    shape comes whole, `wire.dtypes.request_shape`) or another axis is dynamic (-1): such rows
    have no fixed place. Both the daemon and the executors size slot references by it."""
    dims = shape[1:]
    if not shape or shape[0] >= 0 or any(d < 0 for d in dims):
        return None
    return math.prod(dims) * np.dtype(dtype).itemsize


def map_shared(fd: int) -> MappedArena:
    """Map the arena whose descriptor this process inherited (and close the descriptor: the
    mapping keeps the memory). Raises ArenaError for a descriptor that is not an arena."""
    try:
        size_bytes = os.fstat(fd).st_size
        memory = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as error:
        raise ArenaError(f"cannot map the IO arena from descriptor {fd}: {error}") from error
    finally:
        os.close(fd)
    buffer = np.frombuffer(memory, np.uint8)
    if bytes(buffer[: len(MAGIC)]) != MAGIC:
        raise ArenaError(f"descriptor {fd} is not an IO arena")
    token = bytes(buffer[len(MAGIC) : len(MAGIC) + TOKEN_CHARS]).decode("ascii", "replace")
    return MappedArena(buffer, token, memory)


def _make_memfd(size_bytes: int) -> tuple[int, mmap.mmap]:
    """An anonymous memfd of ``size_bytes``, its pages reserved now (no SIGBUS later), mapped."""
    try:
        fd = os.memfd_create("clockwork-io-arena", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as error:
        raise ArenaError(f"memfd_create is not available: {error}") from error
    try:
        os.ftruncate(fd, size_bytes)
        os.posix_fallocate(fd, 0, size_bytes)
        memory = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        os.close(fd)
        raise ArenaError(f"cannot allocate an IO arena of {size_bytes} B: {error}") from error
    return fd, memory


def _address(array: Any) -> int:
    return int(array.__array_interface__["data"][0])
