"""Preparing an optimised ONNX graph for weights bound by address, and laying out one INFER's
inputs and outputs in the IO buffer. No sessions, no devices.

Invariants:
- `split_weights` picks the weights that live in the arena: top-level initializers of
  `ort_graph.ARENA_DTYPES`, non-empty, and not read by a kernel from host memory
  (`HOST_INPUTS`: CUDA kernels take Resize's scales, Clip's bounds and the like on the CPU,
  so those stay inline, counted in ``inline_bytes``). It leaves the graph unchanged.
- `weights_as_inputs` turns the picked initializers into graph inputs of the same name, type
  and shape: a session of that graph runs only with every weight bound (IO binding).
  `weights_as_placeholders` keeps them initializers whose data is the empty placeholder file:
  a session of that graph must be given each one (``SessionOptions.add_initializer``).
- `io_layout` puts the inputs first, then the outputs, in spec order, each at a multiple of
  ``IO_ALIGN_BYTES`` from the buffer's start: the inputs are one contiguous host-to-device
  copy, the outputs one device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .cuda_arena import IO_ALIGN_BYTES, align_up
from .ort_graph import ARENA_DTYPES, PLACEHOLDER_NAME

# op type -> indices of inputs that CUDA kernels read from host memory (float ones matter:
# integer initializers stay inline anyway).
HOST_INPUTS: dict[str, frozenset[int]] = {
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "Clip": frozenset({1, 2}),
    "Pad": frozenset({1, 2, 3}),
    "Range": frozenset({0, 1, 2}),
    "Dropout": frozenset({1, 2}),
    "NonMaxSuppression": frozenset({2, 3, 4}),
}


def host_read_initializers(model: onnx.ModelProto) -> set[str]:
    """Names of tensors some node reads at a `HOST_INPUTS` position."""
    return {
        node.input[index]
        for node in model.graph.node
        for index in HOST_INPUTS.get(node.op_type, ())
        if index < len(node.input) and node.input[index]
    }


def split_weights(model: onnx.ModelProto) -> tuple[list[tuple[str, np.ndarray]], int]:
    """(name, contiguous host copy) of each arena-bound initializer, and the bytes of the
    initializers that stay inline. The graph is left unchanged."""
    host_read = host_read_initializers(model)
    weights: list[tuple[str, np.ndarray]] = []
    inline_bytes = 0
    for proto in model.graph.initializer:
        array = numpy_helper.to_array(proto)
        if array.dtype not in ARENA_DTYPES or array.nbytes == 0 or proto.name in host_read:
            inline_bytes += array.nbytes
            continue
        weights.append((proto.name, np.ascontiguousarray(array)))
    return weights, inline_bytes


def weights_as_inputs(model: onnx.ModelProto, names: Collection[str]) -> None:
    """Turn the initializers ``names`` into graph inputs (in place)."""
    wanted = set(names)
    moved = [proto for proto in model.graph.initializer if proto.name in wanted]
    kept = [proto for proto in model.graph.initializer if proto.name not in wanted]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    listed = {value.name for value in model.graph.input}
    for proto in moved:
        if proto.name not in listed:  # IR < 4 graphs list initializers as inputs already
            info = helper.make_tensor_value_info(proto.name, proto.data_type, list(proto.dims))
            model.graph.input.append(info)


def weights_as_placeholders(model: onnx.ModelProto, names: Collection[str]) -> None:
    """Make the initializers ``names`` external data in the empty placeholder file (in
    place): they keep name, type and shape, and a session must be given their values."""
    wanted = set(names)
    for proto in model.graph.initializer:
        if proto.name not in wanted:
            continue
        nbytes = numpy_helper.to_array(proto).nbytes
        for data_field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
            proto.ClearField(data_field)
        proto.data_location = onnx.TensorProto.EXTERNAL
        del proto.external_data[:]
        for key, value in (
            ("location", PLACEHOLDER_NAME),
            ("offset", "0"),
            ("length", str(nbytes)),
        ):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value


@dataclass(frozen=True, slots=True)
class IoSlot:
    """One tensor of an INFER in the IO buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class IoLayout:
    """Where one batch size's inputs and outputs live in the IO buffer."""

    inputs: tuple[IoSlot, ...]
    outputs: tuple[IoSlot, ...]
    inputs_bytes: int  # [0, inputs_bytes) holds every input
    total_bytes: int  # [outputs_offset, total_bytes) holds every output

    @property
    def outputs_offset(self) -> int:
        return self.outputs[0].offset_bytes if self.outputs else self.total_bytes


Tensor = tuple[str, str, tuple[int, ...]]  # name, dtype, exact shape


def _slots(tensors: Sequence[Tensor], start_bytes: int) -> tuple[tuple[IoSlot, ...], int]:
    slots, offset = [], start_bytes
    for name, dtype, shape in tensors:
        slot = IoSlot(name, dtype, tuple(shape), offset)
        slots.append(slot)
        offset = align_up(offset + slot.nbytes, IO_ALIGN_BYTES)
    return tuple(slots), offset


def io_layout(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> IoLayout:
    """The layout of these exact-shaped inputs and outputs (module header)."""
    input_slots, inputs_end = _slots(inputs, 0)
    output_slots, outputs_end = _slots(outputs, inputs_end)
    return IoLayout(input_slots, output_slots, inputs_end, outputs_end)


def provider_probe_model() -> bytes:
    """A one-node model (y = x + 1, float32 [1, 4]) to check that a provider loads."""
    one = numpy_helper.from_array(np.ones((1, 4), np.float32), "one")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data: bytes = model.SerializeToString()
    return data
