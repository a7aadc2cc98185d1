"""The p50 of one daemon at a light fixed rate through each front end, interleaved: the msgpack
API (``clockwork-async bench``) and the Open Inference Protocol over HTTP
(`benchmarks.http_loadgen`, binary tensors and JSON tensors), so that the difference between
front ends is not the difference between two daemons measured minutes apart on a shared machine
(as `benchmarks.peer_ray`'s ``clockwork`` and ``clockwork-v2http`` are).

    python -m benchmarks.light_p50 [--quick] [--rate R] [--rounds N] [--json OUT]

One daemon (``resnet-like`` on the default ONNX Runtime executor, `peer_ray`'s setup); per
round, each client in turn for ``--duration-s`` at ``--rate`` with a 100 ms SLO, the same seed
for all three in a round (the same arrivals). Generators pinned to CPU 0 at nice 10. Reports
each round's p50 and p99 of ok replies (client side) and the median of the rounds per client,
with the load average. Writes ``results/light_p50[-quick].json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import http_loadgen
from benchmarks.cpu_serving import MODEL, bench
from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    ModelFolder,
    demo_model_bytes,
    generator_cpus,
    load_average,
    machine_description,
    start_daemon,
    table,
    write_report,
)

CLIENTS = ("msgpack", "v2-binary", "v2-json")
SLO_MS = 100.0


def one(
    client: str, daemon: Any, model: Path, rate: float, duration_s: float, seed: int, out: Path
) -> dict[str, Any]:
    """p50 / p99 (ms) of one client's run."""
    if client == "msgpack":
        latency = bench(daemon, rate, duration_s, SLO_MS, out, seed)["latency_ms"]
    else:
        result = http_loadgen.run_process(
            int(daemon.http.rpartition(":")[2]),
            model,
            rate,
            duration_s,
            SLO_MS,
            seed,
            out,
            cpus=generator_cpus(),
            nice=GENERATOR_NICE,
            path=f"/v2/models/{MODEL}/infer",
            protocol=client,
        )
        latency = http_loadgen.summarize_rows(result["rows"], duration_s)["latency_ms"]
    return {"p50": latency["p50"], "p99": latency["p99"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="clockwork-light-p50-") as name:
        folder = Path(name)
        onnx = demo_model_bytes(folder / "demo", [MODEL])[MODEL]
        model = folder / f"{MODEL}.onnx"
        model.write_bytes(onnx)
        with start_daemon(folder, {MODEL: ModelFolder(onnx)}, "clockwork") as daemon:
            for index in range(args.rounds):
                found: dict[str, Any] = {"load_average": load_average()[0]}
                for client in CLIENTS:
                    out = folder / f"{client}-{index}.json"
                    found[client] = one(
                        client, daemon, model, args.rate, args.duration_s, 500 + index, out
                    )
                rounds.append(found)
    medians = {
        client: statistics.median(r[client]["p50"] for r in rounds if r[client]["p50"])
        for client in CLIENTS
    }
    return {"rounds": rounds, "median_p50_ms": {k: round(v, 3) for k, v in medians.items()}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.light_p50", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="4 rounds of 3 s (default 8 of 8 s)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s (default 50)")
    parser.add_argument("--rounds", type=int, help="rounds (default 8; quick 4)")
    parser.add_argument("--duration-s", type=float, help="per client and round (8; quick 3)")
    parser.add_argument("--json", type=Path, help="default results/light_p50[-quick].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.duration_s = args.duration_s or (3.0 if args.quick else 8.0)
    path = args.json or RESULTS / f"light_p50{'-quick' if args.quick else ''}.json"
    result = {
        "benchmark": "light_p50",
        "machine": machine_description(),
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "slo_ms": SLO_MS,
        **run(args),
        "load_average_after": load_average(),
    }
    rows = [
        [index, r["load_average"], *(f"{r[c]['p50']} / {r[c]['p99']}" for c in CLIENTS)]
        for index, r in enumerate(result["rounds"])
    ]
    rows.append(["median p50", "", *(result["median_p50_ms"][c] for c in CLIENTS)])
    print(table(["round", "load", *(f"{c} p50 / p99 ms" for c in CLIENTS)], rows))
    print(f"wrote {write_report(path.stem, result, path.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
