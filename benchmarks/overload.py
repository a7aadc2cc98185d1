"""Overload: 10x capacity for a minute against the real daemon, then normal load again.

    python -m benchmarks.overload [--quick] [--factor 10] [--slowdown 50] [--slo-ms 100]
        [--json OUT]

The daemon (``clockwork-async serve``, temporary config) runs one simulated executor with the
``tiny-sim`` profile slowed ``--slowdown`` times (50: batch 1/4/8/16 take 25/40/60/100 ms), so
capacity is modest and this one process can offer ten times it. Capacity is the profile rule
of `core.capacity` (largest b with 2 exec(b) + margin <= SLO: b4 at 100 ms, 100 requests/s).
Open-loop Poisson load from this process on one connection (`clockwork_async.bench`'s `Run`
through `phases`, observed by `PhaseLog`): ``before`` at 50% of capacity,
``overload`` at ``--factor`` x capacity (quick: 10 s, full: 60 s), ``after`` at 50% again.

Reported: the daemon's and its executors' resident memory over time (sampled from /proc every
250 ms), answers by status and phase (rejections named), lost requests (goal 0), goodput per
phase, and the time from the end of the overload until goodput is full again: the start of the
first 100 ms bin (by send time) from which at least 95% of the requests sent in the next second
were answered ``ok`` (goal <= 1 s; the ``before`` phase's ok fraction is reported beside it,
since a tight SLO has a few ``infeasible`` answers even at 50% load). Writes
``results/overload.json`` and ``results/overload.png`` (RSS and offered/goodput over time).

`soak` reuses `Phase`, `PhaseLog`, `ProcSampler` and `drive` from here.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import (
    RESULTS,
    DaemonProcess,
    add_model,
    children,
    daemon_config,
    keep_log,
    load_average,
    machine_description,
    pyplot,
    run_uvloop,
    save,
    summarize_ns,
    table,
    write_report,
)
from clockwork_async.bench import Run
from clockwork_async.bench import drive as drive_run
from clockwork_async.bench import phases as poisson_phases
from clockwork_async.client import AsyncClient, ClientError, InferResult

MODEL = "tiny"
NS_PER_S = 1_000_000_000
BIN_S = 0.1  # bins of the goodput series and of the recovery rule
RECOVERY_WINDOW_S = 1.0  # "full goodput": of the requests sent in this long,
RECOVERY_OK_FRACTION = 0.95  # at least this fraction answered ok
MAX_NOT_OK = 100_000  # answers other than ok kept with their send times
SIM_EXECUTOR = """
[[executors]]
backend = "simulated"
page_bytes = 1048576
weights_bytes = 16777216
slowdown = {slowdown}
"""


# --- the daemon ----------------------------------------------------------------------------------


def start_daemon(folder: Path, slowdown: float, server: str = "") -> DaemonProcess:
    """The daemon serving ``tiny`` (the ``tiny-sim`` profile) on one simulated executor
    slowed ``slowdown`` times; ``server``: extra lines of its ``[server]`` section."""
    from clockwork_async.models.demo import build_tiny

    add_model(folder / "models", MODEL, build_tiny(0).SerializeToString())
    config = daemon_config(folder, SIM_EXECUTOR.format(slowdown=slowdown))
    text = config.read_text().replace("[server]\n", f"[server]\n{server}\n", 1)
    config.write_text(text.replace('log_level = "info"', 'log_level = "warning"'))
    return DaemonProcess.start(folder, config)


def rule_capacity_rps(slowdown: float, slo_ms: float) -> tuple[int, float]:
    """The profile rule's batch and requests per second for ``tiny-sim`` x ``slowdown``."""
    from clockwork_async.core.capacity import capacity_batch, capacity_rps
    from clockwork_async.core.events import ModelProfile
    from clockwork_async.sim.profiles import TINY_SIM

    execute_ns = {b: round(ns * slowdown) for b, ns in TINY_SIM.execute_ns.items()}
    profile = ModelProfile(execute_ns=execute_ns, load_ns=round(TINY_SIM.load_ns * slowdown))
    slo_ns = round(slo_ms * 1e6)
    sizes = TINY_SIM.batch_sizes
    return capacity_batch(profile, sizes, slo_ns), capacity_rps(profile, sizes, slo_ns)


# --- /proc sampling ------------------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    """Descriptors process ``pid`` holds (0 if it is gone)."""
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


@dataclass
class ProcSampler:
    """Samples the daemon's RSS and descriptors, and its executors' RSS, every ``period_s``."""

    pid: int
    period_s: float
    start_ns: int = field(default_factory=time.monotonic_ns)
    samples: list[dict[str, float]] = field(default_factory=list)

    def sample(self) -> dict[str, float]:
        executors = children(self.pid)  # the daemon's executors
        row = {
            "t_s": round((time.monotonic_ns() - self.start_ns) / NS_PER_S, 3),
            "daemon_rss_mib": _status_kib(self.pid, "VmRSS:") / 1024,
            "executors_rss_mib": sum(_status_kib(p, "VmRSS:") for p in executors) / 1024,
            "daemon_fds": open_fds(self.pid),
        }
        self.samples.append(row)
        return row

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def peak(self, key: str) -> float:
        return max((s[key] for s in self.samples), default=0.0)


# --- the load ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    rate_rps: float
    duration_s: float


@dataclass
class PhaseLog:
    """A `clockwork_async.bench.Observer` of a run of phases: answers by status and ok latency
    per phase (the phase of the request's scheduled time), and requests sent, ok by send time
    and ok by reply time per ``BIN_S`` bin. Answers that never came (lost) are in none."""

    phases: list[Phase]
    sent: int = 0
    statuses: dict[str, Counter[str]] = field(default_factory=dict)
    latency_ns: dict[str, list[int]] = field(default_factory=dict)
    sent_bins: Counter[int] = field(default_factory=Counter)
    ok_by_sent_bin: Counter[int] = field(default_factory=Counter)
    ok_by_reply_bin: Counter[int] = field(default_factory=Counter)
    not_ok: list[tuple[float, str]] = field(default_factory=list)  # (sent_s, status), capped
    _phase_of: list[str] = field(default_factory=list)  # by request index
    _ends_ns: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        end_ns = 0
        for phase in self.phases:
            self.statuses.setdefault(phase.name, Counter())
            self.latency_ns.setdefault(phase.name, [])
            end_ns += round(phase.duration_s * NS_PER_S)
            self._ends_ns.append(end_ns)

    def on_sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None:
        at = bisect.bisect_right(self._ends_ns, scheduled_ns)
        self._phase_of.append(self.phases[min(at, len(self.phases) - 1)].name)
        self.sent += 1
        self.sent_bins[_bin(sent_ns)] += 1

    def on_answer(
        self, index: int, sent_ns: int, now_ns: int, answer: InferResult | ClientError
    ) -> None:
        phase = self._phase_of[index]
        if isinstance(answer, ClientError):
            self.statuses[phase]["connection_closed"] += 1
            return
        self.statuses[phase][answer.status] += 1
        if not answer.ok and len(self.not_ok) < MAX_NOT_OK:
            self.not_ok.append((round(sent_ns / NS_PER_S, 3), answer.status))
        if answer.ok:
            self.latency_ns[phase].append(now_ns - sent_ns)
            self.ok_by_sent_bin[_bin(sent_ns)] += 1
            self.ok_by_reply_bin[_bin(now_ns)] += 1


def _bin(time_ns: int) -> int:
    return int(time_ns / NS_PER_S / BIN_S)


def recovery_s(run: PhaseLog, overload_end_s: float, horizon_s: float) -> float | None:
    """Seconds from ``overload_end_s`` to the start of the first bin from which, of the
    requests sent within the next RECOVERY_WINDOW_S, at least RECOVERY_OK_FRACTION were
    answered ok; None if that never happens before ``horizon_s``."""
    first = math.ceil(overload_end_s / BIN_S - 1e-9)
    window = round(RECOVERY_WINDOW_S / BIN_S)
    last = int(horizon_s / BIN_S) - window
    for start in range(first, last + 1):
        bins = range(start, start + window)
        sent = sum(run.sent_bins[b] for b in bins)
        ok = sum(run.ok_by_sent_bin[b] for b in bins)
        if ok >= RECOVERY_OK_FRACTION * sent:
            return round(max(0.0, start * BIN_S - overload_end_s), 3)
    return None


def ok_fraction(statuses: Counter[str]) -> float | None:
    total = sum(statuses.values())
    return round(statuses["ok"] / total, 4) if total else None


def series(run: PhaseLog, duration_s: float, step_s: float = 0.5) -> dict[str, list[float]]:
    """Offered and goodput (ok replies by reply time) per ``step_s``, in requests/s."""
    per = round(step_s / BIN_S)
    steps = math.ceil(duration_s / step_s)
    out: dict[str, list[float]] = {"t_s": [], "offered_rps": [], "goodput_rps": []}
    for index in range(steps):
        bins = range(index * per, (index + 1) * per)
        out["t_s"].append(index * step_s)
        out["offered_rps"].append(sum(run.sent_bins[b] for b in bins) / step_s)
        out["goodput_rps"].append(sum(run.ok_by_reply_bin[b] for b in bins) / step_s)
    return out


def phase_report(run: PhaseLog, phases: list[Phase]) -> list[dict[str, Any]]:
    """Per phase: offered rate, answers by status, goodput, ok latency."""
    rows = []
    for phase in phases:
        statuses = run.statuses.get(phase.name, Counter())
        rows.append(
            {
                "phase": phase.name,
                "target_rps": round(phase.rate_rps, 1),
                "duration_s": phase.duration_s,
                "sent": sum(statuses.values()),
                "statuses": dict(statuses.most_common()),
                "goodput_rps": round(statuses["ok"] / phase.duration_s, 1),
                "ok_latency": summarize_ns(run.latency_ns.get(phase.name, [])),
            }
        )
    return rows


# --- the benchmark -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    before_s: float
    overload_s: float
    after_s: float
    normal_load: float = 0.5  # of capacity, before and after


QUICK = Plan(before_s=5.0, overload_s=10.0, after_s=10.0)
FULL = Plan(before_s=10.0, overload_s=60.0, after_s=30.0)


async def drive(
    daemon: DaemonProcess, phases: list[Phase], slo_ms: float, sample_period_s: float
) -> tuple[PhaseLog, ProcSampler, int, dict[str, Any]]:
    """Run ``phases`` (open-loop Poisson, `clockwork_async.bench` in this process) against the
    daemon while sampling /proc (from the moment the client is connected, and once more after
    it left); returns the phase log, the sampler, the lost count and the daemon's stats."""
    async with await AsyncClient.connect(daemon.api) as client:
        run = Run(client, {MODEL: {"input": np.ones((1, 4), np.float32)}})
        log = PhaseLog(phases)
        run.observers = (log,)
        sampler = ProcSampler(daemon.pid, sample_period_s, run.start_ns)
        sampling = asyncio.create_task(sampler.run())
        try:
            workload = poisson_phases(1, [(p.rate_rps, p.duration_s) for p in phases])
            await drive_run(run, workload, slo_ms=slo_ms, rng=np.random.default_rng(1))
            lost = run.recorder.outstanding
            stats = await client.stats()
        finally:
            sampling.cancel()
    await asyncio.sleep(sample_period_s)  # let the daemon close its side
    sampler.sample()
    return log, sampler, lost, stats


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """RSS (daemon, executors) and offered/goodput over time; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    samples, rates = result["rss_samples"], result["series"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    times = [s["t_s"] for s in samples]
    top.plot(times, [s["daemon_rss_mib"] for s in samples], label="daemon")
    top.plot(times, [s["executors_rss_mib"] for s in samples], label="executors")
    top.set(ylabel="RSS (MiB)", title=f"overload: {result['factor']:g}x capacity")
    top.legend()
    bottom.plot(rates["t_s"], rates["offered_rps"], label="offered")
    bottom.plot(rates["t_s"], rates["goodput_rps"], label="goodput (ok/s)")
    bottom.axhline(result["capacity_rps"], color="gray", linestyle="--", label="capacity")
    bottom.set(xlabel="time (s)", ylabel="requests/s", yscale="log")
    bottom.legend()
    start, end = result["overload_window_s"]
    for axis in (top, bottom):
        axis.axvspan(start, end, color="red", alpha=0.08)
    return save(plt, fig, path, dpi=80)


def run(plan: Plan, factor: float, slowdown: float, slo_ms: float) -> dict[str, Any]:
    batch, capacity = rule_capacity_rps(slowdown, slo_ms)
    normal = plan.normal_load * capacity
    phases = [
        Phase("before", normal, plan.before_s),
        Phase("overload", factor * capacity, plan.overload_s),
        Phase("after", normal, plan.after_s),
    ]
    with tempfile.TemporaryDirectory(prefix="clockwork-overload-") as name:
        folder = Path(name)
        with start_daemon(folder, slowdown) as daemon:
            run_, sampler, lost, stats = run_uvloop(drive(daemon, phases, slo_ms, 0.25))
            alive = daemon.process.poll() is None
        keep_log(folder / "daemon.log", RESULTS / "overload-daemon.log")
    end_s = plan.before_s + plan.overload_s
    total_s = end_s + plan.after_s
    return {
        "capacity_rule": {"batch": batch, "rps": round(capacity, 1)},
        "capacity_rps": round(capacity, 1),
        "factor": factor,
        "overload_window_s": [plan.before_s, end_s],
        "phases": phase_report(run_, phases),
        "sent": run_.sent,
        "lost": lost,
        "recovery_s": recovery_s(run_, end_s, total_s),
        "before_ok_fraction": ok_fraction(run_.statuses.get("before", Counter())),
        "first_not_ok_after_overload": [x for x in run_.not_ok if x[0] >= end_s][:20],
        "rss_mib": {
            "daemon_start": sampler.samples[0]["daemon_rss_mib"],
            "daemon_peak": sampler.peak("daemon_rss_mib"),
            "daemon_end": sampler.samples[-1]["daemon_rss_mib"],
            "executors_peak": sampler.peak("executors_rss_mib"),
        },
        "daemon_alive": alive,
        "daemon_outcomes": stats.get("outcomes"),
        "series": series(run_, total_s),
        "rss_samples": sampler.samples,
    }


def print_report(result: dict[str, Any]) -> None:
    rows = [
        [
            p["phase"],
            p["target_rps"],
            p["sent"],
            p["goodput_rps"],
            ", ".join(f"{k} {v}" for k, v in p["statuses"].items()),
            p["ok_latency"].get("p99_us", 0) / 1000,
        ]
        for p in result["phases"]
    ]
    print(table(["phase", "target/s", "sent", "goodput/s", "answers", "ok p99 ms"], rows))
    rss = result["rss_mib"]
    print(
        f"capacity {result['capacity_rps']} req/s (rule b{result['capacity_rule']['batch']}); "
        f"lost {result['lost']} (goal 0); recovery {result['recovery_s']} s (goal <= 1 s; "
        f"ok fraction before {result['before_ok_fraction']}); "
        f"daemon RSS {rss['daemon_start']:.1f} -> peak {rss['daemon_peak']:.1f} -> "
        f"{rss['daemon_end']:.1f} MiB; alive {result['daemon_alive']}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overload", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="10 s of overload, not 60 s")
    parser.add_argument("--factor", type=float, default=10.0, help="overload x capacity")
    parser.add_argument("--slowdown", type=float, default=50.0, help="tiny-sim slowdown")
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "overload.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    result: dict[str, Any] = {
        "benchmark": "overload",
        "quick": args.quick,
        "machine": machine_description(),
        "plan": asdict(plan),
        "slowdown": args.slowdown,
        "slo_ms": args.slo_ms,
        **run(plan, args.factor, args.slowdown, args.slo_ms),
        "load_average_after": load_average(),
    }
    print_report(result)
    plot = write_plot(result, args.json.with_suffix(".png"))
    result["plot"] = str(plot) if plot else None
    path = write_report(args.json.stem, result, args.json.parent)
    print(f"wrote {path}" + (f" and {plot}" if plot else ""))
    return 0 if result["lost"] == 0 and result["daemon_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
