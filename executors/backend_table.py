"""The backend table: each ``--backend`` name and the function that builds it from the config.

Invariants: `BACKENDS` is the one list of backend names (the flags offer exactly these); a
factory builds its backend or raises (ValueError for a device it does not run on, BackendError
or OSError from the backend) and never exits; heavy libraries (ONNX Runtime, CuPy) are imported
only by the factory that needs them, so choosing one backend never loads another.
"""

from __future__ import annotations

from collections.abc import Callable

from .backend import Backend
from .executor_config import ExecutorConfig

MIB = 1 << 20
DEFAULT_ORT_WEIGHTS_BYTES = 256 * MIB  # 16 pages: room for every demo model many times over
DEFAULT_CUDA_WEIGHTS_BYTES = 8 << 30  # checked against the device's free memory at start


def _onnxruntime(config: ExecutorConfig) -> Backend:
    if config.device.startswith("cuda:"):
        return _onnxruntime_cuda(config)
    if config.device != "cpu":
        raise ValueError(f"--backend onnxruntime runs on cpu or cuda:N, not {config.device!r}")
    from .arena import NumpyArena
    from .onnxruntime import OnnxRuntimeBackend

    weights_bytes = config.weights_bytes or DEFAULT_ORT_WEIGHTS_BYTES
    arena = NumpyArena(config.page_bytes, weights_bytes // config.page_bytes)
    return OnnxRuntimeBackend(arena, intra_op_threads=config.intra_op_threads)


def _onnxruntime_cuda(config: ExecutorConfig) -> Backend:
    from .onnxruntime_cuda import make_cuda_backend

    return make_cuda_backend(
        config.device,
        page_bytes=config.page_bytes,
        weights_bytes=config.weights_bytes or DEFAULT_CUDA_WEIGHTS_BYTES,
        io_bytes=config.io_bytes,
        workspace_bytes=config.workspace_bytes,
        weights_mode="initializers" if config.cuda_weights == "initializers" else "inputs",
    )


def _simulated(config: ExecutorConfig) -> Backend:
    from .simulated import make_simulated_backend

    if config.device not in ("cpu", "sim"):
        raise ValueError(f"the simulated backend uses no device; {config.device} needs onnxruntime")

    return make_simulated_backend(
        config.page_bytes,
        config.weights_bytes,
        seed=config.seed,
        noise=config.noise,
        slowdown=config.slowdown,
        profile_file=config.profile_file,
    )


BACKENDS: dict[str, Callable[[ExecutorConfig], Backend]] = {
    "onnxruntime": _onnxruntime,
    "simulated": _simulated,
}


def make_backend(config: ExecutorConfig) -> Backend:
    """The backend ``config.backend`` names, built from ``config``. Raises KeyError for a name
    not in `BACKENDS`, and whatever its factory raises (ValueError, BackendError, OSError)."""
    return BACKENDS[config.backend](config)
