"""Experiment 4 of the Clockwork paper, a realistic workload: the Azure Functions 2019 sample
(`../shared/data/traces/azure-functions-2019-500/`, 500 functions, minutes 480-959 of one day)
replayed onto model instances at a 100 ms SLO.

    python -m benchmarks.azure [--quick] [--parts sim,daemon-sim,daemon-ort] [--docs]
        [--sim-minutes M] [--rt-minutes M] [--rt-scale X] [--ort-minutes M]
        [--ort-instances N] [--ort-load F] [--trace PATH]

Parts:
- ``sim``: virtual time on the production core: 4,026 ResNet50-V100 instances (the paper's
  61 x 66) on 6 simulated executors; full mode all 480 minutes, quick 10. Durations are the
  profile's exactly unless ``--sim-noise S`` (each ``x max(0.5, 1 + S N(0,1))``).
- ``daemon-sim``: real time: the real daemon (``clockwork-async serve``, a subprocess) with 6
  simulated executors (ResNet50-V100 profile, 1,376 pages of 16 MiB each) serving 4,026
  instances (``copies``), the trace replayed from a separate process by ``clockwork-async
  bench --trace --copies``; full mode a 30-minute window, quick 2 minutes. The
  trace's rate is multiplied by ``--rt-scale`` (default 0.1, about 95 req/s: every request
  carries a 602 KB image to the daemon and on to an executor, and on 2 cores the daemon falls
  behind well before the trace's full ~950 req/s; see docs/benchmarks-experiments-b.md).
- ``daemon-ort``: reduced scale on a real ONNX Runtime CPU executor (the daemon's default on 2
  CPUs: one executor pinned to CPU 1): ``--ort-instances`` copies of the ``resnet-like`` demo
  model, the trace scaled so its mean rate over the window is ``--ort-load`` (0.6) of the
  registration profile's capacity (`core.capacity`'s rule at 100 ms); generator pinned to the
  controller's CPU at nice 10; full mode 30 minutes, quick 2.

Trace mapping (`sim.trace`): 500 functions sorted by invocations; more instances than
functions replay function ``i mod 500`` (independent Poisson arrivals inside each minute);
fewer take contiguous ranges of the sorted functions.

Reports per part: the share of requests within the SLO (ok / requests: ``ok`` is the
daemon's promise, a reply before arrival + SLO on its clock; the paper: 99.9999%), ok /
accepted, rejections by reason, dropped, late (goal 0), lost (goal 0), latency; for the
real-time parts also the share the client saw within the SLO (ok and socket-to-reply latency
<= SLO, transport included) and what the generator achieved (scheduled vs sent rate, send
lag). Writes
``results/azure[-quick].json`` and PNGs beside it; ``--docs`` copies them to docs/img/exp4-*.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    RESULTS,
    DaemonProcess,
    add_model,
    copy_to_docs,
    daemon_config,
    keep_log,
    load_average,
    machine_description,
    percent,
    plot_panels,
    pyplot,
    registration_profile,
    rejected_text,
    run_bench,
    run_uvloop,
    table,
    write_json,
)
from benchmarks.lib.sim import AZURE_SAMPLE, Row, interval_for, run_sim, windows
from clockwork_async.sim.profiles import RESNET50_V100
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import trace_replay

SLO_MS = 100.0
PAPER_WITHIN_SLO = 0.999999  # the abstract; v1 of the paper said 99.997%
PAPER_INSTANCES = 61 * 66
SIM_EXECUTORS = 6
ORT_MODEL = "resnet-like"
SIM_PREFIX = "r50"
PARTS = ("sim", "daemon-sim", "daemon-ort")


@dataclass(frozen=True)
class Plan:
    sim_minutes: float
    rt_minutes: float
    ort_minutes: float
    rt_scale: float = 0.1
    ort_instances: int = 48
    ort_load: float = 0.6
    instances: int = PAPER_INSTANCES


FULL = Plan(sim_minutes=480.0, rt_minutes=30.0, ort_minutes=30.0)
QUICK = Plan(sim_minutes=10.0, rt_minutes=2.0, ort_minutes=2.0)


# --- (i) virtual time ----------------------------------------------------------------------------


def sim_part(plan: Plan, trace: Path, policy: str, noise: float) -> Row:
    """All of ``plan.sim_minutes`` of the trace in virtual time on 6 simulated executors
    (durations exactly the profile's, or with relative noise ``noise``)."""
    mapping = TraceMapping(read_azure_trace(trace, plan.sim_minutes), plan.instances)
    duration_s = plan.sim_minutes * 60.0
    print(
        f"azure sim: {plan.sim_minutes:g} min onto {plan.instances} instances, {policy}, "
        f"load {load_average()[0]}",
        file=sys.stderr,
        flush=True,
    )
    run = run_sim(
        trace_replay(mapping, duration_s),
        executors=SIM_EXECUTORS,
        slo_ms=SLO_MS,
        policy=policy,
        interval_ns=interval_for(duration_s, 480),
        noise=noise,
    )
    step_s = 3600.0 if duration_s >= 4 * 3600 else 900.0 if duration_s >= 3600 else 60.0
    edges = [k * step_s for k in range(int(duration_s // step_s) + 1)]
    if edges[-1] < duration_s:
        edges.append(duration_s)
    return {
        "part": "sim",
        "policy": policy,
        "summary": run.summary,
        "windows": windows(run.series, edges),
        "series": run.series,
    }


# --- (ii) and (iii) real time --------------------------------------------------------------------


def sim_executors_toml(count: int) -> str:
    profile = RESNET50_V100
    weights_bytes = profile.pages_total * profile.page_bytes
    one = (
        f'[[executors]]\nbackend = "simulated"\npage_bytes = {profile.page_bytes}\n'
        f"weights_bytes = {weights_bytes}\n"
    )
    return "\n".join([one] * count)


def start_sim_daemon(folder: Path, instances: int) -> DaemonProcess:
    """The daemon with 6 simulated ResNet50-V100 executors and ``instances`` copies."""
    from clockwork_async.models.demo import build_tiny

    model_toml = f'copies = {instances}\nsim_profile = "{RESNET50_V100.name}"\n'
    add_model(folder / "models", SIM_PREFIX, build_tiny(0).SerializeToString(), model_toml)
    return DaemonProcess.start(folder, daemon_config(folder, sim_executors_toml(SIM_EXECUTORS)))


def start_ort_daemon(folder: Path, instances: int) -> DaemonProcess:
    """The daemon on its default executors with ``instances`` copies of ``resnet-like``."""
    from clockwork_async.models.demo import generate_demo_models

    path = generate_demo_models(folder / "demo", names=[ORT_MODEL])[ORT_MODEL]
    add_model(folder / "models", ORT_MODEL, path.read_bytes(), f"copies = {instances}\n")
    return DaemonProcess.start(folder, daemon_config(folder))


def replay(
    daemon: DaemonProcess,
    trace: Path,
    prefix: str,
    instances: int,
    minutes: float,
    load_scale: float,
    out: Path,
    pin: bool,
) -> Row:
    """Replay the trace onto the ``instances`` copies of ``prefix`` with ``clockwork-async
    bench --trace`` in a process of its own (pinned to the controller's CPU at nice 10 when
    ``pin``); returns its summary with its timeline. Raises RuntimeError when it leaves no
    summary."""
    flags = ["--model", prefix, "--copies", str(instances), "--trace", str(trace)]
    flags += ["--duration-s", str(minutes * 60.0), "--load-scale", f"{load_scale:.6f}"]
    flags += ["--slo-ms", str(SLO_MS), "--seed", "1", "--grace-s", "5", "--timeline"]
    summary = run_bench(daemon.api, out, flags, pin=pin)
    summary["load_average"] = [
        summary.pop("load_average_before"),
        summary.pop("load_average_after"),
    ]
    summary["generator_exit_status"] = summary.pop("bench_exit_status")
    summary["generator_pinned"] = pin
    return summary


def daemon_stats(daemon: DaemonProcess) -> Row:
    """The daemon's stats, without the per-model and per-executor lists (4,026 entries)."""
    from clockwork_async.api.async_client import AsyncClient

    async def fetch() -> Row:
        async with await AsyncClient.connect(daemon.api) as client:
            stats: Row = await client.stats()
            return stats

    stats = run_uvloop(fetch())
    return {k: v for k, v in stats.items() if not (isinstance(v, list) and len(v) > 20)}


def window_rps(trace: Path, instances: int, minutes: float) -> float:
    """The mapped trace's mean total rate over the first ``minutes`` (scale 1)."""
    mapping = TraceMapping(read_azure_trace(trace, minutes), instances)
    whole = int(minutes)
    counts = sum(int(mapping.instance_counts(m).sum()) for m in range(whole))
    if minutes > whole:
        counts += round(int(mapping.instance_counts(whole).sum()) * (minutes - whole))
    return counts / (minutes * 60.0)


def daemon_sim_part(plan: Plan, trace: Path, out: Path) -> Row:
    with tempfile.TemporaryDirectory(prefix="clockwork-azure-sim-") as name:
        folder = Path(name)
        print(f"azure daemon-sim: starting ({load_average()[0]})", file=sys.stderr, flush=True)
        try:
            with start_sim_daemon(folder, plan.instances) as daemon:
                print(
                    f"azure daemon-sim: {plan.rt_minutes:g} min at scale {plan.rt_scale:g}",
                    file=sys.stderr,
                    flush=True,
                )
                summary = replay(
                    daemon,
                    trace,
                    SIM_PREFIX,
                    plan.instances,
                    plan.rt_minutes,
                    plan.rt_scale,
                    folder / "load.json",
                    pin=False,
                )
                stats = daemon_stats(daemon)
        finally:
            keep_log(folder / "daemon.log", out / "azure-daemon-sim-daemon.log")
    full_rate = window_rps(trace, plan.instances, plan.rt_minutes)
    return {
        "part": "daemon-sim",
        "instances": plan.instances,
        "executors": f"{SIM_EXECUTORS} simulated, {RESNET50_V100.name}",
        "load_scale": plan.rt_scale,
        "trace_rps_at_scale_1": round(full_rate, 1),
        "summary": summary,
        "daemon_stats": stats,
    }


def daemon_ort_part(plan: Plan, trace: Path, out: Path) -> Row:
    from benchmarks.cpu_serving import rule_capacity

    with tempfile.TemporaryDirectory(prefix="clockwork-azure-ort-") as name:
        folder = Path(name)
        print(f"azure daemon-ort: starting ({load_average()[0]})", file=sys.stderr, flush=True)
        try:
            with start_ort_daemon(folder, plan.ort_instances) as daemon:
                rule = rule_capacity(registration_profile(folder), SLO_MS)
                trace_rps = window_rps(trace, plan.ort_instances, plan.ort_minutes)
                scale = plan.ort_load * rule["rps"] / trace_rps
                print(
                    f"azure daemon-ort: {plan.ort_minutes:g} min, capacity {rule['rps']} "
                    f"req/s, scale {scale:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                summary = replay(
                    daemon,
                    trace,
                    ORT_MODEL,
                    plan.ort_instances,
                    plan.ort_minutes,
                    scale,
                    folder / "load.json",
                    pin=True,
                )
                stats = daemon_stats(daemon)
        finally:
            keep_log(folder / "daemon.log", out / "azure-daemon-ort-daemon.log")
    return {
        "part": "daemon-ort",
        "instances": plan.ort_instances,
        "executors": "default: 1 ONNX Runtime CPU executor, pinned",
        "rule_capacity": rule,
        "target_load": plan.ort_load,
        "load_scale": round(scale, 4),
        "trace_rps_at_scale_1": round(trace_rps, 1),
        "summary": summary,
        "daemon_stats": stats,
    }


# --- reporting -----------------------------------------------------------------------------------


def outcome_row(part: Row) -> list[Any]:
    s = part["summary"]
    latency = s["latency_ms"]
    sent = s.get("send", {})
    client = s.get("client_within_slo", {}).get("share")
    return [
        part["part"],
        s["requests"],
        s["offered_rps"],
        sent.get("achieved_rps", "-"),
        s["ok"],
        percent(s["ok_over_requests"], 4),
        percent(client, 4),
        percent(s["ok_over_accepted"], 4),
        rejected_text(s["rejected"]),
        s["dropped"],
        s["failed"],
        s["late"],
        s["lost"],
        latency["p50"],
        latency["p99"],
        latency["max"],
    ]


def outcomes_table(parts: list[Row]) -> str:
    headers = ["part", "requests", "offered/s", "sent/s", "ok", "within SLO %", "client %"]
    headers += ["ok/acc %"]
    headers += ["rejected", "dropped", "failed", "late", "lost", "p50 ms", "p99 ms", "max ms"]
    rows = [outcome_row(p) for p in parts]
    return table(headers, rows) + f"\npaper (8 h, 6 V100s): within SLO {100 * PAPER_WITHIN_SLO}%"


def windows_table(part: Row) -> str:
    headers = ["window s", "offered/s", "ok/s", "infeasible/s", "dropped/s", "cold/s"]
    headers += ["loads/s", "max p99 ms", "max ms", "resident"]
    rows = [
        [
            f"{w['from_s']:g}-{w['to_s']:g}",
            w["offered_rps"],
            w["goodput_rps"],
            w.get("infeasible_per_s", 0.0),
            w.get("dropped_per_s", 0.0),
            w["cold_starts_per_s"],
            w["loads_per_s"],
            w["p99_ms"],
            w["max_ms"],
            int(w["resident_models"]),
        ]
        for w in part["windows"]
    ]
    return table(headers, rows)


def generator_table(parts: list[Row]) -> str:
    headers = ["part", "instances", "scale", "scheduled/s", "sent/s", "lag p50 ms", "lag p99 ms"]
    headers += ["lag max ms", "daemon p99 ms", "load 1m"]
    rows = []
    for part in parts:
        s = part["summary"]
        lag = s["send"]["lag_ms"]
        load = f"{s['load_average'][0][0]}-{s['load_average'][1][0]}"
        rows.append(
            [
                part["part"],
                part["instances"],
                part["load_scale"],
                s["scheduled"]["rps"],
                s["send"]["achieved_rps"],
                lag["p50"],
                lag["p99"],
                lag["max"],
                s["daemon_latency_ms"]["p99"],
                load,
            ]
        )
    return table(headers, rows)


def realtime_series(summary: Row) -> dict[str, list[float]]:
    series = dict(summary["timeline"])
    seconds = len(series["time_s"])
    for key in ("scheduled", "sent"):
        values = summary["scheduled"]["per_s"] if key == "scheduled" else summary["sent_per_s"]
        series[f"{key}_per_s"] = [float(v) for v in values[:seconds]]
        series[f"{key}_per_s"] += [0.0] * (seconds - len(series[f"{key}_per_s"]))
    return series


def write_plots(parts: list[Row], out: Path, stem: str) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for part in parts:
        if part["part"] == "sim":
            series = part["series"]
            panels = [
                ("req/s", ("offered_rps", "goodput_rps", "infeasible_per_s", "dropped_per_s")),
                ("per s", ("cold_starts_per_s", "loads_per_s")),
                ("ok latency (ms)", ("p50_ms", "p99_ms", "max_ms")),
                ("copies", ("resident_models",)),
            ]
            title = f"Azure sample onto {PAPER_INSTANCES} instances, 6 simulated V100s"
        else:
            series = realtime_series(part["summary"])
            panels = [
                ("req/s", ("scheduled_per_s", "sent_per_s", "goodput_rps")),
                ("ok latency (ms)", ("p50_ms", "p99_ms", "max_ms")),
            ]
            title = f"{part['part']}: {part['instances']} instances, {part['executors']}"
        xlabel = "simulated time (s)" if part["part"] == "sim" else "time (s)"
        path = out / f"{stem}-{part['part']}.png"
        paths.append(plot_panels(plt, series, panels, title, path, slo_ms=SLO_MS, xlabel=xlabel))
    return paths


def goals(parts: list[Row]) -> Row:
    found = {}
    for part in parts:
        s = part["summary"]
        found[part["part"]] = {
            "late": s["late"],
            "lost": s["lost"],
            "within_slo": s["ok_over_requests"],
            "paper_within_slo": PAPER_WITHIN_SLO,
        }
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--quick", action="store_true", help="10 min virtual; 2-minute real-time windows")
    add("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    add("--policy", default="clockwork", help="policy of the virtual-time part")
    add("--sim-noise", type=float, default=0.0, help="virtual time: relative stddev of durations")
    add("--sim-minutes", type=float, help="virtual-time part: minutes of the trace")
    add("--rt-minutes", type=float, help="daemon-sim: real-time window, minutes")
    add("--rt-scale", type=float, help="daemon-sim: multiplies the trace's rate")
    add("--ort-minutes", type=float, help="daemon-ort: real-time window, minutes")
    add("--ort-instances", type=int, help="daemon-ort: copies of resnet-like")
    add("--ort-load", type=float, help="daemon-ort: mean rate as a share of capacity")
    add("--trace", type=Path, default=AZURE_SAMPLE)
    add("--out", type=Path, default=RESULTS)
    add("--docs", action="store_true", help="copy the PNGs to docs/img/exp4-*")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"parts must be among {', '.join(PARTS)}")
    if not args.trace.exists():
        print(f"azure: the trace {args.trace} is not present; nothing to run", file=sys.stderr)
        return 0
    base = QUICK if args.quick else FULL
    overrides = {
        "sim_minutes": args.sim_minutes,
        "rt_minutes": args.rt_minutes,
        "rt_scale": args.rt_scale,
        "ort_minutes": args.ort_minutes,
        "ort_instances": args.ort_instances,
        "ort_load": args.ort_load,
    }
    plan = Plan(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    found: list[Row] = []
    if "sim" in parts:
        found.append(sim_part(plan, args.trace, args.policy, args.sim_noise))
    if "daemon-sim" in parts:
        found.append(daemon_sim_part(plan, args.trace, args.out))
    if "daemon-ort" in parts:
        found.append(daemon_ort_part(plan, args.trace, args.out))
    stem = "azure-quick" if args.quick else "azure"
    result: dict[str, Any] = {
        "experiment": "4: realistic workload (Azure Functions 2019 sample)",
        "quick": args.quick,
        "plan": asdict(plan),
        "slo_ms": SLO_MS,
        "trace": str(args.trace),
        "machine": machine,
        "load_average_end": load_average(),
        "goals": goals(found),
        "parts": found,
    }
    plots = write_plots(found, args.out, stem)
    result["plots"] = [str(p) for p in plots]
    if args.docs:
        result["docs_plots"] = [str(p) for p in copy_to_docs(plots, "exp4")]
    write_json("azure", args.quick, result, args.out)
    print(outcomes_table(found))
    realtime = [p for p in found if p["part"] != "sim"]
    if realtime:
        print("\nload generator (achieved vs scheduled):")
        print(generator_table(realtime))
    for part in found:
        if part["part"] == "sim":
            print("\nsim, per window:")
            print(windows_table(part))
    late_or_lost = any(g["late"] or g["lost"] for g in result["goals"].values())
    return 1 if late_or_lost else 0


if __name__ == "__main__":
    sys.exit(main())
