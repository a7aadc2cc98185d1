"""Issue 32's second peer on the Open Inference Protocol: our daemon's v2 HTTP front end against
MLServer, same model, same machine, same arrivals, same HTTP client and request bytes.

    python -m benchmarks.peer_mlserver [--quick] [--skip-mlserver] [--json OUT]

Model: the ``resnet-like`` demo model, as `benchmarks.peer_ray` (written once to a temporary
folder; both servers load those bytes).

Systems, each under open-loop Poisson load from a separate process:
- ``clockwork``: ``clockwork-async serve`` on its default executors (controller on CPU 0, one
  ONNX Runtime executor pinned to CPU 1), driven by ``clockwork-async bench`` over the msgpack
  API: it measures the capacity and sets the points, exactly as in `benchmarks.peer_ray`.
- ``clockwork-v2http``: the same daemon configuration driven through its v2 HTTP front end by
  `benchmarks.http_loadgen` (CPU 0, nice 10), JSON tensors (``v2-json``: MLServer's REST
  front end has no binary tensor data extension), the SLO in Triton's ``timeout`` parameter.
- ``mlserver``: MLServer (``.bench-venv/mlserver``, `benchmarks/requirements-mlserver.txt`)
  with the minimal custom runtime `benchmarks.mlserver_app` (one ONNX Runtime session, one
  intra-op thread, on a thread pinned to CPU 1) and its adaptive batching on
  (``max_batch_size``, ``max_batch_time``: `TUNING`, the best of a short tuning run); MLServer's
  process (event loop, HTTP, codecs, batcher) on CPU 0 at nice 0, as Ray's proxy in
  `benchmarks.peer_ray` and our controller; ``parallel_workers`` 0 (inference in the server's
  process: no hop to a worker process). Same generator, same ``v2-json`` bytes. MLServer has
  no per-request timeout: a request is answered whenever it is done, and the generator
  abandons it ``2 SLO + 50 ms`` after sending.

Points (`peer_ray.points`): 50/90/150/200% of our capacity at SLOs of 2x, 3x, 5x, 10x b1 and
100 ms, plus light fixed rates (50, 100 req/s); quick: the load sweep at 10x b1, the SLO sweep
at 200%, the light rates at 100 ms. Every system gets the same schedule at a point.

Per system and point: the columns of `benchmarks.peer_report` (``ok`` = HTTP 200 for the HTTP
systems); ratios against ``clockwork-v2http``. Goals (issue 32): ``clockwork-v2http`` at least
5x MLServer's in-SLO goodput under overload (150% and 200% load, every SLO), and its p50 at most
half of MLServer's at the light rates. Writes ``results/peer_mlserver[-quick].json``, ``.md``
and ``.png`` and the daemon and MLServer logs beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from benchmarks import http_loadgen
from benchmarks.cpu_serving import MODEL
from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    generator_cpus,
    load_average,
    machine_description,
    write_report,
)
from benchmarks.lib.venv import ensure_venv, free_port
from benchmarks.peer_ray import (
    FULL,
    QUICK,
    Plan,
    Point,
    arrivals_identical,
    http_row,
    progress,
    run_our_systems,
)
from benchmarks.peer_report import markdown, markdown_table, print_tables, ratio, write_plot

VENV = Path(".bench-venv/mlserver")
REQUIREMENTS = Path("benchmarks/requirements-mlserver.txt")
APP_DIR = Path("benchmarks").resolve()  # on MLServer's PYTHONPATH: mlserver_app.OnnxPeer
OURS = ("clockwork", "clockwork-v2http")
REFERENCE = "clockwork-v2http"
PEER = "mlserver"
PROTOCOL = "v2-json"
ORT_CPU = 1
START_TIMEOUT_S = 120.0
SETTLE_S = 1.0
DRAIN_POLL_S = 2.0  # a stats call's timeout
DRAIN_PAUSE_S = 0.5  # between two
DRAIN_CAP_S = 30.0  # a backlog not drained by then: the server is restarted
RESTART_CLOSE_S = 5.0
TUNE_RATE_RPS = 150.0
TUNE_SLO_MS = 100.0
# (max_batch_size, max_batch_time s): MLServer's adaptive batching; quick tries the first two
TUNING = ((16, 0.001), (16, 0.005), (8, 0.002))
GOAL_OVERLOAD_RATIO = 5.0
GOAL_P50_RATIO = 0.5


class MlserverNotRun(Exception):
    """MLServer cannot run; the message says why (it goes into the report)."""


# --- MLServer ------------------------------------------------------------------------------------


def write_settings(folder: Path, model: Path, http_port: int, batch: tuple[int, float]) -> None:
    """``settings.json`` and ``resnet-like/model-settings.json`` for ``mlserver start folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    server = {
        "debug": False,
        "parallel_workers": 0,
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": free_port(),
        "metrics_port": free_port(),
        "metrics_dir": str(folder / "metrics"),
        "gzip_enabled": False,
    }
    (folder / "settings.json").write_text(json.dumps(server, indent=1))
    max_batch_size, max_batch_time_s = batch
    settings = {
        "name": MODEL,
        "implementation": "mlserver_app.OnnxPeer",
        "max_batch_size": max_batch_size,
        "max_batch_time": max_batch_time_s,
        "parameters": {"uri": str(model), "extra": {"ort_cpu": ORT_CPU}},
    }
    (folder / MODEL).mkdir(exist_ok=True)
    (folder / MODEL / "model-settings.json").write_text(json.dumps(settings, indent=1))


@dataclass
class Mlserver:
    """A running ``mlserver start`` process in a session of its own."""

    process: subprocess.Popen[bytes]
    port: int
    started_s: float

    @classmethod
    def start(
        cls, folder: Path, model: Path, batch: tuple[int, float], log: IO[str], cpus: set[int]
    ) -> Mlserver:
        """Start it and wait until the model is ready. Raises MlserverNotRun."""
        port = free_port()
        write_settings(folder, model, port, batch)
        environment = os.environ | {"PYTHONPATH": str(APP_DIR)}

        def pin() -> None:  # in the child, before exec: the front CPU, nice 0
            os.sched_setaffinity(0, cpus)

        started = time.monotonic()
        process = subprocess.Popen(
            [str(VENV.resolve() / "bin" / "mlserver"), "start", str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=folder,
            start_new_session=True,
            preexec_fn=pin,
        )
        server = cls(process, port, 0.0)
        server.wait_ready(started)
        return server

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        """GET ``path``: (status, body). Raises OSError (a timeout among them)."""
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                return int(reply.status), reply.read()
        except urllib.error.HTTPError as error:
            return error.code, b""

    def wait_ready(self, started: float) -> None:
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise MlserverNotRun(f"mlserver exited ({self.process.returncode}); see its log")
            try:
                if self.get(f"/v2/models/{MODEL}/ready")[0] == 200:
                    self.started_s = round(time.monotonic() - started, 2)
                    return
            except OSError:
                pass
            time.sleep(0.25)
        self.close()
        raise MlserverNotRun(f"mlserver not ready in {START_TIMEOUT_S:g} s; see its log")

    def stats(self, timeout_s: float = DRAIN_POLL_S) -> dict[str, Any] | None:
        """The runtime's batches since the last call; None if MLServer did not answer."""
        try:
            status, body = self.get("/stats", timeout_s)
        except OSError:
            return None
        found: dict[str, Any] = json.loads(body) if status == 200 else {"error": status}
        return found

    def drain(self) -> dict[str, Any]:
        """Wait until the runtime forms no more batches (MLServer keeps serving requests the
        client abandoned: nothing cancels them), at most `DRAIN_CAP_S`. Returns the batches
        of the run (the first answer) and how long the backlog took; ``drained`` False when
        it did not end in time (the caller restarts the server)."""
        started = time.monotonic()
        first, after = None, 0
        while time.monotonic() - started < DRAIN_CAP_S:
            found = self.stats()
            if found is not None and first is None:
                first = found
            elif found is not None:
                after += found.get("batches", 0)
                if not found.get("batches"):
                    return {"replica": first, "drain_s": _since(started), "batches_after": after}
            time.sleep(DRAIN_PAUSE_S)
        found = {"replica": first, "drain_s": _since(started), "batches_after": after}
        return found | {"drained": False}

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its session (MLServer shuts down), SIGKILL if it does not."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _since(started: float) -> float:
    return round(time.monotonic() - started, 2)


def mlserver_point(
    server: Mlserver, folder: Path, model: Path, point: Point, duration_s: float
) -> dict[str, Any]:
    """One point against MLServer: a row with the batches it formed and how long its backlog
    took to drain afterwards."""
    before = load_average()[0]
    result = http_loadgen.run_process(
        server.port,
        model,
        point.rate_rps,
        duration_s,
        point.slo_ms,
        point.seed,
        folder / f"{PEER}-{point.seed}.json",
        cpus=generator_cpus(),
        nice=GENERATOR_NICE,
        path=f"/v2/models/{MODEL}/infer",
        protocol=PROTOCOL,
    )
    row = http_row(point, PEER, result, duration_s)
    row["load_average"] = [before, load_average()[0]]
    row |= server.drain()
    time.sleep(SETTLE_S)
    return row


def run_mlserver(
    folder: Path, model: Path, plan: Plan, point_list: list[Point], log_path: Path
) -> dict[str, Any]:
    """Install (once), tune, run every point with the best batching, stop. Returns the rows,
    or ``{"not_run": why}``."""
    why = ensure_venv(VENV, REQUIREMENTS, "mlserver, onnxruntime")
    if why is not None:
        return {"not_run": why}
    front = generator_cpus()  # CPU 0: MLServer's process; its ONNX Runtime thread on ORT_CPU
    found: dict[str, Any] = {"rows": [], "log": str(log_path), "front_cpus": sorted(front)}
    tuning = TUNING if plan.cross else TUNING[:2]  # quick: the first two
    try:
        with log_path.open("w") as log:
            found["tuning"] = _tune(folder, model, plan, tuning, log, front)
            best = max(found["tuning"], key=lambda t: (t["row"]["in_slo_rps"], -_p50(t)))
            found["config"] = best["config"]
            batch = (best["config"]["max_batch_size"], best["config"]["max_batch_time_s"])
            server = Mlserver.start(folder / "mlserver", model, batch, log, front)
            found["startup_s"] = server.started_s
            try:
                for point in point_list:
                    progress(PEER, point, plan)
                    row = mlserver_point(server, folder, model, point, plan.point_s)
                    found["rows"].append(row)
                    if row.get("drained") is False:  # a fresh server for the next point
                        server.close(RESTART_CLOSE_S)
                        server = Mlserver.start(folder / "mlserver", model, batch, log, front)
            finally:
                server.close()
    except (MlserverNotRun, RuntimeError, OSError) as error:
        found["not_run"] = str(error)
    return found


def _p50(tried: dict[str, Any]) -> float:
    value = tried["row"]["latency_ms"]["p50"]
    return float("inf") if value is None else float(value)


def _tune(
    folder: Path,
    model: Path,
    plan: Plan,
    tuning: tuple[tuple[int, float], ...],
    log: IO[str],
    front: set[int],
) -> list[dict[str, Any]]:
    """Each batching candidate over HTTP at `TUNE_RATE_RPS`, 100 ms SLO (a server each)."""
    point = Point("tuning", "100 ms", TUNE_SLO_MS, None, TUNE_RATE_RPS, 99)
    tried = []
    for index, batch in enumerate(tuning):
        config = {"max_batch_size": batch[0], "max_batch_time_s": batch[1]}
        print(f"  mlserver tuning: {config}", file=sys.stderr, flush=True)
        server = Mlserver.start(folder / f"mlserver-tune-{index}", model, batch, log, front)
        try:
            row = mlserver_point(server, folder, model, point, plan.tune_s)
        finally:
            server.close(RESTART_CLOSE_S)
        tried.append({"config": config, "startup_s": server.started_s, "row": row})
    return tried


# --- goals ---------------------------------------------------------------------------------------


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 32's goals for this peer, point by point: ``clockwork-v2http`` over MLServer."""
    overload, p50s = [], []
    by_point: dict[str, dict[str, dict[str, Any]]] = {}
    for found in result["systems"].values():
        for row in found.get("rows") or []:
            by_point.setdefault(row["point"], {})[row["system"]] = row
    for label, systems in by_point.items():
        ours, peer = systems.get(REFERENCE), systems.get(PEER)
        if ours is None or peer is None:
            continue
        if ours["load"] is not None and ours["load"] >= 1.5:
            value = ratio(ours["in_slo_rps"], peer["in_slo_rps"])
            met = value == "inf" or (isinstance(value, float) and value >= GOAL_OVERLOAD_RATIO)
            overload.append(
                {
                    "point": label,
                    "ours_rps": ours["in_slo_rps"],
                    "mlserver_rps": peer["in_slo_rps"],
                    "ours_over_mlserver": value,
                    "met": met,
                }
            )
        if ours["load"] is None:
            value = ratio(ours["latency_ms"]["p50"], peer["latency_ms"]["p50"])
            met = isinstance(value, float) and value <= GOAL_P50_RATIO
            p50s.append({"point": label, "ours_over_mlserver": value, "met": met})
    return {
        "overload_in_slo": overload,
        "overload_met": all(o["met"] for o in overload) if overload else None,
        "p50_light": p50s,
        "p50_met": all(p["met"] for p in p50s) if p50s else None,
    }


def _batch_sizes(row: dict[str, Any]) -> str:
    sizes = (row.get("replica") or {}).get("batch_sizes", {})
    return " ".join(f"{b}:{n}" for b, n in sizes.items())


def tuning_markdown(result: dict[str, Any]) -> str:
    """MLServer's batching candidates as a Markdown table (empty when it did not run)."""
    tuning = result["mlserver"].get("tuning") or []
    if not tuning:
        return ""
    headers = ["max batch", "max wait ms", "in SLO/s", "in SLO %", "p50 ms", "p99 ms"]
    headers += ["batches by size"]
    rows = [
        [
            t["config"]["max_batch_size"],
            t["config"]["max_batch_time_s"] * 1000,
            t["row"]["in_slo_rps"],
            round(100 * (t["row"]["in_slo_share"] or 0), 2),
            t["row"]["latency_ms"]["p50"],
            t["row"]["latency_ms"]["p99"],
            _batch_sizes(t["row"]),
        ]
        for t in tuning
    ]
    return "\n**MLServer tuning (HTTP)**\n\n" + markdown_table(headers, rows) + "\n"


# --- the run -------------------------------------------------------------------------------------


def run(plan: Plan, skip_mlserver: bool, stem: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="clockwork-peer-mlserver-") as name:
        folder = Path(name)
        ours = run_our_systems(folder, plan, stem, OURS)
        phases_s = {"ours": round(ours.seconds, 1)}
        started = time.monotonic()
        if skip_mlserver:
            peer: dict[str, Any] = {"not_run": "--skip-mlserver"}
        else:
            log = stem.with_name(f"{stem.name}-mlserver.log")
            peer = run_mlserver(folder, ours.model_path, plan, ours.points, log)
        phases_s[PEER] = round(time.monotonic() - started, 1)
        rows = peer.get("rows")
        ours.systems[PEER] = {"rows": rows} if rows else {"not_run": peer.get("not_run", "?")}
    return {
        "model": {
            "name": MODEL,
            "bytes": len(ours.onnx),
            "sha256": hashlib.sha256(ours.onnx).hexdigest(),
        },
        **ours.setup,
        "points": [asdict(p) for p in ours.points],
        "reference": REFERENCE,
        "mlserver": {k: v for k, v in peer.items() if k != "rows"},
        "systems": ours.systems,
        "arrivals_identical": arrivals_identical(ours.systems),
        "phases_s": phases_s,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_mlserver", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="the quick subset, 3 s a point")
    parser.add_argument("--skip-mlserver", action="store_true", help="our daemons only")
    parser.add_argument("--json", type=Path, help="default results/peer_mlserver[-quick].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = replace(QUICK if args.quick else FULL, http_protocol=PROTOCOL)
    path = args.json or RESULTS / f"peer_mlserver{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = {
        "benchmark": "peer_mlserver",
        "quick": args.quick,
        "machine": machine_description(),
        "load_average_before": load_average(),
        "plan": asdict(plan),
        **run(plan, args.skip_mlserver, path.with_suffix("")),
    }
    result["load_average_after"] = load_average()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["goals"] = goals(result)
    print_tables(result)
    print(tuning_markdown(result))
    plot = write_plot(result, path.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path.with_suffix(".md").write_text(markdown(result) + tuning_markdown(result))
    written = write_report(path.stem, result, path.parent)
    print(f"\nwrote {written}, {path.with_suffix('.md')}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
