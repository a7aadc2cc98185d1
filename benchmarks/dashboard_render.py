"""The Grafana dashboard's picture, drawn with matplotlib from the real metrics of a short run.

    python -m benchmarks.dashboard_render [--quick] [--out docs/img/dashboard.png]

No Grafana runs here, so this draws the dashboard's main panels itself. A daemon with two
simulated executors (``tiny-sim`` slowed ``SLOWDOWN`` times, so capacity is modest and one
Python client can overload it) serves two model groups: ``alpha`` (one instance, 70% of the
requests) and ``beta`` (three instances, 10% each, so models are loaded and evicted). Open-loop
Poisson load from `overload.LoadRun`, in phases: light (a quarter of the capacity rule's
rate), overload (three times it), a fault (light load; executor ``local-1`` is SIGKILLed at its
start and restarted by the daemon), light again. ``/metrics`` is scraped every ``SCRAPE_PERIOD_S``.

Each panel's quantity is computed here from the scraped counters, histograms and gauges the
way the panel's PromQL computes it (the functions below mirror ``rate``, ``sum by`` and
``histogram_quantile``); the PromQL itself is not run. Rates use a ``RATE_WINDOW_S`` window
instead of the dashboard's ``$__rate_interval`` and the rules' 5 minutes, so that a run of two
minutes shows its phases. Panel titles are the dashboard's own (the script fails if one is
missing there). Writes the picture and ``results/dashboard_render.json`` (the scrapes, from
which ``--replot`` draws again without a run).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.faults import executor_pids
from benchmarks.lib import (
    RESULTS,
    DaemonProcess,
    add_model,
    daemon_config,
    pyplot,
    run_uvloop,
    save,
)
from benchmarks.overload import Phase, rule_capacity_rps
from clockwork_async.bench import Run
from clockwork_async.bench import drive as drive_run
from clockwork_async.bench import phases as poisson_phases
from clockwork_async.client import AsyncClient

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "packaging" / "grafana" / "clockwork-async.json"
PICTURE = ROOT / "docs" / "img" / "dashboard.png"
SCRAPES = RESULTS / "dashboard_render.json"
SLOWDOWN = 100.0  # tiny-sim x100: batch 1/8 execute in 50/120 ms, a LOAD takes 100 ms
SLO_MS = 300.0
EXECUTORS = 2
SCRAPE_PERIOD_S = 1.0
RATE_WINDOW_S = 10.0
VICTIM = "local-1"
# Of the capacity rule's requests/s (batches of 8): small batches at light load need more.
LIGHT, OVERLOAD = 0.25, 3.0
# 70% alpha, 10% each beta instance, in turn.
MODELS = ("alpha",) * 7 + ("beta-0", "beta-1", "beta-2")
EXECUTOR = """
[[executors]]
backend = "simulated"
page_bytes = 1048576
weights_bytes = 7340032
slowdown = {slowdown}
"""
# Outcome sets of the rules file (docs/operations.md, "Dashboard and alerts").
ACCEPTED = frozenset({"ok", "dropped", "failed", "late"})
NOT_VALID = frozenset({"cancelled", "unknown_model", "bad_input"})

Labels = tuple[tuple[str, str], ...]
Series = dict[Labels, list[float]]  # one value per scrape (nan where absent or undefined)


@dataclass(frozen=True)
class Scrape:
    t_s: float
    samples: dict[tuple[str, Labels], float]


def parse_scrape(t_s: float, text: str) -> Scrape:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(t_s, samples)


# --- PromQL, as far as the panels need it ------------------------------------------------------


def select(
    scrapes: Sequence[Scrape], name: str, where: Callable[[dict[str, str]], bool] = lambda _: True
) -> Series:
    """Every series of sample ``name`` whose labels pass ``where``: its value at each scrape."""
    keys = {labels for s in scrapes for (n, labels) in s.samples if n == name}
    return {
        labels: [s.samples.get((name, labels), np.nan) for s in scrapes]
        for labels in sorted(keys)
        if where(dict(labels))
    }


def rate(scrapes: Sequence[Scrape], series: Series, window_s: float) -> Series:
    """Per-second increase of each series over the last ``window_s`` at each scrape: the rise
    from its first to its last sample in the window, a counter reset counting from zero (as
    in PromQL), over the time between them (PromQL also extrapolates to the window's edges);
    nan without two samples in the window."""
    times = [s.t_s for s in scrapes]
    out: Series = {}
    for labels, values in series.items():
        rates = []
        for i, t_s in enumerate(times):
            present = [
                k for k in range(i + 1) if times[k] >= t_s - window_s and not np.isnan(values[k])
            ]
            if len(present) < 2 or present[-1] != i:
                rates.append(np.nan)
                continue
            pairs = itertools.pairwise(present)
            increase = sum(
                values[b] - values[a] if values[b] >= values[a] else values[b] for a, b in pairs
            )
            rates.append(increase / (t_s - times[present[0]]))
        out[labels] = rates
    return out


def sum_by(series: Series, by: Iterable[str]) -> Series:
    """``sum by (labels)``: nan where every input is nan."""
    kept = tuple(by)
    out: dict[Labels, list[list[float]]] = {}
    for labels, values in series.items():
        key = tuple((k, v) for k, v in labels if k in kept)
        out.setdefault(key, []).append(values)
    return {key: _nansum(columns) for key, columns in out.items()}


def _nansum(columns: list[list[float]]) -> list[float]:
    stacked = np.array(columns, dtype=float)
    sums = np.nansum(stacked, axis=0)
    sums[np.all(np.isnan(stacked), axis=0)] = np.nan
    return [float(v) for v in sums]


def divide(numerator: Series, denominator: Series) -> Series:
    """Vector division on identical label sets; nan where the denominator is 0 or missing."""
    out = {}
    for labels, top in numerator.items():
        bottom = denominator.get(labels)
        if bottom is not None:
            out[labels] = [t / b if b else np.nan for t, b in zip(top, bottom, strict=True)]
    return out


def histogram_quantile(q: float, buckets: Series) -> Series:
    """PromQL's ``histogram_quantile`` over rates of ``_bucket`` series (with ``le``), grouped
    by their other labels: linear inside the bucket holding the rank; the upper bound of the
    highest finite bucket when the rank falls in +Inf."""
    groups: dict[Labels, dict[float, list[float]]] = {}
    for labels, values in buckets.items():
        rest = tuple((k, v) for k, v in labels if k != "le")
        groups.setdefault(rest, {})[float(dict(labels)["le"])] = values
    out = {}
    for rest, by_le in groups.items():
        bounds = sorted(by_le)
        columns = zip(*(by_le[b] for b in bounds), strict=True)
        out[rest] = [bucket_quantile(q, bounds, list(counts)) for counts in columns]
    return out


def bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float:
    """One quantile from cumulative bucket ``counts`` at upper ``bounds`` (the last +Inf)."""
    total = counts[-1]
    if np.isnan(total) or total <= 0:
        return np.nan
    rank = q * total
    for index, (bound, count) in enumerate(zip(bounds, counts, strict=True)):
        if count >= rank:
            if np.isinf(bound):
                return bounds[index - 1] if index > 0 else np.nan
            lower, below = (0.0, 0.0) if index == 0 else (bounds[index - 1], counts[index - 1])
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
    return np.nan


# --- the run ------------------------------------------------------------------------------------


def start_daemon(folder: Path) -> DaemonProcess:
    from clockwork_async.models.demo import build_tiny

    add_model(folder / "models", "alpha", build_tiny(0).SerializeToString())
    add_model(folder / "models", "beta", build_tiny(1).SerializeToString(), "copies = 3\n")
    executors = EXECUTOR.format(slowdown=SLOWDOWN) * EXECUTORS
    config = daemon_config(folder, executors)
    config.write_text(config.read_text().replace('log_level = "info"', 'log_level = "warning"'))
    return DaemonProcess.start(folder, config)


def phases(quick: bool) -> list[Phase]:
    _, capacity_rps = rule_capacity_rps(SLOWDOWN, SLO_MS)
    total_rps = EXECUTORS * capacity_rps
    light_s, overload_s, fault_s = (10.0, 10.0, 10.0) if quick else (30.0, 30.0, 30.0)
    return [
        Phase("light", LIGHT * total_rps, light_s),
        Phase("overload", OVERLOAD * total_rps, overload_s),
        Phase("fault", LIGHT * total_rps, fault_s),
        Phase("light again", LIGHT * total_rps, light_s),
    ]


def scrape_now(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
    return text


async def scrape_every(url: str, start_ns: int, into: list[Scrape]) -> None:
    """Until cancelled: scrape ``url`` each SCRAPE_PERIOD_S (times from ``start_ns``)."""
    while True:
        text = await asyncio.to_thread(scrape_now, url)
        into.append(parse_scrape((time.monotonic_ns() - start_ns) / 1e9, text))
        await asyncio.sleep(SCRAPE_PERIOD_S)


async def kill_at(daemon_pid: int, at_s: float, start_ns: int) -> None:
    await asyncio.sleep(max(0.0, at_s - (time.monotonic_ns() - start_ns) / 1e9))
    os.kill(executor_pids(daemon_pid)[VICTIM], signal.SIGKILL)


async def drive(daemon: DaemonProcess, plan: list[Phase]) -> list[Scrape]:
    scrapes: list[Scrape] = []
    async with await AsyncClient.connect(daemon.api) as client:
        row = {"input": np.ones((1, 4), np.float32)}
        run = Run(client, {model: row for model in MODELS})
        run.models = list(MODELS)  # one Poisson instance per entry: alpha takes 7 in 10
        fault_at_s = sum(p.duration_s for p in plan[:2])
        tasks = [
            asyncio.create_task(scrape_every(daemon.metrics_url, run.start_ns, scrapes)),
            asyncio.create_task(kill_at(daemon.pid, fault_at_s, run.start_ns)),
        ]
        try:
            workload = poisson_phases(len(MODELS), [(p.rate_rps, p.duration_s) for p in plan])
            grace_s = 2 * SLO_MS / 1000 + 2.0
            rng = np.random.default_rng(7)
            await drive_run(run, workload, slo_ms=SLO_MS, rng=rng, grace_s=grace_s)
            await asyncio.sleep(RATE_WINDOW_S / 2)  # a few scrapes after the last answers
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return scrapes


# --- the panels ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    label: str
    values: list[float]
    style: str = "-"


def named(series: Series, template: str, style: str = "-") -> list[Line]:
    return [Line(template.format(**dict(k)), v, style) for k, v in series.items()]


def requests_rate(scrapes: Sequence[Scrape], keep: Callable[[str], bool]) -> Series:
    counters = select(scrapes, "clockwork_requests_total", lambda labels: keep(labels["outcome"]))
    return sum_by(rate(scrapes, counters, RATE_WINDOW_S), ["group"])


def quantiles(
    scrapes: Sequence[Scrape], metric: str, qs: Sequence[float], by: Sequence[str]
) -> list[Line]:
    buckets = sum_by(rate(scrapes, select(scrapes, metric + "_bucket"), RATE_WINDOW_S), [*by, "le"])
    lines = []
    for q, style in zip(qs, ("-", "--", ":"), strict=False):
        for labels, values in histogram_quantile(q, buckets).items():
            name = " ".join(v for _, v in labels)
            lines.append(Line(f"p{q * 100:g} {name}", values, style))
    return lines


@dataclass(frozen=True)
class Panel:
    title: str
    sources: tuple[str, ...]  # the dashboard panels it draws, by title
    lines: list[Line]
    unit: str


def panels(scrapes: Sequence[Scrape]) -> list[Panel]:
    """The picture's panels, in order."""
    ok = requests_rate(scrapes, lambda o: o == "ok")
    accepted = requests_rate(scrapes, lambda o: o in ACCEPTED)
    valid = requests_rate(scrapes, lambda o: o not in NOT_VALID)
    drops = rate(scrapes, select(scrapes, "clockwork_drops_total"), RATE_WINDOW_S)
    busy = rate(scrapes, select(scrapes, "clockwork_executor_busy_seconds_total"), RATE_WINDOW_S)
    pages = divide(
        select(scrapes, "clockwork_executor_pages_used"),
        select(scrapes, "clockwork_executor_pages_capacity"),
    )
    loads = rate(scrapes, select(scrapes, "clockwork_load_duration_seconds_count"), RATE_WINDOW_S)
    evictions = rate(scrapes, select(scrapes, "clockwork_evictions_total"), RATE_WINDOW_S)
    cold = rate(scrapes, select(scrapes, "clockwork_cold_starts_total"), RATE_WINDOW_S)
    restarts = select(scrapes, "clockwork_executor_restarts_total")
    cpu = rate(scrapes, select(scrapes, "process_cpu_seconds_total"), RATE_WINDOW_S)
    answered = sum_by(rate(scrapes, select(scrapes, "clockwork_requests_total"), RATE_WINDOW_S), [])
    return [
        Panel(
            "SLO attainment: ok / accepted (solid), ok / valid (dashed)",
            (
                "SLO attainment of accepted requests (ok / accepted)",
                "SLO attainment of all valid requests (ok / valid)",
            ),
            named(divide(ok, accepted), "ok/accepted {group}")
            + named(divide(ok, valid), "ok/valid {group}", "--"),
            "fraction",
        ),
        Panel(
            "Goodput and offered load",
            ("Goodput and offered load",),
            named(ok, "ok {group}") + named(valid, "offered {group}", "--"),
            "requests/s",
        ),
        Panel(
            "Refusals and drops by reason",
            ("Refusals and drops by reason",),
            named(sum_by(drops, ["reason"]), "{reason}"),
            "requests/s",
        ),
        Panel(
            "Request latency p50 / p99 / p99.9",
            ("Request latency p50 / p99 / p99.9",),
            quantiles(scrapes, "clockwork_request_duration_seconds", (0.5, 0.99, 0.999), ["group"]),
            "s",
        ),
        Panel(
            "Deadline slack of ok requests: p1 / p50",
            ("Deadline slack of ok requests: p1 / p50",),
            quantiles(scrapes, "clockwork_deadline_slack_seconds", (0.01, 0.5), ["group"]),
            "s",
        ),
        Panel(
            "Prediction error p50 / p99",
            ("Prediction error p50 / p99",),
            quantiles(
                scrapes, "clockwork_prediction_error_seconds", (0.5, 0.99), ["kind", "direction"]
            ),
            "s",
        ),
        Panel(
            "Executor utilisation",
            ("Executor utilisation",),
            named(busy, "{executor} {kind}"),
            "busy fraction",
        ),
        Panel("Weight pages used", ("Weight pages used",), named(pages, "{executor}"), "fraction"),
        Panel(
            "LOADs, evictions and cold starts",
            ("LOADs, evictions and cold starts",),
            named(sum_by(loads, ["group"]), "loads {group}")
            + named(sum_by(evictions, ["group"]), "evictions {group}", "--")
            + named(cold, "cold starts", ":"),
            "per s",
        ),
        Panel(
            "Executors up (solid) and restarts (dashed)",
            ("Executors up", "Executor restarts in range"),
            named(select(scrapes, "clockwork_executor_up"), "up {executor}")
            + named(restarts, "restarts {executor}", "--"),
            "",
        ),
        Panel(
            "Event loop lag p50 / p99",
            ("Event loop lag p50 / p99",),
            quantiles(scrapes, "clockwork_event_loop_lag_seconds", (0.5, 0.99), []),
            "s",
        ),
        Panel(
            "Controller CPU per request",
            ("Controller CPU per request",),
            named(divide(sum_by(cpu, []), answered), "daemon CPU s / request"),
            "s",
        ),
    ]


def dashboard_titles() -> set[str]:
    model = json.loads(DASHBOARD.read_text())
    return {p["title"] for p in model["panels"]}


def draw(scrapes: Sequence[Scrape], plan: Sequence[Phase], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    drawn = panels(scrapes)
    missing = {source for panel in drawn for source in panel.sources} - dashboard_titles()
    if missing:
        raise SystemExit(f"panels not in {DASHBOARD.name}: {sorted(missing)}")
    times = [s.t_s for s in scrapes]
    fig, axes = plt.subplots(4, 3, figsize=(14, 12), sharex=True)
    for axis, panel in zip(axes.flat, drawn, strict=True):
        for line in panel.lines:
            axis.plot(times, line.values, line.style, label=line.label, linewidth=1.2)
        _phases(axis, plan)
        axis.set_title(panel.title, fontsize=10)
        axis.set_ylabel(panel.unit, fontsize=8)
        axis.tick_params(labelsize=8)
        if panel.unit == "s":
            axis.set_yscale("log")
        axis.legend(fontsize=7, loc="best")
    for axis in axes[-1]:
        axis.set_xlabel("time (s)", fontsize=8)
    fig.suptitle(
        "clockwork-async: 2 simulated executors, model groups alpha and beta. Load: "
        + ", ".join(f"{p.name} {p.rate_rps:.0f}/s for {p.duration_s:g} s" for p in plan)
        + f".\nGrey: overload. Red line: {VICTIM} killed (SIGKILL). Rates over {RATE_WINDOW_S:g} s;"
        " quantiles interpolated inside the histograms' buckets.",
        fontsize=10,
    )
    return shrink(save(plt, fig, out))


def shrink(path: Path) -> Path:
    """Re-save the PNG with a 256-colour palette: a third of the bytes, the same to the eye."""
    from PIL import Image

    with Image.open(path) as image:
        paletted = image.convert("RGB").quantize(colors=256)
    paletted.save(path, optimize=True)
    return path


def _phases(axis: Any, plan: Sequence[Phase]) -> None:
    """The overload phase shaded, the executor kill (the fault phase's start) a red line."""
    start_s = 0.0
    for phase in plan:
        if phase.name == "overload":
            axis.axvspan(start_s, start_s + phase.duration_s, color="grey", alpha=0.15)
        if phase.name == "fault":
            axis.axvline(start_s, color="red", linewidth=0.8, alpha=0.6)
        start_s += phase.duration_s


def summary(scrapes: Sequence[Scrape]) -> dict[str, Any]:
    last = scrapes[-1].samples
    by_outcome: dict[str, float] = {}
    for (name, labels), value in last.items():
        if name == "clockwork_requests_total":
            outcome = dict(labels)["outcome"]
            by_outcome[outcome] = by_outcome.get(outcome, 0) + value
    return {"scrapes": len(scrapes), "outcomes": {k: v for k, v in by_outcome.items() if v}}


def save_scrapes(path: Path, scrapes: Sequence[Scrape], plan: Sequence[Phase]) -> None:
    dump = [
        {"t_s": s.t_s, "samples": [[n, dict(labels), v] for (n, labels), v in s.samples.items()]}
        for s in scrapes
    ]
    phases_ = [[p.name, p.rate_rps, p.duration_s] for p in plan]
    report = {"summary": summary(scrapes), "phases": phases_, "scrapes": dump}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


def load_scrapes(path: Path) -> tuple[list[Scrape], list[Phase]]:
    report = json.loads(path.read_text())
    scrapes = [
        Scrape(
            s["t_s"],
            {(n, tuple(sorted(labels.items()))): v for n, labels, v in s["samples"]},
        )
        for s in report["scrapes"]
    ]
    return scrapes, [Phase(*p) for p in report["phases"]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s phases instead of 30 s")
    parser.add_argument("--out", type=Path, default=PICTURE)
    parser.add_argument(
        "--replot", action="store_true", help=f"draw again from {SCRAPES.name}, without a run"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        scrapes, plan = load_scrapes(SCRAPES)
    else:
        plan = phases(args.quick)
        with (
            tempfile.TemporaryDirectory(prefix="clockwork-dashboard-") as name,
            start_daemon(Path(name)) as daemon,
        ):
            scrapes = run_uvloop(drive(daemon, plan))
        save_scrapes(SCRAPES, scrapes, plan)
    print(json.dumps(summary(scrapes)))
    path = draw(scrapes, plan, args.out)
    if path is not None:
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
