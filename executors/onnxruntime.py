"""The ONNX Runtime (CPU) backend: sessions whose weights live in the arena pages, unmoved.

One idea: the CPU backend of the `Backend` protocol; the helpers here (host images, session
options, example feeds, the prepacking measurement) exist for its REGISTER and LOAD, and the
IO-bound backend reuses them.

Recipe (measured in /work/shared/MACHINE-NOTES.md and re-checked by the tests):

- REGISTER optimises the model once with ONNX Runtime (``ORT_ENABLE_ALL``, on this CPU; the
  saved graph may hold CPU-specific NCHWc kernels, which is fine because the executor that
  optimises it is the one that runs it). The weights of the optimised graph are read into host
  memory as numpy arrays (the host side of the cache) and stripped out of the graph, which
  then points at an empty placeholder file for them (`ort_graph`: float and small-integer
  weights move; int32/int64 shape constants stay inline, counted as ``inline_bytes``).
- The stripped tensors are laid out into page runs by `arena.layout_tensors` (a tensor larger
  than a page owns a contiguous run; smaller ones are packed 64-byte aligned); the model's
  ``run_pages`` lists the runs a LOAD needs.
- LOAD copies the weights into the arena views the host hands it, wraps each tensor's view in
  an ``OrtValue`` (no copy) and creates a session from the stripped graph with
  ``SessionOptions.add_initializer`` for every tensor, ``ORT_DISABLE_ALL`` (already optimised),
  sequential execution, ``intra_op_num_threads`` as configured and intra-op spinning off.
- UNLOAD drops the session and every ``OrtValue``: nothing can read the pages afterwards; the
  handle then refuses to run (NOT_LOADED).
- Registered models and their files are kept by `model_registry` (shared by every backend):
  a model this backend did not register is UNKNOWN_MODEL.

Prepacking. With prepacking on, ONNX Runtime copies the B operand of Gemm/MatMul out of the
arena into its own packed buffers (checked: perturbing the arena then changes nothing for those
tensors, while NCHWc convolution weights stay in place). With it off, every weight stays in the
arena but Gemm-heavy models run slower. Each model is measured at registration: both variants
run the largest batch (2 warm-up runs, then 5 alternating timed runs, medians), and prepacking
is chosen when it is at least ``PREPACK_MIN_SPEEDUP`` (1.10x) faster. A slow model (its first
check run, at the smallest batch, took over ``SLOW_CHECK_NS``) is measured at the smallest batch
with one warm-up and two timed runs instead, so that registering it takes a few runs of a row,
not fourteen of the largest batch; a model with nothing to measure runs that check alone. The
packed copy then counts as ``extra_host_bytes`` (estimated as the bytes of those B operands;
MLAS packs them to about the same size). Models with no such operand skip the measurement and
keep prepacking off. Measured on the 2-vCPU EPYC VM (pinned, machine shared, noisy): demo
``mlp`` (7.5 MB) b16 0.59-0.85 ms in place vs 0.30-0.73 ms prepacked, b1 0.12-0.16 vs 0.11-0.15
ms; registration chose prepacking (+7.4 MB), at the price of LOAD 2.8 ms instead of 0.6 ms
(memcpy 0.13-0.18 ms) because ONNX Runtime repacks at every session creation. ``resnet-like``
(19.7 MB, conv-bound) keeps its weights in place: LOAD 1.6-2.7 ms (memcpy floor 0.7-1.1 ms).
Details and the table are in docs/architecture.md ("ONNX Runtime backend: weights in the
arena").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

# The installed library, not this module: absolute imports never resolve to a sibling. (ruff
# sorts it as first-party only because executors/ is one of its source roots.)
import onnxruntime as ort

from clockwork_async.core.percentile import percentile_of
from clockwork_async.wire.messages import ErrorCode, TensorSpec

from . import ort_graph
from .arena import TensorPlacement, layout_tensors
from .backend import Arena, BackendError, PageRun, RegisteredModel
from .model_registry import ModelFiles, ModelRegistry
from .ort_graph import DEFAULT_BATCH_SIZES as DEFAULT_BATCH_SIZES
from .ort_graph import PLACEHOLDER_NAME

PREPACK_MIN_SPEEDUP = 1.10
PREPACK_WARMUP_RUNS = 2
PREPACK_TIMED_RUNS = 5
SLOW_CHECK_NS = 50_000_000  # a first run slower than this: measure little (registration's cost)
Prepacking = Literal["measure", "on", "off"]


@dataclass(frozen=True, slots=True)
class HostTensor:
    """One stripped weight: its host copy and where it goes in the model's page runs."""

    name: str
    array: np.ndarray  # a typed view into the host image of its run
    placement: TensorPlacement


def _zeroed_bytes(size_bytes: int) -> np.ndarray:
    return np.zeros(size_bytes, np.uint8)


def host_run_images(
    stripped: Sequence[tuple[str, np.ndarray]],
    placements: Sequence[TensorPlacement],
    runs_count: int,
    allocate: Callable[[int], np.ndarray] = _zeroed_bytes,
) -> tuple[tuple[np.ndarray, ...], tuple[HostTensor, ...]]:
    """Host copies of the weights laid out byte for byte as in their arena runs (so a LOAD is
    one memcpy per run). Returns one uint8 image per run (as long as its used bytes, from
    ``allocate``: zeroed host memory, or pinned memory for a GPU) and the tensors as typed
    views into them."""
    used_bytes = [0] * runs_count
    for (_, array), placement in zip(stripped, placements, strict=True):
        end = placement.offset_bytes + array.nbytes
        used_bytes[placement.run_index] = max(used_bytes[placement.run_index], end)
    images = tuple(allocate(size) for size in used_bytes)
    tensors = []
    for (name, array), placement in zip(stripped, placements, strict=True):
        start = placement.offset_bytes
        target = images[placement.run_index][start : start + array.nbytes]
        target[:] = array.reshape(-1).view(np.uint8)
        typed = target.view(array.dtype).reshape(array.shape)
        tensors.append(HostTensor(name, typed, placement))
    return images, tuple(tensors)


@dataclass(frozen=True, slots=True)
class PrepackMeasurement:
    """Median execute time of the largest batch, and session creation time (most of a LOAD),
    with weights in place and prepacked."""

    batch_size: int
    in_place_ns: int
    prepacked_ns: int
    session_in_place_ns: int
    session_prepacked_ns: int


@dataclass(eq=False, slots=True)
class OrtRegisteredModel:
    """A registered model: its stripped graph on disk, its weights in host memory."""

    name: str
    weights_bytes: int  # bytes copied into the arena by each LOAD
    run_pages: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]
    graph_path: Path  # the optimised, stripped graph
    tensors: tuple[HostTensor, ...]  # views into ``images``
    images: tuple[np.ndarray, ...]  # per run: its bytes as the arena will hold them
    inline_bytes: int  # initializers left inside the graph
    prepacked: bool = False
    extra_host_bytes: int = 0  # ONNX Runtime's prepacked copy, per loaded instance
    prepack_measurement: PrepackMeasurement | None = None


@dataclass(eq=False, slots=True)
class OrtLoadedModel:
    """A loaded model; ``session`` is None once unloaded."""

    model: RegisteredModel
    registered: OrtRegisteredModel
    runs: tuple[PageRun, ...]
    session: ort.InferenceSession | None
    values: dict[str, Any] = field(default_factory=dict)  # name -> OrtValue over the arena
    copy_ns: int = 0  # LOAD's memcpy part
    session_ns: int = 0  # LOAD's session-creation part


def session_options(intra_op_threads: int, prepack: bool) -> ort.SessionOptions:
    """The options every session of this backend runs with (no initializers added)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    return options


def cpu_kind_name() -> str:
    """A slug of this CPU's model name (``amd-epyc``), ``unknown-cpu`` if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    name = match.group(1) if match else "unknown cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def example_feeds(specs: Sequence[TensorSpec], batch_size: int) -> dict[str, np.ndarray]:
    """Seeded inputs of ``batch_size`` for timing runs (random floats, zero integers)."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = tuple(batch_size if dim == -1 else dim for dim in spec.shape)
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[spec.name] = np.zeros(shape, dtype)
    return feeds


def _measure_prepacking(
    model: OrtRegisteredModel, sessions: Sequence[ort.InferenceSession], check_ns: int
) -> tuple[int, list[int]]:
    """The batch size measured and each session's median time there: the largest batch, or
    for a slow model (its check run over ``SLOW_CHECK_NS``) the smallest, with fewer runs."""
    if check_ns > SLOW_CHECK_NS:
        smallest = model.batch_sizes[0]
        return smallest, _time_runs_ns(sessions, example_feeds(model.inputs, smallest), 1, 2)
    largest = model.batch_sizes[-1]
    return largest, _time_runs_ns(sessions, example_feeds(model.inputs, largest))


def _run_once_ns(session: ort.InferenceSession, feeds: Mapping[str, Any]) -> int:
    """One run's time: the check that the stripped graph runs, and how slow it is."""
    start_ns = time.perf_counter_ns()
    session.run(None, feeds)
    return time.perf_counter_ns() - start_ns


def _time_runs_ns(
    sessions: Sequence[ort.InferenceSession],
    feeds: Mapping[str, Any],
    warmup_runs: int = PREPACK_WARMUP_RUNS,
    timed_runs: int = PREPACK_TIMED_RUNS,
) -> list[int]:
    """Median (nearest rank) run time of each session, timed alternately after warm-up runs."""
    for session in sessions:
        for _ in range(warmup_runs):
            session.run(None, feeds)
    samples: list[list[int]] = [[] for _ in sessions]
    for _ in range(timed_runs):
        for session, times in zip(sessions, samples, strict=True):
            start_ns = time.perf_counter_ns()
            session.run(None, feeds)
            times.append(time.perf_counter_ns() - start_ns)
    return [percentile_of(times, 50.0) for times in samples]


def _prepack_variants(prepacking: Prepacking, packable_bytes: int) -> list[bool]:
    """The prepacking settings to build at registration (both only when measuring)."""
    if not packable_bytes or prepacking == "off":
        return [False]
    return [True] if prepacking == "on" else [False, True]


def ort_error(action: str, error: Exception) -> BackendError:
    """A BackendError for an ONNX Runtime failure: BAD_INPUT for rejected inputs."""
    code = (
        ErrorCode.BAD_INPUT
        if isinstance(error, ort.capi.onnxruntime_pybind11_state.InvalidArgument)
        else ErrorCode.INTERNAL
    )
    return BackendError(code, f"ONNX Runtime failed to {action}: {error}")


# --- The backend ------------------------------------------------------------------------------


class OnnxRuntimeBackend:
    """`backend.Backend` over ONNX Runtime's CPU execution provider (see the module header).

    ``prepacking``: "measure" (default) decides per model at registration; "on"/"off" force it.
    ``work_dir`` holds the stripped graphs; a temporary one (removed by ``close``) if None.
    """

    name: str = "onnxruntime"
    device: str = "cpu"
    lanes: tuple[str, ...] = ("load", "execute")

    def __init__(
        self,
        arena: Arena,
        *,
        intra_op_threads: int = 1,
        work_dir: str | None = None,
        prepacking: Prepacking = "measure",
    ) -> None:
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        self.arena: Arena = arena
        self.intra_op_threads = intra_op_threads
        self.prepacking: Prepacking = prepacking
        self.kind = f"onnxruntime-{ort.__version__}-cpu-{cpu_kind_name()}-t{intra_op_threads}"
        self._files = ModelFiles(
            work_dir, prefix="clockwork-onnxruntime-", placeholders=(PLACEHOLDER_NAME,)
        )
        self.work_dir = self._files.path
        self._registered = ModelRegistry(OrtRegisteredModel)

    # Registration.

    def register(
        self,
        name: str,
        path: str,
        batch_sizes: Sequence[int],
        inputs: Sequence[TensorSpec] = (),
    ) -> OrtRegisteredModel:
        """Optimise, strip and lay out the model at ``path``; decide prepacking (timed at the
        declared ``inputs`` shapes). Returns the registered model. Raises BAD_MODEL."""
        source = ort_graph.read_model(path)
        inputs, outputs = ort_graph.graph_specs(source, path, inputs)
        batches = ort_graph.batch_sizes(inputs + outputs, batch_sizes, path)
        del source
        stem = self._files.stem(name)
        graph = ort_graph.optimise(path, self.work_dir / f"{stem}.optimised.onnx")
        stripped, inline_bytes = ort_graph.strip(graph)
        run_pages, placements = layout_tensors(
            [array.nbytes for _, array in stripped], self.arena.page_bytes
        )
        images, tensors = host_run_images(stripped, placements, len(run_pages))
        packable_bytes = ort_graph.prepackable_bytes(graph, dict(stripped))
        del stripped  # the images now hold the only host copy
        graph_path = self.work_dir / f"{stem}.onnx"
        onnx.save(graph, str(graph_path))
        model = OrtRegisteredModel(
            name=name,
            weights_bytes=sum(tensor.array.nbytes for tensor in tensors),
            run_pages=run_pages,
            inputs=inputs,
            outputs=outputs,
            batch_sizes=batches,
            graph_path=graph_path,
            tensors=tensors,
            images=images,
            inline_bytes=inline_bytes,
        )
        try:
            self._decide_prepacking(model, packable_bytes, path)
        except BaseException:
            graph_path.unlink(missing_ok=True)
            raise
        self._registered.add(model)
        return model

    def _decide_prepacking(self, model: OrtRegisteredModel, packable_bytes: int, path: str) -> None:
        """Set ``prepacked``, ``extra_host_bytes`` and ``prepack_measurement`` on ``model``,
        after checking that the stripped graph runs. Raises BackendError(BAD_MODEL)."""
        host_values = {t.name: ort.OrtValue.ortvalue_from_numpy(t.array) for t in model.tensors}
        variants = _prepack_variants(self.prepacking, packable_bytes)
        try:
            sessions, session_ns = [], []
            for prepack in variants:
                start_ns = time.perf_counter_ns()
                sessions.append(self._session(model, host_values, prepack))
                session_ns.append(time.perf_counter_ns() - start_ns)
            smallest = example_feeds(model.inputs, model.batch_sizes[0])
            check_ns = _run_once_ns(sessions[0], smallest)
            measured = (
                _measure_prepacking(model, sessions, check_ns) if len(variants) == 2 else None
            )
        except Exception as error:  # the stripped graph must build and run, or it is no model
            raise ort_graph.bad_model(path, f"its stripped graph does not run ({error})") from error
        if measured is not None:
            batch_size, run_ns = measured
            model.prepack_measurement = PrepackMeasurement(batch_size, *run_ns, *session_ns)
            model.prepacked = run_ns[0] >= PREPACK_MIN_SPEEDUP * run_ns[1]
        else:
            model.prepacked = variants[0]
        model.extra_host_bytes = packable_bytes if model.prepacked else 0

    def unregister(self, model: RegisteredModel) -> None:
        """Forget ``model`` and delete its stripped graph. Raises BackendError(UNKNOWN_MODEL)."""
        self._registered.remove(model).graph_path.unlink(missing_ok=True)

    # Sessions.

    def _session(
        self, model: OrtRegisteredModel, values: Mapping[str, Any], prepack: bool
    ) -> ort.InferenceSession:
        """A session of the stripped graph whose initializers are ``values`` (OrtValues)."""
        options = session_options(self.intra_op_threads, prepack)
        for tensor_name, value in values.items():
            options.add_initializer(tensor_name, value)
        return ort.InferenceSession(
            str(model.graph_path), options, providers=["CPUExecutionProvider"]
        )

    def load(
        self, model: RegisteredModel, runs: Sequence[PageRun]
    ) -> tuple[OrtLoadedModel, dict[str, int]]:
        """Copy the weights into ``runs`` and create a session bound to them. Returns the
        loaded model and {"load": ns}. Raises BackendError (UNKNOWN_MODEL, INTERNAL)."""
        registered = self._registered.own(model)
        if tuple(run.count for run in runs) != registered.run_pages:
            raise BackendError(
                ErrorCode.INTERNAL,
                f"model {model.name!r} needs runs of {registered.run_pages} pages, "
                f"got {[run.count for run in runs]}",
            )
        start_ns = time.monotonic_ns()
        values = self._copy_into_arena(registered, runs)
        copied_ns = time.monotonic_ns()
        try:
            session = self._session(registered, values, registered.prepacked)
        except Exception as error:
            raise ort_error(f"create a session for {model.name!r}", error) from error
        end_ns = time.monotonic_ns()
        loaded = OrtLoadedModel(
            model=registered,
            registered=registered,
            runs=tuple(runs),
            session=session,
            values=values,
            copy_ns=copied_ns - start_ns,
            session_ns=end_ns - copied_ns,
        )
        return loaded, {"load": end_ns - start_ns}

    def _copy_into_arena(
        self, model: OrtRegisteredModel, runs: Sequence[PageRun]
    ) -> dict[str, Any]:
        """One memcpy per run of its host image; returns name -> OrtValue over the arena."""
        views = [self.arena.view(run) for run in runs]
        for view, image in zip(views, model.images, strict=True):
            view[: image.nbytes] = image
        values: dict[str, Any] = {}
        for tensor in model.tensors:
            offset = tensor.placement.offset_bytes
            target = views[tensor.placement.run_index][offset : offset + tensor.array.nbytes]
            typed = target.view(tensor.array.dtype).reshape(tensor.array.shape)
            values[tensor.name] = ort.OrtValue.ortvalue_from_numpy(typed)
        return values

    def _live(self, loaded: Any) -> tuple[OrtLoadedModel, ort.InferenceSession]:
        if not isinstance(loaded, OrtLoadedModel) or loaded.session is None:
            name = getattr(getattr(loaded, "model", None), "name", "?")
            raise BackendError(
                ErrorCode.NOT_LOADED, f"model {name!r} is not loaded (this handle was unloaded)"
            )
        return loaded, loaded.session

    def infer(
        self, loaded: Any, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Run one batch. Returns outputs (copies owned by the caller) and ns durations of
        copy_in, execute and copy_out. Raises BackendError (NOT_LOADED, BAD_INPUT, INTERNAL)."""
        handle, session = self._live(loaded)
        start_ns = time.monotonic_ns()
        feeds = {
            name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
            for name, array in inputs.items()
        }
        copied_in_ns = time.monotonic_ns()
        output_names = [spec.name for spec in handle.registered.outputs]
        try:
            results = session.run_with_ort_values(output_names, feeds)
        except Exception as error:
            raise ort_error(f"run {handle.registered.name!r}", error) from error
        executed_ns = time.monotonic_ns()
        outputs = {
            name: np.array(value.numpy(), copy=True)
            for name, value in zip(output_names, results, strict=True)
        }
        end_ns = time.monotonic_ns()
        durations = {
            "copy_in": copied_in_ns - start_ns,
            "execute": executed_ns - copied_in_ns,
            "copy_out": end_ns - executed_ns,
        }
        return outputs, durations

    def unload(self, loaded: Any) -> None:
        """Drop the session and the OrtValues over the pages (CPython frees them now).
        Raises BackendError(NOT_LOADED) for a handle already unloaded."""
        handle, _ = self._live(loaded)
        handle.session = None
        handle.values.clear()

    def close(self) -> None:
        """Forget every model and delete the files this backend wrote."""
        for model in self._registered.clear():
            model.graph_path.unlink(missing_ok=True)
        self._files.close()
