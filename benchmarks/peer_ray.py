"""Issue 5's peer comparison: our daemon against Ray Serve, and against our own ``fifo`` and
``timeout`` policies, side by side in one run: same model, same machine, same arrivals.

    python -m benchmarks.peer_ray [--quick] [--skip-ray] [--http-protocol v2-binary|v2-json]
        [--json OUT]

Model: the ``resnet-like`` demo model (`clockwork_async.models.demo`, 19.7 MB, conv-bound),
written once to a temporary folder; both servers load those bytes. Batching matters for it
(b16 runs at about a third of b1's time per request on these CPUs); it does not for ``mlp``.

Systems, each under open-loop Poisson load from a separate process:
- ``clockwork``, ``fifo``, ``timeout``: ``clockwork-async serve`` on its default executors
  (controller on CPU 0, one ONNX Runtime executor pinned to CPU 1, one intra-op thread), one
  daemon per policy on one folder (so all use one registration profile); load from
  ``clockwork-async bench`` pinned to CPU 0 at nice 10 (`cpu_serving.bench`).
  ``clockwork-warm``: the ``clockwork`` policy with the cold-start options for CPU executors
  on (``warm_gap_ns`` 2 ms, ``warm_up_infers`` 2; `CONTROLLERS`).
- ``clockwork-v2http``: the ``clockwork`` daemon driven through its Open Inference Protocol
  (KServe v2) HTTP front end by the same HTTP client and the same request bytes as
  ``ray-http`` (`benchmarks.http_loadgen`, CPU 0, nice 10, ``--http-protocol``: by default
  the binary tensor data extension, as tritonclient sends large tensors); the SLO rides in
  Triton's ``timeout`` request parameter. ``ok`` = an HTTP 200 (our front end answers 504 for
  ``infeasible``/``dropped`` and 429 for ``overloaded``).
- ``ray-http``, ``ray-handle``: Ray Serve (`benchmarks.ray_app`, in ``.bench-venv/ray``), one
  replica with one ONNX Runtime session (one intra-op thread) behind ``@serve.batch``, every
  replica thread pinned to CPU 1; Ray's own processes (GCS, raylet, Serve controller, HTTP
  proxy) on CPU 0 at nice 0. Over HTTP the replica reads and answers the same Open Inference
  Protocol request as ``clockwork-v2http`` (`ray_app.v2_row`). Requests time out at the SLO
  (``x-request-timeout-seconds`` per request over HTTP, Serve's per-request form of
  ``request_timeout_s``; a cancel at the deadline on the handle). Load:
  `benchmarks.http_loadgen` (CPU 0, nice 10) over HTTP, or the app process itself (CPU 0,
  reniced to 10) through a deployment handle.
All load generators share CPU 0 with the controller (ours) or the proxy (Ray): 2 cores only.

Arrivals: every system gets the same schedule at a point: bench's generator with the point's
seed (`http_loadgen.arrival_schedule` draws it the same way; the request counts are compared).

Steps: (1) the ``clockwork`` daemon profiles the model at registration; capacity = goodput of a
saturation run at 1.5x the profile rule's rate at a 100 ms SLO (as `cpu_serving`). b1 = the
profile's batch-1 execute time. (2) Points: 50/90/150/200% of that capacity, at SLOs of 2x, 3x,
5x and 10x b1 and 100 ms, plus light fixed rates (50, 100 req/s) where Ray Serve keeps up.
Quick: the load sweep at 10x b1, the SLO sweep at 200%, the light rates at 100 ms; full: every
load at every SLO, light rates at 10x b1 and 100 ms. (3) Ray: a short tuning run of each
candidate configuration (`TUNING`) over HTTP at `TUNE_RATE_RPS`, 100 ms SLO; the best goodput
(then the lowest p50) serves every point, over HTTP and through a handle.

Per system and point (`benchmarks.peer_report` has the columns): successes by the server's own
verdict, goodput = replies the client received within the SLO per second and their share,
p50/p99/p99.9 of successful replies (client side), successes received after the SLO, replies
our daemon marked ``late``, send lag (``generator_behind`` where the generator fell behind its
schedule: `clockwork_async.bench.send_verdict`, over 1% of requests sent later than 20% of the
SLO; such a run measured the generator's bursts too), and ours/peer ratios. Writes
``results/peer_ray[-quick].json``, ``.png``, ``.md`` (the tables in Markdown) and the daemon and
Ray logs beside them; prints the tables.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import http_loadgen, ray_side
from benchmarks.cpu_serving import MODEL, bench, rule_capacity
from benchmarks.http_loadgen import model_input_specs, summarize_rows
from benchmarks.lib import (
    GENERATOR_NICE,
    RESULTS,
    DaemonProcess,
    ModelFolder,
    demo_model_bytes,
    generator_cpus,
    keep_log,
    load_average,
    machine_description,
    registration_profile,
    start_daemon,
    write_report,
)
from benchmarks.peer_report import goals, markdown, print_tables, write_plot
from clockwork_async.bench import send_verdict

CAPACITY_SLO_MS = 100.0
SATURATION_FACTOR = 1.5
OURS = ("clockwork", "fifo", "timeout", "clockwork-warm", "clockwork-v2http")
OURS_HTTP = ("clockwork-v2http",)  # driven over HTTP by http_loadgen, not by bench
HTTP_PROTOCOLS = ("v2-binary", "v2-json")
# Our systems' [controller] keys: the policy, and for clockwork-warm the options for CPU
# executors at tight SLOs (docs/controller.md, "Cold starts" and "Warm-ups"). Since these became
# the default where every executor is a local ONNX Runtime CPU one (docs/configuration.md),
# clockwork-warm runs the same settings as clockwork on the default executors.
CONTROLLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "clockwork": ("clockwork", {}),
    "fifo": ("fifo", {}),
    "timeout": ("timeout", {}),
    "clockwork-warm": ("clockwork", {"warm_gap_ns": 2_000_000, "warm_up_infers": 2}),
    "clockwork-v2http": ("clockwork", {}),
}
RAY = ("ray-http", "ray-handle")
TUNE_RATE_RPS = 150.0
# (execute, max_batch_size, batch_wait_timeout_s): ray_app's ``configure`` command.
# Quick mode tries the first three.
TUNING = (
    ("thread", 16, 0.001),
    ("thread", 8, 0.002),
    ("inline", 16, 0.001),
    ("thread", 16, 0.005),
    ("thread", 1, 0.0),
)
SETTLE_S = 1.0  # after a Ray run: cancelled requests drain before the next
UNSENT_LAG_US = 10**12  # a request the generator never sent: later than any budget


@dataclass(frozen=True)
class Plan:
    point_s: float
    saturation_s: float
    tune_s: float
    tune_candidates: int  # the first N of TUNING
    cross: bool  # every load at every SLO (else the quick subset)
    loads: tuple[float, ...] = (0.5, 0.9, 1.5, 2.0)
    slo_multiples: tuple[float, ...] = (2.0, 3.0, 5.0, 10.0)
    light_rates_rps: tuple[float, ...] = (50.0, 100.0)
    http_protocol: str = "v2-binary"  # of ray-http and clockwork-v2http (http_loadgen's)
    generator_nice: int = GENERATOR_NICE  # of the load generators of our systems (CPU 0)


QUICK = Plan(point_s=3.0, saturation_s=4.0, tune_s=2.0, tune_candidates=3, cross=False)
FULL = Plan(point_s=8.0, saturation_s=10.0, tune_s=6.0, tune_candidates=len(TUNING), cross=True)


@dataclass(frozen=True)
class Point:
    """One (SLO, offered rate) cell; every system gets the same arrivals there."""

    label: str
    slo_label: str
    slo_ms: float
    load: float | None  # of our capacity; None for a light fixed rate
    rate_rps: float
    seed: int


def slos(plan: Plan, b1_ms: float) -> dict[str, float]:
    """SLO label -> ms: the multiples of b1, then 100 ms."""
    found = {f"{m:g}x b1": round(m * b1_ms, 3) for m in plan.slo_multiples}
    found[f"{CAPACITY_SLO_MS:g} ms"] = CAPACITY_SLO_MS
    return found


def points(plan: Plan, capacity_rps: float, b1_ms: float) -> list[Point]:
    """The plan's cells, in run order, seeded by position."""
    by_label = slos(plan, b1_ms)
    labels = list(by_label)
    tight_10x, fixed = labels[-2], labels[-1]
    cells: list[tuple[str, float | None]] = []
    if plan.cross:
        cells += [(slo, load) for slo in labels for load in plan.loads]
    else:  # in SLO order, as the full plan: the SLO sweep at the highest load, the load
        # sweep at 10x b1
        for slo in labels:
            loads = plan.loads if slo == tight_10x else plan.loads[-1:]
            cells += [(slo, load) for load in loads]
    light_slos = [tight_10x, fixed] if plan.cross else [fixed]
    cells += [(slo, -rate) for slo in light_slos for rate in plan.light_rates_rps]
    found = []
    for index, (slo, load) in enumerate(cells):
        if load is not None and load < 0:
            rate, load_, name = -load, None, f"{-load:g} req/s"
        else:
            assert load is not None
            rate, load_, name = load * capacity_rps, load, f"{load:.0%}"
        found.append(Point(f"{slo}, {name}", slo, by_label[slo], load_, rate, 100 + index))
    return found


# --- our daemon ----------------------------------------------------------------------------------


def our_row(point: Point, system: str, summary: dict[str, Any]) -> dict[str, Any]:
    """A bench summary as a table row. ``ok`` is the daemon's verdict (done before the
    deadline it set at arrival; ``marked_late`` replies are not ok); ``ok_after_slo_client``
    counts the ok replies the client received after the SLO; ``in_slo`` the rest."""
    latency = summary["latency_ms"]
    requests, ok, ok_after_slo = summary["requests"], summary["ok"], summary["ok_after_slo"]
    duration_s = summary["duration_seconds"]
    return {
        "system": system,
        "point": point.label,
        "slo_label": point.slo_label,
        "slo_ms": point.slo_ms,
        "load": point.load,
        "target_rps": round(point.rate_rps, 1),
        "seed": point.seed,
        "requests": summary["requests"],
        "offered_rps": summary["offered_rps"],
        "ok": ok,
        "ok_rps": round(ok / duration_s, 2),
        "in_slo_rps": round((ok - ok_after_slo) / duration_s, 2),
        "in_slo_share": round((ok - ok_after_slo) / requests, 5) if requests else None,
        "latency_ms": {k: latency.get(k) for k in ("p50", "p99", "p99.9", "max")},
        "marked_late": summary["late"],
        "ok_after_slo_client": ok_after_slo,
        "daemon_latency_ms": summary["daemon_latency_ms"],  # its own, every reply
        "outcomes": {
            "rejected": summary["rejected"],
            "dropped": summary["dropped"],
            "failed": summary["failed"],
            "late": summary["late"],
            "lost": summary["lost"],
            "errors": summary["errors"],
        },
        "send_lag_p99_ms": summary["send"]["lag_ms"].get("p99"),
        "send_late_share": summary["send"].get("late_share"),
        "generator_behind": summary["send"].get("behind"),
    }


def run_ours(
    folder: Path,
    system: str,
    plan: Plan,
    model: dict[str, ModelFolder],
    log_copy: Path,
    point_list: list[Point] | None,
    model_path: Path | None = None,
) -> dict[str, Any]:
    """One daemon of ``system`` (`CONTROLLERS`) over ``point_list``. Without points (the first
    daemon) it measures the capacity first and makes them: they are in the result's
    ``setup``."""
    print(f"  {system}: starting the daemon", file=sys.stderr, flush=True)
    setup: dict[str, Any] = {}
    policy, controller = CONTROLLERS[system]
    try:
        with start_daemon(folder, model, policy, controller) as daemon:
            if point_list is None:
                setup = _setup(folder, daemon, plan, registration_profile(folder))
                point_list = setup["points"]
            if system in OURS_HTTP:
                assert model_path is not None
                rows = [
                    _one_ours_http(folder, daemon, system, point, plan, model_path)
                    for point in point_list
                ]
            else:
                rows = [_one_ours(folder, daemon, system, point, plan) for point in point_list]
    finally:
        keep_log(folder / "daemon.log", log_copy)
    keys = {"policy": policy, **controller}
    found = {"rows": rows, "daemon_log": str(log_copy), "controller": keys}
    return found | ({"setup": setup} if setup else {})


def _setup(
    folder: Path, daemon: DaemonProcess, plan: Plan, profile: dict[str, Any]
) -> dict[str, Any]:
    """Capacity (a saturation run), b1 and the points."""
    rule = rule_capacity(profile, CAPACITY_SLO_MS)
    b1_ms = rule["execute_ms_by_batch"][min(rule["execute_ms_by_batch"])]
    rate = SATURATION_FACTOR * rule["rps"]
    print(f"  clockwork: saturation at {rate:.0f} req/s", file=sys.stderr, flush=True)
    out = folder / "sat.json"
    summary = bench(daemon, rate, plan.saturation_s, CAPACITY_SLO_MS, out, 1, plan.generator_nice)
    capacity_rps = summary["goodput_rps"]
    point_list = points(plan, capacity_rps, b1_ms)
    return {
        "points": point_list,
        "registration_profile": profile,
        "rule_capacity": rule,
        "b1_ms": b1_ms,
        "capacity": {
            "rps": capacity_rps,
            "how": f"goodput of a {plan.saturation_s:g} s saturation run offered "
            f"{SATURATION_FACTOR:g}x the profile rule's {rule['rps']} req/s at "
            f"{CAPACITY_SLO_MS:g} ms",
            "saturation": {
                k: summary[k] for k in ("requests", "ok", "late", "rejected", "ok_after_slo")
            },
        },
        "rule_capacity_by_slo": {
            p.slo_label: rule_capacity(profile, p.slo_ms)["rps"] for p in point_list
        },
    }


def _one_ours(
    folder: Path, daemon: DaemonProcess, system: str, point: Point, plan: Plan
) -> dict[str, Any]:
    progress(system, point, plan)
    before = load_average()[0]
    out = folder / f"{system}-{point.seed}.json"
    summary = bench(
        daemon, point.rate_rps, plan.point_s, point.slo_ms, out, point.seed, plan.generator_nice
    )
    return our_row(point, system, summary) | {"load_average": [before, load_average()[0]]}


def _one_ours_http(
    folder: Path, daemon: DaemonProcess, system: str, point: Point, plan: Plan, model_path: Path
) -> dict[str, Any]:
    """One point through the daemon's v2 HTTP front end, by `http_loadgen` as ``ray-http``."""
    progress(system, point, plan)
    before = load_average()[0]
    port = int(daemon.http.rpartition(":")[2])
    result = http_loadgen.run_process(
        port,
        model_path,
        point.rate_rps,
        plan.point_s,
        point.slo_ms,
        point.seed,
        folder / f"{system}-{point.seed}.json",
        cpus=generator_cpus(),
        nice=plan.generator_nice,
        path=f"/v2/models/{MODEL}/infer",
        protocol=plan.http_protocol,
        max_lag_s=ray_side.MAX_LAG_S,
    )
    row = http_row(point, system, result, plan.point_s)
    return row | {"load_average": [before, load_average()[0]]}


def progress(system: str, point: Point, plan: Plan) -> None:
    print(
        f"  {time.strftime('%H:%M:%S')} {system}: {point.label} ({point.rate_rps:.0f} req/s, "
        f"SLO {point.slo_ms:g} ms) "
        f"for {plan.point_s:g} s (load {load_average()[0]})",
        file=sys.stderr,
        flush=True,
    )


# --- Ray Serve -----------------------------------------------------------------------------------


def http_row(
    point: Point, system: str, result: dict[str, Any], duration_s: float
) -> dict[str, Any]:
    """Rows of one `http_loadgen` (or Ray handle) run as a table row: ``ok`` = an HTTP 200
    (Ray's proxy answers 408 once the request timeout = SLO passes; our v2 front end 504 or
    429 for a refusal) or a handle result before the cancel at the SLO;
    ``ok_after_slo_client`` = those the client received after the SLO."""
    summary = summarize_rows(result["rows"], duration_s)
    verdict = http_send_verdict(result["rows"], point.slo_ms)
    return {
        "system": system,
        "point": point.label,
        "slo_label": point.slo_label,
        "slo_ms": point.slo_ms,
        "load": point.load,
        "target_rps": round(point.rate_rps, 1),
        "seed": point.seed,
        "requests": summary["requests"],
        "offered_rps": summary["offered_rps"],
        "ok": summary["ok"],
        "ok_rps": summary["goodput_rps"],
        "in_slo_rps": summary["goodput_client_rps"],
        "in_slo_share": summary["ok_share_client"],
        "latency_ms": summary["latency_ms"],
        "ok_after_slo_client": summary["late"],
        "marked_late": None,
        "outcomes": summary["statuses"],
        "send_lag_p99_ms": summary["send_lag_ms"]["p99"],
        "send_late_share": verdict["late_share"],
        "generator_behind": verdict["behind"],
    }


def http_send_verdict(rows: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    """`clockwork_async.bench.send_verdict` over `http_loadgen` rows: a request it did not
    send (``behind``, ``not_sent``) counts as one that left too late."""
    unsent = ("behind", "not_sent")
    lag_us = Counter(
        lag_ns // 1000 if status not in unsent else UNSENT_LAG_US
        for lag_ns, status in zip(rows["lag_ns"], rows["status"], strict=True)
    )
    return send_verdict(lag_us, slo_ms)


def run_ray(
    folder: Path, model_path: Path, plan: Plan, point_list: list[Point], log: Path
) -> dict[str, Any]:
    """Install (once), start, tune, run every point over HTTP and a handle, stop. Returns the
    rows by system, or ``{"not_run": why}``."""
    why = ray_side.ensure_venv()
    if why is not None:
        return {"not_run": why}
    system_cpus = {min(os.sched_getaffinity(0))}
    before = ray_side.leftovers()
    started = time.monotonic()
    found: dict[str, Any] = {"rows": {name: [] for name in RAY}}
    try:
        with log.open("w") as stream:
            app = ray_side.RayApp.start(
                model_path, folder / "ray", stream, system_cpus, timeout_s=CAPACITY_SLO_MS / 1e3
            )
            try:
                found["ready"] = app.ready
                found["startup_s"] = round(time.monotonic() - started, 1)
                found["tuning"] = _tune(app, folder, model_path, plan, system_cpus)
                found["tuning_s"] = round(time.monotonic() - started - found["startup_s"], 1)
                found["config"] = _best(found["tuning"])["config"]
                app.command({"cmd": "configure", **found["config"]})
                _ray_points(app, folder, model_path, plan, point_list, found["rows"])
            finally:
                app.close()
    except ray_side.RayNotRun as error:
        found["not_run"] = str(error)
    found["removed_after"] = ray_side.remove_leftovers(before)
    found["log"] = str(log)
    return found


def _config(execute: str, batch: int, wait_s: float) -> dict[str, Any]:
    return {"execute": execute, "max_batch_size": batch, "batch_wait_timeout_s": wait_s}


def _tune(
    app: ray_side.RayApp, folder: Path, model: Path, plan: Plan, load_cpus: set[int]
) -> list[dict[str, Any]]:
    tried = []
    point = Point("tuning", "100 ms", CAPACITY_SLO_MS, None, TUNE_RATE_RPS, 99)
    for execute, batch, wait_s in TUNING[: plan.tune_candidates]:
        config = _config(execute, batch, wait_s)
        app.command({"cmd": "configure", **config})
        print(f"  ray tuning: {config}", file=sys.stderr, flush=True)
        out = folder / f"tune-{len(tried)}.json"
        result = ray_side.http_run(
            app,
            model,
            point.rate_rps,
            plan.tune_s,
            point.slo_ms,
            point.seed,
            out,
            load_cpus,
            plan.http_protocol,
        )
        row = http_row(point, "ray-http", result, plan.tune_s)
        row["replica"] = app.command({"cmd": "stats"})["stats"]
        tried.append({"config": config, "row": row})
        time.sleep(SETTLE_S)
    return tried


def _best(tried: list[dict[str, Any]]) -> dict[str, Any]:
    """The most replies within the SLO (client clock); within 3% of it, the lowest p50."""
    top = max(t["row"]["in_slo_rps"] for t in tried)
    close = [t for t in tried if t["row"]["in_slo_rps"] >= 0.97 * top]
    return min(close, key=lambda t: t["row"]["latency_ms"]["p50"] or float("inf"))


def _ray_points(
    app: ray_side.RayApp,
    folder: Path,
    model: Path,
    plan: Plan,
    point_list: list[Point],
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    """Every point over HTTP, then through a handle; rows are added to ``rows`` as they come
    (a failure part way keeps the points done)."""
    specs = model_input_specs(model.read_bytes())
    load_cpus = {min(os.sched_getaffinity(0))}
    for point in point_list:
        for system in RAY:
            progress(system, point, plan)
            before = load_average()[0]
            out = folder / f"{system}-{point.seed}.json"
            if system == "ray-http":
                result = ray_side.http_run(
                    app,
                    model,
                    point.rate_rps,
                    plan.point_s,
                    point.slo_ms,
                    point.seed,
                    out,
                    load_cpus,
                    plan.http_protocol,
                )
            else:
                result = ray_side.handle_run(
                    app, specs, point.rate_rps, plan.point_s, point.slo_ms, point.seed, out
                )
            row = http_row(point, system, result, plan.point_s)
            row["replica"] = app.command({"cmd": "stats"})["stats"]
            row["load_average"] = [before, load_average()[0]]
            rows[system].append(row)
            time.sleep(SETTLE_S)


# --- the run -------------------------------------------------------------------------------------


def arrivals_identical(systems: dict[str, Any]) -> bool:
    """True when every system that ran sent the same number of requests at every point."""
    counts: dict[str, set[int]] = {}
    for found in systems.values():
        for row in found.get("rows", []):
            counts.setdefault(row["point"], set()).add(row["requests"])
    return all(len(c) == 1 for c in counts.values())


@dataclass
class OursRun:
    """Our daemons' part of a peer comparison: the model they served (written where the peer
    reads it too), the setup the first daemon measured, its points, and each system's rows."""

    onnx: bytes
    model_path: Path
    setup: dict[str, Any]
    points: list[Point]
    systems: dict[str, Any]
    seconds: float


def run_our_systems(folder: Path, plan: Plan, stem: Path, ours: Sequence[str]) -> OursRun:
    """Run each of ``ours`` on the demo model in ``folder``: the first profiles the model and
    sets the points (capacity, b1), the others replay the same points; logs beside ``stem``."""
    onnx = demo_model_bytes(folder / "demo", [MODEL])[MODEL]
    model_path = folder / f"{MODEL}.onnx"
    model_path.write_bytes(onnx)
    model = {MODEL: ModelFolder(onnx)}
    started = time.monotonic()
    log_of = {system: stem.with_name(f"{stem.name}-{system}-daemon.log") for system in ours}
    first = run_ours(folder, ours[0], plan, model, log_of[ours[0]], None)
    setup = first.pop("setup")
    points = setup.pop("points")
    systems: dict[str, Any] = {ours[0]: first}
    for system in ours[1:]:
        systems[system] = run_ours(folder, system, plan, model, log_of[system], points, model_path)
    return OursRun(onnx, model_path, setup, points, systems, time.monotonic() - started)


def run(plan: Plan, skip_ray: bool, stem: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="clockwork-peer-ray-") as name:
        folder = Path(name)
        ours = run_our_systems(folder, plan, stem, OURS)
        phases_s = {"ours": round(ours.seconds, 1)}
        started = time.monotonic()
        if skip_ray:
            ray: dict[str, Any] = {"not_run": "--skip-ray"}
        else:
            ray = run_ray(
                folder, ours.model_path, plan, ours.points, stem.with_name(f"{stem.name}-ray.log")
            )
        phases_s["ray"] = round(time.monotonic() - started, 1)
        for system in RAY:
            rows = ray.get("rows", {}).get(system)
            ours.systems[system] = {"rows": rows} if rows else {"not_run": ray.get("not_run", "?")}
    return {
        "model": {
            "name": MODEL,
            "bytes": len(ours.onnx),
            "sha256": hashlib.sha256(ours.onnx).hexdigest(),
        },
        **ours.setup,
        "points": [asdict(p) for p in ours.points],
        "ray": {k: v for k, v in ray.items() if k != "rows"},
        "systems": ours.systems,
        "arrivals_identical": arrivals_identical(ours.systems),
        "phases_s": phases_s,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_ray", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="the quick subset, 3 s a point")
    parser.add_argument("--skip-ray", action="store_true", help="our daemons only")
    parser.add_argument(
        "--http-protocol",
        choices=HTTP_PROTOCOLS,
        default=FULL.http_protocol,
        help="the Open Inference Protocol body of ray-http and clockwork-v2http",
    )
    parser.add_argument(
        "--generator-nice",
        type=int,
        default=GENERATOR_NICE,
        help="nice of the load generators of our systems on CPU 0 (10: the controller goes "
        "first, and the generator falls behind whenever CPU 0 is busy; 0: it keeps its "
        "schedule and takes CPU 0 from the controller; docs/benchmarks.md, issue 29); "
        "Ray's load keeps ray_side's",
    )
    parser.add_argument("--json", type=Path, help="default results/peer_ray[-quick].json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = replace(
        QUICK if args.quick else FULL,
        http_protocol=args.http_protocol,
        generator_nice=args.generator_nice,
    )
    path = args.json or RESULTS / f"peer_ray{'-quick' if args.quick else ''}.json"
    started = time.monotonic()
    result = {
        "benchmark": "peer_ray",
        "quick": args.quick,
        "machine": machine_description(),
        "plan": asdict(plan),
        "tuning_candidates": [_config(*c) for c in TUNING[: plan.tune_candidates]],
        **run(plan, args.skip_ray, path.with_suffix("")),
    }
    result["load_average_after"] = load_average()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["goals"] = goals(result)
    print_tables(result)
    plot = write_plot(result, path.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path.with_suffix(".md").write_text(markdown(result))
    written = write_report(path.stem, result, path.parent)
    print(f"\nwrote {written}, {path.with_suffix('.md')}" + (f" and {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
