"""Arenas: page views without copies, bounds checks, and the counting (memory-less) arena."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from clockwork_async.executors.arena import (
    ArenaRangeError,
    CountingArena,
    NumpyArena,
    TensorPlacement,
    layout_tensors,
    pages_for,
)
from clockwork_async.executors.backend import Arena, BackendError, PageRun
from hypothesis import given
from hypothesis import strategies as st


def test_pages_for_rounds_up() -> None:
    assert pages_for(0, 64) == 0
    assert pages_for(1, 64) == 1
    assert pages_for(64, 64) == 1
    assert pages_for(65, 64) == 2
    with pytest.raises(ValueError):
        pages_for(10, 0)
    with pytest.raises(ValueError):
        pages_for(-1, 64)


def test_numpy_arena_views_share_memory_and_are_aligned() -> None:
    arena = NumpyArena(page_bytes=4096, pages_total=4)
    whole = arena.view(PageRun(0, 4))
    part = arena.view(PageRun(1, 2))
    assert part.dtype == np.uint8
    assert part.nbytes == 2 * 4096
    assert part.ctypes.data % 4096 == 0
    part[:] = 7
    assert np.all(whole[4096 : 3 * 4096] == 7)
    assert not whole[:4096].any() and not whole[3 * 4096 :].any()
    arena.close()


@pytest.mark.parametrize("run", [PageRun(3, 2), PageRun(-1, 1), PageRun(0, 0), PageRun(4, 1)])
def test_runs_outside_the_arena_raise(run: PageRun) -> None:
    for arena in (NumpyArena(64, 4), CountingArena(64, 4)):
        with pytest.raises(ArenaRangeError):
            arena.view(run)


def test_counting_arena_has_geometry_but_no_memory() -> None:
    arena = CountingArena(page_bytes=16 << 20, pages_total=2048)  # 32 GiB, nothing allocated
    assert arena.pages_total * arena.page_bytes == 32 << 30
    with pytest.raises(BackendError, match="no memory"):
        arena.view(PageRun(0, 1))


def test_closed_arena_refuses_views() -> None:
    arena = NumpyArena(64, 2)
    arena.close()
    with pytest.raises(BackendError, match="closed"):
        arena.view(PageRun(0, 1))


@pytest.mark.parametrize(("page_bytes", "pages_total"), [(0, 1), (100, 1), (64, -1)])
def test_bad_geometry_raises(page_bytes: int, pages_total: int) -> None:
    with pytest.raises(ValueError):
        NumpyArena(page_bytes, pages_total)
    with pytest.raises(ValueError):
        CountingArena(page_bytes, pages_total)


def test_both_arenas_satisfy_the_protocol() -> None:
    arenas: list[Arena] = [NumpyArena(64, 1), CountingArena(64, 1)]
    assert [arena.pages_total for arena in arenas] == [1, 1]


def test_layout_gives_large_tensors_their_own_runs_and_packs_small_ones() -> None:
    run_pages, placements = layout_tensors([100, 5000, 64, 1000, 3000], page_bytes=4096)
    assert run_pages == (2, 1)
    assert placements[1] == TensorPlacement(0, 0)  # 5000 bytes: a run of 2 pages, alone at 0
    # the rest go largest first into the first run with room: the long run's tail, then a new
    # one-page run; each at a 64-byte aligned offset
    assert placements[4] == TensorPlacement(0, 5056)  # 5000 -> 5056
    assert placements[3] == TensorPlacement(1, 0)  # 1000 bytes no longer fit run 0
    assert placements[0] == TensorPlacement(0, 8064)  # 3000 -> 3008; 100 fits the last 128
    assert placements[2] == TensorPlacement(1, 1024)


def test_layout_of_nothing_needs_no_pages() -> None:
    assert layout_tensors([], 4096) == ((), ())
    with pytest.raises(ValueError):
        layout_tensors([-1], 4096)
    with pytest.raises(ValueError):
        layout_tensors([1], 100)


@given(
    sizes=st.lists(st.integers(0, 20_000), max_size=30),
    page_bytes=st.sampled_from([64, 1024, 4096]),
)
def test_layout_places_every_tensor_aligned_inside_its_run_without_overlap(
    sizes: list[int], page_bytes: int
) -> None:
    run_pages, placements = layout_tensors(sizes, page_bytes)
    assert all(count >= 1 for count in run_pages)
    spans: dict[int, list[tuple[int, int]]] = {}
    for size, placement in zip(sizes, placements, strict=True):
        assert placement.offset_bytes % 64 == 0
        end = placement.offset_bytes + size
        assert end <= run_pages[placement.run_index] * page_bytes
        if size > page_bytes:
            assert placement.offset_bytes == 0
        spans.setdefault(placement.run_index, []).append((placement.offset_bytes, end))
    for run_spans in spans.values():
        run_spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(run_spans))
    # packing wastes at most one page per run beyond 64-byte padding
    padded_bytes = sum(-(-size // 64) * 64 for size in sizes)
    assert sum(run_pages) * page_bytes < padded_bytes + len(run_pages) * page_bytes + page_bytes
