"""What a bench run reports: its JSON summary (`summarize`), a progress line, plots and
per-request rows. Reads a `Run`; sends nothing."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome
from clockwork_async.sim.report import timeline_arrays
from clockwork_async.sim.stats import latency_summary_ms

from .run import NS_PER_MS, NS_PER_S, RequestRows, Run

_ENDINGS = (Outcome.OK, Outcome.DROPPED, Outcome.FAILED, Outcome.LATE, Outcome.CANCELLED)

# When a run's generator counts as behind its schedule (`send_verdict`): more than BEHIND_SHARE
# of its requests left more than the lag budget late. The budget is a share of the SLO: a
# request sent L late reaches the daemon together with those due over the last L, a burst the
# daemon's queue absorbs while L is small beside the SLO; larger, the daemon is measured on
# bursts the schedule did not have (and on gaps after them). The floor allows for the event
# loop's millisecond timer granularity.
LAG_BUDGET_SLO_SHARE = 0.2
LAG_BUDGET_FLOOR_MS = 2.0
BEHIND_SHARE = 0.01


def lag_budget_ms(slo_ms: float, budget_ms: float | None = None) -> float:
    """How late a request may leave against its schedule: ``budget_ms`` when given, else
    `LAG_BUDGET_SLO_SHARE` of the SLO, at least `LAG_BUDGET_FLOOR_MS`."""
    if budget_ms is not None:
        return budget_ms
    return max(LAG_BUDGET_FLOOR_MS, LAG_BUDGET_SLO_SHARE * slo_ms)


def send_verdict(
    lag_us: Mapping[int, int], slo_ms: float, budget_ms: float | None = None
) -> dict[str, Any]:
    """Whether the generator kept its schedule: ``lag_us`` counts requests by how late they
    left (µs). Returns the budget (`lag_budget_ms`), how many left later than it (``late``,
    ``late_share``) and ``behind``: more than `BEHIND_SHARE` did, so the daemon was offered
    bursts and gaps the schedule did not have and the run measures the generator too."""
    budget = lag_budget_ms(slo_ms, budget_ms)
    budget_us = budget * 1000
    sent = sum(lag_us.values())
    late = sum(count for lag, count in lag_us.items() if lag > budget_us)
    share = late / sent if sent else 0.0
    return {
        "lag_budget_ms": round(budget, 3),
        "late": late,
        "late_share": round(share, 5),
        "behind": share > BEHIND_SHARE,
    }


def summarize(
    run: Run,
    duration_ns: int,
    workload: Mapping[str, Any],
    timeline: bool = False,
    lag_budget: float | None = None,
) -> dict[str, Any]:
    """The run's JSON summary: keys as ``simulate``'s, plus ``send`` (what was sent against
    the schedule, and `send_verdict`'s verdict with the ``lag_budget`` in ms, default a share
    of the run's SLO), ``scheduled``, ``client`` (this process's CPU), ``client_within_slo``
    and ``errors``; with ``timeline``, per-second series too (``timeline``, ``sent_per_s``,
    ``scheduled.per_s``)."""
    rec = run.recorder
    outcomes = rec.stats.outcomes
    lost = rec.outstanding
    accepted = sum(outcomes[o.value] for o in ACCEPTED_ENDINGS) + lost
    ok = outcomes[Outcome.OK.value]
    duration_s = duration_ns / NS_PER_S
    send_span_s = max(rec.last_send_ns, 1) / NS_PER_S
    scheduled: dict[str, Any] = {
        "requests": rec.scheduled,
        "rps": round(rec.scheduled / duration_s, 3),
    }
    summary: dict[str, Any] = {
        "requests": rec.sent,
        "accepted": accepted,
        **{o.value: outcomes[o.value] for o in _ENDINGS},
        "lost": lost,
        "rejected": {
            o.value: outcomes[o.value] for o in sorted(REJECTED_AT_ARRIVAL) if outcomes[o]
        },
        "errors": dict(sorted(rec.errors.items())),
        "goodput_rps": round(ok / duration_s, 3),
        "offered_rps": round(rec.sent / duration_s, 3),
        "latency_ms": latency_summary_ms(rec.stats.latency_us),
        "late_latency_ms": latency_summary_ms(rec.stats.late_latency_us),
        "ok_after_slo": rec.ok_after_slo,
        "client_within_slo": client_within_slo(run),
        "daemon_latency_ms": latency_summary_ms(rec.daemon_us),
        "ok_over_accepted": ok / accepted if accepted else None,
        "ok_over_requests": ok / rec.sent if rec.sent else None,
        "send": {
            "achieved_rps": round(rec.sent / send_span_s, 3) if rec.sent else 0.0,
            "lag_ms": latency_summary_ms(rec.lag_us),
            **send_verdict(rec.lag_us, rec.slo_ns / NS_PER_MS, lag_budget),
        },
        "scheduled": scheduled,
        "client": run.client_cpu(),
        "duration_seconds": duration_s,
        "wall_seconds": round(run.now_ns() / NS_PER_S, 3),
        "workload": dict(workload),
    }
    if timeline:
        seconds = round(duration_s)
        scheduled["per_s"] = [rec.scheduled_per_s[s] for s in range(seconds)]
        intervals = rec.stats.timeline.intervals
        summary["sent_per_s"] = [i.requests for i in intervals][:seconds]
        summary["timeline"] = timeline_arrays(rec.stats, duration_ns)
    return summary


def client_within_slo(run: Run) -> dict[str, Any]:
    """ok replies whose latency as this client measured it (socket to reply, the transport
    both ways included) was within the SLO, and their share of all requests sent."""
    rec = run.recorder
    ok_within = rec.stats.outcomes[Outcome.OK.value] - rec.ok_after_slo
    return {"ok_within": ok_within, "share": ok_within / rec.sent if rec.sent else None}


# --- plots ---------------------------------------------------------------------------------------


def write_plots(run: Run, duration_ns: int, directory: Path, slo_ms: float) -> list[Path]:
    """latency.png (ok latency p50/p99/max per second) and outcomes.png (answers per second by
    status). Imports matplotlib here only; without it, says so on stderr and writes none (the
    summary is kept)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("clockwork-async bench: matplotlib not installed: no plots", file=sys.stderr)
        return []

    directory.mkdir(parents=True, exist_ok=True)
    series = timeline_arrays(run.recorder.stats, duration_ns)
    fig, ax = plt.subplots(figsize=(8, 4))
    for key in ("p50_ms", "p99_ms", "max_ms"):
        ax.plot(series["time_s"], series[key], label=key.removesuffix("_ms"))
    ax.axhline(slo_ms, color="red", linestyle="--", label="SLO")
    ax.set(xlabel="time (s)", ylabel="latency of ok requests (ms)", title="bench latency")
    ax.legend()
    paths = [_save(plt, fig, directory / "latency.png")]
    fig, ax = plt.subplots(figsize=(8, 4))
    intervals = run.recorder.stats.timeline.intervals
    statuses = sorted({status for i in intervals for status in i.outcomes})
    for status in statuses:
        ax.plot(range(len(intervals)), [i.outcomes[status] for i in intervals], label=status)
    ax.set(xlabel="time (s)", ylabel="answers per second", title="bench outcomes")
    ax.legend()
    paths.append(_save(plt, fig, directory / "outcomes.png"))
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_rows(path: Path, run: Run, rows: RequestRows) -> None:
    """``path``: JSON with the run's ``start_ns`` and ``end_ns`` (monotonic: when sending
    began and ended) and the ``rows`` (columns of `ROW_COLUMNS`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "start_ns": run.start_ns,
        "end_ns": run.start_ns + run.send_end_ns,
        "rows": rows.columns,
    }
    path.write_text(json.dumps(document) + "\n")
