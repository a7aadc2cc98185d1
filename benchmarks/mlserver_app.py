"""The MLServer side of `benchmarks.peer_mlserver`: a minimal custom MLServer runtime serving an
ONNX model with ONNX Runtime on the CPU. It runs inside MLServer (``mlserver start``, in the
benchmark's own venv ``.bench-venv/mlserver``, `benchmarks/requirements-mlserver.txt`), never
in the project's environment, and imports nothing of the project. MLServer finds the runtime by
the import string ``mlserver_app.OnnxPeer`` (this folder on ``PYTHONPATH``); the class is built
on first access (`__getattr__`), so that importing this module needs no MLServer.

``OnnxPeer`` (an ``mlserver.MLModel``):
- ``load``: one ONNX Runtime CPU session of ``parameters.uri`` (one intra-op thread without
  spinning, sequential, default graph optimisations: the session of `benchmarks.ray_app`), run
  on one thread of its own pinned to the CPU in ``parameters.extra.ort_cpu``; warmed up at
  the batch sizes the batcher can form.
- ``predict``: the request's one input (MLServer's adaptive batcher has already stacked the
  rows of up to ``max_batch_size`` requests, waiting at most ``max_batch_time``) through the
  session on that thread, so MLServer's event loop takes requests meanwhile; one output back.
- ``GET /stats`` (a custom handler): the batches since the last call (sizes, median execute
  time by size) and the CPUs of the session's thread.

Invariant: the process is started pinned to the front CPU (the caller does it), so MLServer's
event loop, HTTP parsing, codecs and batcher run there; ONNX Runtime alone runs on
``ort_cpu``, as our executor and Ray's replica do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from typing import Any

import numpy as np


def ort_session(model_path: str) -> Any:
    """The session of `benchmarks.ray_app.ort_session` (this module imports nothing of the
    project, so it is written here again)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])


def _pin_this_thread(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})  # 0 = the calling thread on Linux


def make_model_class() -> type:
    """The ``OnnxPeer`` runtime class (built here so that importing this module needs no
    MLServer)."""
    from mlserver import MLModel
    from mlserver.codecs import NumpyCodec
    from mlserver.handlers import custom_handler
    from mlserver.types import InferenceRequest, InferenceResponse

    class OnnxPeer(MLModel):  # type: ignore[misc]
        async def load(self) -> bool:
            parameters = self.settings.parameters
            extra = parameters.extra or {}
            self.ort_cpu = int(extra.get("ort_cpu", 1))
            self.pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="ort", initializer=_pin_this_thread, initargs=(self.ort_cpu,)
            )
            self.session = self.pool.submit(ort_session, str(parameters.uri)).result()
            first = self.session.get_inputs()[0]
            self.input_name = first.name
            self.output_name = self.session.get_outputs()[0].name
            self.row_shape = tuple(int(d) for d in first.shape[1:])
            self.batches: list[tuple[int, int]] = []  # (batch size, execute ns)
            self.pool.submit(self._warm_up, max(1, self.settings.max_batch_size)).result()
            return True

        def _warm_up(self, max_batch_size: int) -> None:
            for size in sorted({1, 2, 4, 8, 16, max_batch_size}):
                rows = np.zeros((size, *self.row_shape), np.float32)
                for _ in range(3):
                    self.session.run(None, {self.input_name: rows})

        def _run(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
            start_ns = time.perf_counter_ns()
            (output, *_) = self.session.run(None, {self.input_name: rows})
            return output, time.perf_counter_ns() - start_ns

        async def predict(self, payload: InferenceRequest) -> InferenceResponse:
            rows = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
            loop = asyncio.get_running_loop()
            output, execute_ns = await loop.run_in_executor(self.pool, self._run, rows)
            self.batches.append((len(rows), execute_ns))
            encoded = NumpyCodec.encode_output(name=self.output_name, payload=output)
            return InferenceResponse(model_name=self.name, outputs=[encoded])

        @custom_handler(rest_path="/stats", rest_method="GET")
        async def stats(self) -> dict[str, Any]:
            sizes: dict[int, int] = {}
            by_size: dict[int, list[int]] = {}
            for size, execute_ns in self.batches:
                sizes[size] = sizes.get(size, 0) + 1
                by_size.setdefault(size, []).append(execute_ns)
            self.batches.clear()
            return {
                "batches": sum(sizes.values()),
                "batch_sizes": dict(sorted(sizes.items())),
                "execute_ms_p50_by_size": {
                    size: round(float(np.median(values)) / 1e6, 3)
                    for size, values in sorted(by_size.items())
                },
                "ort_cpu": self.ort_cpu,
                "front_cpus": sorted(os.sched_getaffinity(os.getpid())),
                "pid": os.getpid(),
            }

    return OnnxPeer


def __getattr__(name: str) -> Any:
    if name == "OnnxPeer":
        cls = make_model_class()
        globals()["OnnxPeer"] = cls
        return cls
    raise AttributeError(name)
