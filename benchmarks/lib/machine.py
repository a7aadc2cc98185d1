"""What the numbers were measured on: recorded beside every result, since these benchmarks
run on shared machines and the load average says how shared.

Invariant: describing the machine never fails a run: a missing library reads
``"not installed"``, an unreadable /proc what `platform` knows.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo, or what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def version_of(module: str) -> str:
    """``module.__version__``, or ``"not installed"``."""
    try:
        imported = __import__(module)
    except ImportError:
        return "not installed"
    version = getattr(imported, "__version__", None) or getattr(imported, "version", "unknown")
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


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
        "numpy": version_of("numpy"),
        "onnxruntime": version_of("onnxruntime"),
        "uvloop": version_of("uvloop"),
        "msgpack": version_of("msgpack"),
        "load_average": load_average(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
