"""One run of the production core on simulated executors, for the virtual-time experiments
(`sim_scenarios`, `thousands`, `azure`, `scale`): richer timelines and timing of the core's
``handle`` calls. Results files and plots are `benchmarks.lib.report` and `.plots`.

Invariants:
- A run is `sim.engine.Simulation` unchanged: the production controller core on a virtual
  clock, the ResNet50-on-V100 profile unless told otherwise; nothing here alters what the
  core decides. `TimelineStats` only counts more (cold starts per interval), `ColdOutcomes`
  (handed to the engine as its request log) only counts how cold arrivals ended, and
  `TimedController` only measures (wall ns of each ``handle`` call around the real core).
- Timelines are per interval of virtual time; rates are per second of virtual time.
- Percentiles of the handle-time histograms are the house's nearest rank
  (`benchmarks.lib.stats.histogram_percentile`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.lib.plots import Series
from benchmarks.lib.stats import histogram_percentile
from clockwork_async.core.events import Event
from clockwork_async.sim.engine import SimConfig, Simulation, build_controller
from clockwork_async.sim.profiles import RESNET50_V100, SimProfile
from clockwork_async.sim.report import summarize, timeline_arrays
from clockwork_async.sim.stats import SimStats
from clockwork_async.sim.workloads import Workload

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
PROFILE = RESNET50_V100
B1_MS = PROFILE.execute_ns[1] / 1e6
POLICIES = ("clockwork", "fifo", "timeout")
AZURE_SAMPLE = Path("/work/shared/data/traces/azure-functions-2019-500/invocations.csv")
HANDLE_BIN_NS = 100  # resolution of the handle-time histograms
SETUP_EVENTS = ("ModelRegistered", "ExecutorJoined")  # handed to the core at time 0

Row = dict[str, Any]


# --- counting more -------------------------------------------------------------------------------


class TimelineStats(SimStats):
    """`SimStats` plus cold starts per timeline interval (by arrival time)."""

    def __init__(self, interval_ns: int) -> None:
        super().__init__(interval_ns)
        self.cold_per_interval: Counter[int] = Counter()

    def on_arrival(self, now_ns: int, cold: bool) -> None:
        super().on_arrival(now_ns, cold)
        if cold:
            self.cold_per_interval[now_ns // self.timeline.interval_ns] += 1


class ColdOutcomes:
    """Counts how requests that arrived cold ended, in the place of the engine's request log
    (the engine calls ``write`` once per reply with the `REQUEST_LOG_FIELDS` values)."""

    def __init__(self, interval_ns: int) -> None:
        self.interval_ns = interval_ns
        self.outcomes: Counter[str] = Counter()
        self.ok_latency_ms: Counter[int] = Counter()  # 1 ms bins
        self.ok_per_interval: Counter[int] = Counter()  # by reply time

    def write(self, *values: Any) -> None:
        reply_ns, outcome, latency_ns, cold = values[4], values[5], values[6], values[9]
        if not cold:
            return
        self.outcomes[outcome] += 1
        if outcome == "ok":
            self.ok_latency_ms[latency_ns // NS_PER_MS] += 1
            self.ok_per_interval[reply_ns // self.interval_ns] += 1

    def close(self) -> None:
        pass

    def summary(self) -> Row:
        """Outcomes of cold arrivals, and their ok share."""
        total = sum(self.outcomes.values())
        return {
            "requests": total,
            "outcomes": dict(sorted(self.outcomes.items())),
            "ok_share": self.outcomes["ok"] / total if total else None,
            "ok_latency_max_ms": max(self.ok_latency_ms) + 1 if self.ok_latency_ms else None,
        }


class TimedController:
    """The core behind a stopwatch: the wall time of every ``handle`` call, as histograms (in
    `HANDLE_BIN_NS` bins) per event type. Adds two clock reads per event."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.histograms: dict[str, Counter[int]] = {}
        self.total_ns = 0
        self._clock = time.perf_counter_ns

    def handle(self, event: Event, now_ns: int) -> Any:
        clock = self._clock
        start_ns = clock()
        commands = self.inner.handle(event, now_ns)
        spent_ns = clock() - start_ns
        self.total_ns += spent_ns
        name = type(event).__name__
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms[name] = Counter()
        histogram[spent_ns // HANDLE_BIN_NS] += 1
        return commands

    def summary_us(self) -> dict[str, dict[str, float]]:
        """Per event type, over all events, and over the serving events (``serving``: all but
        the set-up at time 0, `SETUP_EVENTS`): count, total, mean, p50, p99, p99.9, max (µs)."""
        everything: Counter[int] = Counter()
        serving: Counter[int] = Counter()
        for name, histogram in self.histograms.items():
            everything.update(histogram)
            if name not in SETUP_EVENTS:
                serving.update(histogram)
        found = {name: histogram_us(h) for name, h in sorted(self.histograms.items())}
        found["all"] = histogram_us(everything)
        found["serving"] = histogram_us(serving)
        return found


def histogram_us(histogram: Mapping[int, int]) -> dict[str, float]:
    """count, total, mean and nearest-rank percentiles (µs) of a `HANDLE_BIN_NS` histogram."""
    count = sum(histogram.values())
    if not count:
        return {"count": 0}
    to_us = HANDLE_BIN_NS / 1000.0
    total = sum(value * n for value, n in histogram.items())
    found: dict[str, float] = {
        "count": count,
        "total_ms": round(total * to_us / 1000.0, 3),
        "mean_us": round(total / count * to_us, 3),
    }
    for label, percent in (("p50_us", 50.0), ("p99_us", 99.0), ("p99.9_us", 99.9)):
        found[label] = round((histogram_percentile(histogram, percent) or 0) * to_us, 3)
    found["max_us"] = round(max(histogram) * to_us, 3)
    return found


# --- one run -------------------------------------------------------------------------------------


@dataclass
class SimRun:
    """What one run leaves: its summary, timeline series and (when timed) the core's cost."""

    summary: Row
    series: Series
    stats: TimelineStats
    core_us: dict[str, dict[str, float]] | None = None
    cpu_s: float = 0.0  # this process's CPU time over the run (engine + core)


def interval_for(duration_s: float, points: int = 300) -> int:
    """A timeline interval (whole seconds, at least 1) giving about ``points`` intervals."""
    return max(1, round(duration_s / points)) * NS_PER_S


def run_sim(
    workload: Workload,
    *,
    executors: int,
    slo_ms: float,
    policy: str = "clockwork",
    preload: bool = False,
    profile: SimProfile = PROFILE,
    interval_ns: int | None = None,
    timed: bool = False,
    progress_s: float = 30.0,
    core: Mapping[str, Any] | None = None,
    count_cold: bool = True,
    noise: float = 0.0,
    seed: int = 0,
) -> SimRun:
    """One simulation of ``workload``; the summary is `sim.report.summarize`'s plus the policy,
    the process's CPU seconds and (``count_cold``) ``cold_arrivals``.
    ``noise`` is the executors' relative standard deviation of durations (`SimConfig.noise`;
    0: exactly the profile). ``seed`` is `SimConfig.seed` (the workload's draws and the noise).
    ``count_cold`` tallies how cold arrivals ended (`ColdOutcomes`,
    a little engine work per reply). Raises ValueError on bad settings (from SimConfig /
    ControllerConfig)."""
    duration_s = workload.duration_ns / NS_PER_S
    interval = interval_ns or interval_for(duration_s)
    config = SimConfig(
        executors=executors,
        profile=profile,
        slo_ns=round(slo_ms * NS_PER_MS),
        interval_ns=interval,
        progress_s=progress_s,
        preload=preload,
        noise=noise,
        seed=seed,
    )
    controller = build_controller(policy, core)
    timer = TimedController(controller) if timed else None
    cold = ColdOutcomes(interval) if count_cold else None
    simulation = Simulation(
        config, workload, timer or controller, request_log=cold, progress=sys.stderr
    )
    stats = TimelineStats(interval)
    simulation.stats = stats
    cpu_start = time.process_time()
    simulation.run()
    cpu_s = time.process_time() - cpu_start
    settings = {
        "policy": policy,
        "executors": executors,
        "slo_ms": slo_ms,
        "preload": preload,
        "noise": noise,
        "seed": seed,
    }
    summary = summarize(stats, workload.duration_ns, settings, workload.describe())
    summary["policy"] = policy
    summary["cpu_seconds"] = round(cpu_s, 3)
    series = timeline_series(stats, workload.duration_ns)
    if cold is not None:
        summary["cold_arrivals"] = cold.summary()
        series["cold_ok_per_s"] = [
            cold.ok_per_interval[i] * NS_PER_S / interval for i in range(len(series["time_s"]))
        ]
    return SimRun(summary, series, stats, timer.summary_us() if timer else None, cpu_s)


def timeline_series(stats: TimelineStats, duration_ns: int) -> Series:
    """`sim.report.timeline_arrays` plus, per interval: cold starts, LOADs and UNLOADs ended,
    and replies by outcome (per second of virtual time)."""
    series = timeline_arrays(stats, duration_ns)
    intervals = len(series["time_s"])
    interval_ns = stats.timeline.interval_ns
    interval_s = interval_ns / NS_PER_S
    series["cold_starts_per_s"] = [
        stats.cold_per_interval[i] / interval_s for i in range(intervals)
    ]
    loads, unloads = residency_changes(stats.loaded_changes, interval_ns, intervals)
    series["loads_per_s"] = [n / interval_s for n in loads]
    series["unloads_per_s"] = [n / interval_s for n in unloads]
    counted = stats.timeline.intervals[:intervals]
    for outcome in sorted({o for interval in counted for o in interval.outcomes}):
        rates = [interval.outcomes[outcome] / interval_s for interval in counted]
        series[f"{outcome}_per_s"] = rates + [0.0] * (intervals - len(rates))
    return series


def residency_changes(
    changes: Sequence[tuple[int, int]], interval_ns: int, intervals: int
) -> tuple[list[int], list[int]]:
    """LOADs and UNLOADs ended per interval, from ``(time_ns, resident)`` steps. Preloaded
    copies (time 0) are not LOADs."""
    loads, unloads = [0] * intervals, [0] * intervals
    for (_, before), (time_ns, after) in pairwise(changes):
        index = time_ns // interval_ns
        if time_ns == 0 or index >= intervals:
            continue
        if after > before:
            loads[index] += after - before
        else:
            unloads[index] += before - after
    return loads, unloads


def windows(series: Series, edges_s: Sequence[float]) -> list[Row]:
    """Per window ``[edges[k], edges[k+1])`` of the timeline: mean of each rate series and the
    largest per-interval p99 / max latency."""
    rows = []
    for start_s, end_s in pairwise(edges_s):
        chosen = [i for i, t in enumerate(series["time_s"]) if start_s <= t < end_s]
        if not chosen:
            continue
        row: Row = {"from_s": start_s, "to_s": end_s}
        for key, values in series.items():
            if key.endswith("_per_s") or key in ("offered_rps", "goodput_rps"):
                row[key] = round(sum(values[i] for i in chosen) / len(chosen), 2)
        for key in ("p50_ms", "p99_ms", "max_ms"):
            finite = [series[key][i] for i in chosen if series[key][i] == series[key][i]]
            row[key] = round(max(finite), 2) if finite else None
        row["resident_models"] = series["resident_models"][chosen[-1]]
        rows.append(row)
    return rows
