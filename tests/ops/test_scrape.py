"""Every metric name, label and label value that the dashboard's queries and the rules use
exists in a real scrape: the daemon runs with a simulated executor, serves ok requests, refuses
some (infeasible, overloaded), loads and evicts models, and is scraped once."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clockwork_async.client import Client
from clockwork_async.core.outcomes import Outcome
from clockwork_async.testing import DaemonProcess, write_config
from e2e.harness import add_tiny, sim_executor

from .kit import (
    Query,
    dashboard,
    dashboard_queries,
    recording_rules,
    rule_queries,
    rules,
    variable_queries,
)
from .promql import TARGET_LABELS, is_recording_rule_name, level_labels, uses

pytestmark = pytest.mark.slow

# Series Prometheus makes itself for each target, beside those it scrapes.
SYNTHETIC = {"up": frozenset(TARGET_LABELS)}
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SLO_MS = 2_000.0
# Room for one tiny-sim (3 pages of 4): the two instances of `tiny` evict each other. At most two
# queued requests per model, so a burst is refused `overloaded`; 10x slower executes queue it.
CONTROLLER = "[controller]\nmax_queued_per_model = 2\n"


@dataclass
class ScrapeIndex:
    """Sample names -> label names -> values seen, from one scrape."""

    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)

    @classmethod
    def of(cls, text: str) -> ScrapeIndex:
        index = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                names = index.labels.setdefault(sample.name, defaultdict(set))
                for label, value in sample.labels.items():
                    names[label].add(value)
        return index


def labels_of(metric: str, index: ScrapeIndex) -> set[str]:
    """The labels a series of ``metric`` carries once Prometheus stored it."""
    if is_recording_rule_name(metric):
        return set(level_labels(metric))
    if metric in SYNTHETIC:
        return set(SYNTHETIC[metric])
    return set(index.labels.get(metric, {})) | TARGET_LABELS


def problems(query: Query, index: ScrapeIndex, recorded: Iterable[str]) -> Iterator[str]:
    """What in ``query`` the scrape (or the rules file, for recorded names) does not have."""
    found = uses(query.expr)
    available: set[str] = set()
    for selector in found.selectors:
        metric = selector.metric
        if is_recording_rule_name(metric):
            if metric not in recorded:
                yield f"{query.where}: no recording rule {metric}"
        elif metric not in SYNTHETIC and metric not in index.labels:
            yield f"{query.where}: {metric} is not in the scrape"
            continue
        labels = labels_of(metric, index)
        available |= labels
        for matcher in selector.matchers:
            if matcher.label not in labels:
                yield f"{query.where}: {metric} has no label {matcher.label}"
            elif matcher.label not in TARGET_LABELS and not is_recording_rule_name(metric):
                seen = index.labels.get(metric, {}).get(matcher.label, set())
                for value in matcher.literal_values or ():
                    if value not in seen:
                        yield f"{query.where}: {metric}{{{matcher.label}}} never is {value!r}"
    for label in found.grouping_labels | set(LEGEND_LABEL.findall(query.legend)):
        if label not in available:
            yield f"{query.where}: label {label} is on none of its series"


def row(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, dtype=np.float32)}


def drive_traffic(client: Client) -> None:
    """ok on both instances (each LOAD evicts the other), refusals, a burst over the cap."""
    for turn in range(4):
        assert client.infer(f"tiny-{turn % 2}", row(turn), slo_ms=SLO_MS).ok
    assert client.infer("tiny-0", row(0), slo_ms=0.05).status == Outcome.INFEASIBLE
    burst = [client.submit("tiny-0", row(i), slo_ms=SLO_MS) for i in range(40)]
    statuses = {future.result(30).status for future in burst}
    assert Outcome.OVERLOADED in statuses and Outcome.OK in statuses
    assert client.infer("no-such-model", row(0)).status == Outcome.UNKNOWN_MODEL


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> ScrapeIndex:
    folder = tmp_path_factory.mktemp("scraped")
    add_tiny(folder / "models", toml="copies = 2\n")
    executor = sim_executor(slowdown=10.0, weights_bytes=4 << 20)
    config = write_config(folder, executor, sections_toml=CONTROLLER)
    with DaemonProcess.start(folder, config) as daemon:
        with Client(daemon.api, timeout_s=30.0) as client:
            drive_traffic(client)
        status, text = daemon.http_get("/metrics")
    assert status == 200
    return ScrapeIndex.of(text)


def test_the_traffic_reached_every_kind_of_series(scrape: ScrapeIndex) -> None:
    reasons = scrape.labels["clockwork_drops_total"]["reason"]
    assert {"infeasible", "overloaded"} <= reasons
    assert "clockwork_evictions_total" in scrape.labels
    assert scrape.labels["clockwork_executor_busy_seconds_total"]["kind"] == {"infer", "load"}
    assert "clockwork_executor_restarts_total" in scrape.labels  # at 0, never restarted


def test_dashboard_queries_use_only_what_a_scrape_has(scrape: ScrapeIndex) -> None:
    recorded = recording_rules(rules())
    found = [p for q in dashboard_queries(dashboard()) for p in problems(q, scrape, recorded)]
    assert found == []


def test_the_group_variable_reads_a_label_the_scrape_has(scrape: ScrapeIndex) -> None:
    for selector, label in variable_queries(dashboard()):
        (series,) = uses(selector).selectors
        assert scrape.labels[series.metric][label] == {"tiny", "other"}


def test_rules_use_only_what_a_scrape_has(scrape: ScrapeIndex) -> None:
    loaded = rules()
    recorded = recording_rules(loaded)
    found = [p for q in rule_queries(loaded) for p in problems(q, scrape, recorded)]
    assert found == []
    for name, expr in recorded.items():  # each rule's level names labels its inputs have
        inputs = uses(expr)
        kept = inputs.grouping_labels | {
            label for s in inputs.selectors for label in labels_of(s.metric, scrape)
        }
        assert level_labels(name) <= kept, name


@pytest.mark.parametrize(
    ("expr", "legend", "wanted"),
    [
        ("rate(clockwork_request_total[5m])", "", "is not in the scrape"),
        ('clockwork_requests_total{outcome="okay"}', "", "never is 'okay'"),
        ('clockwork_requests_total{outcome=~"ok|drop"}', "", "never is 'drop'"),
        ('clockwork_executor_up{group="x"}', "", "has no label group"),
        ("sum by (reason) (clockwork_requests_total)", "", "label reason"),
        ("sum(clockwork_requests_total)", "{{model}}", "label model"),
        ("job:clockwork_nothing:rate5m", "", "no recording rule"),
    ],
)
def test_the_check_finds_what_is_wrong(
    scrape: ScrapeIndex, expr: str, legend: str, wanted: str
) -> None:
    (problem,) = problems(Query("test", expr, legend), scrape, recording_rules(rules()))
    assert wanted in problem


def test_a_whole_scrape_is_found_by_name(scrape: ScrapeIndex) -> None:
    # Histograms are indexed by sample name, as PromQL sees them.
    for suffix in ("_bucket", "_sum", "_count"):
        assert f"clockwork_request_duration_seconds{suffix}" in scrape.labels
    assert "le" in scrape.labels["clockwork_request_duration_seconds_bucket"]
