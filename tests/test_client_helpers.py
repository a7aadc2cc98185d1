"""The client helpers build requests the daemon accepts for every served type and shape: the
CLI's ``--random`` inputs and the demo's batches follow `wire.dtypes.request_shape` and
`batch_shape`, as the daemon's and the executors' checks do."""

from __future__ import annotations

import numpy as np
import pytest

from clockwork_async.cli_client import ClientError
from clockwork_async.cli_client import random_inputs as cli_random_inputs
from clockwork_async.demo import random_inputs as demo_random_inputs
from clockwork_async.runtime.batching import validate_request
from clockwork_async.wire.messages import TensorSpec

SPECS = (
    TensorSpec("ids", "int64", (-1, 12)),
    TensorSpec("mask", "bool", (-1, 12)),
    TensorSpec("scale", "float16", ()),
    TensorSpec("table", "uint8", (3, 2)),
)


def test_cli_random_inputs_pass_the_daemons_checks() -> None:
    inputs = cli_random_inputs(SPECS, np.random.default_rng(0))
    assert {n: (a.dtype.name, a.shape) for n, a in inputs.items()} == {
        "ids": ("int64", (1, 12)),
        "mask": ("bool", (1, 12)),
        "scale": ("float16", ()),
        "table": ("uint8", (3, 2)),
    }
    assert inputs["mask"].any() and not inputs["mask"].all()
    validate_request("m", SPECS, (1,), inputs)


def test_cli_random_inputs_refuse_a_type_the_wire_cannot_carry() -> None:
    with pytest.raises(ClientError, match="input 's' has dtype 'object'"):
        cli_random_inputs((TensorSpec("s", "object", (-1,)),), np.random.default_rng(0))


def test_demo_batches_keep_scalars_and_fixed_shapes_whole() -> None:
    batch = demo_random_inputs(SPECS, 4)
    assert {n: (a.dtype.name, a.shape) for n, a in batch.items()} == {
        "ids": ("int64", (4, 12)),
        "mask": ("bool", (4, 12)),
        "scale": ("float16", ()),
        "table": ("uint8", (3, 2)),
    }
