"""REGISTER for the IO-bound ONNX Runtime backend (`onnxruntime_cuda`): from a model file to a
`BoundRegistered`, its graphs on disk, its weights in pinned host images, one IO layout per
batch size.

Invariants:
- The model is optimised once for this device (``ORT_ENABLE_EXTENDED``, else
  ``ORT_ENABLE_BASIC``), its arena weights split off (`ort_binding.split_weights`) into
  pinned run images laid out as in their pages, and its graph written with the weights as
  inputs (and, in "initializers" mode, as placeholder initializers too).
- Every batch size runs once in a throwaway session with the weights bound from host memory,
  on the register stream (never the load or execute stream): the graph must run, and the exact
  output shapes fix each batch size's `IoLayout`. A batch size whose IO does not fit the IO
  buffer is dropped from the defaults, or is BAD_MODEL when asked for; models with dynamic
  non-batch input axes are BAD_MODEL.
- A registration that fails raises BackendError(BAD_MODEL) and leaves no file behind.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

# The installed library, not the sibling module of the same name.
import onnxruntime as ort

from clockwork_async.wire.messages import TensorSpec

from . import ort_graph
from .arena import layout_tensors
from .device_ops import DeviceOps
from .model_registry import ModelFiles
from .onnxruntime import HostTensor, example_feeds, host_run_images, session_options
from .ort_binding import (
    IoLayout,
    io_layout,
    split_weights,
    weights_as_inputs,
    weights_as_placeholders,
)

WeightsMode = Literal["inputs", "initializers"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("inputs", "initializers")
# Graph optimisation at REGISTER, tried in order (the second if a level cannot be saved).
OPTIMISATION_LEVELS = (
    ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
)


@dataclass(eq=False, slots=True)
class BoundRegistered:
    """A registered model: its graphs on disk, its weights in pinned host images."""

    name: str
    weights_bytes: int
    run_pages: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]
    graph_path: Path  # weights as graph inputs
    placeholder_path: Path | None  # weights as placeholder initializers ("initializers")
    tensors: tuple[HostTensor, ...]
    images: tuple[np.ndarray, ...]
    inline_bytes: int
    layouts: dict[int, IoLayout] = field(default_factory=dict)
    session: ort.InferenceSession | None = None  # "inputs": the model's one session

    def files(self) -> list[Path]:
        return [p for p in (self.graph_path, self.placeholder_path) if p is not None]


def _bad_input_shape(specs: Sequence[TensorSpec], path: str) -> None:
    for spec in specs:
        if any(dim == -1 for dim in spec.shape[1:]):
            raise ort_graph.bad_model(
                path,
                f"input {spec.name!r} has a dynamic axis after the batch axis {spec.shape};"
                " the IO-bound backend needs every other axis fixed",
            )


def _shape_at(spec: TensorSpec, batch_size: int) -> tuple[int, ...]:
    return tuple(batch_size if dim == -1 else dim for dim in spec.shape)


def bound_session(
    ops: DeviceOps,
    workspace_bytes: int,
    path: Path,
    stream: Any,
    *,
    exhaustive: bool,
    initializers: Mapping[str, Any] | None = None,
) -> ort.InferenceSession:
    """A session of the graph at ``path`` on ``stream`` of ``ops``'s device, ONNX Runtime's
    arena capped at ``workspace_bytes``, with ``initializers`` (OrtValues) added."""
    options = session_options(1, prepack=False)
    for tensor_name, value in (initializers or {}).items():
        options.add_initializer(tensor_name, value)
    providers = ops.providers(stream, workspace_bytes, exhaustive=exhaustive)
    with ops.activate():
        return ort.InferenceSession(str(path), options, providers=providers)


class BoundRegistrar:
    """Registers models for one `BoundOrtBackend` (module header), on its own stream."""

    def __init__(
        self,
        ops: DeviceOps,
        files: ModelFiles,
        page_bytes: int,
        io_bytes: int,
        workspace_bytes: int,
        weights_mode: WeightsMode,
    ) -> None:
        self._ops = ops
        self._files = files
        self._page_bytes = page_bytes
        self.io_bytes = io_bytes
        self.workspace_bytes = workspace_bytes
        self.weights_mode = weights_mode
        self._register_stream = ops.new_stream()

    def register(
        self,
        name: str,
        path: str,
        batch_sizes: Sequence[int],
        inputs: Sequence[TensorSpec] = (),
    ) -> BoundRegistered:
        """Optimise, split and lay out the model at ``path`` (its inputs at the declared
        ``inputs`` shapes); run each batch size once. Returns the registered model (no serving
        session yet). Raises BackendError(BAD_MODEL)."""
        source = ort_graph.read_model(path)
        inputs, outputs = ort_graph.graph_specs(source, path, inputs)
        batches = ort_graph.batch_sizes(inputs + outputs, batch_sizes, path)
        _bad_input_shape(inputs, path)
        del source
        stem = self._files.stem(name)
        graph = self._optimise(path, self._files.path / f"{stem}.optimised.onnx")
        model = self._prepare(name, graph, stem, inputs, outputs)
        try:
            model.layouts = self._probe(model, batches, bool(batch_sizes), path)
            model.batch_sizes = tuple(sorted(model.layouts))
        except BaseException:
            for file in model.files():
                file.unlink(missing_ok=True)
            raise
        return model

    def _session(self, path: Path) -> ort.InferenceSession:
        return bound_session(
            self._ops, self.workspace_bytes, path, self._register_stream, exhaustive=False
        )

    def _optimise(self, path: str, optimised_path: Path) -> onnx.ModelProto:
        """ONNX Runtime's graph of ``path`` optimised for this device: ``OPTIMISATION_LEVELS``
        in order, the first that saves. Raises BAD_MODEL."""
        providers = self._ops.providers(
            self._register_stream, self.workspace_bytes, exhaustive=False
        )
        errors = []
        for level in OPTIMISATION_LEVELS:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.optimized_model_filepath = str(optimised_path)
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            try:
                with self._ops.activate():
                    ort.InferenceSession(path, options, providers=providers)
                return onnx.load(str(optimised_path))
            except Exception as error:  # ONNX Runtime raises its own hierarchy of pybind errors
                errors.append(f"{level.name}: {error}")
            finally:
                optimised_path.unlink(missing_ok=True)
        raise ort_graph.bad_model(path, f"ONNX Runtime cannot load it ({'; '.join(errors)})")

    def _prepare(
        self,
        name: str,
        graph: onnx.ModelProto,
        stem: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
    ) -> BoundRegistered:
        """Split the weights into pinned run images and write the graphs."""
        weights, inline_bytes = split_weights(graph)
        run_pages, placements = layout_tensors(
            [array.nbytes for _, array in weights], self._page_bytes
        )
        with self._ops.activate():
            images, tensors = host_run_images(
                weights, placements, len(run_pages), allocate=self._ops.host_array
            )
        names = [weight_name for weight_name, _ in weights]
        del weights
        placeholder_path = None
        if self.weights_mode == "initializers":
            placeholder = copy.deepcopy(graph)
            weights_as_placeholders(placeholder, names)
            placeholder_path = self._files.path / f"{stem}.placeholders.onnx"
            onnx.save(placeholder, str(placeholder_path))
        weights_as_inputs(graph, names)
        graph_path = self._files.path / f"{stem}.onnx"
        onnx.save(graph, str(graph_path))
        return BoundRegistered(
            name=name,
            weights_bytes=sum(tensor.array.nbytes for tensor in tensors),
            run_pages=run_pages,
            inputs=inputs,
            outputs=outputs,
            batch_sizes=(),
            graph_path=graph_path,
            placeholder_path=placeholder_path,
            tensors=tensors,
            images=images,
            inline_bytes=inline_bytes,
        )

    def _probe(
        self, model: BoundRegistered, batches: Sequence[int], requested: bool, path: str
    ) -> dict[int, IoLayout]:
        """Run each batch size once with the weights bound from host memory; returns the IO
        layout of each batch size that fits the IO buffer. Raises BAD_MODEL."""
        try:
            session = self._session(model.graph_path)
            binding = session.io_binding()
            for tensor in model.tensors:
                binding.bind_cpu_input(tensor.name, tensor.array)
        except Exception as error:
            raise ort_graph.bad_model(
                path, f"its IO-bound graph does not load ({error})"
            ) from error
        layouts: dict[int, IoLayout] = {}
        for batch_size in batches:
            shapes = self._probe_run(session, binding, model, batch_size, path)
            layout = io_layout(
                [(s.name, s.dtype, _shape_at(s, batch_size)) for s in model.inputs],
                [(s.name, s.dtype, shape) for s, shape in zip(model.outputs, shapes, strict=True)],
            )
            if layout.total_bytes <= self.io_bytes:
                layouts[batch_size] = layout
            elif requested:
                raise ort_graph.bad_model(path, self._io_too_small(batch_size, layout))
        if not layouts:
            raise ort_graph.bad_model(path, self._io_too_small(min(batches), layout))
        return layouts

    def _probe_run(
        self,
        session: ort.InferenceSession,
        binding: Any,
        model: BoundRegistered,
        batch_size: int,
        path: str,
    ) -> list[tuple[int, ...]]:
        """Output shapes of one run at ``batch_size``. Raises BAD_MODEL."""
        feeds = example_feeds(model.inputs, batch_size)
        try:
            for input_name, array in feeds.items():
                binding.bind_cpu_input(input_name, array)
            for spec in model.outputs:
                binding.bind_output(spec.name, self._ops.ort_device, self._ops.device_id)
            with self._ops.activate():
                session.run_with_iobinding(binding)
            shapes = [tuple(value.shape()) for value in binding.get_outputs()]
            binding.clear_binding_outputs()
        except Exception as error:
            raise ort_graph.bad_model(path, f"its IO-bound graph does not run ({error})") from error
        return shapes

    def _io_too_small(self, batch_size: int, layout: IoLayout) -> str:
        return (
            f"batch size {batch_size} needs {layout.total_bytes} bytes of IO buffer; the "
            f"executor has {self.io_bytes} (--io-bytes)"
        )
