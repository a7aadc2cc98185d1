"""Page accounting for a weights arena: which pages are free, which runs are handed out.

Invariants (checked by hypothesis tests):
- Free extents and handed-out runs never overlap, and together cover pages [0, pages_total).
- ``allocate`` is all-or-nothing: it hands out every requested run or raises `NoPages` and
  changes nothing.
- ``free`` accepts only runs handed out by ``allocate`` and not yet freed; anything else raises
  `PageAccountingError` and changes nothing. Pages freed equal pages taken.
- The cache never evicts: only ``free`` returns pages.

Placement: each requested run is a contiguous range of pages. Requests are placed largest
first, each into the first free extent that fits (first fit), so big tensors get the long
extents; adjacent free extents are merged on ``free``. The cache knows nothing about the
memory behind the pages (host numpy, device CuPy or none at all).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from clockwork_async.wire.messages import ErrorCode

from .backend import BackendError, PageRun


class NoPages(BackendError):
    """Not enough free pages (or no long enough contiguous extents) for a LOAD."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.NO_PAGES, message)


class PageAccountingError(ValueError):
    """A free of a run that is not currently allocated (double free or foreign run)."""


def _place(extents: list[tuple[int, int]], count: int) -> int | None:
    """First page of the first extent fitting ``count`` pages, taken out of ``extents``
    (sorted (first, count) pairs, updated in place); None if no extent fits."""
    for index, (first, length) in enumerate(extents):
        if length >= count:
            if length == count:
                del extents[index]
            else:
                extents[index] = (first + count, length - count)
            return first
    return None


class PageCache:
    """Free/used accounting of ``pages_total`` fixed-size pages, in contiguous runs."""

    def __init__(self, pages_total: int) -> None:
        if pages_total < 0:
            raise ValueError(f"pages_total must be >= 0, got {pages_total}")
        self.pages_total = pages_total
        self._free_extents: list[tuple[int, int]] = [(0, pages_total)] if pages_total else []
        self._allocated: dict[int, int] = {}  # first page -> count of each handed-out run
        self._pages_free = pages_total

    @property
    def pages_free(self) -> int:
        return self._pages_free

    @property
    def pages_used(self) -> int:
        return self.pages_total - self._pages_free

    @property
    def largest_free_run(self) -> int:
        """Length in pages of the longest contiguous free extent (0 when full)."""
        return max((length for _, length in self._free_extents), default=0)

    def allocate(self, run_pages: Sequence[int]) -> list[PageRun]:
        """One contiguous run per entry of ``run_pages``, in the same order.
        Raises ValueError for a count < 1, NoPages (changing nothing) if they do not fit."""
        if any(count < 1 for count in run_pages):
            raise ValueError(f"every run needs at least one page, got {list(run_pages)}")
        extents = list(self._free_extents)
        firsts: dict[int, int] = {}
        for index in sorted(range(len(run_pages)), key=lambda i: -run_pages[i]):
            first = _place(extents, run_pages[index])
            if first is None:
                raise NoPages(self._no_pages_message(run_pages))
            firsts[index] = first
        self._free_extents = extents
        runs = [PageRun(firsts[i], count) for i, count in enumerate(run_pages)]
        for run in runs:
            self._allocated[run.first] = run.count
        self._pages_free -= sum(run_pages)
        return runs

    def _no_pages_message(self, run_pages: Sequence[int]) -> str:
        needed = sum(run_pages)
        if needed > self._pages_free:
            return f"needs {needed} pages, {self._pages_free} of {self.pages_total} are free"
        return (
            f"needs runs of {sorted(run_pages, reverse=True)} pages; {self._pages_free} pages "
            f"are free but the longest contiguous free run is {self.largest_free_run}"
        )

    def free(self, runs: Iterable[PageRun]) -> None:
        """Return ``runs`` to the free extents. Raises PageAccountingError (changing nothing)
        if any run is not currently allocated exactly as given, or appears twice."""
        runs = list(runs)
        firsts = [run.first for run in runs]
        if len(set(firsts)) != len(firsts):
            raise PageAccountingError(f"the same run is freed twice in one call: {runs}")
        for run in runs:
            if self._allocated.get(run.first) != run.count:
                raise PageAccountingError(f"page run {run.first}+{run.count} is not allocated")
        for run in runs:
            del self._allocated[run.first]
            self._insert_free(run.first, run.count)
            self._pages_free += run.count

    def _insert_free(self, first: int, count: int) -> None:
        """Insert the extent [first, first+count) and merge it with adjacent free extents."""
        extents = self._free_extents
        index = bisect.bisect_left(extents, (first, 0))
        if index < len(extents) and extents[index][0] == first + count:
            count += extents.pop(index)[1]
        if index > 0 and sum(extents[index - 1]) == first:
            first, count = extents[index - 1][0], extents[index - 1][1] + count
            index -= 1
            extents.pop(index)
        extents.insert(index, (first, count))

    def allocated_runs(self) -> list[PageRun]:
        """The runs handed out and not yet freed, by first page."""
        return [PageRun(first, count) for first, count in sorted(self._allocated.items())]

    def free_extents(self) -> list[PageRun]:
        """The free extents, by first page (adjacent ones always merged)."""
        return [PageRun(first, count) for first, count in self._free_extents]
