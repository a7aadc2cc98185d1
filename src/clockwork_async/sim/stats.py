"""What a simulation counts: outcomes, latencies, actions and per-interval timelines.

Invariants: memory stays bounded whatever the number of requests. Latencies are kept as
histograms (exact to the microsecond overall, to 0.1 ms per timeline interval), never as one
value per request. Percentiles are nearest-rank over those histograms. The counts bumped per
reply and per INFER live in plain dicts, read as Counters (a copy per read): a ``Counter`` is
a ``dict`` subclass, so each of its subscripts goes through a Python-level slot even when
compiled (about 5% of a compiled Azure run). ok replies, most of them, are counted in ints
beside those dicts (their key kept in its place in the dicts with 0), merged on reading.
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

    __slots__ = ("_latency_bins", "_ok", "_outcomes", "batch_rows", "infers", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self._outcomes: dict[str, int] = {}  # ok's entry holds 0: counted in _ok (below)
        self._ok = 0
        self._latency_bins: dict[int, int] = {}  # ok latency, in 0.1 ms bins
        self.infers = 0
        self.batch_rows = 0  # requests carried by the interval's INFERs

    @property
    def outcomes(self) -> Counter[str]:
        return _with_ok(self._outcomes, self._ok)

    @property
    def latency_bins(self) -> Counter[int]:
        """ok latency, in 0.1 ms bins."""
        return Counter(self._latency_bins)


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
        self._outcomes: dict[str, int] = {}  # ok's entry holds 0: counted in _ok (below)
        self._ok = 0
        self._latency_us: dict[int, int] = {}  # ok requests
        self._late_latency_us: dict[int, int] = {}
        self.loads = 0
        self.evictions = 0
        self.infers = 0
        self._batch_sizes: dict[int, int] = {}
        self.action_errors: Counter[str] = Counter()
        self.violations: Counter[str] = Counter()  # broken core promises (bugs)
        self.loaded_changes: list[tuple[int, int]] = [(0, 0)]  # (time_ns, models resident)
        self.timeline = Timeline(interval_ns)
        self.lost = 0
        self.lost_examples: list[int] = []
        self.simulated_ns = 0
        self.wall_s = 0.0
        self.events = 0

    @property
    def outcomes(self) -> Counter[str]:
        return _with_ok(self._outcomes, self._ok)

    @property
    def latency_us(self) -> Counter[int]:
        """ok requests' latencies, in µs."""
        return Counter(self._latency_us)

    @property
    def late_latency_us(self) -> Counter[int]:
        return Counter(self._late_latency_us)

    @property
    def batch_sizes(self) -> Counter[int]:
        """INFERs by batch size."""
        return Counter(self._batch_sizes)

    def on_arrival(self, now_ns: int, cold: bool) -> None:
        self.requests += 1
        self.cold_starts += cold
        self.timeline.at(now_ns).requests += 1

    def on_reply(self, outcome: Outcome, now_ns: int, arrival_ns: int) -> None:
        """Count a reply; ``outcome`` keys the counters by its string value. Most replies are
        ok: those are counted in plain ints, not in the dicts (two dict updates less a reply);
        the first one leaves ok's key in the dicts, so that the counters read in the order the
        outcomes came."""
        interval = self.timeline.at(now_ns)
        latency_us = (now_ns - arrival_ns) // 1000
        if outcome == _OK:
            if not interval._ok:
                interval._outcomes.setdefault(outcome, 0)
                if not self._ok:
                    self._outcomes.setdefault(outcome, 0)
            self._ok += 1
            interval._ok += 1
            _bump(self._latency_us, latency_us)
            _bump(interval._latency_bins, latency_us // US_PER_TIMELINE_BIN)
            return
        _bump(self._outcomes, outcome)
        _bump(interval._outcomes, outcome)
        if outcome == _LATE:
            _bump(self._late_latency_us, latency_us)

    def on_infer(self, end_ns: int, batch_size: int, rows: int) -> None:
        self.infers += 1
        _bump(self._batch_sizes, batch_size)
        interval = self.timeline.at(end_ns)
        interval.infers += 1
        interval.batch_rows += rows

    def on_resident_change(self, now_ns: int, delta: int) -> None:
        self.loaded_changes.append((now_ns, self.loaded_changes[-1][1] + delta))


def _bump(counts: dict[Any, int], key: Any) -> None:
    counts[key] = counts.get(key, 0) + 1


def _with_ok(outcomes: dict[str, int], ok: int) -> Counter[str]:
    """The outcome counts with ok's (kept apart, its key in place) filled in."""
    counts = Counter(outcomes)
    if ok:
        counts[_OK] = ok
    return counts


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


# The columns of the engine's logs (`RecordSink`): one row per reply, one per finished action.
REQUEST_LOG_FIELDS = (
    "request_id",
    "model",
    "arrival_ns",
    "deadline_ns",
    "reply_ns",
    "outcome",
    "latency_ns",
    "executor",
    "action_id",
    "cold",
)
ACTION_LOG_FIELDS = (
    "action_id",
    "executor",
    "type",
    "model",
    "batch_size",
    "requests",
    "issued_ns",
    "earliest_ns",
    "latest_ns",
    "start_ns",
    "end_ns",
    "code",
)


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
