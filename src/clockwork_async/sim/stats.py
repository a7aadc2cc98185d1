"""What a simulation counts: outcomes, latencies, actions and per-interval timelines.

Invariants: memory stays bounded whatever the number of requests. Latencies are kept as
histograms (exact to the microsecond overall, to 0.1 ms per timeline interval), never as one
value per request. Percentiles are nearest-rank over those histograms.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from clockwork_async.build import mypyc_attr
from clockwork_async.core.outcomes import Outcome
from clockwork_async.core.percentile import nearest_rank_index

US_PER_TIMELINE_BIN = 100  # timeline latency resolution: 0.1 ms
PERCENTILES = (50.0, 99.0, 99.9, 99.99)
_OK, _LATE = Outcome.OK, Outcome.LATE  # enum attribute lookups are slow in hot paths


class Interval:
    """Counts of one timeline interval (replies counted when they are sent)."""

    __slots__ = ("batch_rows", "infers", "latency_bins", "outcomes", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.outcomes: Counter[str] = Counter()
        self.latency_bins: Counter[int] = Counter()  # ok latency, in 0.1 ms bins
        self.infers = 0
        self.batch_rows = 0  # requests carried by the interval's INFERs


class Timeline:
    """Per-interval counts, grown on demand."""

    def __init__(self, interval_ns: int) -> None:
        if interval_ns <= 0:
            raise ValueError(f"interval must be positive, got {interval_ns} ns")
        self.interval_ns = interval_ns
        self.intervals: list[Interval] = []

    def at(self, time_ns: int) -> Interval:
        """The interval holding ``time_ns`` (created, with any before it, if new)."""
        index = time_ns // self.interval_ns
        while len(self.intervals) <= index:
            self.intervals.append(Interval())
        return self.intervals[index]


@mypyc_attr(allow_interpreted_subclasses=True)  # benchmarks.lib.sim.TimelineStats
class SimStats:
    """Everything one run counted. Filled by the engine, read by `report`."""

    def __init__(self, interval_ns: int) -> None:
        self.requests = 0
        self.cold_starts = 0
        self.outcomes: Counter[str] = Counter()
        self.latency_us: Counter[int] = Counter()  # ok requests
        self.late_latency_us: Counter[int] = Counter()
        self.loads = 0
        self.evictions = 0
        self.infers = 0
        self.batch_sizes: Counter[int] = Counter()
        self.action_errors: Counter[str] = Counter()
        self.violations: Counter[str] = Counter()  # broken core promises (bugs)
        self.loaded_changes: list[tuple[int, int]] = [(0, 0)]  # (time_ns, models resident)
        self.timeline = Timeline(interval_ns)
        self.lost = 0
        self.lost_examples: list[int] = []
        self.simulated_ns = 0
        self.wall_s = 0.0
        self.events = 0

    def on_arrival(self, now_ns: int, cold: bool) -> None:
        self.requests += 1
        self.cold_starts += cold
        self.timeline.at(now_ns).requests += 1

    def on_reply(self, outcome: Outcome, now_ns: int, arrival_ns: int) -> None:
        """Count a reply; ``outcome`` keys the counters by its string value."""
        self.outcomes[outcome] += 1
        interval = self.timeline.at(now_ns)
        interval.outcomes[outcome] += 1
        latency_us = (now_ns - arrival_ns) // 1000
        if outcome == _OK:
            self.latency_us[latency_us] += 1
            interval.latency_bins[latency_us // US_PER_TIMELINE_BIN] += 1
        elif outcome == _LATE:
            self.late_latency_us[latency_us] += 1

    def on_infer(self, end_ns: int, batch_size: int, rows: int) -> None:
        self.infers += 1
        self.batch_sizes[batch_size] += 1
        interval = self.timeline.at(end_ns)
        interval.infers += 1
        interval.batch_rows += rows

    def on_resident_change(self, now_ns: int, delta: int) -> None:
        self.loaded_changes.append((now_ns, self.loaded_changes[-1][1] + delta))


def percentile(histogram: Mapping[int, int], percent: float) -> int | None:
    """The house's nearest-rank percentile (`core.percentile`) of a value -> count histogram,
    None when it is empty: the same value `percentile_of` gives for the samples the histogram
    counts, found by walking the counts instead of sorting every sample. Raises ValueError for
    ``percent`` outside [0, 100]."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = nearest_rank_index(total, percent) + 1  # 1-based
    seen = 0
    for value in sorted(histogram):
        seen += histogram[value]
        if seen >= rank:
            return value
    return max(histogram)  # unreachable: ranks never exceed the total


def latency_summary_ms(histogram_us: Mapping[int, int]) -> dict[str, float | None]:
    """p50/p99/p99.9/p99.99/max and mean of a microsecond histogram, in milliseconds."""
    summary: dict[str, float | None] = {}
    for percent in PERCENTILES:
        value = percentile(histogram_us, percent)
        summary[f"p{percent:g}"] = None if value is None else value / 1000.0
    total = sum(histogram_us.values())
    summary["max"] = max(histogram_us) / 1000.0 if total else None
    mean_us = sum(v * n for v, n in histogram_us.items()) / total if total else None
    summary["mean"] = None if mean_us is None else round(mean_us / 1000.0, 3)
    return summary


class RecordSink(Protocol):
    """Where the engine writes a log: a `RecordWriter`, or any object with these two methods
    (benchmarks.guard collects rows in memory). A Protocol, so that the compiled engine (mypyc
    checks class types at run time) accepts both."""

    def write(self, *values: Any) -> None: ...

    def close(self) -> None: ...


class RecordWriter:
    """Writes one record per line: CSV when the path ends in ``.csv``, else JSON lines."""

    def __init__(self, path: str | Path, fields: Sequence[str]) -> None:
        self._stream: IO[str] = open(path, "w", newline="")  # noqa: SIM115 (closed in close)
        self._fields = tuple(fields)
        self._csv = csv.writer(self._stream) if str(path).endswith(".csv") else None
        if self._csv is not None:
            self._csv.writerow(self._fields)

    def write(self, *values: Any) -> None:
        """One record, values in the order of ``fields``."""
        if self._csv is not None:
            self._csv.writerow(values)
        else:
            self._stream.write(json.dumps(dict(zip(self._fields, values, strict=True))) + "\n")

    def close(self) -> None:
        self._stream.close()
