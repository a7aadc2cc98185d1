"""Request validation, batch assembly with padding, and output row slicing."""

from __future__ import annotations

import numpy as np
import pytest

from clockwork_async.runtime.batching import (
    BadInput,
    assemble_batch,
    output_rows,
    validate_request,
    zero_batch,
)
from clockwork_async.wire.messages import TensorSpec

SPECS = (TensorSpec("x", "float32", (-1, 3)), TensorSpec("ids", "int64", (-1,)))


def _row(value: float) -> dict[str, np.ndarray]:
    return {
        "x": np.full((1, 3), value, dtype=np.float32),
        "ids": np.array([int(value)], dtype=np.int64),
    }


def test_a_valid_row_passes() -> None:
    validate_request("m", SPECS, (1, 2, 4), _row(1.0))


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"x": np.zeros((1, 3), np.float32)}, "missing input 'ids'"),
        ({**_row(1.0), "y": np.zeros(1)}, "unexpected input 'y'"),
        ({"x": [[0.0, 0.0, 0.0]], "ids": np.zeros(1, np.int64)}, "not a numpy array"),
        ({"x": np.zeros((1, 3), np.float64), "ids": np.zeros(1, np.int64)}, "dtype float64"),
        ({"x": np.zeros((2, 3), np.float32), "ids": np.zeros(1, np.int64)}, "axis 0"),
        ({"x": np.zeros((1, 4), np.float32), "ids": np.zeros(1, np.int64)}, "axis 1"),
        ({"x": np.zeros((3,), np.float32), "ids": np.zeros(1, np.int64)}, r"expected \(1, 3\)"),
        ({"x": np.zeros((1, 3), np.float32), "ids": np.int64(3)}, "not a numpy array"),
    ],
)
def test_bad_rows_name_the_problem(inputs: dict[str, object], needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        validate_request("m", SPECS, (1, 2, 4), inputs)


def test_dynamic_inner_axis_only_at_batch_one() -> None:
    specs = (TensorSpec("seq", "float32", (-1, -1)),)
    row = {"seq": np.zeros((1, 7), np.float32)}
    validate_request("m", specs, (1,), row)
    with pytest.raises(BadInput, match="axis 1"):
        validate_request("m", specs, (1, 2), row)


def test_fixed_batch_one_model() -> None:
    specs = (TensorSpec("x", "float32", (1, 2)),)
    validate_request("m", specs, (1,), {"x": np.zeros((1, 2), np.float32)})


def test_a_tensor_without_a_batch_axis_is_sent_whole() -> None:
    specs = (TensorSpec("scale", "float32", ()), TensorSpec("table", "int8", (3, 2)))
    whole = {"scale": np.array(2.0, np.float32), "table": np.zeros((3, 2), np.int8)}
    validate_request("m", specs, (1,), whole)
    with pytest.raises(BadInput, match=r"input 'scale' has shape \(1,\), expected a scalar"):
        validate_request("m", specs, (1,), {**whole, "scale": np.ones(1, np.float32)})
    with pytest.raises(BadInput, match=r"'table' has shape \(1, 2\), expected \(3, 2\)"):
        validate_request("m", specs, (1,), {**whole, "table": np.zeros((1, 2), np.int8)})
    assert assemble_batch(specs, [whole], 1)["scale"] is whole["scale"]


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "int32", "float16"])
def test_every_dtype_is_checked_by_name(dtype: str) -> None:
    specs = (TensorSpec("v", dtype, (-1, 2)),)
    validate_request("m", specs, (1, 2), {"v": np.zeros((1, 2), dtype)})
    with pytest.raises(BadInput, match=f"input 'v' has dtype float64, expected {dtype}"):
        validate_request("m", specs, (1, 2), {"v": np.zeros((1, 2), np.float64)})


def test_a_declared_length_is_named_when_a_request_has_another() -> None:
    specs = (TensorSpec("audio", "float32", (-1, 512)),)
    with pytest.raises(BadInput, match=r"expected \(1, 512\) \(axis 1 takes only 512, got 300\)"):
        validate_request("m", specs, (1, 2), {"audio": np.zeros((1, 300), np.float32)})


def test_zero_batch_keeps_fixed_shapes_and_scalars() -> None:
    specs = (
        TensorSpec("x", "float32", (-1, 4, -1)),
        TensorSpec("s", "int64", ()),
        TensorSpec("flag", "bool", (2,)),
    )
    batch = zero_batch(specs, 3)
    assert {n: (a.shape, a.dtype.name) for n, a in batch.items()} == {
        "x": ((3, 4, 1), "float32"),
        "s": ((), "int64"),
        "flag": ((2,), "bool"),
    }


def test_assemble_stacks_in_order_and_pads_with_last_row() -> None:
    batch = assemble_batch(SPECS, [_row(1.0), _row(2.0), _row(3.0)], batch_size=4)
    assert batch["x"].shape == (4, 3)
    assert batch["x"][:, 0].tolist() == [1.0, 2.0, 3.0, 3.0]
    assert batch["ids"].tolist() == [1, 2, 3, 3]
    assert batch["x"].dtype == np.float32


def test_assemble_single_request_is_passed_through() -> None:
    row = _row(5.0)
    batch = assemble_batch(SPECS, [row], batch_size=1)
    assert batch["x"] is row["x"]


def test_assemble_rejects_too_many_rows() -> None:
    with pytest.raises(ValueError):
        assemble_batch(SPECS, [_row(1.0), _row(2.0)], batch_size=1)
    with pytest.raises(ValueError):
        assemble_batch(SPECS, [], batch_size=2)


def test_output_rows_are_read_only_views() -> None:
    outputs = {"y": np.arange(8, dtype=np.float32).reshape(4, 2), "scalar": np.array(3.0)}
    rows = output_rows(outputs, 2, batch_size=4)
    assert rows["y"].tolist() == [[4.0, 5.0]]
    assert np.shares_memory(rows["y"], outputs["y"])
    assert not rows["y"].flags.writeable
    assert rows["scalar"].shape == ()
    with pytest.raises(ValueError):
        rows["y"][0, 0] = 1.0
    assert outputs["y"].flags.writeable  # the batch itself is untouched


def test_output_without_batch_axis_is_shared_whole() -> None:
    outputs = {"y": np.arange(10, dtype=np.float32)}
    rows = output_rows(outputs, 0, batch_size=1)
    assert rows["y"].shape == (10,)
