"""The Open Inference Protocol's HTTP front end under overload, JSON tensors against binary:
what the daemon's own loop does when more requests arrive than it can serve.

    python -m benchmarks.v2_overload [--quick] [--factor 2] [--slo-ms 100] [--before PYTHON]
        [--executor onnx|simulated] [--rate R] [--json OUT]

Model: the ``resnet-like`` demo model (as `benchmarks.peer_ray`: 12 KB float32 rows, about
62 KB as a JSON ``data`` list), on the daemon's default executors (controller on CPU 0, one
ONNX Runtime executor pinned to CPU 1). Load: `benchmarks.http_loadgen` (CPU 0, nice 10),
open-loop Poisson at ``--factor`` x the profile rule's capacity at ``--slo-ms``
(`cpu_serving.rule_capacity`), the SLO in Triton's ``timeout`` request parameter, ``v2-json``
then ``v2-binary`` bodies, each point on a fresh daemon (one folder: one registration profile).
With ``--executor simulated`` the model is a 3x224x224 float32 image (about 3 MB as JSON) on
one near-zero simulated executor (``resnet50-v100`` times x 0.02), so that the daemon's own
loop is the limit, and the generator runs on the executor's CPU; ``--rate`` sets the offered
rate.

With ``--before PYTHON`` a daemon run by another install's interpreter (the build to compare
against) takes every point too, alternating with this one's, so that the machine's load hits
both alike.

Per point: the generator's rows (`http_loadgen.summarize_rows`: HTTP 200 in the SLO per second,
statuses, send lag), the daemon's answers by status (``clockwork_api_requests_total``, the
daemon's own verdicts: ``ok``, ``late``, ``overloaded``, ``infeasible``, ``dropped``), its event
loop's lag over the point (``clockwork_event_loop_lag_seconds``: mean, share of 100 ms probes
later than 10 ms, the highest bucket reached) and its CPU per request offered.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import http_loadgen, ray_side
from benchmarks.cpu_serving import MODEL, rule_capacity
from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    DaemonProcess,
    add_model,
    daemon_config,
    demo_model_bytes,
    generator_cpus,
    keep_log,
    load_average,
    machine_description,
    registration_profile,
    table,
    write_report,
)
from benchmarks.overhead import near_zero_executor
from benchmarks.overhead_v2 import process_cpu_ns
from clockwork_async.testing import clean_environ

PROTOCOLS = ("v2-json", "v2-binary")
LAG = "clockwork_event_loop_lag_seconds"
ANSWERS = "clockwork_api_requests_total"
LATE_PROBE_S = 0.01
SIM_PROFILE = "resnet50-v100"  # the simulated executor's model: one 3x224x224 float32 image
SIM_IMAGE = (3, 224, 224)


def scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the daemon's metrics, by name and labels."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def loop_lag(before: dict[Any, float], after: dict[Any, float]) -> dict[str, Any]:
    """The loop lag histogram over a point: mean, share of probes over 10 ms, highest bucket."""

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    count = delta(f"{LAG}_count")
    buckets = sorted(
        (float(dict(labels)["le"]), delta(name, labels))
        for name, labels in after
        if name == f"{LAG}_bucket"
    )
    within = dict(buckets).get(LATE_PROBE_S, 0.0)
    highest = next((le for le, n in buckets if n >= count), None)
    return {
        "probes": int(count),
        "mean_ms": round(1000 * delta(f"{LAG}_sum") / count, 2) if count else None,
        "over_10ms_share": round(1 - within / count, 3) if count else None,
        "max_bucket_ms": None if highest is None else 1000 * highest,
    }


def answers(before: dict[Any, float], after: dict[Any, float]) -> dict[str, int]:
    """The daemon's HTTP answers over a point, by status."""
    found = {}
    for (name, labels), value in after.items():
        tags = dict(labels)
        if name == ANSWERS and tags.get("protocol") == "http":
            n = int(value - before.get((name, labels), 0.0))
            if n:
                found[tags["status"]] = n
    return dict(sorted(found.items()))


def config_of(folder: Path, executor: str) -> Path:
    """The daemon's config: its default ONNX Runtime executors, or ``simulated``: one
    near-zero simulated executor (`benchmarks.overhead`) on the last CPU."""
    if executor == "onnx":
        return daemon_config(folder)
    return daemon_config(folder, near_zero_executor(max(os.sched_getaffinity(0))))


def load_cpus(executor: str) -> set[int]:
    """The generator's CPU: the controller's beside ONNX Runtime executors (as the peer
    benchmarks), the simulated executor's otherwise (it leaves that CPU nearly idle)."""
    return generator_cpus() if executor == "onnx" else {max(os.sched_getaffinity(0))}


def one_point(
    folder: Path, python: str, protocol: str, rate_rps: float, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """A fresh daemon (run by ``python``) under one overload point."""
    config = config_of(folder, args.executor)
    load_before = load_average()[0]
    daemon = DaemonProcess.start(folder, config, env=clean_environ(folder), python=python)
    try:
        port = int(daemon.http.rpartition(":")[2])
        metrics, cpu_ns = scrape(daemon), process_cpu_ns(daemon.pid)
        out = folder / f"load-{seed}.json"
        result = http_loadgen.run_process(
            port,
            folder / f"{MODEL}.onnx",
            rate_rps,
            args.duration_s,
            args.slo_ms,
            seed,
            out,
            cpus=load_cpus(args.executor),
            nice=GENERATOR_NICE,
            path=f"/v2/models/{MODEL}/infer",
            protocol=protocol,
            max_lag_s=ray_side.MAX_LAG_S,
        )
        cpu_ns = process_cpu_ns(daemon.pid) - cpu_ns
        after = scrape(daemon)
    finally:
        daemon.stop()
    summary = http_loadgen.summarize_rows(result["rows"], args.duration_s)
    return {
        "protocol": protocol,
        "offered_rps": summary["offered_rps"],
        "in_slo_rps": summary["goodput_client_rps"],
        "client": summary,
        "daemon_answers": answers(metrics, after),
        "loop_lag": loop_lag(metrics, after),
        "daemon_cpu_us_per_request": round(cpu_ns / 1000 / max(1, summary["requests"]), 1),
        "load_average": [load_before, load_average()[0]],
    }


def image_identity() -> bytes:
    """An ONNX model whose one input is the ``resnet50-v100`` profile's (``input``, float32
    Nx3x224x224): what the simulated executor serves, as the generator reads it."""
    import onnx
    from onnx import TensorProto, helper

    shape = ["N", *SIM_IMAGE]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "image",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    if args.executor == "onnx":
        onnx = demo_model_bytes(folder / "demo", [MODEL])[MODEL]
        add_model(folder / "models", MODEL, onnx)
    else:
        onnx = image_identity()
        add_model(folder / "models", MODEL, onnx, f'sim_profile = "{SIM_PROFILE}"\n')
    (folder / f"{MODEL}.onnx").write_bytes(onnx)
    daemons = {"after": sys.executable} | ({"before": args.before} if args.before else {})
    config = config_of(folder, args.executor)
    first = DaemonProcess.start(folder, config, env=clean_environ(folder))
    first.stop()  # registered and profiled: every daemon after it reuses the profile
    capacity = rule_capacity(registration_profile(folder), args.slo_ms)
    rate_rps = args.rate or args.factor * capacity["rps"]
    rows = []
    for round_ in range(args.rounds):
        for protocol in PROTOCOLS:
            order = list(daemons.items())
            for name, python in order if round_ % 2 == 0 else order[::-1]:
                print(f"  {name} {protocol} at {rate_rps:.0f} req/s", file=sys.stderr, flush=True)
                point = one_point(folder, python, protocol, rate_rps, args, 100 + round_)
                rows.append({"daemon": name, "round": round_} | point)
    keep_log(folder / "daemon.log", RESULTS / "v2_overload-daemon.log")
    return {"capacity": capacity, "rate_rps": round(rate_rps, 1), "rows": rows}


def print_rows(rows: list[dict[str, Any]]) -> None:
    header = ["daemon", "body", "offered/s", "in SLO/s", "daemon answers", "loop lag mean ms"]
    header += ["probes >10 ms", "lag max bucket ms", "daemon CPU µs/req", "send lag p99 ms"]
    lines = [
        [
            row["daemon"],
            row["protocol"],
            row["offered_rps"],
            row["in_slo_rps"],
            " ".join(f"{k} {v}" for k, v in row["daemon_answers"].items()),
            row["loop_lag"]["mean_ms"],
            row["loop_lag"]["over_10ms_share"],
            row["loop_lag"]["max_bucket_ms"],
            row["daemon_cpu_us_per_request"],
            row["client"]["send_lag_ms"].get("p99"),
        ]
        for row in rows
    ]
    print(table(header, lines))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.v2_overload", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="one round of 5 s points")
    parser.add_argument("--factor", type=float, default=2.0, help="x the rule's capacity")
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--rate", type=float, help="requests/s offered (instead of --factor)")
    parser.add_argument(
        "--executor",
        choices=("onnx", "simulated"),
        default="onnx",
        help="ONNX Runtime executors, or a near-zero simulated one (the loop is the limit)",
    )
    parser.add_argument("--before", help="also a daemon run by this interpreter (another build)")
    parser.add_argument("--json", type=Path, help="default results/v2_overload[-quick].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.duration_s, args.rounds = (5.0, 1) if args.quick else (15.0, 2)
    path = args.json or RESULTS / f"v2_overload{'-quick' if args.quick else ''}.json"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="clockwork-v2-overload-") as name:
        found = run(args, Path(name))
    result = {
        "benchmark": "v2_overload",
        "quick": args.quick,
        "machine": machine_description(),
        "factor": args.factor,
        "slo_ms": args.slo_ms,
        "executor": args.executor,
        "duration_s": args.duration_s,
        **found,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print_rows(result["rows"])
    print(f"wrote {write_report(path.stem, result, path.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
