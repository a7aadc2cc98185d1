"""Device memory of the CUDA executor: one CuPy allocation per pool, made at start, never grown.

Invariants:
- Each pool (the weights arena, the IO buffer) is one ``cudaMalloc``, made in its constructor
  through ``cupy.cuda.Memory`` (not CuPy's caching pool, which could reuse the memory for other
  arrays or keep it after close) and zero-filled once; nothing here allocates device memory
  afterwards. Freeing pages is `pages.PageCache` accounting only: the pool never shrinks.
- ``CupyArena.view(run)`` is a CuPy uint8 array over exactly the run's bytes (no copy) and
  ``address(run)`` its device pointer; a run outside the arena raises ``ArenaRangeError``
  (the checks are `arena.run_bounds_bytes`, shared with the host arenas).
- The third pool, ONNX Runtime's workspace (activations, cuDNN/cuBLAS scratch), is ONNX
  Runtime's own arena, capped at ``workspace_bytes`` per session; `plan_pools` counts it so the
  three fit the device together. ONNX Runtime cannot allocate from our pools: they are ours.
- CuPy is imported lazily (`import_cupy`): importing this module needs neither CuPy nor a GPU,
  and `plan_pools` is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from clockwork_async.wire.messages import ErrorCode

from .arena import check_geometry, run_bounds_bytes
from .backend import BackendError, PageRun

IO_ALIGN_BYTES = 256  # cudaMalloc's own alignment; every IO tensor starts at a multiple


class CudaUnavailable(BackendError):
    """The CUDA executor cannot run here: no CuPy, no GPU, no CUDA execution provider, or
    not enough device memory. The message says which, and what to install or change."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


def import_cupy() -> Any:
    """The ``cupy`` module. Raises CudaUnavailable naming the missing package."""
    try:
        import cupy
    except ImportError as error:  # CuPy also raises ImportError when its CUDA libraries fail
        raise CudaUnavailable(
            f"a CUDA device needs CuPy (pip install 'clockwork-async[gpu]'): {error}"
        ) from None
    return cupy


def align_up(size_bytes: int, align_bytes: int = IO_ALIGN_BYTES) -> int:
    return -(-size_bytes // align_bytes) * align_bytes


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Sizes of the executor's device pools."""

    page_bytes: int
    pages_total: int
    io_bytes: int  # the IO buffer: one INFER's inputs and outputs
    workspace_bytes: int  # ONNX Runtime's arena cap, per session (its allocation, not ours)

    @property
    def weights_bytes(self) -> int:
        return self.page_bytes * self.pages_total

    @property
    def allocated_bytes(self) -> int:
        """Device bytes this executor allocates at start (weights pages and IO buffer)."""
        return self.weights_bytes + self.io_bytes


def plan_pools(
    page_bytes: int, weights_bytes: int, io_bytes: int, workspace_bytes: int, free_bytes: int
) -> PoolPlan:
    """The pools for these flags on a device with ``free_bytes`` free: ``weights_bytes //
    page_bytes`` pages, the IO buffer rounded up to 256 bytes. Raises ValueError for bad
    geometry, CudaUnavailable when the pools plus one workspace exceed the free memory."""
    check_geometry(page_bytes, weights_bytes // page_bytes if page_bytes > 0 else 0)
    if io_bytes <= 0 or workspace_bytes <= 0:
        raise ValueError(
            f"io_bytes and workspace_bytes must be positive: {io_bytes}, {workspace_bytes}"
        )
    plan = PoolPlan(page_bytes, weights_bytes // page_bytes, align_up(io_bytes), workspace_bytes)
    needed_bytes = plan.allocated_bytes + workspace_bytes
    if needed_bytes > free_bytes:
        mib = [size / 2**20 for size in (plan.weights_bytes, plan.io_bytes, workspace_bytes)]
        raise CudaUnavailable(
            f"the pools need {needed_bytes / 2**20:.0f} MiB (weights {mib[0]:.0f} + IO "
            f"{mib[1]:.0f} + workspace {mib[2]:.0f}) but the device has "
            f"{free_bytes / 2**20:.0f} MiB free; lower --weights-bytes"
        )
    return plan


def _device_bytes(cupy: Any, size_bytes: int) -> tuple[Any, Any]:
    """(Memory, uint8 array over it) of ``size_bytes`` on the current device, zero-filled."""
    memory = cupy.cuda.memory.Memory(size_bytes)  # one cudaMalloc, outside CuPy's pool
    pointer = cupy.cuda.memory.MemoryPointer(memory, 0)
    array = cupy.ndarray((size_bytes,), cupy.uint8, pointer)
    array.fill(0)
    cupy.cuda.runtime.deviceSynchronize()
    return memory, array


class CupyArena:
    """The weights arena on a CUDA device: ``pages_total`` pages of ``page_bytes``, one
    allocation. Satisfies `backend.Arena` (``view`` returns a CuPy array, not numpy)."""

    def __init__(self, page_bytes: int, pages_total: int, device_id: int) -> None:
        check_geometry(page_bytes, pages_total)
        self.page_bytes = page_bytes
        self.pages_total = pages_total
        self.device_id = device_id
        cupy = import_cupy()
        with cupy.cuda.Device(device_id):
            self._memory, self._buffer = _device_bytes(cupy, max(1, page_bytes * pages_total))
        self._closed = False

    def view(self, run: PageRun) -> Any:
        """A writable CuPy uint8 view (no copy) of ``run``. Raises ArenaRangeError, or
        BackendError(INTERNAL) once closed."""
        start, stop = self._bounds(run)
        return self._buffer[start:stop]

    def address(self, run: PageRun) -> int:
        """The device address of the first byte of ``run``. Raises like ``view``."""
        return int(self._memory.ptr) + self._bounds(run)[0]

    def _bounds(self, run: PageRun) -> tuple[int, int]:
        if self._closed:
            raise BackendError(ErrorCode.INTERNAL, "the arena is closed")
        return run_bounds_bytes(run, self.page_bytes, self.pages_total)

    def close(self) -> None:
        """Drop the arena's reference to its memory (freed once no view holds it)."""
        self._closed = True
        self._buffer = self._memory = None


class CupyBuffer:
    """A device buffer of ``nbytes`` (the IO pool): one allocation, never grown."""

    def __init__(self, nbytes: int, device_id: int) -> None:
        cupy = import_cupy()
        with cupy.cuda.Device(device_id):
            self._memory, self.array = _device_bytes(cupy, max(1, nbytes))
        self.nbytes = nbytes
        self.address = int(self._memory.ptr)


def pinned_host_array(nbytes: int) -> np.ndarray:
    """A uint8 numpy array over page-locked host memory (CuPy's pinned allocator), so
    host-to-device copies from it run at full PCIe speed and asynchronously."""
    cupy = import_cupy()
    memory = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
    array = np.frombuffer(memory, np.uint8, max(1, nbytes))[:nbytes]  # keeps ``memory`` alive
    array.fill(0)
    return array
