"""Helpers shared by the benchmarks.

- `machine_description`: CPU model, cores, kernel, versions and the load average, recorded
  beside every result (these benchmarks run on shared machines; the load says how shared).
- `summarize_ns`: nearest-rank percentiles of a list of durations.
- The real daemon as a subprocess (`DaemonProcess`, `daemon_config`, `add_model`, ...) comes
  from the product's `clockwork_async.testing`, re-exported here.
- `write_report`: one JSON file per benchmark under ``results/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from clockwork_async.testing import (  # noqa: F401 (re-exported for the benchmarks)
    DaemonProcess,
    add_model,
    children,
    clean_environ,
    kill_daemon,
    wait_serving,
    write_config,
)

RESULTS = Path("results")
T = TypeVar("T")


# --- the machine ---------------------------------------------------------------------------------


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo, or what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _version(module: str) -> str:
    try:
        imported = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(imported, "__version__", "unknown"))


def load_average() -> tuple[float, float, float]:
    """1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on, and how busy the machine was when this was called."""
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": _version("numpy"),
        "onnxruntime": _version("onnxruntime"),
        "uvloop": _version("uvloop"),
        "msgpack": ".".join(map(str, __import__("msgpack").version)),
        "load_average": load_average(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --- statistics ----------------------------------------------------------------------------------


def nearest_rank(ordered: Sequence[float], percent: float) -> float:
    """The nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize_ns(values_ns: Iterable[int]) -> dict[str, float]:
    """n, mean, p50, p99, p99.9 and max of durations in ns, reported in µs (empty: n=0)."""
    ordered = sorted(values_ns)
    if not ordered:
        return {"n": 0}
    to_us = 1e-3
    return {
        "n": len(ordered),
        "mean_us": round(sum(ordered) / len(ordered) * to_us, 2),
        "p50_us": round(nearest_rank(ordered, 50) * to_us, 2),
        "p99_us": round(nearest_rank(ordered, 99) * to_us, 2),
        "p999_us": round(nearest_rank(ordered, 99.9) * to_us, 2),
        "max_us": round(ordered[-1] * to_us, 2),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded to 3 digits, None when either is missing or zero."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


# --- output --------------------------------------------------------------------------------------


def write_report(name: str, report: Mapping[str, Any], directory: Path = RESULTS) -> Path:
    """Write ``report`` as ``directory/name.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def keep_log(source: Path, target: Path) -> None:
    """Copy a daemon's log out of its temporary folder (if it wrote one)."""
    if source.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        first = row[0].ljust(widths[0])
        rest = [value.rjust(width) for value, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join([first, *rest]))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def run_uvloop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a uvloop event loop (asyncio's if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio

        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


# --- the daemon as a subprocess ------------------------------------------------------------------


def daemon_config(folder: Path, executors_toml: str = "", extra_sections: str = "") -> Path:
    """`clockwork_async.testing.write_config` under its benchmark name: ``extra_sections``
    are more tables (``[controller]``, ``[executor_link]`` ...)."""
    return write_config(folder, executors_toml, sections_toml=extra_sections)
