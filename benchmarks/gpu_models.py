"""Models generated for the GPU check (nothing downloaded): `build_big_mlp`, about 100 MB of
float32 weights in three Gemm layers (1024 -> 4096 -> 4096 -> 1024, Relu between), a dynamic
batch axis ``N``, seeded so the same seed gives the same bytes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

BIG_MLP_WIDTHS = (1024, 4096, 4096, 1024)  # 25.2 M parameters: 100.7 MB of float32


def build_big_mlp(widths: Sequence[int] = BIG_MLP_WIDTHS, seed: int = 0) -> onnx.ModelProto:
    """x [N, widths[0]] -> y [N, widths[-1]]: Gemm (transB) layers with Relu between."""
    rng = np.random.default_rng(seed)
    nodes, initializers, h = [], [], "x"
    layers = list(itertools.pairwise(widths))
    for index, (fan_in, fan_out) in enumerate(layers):
        weight = rng.standard_normal((fan_out, fan_in), np.float32) * np.sqrt(2.0 / fan_in)
        bias = rng.standard_normal(fan_out, np.float32) * np.float32(0.01)
        initializers += [
            numpy_helper.from_array(weight.astype(np.float32), f"fc{index}.weight"),
            numpy_helper.from_array(bias.astype(np.float32), f"fc{index}.bias"),
        ]
        out = "y" if index == len(layers) - 1 else f"fc{index}"
        inputs = [h, f"fc{index}.weight", f"fc{index}.bias"]
        nodes.append(helper.make_node("Gemm", inputs, [out], name=f"fc{index}", transB=1))
        if out != "y":
            h = f"relu{index}"
            nodes.append(helper.make_node("Relu", [out], [h], name=h))
    graph = helper.make_graph(
        nodes,
        "mlp-100mb",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", widths[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", widths[-1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model
