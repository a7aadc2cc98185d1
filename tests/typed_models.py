"""Small ONNX models of every served tensor type and with sequence axes, built with
`onnx.helper` and seeded weights, for the repository, executor and end-to-end tests.

Each builder returns the model's bytes; ``model.toml`` texts that serve them sit beside.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
TOKENS = 12  # the length the sequence model's model.toml declares
SAMPLES = 64  # likewise for the audio model


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    weights: dict[str, np.ndarray],
) -> bytes:
    initializers = [numpy_helper.from_array(array, name) for name, array in weights.items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def _value(name: str, elem_type: int, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def fp16_model() -> bytes:
    """``x`` float16 [N, 8] -> ``y`` float16 [N, 4] = Relu(x @ W)."""
    weight = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    return _model(
        nodes,
        [_value("x", TensorProto.FLOAT16, ["N", 8])],
        [_value("y", TensorProto.FLOAT16, ["N", 4])],
        {"w": weight},
    )


def ids_mask_scale_model() -> bytes:
    """``ids`` int64 [N, 6], ``mask`` bool [N, 6] and a scalar ``scale`` float32 [] ->
    ``y`` float32 [N, 4] = scale * sum over the masked tokens of table[ids]; ``kept`` int64
    [N] = how many tokens the mask keeps. The scalar input makes it a batch-1 model."""
    table = np.random.default_rng(2).standard_normal((10, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["rows", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "one"], ["summed"], keepdims=0),
        helper.make_node("Mul", ["summed", "scale"], ["y"]),
        helper.make_node("Cast", ["mask"], ["maski"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["maski", "one"], ["kept"], keepdims=0),
    ]
    return _model(
        nodes,
        [
            _value("ids", TensorProto.INT64, ["N", 6]),
            _value("mask", TensorProto.BOOL, ["N", 6]),
            _value("scale", TensorProto.FLOAT, []),
        ],
        [_value("y", TensorProto.FLOAT, ["N", 4]), _value("kept", TensorProto.INT64, ["N"])],
        {"table": table, "last": np.array([2], np.int64), "one": np.array([1], np.int64)},
    )


MIXED_INPUTS = {
    "a": TensorProto.INT8,
    "b": TensorProto.UINT8,
    "c": TensorProto.INT16,
    "d": TensorProto.INT32,
    "e": TensorProto.FLOAT,
    "f": TensorProto.DOUBLE,
}


def mixed_model() -> bytes:
    """Six inputs [N, 3] of int8, uint8, int16, int32, float32, float64 -> ``total`` float64
    (their sum), ``positive`` bool (total > 0) and ``rounded`` int32 (total cast)."""
    nodes = [
        helper.make_node("Cast", [name], [f"{name}64"], to=TensorProto.DOUBLE)
        for name in MIXED_INPUTS
    ]
    running = "a64"
    for index, name in enumerate(list(MIXED_INPUTS)[1:]):
        out = "total" if index == len(MIXED_INPUTS) - 2 else f"sum{index}"
        nodes.append(helper.make_node("Add", [running, f"{name}64"], [out]))
        running = out
    nodes += [
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("Cast", ["total"], ["rounded"], to=TensorProto.INT32),
    ]
    return _model(
        nodes,
        [_value(name, kind, ["N", 3]) for name, kind in MIXED_INPUTS.items()],
        [
            _value("total", TensorProto.DOUBLE, ["N", 3]),
            _value("positive", TensorProto.BOOL, ["N", 3]),
            _value("rounded", TensorProto.INT32, ["N", 3]),
        ],
        {"zero": np.array(0.0, np.float64)},
    )


def sequence_model() -> bytes:
    """``ids`` int64 [N, tokens] -> ``y`` float32 [N, 8]: an embedding, then the mean over
    ``tokens``."""
    table = np.random.default_rng(3).standard_normal((50, 8)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("ReduceMean", ["rows"], ["y"], axes=[1], keepdims=0),
    ]
    return _model(
        nodes,
        [_value("ids", TensorProto.INT64, ["N", "tokens"])],
        [_value("y", TensorProto.FLOAT, ["N", 8])],
        {"table": table},
    )


SEQUENCE_TOML = f"[inputs.ids.axes]\ntokens = [{TOKENS}]\n"


def audio_model() -> bytes:
    """``audio`` float32 [batch, samples] -> ``energy`` float32 [batch]: reflect-pads one
    sample each side (ONNX Runtime needs samples >= 2 for that) and sums the squares."""
    nodes = [
        helper.make_node("Pad", ["audio", "pads"], ["padded"], mode="reflect"),
        helper.make_node("Mul", ["padded", "padded"], ["squares"]),
        helper.make_node("ReduceSum", ["squares", "one"], ["energy"], keepdims=0),
    ]
    return _model(
        nodes,
        [_value("audio", TensorProto.FLOAT, ["batch", "samples"])],
        [_value("energy", TensorProto.FLOAT, ["batch"])],
        {"pads": np.array([0, 1, 0, 1], np.int64), "one": np.array([1], np.int64)},
    )


AUDIO_TOML = f"[inputs.audio.axes]\nsamples = [{SAMPLES}]\n"


BUCKETS = (4, 8, 12)  # the token lengths the bucketed models' model.toml declares
SEQUENCE_BUCKETS_TOML = f"[inputs.ids.axes]\ntokens = {list(BUCKETS)}\n"  # padding off


def masked_tokens_model() -> bytes:
    """``ids`` int64 [N, tokens] and ``mask`` float32 [N, tokens] -> ``hidden`` float32
    [N, tokens, 4] = table[ids] x mask, and ``pooled`` float32 [N, 4] = the sum of ``hidden``
    over ``tokens`` divided by the sum of the mask: zero-padding (ids 0, mask 0) changes
    neither ``pooled`` nor the unpadded part of ``hidden``, so it may be padded."""
    table = np.random.default_rng(4).standard_normal((20, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"]),
        helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"]),
        helper.make_node("Mul", ["rows", "mask3"], ["hidden"]),
        helper.make_node("ReduceSum", ["hidden", "one"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask", "one"], ["count"], keepdims=1),
        helper.make_node("Div", ["summed", "count"], ["pooled"]),
    ]
    return _model(
        nodes,
        [
            _value("ids", TensorProto.INT64, ["N", "tokens"]),
            _value("mask", TensorProto.FLOAT, ["N", "tokens"]),
        ],
        [
            _value("hidden", TensorProto.FLOAT, ["N", "tokens", 4]),
            _value("pooled", TensorProto.FLOAT, ["N", 4]),
        ],
        {"table": table, "last": np.array([2], np.int64), "one": np.array([1], np.int64)},
    )


MASKED_TOKENS_TOML = f"""pad = true
[inputs.ids.axes]
tokens = {{ min = 1, max = {BUCKETS[-1]}, buckets = {list(BUCKETS)} }}
[inputs.mask.axes]
tokens = {{ min = 1, max = {BUCKETS[-1]}, buckets = {list(BUCKETS)} }}
[outputs.hidden.axes]
tokens = "tokens"
"""
