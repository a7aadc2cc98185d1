"""The daemon's own capacity: offered load stepped up against executors that are never the
limit, until the generator itself cannot keep up. Does goodput hold past the knee?

    python -m benchmarks.daemon_capacity [--quick] [--sizes 602kb,16b] [--daemon-python PY]

One daemon per row size, one simulated executor sped up 100x (``slowdown`` 0.01, so the
executor is never the limit) pinned to CPU 1, one model, SLO 100 ms; open-loop Poisson from
`clockwork-async bench`, pinned to CPU 0 (the controller's CPU) at nice 10. Row sizes:
``602kb`` (the ``resnet50-v100`` profile: one 3x224x224 float32 image) and ``16b``
(``tiny-sim``: 4 floats).

In the same run, a raw ingest reference: a small server (its own process, the project's codec
and `connection`) that reads the same frames and answers each with a short ``ok`` reply, driven
by the same bench at the same steps. Per step: goodput, ``late`` on the daemon's clock and the
client's (``ok`` replies that reached the client after the SLO), accepted-then-dropped,
refusals by cause, the daemon's loop lag and controller cost per request, its RSS, and what
the generator sent against its schedule (a step it could not keep, under 95% of the schedule,
is marked and not counted). The **knee** is the highest counted offered rate whose goodput is
at least 99% of offered with nothing late.

``--daemon-python`` runs the daemon with another interpreter (an older install, to compare
before and after with the same generator).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    RESULTS,
    DaemonProcess,
    add_model,
    copy_to_docs,
    daemon_config,
    machine_description,
    pyplot,
    run_bench,
    run_uvloop,
    save,
    serve_wire,
    start_wire_server,
    table,
    write_json,
)
from clockwork_async.wire.messages import ModelStatus, TensorSpec

SLO_MS = 100.0
SLOWDOWN = 0.01
SUSTAINED = 0.95  # of the scheduled rate: below, the generator could not keep the step
KNEE_GOODPUT = 0.99
EXECUTOR_CPU = 1  # the controller pins itself to CPU 0, which the generator shares
EXECUTOR = f"""
[[executors]]
backend = "simulated"
cpus = [{EXECUTOR_CPU}]
page_bytes = 4194304
weights_bytes = 536870912
slowdown = {SLOWDOWN}
"""


@dataclass(frozen=True)
class RowSize:
    name: str
    sim_profile: str
    input_shape: tuple[int, ...]
    rates_rps: tuple[int, ...]
    quick_rates_rps: tuple[int, ...]


SIZES = {
    "602kb": RowSize(
        "602kb",
        "resnet50-v100",
        (3, 224, 224),
        (400, 800, 1000, 1200, 1600, 2000, 2500, 3000),
        (500, 1000, 1500, 2500),
    ),
    "16b": RowSize(
        "16b",
        "tiny-sim",
        (4,),
        (2000, 4000, 6500, 9000, 12000, 15000),
        (2000, 6500, 12000),
    ),
}


# --- the raw ingest reference (its own process) --------------------------------------------------


def ingest_reply(model: ModelStatus) -> Callable[[Any], Any]:
    """The ingest reference's answers: ListModels -> ``model``; InferRequest -> a short
    ``ok`` InferReply (no outputs)."""
    from clockwork_async.wire.messages import InferReply, InferRequest, ListModels, ModelsReply

    def respond(message: Any) -> Any:
        if isinstance(message, InferRequest):
            return InferReply(message.request_id, "ok", "")
        if isinstance(message, ListModels):
            return ModelsReply(message.request_id, "ok", "1 model", (model,))
        return None

    return respond


def ingest_model(input_shape: tuple[int, ...]) -> ModelStatus:
    """One model ``m`` taking rows of ``input_shape``."""
    spec = TensorSpec("input", "float32", (-1, *input_shape))
    return ModelStatus("m", "m", "ready", batch_sizes=(1,), inputs=(spec,))


def start_ingest(input_shape: tuple[int, ...]) -> tuple[subprocess.Popen[bytes], str]:
    """The reference server's process (`serve_wire`) and its address."""
    shape = ",".join(str(d) for d in input_shape)
    argv = [sys.executable, "-m", "benchmarks.daemon_capacity", "--serve-ingest", shape]
    return start_wire_server(argv)


# --- one step ------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def daemon_stats(address: str) -> dict[str, Any]:
    from clockwork_async.client import Client

    with Client(address) as client:
        return dict(client.stats())


def step(
    address: str, model: str, rate_rps: int, duration_s: float, folder: Path, pid: int | None
) -> dict[str, Any]:
    """One bench run at ``rate_rps``; with ``pid`` (a daemon), its stats and RSS around it."""
    before = daemon_stats(address) if pid is not None else {}
    flags = ["--model", model, "--rate", str(rate_rps), "--duration-s", str(duration_s)]
    flags += ["--slo-ms", str(SLO_MS), "--seed", str(rate_rps), "--grace-s", "3"]
    summary = run_bench(address, folder / f"bench-{model}-{rate_rps}.json", flags)
    sent_rps = summary["send"]["achieved_rps"]
    # bench sends every scheduled request, late if it must: over the span it took to send them
    span_s = max(duration_s, summary["requests"] / sent_rps) if sent_rps else duration_s
    row: dict[str, Any] = {
        "offered_rps": rate_rps,
        "sent_rps": sent_rps,
        "sustained": sent_rps >= SUSTAINED * rate_rps,
        "goodput_rps": round(summary["ok"] / span_s, 1),
        "ok": summary["ok"],
        "requests": summary["requests"],
        "late_daemon": summary["late"],
        "late_client": summary["ok_after_slo"],
        "dropped": summary["dropped"],
        "failed": summary["failed"],
        "lost": summary["lost"],
        "refused": summary["rejected"],
        "client_cpu": summary["client"],
    }
    if pid is not None:
        after = daemon_stats(address)
        row |= _daemon_side(before, after, pid)
    return row


def _daemon_side(before: dict[str, Any], after: dict[str, Any], pid: int) -> dict[str, Any]:
    submitted = after["submitted"] - before["submitted"]

    def per_request(key: str) -> float | None:
        total_after = after[key] * after["submitted"]
        total_before = before[key] * before["submitted"]
        return round((total_after - total_before) / submitted / 1000, 1) if submitted else None

    lag = after["loop_lag"]
    return {
        "loop_lag_p99_ms": round(lag["p99_ns"] / 1e6, 3),
        "loop_lag_max_ms": round(lag["max_ns"] / 1e6, 3),
        "core_us": per_request("core_ns_per_request"),
        "dispatch_us": per_request("driver_ns_per_request"),
        "send_us": per_request("send_ns_per_request"),
        "rss_mib": round(rss_kib(pid) / 1024, 1),
    }


def knee(rows: Sequence[dict[str, Any]]) -> int | None:
    """The highest sustained offered rate with goodput >= 99% of it and nothing late."""
    good = [
        r["offered_rps"]
        for r in rows
        if r["sustained"]
        and r["goodput_rps"] >= KNEE_GOODPUT * r["offered_rps"]
        and not r["late_daemon"]
        and not r["late_client"]
    ]
    return max(good, default=None)


# --- a whole size -------------------------------------------------------------------------------


def run_size(
    size: RowSize, quick: bool, daemon_python: str, busy_poll_us: float | None = None
) -> dict[str, Any]:
    rates = size.quick_rates_rps if quick else size.rates_rps
    duration_s = 4.0 if quick else 12.0
    with tempfile.TemporaryDirectory(prefix="clockwork-capacity-") as name:
        folder = Path(name)
        from clockwork_async.models.demo import build_tiny

        toml = f'sim_profile = "{size.sim_profile}"\ndefault_slo_ms = {SLO_MS}\n'
        add_model(folder / "models", "m", build_tiny(0).SerializeToString(), toml)
        config = daemon_config(folder, EXECUTOR)
        server = 'log_level = "warning"'
        if busy_poll_us is not None:
            server += f"\nbusy_poll_us = {busy_poll_us}"
        config.write_text(config.read_text().replace('log_level = "info"', server))
        daemon = DaemonProcess.start(folder, config, python=daemon_python)
        rows = []
        try:
            for rate_rps in rates:
                print(f"  {size.name} daemon at {rate_rps} req/s ...", flush=True)
                rows.append(step(daemon.api, "m", rate_rps, duration_s, folder, daemon.pid))
        finally:
            daemon.stop()
        ingest, ingest_address = start_ingest(size.input_shape)
        reference = []
        try:
            for rate_rps in rates:
                print(f"  {size.name} ingest reference at {rate_rps} req/s ...", flush=True)
                reference.append(step(ingest_address, "m", rate_rps, duration_s, folder, None))
        finally:
            ingest.kill()
            ingest.wait()
    return {
        "size": size.name,
        "daemon": rows,
        "reference": reference,
        "knee_rps": knee(rows),
        "reference_max_goodput_rps": max((r["goodput_rps"] for r in reference), default=0.0),
    }


def print_report(result: dict[str, Any]) -> None:
    for size in result["sizes"]:
        print(
            f"\n{size['size']}: knee {size['knee_rps']} req/s; reference peak goodput "
            f"{size['reference_max_goodput_rps']} req/s"
        )
        headers = (
            "offered",
            "sent",
            "goodput",
            "late d/c",
            "dropped",
            "refused",
            "lag p99 ms",
            "dispatch us",
            "rss MiB",
            "ref goodput",
        )
        rows = []
        for daemon, reference in zip(size["daemon"], size["reference"], strict=True):
            mark = "" if daemon["sustained"] else " (not kept)"
            rows.append(
                (
                    f"{daemon['offered_rps']}{mark}",
                    daemon["sent_rps"],
                    daemon["goodput_rps"],
                    f"{daemon['late_daemon']}/{daemon['late_client']}",
                    daemon["dropped"],
                    sum(daemon["refused"].values()),
                    daemon.get("loop_lag_p99_ms"),
                    daemon.get("dispatch_us"),
                    daemon.get("rss_mib"),
                    reference["goodput_rps"],
                )
            )
        print(table(headers, rows))


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    sizes = result["sizes"]
    figure, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for axis, size in zip(axes[0], sizes, strict=True):
        offered = [r["offered_rps"] for r in size["daemon"]]
        axis.plot(offered, offered, ":", color="grey", label="offered")
        axis.plot(offered, [r["goodput_rps"] for r in size["daemon"]], "o-", label="daemon ok")
        axis.plot(
            offered, [r["goodput_rps"] for r in size["reference"]], "s--", label="ingest reference"
        )
        if size["knee_rps"]:
            axis.axvline(size["knee_rps"], color="green", alpha=0.4, label="knee")
        axis.set_title(f"{size['size']} rows, SLO {SLO_MS:g} ms")
        axis.set_xlabel("offered (req/s)")
        axis.set_ylabel("goodput (req/s)")
        axis.legend(fontsize=8)
    return save(plt, figure, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter steps")
    parser.add_argument("--sizes", default="602kb,16b", help="comma-separated: 602kb, 16b")
    parser.add_argument("--daemon-python", default=sys.executable, help="runs the daemon")
    parser.add_argument("--label", default="", help="a name for this run in its file names")
    parser.add_argument(
        "--busy-poll-us",
        type=float,
        default=None,
        help="the daemon's server.busy_poll_us (default: the daemon's default)",
    )
    parser.add_argument("--serve-ingest", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_ingest:
        model = ingest_model(tuple(int(d) for d in args.serve_ingest.split(",")))
        run_uvloop(serve_wire("ingest", ingest_reply(model)))
        return 0
    started = time.time()
    result: dict[str, Any] = {
        "machine": machine_description(),
        "daemon_python": args.daemon_python,
        "slo_ms": SLO_MS,
        "slowdown": SLOWDOWN,
        "sizes": [
            run_size(SIZES[name], args.quick, args.daemon_python, args.busy_poll_us)
            for name in args.sizes.split(",")
        ],
    }
    result["wall_s"] = round(time.time() - started, 1)
    name = f"daemon_capacity{'-' + args.label if args.label else ''}"
    path = write_json(name, args.quick, result, RESULTS)
    print_report(result)
    plot = write_plot(result, RESULTS / f"{name}.png")
    if plot is not None:
        copy_to_docs([plot], "capacity")
    print(json.dumps({"wrote": str(path)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
