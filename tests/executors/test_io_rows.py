"""An INFER by reference on the executor's side: references are checked on arrival, rows are
gathered from the arena (padding repeats the last), outputs land in their slots, and what does
not fit stays in the result as bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from clockwork_async.executors.io_rows import check_rows, gather, scatter
from clockwork_async.executors.validation import Refused

from clockwork_async.ioarena.shared import IoArena, MappedArena, Slot, map_shared
from clockwork_async.wire.messages import Infer, TensorSpec

X = TensorSpec("x", "float32", (-1, 3))
Y = TensorSpec("y", "int64", (-1, 2))


@dataclass
class Model:
    name: str = "m"
    weights_bytes: int = 0
    run_pages: tuple[int, ...] = ()
    inputs: tuple[TensorSpec, ...] = (X,)
    outputs: tuple[TensorSpec, ...] = (Y,)
    batch_sizes: tuple[int, ...] = (1, 4)


@pytest.fixture
def arenas() -> tuple[IoArena, MappedArena]:
    arena = IoArena(1 << 16)
    mapped = map_shared(os.dup(arena.fd))
    yield arena, mapped
    mapped.close()
    arena.close()


def _slot(arena: IoArena, nbytes: int) -> Slot:
    slot = arena.lease("c", nbytes)
    assert isinstance(slot, Slot)
    return slot


def _infer(batch_size: int, inputs: list[int], outputs: list[int] = ()) -> Infer:
    return Infer(1, "m", batch_size, {}, 0, 1, tuple(inputs), tuple(outputs))


def test_rows_are_gathered_padded_and_outputs_scattered(arenas) -> None:
    arena, mapped = arenas
    rows = [_slot(arena, 12) for _ in range(2)]
    outs = [_slot(arena, 16) for _ in range(2)]
    for value, slot in enumerate(rows):
        slot.array.view(np.float32)[:] = value + 1
    action = _infer(4, [rows[0].offset, 12, rows[1].offset, 12], [outs[0].offset, 16, 0, 0])
    check_rows(mapped, Model(), action)
    batch = gather(mapped, (X,), action)["x"]
    assert batch.shape == (4, 3) and batch[:, 0].tolist() == [1, 2, 2, 2]
    left = scatter(mapped, (Y,), action, {"y": np.arange(8, dtype=np.int64).reshape(4, 2)})
    assert left == {}
    assert outs[0].array.view(np.int64).tolist() == [0, 1]
    assert not outs[1].array.any()  # the dropped row wrote nothing


def test_a_lone_row_is_read_in_place(arenas) -> None:
    arena, mapped = arenas
    row = _slot(arena, 12)
    action = _infer(1, [row.offset, 12])
    batch = gather(mapped, (X,), action)["x"]
    assert batch.shape == (1, 3) and np.shares_memory(batch, mapped.buffer)


def test_outputs_that_do_not_fit_stay_as_bytes(arenas) -> None:
    arena, mapped = arenas
    row, out = _slot(arena, 12), _slot(arena, 16)
    action = _infer(1, [row.offset, 12], [out.offset, 16])
    wrong = {"y": np.zeros((1, 3), np.int64)}
    assert scatter(mapped, (Y,), action, wrong).keys() == {"y"}


@pytest.mark.parametrize(
    "refs",
    [[10, 12], [1 << 20, 12], [-64, 12], [128, 8], [128, 12, 256]],
)
def test_bad_references_are_refused_on_arrival(arenas, refs: list[int]) -> None:
    _, mapped = arenas
    with pytest.raises(Refused):
        check_rows(mapped, Model(), _infer(1, refs))


def test_references_without_an_arena_are_refused() -> None:
    with pytest.raises(Refused):
        check_rows(None, Model(), _infer(1, [128, 12]))
