"""``clockwork-async bench``: a load generator against a running daemon.

Modes: open-loop Poisson (``--rate``), replay of an Azure Functions trace (``--trace``; the
workloads of `sim.workloads`, drawn on the same schedule the simulator uses), or closed loop
(``--concurrency N``: N requests always in flight). The summary has the outcome keys and latency
percentiles of ``clockwork-async simulate`` plus what the generator itself achieved: its send
rate and its send lag (how late each request left against its schedule), so a generator that
cannot keep up is visible rather than mistaken for a slow daemon.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from clockwork_async.api.async_client import AsyncClient, ClientError, InferResult
from clockwork_async.api.auth import client_ssl_context
from clockwork_async.cli_client import Parser, UsageError, add_connection_flags, random_inputs
from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome
from clockwork_async.sim.stats import SimStats, latency_summary_ms
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import OpenLoop, poisson, trace_replay

NS_PER_S = 1_000_000_000
_YIELD_EVERY = 64  # sends in a row (when behind schedule) before letting replies in
_ENDINGS = (Outcome.OK, Outcome.DROPPED, Outcome.FAILED, Outcome.LATE, Outcome.CANCELLED)


@dataclass(slots=True)
class Recorder:
    """Counts what was sent and answered; times are ns since the run's start."""

    stats: SimStats
    lag_us: Counter[int] = field(default_factory=Counter)
    daemon_us: Counter[int] = field(default_factory=Counter)  # the daemon's own total
    errors: Counter[str] = field(default_factory=Counter)  # statuses that are no outcome
    sent: int = 0
    answered: int = 0
    last_send_ns: int = 0
    slo_ns: int = 0  # when set, ok replies received later than this after sending are counted
    ok_after_slo: int = 0

    def on_sent(self, scheduled_ns: int, sent_ns: int) -> None:
        self.stats.on_arrival(sent_ns, False)
        self.sent += 1
        self.last_send_ns = sent_ns
        self.lag_us[max(0, sent_ns - scheduled_ns) // 1000] += 1

    def on_answer(self, sent_ns: int, now_ns: int, answer: InferResult | ClientError) -> None:
        self.answered += 1
        if isinstance(answer, ClientError):
            self.errors["connection_closed"] += 1
            return
        outcome = answer.outcome
        if outcome is None:
            self.errors[answer.status] += 1
            return
        self.stats.on_reply(outcome, now_ns, sent_ns)
        if outcome is Outcome.OK and self.slo_ns and now_ns - sent_ns > self.slo_ns:
            self.ok_after_slo += 1
        if "total" in answer.timing_ns:
            self.daemon_us[answer.timing_ns["total"] // 1000] += 1

    @property
    def outstanding(self) -> int:
        return self.sent - self.answered


class Run:
    """One bench run on one connection."""

    def __init__(self, client: AsyncClient, inputs: Mapping[str, Mapping[str, np.ndarray]]):
        self.client = client
        self.inputs = inputs
        self.models = list(inputs)
        self.start_ns = time.monotonic_ns()
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
        sent_ns = self.now_ns()
        try:
            pending = self.client.start_infer(model, self.inputs[model], slo_ms=slo_ms)
        except ClientError as error:
            self.recorder.on_sent(scheduled_ns, sent_ns)
            self._answered(sent_ns, error, done)
            return done
        self.recorder.on_sent(scheduled_ns, sent_ns)
        pending.add_done_callback(lambda answer: self._answered(sent_ns, answer, done))
        return done

    def _answered(
        self, sent_ns: int, answer: InferResult | ClientError, done: asyncio.Future[None]
    ) -> None:
        if self._books_closed:
            return  # counted as lost
        self.recorder.on_answer(sent_ns, self.now_ns(), answer)
        if not done.done():
            done.set_result(None)
        if not self._sending and not self.recorder.outstanding:
            self._all_answered.set()

    async def open_loop(
        self, arrivals: Iterator[tuple[list[int], list[int]]], slo_ms: float
    ) -> None:
        """Send each arrival at its time; never wait for replies."""
        behind = 0
        for times_ns, instances in arrivals:
            for scheduled_ns, instance in zip(times_ns, instances, strict=True):
                delay_ns = scheduled_ns - self.now_ns()
                if delay_ns > 0:
                    await asyncio.sleep(delay_ns / NS_PER_S)
                    behind = 0
                elif (behind := behind + 1) % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                self.send(instance, scheduled_ns, slo_ms)

    async def closed_loop(self, concurrency: int, duration_ns: int, slo_ms: float) -> None:
        """``concurrency`` workers, each sending its next request when the last is answered."""

        async def worker(index: int) -> None:
            while (now_ns := self.now_ns()) < duration_ns:
                await self.send(index, now_ns, slo_ms)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    async def finish(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the replies still due; those that do not come are lost."""
        self._sending = False
        if self.recorder.outstanding:
            self._all_answered.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_answered.wait(), grace_s)
        self._books_closed = True


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


def summarize(run: Run, duration_ns: int, workload: Mapping[str, Any]) -> dict[str, Any]:
    """The run's JSON summary (keys as ``simulate``'s, plus ``send`` and ``errors``)."""
    rec = run.recorder
    outcomes = rec.stats.outcomes
    lost = rec.outstanding
    accepted = sum(outcomes[o.value] for o in ACCEPTED_ENDINGS) + lost
    ok = outcomes[Outcome.OK.value]
    duration_s = duration_ns / NS_PER_S
    send_span_s = max(rec.last_send_ns, 1) / NS_PER_S
    return {
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
        "daemon_latency_ms": latency_summary_ms(rec.daemon_us),
        "ok_over_accepted": ok / accepted if accepted else None,
        "ok_over_requests": ok / rec.sent if rec.sent else None,
        "send": {
            "achieved_rps": round(rec.sent / send_span_s, 3) if rec.sent else 0.0,
            "lag_ms": latency_summary_ms(rec.lag_us),
        },
        "duration_seconds": duration_s,
        "wall_seconds": round(run.now_ns() / NS_PER_S, 3),
        "workload": dict(workload),
    }


# --- plots ---------------------------------------------------------------------------------------


def write_plots(run: Run, duration_ns: int, directory: Path, slo_ms: float) -> list[Path]:
    """latency.png (ok latency p50/p99/max per second) and outcomes.png (answers per second by
    status). Imports matplotlib here only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from clockwork_async.sim.report import timeline_arrays

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
    add("--rate", type=float, help="open loop: Poisson requests per second, all models")
    add("--concurrency", type=int, help="closed loop: requests kept in flight")
    add("--trace", type=Path, help="open loop: replay an Azure Functions invocations CSV")
    add("--load-scale", type=float, default=1.0, help="--trace: multiplies its rates")
    add("--duration-s", type=float, default=10.0)
    add("--quick", action="store_true", help="a 1 s run (for smoke tests)")
    add("--slo-ms", type=float, default=100.0)
    add("--seed", type=int, default=0)
    add("--grace-s", type=float, help="wait for late replies (default: 2 SLOs + 2 s)")
    add("--progress-s", type=float, default=1.0, help="progress line period (0: off)")
    add("--json", type=Path, help="write the summary here (it is printed too)")
    add("--plot", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    add_connection_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> list[str]:
    """Cross-flag checks; returns the model names. Raises UsageError."""
    models = [m for m in (args.models or args.model or "").split(",") if m]
    if not models:
        raise UsageError("give --model M or --models M1,M2")
    modes = sum(x is not None for x in (args.rate, args.concurrency, args.trace))
    if modes != 1:
        raise UsageError("give exactly one of --rate R, --concurrency N, --trace FILE")
    if args.quick:
        args.duration_s = 1.0
    positive = {"--duration-s": args.duration_s, "--slo-ms": args.slo_ms}
    if args.rate is not None:
        positive["--rate"] = args.rate
    if args.concurrency is not None:
        positive["--concurrency"] = args.concurrency
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    return models


def open_workload(args: argparse.Namespace, instances: int) -> OpenLoop:
    """The open-loop workload of the flags. Raises ValueError, TraceFormatError, OSError."""
    if args.trace is None:
        return poisson(instances, args.rate, args.duration_s)
    trace = read_azure_trace(args.trace, args.duration_s / 60.0)
    return trace_replay(TraceMapping(trace, instances), args.duration_s, args.load_scale)


async def bench(args: argparse.Namespace, models: list[str]) -> dict[str, Any]:
    """Run the bench the flags describe; returns its summary. Raises ClientError."""
    ssl = client_ssl_context(args.tls_ca) if args.tls or args.tls_ca else None
    async with await AsyncClient.connect(args.address, token=args.token, ssl=ssl) as client:
        served = {m.name: m for m in await client.models()}
        missing = [m for m in models if m not in served]
        if missing:
            raise ClientError(f"unknown_model: the daemon serves no model {missing[0]!r}")
        rng = np.random.default_rng(args.seed)
        inputs = {m: random_inputs(served[m].inputs, rng) for m in models}
        workload = None if args.concurrency else open_workload(args, len(models))
        run = Run(client, inputs)
        run.recorder.slo_ns = round(args.slo_ms * 1_000_000)
        progress = None
        if args.progress_s > 0:
            progress = asyncio.create_task(report_progress(run, args.progress_s, sys.stderr))
        try:
            if workload is None:
                await run.closed_loop(
                    args.concurrency, round(args.duration_s * NS_PER_S), args.slo_ms
                )
                described: Mapping[str, Any] = {
                    "workload": "closed",
                    "concurrency": args.concurrency,
                }
            else:
                await run.open_loop(workload.open_arrivals(rng), args.slo_ms)
                described = workload.describe()
            grace_s = args.grace_s if args.grace_s is not None else 2 * args.slo_ms / 1000 + 2.0
            await run.finish(grace_s)
        finally:
            if progress is not None:
                progress.cancel()
    duration_ns = round(args.duration_s * NS_PER_S)
    summary = summarize(run, duration_ns, {**described, "models": models})
    summary["config"] = {"address": args.address, "slo_ms": args.slo_ms, "seed": args.seed}
    if args.plot is not None:
        try:
            plots = write_plots(run, duration_ns, args.plot, args.slo_ms)
        except ImportError as error:  # the run's summary matters more than its pictures
            summary["plot_error"] = f"no plots: {error} (pip install matplotlib)"
            print(f"clockwork-async bench: {summary['plot_error']}", file=sys.stderr)
            plots = []
        summary["plots"] = [str(p) for p in plots]
    return summary


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
