"""Time from ``models add`` to ready: the demo models and generated slow models.

    python -m benchmarks.registration_time [--quick] [--layers 32,64,128,256] [--json OUT]

The real daemon (``clockwork-async serve``, one pinned ONNX Runtime executor, default
``[profiler]`` settings, an empty profile cache) serves ``tiny``; this process adds each model
with ``wait=False`` and asks ``models`` every ``POLL_S`` until it is ready, noting when its job
went from ``registering`` (registering the file on the executor) to ``profiling``, then one
request of it measures its batch-1 execute time. The models: the demo ``tiny``, ``mlp`` and
``resnet-like``, and `build_slow` at ``--layers`` (one 3x3 conv kernel shared by every layer:
the time of a row grows with the layers, the file barely). ``--quick``: 64 and 256 layers only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import DaemonProcess, daemon_config, machine_description, table
from clockwork_async.client import Client
from clockwork_async.models.demo import build_slow, generate_demo_models

POLL_S = 0.05
DEMO = ("tiny", "mlp", "resnet-like")
EXECUTOR = """
[[executors]]
backend = "onnxruntime"
page_bytes = 1048576
weights_bytes = 268435456
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.registration_time")
    parser.add_argument("--quick", action="store_true", help="two slow models only")
    parser.add_argument("--layers", default="32,64,128,256", help="slow models' layer counts")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def timed_add(client: Client, name: str, onnx: bytes) -> dict[str, Any]:
    """Add ``name``; return when its job profiled and when it was ready (s from the add)."""
    started_s = time.monotonic()
    toml = "batch_sizes = [1]\n" if name.startswith("slow") else None
    added = client.add_model(name, onnx, toml, wait=False)
    profiling_s: float | None = None
    ready_s: float | None = None
    slo_ms = 0.0
    while ready_s is None:
        for row in client.models():
            if (row.name, row.version) != (name, added.version):
                continue
            now_s = time.monotonic() - started_s
            if row.state == "profiling" and profiling_s is None:
                profiling_s = now_s
            if row.state in ("ready", "loaded"):
                ready_s = now_s
                slo_ms = row.default_slo_ns / 1e6
            if row.state in ("failed", "cancelled"):
                raise RuntimeError(f"{name}: {row.state}: {row.reason}")
        time.sleep(POLL_S)
    return {"model": name, "profiling_at_s": profiling_s, "ready_s": ready_s, "slo_ms": slo_ms}


def b1_ms(client: Client, name: str, inputs: dict[str, np.ndarray]) -> float:
    result = client.infer(name, inputs, slo_ms=60_000.0)
    return result.timing_ns.get("execute", 0) / 1e6


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    layers = [64, 256] if args.quick else [int(n) for n in args.layers.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="registration-time-"))
    demo = generate_demo_models(folder / "demo", names=list(DEMO))
    daemon = DaemonProcess.start(folder, daemon_config(folder, EXECUTOR))
    rows = []
    try:
        with Client(daemon.api, timeout_s=600.0) as client:
            models = {f"{name}-new": demo[name].read_bytes() for name in DEMO}
            models |= {f"slow-{n}": build_slow(n).SerializeToString() for n in layers}
            for name, onnx in models.items():
                row = timed_add(client, name, onnx)
                (spec,) = next(m for m in client.models() if m.name == name).inputs
                shape = (1, *(d if d > 0 else 1 for d in spec.shape[1:]))
                row["b1_ms"] = b1_ms(client, name, {spec.name: np.zeros(shape, spec.dtype)})
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        daemon.stop()
    print(machine_description())
    headers = ("model", "b1 ms", "registering s", "add -> ready s", "default SLO ms")
    print(table(headers, [_cells(row) for row in rows]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


def _cells(row: dict[str, Any]) -> list[Any]:
    registering_s = row["profiling_at_s"] if row["profiling_at_s"] is not None else row["ready_s"]
    ready_s = round(row["ready_s"], 2)
    return [row["model"], round(row["b1_ms"], 1), round(registering_s, 2), ready_s, row["slo_ms"]]


if __name__ == "__main__":
    raise SystemExit(main())
