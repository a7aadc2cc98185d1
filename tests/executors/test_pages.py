"""PageCache: contiguous runs, all-or-nothing allocation, exact frees, no over-commit."""

from __future__ import annotations

import pytest
from clockwork_async.executors.backend import BackendError, PageRun
from clockwork_async.executors.pages import NoPages, PageAccountingError, PageCache
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from clockwork_async.wire.messages import ErrorCode


def test_allocate_returns_runs_in_request_order_with_requested_counts() -> None:
    cache = PageCache(10)
    runs = cache.allocate([3, 2, 5])
    assert [run.count for run in runs] == [3, 2, 5]
    assert cache.pages_free == 0
    assert cache.pages_used == 10
    covered = sorted(page for run in runs for page in range(run.first, run.first + run.count))
    assert covered == list(range(10))


def test_no_pages_is_a_backend_error_with_its_code_and_changes_nothing() -> None:
    cache = PageCache(4)
    held = cache.allocate([2])
    with pytest.raises(NoPages) as caught:
        cache.allocate([1, 2])
    assert isinstance(caught.value, BackendError)
    assert caught.value.code is ErrorCode.NO_PAGES
    assert "3 pages" in caught.value.message
    assert cache.pages_free == 2
    assert cache.allocated_runs() == held


def test_fragmented_free_space_refuses_a_long_run_and_says_why() -> None:
    cache = PageCache(6)
    a, _b, c = cache.allocate([2, 2, 2])
    cache.free([a, c])
    assert cache.pages_free == 4
    with pytest.raises(NoPages, match="longest contiguous free run is 2"):
        cache.allocate([3])
    assert cache.pages_free == 4


def test_freeing_merges_neighbours_back_into_one_extent() -> None:
    cache = PageCache(9)
    runs = cache.allocate([3, 3, 3])
    cache.free([runs[0]])
    cache.free([runs[2]])
    cache.free([runs[1]])
    assert cache.free_extents() == [PageRun(0, 9)]
    assert cache.allocate([9]) == [PageRun(0, 9)]


def test_largest_requests_are_placed_first() -> None:
    cache = PageCache(8)
    small, _gap, _rest = cache.allocate([1, 1, 6])
    cache.free([small])  # free extents: [0,1) and nothing else
    assert cache.largest_free_run == 1


def test_double_free_and_foreign_runs_raise_without_side_effects() -> None:
    cache = PageCache(8)
    run, other = cache.allocate([2, 3])
    cache.free([run])
    with pytest.raises(PageAccountingError):
        cache.free([run])
    with pytest.raises(PageAccountingError):
        cache.free([PageRun(other.first, other.count - 1)])
    with pytest.raises(PageAccountingError):
        cache.free([other, run])  # one good, one already free: nothing happens
    with pytest.raises(PageAccountingError):
        cache.free([other, other])
    assert cache.allocated_runs() == [other]
    cache.free([other])
    assert cache.pages_free == 8


def test_bad_requests_raise_value_error() -> None:
    with pytest.raises(ValueError):
        PageCache(-1)
    with pytest.raises(ValueError):
        PageCache(4).allocate([0])


def test_empty_cache_and_empty_request() -> None:
    cache = PageCache(0)
    assert cache.allocate([]) == []
    with pytest.raises(NoPages):
        cache.allocate([1])


class PageCacheMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of which pages are taken."""

    def __init__(self) -> None:
        super().__init__()
        self.pages_total = 24
        self.cache = PageCache(self.pages_total)
        self.held: list[list[PageRun]] = []
        self.taken_total = 0
        self.freed_total = 0

    @rule(run_pages=st.lists(st.integers(1, 9), max_size=4))
    def allocate(self, run_pages: list[int]) -> None:
        before_free = self.cache.free_extents()
        before_used = self.cache.allocated_runs()
        try:
            runs = self.cache.allocate(run_pages)
        except NoPages:
            assert self.cache.free_extents() == before_free
            assert self.cache.allocated_runs() == before_used
            return
        assert [run.count for run in runs] == run_pages
        if runs:
            self.held.append(runs)
        self.taken_total += sum(run_pages)

    @precondition(lambda self: bool(self.held))
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        runs = self.held.pop(index % len(self.held))
        self.cache.free(runs)
        self.freed_total += sum(run.count for run in runs)
        with pytest.raises(PageAccountingError):
            self.cache.free(runs[:1])  # a double free

    @invariant()
    def pages_partition_the_arena(self) -> None:
        pages: list[int] = []
        for run in self.cache.allocated_runs() + self.cache.free_extents():
            pages.extend(range(run.first, run.first + run.count))
        assert sorted(pages) == list(range(self.pages_total))  # no overlap, no over-commit
        used = sum(run.count for runs in self.held for run in runs)
        assert self.cache.pages_used == used == self.taken_total - self.freed_total
        assert self.cache.pages_free + self.cache.pages_used == self.pages_total

    def teardown(self) -> None:
        for runs in self.held:
            self.cache.free(runs)
        assert self.cache.free_extents() == [PageRun(0, self.pages_total)]


TestPageCacheMachine = PageCacheMachine.TestCase
