"""Azure Functions 2019 invocation traces, and how their functions map onto model instances.

The format (one CSV per day): a header ``HashOwner,HashApp,HashFunction,Trigger,<minute
columns>`` then one row per function with its invocation count in each minute. The minute
columns need not start at 1 (a sample may start at minute 480); ``--minutes`` counts from the
file's first minute column.

Mapping rules (as in the Clockwork paper), with functions sorted by their total invocations over
the whole file, most invoked first (ties keep file order):

- fewer instances than functions (M < F): function ranks are cut into M contiguous ranges of
  near-equal length (range j holds ranks ``[j*F//M, (j+1)*F//M)``); an instance's per-minute
  count is the sum over its range;
- as many (M == F): instance i replays function i;
- more (M > F): instance i replays function ``i mod F``; the copies draw their arrivals
  independently (the workload draws one Poisson process per instance).

Invariants: counts are non-negative integers; only the requested window of minutes is kept in
memory (one ``uint32`` per function and minute).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

HEADER_PREFIX = ("HashOwner", "HashApp", "HashFunction", "Trigger")

CountArray = npt.NDArray[np.uint32]


class TraceFormatError(ValueError):
    """The file is not an Azure Functions invocation trace (header, row width, counts)."""


@dataclass(frozen=True, slots=True)
class AzureTrace:
    """Per-minute invocation counts, functions sorted by total invocations (most first)."""

    path: str
    first_minute: int  # label of the file's first minute column
    minutes_in_file: int
    counts: CountArray  # shape (functions, window minutes), sorted rows
    totals: npt.NDArray[np.int64]  # invocations over the whole file, sorted (descending)
    function_ids: tuple[str, ...]  # "owner/app/function", in sorted order

    @property
    def functions(self) -> int:
        return int(self.counts.shape[0])

    @property
    def minutes(self) -> int:
        return int(self.counts.shape[1])


def read_azure_trace(path: str | Path, minutes: float | None = None) -> AzureTrace:
    """Read a trace, keeping the first ``ceil(minutes)`` minute columns (all when None).

    Raises TraceFormatError on a bad header, a short row or a count that is not a
    non-negative integer; FileNotFoundError if the file is missing.
    """
    with open(path, newline="") as stream:
        rows = csv.reader(stream)
        header = next(rows, None)
        first_minute, minutes_in_file = _check_header(header, path)
        keep = _window(minutes, minutes_in_file)
        ids, totals, kept = _read_rows(rows, path, minutes_in_file, keep)
    if not ids:
        raise TraceFormatError(f"{path}: no function rows")
    order = np.argsort(-np.asarray(totals, dtype=np.int64), kind="stable")
    counts = np.asarray(kept, dtype=np.uint32).reshape(len(ids), keep)[order]
    return AzureTrace(
        path=str(path),
        first_minute=first_minute,
        minutes_in_file=minutes_in_file,
        counts=counts,
        totals=np.asarray(totals, dtype=np.int64)[order],
        function_ids=tuple(ids[i] for i in order.tolist()),
    )


def _check_header(header: list[str] | None, path: str | Path) -> tuple[int, int]:
    """Return (first minute label, number of minute columns)."""
    if header is None or tuple(header[:4]) != HEADER_PREFIX or len(header) < 5:
        raise TraceFormatError(
            f"{path}: header must start with {','.join(HEADER_PREFIX)},<minute columns>"
        )
    try:
        labels = [int(label) for label in header[4:]]
    except ValueError as error:
        raise TraceFormatError(f"{path}: minute columns must be integers ({error})") from None
    if labels != list(range(labels[0], labels[0] + len(labels))):
        raise TraceFormatError(f"{path}: minute columns must be consecutive")
    return labels[0], len(labels)


def _window(minutes: float | None, minutes_in_file: int) -> int:
    if minutes is None:
        return minutes_in_file
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    wanted = int(np.ceil(minutes))
    if wanted > minutes_in_file:
        raise ValueError(f"the trace has {minutes_in_file} minutes, {wanted} were asked for")
    return wanted


def _read_rows(
    rows: Iterator[list[str]], path: str | Path, minutes_in_file: int, keep: int
) -> tuple[list[str], list[int], list[int]]:
    """Return (function ids, totals, kept counts flattened row by row)."""
    ids: list[str] = []
    totals: list[int] = []
    kept: list[int] = []
    for line, row in enumerate(rows, start=2):
        if len(row) != 4 + minutes_in_file:
            raise TraceFormatError(
                f"{path}:{line}: {len(row)} fields, expected {4 + minutes_in_file}"
            )
        counts = _parse_counts(row[4:], path, line)
        ids.append("/".join(row[:3]))
        totals.append(sum(counts))
        kept.extend(counts[:keep])
    return ids, totals, kept


def _parse_counts(fields: list[str], path: str | Path, line: int) -> list[int]:
    try:
        counts = [int(field) for field in fields]
    except ValueError:
        raise TraceFormatError(f"{path}:{line}: counts must be integers") from None
    if min(counts) < 0:
        raise TraceFormatError(f"{path}:{line}: negative count")
    return counts


@dataclass(frozen=True, slots=True)
class TraceMapping:
    """How a trace's functions feed ``instances`` model instances."""

    trace: AzureTrace
    instances: int

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")

    @property
    def mode(self) -> str:
        """``grouped`` (M < F), ``one-to-one`` (M == F) or ``modulo`` (M > F)."""
        functions = self.trace.functions
        if self.instances < functions:
            return "grouped"
        return "one-to-one" if self.instances == functions else "modulo"

    def range_starts(self) -> npt.NDArray[np.int64]:
        """First function rank of each instance's range (grouped mode)."""
        functions, instances = self.trace.functions, self.instances
        return (np.arange(instances, dtype=np.int64) * functions) // instances

    def instance_counts(self, minute: int) -> npt.NDArray[np.int64]:
        """Invocations of each instance in window minute ``minute`` (0-based)."""
        column = self.trace.counts[:, minute].astype(np.int64)
        if self.mode == "grouped":
            return np.add.reduceat(column, self.range_starts())
        return column[np.arange(self.instances) % self.trace.functions]

    def window_total(self) -> int:
        """Invocations the mapped instances replay over the whole kept window (scale 1)."""
        return int(sum(int(self.instance_counts(m).sum()) for m in range(self.trace.minutes)))

    def describe(self) -> dict[str, object]:
        """A JSON-ready statement of the mapping, for summaries."""
        functions, instances = self.trace.functions, self.instances
        described: dict[str, object] = {
            "trace": self.trace.path,
            "functions": functions,
            "instances": instances,
            "mode": self.mode,
            "first_minute_column": self.trace.first_minute,
            "minutes_in_file": self.trace.minutes_in_file,
            "sorted_by": "total invocations over the file, descending",
        }
        if self.mode == "grouped":
            sizes = np.diff(np.append(self.range_starts(), functions))
            described["functions_per_instance"] = [int(sizes.min()), int(sizes.max())]
            described["rule"] = "contiguous ranges of sorted functions, one range per instance"
        else:
            copies = np.bincount(np.arange(instances) % functions, minlength=functions)
            described["copies_per_function"] = [int(copies.min()), int(copies.max())]
            described["rule"] = "instance i replays function i mod F, independent arrivals"
        return described
