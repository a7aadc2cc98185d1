"""Pure against compiled core (issue 28), side by side from one compiled install.

    python -m benchmarks.compiled [--install DIR] [--quick] [--only sim,controller,overhead,scale]
                                  [--json results/compiled.json]

``DIR`` holds a compiled build (``pip install --no-deps --target DIR <wheel>``, see
docs/benchmarks.md "Compiled core"); default: ``$CLOCKWORK_ASYNC_COMPILED``. Every
measurement but ``overhead`` runs twice in fresh processes, pure first
(``CLOCKWORK_ASYNC_PURE=1``: the same install's ``.py`` files loaded as source), then compiled,
so the two see the same source and, as far as a shared machine allows, the same load (the
1-minute load average is recorded beside each).

- ``sim``: simulated requests per wall second. The Azure Functions sample (when present; the
  first 10 minutes, quick 2, at twice the trace's rate onto 4,000 instances on 6 ResNet50-V100
  executors, 100 ms SLO) and the 2x overload (12 instances, 1,846 req/s on one executor, 2
  minutes, quick 30 s). Outcome counts and the INFER batch-size histogram must be identical.
- ``controller``: ``benchmarks.controller`` (``--quick`` passed on): the core's own CPU per
  request, replaying recorded event logs into a fresh core (best of 3).
- ``overhead``: ``benchmarks.overhead --no-flipped`` (``--quick`` passed on) run once, the
  compiled daemon and a pure one (``--before``) in interleaved blocks: the daemon's serial round
  trip, pipelined throughput and the controller's CPU per request (core, driver, sends; from
  the daemon's stats), each daemon's build checked from its stats.
- ``scale``: ``benchmarks.scale`` (``--quick`` passed on): wall seconds per virtual second and
  the core's µs per request at 10 to 150 executors.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import RESULTS, load_average

REPO = Path(__file__).resolve().parents[1]
INSTALL_VARIABLE = "CLOCKWORK_ASYNC_COMPILED"
PURE_VARIABLE = "CLOCKWORK_ASYNC_PURE"
AZURE_INSTANCES = 4000
AZURE_EXECUTORS = 6
AZURE_LOAD_SCALE = 2.0
OVERLOAD_INSTANCES, OVERLOAD_RATE_RPS, OVERLOAD_SEED = 12, 1846.0, 20
SLO_MS = 100.0
BUILDS = ("pure", "compiled")


# --- one simulation, in a child process -------------------------------------------------------


def simulate_one(name: str, quick: bool) -> dict[str, Any]:
    """Run one named simulation here; what it gave and its wall time."""
    from benchmarks.guard import find_azure_sample
    from clockwork_async import build
    from clockwork_async.sim.engine import SimConfig, Simulation, build_controller
    from clockwork_async.sim.profiles import RESNET50_V100
    from clockwork_async.sim.trace import TraceMapping, read_azure_trace
    from clockwork_async.sim.workloads import poisson, trace_replay

    if name == "azure":
        azure = find_azure_sample()
        if azure is None:
            return {"skipped": "the Azure sample (../shared/data) is absent"}
        minutes = 2.0 if quick else 10.0
        trace = read_azure_trace(azure, minutes)
        mapping = TraceMapping(trace, AZURE_INSTANCES)
        workload = trace_replay(mapping, minutes * 60.0, load_scale=AZURE_LOAD_SCALE)
        executors, seed = AZURE_EXECUTORS, 0
    else:
        duration_s = 30.0 if quick else 120.0
        workload = poisson(OVERLOAD_INSTANCES, OVERLOAD_RATE_RPS, duration_s)
        executors, seed = 1, OVERLOAD_SEED
    config = SimConfig(
        executors=executors,
        profile=RESNET50_V100,
        slo_ns=round(SLO_MS * 1e6),
        seed=seed,
        interval_ns=1_000_000_000,
    )
    simulation = Simulation(config, workload, build_controller("clockwork", {}))
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    stats = simulation.run()
    wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    return {
        "core": build.core_label(),
        "requests": stats.requests,
        "wall_s": round(wall_s, 2),
        "requests_per_wall_s": round(stats.requests / wall_s),
        "cpu_s": round(cpu_s, 2),  # this process's CPU time: less moved by a shared machine
        "requests_per_cpu_s": round(stats.requests / cpu_s),
        "outcomes": dict(sorted(stats.outcomes.items())),
        "infers_by_batch_size": {str(k): v for k, v in sorted(stats.batch_sizes.items())},
        "lost": stats.lost,
    }


# --- the side-by-side runs ---------------------------------------------------------------------


def environment(install: Path, build: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{install}{os.pathsep}{REPO}"}
    env[PURE_VARIABLE] = "1" if build == "pure" else "0"
    return env


def run_child(install: Path, build: str, arguments: list[str]) -> str:
    print(f"  {build}: {' '.join(arguments)}", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, *arguments],
        cwd=REPO,
        env=environment(install, build),
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return done.stdout


def compare_sim(install: Path, quick: bool) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in ("azure", "overload"):
        runs = {}
        for build in BUILDS:
            load = load_average()[0]
            flags = ["--sim-one", name, *(["--quick"] if quick else [])]
            out = run_child(install, build, ["-m", "benchmarks.compiled", *flags])
            runs[build] = {**json.loads(out), "load_average_1m_before": load}
        rows[name] = {**runs, **_sim_verdict(runs)}
    return rows


def _sim_verdict(runs: dict[str, Any]) -> dict[str, Any]:
    pure, compiled = runs["pure"], runs["compiled"]
    if "skipped" in pure:
        return {}
    same = all(pure[key] == compiled[key] for key in ("requests", "outcomes", "lost"))
    same = same and pure["infers_by_batch_size"] == compiled["infers_by_batch_size"]
    speedup = compiled["requests_per_wall_s"] / pure["requests_per_wall_s"]
    cpu_speedup = compiled["requests_per_cpu_s"] / pure["requests_per_cpu_s"]
    return {
        "identical_outcomes": same,
        "speedup": round(speedup, 2),
        "cpu_speedup": round(cpu_speedup, 2),
    }


def compare_overhead(install: Path, quick: bool) -> dict[str, Any]:
    """One `benchmarks.overhead` run of the compiled build with a pure daemon beside it
    (``--before``: an interpreter that selects the pure build), their blocks interleaved so
    that the machine's load hits both alike."""
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "overhead.json"
        flags = ["--no-flipped", "--json", str(out), *(["--quick"] if quick else [])]
        flags += ["--before", str(pure_interpreter(Path(folder)))]
        run_child(install, "compiled", ["-m", "benchmarks.overhead", *flags])
        targets = json.loads(out.read_text())["targets"]
        for build, name in (("pure", "daemon-before"), ("compiled", "daemon")):
            daemon = targets[name]
            if daemon.get("core_build") != build:
                raise RuntimeError(f"the {build} daemon ran core {daemon.get('core_build')!r}")
            rows[build] = {
                "controller_cost_per_request_us": daemon.get("controller_cost_per_request"),
                "serial_round_trip_us": daemon["serial_round_trip"],
                "pipelined_rps": daemon["pipelined_rps"],
                "pipelined_ok_rps": daemon["pipelined_ok_rps"],
                "load_average_1m": daemon["load_average_1m"],
            }
    return rows


def pure_interpreter(folder: Path) -> Path:
    """An executable in ``folder`` that runs this interpreter with the pure build selected."""
    path = folder / "python-pure"
    path.write_text(f'#!/bin/sh\n{PURE_VARIABLE}=1 exec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return path


def compare_scale(install: Path, quick: bool) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for build in BUILDS:
            out = Path(folder) / build
            flags = ["--out", str(out), *(["--quick"] if quick else [])]
            run_child(install, build, ["-m", "benchmarks.scale", *flags])
            (result_file,) = out.glob("scale*.json")
            cases = json.loads(result_file.read_text())["cases"]
            rows[build] = [
                {
                    key: case[key]
                    for key in (
                        "executors",
                        "requests",
                        "core_us_per_request",
                        "cpu_us_per_request",
                        "wall_s_per_virtual_s",
                        "late",
                        "lost",
                    )
                }
                for case in cases
            ]
    return rows


def compare_controller(install: Path, quick: bool) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for build in BUILDS:
            out = Path(folder) / f"controller-{build}.json"
            flags = ["--json", str(out), *(["--quick"] if quick else [])]
            run_child(install, build, ["-m", "benchmarks.controller", *flags])
            rows[build] = [
                {key: case[key] for key in ("case", "requests", "us_per_request", "outcomes")}
                for case in json.loads(out.read_text())["rows"]
            ]
    return rows


COMPARISONS = {
    "sim": compare_sim,
    "controller": compare_controller,
    "overhead": compare_overhead,
    "scale": compare_scale,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", type=Path, default=os.environ.get(INSTALL_VARIABLE))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(COMPARISONS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sim-one", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sim_one:
        print(json.dumps(simulate_one(args.sim_one, args.quick)))
        return 0
    if args.install is None:
        parser.error(f"--install DIR or ${INSTALL_VARIABLE}: a compiled build's folder")
    result: dict[str, Any] = {"install": str(args.install), "quick": args.quick}
    for name in args.only.split(","):
        print(f"{name}:", file=sys.stderr, flush=True)
        result[name] = COMPARISONS[name](args.install.resolve(), args.quick)
        print(json.dumps({name: result[name]}, indent=1))
    path = args.json or RESULTS / f"compiled{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
