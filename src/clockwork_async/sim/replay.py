"""Replay of a per-request log (``--workload replay --requests FILE.csv``, bench ``--replay``).

The format: a CSV with a header naming the columns ``timestamp_s`` or ``timestamp_ms`` (one of
them; any origin, any order of rows), ``model`` and optionally ``slo_ms`` (an empty cell: the
run's SLO); other columns are ignored. A request is sent at ``(t - t_first) * time_scale``:
``--time-scale 0.5`` replays twice as fast, 2 half as fast.

Mapping models onto instances (targets: the simulator's ``m0`` .. ``m{N-1}``, or bench's
``--models`` / ``--copies``): when every model name of the log is a target's name, each goes to
that target; otherwise the log's distinct names, sorted, are numbered 0..F-1 and name k goes to
target ``k mod N`` (so with N >= F each name has its own instance, with N < F several share
one). `describe` lists the mapping.

Invariants: rows are kept sorted by replay time (ties keep file order); arrivals come in pieces
of at most a second of replay time; a replay draws nothing (the seed does not change it).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .workloads import NS_PER_S, PIECE_NS, Arrivals

TIME_COLUMNS = {"timestamp_s": 1e9, "timestamp_ms": 1e6}  # column -> ns per unit


class RequestLogError(ValueError):
    """The file is not a per-request log: header, timestamps, SLOs."""


@dataclass(frozen=True, slots=True)
class RequestLog:
    """A log's requests in replay order: offsets from the first (ns, before any time scale),
    model name index, and SLO in ms (NaN: the run's)."""

    path: str
    offsets_ns: npt.NDArray[np.int64]
    model_index: npt.NDArray[np.int64]  # into ``names``
    names: tuple[str, ...]  # distinct, sorted
    slos_ms: npt.NDArray[np.float64] | None  # None: the file has no slo_ms column

    def __len__(self) -> int:
        return len(self.offsets_ns)


def read_request_log(path: str | Path) -> RequestLog:
    """Read a per-request CSV. Raises RequestLogError (bad header or values), OSError."""
    with open(path, newline="") as stream:
        reader = csv.DictReader(stream)
        fields = reader.fieldnames or []
        time_columns = [c for c in TIME_COLUMNS if c in fields]
        if len(time_columns) != 1 or "model" not in fields:
            raise RequestLogError(
                f"{path}: the header needs model and one of timestamp_s, timestamp_ms"
            )
        column = time_columns[0]
        times, models, slos = [], [], []
        for line, row in enumerate(reader, start=2):
            times.append(_number(row[column], path, line, column))
            models.append(row["model"] or "")
            if "slo_ms" in fields:
                slos.append(_slo(row["slo_ms"], path, line))
    if not times:
        raise RequestLogError(f"{path}: no requests")
    return _as_log(str(path), times, TIME_COLUMNS[column], models, slos if slos else None)


def _number(text: str | None, path: object, line: int, column: str) -> float:
    try:
        value = float(text or "")
    except ValueError:
        raise RequestLogError(f"{path}:{line}: {column} {text!r} is not a number") from None
    if not np.isfinite(value):
        raise RequestLogError(f"{path}:{line}: {column} {text!r} is not finite")
    return value


def _slo(text: str | None, path: object, line: int) -> float:
    if not text:
        return float("nan")
    value = _number(text, path, line, "slo_ms")
    if value <= 0:
        raise RequestLogError(f"{path}:{line}: slo_ms must be > 0, got {text}")
    return value


def _as_log(
    path: str, times: list[float], ns_per_unit: float, models: list[str], slos: list[float] | None
) -> RequestLog:
    stamps = np.asarray(times, dtype=np.float64)
    order = np.argsort(stamps, kind="stable")
    offsets_ns = np.round((stamps[order] - stamps[order[0]]) * ns_per_unit).astype(np.int64)
    names = tuple(sorted(set(models)))
    index_of = {name: i for i, name in enumerate(names)}
    model_index = np.asarray([index_of[models[i]] for i in order.tolist()], dtype=np.int64)
    slos_ms = None if slos is None else np.asarray(slos, dtype=np.float64)[order]
    return RequestLog(path, offsets_ns, model_index, names, slos_ms)


def map_models(names: Sequence[str], targets: Sequence[str]) -> list[int]:
    """Target index of each of the log's ``names`` (the module header's rule)."""
    position = {target: i for i, target in enumerate(targets)}
    if all(name in position for name in names):
        return [position[name] for name in names]
    return [k % len(targets) for k in range(len(names))]


@dataclass(frozen=True)
class Replay:
    """A `RequestLog` as an open-loop workload onto ``targets``."""

    log: RequestLog
    targets: tuple[str, ...]
    duration_ns: int
    time_scale: float
    default_slo_ms: float

    @property
    def instances(self) -> int:
        return len(self.targets)

    @property
    def times_ns(self) -> npt.NDArray[np.int64]:
        """Replay times of the requests inside the run (before ``duration_ns``)."""
        scaled = np.round(self.log.offsets_ns * self.time_scale).astype(np.int64)
        return scaled[scaled < self.duration_ns]

    @property
    def request_slos_ns(self) -> list[int] | None:
        """Each replayed request's SLO (ns), in arrival order; None without an slo_ms column."""
        if self.log.slos_ms is None:
            return None
        slos = self.log.slos_ms[: len(self.times_ns)]
        filled = np.where(np.isnan(slos), self.default_slo_ms, slos)
        slos_ns: list[int] = np.round(filled * 1e6).astype(np.int64).tolist()
        return slos_ns

    def open_arrivals(self, rng: np.random.Generator) -> Iterator[Arrivals]:
        times = self.times_ns
        instance_of = np.asarray(map_models(self.log.names, self.targets), dtype=np.int64)
        instances = instance_of[self.log.model_index[: len(times)]]
        piece_ends = np.searchsorted(times, np.arange(PIECE_NS, self.duration_ns, PIECE_NS))
        starts = [0, *piece_ends.tolist()]
        ends = [*piece_ends.tolist(), len(times)]
        for begin, end in zip(starts, ends, strict=True):
            if end > begin:
                yield times[begin:end].tolist(), instances[begin:end].tolist()

    def after_reply(self, instance: int, now_ns: int, ok: bool) -> int | None:
        return None

    def describe(self) -> dict[str, object]:
        mapping = map_models(self.log.names, self.targets)
        return {
            "workload": "replay",
            "instances": self.instances,
            "requests_file": self.log.path,
            "requests_in_file": len(self.log),
            "time_scale": self.time_scale,
            "model_mapping": {
                name: self.targets[i] for name, i in zip(self.log.names, mapping, strict=True)
            },
        }


def replay(
    log: RequestLog,
    targets: Sequence[str],
    *,
    time_scale: float = 1.0,
    duration_s: float | None = None,
    default_slo_ms: float = 100.0,
) -> Replay:
    """The log replayed onto ``targets``; by default for its whole span (last request + 1 ns).
    Raises ValueError on no targets or a time scale <= 0."""
    if not targets:
        raise ValueError("replay needs at least one target instance")
    if time_scale <= 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    span_ns = round(int(log.offsets_ns[-1]) * time_scale) + 1
    duration_ns = span_ns if duration_s is None else round(duration_s * NS_PER_S)
    if duration_ns <= 0:
        raise ValueError("replay duration must be > 0")
    return Replay(log, tuple(targets), duration_ns, time_scale, default_slo_ms)
