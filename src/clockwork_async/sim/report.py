"""Summaries (JSON-ready dicts) and plots (PNG) of simulation runs.

Invariants: the summary keys are the documented output of ``clockwork-async simulate`` (see
docs/simulator.md); matplotlib is imported only by `write_plots`, so a run without ``--plot``
never needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from clockwork_async.core.capacity import capacity_rps as core_capacity_rps
from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome

from .profiles import SimProfile
from .stats import US_PER_TIMELINE_BIN, SimStats, latency_summary_ms, percentile

NS_PER_S = 1_000_000_000


def capacity_rps(profile: SimProfile, slo_ns: int, margin_ns: int | None = None) -> float:
    """One executor's capacity for one model of ``profile`` at an SLO, by the core's rule
    (`core.capacity`: b/exec(b) for the largest b with 2*exec(b) + margin <= SLO; 0 if none)."""
    seed = ModelProfile(execute_ns=profile.execute_ns, load_ns=profile.load_ns)
    return core_capacity_rps(seed, profile.batch_sizes, slo_ns, margin_ns)


def summarize(
    stats: SimStats, duration_ns: int, config: Mapping[str, Any], workload: Mapping[str, Any]
) -> dict[str, Any]:
    """The run's JSON summary: counts, ratios, latency percentiles, actions and the config."""
    outcomes = stats.outcomes
    rejected = {o.value: outcomes[o.value] for o in sorted(REJECTED_AT_ARRIVAL) if outcomes[o]}
    accepted = sum(outcomes[o.value] for o in ACCEPTED_ENDINGS) + stats.lost
    ok = outcomes[Outcome.OK.value]
    duration_s = duration_ns / NS_PER_S
    summary: dict[str, Any] = {
        "requests": stats.requests,
        "accepted": accepted,
        **{o.value: outcomes[o.value] for o in _ENDINGS_IN_ORDER},
        "lost": stats.lost,
        "rejected": rejected,
        "goodput_rps": round(ok / duration_s, 3),
        "offered_rps": round(stats.requests / duration_s, 3),
        "latency_ms": latency_summary_ms(stats.latency_us),
        "late_latency_ms": latency_summary_ms(stats.late_latency_us),
        "ok_over_accepted": _ratio(ok, accepted),
        "ok_over_requests": _ratio(ok, stats.requests),
        "cold_starts": stats.cold_starts,
        "loads": stats.loads,
        "evictions": stats.evictions,
        "infers": stats.infers,
        "batch_sizes": {str(b): n for b, n in sorted(stats.batch_sizes.items())},
        "action_errors": dict(sorted(stats.action_errors.items())),
        "violations": dict(sorted(stats.violations.items())),
        "duration_seconds": duration_s,
        "simulated_seconds": stats.simulated_ns / NS_PER_S,
        "wall_seconds": round(stats.wall_s, 3),
        "speedup": round(stats.simulated_ns / NS_PER_S / stats.wall_s, 2) if stats.wall_s else None,
        "events": stats.events,
        "workload": dict(workload),
        "config": dict(config),
    }
    if stats.lost_examples:
        summary["lost_examples"] = stats.lost_examples
    return summary


_ENDINGS_IN_ORDER = (Outcome.OK, Outcome.DROPPED, Outcome.FAILED, Outcome.LATE, Outcome.CANCELLED)


def _ratio(part: int, whole: int) -> float | None:
    return None if whole == 0 else part / whole


def timeline_arrays(stats: SimStats, duration_ns: int) -> dict[str, list[float]]:
    """Per-interval series: start time, offered and ok rates, ok latency p50/p99/max (ms),
    mean rows per INFER, resident models at the interval's end."""
    timeline = stats.timeline
    interval_s = timeline.interval_ns / NS_PER_S
    intervals = timeline.intervals[: -(-duration_ns // timeline.interval_ns)]
    bin_ms = US_PER_TIMELINE_BIN / 1000.0
    series: dict[str, list[float]] = {k: [] for k in _SERIES}
    for index, interval in enumerate(intervals):
        bins = interval.latency_bins
        series["time_s"].append(index * interval_s)
        series["offered_rps"].append(interval.requests / interval_s)
        series["goodput_rps"].append(interval.outcomes[Outcome.OK.value] / interval_s)
        for key, percent in (("p50_ms", 50.0), ("p99_ms", 99.0), ("max_ms", 100.0)):
            value = percentile(bins, percent)
            series[key].append(float("nan") if value is None else (value + 1) * bin_ms)
        series["mean_batch_rows"].append(interval.batch_rows / max(interval.infers, 1))
    series["resident_models"] = _resident_at(stats, len(intervals), timeline.interval_ns)
    return series


_SERIES = ("time_s", "offered_rps", "goodput_rps", "p50_ms", "p99_ms", "max_ms", "mean_batch_rows")


def _resident_at(stats: SimStats, intervals: int, interval_ns: int) -> list[float]:
    """Resident model copies at the end of each interval (a step function sampled)."""
    times = np.array([t for t, _ in stats.loaded_changes], dtype=np.int64)
    counts = np.array([c for _, c in stats.loaded_changes], dtype=np.int64)
    ends = (np.arange(intervals, dtype=np.int64) + 1) * interval_ns
    resident = counts[np.searchsorted(times, ends, side="right") - 1]
    return [float(value) for value in resident]


def write_plots(
    stats: SimStats, duration_ns: int, directory: str | Path, slo_ms: float, title: str = ""
) -> list[Path]:
    """Write latency, goodput, batch-size and resident-model PNGs; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    series = timeline_arrays(stats, duration_ns)
    paths = [
        _plot_latency(plt, series, slo_ms, title, out / "latency.png"),
        _plot_lines(
            plt, series, ("offered_rps", "goodput_rps"), "req/s", title, out / "goodput.png"
        ),
        _plot_batches(plt, stats, title, out / "batch_sizes.png"),
        _plot_lines(plt, series, ("resident_models",), "copies", title, out / "loaded_models.png"),
    ]
    return paths


def _plot_latency(
    plt: Any, series: dict[str, list[float]], slo_ms: float, title: str, path: Path
) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for key in ("p50_ms", "p99_ms", "max_ms"):
        ax.plot(series["time_s"], series[key], label=key.removesuffix("_ms"))
    ax.axhline(slo_ms, color="red", linestyle="--", label="SLO")
    ax.set(xlabel="simulated time (s)", ylabel="latency of ok requests (ms)", title=title)
    ax.legend()
    return _save(plt, fig, path)


def _plot_lines(
    plt: Any,
    series: dict[str, list[float]],
    keys: tuple[str, ...],
    unit: str,
    title: str,
    path: Path,
) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for key in keys:
        ax.plot(series["time_s"], series[key], label=key)
    ax.set(xlabel="simulated time (s)", ylabel=unit, title=title)
    ax.legend()
    return _save(plt, fig, path)


def _plot_batches(plt: Any, stats: SimStats, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(stats.batch_sizes)
    ax.bar([str(b) for b in sizes], [stats.batch_sizes[b] for b in sizes])
    ax.set(xlabel="batch size", ylabel="INFER actions", title=title)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
