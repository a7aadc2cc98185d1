"""The Ray Serve side of `benchmarks.peer_ray`: a one-replica Ray Serve application serving an
ONNX model with ONNX Runtime on the CPU, driven by commands on standard input. It runs in the
benchmark's own venv (``.bench-venv/ray``, `benchmarks/requirements-ray.txt`), never in the
project's environment, and imports nothing of the project:

    .bench-venv/ray/bin/python benchmarks/ray_app.py --model M.onnx --port P --temp-dir D
        [--replica-cpu 1] [--max-batch-size B] [--batch-wait-timeout-s W] [--timeout-s T]
        [--execute thread|inline] [--max-ongoing-requests N]

It starts Ray (``ray.init``, no dashboard) and Serve (HTTP proxy on ``127.0.0.1:P``, global
``request_timeout_s`` = T), deploys `OnnxPeer` and prints one JSON line ``{"ready": ...}``.
Then each line read is a JSON command, answered by one JSON line:

- ``{"cmd": "configure", "max_batch_size": B, "batch_wait_timeout_s": W, "execute": E}``:
  the running replica's ``@serve.batch`` settings (its setters; no restart) and where a batch
  runs (``thread``: an ONNX Runtime thread of its own; ``inline``: on the event loop).
- ``{"cmd": "stats"}``: the replica's batches since the last ``stats`` (sizes, execute time),
  its threads' CPU affinity, and its ONNX Runtime session settings.
- ``{"cmd": "handle_load", "schedule": F.npy, "input": F.npy, "slo_ms": S, "out": F.json,
  "max_lag_s": L}``: open-loop load through a deployment handle from this process (see
  `HandleLoad`); a request more than L s late against its schedule is not sent (``behind``).
  This load stays apart from ``clockwork-async bench``: it calls a Ray deployment handle
  inside Ray's own process and venv, which imports nothing of the project (the schedule is
  bench's, drawn by `benchmarks.http_loadgen.arrival_schedule` and passed in as a file).
- ``{"cmd": "quit"}``: shut Serve and Ray down and exit.

Invariants:
- CPUs: this process is started pinned to the system CPU (the caller does it), so every Ray
  process it starts (GCS, raylet, the Serve controller and HTTP proxy) inherits that CPU; the
  replica moves every one of its threads to ``--replica-cpu`` before it loads the model, so
  ONNX Runtime (one intra-op thread, no spinning) and the replica's event loops share that CPU
  and nothing else of Ray runs there.
- After Serve is up this process renices its own threads to 10: as a load generator it yields
  CPU 0 to Ray's proxy and controller, as `clockwork-async bench` yields it to our controller.
- Rows of a handle load are in the format of `benchmarks.http_loadgen`: per request sent, its
  send time and lag (ns, from the schedule's start), status and client latency. A request is
  cancelled (``DeploymentResponse.cancel``) at its deadline; a reply that still arrives after
  it is ``late``; one that never arrives is ``abandoned`` ``2 SLO + 50 ms`` after it was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

NS_PER_S = 1_000_000_000
# Set before Ray starts. Ray runs its workers (the Serve controller, the HTTP proxy and the
# replica) at nice 15 by default, below our nice-10 load generator: nice 0 as our daemon.
RAY_ENVIRONMENT = {
    "RAY_worker_niceness": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # else it writes ~/.ray/auth_token
}
APP_NAME = "peer"
LOAD_NICE = 10
ABANDON_EXTRA_S = 0.05


# --- the replica ---------------------------------------------------------------------------------


def pin_all_threads(cpus: set[int]) -> list[int]:
    """Move every thread of this process to ``cpus``; returns their ids."""
    tids = [int(name) for name in os.listdir("/proc/self/task")]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
    return tids


def thread_affinities() -> dict[int, list[int]]:
    """CPU affinity of every thread of this process."""
    found = {}
    for name in os.listdir("/proc/self/task"):
        try:
            found[int(name)] = sorted(os.sched_getaffinity(int(name)))
        except ProcessLookupError:
            continue
    return found


def ort_session(model_path: str) -> Any:
    """An ONNX Runtime CPU session: one intra-op thread without spinning, sequential, default
    graph optimisations (ONNX Runtime's own best for a plain session)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])


def v2_row(body: bytes, header_length: str | None, row_shape: tuple[int, ...]) -> tuple[Any, bool]:
    """The one FP32 input row of an Open Inference Protocol infer request (JSON ``data``, or
    the binary tensor data extension when ``header_length`` is given), and whether the
    outputs are asked binary. Only what `benchmarks.http_loadgen` sends is read: one input."""
    split = len(body) if header_length is None else int(header_length)
    request = json.loads(body[:split])
    (tensor,) = request["inputs"]
    if header_length is None:
        row = np.asarray(tensor["data"], np.float32).reshape(row_shape)
    else:
        row = np.frombuffer(body, np.float32, offset=split).reshape(row_shape)
    binary = bool(request.get("parameters", {}).get("binary_data_output", False))
    return row, binary


def v2_reply(name: str, output: Any, binary: bool) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol infer response holding ``output`` (FP32), binary or JSON."""
    tensor: dict[str, Any] = {"name": name, "shape": list(output.shape), "datatype": "FP32"}
    if not binary:
        tensor["data"] = output.ravel().tolist()
        reply = json.dumps({"model_name": APP_NAME, "outputs": [tensor]}).encode()
        return reply, {"content-type": "application/json"}
    tensor["parameters"] = {"binary_data_size": output.nbytes}
    header = json.dumps({"model_name": APP_NAME, "outputs": [tensor]}).encode()
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }
    return header + output.tobytes(), headers


def make_deployment(max_ongoing_requests: int) -> Any:
    """The `OnnxPeer` deployment class (built here so that importing this module needs no Ray)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": 1},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    )
    class OnnxPeer:
        """One ONNX Runtime session behind ``@serve.batch``; HTTP at ``/`` (raw float32 bytes
        in and out, or an Open Inference Protocol infer request: `v2_row`, `v2_reply`) and
        ``predict`` (a numpy row in, one out) for deployment handles."""

        def __init__(
            self, model_path: str, cpu: int, batch_size: int, wait_s: float, in_thread: bool
        ) -> None:
            pin_all_threads({cpu})
            self.cpu = cpu
            self.session = ort_session(model_path)
            first = self.session.get_inputs()[0]
            self.input_name = first.name
            self.output_name = self.session.get_outputs()[0].name
            self.row_shape = (1, *(int(d) for d in first.shape[1:]))
            # in_thread: ONNX Runtime releases the GIL, so a batch run on this thread lets the
            # event loop take requests into the next batch meanwhile; else it runs on the loop.
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ort")
            self.batches: list[tuple[int, int]] = []  # (batch size, execute ns)
            self.configure(batch_size, wait_s, in_thread)
            self._warm_up(batch_size)

        def _warm_up(self, batch_size: int) -> None:
            for size in sorted({1, 2, 4, 8, 16, batch_size}):
                rows = np.zeros((size, *self.row_shape[1:]), np.float32)
                for _ in range(3):
                    self.session.run(None, {self.input_name: rows})

        def configure(
            self, max_batch_size: int, batch_wait_timeout_s: float, in_thread: bool
        ) -> dict[str, Any]:
            self.infer.set_max_batch_size(max_batch_size)
            self.infer.set_batch_wait_timeout_s(batch_wait_timeout_s)
            self.in_thread = in_thread
            self.batches.clear()
            return {
                "max_batch_size": max_batch_size,
                "batch_wait_timeout_s": batch_wait_timeout_s,
                "execute": "thread" if in_thread else "inline",
            }

        def _run(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
            start_ns = time.perf_counter_ns()
            (output, *_) = self.session.run(None, {self.input_name: rows})
            return output, time.perf_counter_ns() - start_ns

        @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.001)
        async def infer(self, rows: list[np.ndarray]) -> list[np.ndarray]:
            batch = np.concatenate(rows)
            if self.in_thread:
                loop = asyncio.get_running_loop()
                output, execute_ns = await loop.run_in_executor(self.pool, self._run, batch)
            else:
                output, execute_ns = self._run(batch)
            self.batches.append((len(rows), execute_ns))
            return [output[i : i + 1] for i in range(len(rows))]

        async def __call__(self, request: Request) -> Response:
            body = await request.body()
            header_length = request.headers.get("inference-header-content-length")
            if header_length is None and "json" not in request.headers.get("content-type", ""):
                row = np.frombuffer(body, np.float32).reshape(self.row_shape)
                output = await self.infer(row)
                return Response(output.tobytes(), media_type="application/octet-stream")
            row, binary = v2_row(body, header_length, self.row_shape)
            reply, headers = v2_reply(self.output_name, await self.infer(row), binary)
            return Response(reply, headers=headers)

        async def predict(self, row: np.ndarray) -> np.ndarray:
            result: np.ndarray = await self.infer(row)
            return result

        def stats(self) -> dict[str, Any]:
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
                "replica_cpu": self.cpu,
                "replica_thread_cpus": sorted(
                    {c for cs in thread_affinities().values() for c in cs}
                ),
                "pid": os.getpid(),
            }

    return OnnxPeer


# --- the handle load ------------------------------------------------------------------------------


class HandleLoad:
    """Open-loop requests through a deployment handle, one row each (see the module doc)."""

    def __init__(self, handle: Any, row: np.ndarray, slo_s: float) -> None:
        self.handle = handle
        self.row = row
        self.slo_s = slo_s
        self.columns: dict[str, list[Any]] = {
            "sent_ns": [],
            "lag_ns": [],
            "status": [],
            "latency_ns": [],
        }
        self.outstanding = 0
        self.idle = asyncio.Event()
        self.start_ns = 0

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.start_ns

    async def run(self, offsets_ns: list[int], max_lag_ns: int) -> None:
        loop = asyncio.get_running_loop()
        self.start_ns = time.monotonic_ns()
        for scheduled_ns in offsets_ns:
            delay_ns = scheduled_ns - self.now_ns()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / NS_PER_S)
            elif -delay_ns > max_lag_ns:
                self.skip(scheduled_ns)
                continue
            self.send(loop, scheduled_ns)
        if self.outstanding:
            await self.idle.wait()

    def skip(self, scheduled_ns: int) -> None:
        """A request not sent: the generator is too far behind its schedule."""
        for name, value in (
            ("sent_ns", scheduled_ns),
            ("lag_ns", 0),
            ("status", "behind"),
            ("latency_ns", 0),
        ):
            self.columns[name].append(value)

    def send(self, loop: asyncio.AbstractEventLoop, scheduled_ns: int) -> None:
        sent_ns = self.now_ns()
        index = len(self.columns["sent_ns"])
        for name, value in (("sent_ns", sent_ns), ("lag_ns", max(0, sent_ns - scheduled_ns))):
            self.columns[name].append(value)
        self.columns["status"].append("abandoned")
        self.columns["latency_ns"].append(0)
        self.outstanding += 1
        self.idle.clear()
        response = self.handle.predict.remote(self.row)
        cancel = loop.call_later(self.slo_s, response.cancel)
        task = loop.create_task(self._await(response, index, sent_ns, cancel))
        abandon = loop.call_later(2 * self.slo_s + ABANDON_EXTRA_S, task.cancel)
        task.add_done_callback(lambda _: abandon.cancel())

    async def _await(self, response: Any, index: int, sent_ns: int, cancel: Any) -> None:
        from ray.serve.exceptions import RequestCancelledError

        try:
            await response
            status = "ok"
        except RequestCancelledError:
            status = "timeout"
        except asyncio.CancelledError:
            self._done()
            raise
        except Exception as error:  # any other failure is one row's status
            status = f"error:{type(error).__name__}"
        cancel.cancel()
        latency_ns = self.now_ns() - sent_ns
        if status == "ok" and latency_ns > self.slo_s * NS_PER_S:
            status = "late"
        self.columns["status"][index] = status
        self.columns["latency_ns"][index] = latency_ns
        self._done()

    def _done(self) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self.idle.set()


def handle_load(command: dict[str, Any]) -> dict[str, Any]:
    """Run one handle load; writes its rows to ``command["out"]`` and returns a short note."""
    from ray import serve

    offsets_ns = np.load(command["schedule"]).astype(np.int64).tolist()
    row = np.load(command["input"]).astype(np.float32)
    load = HandleLoad(serve.get_app_handle(APP_NAME), row, command["slo_ms"] / 1e3)
    wall_start = time.monotonic()
    asyncio.run(load.run(offsets_ns, round(float(command.get("max_lag_s", 1.0)) * NS_PER_S)))
    Path(command["out"]).write_text(json.dumps({"rows": load.columns}) + "\n")
    return {"requests": len(offsets_ns), "wall_s": round(time.monotonic() - wall_start, 3)}


# --- the command loop ----------------------------------------------------------------------------


def renice_own_threads(nice: int) -> None:
    """Lower the priority of every thread of this process (Linux nice values are per thread)."""
    for name in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(name), nice)
        except (ProcessLookupError, PermissionError):
            continue


def quiet_ray_logs() -> None:
    """Serve's driver-side INFO lines (one per cancelled request) to WARNING: printing them
    would cost the load generator's CPU."""
    import logging

    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.WARNING)


def start(args: argparse.Namespace) -> dict[str, Any]:
    """Ray, Serve and the deployment; returns the ready line's fields."""
    import ray
    from ray import serve

    started = time.monotonic()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(args.temp_dir),
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
        logging_level="WARNING",
    )
    ray_s = time.monotonic() - started
    serve.start(
        http_options={"host": "127.0.0.1", "port": args.port, "request_timeout_s": args.timeout_s}
    )
    peer = make_deployment(args.max_ongoing_requests)
    app = peer.bind(
        str(args.model),
        args.replica_cpu,
        args.max_batch_size,
        args.batch_wait_timeout_s,
        args.execute == "thread",
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    return {
        "ray_version": ray.__version__,
        "ray_init_s": round(ray_s, 2),
        "serve_s": round(time.monotonic() - started - ray_s, 2),
        "driver_cpus": sorted(os.sched_getaffinity(0)),
        "max_ongoing_requests": args.max_ongoing_requests,
        "execute": args.execute,
        "environment": RAY_ENVIRONMENT,
    }


def answer(command: dict[str, Any]) -> dict[str, Any]:
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    what = command.get("cmd")
    if what == "configure":
        done = handle.configure.remote(
            int(command["max_batch_size"]),
            float(command["batch_wait_timeout_s"]),
            command.get("execute", "thread") == "thread",
        )
        return {"configure": done.result(timeout_s=30)}
    if what == "stats":
        return {"stats": handle.stats.remote().result(timeout_s=30)}
    if what == "handle_load":
        return {"handle_load": handle_load(command)}
    raise ValueError(f"unknown command {what!r}")


def _reply_channel() -> TextIO:
    """Keep stdout for our replies alone; whatever else writes to fd 1 (Ray
    forwards its workers' output to the driver's stdout) lands in the log."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return replies


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray_app.py", description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--temp-dir", type=Path, required=True)
    parser.add_argument("--replica-cpu", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--batch-wait-timeout-s", type=float, default=0.001)
    parser.add_argument("--max-ongoing-requests", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=0.1)
    parser.add_argument(
        "--execute",
        choices=("thread", "inline"),
        default="thread",
        help="run ONNX Runtime on a thread of its own (default) or on the replica's event loop",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    replies = _reply_channel()
    os.environ.update(RAY_ENVIRONMENT)
    reply = {"ready": start(args)}
    quiet_ray_logs()
    renice_own_threads(LOAD_NICE)
    print(json.dumps(reply), file=replies, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("cmd") == "quit":
            break
        try:
            reply = answer(command)
        except Exception as error:  # reported to the caller, who decides
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply, default=str), file=replies, flush=True)
    from ray import serve

    serve.shutdown()
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
