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
- REGISTER is `ort_cuda_register` (optimise for this device, pinned images, one probe run
  per batch size on its own stream); in "inputs" mode the backend then creates the serving
  session (on the execute stream, cuDNN's exhaustive algorithm search at each batch size's
  first INFER: the profiler's warm-up runs pay it).
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

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The installed library, not the sibling module of the same name.
import onnxruntime as ort

from clockwork_async.wire.messages import ErrorCode, TensorSpec

from .backend import BackendError, PageRun, RegisteredModel
from .cuda_arena import CudaUnavailable, plan_pools
from .device_ops import DeviceOps, buffer_address, open_cuda
from .model_registry import ModelFiles, ModelRegistry
from .onnxruntime import ort_error
from .ort_binding import IoLayout
from .ort_cuda_register import (
    WEIGHTS_MODES,
    BoundRegistered,
    BoundRegistrar,
    WeightsMode,
    bound_session,
)
from .ort_graph import PLACEHOLDER_NAME

# INFER's marks: before copy-in, after it, before the run, after it, after copy-out.
GPU_PHASE_MARKS = {"copy_in_gpu": (0, 1), "execute_gpu": (2, 3), "copy_out_gpu": (3, 4)}


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
        self._files = ModelFiles(
            work_dir, prefix="clockwork-onnxruntime-io-", placeholders=(PLACEHOLDER_NAME,)
        )
        self.work_dir = self._files.path
        self._registrar = BoundRegistrar(
            ops, self._files, self.arena.page_bytes, io_bytes, workspace_bytes, weights_mode
        )
        self._registered = ModelRegistry(BoundRegistered)

    def device_clock_mhz(self) -> int:
        """The device's SM clock now (0 where it cannot be read)."""
        return self._ops.clock_mhz()

    def _session(
        self, path: Path, *, exhaustive: bool, initializers: Mapping[str, Any] | None = None
    ) -> ort.InferenceSession:
        """A session of ``path`` on the execute stream."""
        return bound_session(
            self._ops,
            self.workspace_bytes,
            path,
            self._execute_stream,
            exhaustive=exhaustive,
            initializers=initializers,
        )

    # Registration.

    def register(
        self,
        name: str,
        path: str,
        batch_sizes: Sequence[int],
        inputs: Sequence[TensorSpec] = (),
    ) -> BoundRegistered:
        """Register the model at ``path`` (`ort_cuda_register`); in "inputs" mode also create
        its one serving session. Returns the registered model. Raises BackendError(BAD_MODEL)."""
        model = self._registrar.register(name, path, batch_sizes, inputs)
        if self.weights_mode == "inputs":
            try:
                model.session = self._session(model.graph_path, exhaustive=True)
            except BaseException:
                for file in model.files():
                    file.unlink(missing_ok=True)
                raise
        self._registered.add(model)
        return model

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
                registered.placeholder_path, exhaustive=False, initializers=values
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
