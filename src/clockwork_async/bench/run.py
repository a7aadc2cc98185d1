"""The load generator's engine: a `Run` sends requests on one connection through any
open-loop schedule (`sim.workloads`, `phases`) or a closed loop (`drive`), counts every
request once in its `Recorder`, and shows each request sent and answered to its observers
(`Observer`, e.g. `RequestRows`).

Invariants: open-loop arrivals leave on their schedule from this process and never wait for a
reply (nor for the socket to drain); every request sent is counted exactly once, as an
outcome, an error status or lost (no answer before the end of the grace period). Latency is
measured here, from the moment a request was handed to the socket to its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import numpy as np

from clockwork_async.api.async_client import AsyncClient, ClientError, InferResult
from clockwork_async.core.outcomes import Outcome
from clockwork_async.sim.stats import SimStats, latency_summary_ms
from clockwork_async.sim.workloads import (
    OpenLoop,
    RateSegment,
    Workload,
    request_slos_ns,
)

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
_YIELD_EVERY = 64  # sends in a row (when behind schedule) before letting replies in


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
