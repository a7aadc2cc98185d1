"""End-to-end test helpers around `clockwork_async.testing` (the real daemon as a
subprocess): executor tables, configs with debug logs, the demo ``tiny`` model, and Prometheus
text parsing. Everything a test starts lives under its own folder; stop the daemon in a finally
or a fixture teardown (executors die with it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from clockwork_async import testing
from clockwork_async.models.demo import build_tiny
from clockwork_async.testing import (  # noqa: F401 (re-exported for the tests)
    DaemonProcess,
    children,
    clean_environ,
)

START_TIMEOUT_S = 60.0

SIM_EXECUTOR = """
[[executors]]
backend = "simulated"
page_bytes = 1048576
weights_bytes = {weights_bytes}
slowdown = {slowdown}
"""
ORT_EXECUTOR = """
[[executors]]
backend = "onnxruntime"
page_bytes = 1048576
weights_bytes = 33554432
cpus = [{cpu}]
"""


def sim_executor(slowdown: float = 1.0, weights_bytes: int = 16 << 20) -> str:
    """A simulated executor (counted pages only: its arena costs no memory)."""
    return SIM_EXECUTOR.format(slowdown=slowdown, weights_bytes=weights_bytes)


def ort_executor() -> str:
    return ORT_EXECUTOR.format(cpu=max(os.sched_getaffinity(0)))


def write_config(
    folder: Path,
    executors: str,
    *,
    drain_timeout_s: float = 5.0,
    extra: str = "",
    sections: str = "",
) -> Path:
    """A config serving on free loopback ports, everything under ``folder``, debug logs;
    ``extra``: more keys of ``[repository]``; ``sections``: more tables."""
    return testing.write_config(
        folder,
        executors,
        repository_toml=extra,
        sections_toml=sections,
        drain_timeout_s=drain_timeout_s,
        log_level="debug",
    )


def add_tiny(repository: Path, name: str = "tiny", *, seed: int = 0, toml: str = "") -> Path:
    """Put the demo ``tiny`` model (weights seeded by ``seed``) into a repository folder."""
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(build_tiny(seed).SerializeToString())
    if toml:
        (folder / "model.toml").write_text(toml, encoding="utf-8")
    return folder


def run_serve(
    folder: Path, args: Sequence[str], timeout_s: float = START_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``clockwork-async serve ARGS`` to its end (for starts that must fail)."""
    argv = [sys.executable, "-m", "clockwork_async", "serve", *args]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=clean_environ(folder),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus text format, or None if absent."""
    wanted = labels or {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if all(found.get(k) == v for k, v in wanted.items()):
            return float(value)
    return None
