"""The IO-bound ONNX Runtime backend: ``--backend onnxruntime --device cuda:N``.

Weights live in the executor's preallocated device pages and ONNX Runtime reads them there:
nothing is copied but the LOAD itself (pinned host image -> pages) and each INFER's inputs and
outputs (pinned staging <-> the preallocated IO buffer). How weights reach a session is
``weights_mode`` (docs/architecture.md, "GPU backend", has the sources and the trade-off):

- ``"inputs"`` (default): at REGISTER the optimised graph's weights become graph inputs and
  one session is created for the model's lifetime. LOAD copies the weights into pages and
  binds every weight input to its page address (``IOBinding.bind_input``): a LOAD is the
  copy plus one bind per tensor, no session creation.
- ``"initializers"``: the weights stay initializers whose data is a placeholder; LOAD copies
  them into pages and creates a session with ``add_initializer(name, OrtValue)``, each value
  an ``OrtValue.from_dlpack`` over its pages, which ONNX Runtime uses in place when it lives
  on the device the kernel runs on. A LOAD pays a session creation.

Invariants:
- Device memory is the `DeviceOps` pools made at start (`cuda_arena`: weights pages, one IO
  buffer) plus ONNX Runtime's capped per-session arena; host images of registered weights are
  pinned and kept from REGISTER to UNREGISTER; one pinned staging buffer as large as the IO
  buffer carries every INFER's bytes.
- REGISTER optimises the model once for this device (``ORT_ENABLE_EXTENDED``, else
  ``ORT_ENABLE_BASIC``), then runs every batch size once in a throwaway session with the
  weights bound from host memory, on its own stream: the graph must run, and the exact output
  shapes fix each batch size's `IoLayout`. In "inputs" mode it then creates the serving
  session (on the execute stream, cuDNN's exhaustive algorithm search at each batch size's
  first INFER: the profiler's warm-up runs pay it).
  A batch size whose IO does not fit the IO buffer is dropped from the defaults, or is
  BAD_MODEL when asked for; models with dynamic non-batch input axes are BAD_MODEL.
- LOAD copies on the load stream, INFER on the execute stream (ONNX Runtime's compute stream
  too), so a LOAD never waits for an INFER nor delays one beyond the shared PCIe link. Each
  phase ends synchronized: ``durations_ns`` are host clock (``load``; ``copy_in``,
  ``execute``, ``copy_out``), and on CUDA also the CUDA-event times of the same phases
  (``load_gpu``, ``copy_in_gpu``, ``execute_gpu``, ``copy_out_gpu``).
- Only the execute lane runs INFER, so one INFER at a time owns the IO buffer and staging.
- UNLOAD drops the binding (and in "initializers" mode the session and its OrtValues):
  nothing can read the pages afterwards; the handle then answers NOT_LOADED.
- Registered models and their files are kept by `model_registry` (shared by every backend):
  a model this backend did not register is UNKNOWN_MODEL.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

# The installed library, not the sibling module of the same name.
import onnxruntime as ort

from clockwork_async.wire.messages import ErrorCode, TensorSpec

from . import ort_graph
from .arena import layout_tensors
from .backend import BackendError, PageRun, RegisteredModel
from .cuda_arena import CudaUnavailable, plan_pools
from .device_ops import DeviceOps, buffer_address, open_cuda
from .model_registry import ModelFiles, ModelRegistry
from .onnxruntime import HostTensor, example_feeds, host_run_images, ort_error, session_options
from .ort_binding import (
    IoLayout,
    io_layout,
    split_weights,
    weights_as_inputs,
    weights_as_placeholders,
)
from .ort_graph import PLACEHOLDER_NAME

WeightsMode = Literal["inputs", "initializers"]
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("inputs", "initializers")
# Graph optimisation at REGISTER, tried in order (the second if a level cannot be saved).
OPTIMISATION_LEVELS = (
    ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
)
# INFER's marks: before copy-in, after it, before the run, after it, after copy-out.
GPU_PHASE_MARKS = {"copy_in_gpu": (0, 1), "execute_gpu": (2, 3), "copy_out_gpu": (3, 4)}


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


@dataclass(eq=False, slots=True)
class BoundLoaded:
    """A loaded model; ``binding`` is None once unloaded."""

    model: RegisteredModel
    registered: BoundRegistered
    runs: tuple[PageRun, ...]
    session: ort.InferenceSession | None
    binding: Any  # ort.IOBinding with every weight bound ("inputs") or none ("initializers")
    addresses: dict[str, int]  # weight name -> its address in the pages
    values: dict[str, Any] = field(default_factory=dict)  # "initializers": OrtValues over pages


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


def ortvalue_over(view: Any) -> Any:
    """An OrtValue sharing the memory of a numpy or CuPy array (DLPack, no copy). Raises
    BackendError(INTERNAL) on an onnxruntime without ``OrtValue.from_dlpack``."""
    from_dlpack = getattr(ort.OrtValue, "from_dlpack", None)
    if from_dlpack is None:
        raise BackendError(
            ErrorCode.INTERNAL,
            f"onnxruntime {ort.__version__} has no OrtValue.from_dlpack: use --cuda-weights inputs",
        )
    return from_dlpack(view)


class BoundOrtBackend:
    """`backend.Backend` over ONNX Runtime with IO binding into preallocated pools (module
    header). ``ops`` chooses the device: `device_ops.CudaOps` or `device_ops.HostOps`."""

    name: str = "onnxruntime"
    lanes: tuple[str, ...] = ("load", "execute")

    def __init__(
        self,
        ops: DeviceOps,
        *,
        page_bytes: int,
        pages_total: int,
        io_bytes: int,
        workspace_bytes: int,
        weights_mode: WeightsMode = "inputs",
        work_dir: str | None = None,
    ) -> None:
        if weights_mode not in WEIGHTS_MODES:
            raise ValueError(f"weights_mode must be one of {WEIGHTS_MODES}, got {weights_mode!r}")
        self._ops = ops
        self.device = ops.device
        self.weights_mode: WeightsMode = weights_mode
        self.workspace_bytes = workspace_bytes
        self.io_bytes = io_bytes
        self.kind = f"onnxruntime-{ort.__version__}-{ops.kind}-{weights_mode}"
        self.arena: Any = ops.arena(page_bytes, pages_total)
        self._io, self._io_address = ops.io_buffer(io_bytes)
        self._staging = ops.host_array(io_bytes)
        self._load_stream = ops.new_stream()
        self._execute_stream = ops.new_stream()
        self._register_stream = ops.new_stream()
        self._files = ModelFiles(
            work_dir, prefix="clockwork-onnxruntime-io-", placeholders=(PLACEHOLDER_NAME,)
        )
        self.work_dir = self._files.path
        self._registered = ModelRegistry(BoundRegistered)

    def device_clock_mhz(self) -> int:
        """The device's SM clock now (0 where it cannot be read)."""
        return self._ops.clock_mhz()

    # Sessions.

    def _session(
        self,
        path: Path,
        stream: Any,
        *,
        exhaustive: bool,
        initializers: Mapping[str, Any] | None = None,
    ) -> ort.InferenceSession:
        options = session_options(1, prepack=False)
        for tensor_name, value in (initializers or {}).items():
            options.add_initializer(tensor_name, value)
        providers = self._ops.providers(stream, self.workspace_bytes, exhaustive=exhaustive)
        with self._ops.activate():
            return ort.InferenceSession(str(path), options, providers=providers)

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

    # Registration.

    def register(self, name: str, path: str, batch_sizes: Sequence[int]) -> BoundRegistered:
        """Optimise, split and lay out the model at ``path``; run each batch size once.
        Returns the registered model. Raises BackendError(BAD_MODEL)."""
        source = ort_graph.read_model(path)
        inputs, outputs = ort_graph.graph_specs(source, path)
        batches = ort_graph.batch_sizes(inputs + outputs, batch_sizes, path)
        _bad_input_shape(inputs, path)
        del source
        stem = self._files.stem(name)
        graph = self._optimise(path, self.work_dir / f"{stem}.optimised.onnx")
        model = self._prepare(name, graph, stem, inputs, outputs)
        try:
            model.layouts = self._probe(model, batches, bool(batch_sizes), path)
            model.batch_sizes = tuple(sorted(model.layouts))
            if self.weights_mode == "inputs":
                model.session = self._session(
                    model.graph_path, self._execute_stream, exhaustive=True
                )
        except BaseException:
            for file in model.files():
                file.unlink(missing_ok=True)
            raise
        self._registered.add(model)
        return model

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
            [array.nbytes for _, array in weights], self.arena.page_bytes
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
            placeholder_path = self.work_dir / f"{stem}.placeholders.onnx"
            onnx.save(placeholder, str(placeholder_path))
        weights_as_inputs(graph, names)
        graph_path = self.work_dir / f"{stem}.onnx"
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
            session = self._session(model.graph_path, self._register_stream, exhaustive=False)
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

    def unregister(self, model: RegisteredModel) -> None:
        """Forget ``model``: its session, pinned images and files. Raises UNKNOWN_MODEL."""
        registered = self._registered.remove(model)
        registered.session = None
        for file in registered.files():
            file.unlink(missing_ok=True)

    # LOAD and UNLOAD.

    def load(
        self, model: RegisteredModel, runs: Sequence[PageRun]
    ) -> tuple[BoundLoaded, dict[str, int]]:
        """Copy the weights into ``runs`` and bind them. Returns the loaded model and
        {"load": ns} (plus "load_gpu" on CUDA). Raises BackendError (UNKNOWN_MODEL, INTERNAL)."""
        registered = self._registered.own(model)
        if tuple(run.count for run in runs) != registered.run_pages:
            raise BackendError(
                ErrorCode.INTERNAL,
                f"model {model.name!r} needs runs of {registered.run_pages} pages, "
                f"got {[run.count for run in runs]}",
            )
        ops, stream = self._ops, self._load_stream
        with ops.activate():
            start_ns = time.monotonic_ns()
            views = [self.arena.view(run) for run in runs]
            first = ops.mark(stream)
            for view, image in zip(views, registered.images, strict=True):
                ops.copy_to_device(buffer_address(view), image, stream)
            last = ops.mark(stream)
            ops.synchronize(stream)
            try:
                loaded = self._bind_weights(registered, tuple(runs), views)
            except Exception as error:
                raise ort_error(f"bind the weights of {model.name!r}", error) from error
            end_ns = time.monotonic_ns()
        durations = {"load": end_ns - start_ns}
        if ops.ort_device != "cpu":
            durations["load_gpu"] = ops.elapsed_ns(first, last)
        return loaded, durations

    def _bind_weights(
        self, registered: BoundRegistered, runs: tuple[PageRun, ...], views: Sequence[Any]
    ) -> BoundLoaded:
        """The loaded model over ``views`` (the runs' pages, weights already copied)."""
        addresses: dict[str, int] = {}
        values: dict[str, Any] = {}
        for tensor in registered.tensors:
            offset = tensor.placement.offset_bytes
            page_bytes = views[tensor.placement.run_index][offset : offset + tensor.array.nbytes]
            addresses[tensor.name] = buffer_address(page_bytes)
            if self.weights_mode == "initializers":
                typed = page_bytes.view(tensor.array.dtype).reshape(tensor.array.shape)
                values[tensor.name] = ortvalue_over(typed)
        if self.weights_mode == "initializers":
            assert registered.placeholder_path is not None
            session = self._session(
                registered.placeholder_path,
                self._execute_stream,
                exhaustive=False,
                initializers=values,
            )
            return BoundLoaded(
                registered, registered, runs, session, session.io_binding(), addresses, values
            )
        session = registered.session
        assert session is not None
        binding = session.io_binding()
        device, device_id = self._ops.ort_device, self._ops.device_id
        for tensor in registered.tensors:
            shape = list(tensor.array.shape)
            address = addresses[tensor.name]
            binding.bind_input(tensor.name, device, device_id, tensor.array.dtype, shape, address)
        return BoundLoaded(registered, registered, runs, session, binding, addresses)

    def _live(self, loaded: Any) -> tuple[BoundLoaded, ort.InferenceSession, Any]:
        if not isinstance(loaded, BoundLoaded) or loaded.binding is None or loaded.session is None:
            name = getattr(getattr(loaded, "model", None), "name", "?")
            raise BackendError(
                ErrorCode.NOT_LOADED, f"model {name!r} is not loaded (this handle was unloaded)"
            )
        return loaded, loaded.session, loaded.binding

    def unload(self, loaded: Any) -> None:
        """Drop what can read the pages. Raises BackendError(NOT_LOADED) when unloaded."""
        handle, _, _ = self._live(loaded)
        handle.binding = None
        handle.session = None
        handle.values.clear()

    # INFER.

    def infer(
        self, loaded: Any, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Run one batch through the IO buffer. Returns outputs (copies owned by the caller)
        and ns durations of copy_in, execute and copy_out (plus ``*_gpu`` on CUDA). Raises
        BackendError (NOT_LOADED, BAD_INPUT, INTERNAL)."""
        handle, session, binding = self._live(loaded)
        layout = handle.registered.layouts.get(batch_size)
        if layout is None:
            raise BackendError(
                ErrorCode.BAD_INPUT,
                f"batch size {batch_size} is not served for {handle.registered.name!r}",
            )
        ops, stream = self._ops, self._execute_stream
        with ops.activate():
            start_ns = time.monotonic_ns()
            marks = [self._copy_in(layout, inputs, stream)]
            marks.append(ops.mark(stream))
            ops.synchronize(stream)
            copied_in_ns = time.monotonic_ns()
            self._bind_io(binding, layout)
            marks.append(ops.mark(stream))
            try:
                session.run_with_iobinding(binding)
            except Exception as error:
                raise ort_error(f"run {handle.registered.name!r}", error) from error
            marks.append(ops.mark(stream))
            ops.synchronize(stream)
            executed_ns = time.monotonic_ns()
            outputs = self._copy_out(layout, stream, marks)
            end_ns = time.monotonic_ns()
        durations = {
            "copy_in": copied_in_ns - start_ns,
            "execute": executed_ns - copied_in_ns,
            "copy_out": end_ns - executed_ns,
        }
        if ops.ort_device != "cpu":
            for phase, (first, last) in GPU_PHASE_MARKS.items():
                durations[phase] = ops.elapsed_ns(marks[first], marks[last])
        return outputs, durations

    def _copy_in(self, layout: IoLayout, inputs: Mapping[str, np.ndarray], stream: Any) -> Any:
        """Stage every input and enqueue one copy into the IO buffer; returns the mark
        before that copy."""
        for slot in layout.inputs:
            array = np.ascontiguousarray(inputs[slot.name])
            if array.nbytes != slot.nbytes:
                raise BackendError(
                    ErrorCode.BAD_INPUT,
                    f"input {slot.name!r} has {array.nbytes} bytes, expected {slot.nbytes}",
                )
            target = self._staging[slot.offset_bytes : slot.offset_bytes + slot.nbytes]
            target[:] = array.reshape(-1).view(np.uint8)
        mark = self._ops.mark(stream)
        self._ops.copy_to_device(self._io_address, self._staging[: layout.inputs_bytes], stream)
        return mark

    def _bind_io(self, binding: Any, layout: IoLayout) -> None:
        device, device_id, base = self._ops.ort_device, self._ops.device_id, self._io_address
        for slot in layout.inputs:
            dtype = np.dtype(slot.dtype)
            binding.bind_input(
                slot.name, device, device_id, dtype, list(slot.shape), base + slot.offset_bytes
            )
        for slot in layout.outputs:
            dtype = np.dtype(slot.dtype)
            binding.bind_output(
                slot.name, device, device_id, dtype, list(slot.shape), base + slot.offset_bytes
            )

    def _copy_out(self, layout: IoLayout, stream: Any, marks: list[Any]) -> dict[str, np.ndarray]:
        """Copy the outputs back into staging (appending the mark after that copy to
        ``marks``) and return caller-owned copies."""
        start = layout.outputs_offset
        self._ops.copy_to_host(
            self._staging[start : layout.total_bytes], self._io_address + start, stream
        )
        marks.append(self._ops.mark(stream))
        self._ops.synchronize(stream)
        return {
            slot.name: self._staging[slot.offset_bytes : slot.offset_bytes + slot.nbytes]
            .view(slot.dtype)
            .reshape(slot.shape)
            .copy()
            for slot in layout.outputs
        }

    def close(self) -> None:
        """Forget every model, delete the files this backend wrote, drop the pools."""
        for model in self._registered.clear():
            model.session = None
            for file in model.files():
                file.unlink(missing_ok=True)
        self._files.close()
        self.arena.close()
        self._io = None
        self._ops.close()


def make_cuda_backend(
    device: str,
    *,
    page_bytes: int,
    weights_bytes: int,
    io_bytes: int,
    workspace_bytes: int,
    weights_mode: WeightsMode = "inputs",
) -> BoundOrtBackend:
    """The backend on ``device`` (``cuda:N``), its pools checked against the free device memory
    and allocated now. Raises CudaUnavailable (named reason) or ValueError (bad geometry)."""
    ops = open_cuda(device)
    plan = plan_pools(page_bytes, weights_bytes, io_bytes, workspace_bytes, ops.free_bytes())
    try:
        return BoundOrtBackend(
            ops,
            page_bytes=plan.page_bytes,
            pages_total=plan.pages_total,
            io_bytes=plan.io_bytes,
            workspace_bytes=workspace_bytes,
            weights_mode=weights_mode,
        )
    except (BackendError, ValueError):
        raise
    except Exception as error:  # CuPy's allocation and runtime errors
        raise CudaUnavailable(f"cannot allocate the pools on {device}: {error}") from error
