"""Weight arenas: preallocated memory cut into fixed-size pages, never grown after start.

Invariants:
- An arena's memory is allocated, zero-filled and so committed once, in the constructor, so a
  LOAD never page-faults or asks the OS for memory.
- ``view(run)`` is a uint8 view of exactly ``run.count * page_bytes`` bytes starting at page
  ``run.first``: no copy; a run outside the arena raises ``ArenaRangeError``.
- Pages start 4096-byte aligned and ``page_bytes`` is a multiple of 64, so every page (and
  every 64-byte offset inside one) is aligned for any tensor dtype and SIMD loads.

Layout policy (`layout_tensors`): a tensor larger than a page gets its own contiguous run of
pages starting at offset 0; smaller tensors are packed first-fit-decreasing, each at a 64-byte
aligned offset, into the unused tail of those runs or into one-page runs. A model's weights
thus need the runs listed in its ``run_pages`` (long runs first), and no tensor ever straddles
two runs, so each tensor is one contiguous view.

Which pages are free is not the arena's business: `pages.PageCache` keeps the accounting and
does not care which arena (host numpy here, CuPy device memory in a later issue) it describes.
A GPU ``CupyArena`` implements the same three members (``page_bytes``, ``pages_total``,
``view``) plus ``close``; `check_geometry` and `run_bounds_bytes` are shared with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clockwork_async.wire.messages import ErrorCode

from .backend import BackendError, PageRun

PAGE_ALIGN_BYTES = 64  # every page size is a multiple of this
BASE_ALIGN_BYTES = 4096  # the first page starts on an OS page boundary


class ArenaRangeError(BackendError):
    """A page run that does not lie inside the arena (a bug in the caller)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


def pages_for(weights_bytes: int, page_bytes: int) -> int:
    """Number of pages needed to hold ``weights_bytes`` (0 for 0 bytes). Raises ValueError."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    if weights_bytes < 0:
        raise ValueError(f"weights_bytes must be >= 0, got {weights_bytes}")
    return -(-weights_bytes // page_bytes)


def check_geometry(page_bytes: int, pages_total: int) -> None:
    """Raise ValueError unless page_bytes is a positive multiple of 64 and pages_total >= 0."""
    if page_bytes <= 0 or page_bytes % PAGE_ALIGN_BYTES:
        raise ValueError(
            f"page_bytes must be a positive multiple of {PAGE_ALIGN_BYTES}, got {page_bytes}"
        )
    if pages_total < 0:
        raise ValueError(f"pages_total must be >= 0, got {pages_total}")


def run_bounds_bytes(run: PageRun, page_bytes: int, pages_total: int) -> tuple[int, int]:
    """Byte offsets [start, stop) of ``run``. Raises ArenaRangeError if it leaves the arena."""
    if run.count < 1 or run.first < 0 or run.first + run.count > pages_total:
        raise ArenaRangeError(
            f"page run {run.first}+{run.count} is outside an arena of {pages_total} pages"
        )
    return run.first * page_bytes, (run.first + run.count) * page_bytes


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """Where one tensor lives: ``offset_bytes`` into the run ``run_index`` of a layout."""

    run_index: int
    offset_bytes: int


def _align_up(size_bytes: int) -> int:
    return -(-size_bytes // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES


def layout_tensors(
    sizes_bytes: Sequence[int], page_bytes: int
) -> tuple[tuple[int, ...], tuple[TensorPlacement, ...]]:
    """Lay tensors of ``sizes_bytes`` out into page runs (policy in the module header).
    Returns (page count of each run, placement of each tensor in input order).
    Raises ValueError for a negative size or a page size not a multiple of 64."""
    check_geometry(page_bytes, 0)
    if any(size < 0 for size in sizes_bytes):
        raise ValueError(f"tensor sizes must be >= 0, got {list(sizes_bytes)}")
    order = sorted(range(len(sizes_bytes)), key=lambda i: -sizes_bytes[i])
    run_pages: list[int] = []
    used_bytes: list[int] = []  # per run, aligned
    placements: dict[int, TensorPlacement] = {}
    for index in order:
        size = _align_up(sizes_bytes[index])
        run = _first_fit(run_pages, used_bytes, size, page_bytes)
        if run is None:
            run = len(run_pages)
            run_pages.append(max(1, pages_for(size, page_bytes)))
            used_bytes.append(0)
        placements[index] = TensorPlacement(run, used_bytes[run])
        used_bytes[run] += size
    return tuple(run_pages), tuple(placements[i] for i in range(len(sizes_bytes)))


def _first_fit(
    run_pages: list[int], used_bytes: list[int], size_bytes: int, page_bytes: int
) -> int | None:
    """Index of the first run with ``size_bytes`` free at its end, or None."""
    for run, (pages, used) in enumerate(zip(run_pages, used_bytes, strict=True)):
        if used + size_bytes <= pages * page_bytes:
            return run
    return None


def _aligned_committed_buffer(size_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A (backing, aligned view) pair of ``size_bytes``, zero-filled (hence committed)."""
    backing = np.empty(size_bytes + BASE_ALIGN_BYTES, dtype=np.uint8)
    offset = -backing.ctypes.data % BASE_ALIGN_BYTES
    aligned = backing[offset : offset + size_bytes]
    # Writing every byte commits the memory now rather than at the first LOAD (np.zeros
    # would only map copy-on-write zero pages).
    aligned.fill(0)
    return backing, aligned


class NumpyArena:
    """Host-memory arena: one preallocated, committed, 4 KiB-aligned uint8 numpy buffer."""

    def __init__(self, page_bytes: int, pages_total: int) -> None:
        check_geometry(page_bytes, pages_total)
        self.page_bytes = page_bytes
        self.pages_total = pages_total
        self._backing, self._buffer = _aligned_committed_buffer(page_bytes * pages_total)
        self._closed = False

    @property
    def size_bytes(self) -> int:
        return self.page_bytes * self.pages_total

    def view(self, run: PageRun) -> np.ndarray:
        """A writable uint8 view (no copy) of ``run``. Raises ArenaRangeError, or
        BackendError(INTERNAL) once closed."""
        if self._closed:
            raise BackendError(ErrorCode.INTERNAL, "the arena is closed")
        start, stop = run_bounds_bytes(run, self.page_bytes, self.pages_total)
        return self._buffer[start:stop]

    def close(self) -> None:
        """Drop the arena's reference to its memory (views still held keep it alive)."""
        self._closed = True
        self._buffer = self._backing = np.empty(0, dtype=np.uint8)


class CountingArena:
    """An arena with geometry only and no memory, for the simulated backend (it can stand for a
    32 GB device). ``view`` always raises: nothing may read or write simulated weights."""

    def __init__(self, page_bytes: int, pages_total: int) -> None:
        check_geometry(page_bytes, pages_total)
        self.page_bytes = page_bytes
        self.pages_total = pages_total

    def view(self, run: PageRun) -> np.ndarray:
        """Raises ArenaRangeError for a run outside the arena, else BackendError(INTERNAL)."""
        run_bounds_bytes(run, self.page_bytes, self.pages_total)
        raise BackendError(ErrorCode.INTERNAL, "a counting arena holds no memory to view")

    def close(self) -> None:
        """Nothing to release."""
