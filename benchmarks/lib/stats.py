"""Statistics of the benchmarks, on the house's one percentile (`core.percentile`, nearest
rank: always one of the values, p100 the maximum).

Invariants: every percentile here is `clockwork_async.core.percentile.percentile` (or, for a
histogram, the same rank counted through its bins); an empty input gives ``None`` values (or
``{"n": 0}``), never an exception, so a run that answered nothing still writes its report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from clockwork_async.core.percentile import nearest_rank_index, percentile, percentile_of

NS_PER_MS = 1_000_000
NS_PER_US = 1_000

__all__ = [
    "action_errors",
    "error_summary",
    "histogram_percentile",
    "outcome_summary",
    "percentile",
    "percentile_of",
    "percentiles",
    "percentiles_ms",
    "ratio",
    "select",
    "summarize_ns",
]


def percentiles(
    values: Iterable[float],
    points: Sequence[float],
    *,
    scale: float = 1.0,
    digits: int = 3,
    suffix: str = "",
    with_max: bool = True,
) -> dict[str, float | None]:
    """``{"p50<suffix>": ..., "max<suffix>": ...}``: nearest-rank percentiles of ``values``
    times ``scale``, rounded to ``digits`` (None when there are no values)."""
    ordered = sorted(values)
    found: dict[str, float | None] = {
        f"p{p:g}{suffix}": round(percentile(ordered, p) * scale, digits) if ordered else None
        for p in points
    }
    if with_max:
        found[f"max{suffix}"] = round(ordered[-1] * scale, digits) if ordered else None
    return found


def percentiles_ms(
    values_ns: Iterable[int], points: Sequence[float] = (50, 99, 99.9)
) -> dict[str, float | None]:
    """Percentiles and the max of durations in ns, in ms (keys ``p50`` ... ``max``)."""
    return percentiles(values_ns, points, scale=1 / NS_PER_MS)


def summarize_ns(values_ns: Iterable[int]) -> dict[str, float]:
    """n, mean, p50, p99, p99.9 and max of durations in ns, reported in µs (empty: n=0)."""
    ordered = sorted(values_ns)
    if not ordered:
        return {"n": 0}
    to_us = 1 / NS_PER_US
    found: dict[str, float] = {
        "n": len(ordered),
        "mean_us": round(sum(ordered) / len(ordered) * to_us, 2),
    }
    for label, percent in (("p50_us", 50), ("p99_us", 99), ("p999_us", 99.9)):
        found[label] = round(percentile(ordered, percent) * to_us, 2)
    found["max_us"] = round(ordered[-1] * to_us, 2)
    return found


def histogram_percentile(histogram: Mapping[int, int], percent: float) -> int | None:
    """The nearest-rank percentile of values counted in ``histogram`` (value -> count); None
    when it counts nothing."""
    count = sum(histogram.values())
    if not count:
        return None
    index, seen = nearest_rank_index(count, percent), 0
    for value, n in sorted(histogram.items()):
        seen += n
        if seen > index:
            return value
    raise AssertionError("unreachable: the rank is below the count")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded to 3 digits, None when either is missing or zero."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


# --- per-request rows (`clockwork_async.bench --rows`) ----------------------------------------


def select(rows: Mapping[str, list[Any]], keep: Iterable[bool]) -> dict[str, list[Any]]:
    """The rows where ``keep`` is true, column-wise."""
    mask = list(keep)
    return {
        name: [v for v, k in zip(values, mask, strict=True) if k] for name, values in rows.items()
    }


def outcome_summary(rows: Mapping[str, list[Any]], duration_s: float) -> dict[str, Any]:
    """Counts by status, ok share, goodput and ok latency of some rows."""
    statuses = Counter(rows["status"])
    sent = len(rows["status"])
    ok = statuses.get("ok", 0)
    ok_latency = [
        lat for lat, s in zip(rows["latency_ns"], rows["status"], strict=True) if s == "ok"
    ]
    return {
        "sent": sent,
        "statuses": dict(sorted(statuses.items())),
        "ok": ok,
        "ok_share": round(ok / sent, 5) if sent else None,
        "goodput_rps": round(ok / duration_s, 2) if duration_s > 0 else None,
        "late": statuses.get("late", 0),
        "ok_latency_ms": percentiles_ms(ok_latency),
        "send_lag_ms": percentiles_ms(rows["lag_ns"], (50, 99)),
    }


def action_errors(rows: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    """One entry per executed action seen in ``ok``/``late`` replies: the requests of one
    batch share (executor, batch size, measured and predicted execute ns), which tells them
    apart from other actions (two actions measured to the nanosecond alike would merge)."""
    seen: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    for model, status, batch, executor, execute_ns, predicted_ns in zip(
        rows["model"],
        rows["status"],
        rows["batch_size"],
        rows["executor"],
        rows["execute_ns"],
        rows["predicted_ns"],
        strict=True,
    ):
        if status not in ("ok", "late") or not execute_ns or not predicted_ns:
            continue
        key = (executor, batch, execute_ns, predicted_ns)
        if key not in seen:
            seen[key] = {
                "model": model,
                "batch_size": batch,
                "execute_ns": execute_ns,
                "predicted_ns": predicted_ns,
                "error_ns": predicted_ns - execute_ns,
            }
    return list(seen.values())


def error_summary(errors: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Prediction error (predicted - actual) of actions: |error| p50/p99/max in ms, the share
    under-predicted (actual slower than predicted) and the median actual execute time."""
    if not errors:
        return {"actions": 0}
    absolute = sorted(abs(e["error_ns"]) for e in errors)
    under = sum(e["error_ns"] < 0 for e in errors)
    return {
        "actions": len(errors),
        "abs_error_ms": percentiles_ms(absolute, (50, 99)),
        "under_predicted": under,
        "under_share": round(under / len(errors), 4),
        "worst_under_ms": round(-min(e["error_ns"] for e in errors) / NS_PER_MS, 3),
        "execute_p50_ms": percentiles_ms((e["execute_ns"] for e in errors), (50,))["p50"],
    }
