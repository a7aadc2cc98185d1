"""``clockwork-async bench``: a load generator against a running daemon.

Modes: open-loop Poisson (``--rate``), replay of an Azure Functions trace (``--trace``; the
workloads of `sim.workloads`, drawn on the same schedule the simulator uses), replay of a
per-request log (``--replay FILE.csv``, `sim.replay`: its times scaled by ``--time-scale``, its
models mapped onto ``--models`` by name or else round-robin, its ``slo_ms`` per request), or
closed loop
(``--concurrency N``: N requests always in flight). ``--copies N`` sends to the N copies
``NAME-0`` .. ``NAME-{N-1}`` of ``--model NAME`` (model.toml's ``copies``), all with one input.
The summary has the outcome keys and latency percentiles of ``clockwork-async simulate`` plus
what the generator itself achieved: requests scheduled against sent, its send rate, its send
lag (how late each request left against its schedule) and its own CPU time, so a generator
that cannot keep up is visible rather than mistaken for a slow daemon. ``--rows FILE`` keeps
one row per request (`RequestRows`), ``--timeline`` per-second series.

It is also the load generator of the benchmarks, called in-process: `drive` runs a `Run` (on
a connection the caller holds) through any open-loop schedule (`sim.workloads`, `phases`) or a
closed loop, with observers (`Observer`) that see every request sent and answered.

Invariants: open-loop arrivals leave on their schedule from this process and never wait for a
reply (nor for the socket to drain); every request sent is counted exactly once in the summary,
as an outcome, an error status or ``lost`` (no answer before the end of the grace period).
Latency is measured here, from the moment a request was handed to the socket to its reply.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from clockwork_async.api.async_client import AsyncClient, ClientError, InferResult
from clockwork_async.api.auth import client_ssl_context
from clockwork_async.cli_client import Parser, UsageError, add_connection_flags, random_inputs
from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome
from clockwork_async.sim.replay import read_request_log, replay
from clockwork_async.sim.report import timeline_arrays
from clockwork_async.sim.stats import SimStats, latency_summary_ms
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import (
    OpenLoop,
    RateSegment,
    Workload,
    poisson,
    request_slos_ns,
    trace_replay,
)

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
_YIELD_EVERY = 64  # sends in a row (when behind schedule) before letting replies in
_ENDINGS = (Outcome.OK, Outcome.DROPPED, Outcome.FAILED, Outcome.LATE, Outcome.CANCELLED)


Answer = InferResult | ClientError


class Observer(Protocol):
    """Sees every request of a `Run`: ``index`` counts requests sent from 0; times are ns
    since the run's start. Answers after the grace period are not passed on (they are lost)."""

    def on_sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None: ...

    def on_answer(self, index: int, sent_ns: int, now_ns: int, answer: Answer) -> None: ...


@dataclass(slots=True)
class Recorder:
    """Counts what was scheduled, sent and answered; times are ns since the run's start."""

    stats: SimStats
    lag_us: Counter[int] = field(default_factory=Counter)
    daemon_us: Counter[int] = field(default_factory=Counter)  # the daemon's own total
    errors: Counter[str] = field(default_factory=Counter)  # statuses that are no outcome
    scheduled_per_s: Counter[int] = field(default_factory=Counter)  # by scheduled second
    scheduled: int = 0
    sent: int = 0
    answered: int = 0
    last_send_ns: int = 0
    slo_ns: int = 0  # when set, ok replies received later than this after sending are counted
    ok_after_slo: int = 0

    def on_scheduled(self, scheduled_ns: int) -> None:
        self.scheduled += 1
        self.scheduled_per_s[scheduled_ns // NS_PER_S] += 1

    def on_sent(self, scheduled_ns: int, sent_ns: int) -> None:
        self.stats.on_arrival(sent_ns, False)
        self.sent += 1
        self.last_send_ns = sent_ns
        self.lag_us[max(0, sent_ns - scheduled_ns) // 1000] += 1

    def on_answer(
        self, sent_ns: int, now_ns: int, answer: Answer, slo_ns: int | None = None
    ) -> None:
        """Count an answer; ``slo_ns``: the request's own SLO (default: ``self.slo_ns``)."""
        self.answered += 1
        if isinstance(answer, ClientError):
            self.errors["connection_closed"] += 1
            return
        outcome = answer.outcome
        if outcome is None:
            self.errors[answer.status] += 1
            return
        self.stats.on_reply(outcome, now_ns, sent_ns)
        slo_ns = self.slo_ns if slo_ns is None else slo_ns
        if outcome is Outcome.OK and slo_ns and now_ns - sent_ns > slo_ns:
            self.ok_after_slo += 1
        if "total" in answer.timing_ns:
            self.daemon_us[answer.timing_ns["total"] // 1000] += 1

    @property
    def outstanding(self) -> int:
        return self.sent - self.answered


class Run:
    """One bench run on one connection: request ``i`` of an arrival goes to
    ``models[instance % len(models)]``."""

    def __init__(
        self,
        client: AsyncClient,
        inputs: Mapping[str, Mapping[str, np.ndarray]],
        observers: Sequence[Observer] = (),
    ):
        self.client = client
        self.inputs = inputs
        self.models = list(inputs)
        self.observers = tuple(observers)
        self.start_ns = time.monotonic_ns()  # every time of the run counts from here
        self.cpu_start_s = time.process_time()
        self.send_end_ns = 0  # when the last request was sent (or the schedule ended)
        self.recorder = Recorder(SimStats(NS_PER_S))
        self._all_answered = asyncio.Event()
        self._sending = True
        self._books_closed = False  # after the grace period: later answers are not counted

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.start_ns

    def send(self, instance: int, scheduled_ns: int, slo_ms: float) -> asyncio.Future[None]:
        """Send one request now; the future resolves when it is answered."""
        model = self.models[instance % len(self.models)]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        index = self.recorder.sent
        sent_ns = self.now_ns()
        slo_ns = round(slo_ms * NS_PER_MS)
        try:
            pending = self.client.start_infer(model, self.inputs[model], slo_ms=slo_ms)
        except ClientError as error:
            self._sent(index, model, scheduled_ns, sent_ns)
            self._answered(index, sent_ns, error, done, slo_ns)
            return done
        self._sent(index, model, scheduled_ns, sent_ns)
        pending.add_done_callback(
            lambda answer: self._answered(index, sent_ns, answer, done, slo_ns)
        )
        return done

    def _sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None:
        self.recorder.on_sent(scheduled_ns, sent_ns)
        for observer in self.observers:
            observer.on_sent(index, model, scheduled_ns, sent_ns)

    def _answered(
        self,
        index: int,
        sent_ns: int,
        answer: Answer,
        done: asyncio.Future[None],
        slo_ns: int | None = None,
    ) -> None:
        if self._books_closed:
            return  # counted as lost
        now_ns = self.now_ns()
        self.recorder.on_answer(sent_ns, now_ns, answer, slo_ns)
        for observer in self.observers:
            observer.on_answer(index, sent_ns, now_ns, answer)
        if not done.done():
            done.set_result(None)
        if not self._sending and not self.recorder.outstanding:
            self._all_answered.set()

    async def open_loop(
        self,
        arrivals: Iterable[tuple[Sequence[int], Sequence[int]]],
        slo_ms: float,
        end_ns: int = 0,
        slos_ms: Sequence[float] | None = None,
    ) -> None:
        """Send each arrival at its time; never wait for replies. Then wait until ``end_ns``
        (the schedule's end: a run lasts its duration however its last arrival fell).
        ``slos_ms``: each arrival's own SLO (a replayed log's), else ``slo_ms`` for all."""
        behind, index = 0, 0
        for times_ns, instances in arrivals:
            for scheduled_ns, instance in zip(times_ns, instances, strict=True):
                self.recorder.on_scheduled(scheduled_ns)
                delay_ns = scheduled_ns - self.now_ns()
                if delay_ns > 0:
                    await asyncio.sleep(delay_ns / NS_PER_S)
                    behind = 0
                elif (behind := behind + 1) % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                self.send(instance, scheduled_ns, slo_ms if slos_ms is None else slos_ms[index])
                index += 1
        if (delay_ns := end_ns - self.now_ns()) > 0:
            await asyncio.sleep(delay_ns / NS_PER_S)
        self.send_end_ns = self.now_ns()

    async def closed_loop(self, concurrency: int, duration_ns: int, slo_ms: float) -> None:
        """``concurrency`` workers, each sending its next request when the last is answered."""

        async def worker(index: int) -> None:
            while (now_ns := self.now_ns()) < duration_ns:
                self.recorder.on_scheduled(now_ns)  # due as soon as the last was answered
                await self.send(index, now_ns, slo_ms)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        self.send_end_ns = self.now_ns()

    async def finish(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the replies still due; those that do not come are lost."""
        self._sending = False
        if not self.send_end_ns:
            self.send_end_ns = self.now_ns()
        if self.recorder.outstanding:
            self._all_answered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_answered.wait(), grace_s)
        self._books_closed = True

    def client_cpu(self) -> dict[str, float]:
        """This process's CPU seconds since the run began, and their share of the wall time
        (the generator's own cost: near 1.0, it may be what limits the load)."""
        cpu_s = time.process_time() - self.cpu_start_s
        wall_s = max(self.now_ns() / NS_PER_S, 1e-9)
        return {"cpu_s": round(cpu_s, 3), "cpu_share": round(cpu_s / wall_s, 3)}


# Per request: when it left (monotonic ns) and how late against its schedule; its model; its
# status ("lost" until answered, "connection_closed" for a connection error); the client's
# latency; then what the reply says: batch size, executor, measured and predicted execute time
# of its batch, the daemon's queueing and total time, and the two executor hops (sent ->
# started there, ended there -> result received).
ROW_COLUMNS = (
    "sent_ns",
    "lag_ns",
    "model",
    "status",
    "latency_ns",
    "batch_size",
    "executor",
    "execute_ns",
    "predicted_ns",
    "queue_ns",
    "daemon_ns",
    "to_executor_ns",
    "from_executor_ns",
)
_ROW_DEFAULTS = (0, 0, "", "lost", 0, 0, "", 0, 0, 0, 0, 0, 0)
_TIMING_COLUMNS = (
    ("execute_ns", "execute"),
    ("predicted_ns", "predicted_execute"),
    ("queue_ns", "queue"),
    ("daemon_ns", "total"),
    ("to_executor_ns", "to_executor"),
    ("from_executor_ns", "from_executor"),
)


class RequestRows:
    """An `Observer` keeping one row per request sent, column-wise (`ROW_COLUMNS`). Its
    ``sent_ns`` are ``time.monotonic_ns()`` (one clock for every process on the machine), so
    rows of two generators and the marks of the process that started them line up."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns  # the run's start_ns
        self.columns: dict[str, list[Any]] = {name: [] for name in ROW_COLUMNS}

    def on_sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None:
        values = (self.origin_ns + sent_ns, max(0, sent_ns - scheduled_ns), model)
        for name, value in zip(ROW_COLUMNS, values + _ROW_DEFAULTS[3:], strict=True):
            self.columns[name].append(value)

    def on_answer(self, index: int, sent_ns: int, now_ns: int, answer: Answer) -> None:
        columns = self.columns
        columns["latency_ns"][index] = now_ns - sent_ns
        if isinstance(answer, ClientError):
            columns["status"][index] = "connection_closed"
            return
        columns["status"][index] = answer.status
        columns["batch_size"][index] = answer.batch_size
        columns["executor"][index] = answer.executor_id
        for name, key in _TIMING_COLUMNS:
            columns[name][index] = int(answer.timing_ns.get(key, 0))


def phases(instances: int, rates_and_durations: Sequence[tuple[float, float]]) -> OpenLoop:
    """Poisson phases back to back: ``(rate_rps, duration_s)`` each, the rate split evenly
    over the instances. Raises ValueError for no phase or a negative rate or duration."""
    if not rates_and_durations or any(r < 0 or d <= 0 for r, d in rates_and_durations):
        raise ValueError("phases need rates >= 0 and durations > 0")
    bounds_ns, start_ns = [], 0
    for rate_rps, duration_s in rates_and_durations:
        end_ns = start_ns + round(duration_s * NS_PER_S)
        bounds_ns.append((start_ns, end_ns, np.full(instances, rate_rps / instances)))
        start_ns = end_ns

    def segments(_rng: np.random.Generator) -> Iterator[RateSegment]:
        for begin_ns, finish_ns, rates in bounds_ns:
            yield RateSegment(begin_ns, finish_ns, rates)

    details = {"phases": [list(phase) for phase in rates_and_durations]}
    return OpenLoop("phases", instances, start_ns, segments, details)


async def drive(
    run: Run,
    workload: Workload | None,
    *,
    slo_ms: float,
    rng: np.random.Generator,
    grace_s: float | None = None,
    concurrency: int = 0,
    duration_s: float = 0.0,
    progress_s: float = 0.0,
) -> None:
    """Drive ``run``: ``workload``'s open-loop arrivals (drawn from ``rng``), or (``workload``
    None) a closed loop of ``concurrency`` for ``duration_s``; then wait ``grace_s`` (default
    2 SLOs + 2 s) for the last replies. Then `summarize` it."""
    run.recorder.slo_ns = round(slo_ms * NS_PER_MS)
    progress = None
    if progress_s > 0:
        progress = asyncio.create_task(report_progress(run, progress_s, sys.stderr))
    try:
        if workload is None:
            await run.closed_loop(concurrency, round(duration_s * NS_PER_S), slo_ms)
        else:
            slos_ns = request_slos_ns(workload)
            slos_ms = None if slos_ns is None else [slo / NS_PER_MS for slo in slos_ns]
            arrivals = workload.open_arrivals(rng)
            await run.open_loop(arrivals, slo_ms, workload.duration_ns, slos_ms)
        await run.finish(grace_s if grace_s is not None else 2 * slo_ms / 1000 + 2.0)
    finally:
        if progress is not None:
            progress.cancel()


async def report_progress(run: Run, period_s: float, stream: IO[str]) -> None:
    """A line every ``period_s``: sent, rate, answers, ok, latency, lag."""
    last_sent, last_ns = 0, 0
    while True:
        await asyncio.sleep(period_s)
        now_ns, rec = run.now_ns(), run.recorder
        rate = (rec.sent - last_sent) / max((now_ns - last_ns) / NS_PER_S, 1e-9)
        latency = latency_summary_ms(rec.stats.latency_us)
        lag = latency_summary_ms(rec.lag_us)
        print(
            f"[{now_ns / NS_PER_S:7.1f} s] sent {rec.sent} ({rate:.1f}/s) answered "
            f"{rec.answered} ok {rec.stats.outcomes[Outcome.OK.value]} "
            f"p99 {_fmt(latency['p99'])} ms, send lag p99 {_fmt(lag['p99'])} ms",
            file=stream,
            flush=True,
        )
        last_sent, last_ns = rec.sent, now_ns


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summarize(
    run: Run, duration_ns: int, workload: Mapping[str, Any], timeline: bool = False
) -> dict[str, Any]:
    """The run's JSON summary: keys as ``simulate``'s, plus ``send`` (what was sent against
    the schedule), ``scheduled``, ``client`` (this process's CPU), ``client_within_slo`` and
    ``errors``; with ``timeline``, per-second series too (``timeline``, ``sent_per_s``,
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


# --- the verb ------------------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(prog="clockwork-async bench", description="Load a running daemon.")
    add = parser.add_argument
    add("--model", help="the model to send to")
    add("--models", help="comma-separated models; request i goes to model i mod N")
    add("--copies", type=int, help="send to the copies NAME-0 .. NAME-{N-1} of --model NAME")
    add("--rate", type=float, help="open loop: Poisson requests per second, all models")
    add("--concurrency", type=int, help="closed loop: requests kept in flight")
    add("--trace", type=Path, help="open loop: replay an Azure Functions invocations CSV")
    add("--load-scale", type=float, default=1.0, help="--trace: multiplies its rates")
    add("--replay", type=Path, help="open loop: replay a per-request CSV log (sim.replay)")
    add("--time-scale", type=float, default=1.0, help="--replay: multiplies its gaps")
    add("--duration-s", type=float, help="default 10 (--replay: the whole log)")
    add("--quick", action="store_true", help="a 1 s run (for smoke tests)")
    add("--slo-ms", type=float, default=100.0)
    add("--seed", type=int, default=0)
    add("--grace-s", type=float, help="wait for late replies (default: 2 SLOs + 2 s)")
    add("--progress-s", type=float, default=1.0, help="progress line period (0: off)")
    add("--json", type=Path, help="write the summary here (it is printed too)")
    add("--plot", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    add("--rows", type=Path, help="write one row per request (JSON, columns) here")
    add("--timeline", action="store_true", help="per-second series in the summary")
    add_connection_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> list[str]:
    """Cross-flag checks; returns the model names. Raises UsageError."""
    models = [m for m in (args.models or args.model or "").split(",") if m]
    if not models:
        raise UsageError("give --model M or --models M1,M2")
    if args.copies is not None:
        if args.models or args.copies < 1:
            raise UsageError("--copies N (N >= 1) goes with --model NAME")
        models = copy_names(models[0], args.copies)
    modes = sum(x is not None for x in (args.rate, args.concurrency, args.trace, args.replay))
    if modes != 1:
        raise UsageError(
            "give exactly one of --rate R, --concurrency N, --trace FILE, --replay FILE"
        )
    if args.quick:
        args.duration_s = 1.0
    if args.duration_s is None and args.replay is None:
        args.duration_s = 10.0
    positive = {"--slo-ms": args.slo_ms, "--time-scale": args.time_scale}
    if args.duration_s is not None:
        positive["--duration-s"] = args.duration_s
    if args.rate is not None:
        positive["--rate"] = args.rate
    if args.concurrency is not None:
        positive["--concurrency"] = args.concurrency
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    return models


def copy_names(model: str, copies: int) -> list[str]:
    """The daemon's names of a model's copies: ``NAME-i``, or ``NAME`` for one copy."""
    return [model] if copies == 1 else [f"{model}-{i}" for i in range(copies)]


def open_workload(args: argparse.Namespace, models: Sequence[str]) -> Workload:
    """The open-loop workload of the flags (a replay fills in ``args.duration_s`` when it was
    not given). Raises ValueError (TraceFormatError, RequestLogError), OSError."""
    instances = len(models)
    if args.replay is not None:
        duration_s = args.duration_s
        workload = replay(
            read_request_log(args.replay),
            models,
            time_scale=args.time_scale,
            duration_s=duration_s,
            default_slo_ms=args.slo_ms,
        )
        args.duration_s = workload.duration_ns / NS_PER_S
        return workload
    if args.trace is None:
        return poisson(instances, args.rate, args.duration_s)
    trace = read_azure_trace(args.trace, args.duration_s / 60.0)
    return trace_replay(TraceMapping(trace, instances), args.duration_s, args.load_scale)


async def draw_inputs(
    client: AsyncClient, models: Sequence[str], rng: np.random.Generator, shared: bool = False
) -> dict[str, Mapping[str, np.ndarray]]:
    """Random inputs per model as the daemon describes them (``shared``: one for all, drawn
    for the first: copies of one model). Raises ClientError for a model it does not serve."""
    served = {m.name: m for m in await client.models()}
    missing = [m for m in models if m not in served]
    if missing:
        raise ClientError(f"unknown_model: the daemon serves no model {missing[0]!r}")
    if shared:
        one = random_inputs(served[models[0]].inputs, rng)
        return dict.fromkeys(models, one)
    return {m: random_inputs(served[m].inputs, rng) for m in models}


async def bench(args: argparse.Namespace, models: list[str]) -> dict[str, Any]:
    """Run the bench the flags describe; returns its summary. Raises ClientError."""
    ssl = client_ssl_context(args.tls_ca) if args.tls or args.tls_ca else None
    async with await AsyncClient.connect(args.address, token=args.token, ssl=ssl) as client:
        rng = np.random.default_rng(args.seed)
        inputs = await draw_inputs(client, models, rng, shared=args.copies is not None)
        workload = None if args.concurrency else open_workload(args, models)
        run = Run(client, inputs)
        rows = RequestRows(run.start_ns) if args.rows is not None else None
        if rows is not None:
            run.observers = (rows,)
        await drive(
            run,
            workload,
            slo_ms=args.slo_ms,
            rng=rng,
            grace_s=args.grace_s,
            concurrency=args.concurrency or 0,
            duration_s=args.duration_s,
            progress_s=args.progress_s,
        )
    described: Mapping[str, Any] = (
        {"workload": "closed", "concurrency": args.concurrency}
        if workload is None
        else workload.describe()
    )
    duration_ns = round(args.duration_s * NS_PER_S)
    named: list[str] | str = models
    if args.copies is not None:  # thousands of copies are named by their range
        named = f"{models[0]} .. {models[-1]} ({len(models)} copies)"
    summary = summarize(run, duration_ns, {**described, "models": named}, args.timeline)
    summary["config"] = {"address": args.address, "slo_ms": args.slo_ms, "seed": args.seed}
    if args.trace is not None:
        summary["config"]["load_scale"] = args.load_scale
    if args.replay is not None:
        summary["config"]["time_scale"] = args.time_scale
    if rows is not None:
        write_rows(args.rows, run, rows)
        summary["rows"] = str(args.rows)
    if args.plot is not None:
        summary["plots"] = [str(p) for p in write_plots(run, duration_ns, args.plot, args.slo_ms)]
    return summary


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


def main(argv: list[str]) -> int:
    """Entry point of the verb: 0 done, 1 lost requests or no connection, 2 usage error."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        models = check_args(args)
        summary = _run_loop(bench(args, models))
    except UsageError as error:
        print(f"clockwork-async bench: {error}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except (ClientError, ValueError, OSError) as error:
        print(f"clockwork-async bench: {error}", file=sys.stderr)
        return 1
    text = json.dumps(summary, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 1 if summary["lost"] else 0


def _run_loop(coroutine: Any) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        result: dict[str, Any] = asyncio.run(coroutine)
        return result
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)  # type: ignore[no-any-return]
