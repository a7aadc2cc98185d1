"""Every Prometheus metric of the daemon, defined once here on an injected registry.

One idea: the daemon as Prometheus sees it.

Invariants: names start with ``clockwork_``, are in base units (seconds, bytes) and counters
end in ``_total``; every label set is bounded whatever clients do: latency histograms are
labelled by model *group* (one per ONNX file, or model.toml's ``group``), never by instance;
per-instance counters admit the first ``instance_label_limit`` instances and count the rest
under ``instance="other"``; groups and executors are capped the same way. Live state (pages,
queue depth, executors up) is not copied into gauges as it changes: a collector reads it from
the caller's snapshot function at scrape time, on the event loop that serves the scrape; so
are counters that the controller core keeps itself (cold starts), so there is one count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from clockwork_async import build
from clockwork_async.api.service import InferOutcome
from clockwork_async.core.outcomes import Outcome
from clockwork_async.ioarena.shared import IoArena
from clockwork_async.runtime.requests import ActionRecord
from clockwork_async.wire.messages import ActionResult, ApiCode

log = logging.getLogger(__name__)

NS_PER_S = 1e9

OTHER = "other"
# From 0.5 ms to 10 s: a fast model's execute up to a generous SLO.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
# Prediction errors are small when all is well: from 10 µs up.
ERROR_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1)
LAG_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# Outcomes where the daemon failed a valid request (client mistakes and cancels are not drops).
DROP_REASONS = frozenset(
    {
        Outcome.DROPPED,
        Outcome.FAILED,
        Outcome.LATE,
        Outcome.INFEASIBLE,
        Outcome.OVERLOADED,
        Outcome.SHUTTING_DOWN,
    }
)
ANSWERED_WITH_OUTPUTS = frozenset({Outcome.OK, Outcome.LATE})
PREDICTION_KINDS = ("infer", "load")
PROTOCOLS = frozenset({"msgpack", "http", "grpc"})
# Statuses of answered infers: outcomes, client-API codes and the v2 front ends' own refusals.
ANSWER_STATUSES = frozenset(
    {*Outcome, *ApiCode, "unauthorized", "too_large", "request_timeout", "not_found"}
)
# Executor lanes whose busy time is counted: one execute lane and one load lane per executor.
BUSY_KINDS = ("infer", "load")
MAX_EXECUTOR_LABELS = 256


class BoundedLabel:
    """Admits the first ``limit`` distinct values as themselves; any later one is ``other``."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"label limit must be >= 0, not {limit}")
        self.limit = limit
        self._admitted: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._admitted:
            return value
        if len(self._admitted) < self.limit and value != OTHER:
            self._admitted.add(value)
            return value
        return OTHER


@dataclass(frozen=True, slots=True)
class ExecutorGauges:
    """One executor as the driver sees it now."""

    executor: str
    up: bool
    pages_used: int
    pages_total: int
    models_loaded: int


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """What the live gauges show; the daemon adapts the driver's snapshot to this."""

    executors: tuple[ExecutorGauges, ...] = ()
    queue_depth: int = 0  # accepted requests not yet sent to an executor
    queue_depth_by_group: Mapping[str, int] = field(default_factory=dict)
    running_requests: int = 0  # in a batch sent to an executor, not yet answered
    outstanding_requests: int = 0  # accepted, not yet answered
    models_registered: int = 0  # instances
    client_connections: int = 0
    cold_starts: int = 0  # the core's count since start (a counter)
    warm_ups: int = 0  # the core's count of warm-up INFERs since start (a counter)
    loop_delay_ns: int = 0  # the daemon's own booked work ahead of now (its door)
    loop_request_ns: float = 0.0  # its learned cost of one admitted request


SnapshotSource = Callable[[], LiveSnapshot]


class Metrics:
    """The daemon's metrics. Methods are cheap and never raise for well-formed arguments; an
    unknown outcome or prediction kind is a programming error (ValueError)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        instance_label_limit: int = 100,
        group_label_limit: int = 1000,
        include_process: bool = True,
    ) -> None:
        self._instance = BoundedLabel(instance_label_limit)
        # Served name -> instance label, for replaced models served as ``NAME@vN``.
        self.instance_aliases: dict[str, str] = {}
        self._group = BoundedLabel(group_label_limit)
        self._executor = BoundedLabel(MAX_EXECUTOR_LABELS)
        # `_created` series would double every series for a timestamp nobody queries. The
        # switch is process-wide in prometheus_client; this daemon is its only user.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self._groups_seen: set[str] = set()
        # Each label set's child, kept: `labels()` validates and locks on every call, several
        # times per request; label sets are bounded above and never removed.
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self._define_counters(registry)
        self._define_histograms(registry)
        self._live = _LiveCollector(self._group, self._executor)
        registry.register(self._live)
        self._arena = _ArenaCollector()
        registry.register(self._arena)
        if include_process:
            ProcessCollector(namespace="", registry=registry)

    def _define_counters(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: Iterable[str]) -> Counter:
            return Counter(f"clockwork_{name}", doc, list(labels), registry=registry)

        self.requests = counter(
            "requests", "Requests answered, by model group and outcome.", ["group", "outcome"]
        )
        self.instance_requests = counter(
            "instance_requests",
            "Requests answered, by model instance (the first instance_label_limit; "
            'the rest as "other") and outcome.',
            ["instance", "outcome"],
        )
        self.drops = counter(
            "drops", "Valid requests not answered ok in time, by reason.", ["group", "reason"]
        )
        self.api_requests = counter(
            "api_requests",
            "Infer requests answered, by front end (msgpack, http, grpc) and status (an "
            "outcome, or the front end's own refusal such as unauthorized or bad_request).",
            ["protocol", "status"],
        )
        self.evictions = counter("evictions", "Models unloaded to free pages.", ["group"])
        self.executor_restarts = counter(
            "executor_restarts",
            "Executor processes restarted or links re-established.",
            ["executor"],
        )
        # rate() of it is a lane's utilisation (0..1): each executor runs one action of a kind
        # at a time. Per-request execute histograms cannot give it (a batch counts once per row).
        self.executor_busy = counter(
            "executor_busy_seconds",
            "Seconds an executor spent running actions that succeeded, by kind (infer, load).",
            ["executor", "kind"],
        )

    def _define_histograms(self, registry: CollectorRegistry) -> None:
        def histogram(
            name: str, doc: str, labels: Iterable[str], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(
                f"clockwork_{name}", doc, list(labels), registry=registry, buckets=buckets
            )

        by_group = ["group"]
        self.request_duration = histogram(
            "request_duration_seconds",
            "Arrival to reply of requests answered with outputs (ok or late).",
            by_group,
            LATENCY_BUCKETS_S,
        )
        self.queue_duration = histogram(
            "queue_duration_seconds", "Arrival to start of execution.", by_group, LATENCY_BUCKETS_S
        )
        self.execute_duration = histogram(
            "execute_duration_seconds",
            "Measured execution of the batch.",
            by_group,
            LATENCY_BUCKETS_S,
        )
        self.deadline_slack = histogram(
            "deadline_slack_seconds",
            "Deadline minus reply time of ok requests.",
            by_group,
            LATENCY_BUCKETS_S,
        )
        self.load_duration = histogram(
            "load_duration_seconds",
            "Measured LOAD of a model onto an executor.",
            by_group,
            LATENCY_BUCKETS_S,
        )
        self.prediction_error = histogram(
            "prediction_error_seconds",
            "|actual - predicted| duration of actions; direction=slower when actual > predicted.",
            ["kind", "direction"],
            ERROR_BUCKETS_S,
        )
        self.loop_lag = histogram(
            "event_loop_lag_seconds", "How late the event loop ran a timer.", [], LAG_BUCKETS_S
        )

    # --- observations --------------------------------------------------------------------------

    def observe_reply(
        self,
        model: str,
        group: str,
        outcome: str,
        total_s: float,
        queue_s: float | None = None,
        execute_s: float | None = None,
        slack_s: float | None = None,
    ) -> None:
        """One reply: counts it and, for replies with outputs, its latencies and slack."""
        result = Outcome(outcome)
        group_label = self._group_label(group)
        self._child(self.requests, group_label, result.value).inc()
        instance = self._instance(self.instance_aliases.get(model, model))
        self._child(self.instance_requests, instance, result.value).inc()
        if result in DROP_REASONS:
            self._child(self.drops, group_label, result.value).inc()
        if result not in ANSWERED_WITH_OUTPUTS:
            return
        self._child(self.request_duration, group_label).observe(total_s)
        if queue_s is not None:
            self._child(self.queue_duration, group_label).observe(queue_s)
        if execute_s is not None:
            self._child(self.execute_duration, group_label).observe(execute_s)
        if slack_s is not None and slack_s >= 0 and result is Outcome.OK:
            self._child(self.deadline_slack, group_label).observe(slack_s)

    def observe_outcome(self, model: str, group: str, slack_ns: int, outcome: InferOutcome) -> None:
        """One answer, as the dispatcher hands it to its outcome listeners (labels of
        unknown models are already ``other``): `observe_reply` with its timings."""
        timing = outcome.timing_ns
        ran = outcome.executor_id is not None
        self.observe_reply(
            model,
            group,
            outcome.outcome.value,
            timing.get("total", 0) / NS_PER_S,
            timing.get("queue", 0) / NS_PER_S if ran else None,
            timing.get("execute", 0) / NS_PER_S if ran else None,
            slack_ns / NS_PER_S,
        )

    def observe_action(self, group: str, action: ActionRecord, result: ActionResult) -> None:
        """One action's result, as the dispatcher hands it to its action listeners: executor
        busy time of INFERs and LOADs, prediction errors of INFERs, LOAD durations and
        evictions (UNLOADs) of successful actions."""
        if not result.ok or group == OTHER:  # a model no longer served
            return
        if action.kind in BUSY_KINDS:  # both ends are the executor's clock
            busy_s = (result.end_ns - result.start_ns) / NS_PER_S
            self.observe_busy(action.executor_id, action.kind, busy_s)
        if action.kind == "infer":
            error_ns = result.durations_ns.get("execute", 0) - action.predicted_ns
            self.observe_prediction("infer", error_ns / NS_PER_S)
        elif action.kind == "load":
            self.observe_load(group, result.durations_ns.get("load", 0) / NS_PER_S)
        elif action.kind == "unload":
            self.observe_eviction(group)

    def observe_answer(self, protocol: str, status: str) -> None:
        """One infer answered by front end ``protocol`` with ``status`` (labels outside the
        fixed sets count as ``other``)."""
        protocol = protocol if protocol in PROTOCOLS else OTHER
        status = status if status in ANSWER_STATUSES else OTHER
        self._child(self.api_requests, protocol, status).inc()

    def observe_prediction(self, kind: str, error_s: float) -> None:
        """``error_s`` = actual - predicted duration of an ``infer`` or ``load`` action."""
        if kind not in PREDICTION_KINDS:
            raise ValueError(f"prediction kind must be one of {PREDICTION_KINDS}, not {kind!r}")
        direction = "slower" if error_s > 0 else "faster"
        self._child(self.prediction_error, kind, direction).observe(abs(error_s))

    def observe_load(self, group: str, duration_s: float) -> None:
        self.load_duration.labels(self._group_label(group)).observe(duration_s)

    def observe_eviction(self, group: str) -> None:
        self.evictions.labels(self._group_label(group)).inc()

    def observe_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(max(0.0, seconds))

    def track_executor(self, executor_id: str) -> None:
        """Start an executor's restart count at 0, so that increase() sees its first restart."""
        self.executor_restarts.labels(self._executor(executor_id))

    def executor_restarted(self, executor_id: str) -> None:
        self.executor_restarts.labels(self._executor(executor_id)).inc()

    def observe_busy(self, executor_id: str, kind: str, seconds: float) -> None:
        """One action of ``kind`` (``infer`` or ``load``) ran ``seconds`` on an executor."""
        if kind not in BUSY_KINDS:
            raise ValueError(f"busy kind must be one of {BUSY_KINDS}, not {kind!r}")
        self._child(self.executor_busy, self._executor(executor_id), kind).inc(max(0.0, seconds))

    def set_snapshot_source(self, source: SnapshotSource | None) -> None:
        """Where the live gauges come from at scrape time (None: no live gauges)."""
        self._live.source = source

    def set_arena(self, arena: IoArena | None) -> None:
        """The IO arena whose occupancy is read at scrape time (None: no arena gauges)."""
        self._arena.arena = arena

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _group_label(self, group: str) -> str:
        label = self._group(group)
        if label not in self._groups_seen:  # so rate() sees every outcome from zero
            self._groups_seen.add(label)
            for outcome in Outcome:
                self.requests.labels(label, outcome.value)
        return label


class _LiveCollector:
    """Gauges read from a snapshot at scrape time."""

    def __init__(self, group: BoundedLabel, executor: BoundedLabel) -> None:
        self.source: SnapshotSource | None = None
        self._group = group
        self._executor = executor

    def describe(self) -> list[Metric]:
        return list(_live_families(LiveSnapshot(), self._group, self._executor, samples=False))

    def collect(self) -> Iterator[Metric]:
        yield _build_info()
        if self.source is None:
            return
        try:
            snapshot = self.source()
        except Exception:
            log.exception("metrics snapshot failed; live gauges left out of this scrape")
            return
        yield from _live_families(snapshot, self._group, self._executor, samples=True)


class _ArenaCollector:
    """The IO arena's occupancy and refusals, read from it at scrape time."""

    CAUSES = ("full", "share", "too_large")

    def __init__(self) -> None:
        self.arena: IoArena | None = None

    def describe(self) -> list[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        if self.arena is not None:
            yield from self._families(self.arena)

    def _families(self, arena: IoArena | None) -> Iterator[Metric]:
        gauges = {
            "io_arena_used_bytes": ("IO arena bytes held by slots (requests' tensors).", "used"),
            "io_arena_capacity_bytes": ("IO arena bytes slots can take (fixed).", "capacity"),
            "io_arena_slots": ("IO arena slots live (inputs and output regions).", "slots"),
        }
        values = {}
        if arena is not None:
            values = {
                "used": arena.used_bytes,
                "capacity": arena.capacity_bytes,
                "slots": arena.live_slots,
            }
        for name, (doc, key) in gauges.items():
            yield GaugeMetricFamily(f"clockwork_{name}", doc, value=values.get(key))
        refusals = CounterMetricFamily(
            "clockwork_io_arena_refusals",
            "Requests refused at the door for want of IO arena room, by cause "
            "(full, share: the connection's share, too_large: over any one request's).",
            labels=["cause"],
        )
        counts = arena.refusals if arena is not None else {}
        for cause in self.CAUSES if arena is not None else ():
            refusals.add_metric([cause], counts.get(cause, 0))
        yield refusals


def _live_families(
    snapshot: LiveSnapshot, group: BoundedLabel, executor: BoundedLabel, *, samples: bool
) -> Iterator[Metric]:
    per_executor: dict[str, tuple[str, Callable[[ExecutorGauges], float]]] = {
        "executor_up": ("1 if the executor is connected and serving.", lambda e: float(e.up)),
        "executor_pages_used": ("Weight pages in use.", lambda e: e.pages_used),
        "executor_pages_capacity": ("Weight pages in the arena.", lambda e: e.pages_total),
        "executor_models_loaded": ("Model instances loaded.", lambda e: e.models_loaded),
    }
    for name, (doc, value_of) in per_executor.items():
        family = GaugeMetricFamily(f"clockwork_{name}", doc, labels=["executor"])
        for gauges in snapshot.executors if samples else ():
            family.add_metric([executor(gauges.executor)], value_of(gauges))
        yield family
    by_group = GaugeMetricFamily(
        "clockwork_group_queue_depth", "Queued requests by model group.", labels=["group"]
    )
    for label, depth in _summed(snapshot.queue_depth_by_group, group).items() if samples else ():
        by_group.add_metric([label], depth)
    yield by_group
    totals = {
        "queue_depth": ("Accepted requests not yet sent to an executor.", snapshot.queue_depth),
        "running_requests": (
            "Accepted requests in a batch sent to an executor, not yet answered.",
            snapshot.running_requests,
        ),
        "outstanding_requests": (
            "Accepted requests not yet answered.",
            snapshot.outstanding_requests,
        ),
        "models_registered": ("Model instances registered.", snapshot.models_registered),
        "client_connections": ("Open client API connections.", snapshot.client_connections),
        "loop_delay_seconds": (
            "The daemon's own booked work ahead of now: past a share of a request's time to "
            "its deadline, the door refuses it overloaded.",
            snapshot.loop_delay_ns / NS_PER_S,
        ),
        "loop_request_cost_seconds": (
            "The daemon's learned cost of one admitted request on its own loop (CPU).",
            snapshot.loop_request_ns / NS_PER_S,
        ),
    }
    for name, (doc, value) in totals.items():
        yield GaugeMetricFamily(f"clockwork_{name}", doc, value=value if samples else None)
    yield CounterMetricFamily(
        "clockwork_cold_starts",
        "LOADs of a model that had no copy loaded or loading: its requests wait for the LOAD.",
        value=snapshot.cold_starts if samples else None,
    )
    yield CounterMetricFamily(
        "clockwork_warm_ups",
        "INFERs of no request sent to warm a cold execute lane (controller warm_up_infers).",
        value=snapshot.warm_ups if samples else None,
    )


def _summed(by_group: Mapping[str, int], group: BoundedLabel) -> dict[str, int]:
    summed: dict[str, int] = {}
    for name, depth in by_group.items():
        label = group(name)
        summed[label] = summed.get(label, 0) + depth
    return summed


def _build_info() -> Metric:
    info = GaugeMetricFamily(
        "clockwork_build_info",
        "Always 1; the version, and whether the core is compiled (mypyc) or pure Python.",
        labels=["version", "core"],
    )
    info.add_metric([build.version(), build.core_label()], 1)
    return info


async def probe_loop_lag(observe: Callable[[float], None], interval_s: float = 0.1) -> None:
    """Forever: sleep ``interval_s`` and report how late the loop woke us (cancel to stop).
    On uvloop timers are millisecond-grained, so lag below ~1 ms is timer granularity."""
    loop = asyncio.get_running_loop()
    while True:
        due_s = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - due_s))
