"""Demo ONNX models built offline with `onnx.helper` and seeded numpy weights.

Every model has a dynamic batch axis ``N`` on its input and its output, float32 throughout,
opset 17. The same seed always gives the same bytes, so generation is idempotent: a file whose
content hash already matches is left alone.

=============  ==================  ===================  ===========  ========================
name           input               output               weights      layers
=============  ==================  ===================  ===========  ========================
``tiny``       ``x`` [N, 16]       ``y`` [N, 4]         ~2.7 KB      Gemm 16x32, Relu,
                                                                     Gemm 32x4
``mlp``        ``x`` [N, 784]      ``logits`` [N, 10]   ~7.5 MB      Gemm 784x1024, Relu,
                                                                     Gemm 1024x1024, Relu,
                                                                     Gemm 1024x10
``resnet-like`` ``image``          ``logits``           ~20.0 MB     3x3 convs, stride-2 stem
               [N, 3, 32, 32]      [N, 1000]                         and downsamplings
                                                                     (32, 64, 128, 256 ch),
                                                                     residual blocks (2 x 64
                                                                     at 8x8, 2 x 128 at 4x4,
                                                                     3 x 256 at 2x2), global
                                                                     average pool, Gemm
                                                                     256x1000
=============  ==================  ===================  ===========  ========================

``mlp`` is Gemm-bound (ONNX Runtime prepacks its weights), ``resnet-like`` conv-bound with
most of its weights in the 256-channel blocks, and ``tiny`` is for fast tests.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
BATCH_AXIS = "N"


class _GraphBuilder:
    """Collects nodes and seeded He-initialised float32 initializers for one graph."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        std = np.sqrt(2.0 / fan_in)
        array = (self.rng.standard_normal(shape) * std).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def bias(self, name: str, size: int) -> str:
        array = (self.rng.standard_normal(size) * 0.01).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: Sequence[str], output: str, **attributes: Any) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attributes))
        return output

    def gemm(self, name: str, x: str, in_features: int, out_features: int) -> str:
        w = self.weight(f"{name}.weight", (out_features, in_features), in_features)
        b = self.bias(f"{name}.bias", out_features)
        return self.node("Gemm", [x, w, b], name, transB=1)

    def conv(self, name: str, x: str, in_ch: int, out_ch: int, stride: int = 1) -> str:
        w = self.weight(f"{name}.weight", (out_ch, in_ch, 3, 3), in_ch * 9)
        b = self.bias(f"{name}.bias", out_ch)
        return self.node(
            "Conv", [x, w, b], name, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride] * 2
        )

    def model(self, name: str, x: onnx.ValueInfoProto, y: onnx.ValueInfoProto) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, [x], [y], self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="clockwork-async demo_models",
            ir_version=IR_VERSION,
        )
        onnx.checker.check_model(model)
        return model


def _tensor(name: str, *shape: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [BATCH_AXIS, *shape])


def _mlp(name: str, seed: int, widths: Sequence[int], output: str) -> onnx.ModelProto:
    builder = _GraphBuilder(seed)
    h = "x"
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        h = builder.gemm(f"fc{index}", h, fan_in, fan_out)
        if index < len(widths) - 2:
            h = builder.node("Relu", [h], f"relu{index}")
    builder.nodes[-1].output[0] = output
    return builder.model(name, _tensor("x", widths[0]), _tensor(output, widths[-1]))


def build_tiny(seed: int = 0) -> onnx.ModelProto:
    """The ``tiny`` model: x [N, 16] -> y [N, 4]."""
    return _mlp("tiny", seed, (16, 32, 4), "y")


def build_mlp(seed: int = 0) -> onnx.ModelProto:
    """The ``mlp`` model: x [N, 784] -> logits [N, 10], ~7.5 MB of weights."""
    return _mlp("mlp", seed, (784, 1024, 1024, 10), "logits")


def build_slow(layers: int = 256, channels: int = 64, size: int = 32) -> onnx.ModelProto:
    """A slow model with one small weight, not a demo model (tests and benchmarks of slow
    registration): x [N, channels, size, size] -> y [N, channels], ``layers`` x (3x3 Conv by
    one shared ``channels`` x ``channels`` kernel, Tanh), then a mean over the image.
    Compute-bound, 147 KB of weights: with the defaults about 0.35-0.6 s a row on one core
    of the 2-vCPU VM. Convolutions, not MatMuls, so that ONNX Runtime registers it without
    timing a prepacked variant (docs/architecture.md): the tests' registrations stay short."""
    builder = _GraphBuilder(0)
    w = builder.weight("w", (channels, channels, 3, 3), 4 * channels * 9)  # tanh stays unsaturated
    # A bias of 0.5 keeps activations near tanh(0.5) whatever the input: never exactly 0 (which
    # runs faster) nor shrinking to denormals (which run far slower), so its time is steady.
    b = "b"
    builder.initializers.append(numpy_helper.from_array(np.full(channels, 0.5, np.float32), b))
    h = "x"
    for index in range(layers):
        conv = builder.node("Conv", [h, w, b], f"c{index}", kernel_shape=[3, 3], pads=[1] * 4)
        h = builder.node("Tanh", [conv], f"t{index}")
    builder.node("ReduceMean", [h], "y", axes=[2, 3], keepdims=0)
    return builder.model("slow", _tensor("x", channels, size, size), _tensor("y", channels))


def _residual_block(builder: _GraphBuilder, name: str, x: str, channels: int) -> str:
    h = builder.node("Relu", [builder.conv(f"{name}.conv1", x, channels, channels)], f"{name}.r1")
    h = builder.conv(f"{name}.conv2", h, channels, channels)
    return builder.node("Relu", [builder.node("Add", [h, x], f"{name}.add")], f"{name}.out")


def build_resnet_like(seed: int = 0) -> onnx.ModelProto:
    """The ``resnet-like`` model: image [N, 3, 32, 32] -> logits [N, 1000], ~20.0 MB."""
    builder = _GraphBuilder(seed)
    h = builder.node("Relu", [builder.conv("stem", "image", 3, 32, stride=2)], "stem.relu")
    in_ch = 32
    for stage, (channels, blocks) in enumerate(((64, 2), (128, 2), (256, 3))):
        h = builder.conv(f"down{stage}", h, in_ch, channels, stride=2)
        h = builder.node("Relu", [h], f"down{stage}.relu")
        for block in range(blocks):
            h = _residual_block(builder, f"stage{stage}.block{block}", h, channels)
        in_ch = channels
    h = builder.node("GlobalAveragePool", [h], "pool")
    h = builder.node("Flatten", [h], "flatten", axis=1)
    h = builder.gemm("fc", h, 256, 1000)
    builder.nodes[-1].output[0] = "logits"
    return builder.model("resnet-like", _tensor("image", 3, 32, 32), _tensor("logits", 1000))


BUILDERS: dict[str, Callable[[int], onnx.ModelProto]] = {
    "tiny": build_tiny,
    "mlp": build_mlp,
    "resnet-like": build_resnet_like,
}


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/clockwork-async/demo-models`` (``~/.cache`` when unset)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "clockwork-async" / "demo-models"


def _sha256_file(path: Path) -> str | None:
    """Hex digest of ``path``'s content, or None if it is not a readable file."""
    try:
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError:
        return None


def _write_if_changed(path: Path, content: bytes) -> None:
    """Write ``content`` atomically unless ``path`` already holds exactly it."""
    if _sha256_file(path) == hashlib.sha256(content).hexdigest():
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(content)
    os.replace(temporary, path)


def generate_demo_models(
    directory: Path, *, seed: int = 0, names: Iterable[str] | None = None
) -> dict[str, Path]:
    """Write the demo models (all, or those in ``names``) as ``<name>.onnx`` in ``directory``,
    leaving files whose content already matches. Returns name -> path. Raises KeyError for an
    unknown name, OSError if the directory cannot be written."""
    chosen = list(BUILDERS) if names is None else list(names)
    unknown = [name for name in chosen if name not in BUILDERS]
    if unknown:
        raise KeyError(f"unknown demo model(s) {unknown}; known: {sorted(BUILDERS)}")
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name in chosen:
        path = directory / f"{name}.onnx"
        _write_if_changed(path, BUILDERS[name](seed).SerializeToString())
        paths[name] = path
    return paths


def main(argv: Sequence[str]) -> int:
    """`clockwork-async demo-models [--out DIR] [--seed N] [--only NAME ...]`: prints the
    paths written. Returns 0, or 2 for an unknown model name."""
    parser = argparse.ArgumentParser(prog="clockwork-async demo-models", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", type=Path, default=default_directory(), help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"some of {sorted(BUILDERS)}")
    args = parser.parse_args(list(argv))
    try:
        paths = generate_demo_models(args.out, seed=args.seed, names=args.only)
    except KeyError as error:
        parser.print_usage()
        print(f"clockwork-async demo-models: {error.args[0]}")
        return 2
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0
