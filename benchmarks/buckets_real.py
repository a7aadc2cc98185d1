"""The real-time part of `benchmarks.buckets` (``--real``): one ONNX Runtime sequence model on
a real daemon, served by buckets against the same model forced to one bucket (512 tokens).

The model (generated here, seeded): ``ids`` int64 [batch, tokens] and ``mask`` float32
[batch, tokens] -> ``pooled`` float32 [batch, 256]: an embedding (1000 x 256), four
MatMul + Relu layers of 256 x 256 over every token, and the mean over the tokens the mask
keeps. Its cost grows with the length (one intra-op thread, batch 1: about 0.4 ms at 32 tokens,
3-4 ms at 512) and zero padding (ids 0, mask 0) changes no answer, so it declares
``pad = true``. The daemon serves it twice from one repository: ``text`` with the buckets
32, 64, 128, 256, 512 and ``text512`` with the one bucket 512 (every request padded to 512).

The daemon runs its default executors (`clockwork_async.testing`; on the 2-CPU machine: the
controller on CPU 0, one ONNX Runtime executor pinned to CPU 1, one intra-op thread). The
load is the product's generator (`clockwork_async.bench`: `Run`, `drive`, `summarize`) run in
this process once the daemon serves, pinned to the controller's CPU at nice 10 as the
benchmarks' bench processes are (`benchmarks.lib.processes`). Each request draws its length:
a bucket by `LENGTH_SHARES` (half up to 32 tokens, a long tail), then a length uniformly
within it, so most requests are padded a little. Both models get the same Poisson arrivals
and the same lengths (same seed) at each load point; the load points are multiples of the
one-bucket model's capacity by the profile rule (`core.capacity`, from its registration
profile at the SLO).

Invariant: the daemon and everything it writes live in a temporary folder; its log is kept
under ``results/`` however the run ends.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    DaemonProcess,
    add_model,
    daemon_config,
    generator_cpus,
    keep_log,
    load_average,
    machine_description,
    percentiles_ms,
    run_uvloop,
    table,
    write_json,
)

BUCKETS = (32, 64, 128, 256, 512)
LENGTH_SHARES = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # of requests per bucket, as the sim part
VOCAB = 1000
HIDDEN = 256
LAYERS = 4
BUCKETED, ONE_BUCKET = "text", "text512"
NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class RealPlan:
    run_s: float  # per load point and model
    slo_ms: float
    loads: tuple[float, ...]  # multiples of the one-bucket model's rule capacity
    iterations: int  # registration profiling: measured runs per batch size


QUICK = RealPlan(run_s=8.0, slo_ms=50.0, loads=(0.5, 1.5, 3.0), iterations=4)
FULL = RealPlan(run_s=30.0, slo_ms=50.0, loads=(0.5, 1.0, 1.5, 3.0), iterations=10)


# --- the model and its two declarations ----------------------------------------------------------


def text_model(vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS) -> bytes:
    """The ONNX bytes of the masked sequence model (module docstring), seeded weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(31)
    weights = {
        "table": rng.standard_normal((vocab, hidden)).astype(np.float32),
        "last": np.array([2], np.int64),
        "one": np.array([1], np.int64),
    }
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h0"])]
    for i in range(layers):
        scale = 1 / np.sqrt(hidden)  # keeps the activations near 1 through the layers
        weights[f"w{i}"] = (rng.standard_normal((hidden, hidden)) * scale).astype(np.float32)
        nodes += [
            helper.make_node("MatMul", [f"h{i}", f"w{i}"], [f"m{i}"]),
            helper.make_node("Relu", [f"m{i}"], [f"h{i + 1}"]),
        ]
    nodes += [
        helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"]),
        helper.make_node("Mul", [f"h{layers}", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "one"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask", "one"], ["count"], keepdims=1),
        helper.make_node("Div", ["summed", "count"], ["pooled"]),
    ]
    graph = helper.make_graph(
        nodes,
        "text",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "tokens"]),
        ],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", hidden])],
        [numpy_helper.from_array(array, name) for name, array in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def model_toml(buckets: tuple[int, ...]) -> str:
    """Padding on (the model masks it), ``ids`` and ``mask`` sharing ``tokens``."""
    axis = f"tokens = {{ min = 1, max = {buckets[-1]}, buckets = {list(buckets)} }}"
    return f"pad = true\n[inputs.ids.axes]\n{axis}\n[inputs.mask.axes]\n{axis}\n"


# --- the workload --------------------------------------------------------------------------------


def draw_lengths(count: int, seed: int) -> np.ndarray:
    """``count`` request lengths: a bucket by `LENGTH_SHARES`, then uniform within it."""
    rng = np.random.default_rng(seed)
    bucket = rng.choice(len(BUCKETS), size=count, p=LENGTH_SHARES)
    low = np.array((0, *BUCKETS[:-1]))[bucket] + 1
    high = np.array(BUCKETS)[bucket]
    return rng.integers(low, high + 1)


def bucket_of(length: int) -> int:
    return next(b for b in BUCKETS if length <= b)


class Inputs:
    """Each request's tensors by length (cached: views of one row of token ids)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self._ids = rng.integers(1, VOCAB, (1, BUCKETS[-1]), dtype=np.int64)
        self._by_length: dict[int, dict[str, np.ndarray]] = {}

    def of(self, length: int) -> dict[str, np.ndarray]:
        if length not in self._by_length:
            mask = np.ones((1, length), np.float32)
            self._by_length[length] = {"ids": self._ids[:, :length], "mask": mask}
        return self._by_length[length]


async def drive_lengths(
    address: str, model: str, rate_rps: float, duration_s: float, slo_ms: float, seed: int
) -> dict[str, Any]:
    """One open-loop run of the product's generator at ``rate_rps`` whose request ``i`` has
    length ``draw_lengths(...)[i]``; its summary plus ``by_bucket`` (ok share and latency of
    ok replies per request bucket) and ``mean_batch`` (of answered requests)."""
    from clockwork_async.bench import RequestRows, Run, drive, summarize
    from clockwork_async.client import AsyncClient
    from clockwork_async.sim.workloads import poisson

    lengths = draw_lengths(round(3 * rate_rps * duration_s) + 1000, seed)
    inputs = Inputs(seed)

    class LengthRun(Run):
        """Request ``index`` carries ``lengths[index]`` tokens (one model)."""

        def send(self, instance: int, scheduled_ns: int, slo_ms: float) -> Any:
            self.inputs = {model: inputs.of(int(lengths[self.recorder.sent]))}
            return super().send(instance, scheduled_ns, slo_ms)

    async with await AsyncClient.connect(address) as client:
        run = LengthRun(client, {model: inputs.of(1)})
        rows = RequestRows(run.start_ns)
        run.observers = (rows,)
        workload = poisson(1, rate_rps, duration_s)
        rng = np.random.default_rng(seed)
        await drive(run, workload, slo_ms=slo_ms, rng=rng)
    summary = summarize(run, round(duration_s * 1e9), workload.describe())
    sent = len(rows.columns["status"])
    summary.update(by_request_rows(rows.columns, lengths[:sent]))
    return summary


def by_request_rows(columns: Mapping[str, list[Any]], lengths: np.ndarray) -> dict[str, Any]:
    """Per request bucket: requests, ok share, latency of ok replies; and the mean batch."""
    status = np.array(columns["status"])
    latency_ns = np.array(columns["latency_ns"])
    batch = np.array(columns["batch_size"])
    buckets = np.array([bucket_of(int(n)) for n in lengths])
    by_bucket = {}
    for b in BUCKETS:
        mine = buckets == b
        ok = mine & (status == "ok")
        by_bucket[b] = {
            "requests": int(mine.sum()),
            "ok_share": round(float(ok.sum() / mine.sum()), 4) if mine.any() else None,
            "latency_ms": percentiles_ms(latency_ns[ok].tolist()),
        }
    answered = batch > 0
    mean_batch = float(batch[answered].mean()) if answered.any() else 0.0
    return {"by_bucket": by_bucket, "mean_batch": round(mean_batch, 2)}


# --- the daemon and the runs ---------------------------------------------------------------------


def start(folder: Path, plan: RealPlan) -> DaemonProcess:
    """The daemon on its default executors serving both declarations of the model."""
    onnx_bytes = text_model()
    add_model(folder / "models", BUCKETED, onnx_bytes, model_toml(BUCKETS))
    add_model(folder / "models", ONE_BUCKET, onnx_bytes, model_toml(BUCKETS[-1:]))
    profiler = f"[profiler]\nwarmup_iterations = 2\niterations = {plan.iterations}\n"
    return DaemonProcess.start(folder, daemon_config(folder, extra_sections=profiler))


def read_profiles(folder: Path) -> list[dict[int, int]]:
    """The registration profiles in the daemon's cache (execute ns by batch size of the one
    executor kind), fastest first: one per bucket, the 512 one shared by both models (the
    cache is keyed by the file and the shapes). The cost grows with the length, so the
    order is the buckets'."""
    found = []
    for path in (folder / "profiles").glob("*.json"):
        kinds = json.loads(path.read_text())["profile"]["kinds"]
        (table_,) = kinds.values()
        found.append({int(b): int(ns) for b, ns in table_["execute_ns"].items()})
    return sorted(found, key=lambda p: p[min(p)])


def rule_capacity(execute_ns: Mapping[int, int], slo_ms: float) -> dict[str, Any]:
    """The profile rule's batch and req/s of one profile at ``slo_ms`` (`core.capacity`)."""
    from clockwork_async.core.capacity import capacity_batch, capacity_rps
    from clockwork_async.core.events import ModelProfile

    profile = ModelProfile(execute_ns=dict(execute_ns), load_ns=0)
    sizes = sorted(execute_ns)
    slo_ns = round(slo_ms * NS_PER_MS)
    return {
        "batch": capacity_batch(profile, sizes, slo_ns),
        "rps": round(capacity_rps(profile, sizes, slo_ns), 1),
    }


def check_answers(address: str, lengths: tuple[int, ...] = (1, 20, 100, 300, 512)) -> None:
    """Both models answer each length as ONNX Runtime does on the unpadded request (padding
    to 32 or to 512 changes nothing). Raises RuntimeError otherwise."""
    import onnxruntime as ort

    from clockwork_async.client import Client

    session = ort.InferenceSession(text_model(), providers=["CPUExecutionProvider"])
    inputs = Inputs(0)
    with Client(address, timeout_s=60.0) as client:
        for length in lengths:
            row = inputs.of(length)
            (expected,) = session.run(None, row)
            for model in (BUCKETED, ONE_BUCKET):
                result = client.infer(model, row, slo_ms=1000.0)
                got = result.outputs.get("pooled") if result.outputs else None
                if got is None or not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
                    raise RuntimeError(f"{model} at {length} tokens: {result.status} {got}")


def measure(daemon: DaemonProcess, folder: Path, plan: RealPlan, seed: int) -> dict[str, Any]:
    check_answers(daemon.api)
    found = read_profiles(folder)
    capacity = rule_capacity(found[-1], plan.slo_ms)
    # From here this process is a load generator: on the controller's CPU, below it.
    os.sched_setaffinity(0, generator_cpus())
    os.nice(max(0, GENERATOR_NICE - os.nice(0)))  # once, however many seeds
    runs = []
    for load in plan.loads:
        rate = load * capacity["rps"]
        for model in (BUCKETED, ONE_BUCKET):
            before = load_average()
            print(f"  {model}: {rate:.0f} req/s (load {before[0]})", file=sys.stderr, flush=True)
            started = time.perf_counter()
            summary = run_uvloop(
                drive_lengths(daemon.api, model, rate, plan.run_s, plan.slo_ms, seed)
            )
            summary.update(
                load=load,
                rate_rps=round(rate, 1),
                serving="buckets" if model == BUCKETED else "one bucket (512)",
                load_average=[before[0], load_average()[0]],
                wall_s=round(time.perf_counter() - started, 1),
            )
            runs.append(summary)
    execute_ms = [{b: ns / NS_PER_MS for b, ns in p.items()} for p in found]
    return {"profiles_ms": execute_ms, "one_bucket_capacity": capacity, "runs": runs}


def run_real(quick: bool, seed: int) -> dict[str, Any]:
    """Every run on one daemon; writes ``results/buckets-real[-quick].json`` and returns it."""
    plan = QUICK if quick else FULL
    log_copy = RESULTS / f"buckets-real{'-quick' if quick else ''}-daemon.log"
    machine = machine_description()  # before this process pins itself to one CPU
    with tempfile.TemporaryDirectory(prefix="clockwork-buckets-") as name:
        folder = Path(name)
        print("  starting the daemon (registration profiles 6 variants)", file=sys.stderr)
        try:
            with start(folder, plan) as daemon:
                result = measure(daemon, folder, plan, seed)
        finally:
            keep_log(folder / "daemon.log", log_copy)
    report = {
        "machine": machine,
        "load_average_after": load_average(),
        "plan": asdict(plan),
        "seed": seed,
        "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "buckets": BUCKETS},
        "daemon_log": str(log_copy),
        **result,
    }
    write_json("buckets-real", quick, report, RESULTS)
    return report


def print_real(report: Mapping[str, Any]) -> None:
    capacity = report["one_bucket_capacity"]
    print(
        f"one bucket (512) by the profile rule at {report['plan']['slo_ms']:g} ms: "
        f"b{capacity['batch']} -> {capacity['rps']} req/s"
    )
    headers = ("load", "req/s", "serving", "requests", "goodput/s", "ok %", "late", "refused")
    headers += ("dropped", "p50 ms", "p99 ms", "p99 512 ms", "batch", "lag p99", "load 1m")
    rows = []
    for r in report["runs"]:
        latency = r["latency_ms"]
        rows.append(
            (
                r["load"],
                r["rate_rps"],
                r["serving"],
                r["requests"],
                r["goodput_rps"],
                round(100 * (r["ok_over_requests"] or 0), 1),
                r["late"],
                sum(r["rejected"].values()),
                r["dropped"],
                latency["p50"],
                latency["p99"],
                r["by_bucket"][BUCKETS[-1]]["latency_ms"].get("p99"),
                r["mean_batch"],
                r["send"]["lag_ms"]["p99"],
                "-".join(map(str, r["load_average"])),
            )
        )
    print(table(headers, rows))
