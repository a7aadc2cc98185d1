"""Where slots go in the IO arena: a first-fit allocator over byte offsets. Pure: no I/O, no
memory of its own (it hands out offsets into memory someone else maps).

Invariants:
- Every offset handed out is aligned to ``align_bytes``; slots never overlap and never reach
  past ``capacity_bytes``; ``used_bytes + free_bytes == capacity_bytes`` at all times.
- A slot is freed exactly once: `free` of an offset that is not the start of a live slot
  raises `NotAllocated` (a double free, or a stranger's offset) and changes nothing.
- Free extents are kept sorted and coalesced, so after every slot is freed one extent covers
  the whole capacity again (no fragmentation survives an empty arena).
- The capacity is fixed at construction: the allocator never grows.
"""

from __future__ import annotations

import bisect

DEFAULT_ALIGN_BYTES = 64  # a cache line; the wire aligns tensors in a tail to the same


class NotAllocated(KeyError):
    """`SlotAllocator.free` of an offset that is not a live slot (freed twice, or never)."""


def align_up(nbytes: int, align_bytes: int) -> int:
    return -(-nbytes // align_bytes) * align_bytes


class SlotAllocator:
    """First-fit over ``[0, capacity_bytes)``; each slot rounded up to ``align_bytes``."""

    def __init__(self, capacity_bytes: int, align_bytes: int = DEFAULT_ALIGN_BYTES) -> None:
        if align_bytes < 1 or align_bytes & (align_bytes - 1):
            raise ValueError(f"align_bytes must be a power of two, got {align_bytes}")
        if capacity_bytes < 0 or capacity_bytes % align_bytes:
            raise ValueError(f"capacity_bytes must be a multiple of {align_bytes} and >= 0")
        self.capacity_bytes = capacity_bytes
        self.align_bytes = align_bytes
        self._free_starts: list[int] = [0] if capacity_bytes else []  # sorted
        self._free_ends: list[int] = [capacity_bytes] if capacity_bytes else []
        self._live: dict[int, int] = {}  # offset -> its rounded size in bytes
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def live_slots(self) -> int:
        return len(self._live)

    def largest_free_bytes(self) -> int:
        """The largest slot `allocate` could hand out now."""
        return max(
            (e - s for s, e in zip(self._free_starts, self._free_ends, strict=True)), default=0
        )

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a fresh slot of at least ``nbytes`` (at least one alignment unit), or
        None when no free extent is large enough (never a wait)."""
        size_bytes = align_up(max(nbytes, 1), self.align_bytes)
        for index, start in enumerate(self._free_starts):
            end = self._free_ends[index]
            if end - start < size_bytes:
                continue
            if end - start == size_bytes:
                del self._free_starts[index], self._free_ends[index]
            else:
                self._free_starts[index] = start + size_bytes
            self._live[start] = size_bytes
            self.used_bytes += size_bytes
            return start
        return None

    def size_of(self, offset: int) -> int:
        """The rounded size of the live slot at ``offset``. Raises NotAllocated."""
        try:
            return self._live[offset]
        except KeyError:
            raise NotAllocated(f"no live slot at offset {offset}") from None

    def free(self, offset: int) -> int:
        """Give the slot at ``offset`` back; returns its rounded size. Raises NotAllocated."""
        size_bytes = self._live.pop(offset, None)
        if size_bytes is None:
            raise NotAllocated(f"no live slot at offset {offset} (freed already, or never)")
        self.used_bytes -= size_bytes
        self._insert_free(offset, offset + size_bytes)
        return size_bytes

    def _insert_free(self, start: int, end: int) -> None:
        """Put ``[start, end)`` back, merged with the free extents that touch it."""
        index = bisect.bisect_left(self._free_starts, start)
        if index < len(self._free_starts) and self._free_starts[index] == end:
            end = self._free_ends[index]  # merge with the next extent
            del self._free_starts[index], self._free_ends[index]
        if index > 0 and self._free_ends[index - 1] == start:
            self._free_ends[index - 1] = end  # merge with the previous extent
            return
        self._free_starts.insert(index, start)
        self._free_ends.insert(index, end)

    def free_extents(self) -> list[tuple[int, int]]:
        """The free extents, ``(start, end)`` sorted (for tests and stats)."""
        return list(zip(self._free_starts, self._free_ends, strict=True))
