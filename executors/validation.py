"""Input checks of executor actions, done on arrival so a bad action never takes lane time.

Invariant: every check raises `Refused` with a named ErrorCode (BAD_INPUT here; declared input
shapes at REGISTER: BackendError(BAD_MODEL), as backends raise) and one sentence naming the
first problem; nothing here touches the registry, pages or a backend. An input whose axis 0 is
dynamic is the batch's (its leading axis is the action's batch size); any other input (a
scalar, a fixed shape) comes whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from clockwork_async.wire.messages import ErrorCode, TensorSpec

from .backend import BackendError, RegisteredModel


class Refused(Exception):
    """An action answered with an error without running (no start/end times)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def validate_window(earliest_ns: int, latest_ns: int) -> None:
    """Raises Refused(BAD_INPUT) for an empty window."""
    if earliest_ns > latest_ns:
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"empty window: earliest_ns {earliest_ns} is after latest_ns {latest_ns}",
        )


def validate_inputs(
    model: RegisteredModel, batch_size: int, inputs: Mapping[str, np.ndarray]
) -> None:
    """Check a batch against the model's TensorSpecs. Raises Refused(BAD_INPUT) naming the
    first problem: batch size, missing/unexpected input, dtype, rank, leading axis, shape."""
    if batch_size not in model.batch_sizes:
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"batch size {batch_size} is not one of model {model.name!r}'s {model.batch_sizes}",
        )
    expected = {spec.name for spec in model.inputs}
    for name in sorted(expected - inputs.keys()):
        raise Refused(ErrorCode.BAD_INPUT, f"missing input {name!r} of model {model.name!r}")
    for name in sorted(inputs.keys() - expected):
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"unexpected input {name!r}: model {model.name!r} takes {sorted(expected)}",
        )
    for spec in model.inputs:
        _check_tensor(spec, batch_size, inputs[spec.name])


def _check_tensor(spec: TensorSpec, batch_size: int, array: np.ndarray) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != np.dtype(spec.dtype):
        dtype = getattr(array, "dtype", type(array).__name__)
        raise Refused(
            ErrorCode.BAD_INPUT, f"input {spec.name!r} has dtype {dtype}, expected {spec.dtype}"
        )
    if array.ndim != len(spec.shape):
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"input {spec.name!r} has shape {array.shape}, expected rank {len(spec.shape)} "
            f"like {spec.shape}",
        )
    batched = bool(spec.shape) and spec.shape[0] == -1  # else: no batch axis, sent whole
    if batched and array.shape[0] != batch_size:
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"input {spec.name!r} has leading axis {array.shape[0]}, "
            f"but the action's batch_size is {batch_size}",
        )
    if any(want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)):
        raise Refused(
            ErrorCode.BAD_INPUT,
            f"input {spec.name!r} has shape {array.shape}, expected {spec.shape} (-1: any size)",
        )


def serving_inputs(
    model: str, found: Sequence[TensorSpec], declared: Sequence[TensorSpec]
) -> tuple[TensorSpec, ...]:
    """The input specs a RegisterModel declares (its dynamic axes set to the lengths model.toml
    declares), checked against the file's: the same names, dtypes and ranks, and every fixed
    axis of the file kept. Empty ``declared``: the file's. Raises BackendError(BAD_MODEL), as
    a backend's REGISTER does."""
    if not declared:
        return tuple(found)
    by_name = {spec.name: spec for spec in found}
    if sorted(by_name) != sorted(spec.name for spec in declared):
        raise BackendError(
            ErrorCode.BAD_MODEL,
            f"model {model!r}: declared inputs {sorted(s.name for s in declared)} differ from "
            f"the file's {sorted(by_name)}",
        )
    for spec in declared:
        _check_declared(model, by_name[spec.name], spec)
    return tuple(declared)


def _check_declared(model: str, file_spec: TensorSpec, spec: TensorSpec) -> None:
    fits = len(spec.shape) == len(file_spec.shape) and all(
        dim in (-1, want) for dim, want in zip(file_spec.shape, spec.shape, strict=True)
    )
    if spec.dtype != file_spec.dtype or not fits:
        raise BackendError(
            ErrorCode.BAD_MODEL,
            f"model {model!r}: input {spec.name!r} is declared {spec.dtype} {list(spec.shape)}, "
            f"but the file has {file_spec.dtype} {list(file_spec.shape)}",
        )
