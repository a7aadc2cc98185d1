"""Helpers shared by the daemon benchmarks (`overhead`, `cpu_serving`).

- `machine_description`: CPU model, cores, kernel, versions and the load average, recorded
  beside every result (these benchmarks run on shared machines; the load says how shared).
- `summarize_ns`: nearest-rank percentiles of a list of durations.
- `DaemonProcess`: the real daemon (``clockwork-async serve``) as a subprocess on a temporary
  config. Invariant: everything it writes (config, model repository, profile cache, XDG
  state/cache homes, its log) lives under the folder it is given, its ports are picked by the
  daemon (port 0) and read back from its ``serving`` line, and `stop` (SIGTERM, then SIGKILL of
  the daemon and its executors) runs however the benchmark ends (use it as a context manager).
- `write_report`: one JSON file per benchmark under ``results/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

RESULTS = Path("results")
SERVING = re.compile(r"^clockwork-async serving: api=(\S+) metrics=(\S+)")
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
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
    """Write a daemon config serving on free loopback ports with its repository and profile
    cache under ``folder``; returns its path. ``executors_toml``: ``[[executors]]`` tables
    (empty: the daemon's default, one pinned ONNX Runtime executor per spare CPU)."""
    text = f"""
[server]
listen = "127.0.0.1:0"
drain_timeout_s = 5.0
log_level = "info"
[metrics]
listen = "127.0.0.1:0"
[repository]
path = "{folder / "models"}"
profile_cache_dir = "{folder / "profiles"}"
{extra_sections}
{executors_toml}
"""
    path = folder / "clockwork-async.toml"
    path.write_text(text, encoding="utf-8")
    return path


def add_model(repository: Path, name: str, onnx_bytes: bytes, model_toml: str = "") -> Path:
    """Put one model folder (``model.onnx`` and an optional ``model.toml``) in a repository."""
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(onnx_bytes)
    if model_toml:
        (folder / "model.toml").write_text(model_toml, encoding="utf-8")
    return folder


def clean_environ(folder: Path) -> dict[str, str]:
    """This environment minus the daemon's own and systemd's variables, XDG homes in
    ``folder``."""
    drop = ("CLOCKWORK_ASYNC_", "NOTIFY_SOCKET", "WATCHDOG_", "STATE_DIRECTORY")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["XDG_STATE_HOME"] = str(folder / "state")
    env["XDG_CACHE_HOME"] = str(folder / "cache")
    return env


class DaemonProcess:
    """``clockwork-async serve --config CONFIG`` running under ``folder``."""

    def __init__(self, process: subprocess.Popen[bytes], api: str, metrics: str, log: Path):
        self.process = process
        self.api = api
        self.metrics_url = metrics
        self.log_path = log

    @classmethod
    def start(cls, folder: Path, config: Path, timeout_s: float = START_TIMEOUT_S) -> DaemonProcess:
        """Start the daemon; returns once it prints its ``serving`` line. Raises RuntimeError
        (with the end of its log) if it exits first or takes longer than ``timeout_s``."""
        log_path = folder / "daemon.log"
        argv = [sys.executable, "-m", "clockwork_async", "serve", "--config", str(config)]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=clean_environ(folder),
            )
        try:
            api, metrics = wait_serving(process, timeout_s)
        except (RuntimeError, TimeoutError) as error:
            kill_daemon(process)
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the daemon did not start ({error}):\n{tail}") from None
        return cls(process, api, metrics, log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def thread_ids(self) -> list[int]:
        """The daemon's own threads (not its executors, which are other processes)."""
        return [int(tid) for tid in os.listdir(f"/proc/{self.pid}/task")]

    def affinities(self) -> dict[int, set[int]]:
        """The CPUs each of the daemon's threads may run on, by thread id."""
        found = {}
        for tid in self.thread_ids():
            with contextlib.suppress(ProcessLookupError):
                found[tid] = os.sched_getaffinity(tid)
        return found

    def controller_cpus(self) -> list[int]:
        """The CPUs the daemon's main thread (its event loop: the controller) may run on."""
        return sorted(os.sched_getaffinity(self.pid))

    def pin(self, cpus: set[int]) -> None:
        """Set every thread of the daemon to run on ``cpus`` (its executors are untouched)."""
        self.restore(dict.fromkeys(self.thread_ids(), cpus))

    def restore(self, affinities: Mapping[int, set[int]]) -> None:
        """Put back what `affinities` returned (threads gone since are skipped)."""
        for tid, cpus in affinities.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL, executors too, after STOP_TIMEOUT_S); returns the
        exit status."""
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    kill_daemon(self.process)
            return self.process.wait()
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        status = self.stop()
        if status != 0 and kind is None:
            print(f"warning: the daemon exited with {status}; log: {self.log_path}")


def wait_serving(process: subprocess.Popen[bytes], timeout_s: float) -> tuple[str, str]:
    """Read the daemon's stdout until its serving line; return (api address, metrics URL).
    Raises RuntimeError if it exited, TimeoutError if it did not serve in time."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([process.stdout], [], [], left_s)
        if not readable:
            break
        line = process.stdout.readline().decode(errors="replace")
        if not line:
            raise RuntimeError(f"the daemon exited with status {process.wait()}")
        match = SERVING.match(line)
        if match:
            return match.group(1), match.group(2)
    raise TimeoutError(f"no serving line within {timeout_s:g} s")


def children(pid: int, *, zombies: bool = False) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc): live ones, and with ``zombies`` also
    those that exited and were not waited for yet."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, parent = stat.rpartition(")")[2].split()[:2]
            if int(parent) == pid and (zombies or state != "Z"):
                found.append(int(entry.name))
    return found


def kill_daemon(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the daemon and its executors (they run in sessions of their own)."""
    if process.poll() is None:
        orphans = children(process.pid)
        process.kill()
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    process.wait()
    if process.stdout is not None:
        process.stdout.close()
