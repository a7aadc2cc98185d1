"""Metrics: what each observation counts, bounded label sets, scrape-time live gauges."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from clockwork_async.core.outcomes import Outcome
from clockwork_async.daemon.metrics import (
    OTHER,
    BoundedLabel,
    ExecutorGauges,
    LiveSnapshot,
    Metrics,
    probe_loop_lag,
)
from clockwork_async.ioarena.shared import IoArena, Slot
from clockwork_async.runtime.requests import ActionRecord
from clockwork_async.wire.messages import ActionResult

MS_NS = 1_000_000


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def label_values(registry: CollectorRegistry, family: str, label: str) -> set[str]:
    found = set()
    for metric in registry.collect():
        if metric.name == family:
            found |= {sample.labels[label] for sample in metric.samples}
    return found


def series_count(registry: CollectorRegistry, prefix: str = "clockwork_") -> int:
    return sum(
        len(metric.samples) for metric in registry.collect() if metric.name.startswith(prefix)
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_an_ok_reply_counts_and_observes_every_latency(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_reply("m-0", "m", "ok", 0.02, queue_s=0.004, execute_s=0.01, slack_s=0.08)
    assert value(registry, "clockwork_requests_total", group="m", outcome="ok") == 1
    assert value(registry, "clockwork_instance_requests_total", instance="m-0", outcome="ok") == 1
    for name in ("request", "queue", "execute"):
        assert value(registry, f"clockwork_{name}_duration_seconds_count", group="m") == 1
    assert value(registry, "clockwork_request_duration_seconds_sum", group="m") == 0.02
    assert value(registry, "clockwork_deadline_slack_seconds_sum", group="m") == 0.08
    assert value(registry, "clockwork_drops_total", group="m", reason="ok") is None


def test_every_outcome_of_a_group_starts_at_zero(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_reply("m", "g", "ok", 0.01)
    for outcome in Outcome:
        expected = 1 if outcome is Outcome.OK else 0
        assert value(registry, "clockwork_requests_total", group="g", outcome=outcome) == expected


@pytest.mark.parametrize("outcome", ["dropped", "failed", "infeasible", "overloaded"])
def test_server_side_failures_are_drops_without_latency(
    registry: CollectorRegistry, outcome: str
) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_reply("m", "g", outcome, 0.01, slack_s=0.5)
    assert value(registry, "clockwork_drops_total", group="g", reason=outcome) == 1
    assert value(registry, "clockwork_request_duration_seconds_count", group="g") is None
    assert value(registry, "clockwork_deadline_slack_seconds_count", group="g") is None


def test_client_mistakes_and_cancels_are_not_drops(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    for outcome in ("unknown_model", "bad_input", "cancelled"):
        metrics.observe_reply("m", "g", outcome, 0.0)
    assert label_values(registry, "clockwork_drops", "reason") == set()


def test_a_late_reply_is_a_drop_with_latency_but_no_slack(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_reply("m", "g", "late", 0.2, execute_s=0.1, slack_s=-0.05)
    assert value(registry, "clockwork_drops_total", group="g", reason="late") == 1
    assert value(registry, "clockwork_request_duration_seconds_count", group="g") == 1
    assert value(registry, "clockwork_deadline_slack_seconds_count", group="g") is None


def test_unknown_outcome_or_prediction_kind_is_a_programming_error(
    registry: CollectorRegistry,
) -> None:
    metrics = Metrics(registry, include_process=False)
    with pytest.raises(ValueError):
        metrics.observe_reply("m", "g", "splendid", 0.01)
    with pytest.raises(ValueError, match="prediction kind"):
        metrics.observe_prediction("unload", 0.001)


def test_prediction_error_is_split_by_direction(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_prediction("infer", 0.002)
    metrics.observe_prediction("infer", -0.001)
    metrics.observe_prediction("load", 0.0)
    name = "clockwork_prediction_error_seconds_sum"
    assert value(registry, name, kind="infer", direction="slower") == 0.002
    assert value(registry, name, kind="infer", direction="faster") == 0.001
    assert value(registry, name, kind="load", direction="faster") == 0.0


def test_loads_evictions_restarts_and_lag(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_load("g", 0.003)
    metrics.observe_eviction("g")
    metrics.executor_restarted("local-0")
    metrics.observe_loop_lag(-0.001)  # clamped: a loop is never early
    assert value(registry, "clockwork_load_duration_seconds_sum", group="g") == 0.003
    assert value(registry, "clockwork_evictions_total", group="g") == 1
    assert value(registry, "clockwork_executor_restarts_total", executor="local-0") == 1
    assert value(registry, "clockwork_event_loop_lag_seconds_sum") == 0.0


def test_a_tracked_executors_restarts_start_at_zero(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    name = "clockwork_executor_restarts_total"
    assert value(registry, name, executor="local-0") is None
    metrics.track_executor("local-0")
    assert value(registry, name, executor="local-0") == 0
    metrics.executor_restarted("local-0")
    assert value(registry, name, executor="local-0") == 1


def test_executor_busy_seconds_add_up_by_executor_and_kind(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_busy("local-0", "infer", 0.25)
    metrics.observe_busy("local-0", "infer", 0.5)
    metrics.observe_busy("local-0", "load", 0.125)
    metrics.observe_busy("local-1", "infer", -0.001)  # clock jitter: never negative
    name = "clockwork_executor_busy_seconds_total"
    assert value(registry, name, executor="local-0", kind="infer") == 0.75
    assert value(registry, name, executor="local-0", kind="load") == 0.125
    assert value(registry, name, executor="local-1", kind="infer") == 0.0
    with pytest.raises(ValueError, match="busy kind"):
        metrics.observe_busy("local-0", "unload", 0.1)


def test_actions_feed_busy_time_prediction_error_and_loads(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    infer = ActionRecord("infer", "sim", 1, "m-0", 0, predicted_ns=3 * MS_NS)
    load = ActionRecord("load", "sim", 2, "m-0", 0)
    ran = ActionResult(
        1, start_ns=10 * MS_NS, end_ns=14 * MS_NS, durations_ns={"execute": 4 * MS_NS}
    )
    metrics.observe_action("g", infer, ran)
    metrics.observe_action(
        "g", load, ActionResult(2, end_ns=2 * MS_NS, durations_ns={"load": 2 * MS_NS})
    )
    metrics.observe_action("g", infer, ActionResult(3, code="too_late"))  # failed: not counted
    metrics.observe_action(OTHER, infer, ran)  # a model no longer served: not counted
    busy = "clockwork_executor_busy_seconds_total"
    assert value(registry, busy, executor="sim", kind="infer") == 0.004
    assert value(registry, busy, executor="sim", kind="load") == 0.002
    error = "clockwork_prediction_error_seconds_sum"
    assert value(registry, error, kind="infer", direction="slower") == 0.001
    assert value(registry, "clockwork_load_duration_seconds_count", group="g") == 1


def test_thousands_of_instances_keep_label_sets_bounded(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, instance_label_limit=10, include_process=False)
    for i in range(5000):
        metrics.observe_reply(f"resnet-{i}", "resnet", "ok", 0.01, 0.001, 0.005, 0.05)
    instances = label_values(registry, "clockwork_instance_requests", "instance")
    assert instances == {f"resnet-{i}" for i in range(10)} | {OTHER}
    assert (
        value(registry, "clockwork_instance_requests_total", instance=OTHER, outcome="ok") == 4990
    )
    assert label_values(registry, "clockwork_request_duration_seconds", "group") == {"resnet"}
    assert series_count(registry) < 200


def test_groups_beyond_their_limit_share_other(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, group_label_limit=2, include_process=False)
    for group in ("a", "b", "c", "d"):
        metrics.observe_reply(group, group, "ok", 0.01)
    assert label_values(registry, "clockwork_requests", "group") == {"a", "b", OTHER}
    assert value(registry, "clockwork_requests_total", group=OTHER, outcome="ok") == 2


def test_bounded_label_never_admits_the_name_other() -> None:
    label = BoundedLabel(2)
    assert [label(v) for v in ("other", "a", "b", "c", "a")] == [OTHER, "a", "b", OTHER, "a"]
    with pytest.raises(ValueError):
        BoundedLabel(-1)


def test_live_gauges_are_read_at_scrape_time(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    state = {"used": 3}

    def snapshot() -> LiveSnapshot:
        gauges = ExecutorGauges("local-0", True, state["used"], 64, 2)
        return LiveSnapshot(
            executors=(gauges,),
            queue_depth=5,
            queue_depth_by_group={"a": 2, "b": 3},
            running_requests=2,
            outstanding_requests=7,
            models_registered=1000,
            client_connections=4,
            cold_starts=state["used"] + 10,
            warm_ups=state["used"] + 2,
        )

    assert value(registry, "clockwork_executor_pages_used", executor="local-0") is None
    metrics.set_snapshot_source(snapshot)
    assert value(registry, "clockwork_executor_pages_used", executor="local-0") == 3
    state["used"] = 9
    assert value(registry, "clockwork_executor_pages_used", executor="local-0") == 9
    assert value(registry, "clockwork_executor_pages_capacity", executor="local-0") == 64
    assert value(registry, "clockwork_executor_up", executor="local-0") == 1
    assert value(registry, "clockwork_group_queue_depth", group="b") == 3
    assert value(registry, "clockwork_queue_depth") == 5
    assert value(registry, "clockwork_running_requests") == 2
    assert value(registry, "clockwork_outstanding_requests") == 7
    assert value(registry, "clockwork_cold_starts_total") == 19  # the core's count, as it is
    assert value(registry, "clockwork_warm_ups_total") == 11
    assert value(registry, "clockwork_models_registered") == 1000
    assert value(registry, "clockwork_client_connections") == 4


def test_a_failing_snapshot_leaves_the_rest_of_the_scrape_intact(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics(registry, include_process=False)
    metrics.observe_reply("m", "g", "ok", 0.01)

    def broken() -> LiveSnapshot:
        raise RuntimeError("driver gone")

    metrics.set_snapshot_source(broken)
    with caplog.at_level(logging.ERROR):
        text = generate_latest(registry).decode()
    assert 'clockwork_requests_total{group="g",outcome="ok"} 1.0' in text
    assert "clockwork_queue_depth " not in text
    assert "snapshot failed" in caplog.text


def test_process_metrics_are_included_by_default(registry: CollectorRegistry) -> None:
    Metrics(registry)
    assert (value(registry, "process_resident_memory_bytes") or 0) > 0


async def test_loop_lag_probe_reports_non_negative_lag() -> None:
    seen: list[float] = []
    probe = asyncio.create_task(probe_loop_lag(seen.append, interval_s=0.001))
    while len(seen) < 3:
        await asyncio.sleep(0.001)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert all(lag >= 0 for lag in seen)


def test_the_io_arena_is_read_at_scrape_time(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, include_process=False)
    assert value(registry, "clockwork_io_arena_used_bytes") is None  # no arena: no samples
    arena = IoArena(1 << 16, owner_share=0.5)
    try:
        metrics.set_arena(arena)
        slot = arena.lease("conn", 100)
        assert isinstance(slot, Slot)
        arena.lease("conn", 1 << 20)  # too large
        assert value(registry, "clockwork_io_arena_used_bytes") == 128
        assert value(registry, "clockwork_io_arena_capacity_bytes") == 1 << 16
        assert value(registry, "clockwork_io_arena_slots") == 1
        assert value(registry, "clockwork_io_arena_refusals_total", cause="too_large") == 1
        slot.release()
        assert value(registry, "clockwork_io_arena_used_bytes") == 0
    finally:
        arena.close()
