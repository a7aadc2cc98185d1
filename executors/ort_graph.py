"""Preparing an ONNX model for the arena: read it, optimise it once, strip its weights.

Invariants:
- ``strip`` leaves every stripped initializer in the graph with its name, type and shape but
  no data: it points at external data in ``PLACEHOLDER_NAME``, an empty file next to the graph
  that must exist and is never read, because every session supplies those tensors itself
  (``SessionOptions.add_initializer``).
- Only initializers of ``ARENA_DTYPES`` move to the arena. Integer (int32/int64), bool and
  string initializers stay inline: they are shapes, axes and indices that ONNX Runtime's shape
  inference reads while it builds the graph (stripping a Reshape's shape fails with "Cannot
  parse data from external tensors").
- Every failure to read or prepare a model is a BackendError(BAD_MODEL) with a sentence that
  names the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

# The installed library, not the sibling module: absolute imports never resolve to a sibling.
import onnxruntime as ort
from onnx import numpy_helper

from clockwork_async.wire.dtypes import onnx_wire_name, supported_names
from clockwork_async.wire.messages import ErrorCode, TensorSpec

from .backend import BackendError
from .validation import serving_inputs

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
PLACEHOLDER_NAME = "placeholder.weights"
# dtypes whose initializers move into the arena; the rest stay inline (see module header).
ARENA_DTYPES = frozenset(
    np.dtype(name) for name in ("float16", "float32", "float64", "int8", "uint8", "int16")
)
# op type -> index of its weight input that ONNX Runtime's CPU kernels prepack.
PREPACKED_INPUT_INDEX = {"Gemm": 1, "FusedGemm": 1, "MatMul": 1, "FusedMatMul": 1}


def bad_model(path: str, reason: str) -> BackendError:
    return BackendError(ErrorCode.BAD_MODEL, f"cannot register {path}: {reason}")


def read_model(path: str) -> onnx.ModelProto:
    """The model at ``path`` (external data loaded). Raises BackendError(BAD_MODEL)."""
    if not Path(path).is_file():
        raise bad_model(path, "no such file")
    try:
        return onnx.load(path)
    except Exception as error:  # protobuf and onnx raise many unrelated types
        raise bad_model(path, f"not a readable ONNX model ({error})") from error


def _spec(value: onnx.ValueInfoProto, path: str) -> TensorSpec:
    """TensorSpec of a graph input/output; unknown dims become -1. Raises BAD_MODEL for a type
    outside the wire's table (`wire.dtypes`)."""
    tensor_type = value.type.tensor_type
    dtype = onnx_wire_name(tensor_type.elem_type)
    if dtype is None:
        raise bad_model(
            path,
            f"tensor {value.name!r} has element type {tensor_type.elem_type}; "
            f"served types: {supported_names()}",
        )
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return TensorSpec(value.name, dtype, shape)


def graph_specs(
    model: onnx.ModelProto, path: str, declared: Sequence[TensorSpec] = ()
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of the graph; initializers listed as inputs (IR < 4) are skipped.
    ``declared`` input shapes replace the file's where they fit it (`serving_inputs`)."""
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = tuple(_spec(v, path) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_spec(v, path) for v in model.graph.output)
    if not inputs or not outputs:
        raise bad_model(path, "the graph needs at least one input and one output")
    return serving_inputs(path, inputs, declared), outputs


def batch_sizes(
    specs: Sequence[TensorSpec], requested: Sequence[int], path: str
) -> tuple[int, ...]:
    """Requested sizes (sorted, unique) or the defaults when every input and output has a
    dynamic leading axis; else (1,). Raises BAD_MODEL for sizes the model cannot take."""
    if any(size < 1 for size in requested):
        raise bad_model(path, f"batch sizes must be >= 1, got {list(requested)}")
    dynamic = all(spec.shape and spec.shape[0] == -1 for spec in specs)
    if dynamic:
        return tuple(sorted(set(requested))) or DEFAULT_BATCH_SIZES
    if set(requested) - {1}:
        raise bad_model(path, f"the model has a fixed batch; it cannot run {list(requested)}")
    return (1,)


def optimise(path: str, optimised_path: Path) -> onnx.ModelProto:
    """ONNX Runtime's fully optimised graph of ``path`` (weights inline). Raises BAD_MODEL."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(optimised_path)
    options.intra_op_num_threads = 1
    options.log_severity_level = 3  # silence the "hardware specific optimizations" warning
    try:
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return onnx.load(str(optimised_path))
    except Exception as error:  # ONNX Runtime raises its own hierarchy of pybind errors
        raise bad_model(path, f"ONNX Runtime cannot load it ({error})") from error
    finally:
        optimised_path.unlink(missing_ok=True)


def _point_at_placeholder(proto: onnx.TensorProto, nbytes: int) -> None:
    """Drop the tensor's data and make it external data in the (empty) placeholder file."""
    for data_field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
        proto.ClearField(data_field)
    proto.data_location = onnx.TensorProto.EXTERNAL
    del proto.external_data[:]
    for key, value in (("location", PLACEHOLDER_NAME), ("offset", "0"), ("length", str(nbytes))):
        entry = proto.external_data.add()
        entry.key, entry.value = key, value


def strip(model: onnx.ModelProto) -> tuple[list[tuple[str, np.ndarray]], int]:
    """Strip the arena-bound initializers out of ``model`` (in place). Returns their
    (name, contiguous host copy) and the bytes of those left inline."""
    stripped: list[tuple[str, np.ndarray]] = []
    inline_bytes = 0
    for proto in model.graph.initializer:
        array = numpy_helper.to_array(proto)
        if array.dtype not in ARENA_DTYPES or array.nbytes == 0:
            inline_bytes += array.nbytes
            continue
        stripped.append((proto.name, np.ascontiguousarray(array)))
        _point_at_placeholder(proto, array.nbytes)
    return stripped, inline_bytes


def prepackable_bytes(model: onnx.ModelProto, stripped: Mapping[str, np.ndarray]) -> int:
    """Bytes of stripped weights that CPU kernels would copy out when prepacking is on."""
    names = {
        node.input[PREPACKED_INPUT_INDEX[node.op_type]]
        for node in model.graph.node
        if node.op_type in PREPACKED_INPUT_INDEX and len(node.input) > 1
    }
    return sum(stripped[name].nbytes for name in names if name in stripped)
