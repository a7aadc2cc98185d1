"""The IO arena's slot allocator: first fit, aligned, no overlap, freed exactly once, and one
extent again once everything is freed (hypothesis drives random lease/free sequences)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from clockwork_async.ioarena.slots import NotAllocated, SlotAllocator


def test_slots_are_aligned_first_fit_and_reused() -> None:
    slots = SlotAllocator(1024, align_bytes=64)
    first = slots.allocate(1)
    second = slots.allocate(100)
    assert (first, second) == (0, 64)
    assert slots.used_bytes == 64 + 128
    slots.free(first)
    assert slots.allocate(64) == 0  # the hole is reused first
    assert slots.allocate(2048) is None  # never a wait, never growth


def test_a_full_allocator_says_no_and_recovers() -> None:
    slots = SlotAllocator(256, align_bytes=64)
    offsets = [slots.allocate(64) for _ in range(4)]
    assert slots.allocate(1) is None and slots.free_bytes == 0
    for offset in offsets:
        assert offset is not None
        slots.free(offset)
    assert slots.free_extents() == [(0, 256)]


def test_free_exactly_once() -> None:
    slots = SlotAllocator(256, align_bytes=64)
    offset = slots.allocate(10)
    assert offset is not None
    slots.free(offset)
    with pytest.raises(NotAllocated):
        slots.free(offset)
    with pytest.raises(NotAllocated):
        slots.free(128)  # never handed out
    assert slots.used_bytes == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        SlotAllocator(100, align_bytes=64)
    with pytest.raises(ValueError):
        SlotAllocator(128, align_bytes=48)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a model of live slots."""

    def __init__(self) -> None:
        super().__init__()
        self.slots = SlotAllocator(64 * 64, align_bytes=64)
        self.live: dict[int, int] = {}  # offset -> asked bytes

    @rule(nbytes=st.integers(min_value=0, max_value=64 * 20))
    def allocate(self, nbytes: int) -> None:
        offset = self.slots.allocate(nbytes)
        if offset is None:
            assert self.slots.largest_free_bytes() < max(nbytes, 1)
            return
        assert offset % 64 == 0
        self.live[offset] = nbytes

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[offset]
        self.slots.free(offset)
        with pytest.raises(NotAllocated):
            self.slots.free(offset)

    @invariant()
    def no_overlap_and_bytes_add_up(self) -> None:
        spans = sorted((o, o + self.slots.size_of(o)) for o in self.live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert all(end <= self.slots.capacity_bytes for _, end in spans)
        assert all(self.slots.size_of(o) >= n for o, n in self.live.items())
        used = sum(end - start for start, end in spans)
        assert self.slots.used_bytes == used
        free = sum(end - start for start, end in self.slots.free_extents())
        assert used + free == self.slots.capacity_bytes

    @invariant()
    def empty_means_one_extent(self) -> None:
        if not self.live:
            assert self.slots.free_extents() == [(0, self.slots.capacity_bytes)]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
