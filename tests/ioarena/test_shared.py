"""The IO arena: an anonymous memfd (nothing in /dev/shm), slots with one owner freed exactly
once (after the last pin), per-owner shares, and an executor-side mapping that sees the same
bytes and the daemon's token."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.ioarena.shared import (
    HEADER_BYTES,
    ArenaError,
    ArenaRefusal,
    IoArena,
    Slot,
    map_shared,
)


def _slot(result: Slot | ArenaRefusal) -> Slot:
    assert isinstance(result, Slot), result
    return result


def test_nothing_is_named_in_dev_shm_and_the_fd_is_cloexec() -> None:
    before = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
    arena = IoArena(1 << 16)
    try:
        after = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
        assert after == before
        assert not os.get_inheritable(arena.fd)
        assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:")
    finally:
        arena.close()


def test_slots_free_once_after_release_and_last_pin() -> None:
    arena = IoArena(1 << 16)
    try:
        slot = _slot(arena.lease("conn", 1000))
        assert slot.offset >= HEADER_BYTES and arena.used_bytes == 1024
        slot.pin()
        slot.release()
        assert not slot.freed and arena.used_bytes == 1024  # an action still holds it
        slot.unpin()
        assert slot.freed and arena.used_bytes == 0 and arena.held_by("conn") == 0
        slot.release()  # a second release does nothing
        assert arena.used_bytes == 0
        with pytest.raises(RuntimeError):
            slot.pin()
    finally:
        arena.close()


def test_parts_share_their_slot_pins_and_have_output_regions_of_their_own() -> None:
    arena = IoArena(1 << 16)
    try:
        slot = _slot(arena.lease("conn", 1000))
        first, second = slot.part(), slot.part()
        assert (first.offset, first.nbytes) == (slot.offset, slot.nbytes)
        regions = [first.attach_outputs(100), second.attach_outputs(100)]
        assert all(region is not None for region in regions)
        assert regions[0].offset != regions[1].offset  # type: ignore[union-attr]
        assert arena.used_bytes == 1024 + 2 * 128
        first.pin()
        first.release()  # a part's release is not its slot's
        second.release()
        slot.release()
        assert not slot.freed and not first.freed  # the part's pin holds the slot
        first.unpin()
        assert slot.freed and first.freed and second.freed
        assert arena.used_bytes == 0 and arena.held_by("conn") == 0
        with pytest.raises(RuntimeError):
            second.pin()
        with pytest.raises(RuntimeError):
            slot.part()
    finally:
        arena.close()


def test_output_regions_go_with_their_slot() -> None:
    arena = IoArena(1 << 16)
    try:
        slot = _slot(arena.lease("conn", 100))
        outputs = slot.attach_outputs(4000)
        assert outputs is not None and slot.attach_outputs(10) is outputs
        assert arena.held_by("conn") == 128  # outputs do not count against the share
        slot.release()
        assert arena.used_bytes == 0 and arena.live_slots == 0
    finally:
        arena.close()


def test_shares_full_and_too_large_are_named_refusals() -> None:
    arena = IoArena(4096, owner_share=0.5)
    try:
        too_large = arena.lease("a", 3000)
        assert isinstance(too_large, ArenaRefusal) and too_large.cause == "too_large"
        first = _slot(arena.lease("a", 2048))
        share = arena.lease("a", 64)
        assert isinstance(share, ArenaRefusal) and share.cause == "share"
        second = _slot(arena.lease("b", 2048))
        full = arena.lease("c", 64)
        assert isinstance(full, ArenaRefusal) and full.cause == "full"
        assert dict(arena.refusals) == {"too_large": 1, "share": 1, "full": 1}
        first.release()
        second.release()
        assert arena.used_bytes == 0
    finally:
        arena.close()


def test_an_executor_mapping_sees_the_same_bytes_and_token() -> None:
    arena = IoArena(1 << 16)
    try:
        mapped = map_shared(os.dup(arena.fd))
        assert mapped.token == arena.token
        slot = _slot(arena.lease("conn", 8))
        slot.array[:] = np.arange(8, dtype=np.uint8)
        assert bytes(mapped.view(slot.offset, 8)) == bytes(range(8))
        mapped.view(slot.offset, 8)[:] = 7
        assert bytes(slot.array) == b"\x07" * 8
        with pytest.raises(ValueError):
            mapped.view(0, 8)  # the header is not a slot
        assert arena.offset_of(slot.array[2:]) == slot.offset + 2
        assert arena.offset_of(np.zeros(4, np.uint8)) is None
        mapped.close()
        slot.release()
    finally:
        arena.close()


def test_a_foreign_descriptor_is_not_an_arena(tmp_path: Path) -> None:
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ArenaError):
        map_shared(os.open(path, os.O_RDWR))
