"""Soak: steady 70% load on the real daemon for a long time; nothing lost, nothing grows.

    python -m benchmarks.soak [--minutes 20] [--quick] [--load 0.7] [--slowdown 10]
        [--slo-ms 100] [--json OUT]

The daemon (temporary config) runs one simulated executor with the ``tiny-sim`` profile slowed
``--slowdown`` times (10: batch 1/16 take 5/20 ms, so the profile rule of `core.capacity` gives
b16 and 800 requests/s at a 100 ms SLO). This process offers ``--load`` x that capacity as
open-loop Poisson requests on one connection for ``--minutes`` (quick: 1), sampling the
daemon's resident memory and open descriptors, and its executors' memory, from /proc.

Reported: requests sent, answers by status, lost (goal 0), ok latency; RSS drift: the median
daemon RSS over the last tenth of the run against the median over the tenth after a warm-up
tenth (goal < 5%); open descriptors at the start of the load, at its end and after the client
disconnected (goal: no growth); the fraction answered ``ok`` by minute of sending. Writes
``results/soak.json`` and ``results/soak.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import (
    RESULTS,
    keep_log,
    load_average,
    machine_description,
    percentile_of,
    pyplot,
    run_uvloop,
    save,
    summarize_ns,
    write_report,
)
from benchmarks.overload import (
    BIN_S,
    Phase,
    PhaseLog,
    ProcSampler,
    drive,
    rule_capacity_rps,
    start_daemon,
)


def window_median(
    samples: list[dict[str, float]], key: str, start_s: float, end_s: float
) -> float | None:
    """The median of ``key`` over samples taken in [start_s, end_s); None if there are none."""
    values = [s[key] for s in samples if start_s <= s["t_s"] < end_s]
    return percentile_of(values, 50) if values else None


def drift(samples: list[dict[str, float]], key: str, load_s: float) -> dict[str, Any]:
    """``key`` early (the second tenth of the load) and late (its last tenth), and the
    relative change."""
    tenth_s = load_s / 10
    early = window_median(samples, key, tenth_s, 2 * tenth_s)
    late = window_median(samples, key, load_s - tenth_s, load_s)
    change = None if not early or late is None else round((late - early) / early, 4)
    return {"early": early, "late": late, "drift": change}


def ok_by_minute(load_run: PhaseLog, load_s: float) -> list[dict[str, Any]]:
    """Requests sent in each minute of the load and the fraction of them answered ``ok``, so
    a run can tell a steady shortfall from a bad stretch (another job on the machine)."""
    bins_per_minute = round(60 / BIN_S)
    rows = []
    for minute in range(math.ceil(load_s / 60)):
        bins = range(minute * bins_per_minute, (minute + 1) * bins_per_minute)
        sent = sum(load_run.sent_bins[b] for b in bins)
        ok = sum(load_run.ok_by_sent_bin[b] for b in bins)
        rows.append({"minute": minute, "sent": sent, "ok_fraction": round(ok / max(1, sent), 4)})
    return rows


def descriptors(sampler: ProcSampler, load_s: float) -> dict[str, Any]:
    """Open descriptors of the daemon at the load's start and end, and after the client left."""
    during = [s for s in sampler.samples if s["t_s"] < load_s]
    start = during[0]["daemon_fds"] if during else None
    end = during[-1]["daemon_fds"] if during else None
    after = sampler.samples[-1]["daemon_fds"]
    growth = None if start is None or end is None else end - start
    return {"start": start, "end": end, "after_disconnect": after, "growth": growth}


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """Daemon and executor RSS and the daemon's descriptors over time."""
    plt = pyplot()
    if plt is None:
        return None
    samples = result["samples"]
    times = [s["t_s"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    top.plot(times, [s["daemon_rss_mib"] for s in samples], label="daemon")
    top.plot(times, [s["executors_rss_mib"] for s in samples], label="executors")
    top.set(ylabel="RSS (MiB)", title=f"soak: {result['load']:.0%} load")
    top.legend()
    bottom.plot(times, [s["daemon_fds"] for s in samples], label="daemon open fds")
    bottom.set(xlabel="time (s)", ylabel="descriptors")
    bottom.legend()
    return save(plt, fig, path, dpi=80)


def run(minutes: float, load: float, slowdown: float, slo_ms: float) -> dict[str, Any]:
    batch, capacity = rule_capacity_rps(slowdown, slo_ms)
    load_s = minutes * 60
    phases = [Phase("soak", load * capacity, load_s)]
    period_s = max(0.5, load_s / 600)
    with tempfile.TemporaryDirectory(prefix="clockwork-soak-") as name:
        folder = Path(name)
        with start_daemon(folder, slowdown) as daemon:
            load_run, sampler, lost, stats = run_uvloop(drive(daemon, phases, slo_ms, period_s))
            alive = daemon.process.poll() is None
        keep_log(folder / "daemon.log", RESULTS / "soak-daemon.log")
    statuses = load_run.statuses["soak"]
    return {
        "capacity_rule": {"batch": batch, "rps": round(capacity, 1)},
        "target_rps": round(load * capacity, 1),
        "load_s": load_s,
        "sent": load_run.sent,
        "statuses": dict(statuses.most_common()),
        "lost": lost,
        "ok_fraction": round(statuses["ok"] / max(1, load_run.sent), 5),
        "ok_latency": summarize_ns(load_run.latency_ns["soak"]),
        "ok_by_minute": ok_by_minute(load_run, load_s),
        "daemon_rss_mib": drift(sampler.samples, "daemon_rss_mib", load_s),
        "executors_rss_mib": drift(sampler.samples, "executors_rss_mib", load_s),
        "daemon_fds": descriptors(sampler, load_s),
        "daemon_alive": alive,
        "daemon_outcomes": stats.get("outcomes"),
        "samples": sampler.samples,
    }


def print_report(result: dict[str, Any]) -> None:
    rss, fds = result["daemon_rss_mib"], result["daemon_fds"]
    latency = result["ok_latency"]
    print(
        f"{result['load_s'] / 60:g} min at {result['target_rps']} req/s: sent {result['sent']}, "
        f"lost {result['lost']} (goal 0), answers {result['statuses']}\n"
        f"ok latency p50 {latency.get('p50_us', 0) / 1000:.2f} ms, "
        f"p99 {latency.get('p99_us', 0) / 1000:.2f} ms\n"
        f"daemon RSS {rss['early']} -> {rss['late']} MiB, drift {rss['drift']} (goal < 0.05); "
        f"executors {result['executors_rss_mib']['drift']}\n"
        f"daemon fds start {fds['start']}, end {fds['end']}, after disconnect "
        f"{fds['after_disconnect']} (goal: no growth); alive {result['daemon_alive']}"
    )
    minutes = ", ".join(f"{row['ok_fraction']:.3f}" for row in result["ok_by_minute"])
    print(f"ok fraction by minute: {minutes}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="one minute")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--slowdown", type=float, default=10.0, help="tiny-sim slowdown")
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    minutes = 1.0 if args.quick else args.minutes
    result: dict[str, Any] = {
        "benchmark": "soak",
        "quick": args.quick,
        "machine": machine_description(),
        "minutes": minutes,
        "load": args.load,
        "slowdown": args.slowdown,
        "slo_ms": args.slo_ms,
        **run(minutes, args.load, args.slowdown, args.slo_ms),
        "load_average_after": load_average(),
    }
    print_report(result)
    plot = write_plot(result, args.json.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path = write_report(args.json.stem, result, args.json.parent)
    print(f"wrote {path}" + (f" and {plot}" if plot else ""))
    fds = result["daemon_fds"]
    healthy = result["lost"] == 0 and result["daemon_alive"] and not (fds["growth"] or 0) > 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
