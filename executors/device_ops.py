"""Where the IO-bound ONNX Runtime backend keeps memory and how it moves bytes: `CudaOps` (a
CUDA device through CuPy) or `HostOps` (host memory and ONNX Runtime's CPU provider, so the
very same backend code runs, and is tested, on a machine without a GPU).

Invariants:
- A *stream* orders copies; ``mark(stream)`` returns a point in it (a CUDA event, or the host
  clock when copies are synchronous) and ``elapsed_ns(a, b)`` the time between two marks, valid
  after ``synchronize(stream)``.
- ``copy_to_device`` / ``copy_to_host`` only enqueue on CUDA (the host side must stay alive and
  unchanged until the stream is synchronized); on the host they are done when they return.
- Every method that touches a CUDA device runs inside ``activate()`` (CuPy's current device
  is per thread, and each lane is a thread).
- ``clock_mhz()`` is the device's current SM clock from NVML (``nvidia-ml-py``), or 0 where
  no clock can be read (the host; a machine without NVML). It is never a guess.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import sys
import time
from typing import Any, Protocol

import numpy as np

# The installed library (executors/onnxruntime.py shadows the name only for relative imports).
import onnxruntime as ort

from .cuda_arena import (
    CudaUnavailable,
    CupyArena,
    CupyBuffer,
    import_cupy,
    pinned_host_array,
)

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
_DEVICE_PATTERN = re.compile(r"cuda:(\d{1,2})")
_H2D, _D2H = 1, 2  # cudaMemcpyKind


def cuda_index(device: str) -> int:
    """``"cuda:N"`` -> N. Raises ValueError for anything else."""
    match = _DEVICE_PATTERN.fullmatch(device)
    if match is None:
        raise ValueError(f"not a CUDA device: {device!r} (expected cuda:N)")
    return int(match.group(1))


def buffer_address(array: Any) -> int:
    """The address of the first element of a numpy or CuPy array."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class DeviceOps(Protocol):
    device: str  # "cuda:0", "cpu"
    ort_device: str  # the device_type ONNX Runtime's IO binding takes: "cuda", "cpu"
    device_id: int
    kind: str  # "cuda-nvidia-h200", "cpu"
    clock_source: str  # "nvml" or "none"

    def activate(self) -> contextlib.AbstractContextManager[Any]: ...
    def new_stream(self) -> Any: ...
    def host_array(self, nbytes: int) -> np.ndarray: ...
    def arena(self, page_bytes: int, pages_total: int) -> Any: ...
    def io_buffer(self, nbytes: int) -> tuple[Any, int]: ...
    def copy_to_device(self, address: int, source: np.ndarray, stream: Any) -> None: ...
    def copy_to_host(self, target: np.ndarray, address: int, stream: Any) -> None: ...
    def mark(self, stream: Any) -> Any: ...
    def elapsed_ns(self, start: Any, end: Any) -> int: ...
    def synchronize(self, stream: Any) -> None: ...
    def providers(self, stream: Any, workspace_bytes: int, *, exhaustive: bool) -> list[Any]: ...
    def clock_mhz(self) -> int: ...
    def close(self) -> None: ...


class HostOps:
    """Host memory and ONNX Runtime's CPU provider: copies are memmoves, marks are clock
    reads, there are no streams."""

    device = "cpu"
    ort_device = "cpu"
    device_id = 0
    kind = "cpu"
    clock_source = "none"

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_stream(self) -> None:
        return None

    def host_array(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def arena(self, page_bytes: int, pages_total: int) -> Any:
        from .arena import NumpyArena

        return NumpyArena(page_bytes, pages_total)

    def io_buffer(self, nbytes: int) -> tuple[np.ndarray, int]:
        array = np.zeros(nbytes, np.uint8)
        return array, buffer_address(array)

    def copy_to_device(self, address: int, source: np.ndarray, stream: Any) -> None:
        ctypes.memmove(address, buffer_address(source), source.nbytes)

    def copy_to_host(self, target: np.ndarray, address: int, stream: Any) -> None:
        ctypes.memmove(buffer_address(target), address, target.nbytes)

    def mark(self, stream: Any) -> int:
        return time.perf_counter_ns()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return int(end - start)

    def synchronize(self, stream: Any) -> None:
        """Nothing is ever in flight."""

    def providers(self, stream: Any, workspace_bytes: int, *, exhaustive: bool) -> list[Any]:
        return [CPU_PROVIDER]

    def clock_mhz(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to release."""


class NvmlClock:
    """The SM clock of one GPU through NVML; ``mhz()`` is 0 when NVML is unavailable."""

    def __init__(self, pci_bus_id: str, device_id: int) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            except Exception:  # NVMLError, or no bus id: NVML's index is CUDA's by default
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_id)
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver library, or no such device
            self._nvml = None

    @property
    def source(self) -> str:
        return "nvml" if self._nvml is not None else "none"

    def mhz(self) -> int:
        if self._nvml is None:
            return 0
        try:
            return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except Exception:
            return 0


class CudaOps:
    """A CUDA device through CuPy: pinned host memory, async copies and CUDA events."""

    ort_device = "cuda"

    def __init__(self, device_id: int) -> None:
        """Raises CudaUnavailable (no CuPy, no such device)."""
        self._cupy = import_cupy()
        self.device_id = device_id
        self.device = f"cuda:{device_id}"
        self._device = self._open_device(device_id)
        runtime = self._cupy.cuda.runtime
        with self._device:
            name = runtime.getDeviceProperties(device_id)["name"]
            try:
                pci_bus_id = str(runtime.deviceGetPCIBusId(device_id))
            except Exception:  # then NVML is asked by index
                pci_bus_id = ""
        self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
        self.kind = f"cuda-{slug(self.gpu_name)}"
        self._clock = NvmlClock(pci_bus_id, device_id)
        self.clock_source = self._clock.source

    def _open_device(self, device_id: int) -> Any:
        cupy = self._cupy
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as error:  # CUDARuntimeError: no driver, no device
            raise CudaUnavailable(f"no CUDA device is visible: {error}") from None
        if not 0 <= device_id < count:
            raise CudaUnavailable(
                f"cuda:{device_id} does not exist; {count} CUDA device(s) visible"
            )
        return cupy.cuda.Device(device_id)

    def free_bytes(self) -> int:
        with self._device:
            return int(self._cupy.cuda.runtime.memGetInfo()[0])

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """This device as the calling thread's current one (a new context object each call:
        lanes enter it from several threads)."""
        return self._cupy.cuda.Device(self.device_id)  # type: ignore[no-any-return]

    def new_stream(self) -> Any:
        with self._device:
            return self._cupy.cuda.Stream(non_blocking=True)

    def host_array(self, nbytes: int) -> np.ndarray:
        with self._device:
            return pinned_host_array(nbytes)

    def arena(self, page_bytes: int, pages_total: int) -> CupyArena:
        return CupyArena(page_bytes, pages_total, self.device_id)

    def io_buffer(self, nbytes: int) -> tuple[CupyBuffer, int]:
        buffer = CupyBuffer(nbytes, self.device_id)
        return buffer, buffer.address

    def copy_to_device(self, address: int, source: np.ndarray, stream: Any) -> None:
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(address, buffer_address(source), source.nbytes, _H2D, stream.ptr)

    def copy_to_host(self, target: np.ndarray, address: int, stream: Any) -> None:
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(buffer_address(target), address, target.nbytes, _D2H, stream.ptr)

    def mark(self, stream: Any) -> Any:
        event = self._cupy.cuda.Event()
        event.record(stream)
        return event

    def elapsed_ns(self, start: Any, end: Any) -> int:
        elapsed_ms = float(self._cupy.cuda.get_elapsed_time(start, end))
        return round(elapsed_ms * 1e6)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def providers(self, stream: Any, workspace_bytes: int, *, exhaustive: bool) -> list[Any]:
        """The CUDA provider on ``stream`` with its arena capped at ``workspace_bytes``, then
        the CPU provider. ``exhaustive``: cuDNN benchmarks convolution algorithms at each
        shape's first run (serving sessions, warmed up by the profiler), else heuristics."""
        options = {
            "device_id": str(self.device_id),
            "gpu_mem_limit": str(workspace_bytes),
            "arena_extend_strategy": "kSameAsRequested",
            "cudnn_conv_algo_search": "EXHAUSTIVE" if exhaustive else "HEURISTIC",
            "cudnn_conv_use_max_workspace": "0",
            "do_copy_in_default_stream": "1",
            "has_user_compute_stream": "1",
            "user_compute_stream": str(stream.ptr),
        }
        return [(CUDA_PROVIDER, options), CPU_PROVIDER]

    def clock_mhz(self) -> int:
        return self._clock.mhz()

    def close(self) -> None:
        """CuPy frees the pools when the backend drops them."""


def preload_cuda_libraries() -> None:
    """Let onnxruntime-gpu load the CUDA and cuDNN libraries of the ``nvidia-*`` wheels
    (``onnxruntime.preload_dlls``, 1.21+), printing nothing on stdout (the executor's first
    stdout line must be ``ready``)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(Exception):
        preload()


def package_info() -> tuple[str, str]:
    """(package name, the CUDA version it was built for) of the installed onnxruntime."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return "onnxruntime", ""
    return str(getattr(info, "package_name", "onnxruntime")), str(getattr(info, "cuda_version", ""))


def check_cuda_provider(ops: CudaOps) -> None:
    """Raises CudaUnavailable unless ONNX Runtime has a CUDA provider that really loads (a
    wheel built for another CUDA major version falls back to the CPU, or fails)."""
    package, cuda = package_info()
    where = f"onnxruntime {ort.__version__} ({package}, CUDA {cuda or 'none'})"
    if CUDA_PROVIDER not in ort.get_available_providers():
        raise CudaUnavailable(
            f"{where} has no CUDA execution provider: install onnxruntime-gpu instead of "
            "onnxruntime (docs/gpu.md)"
        )
    from .ort_binding import provider_probe_model

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        stream = ops.new_stream()
        with ops.activate():
            session = ort.InferenceSession(
                provider_probe_model(),
                options,
                providers=ops.providers(stream, 64 << 20, exhaustive=False),
            )
        loaded = CUDA_PROVIDER in session.get_providers()
        why = "it fell back to the CPU"
    except Exception as error:  # ONNX Runtime's own error types
        loaded, why = False, str(error).strip()
    if not loaded:
        raise CudaUnavailable(
            f"{where} could not start its CUDA execution provider ({why}); it needs the CUDA "
            "and cuDNN libraries of that major version (docs/gpu.md)"
        )


def open_cuda(device: str) -> CudaOps:
    """The ops of ``device`` (``cuda:N``) after checking CuPy, the device and ONNX Runtime's
    CUDA provider. Raises CudaUnavailable (or ValueError for a bad device name)."""
    ops = CudaOps(cuda_index(device))
    preload_cuda_libraries()
    check_cuda_provider(ops)
    return ops


@functools.cache
def cuda_unavailable_reason(device: str = "cuda:0") -> str | None:
    """Why ``device`` cannot run the CUDA executor here, or None when it can."""
    try:
        open_cuda(device)
    except CudaUnavailable as error:
        return error.message
    return None
