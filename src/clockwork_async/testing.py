"""The real daemon as a subprocess, for end-to-end tests, benchmarks and users' own tests.

    with DaemonProcess.start(folder, write_config(folder, SIM_EXECUTOR)) as daemon:
        with Client(daemon.api) as client: ...

Invariants: nothing is written outside the folder given (the config, the model repository,
the profile cache, XDG state/cache homes and the daemon's log all live there); ports are
picked by the daemon (port 0) and read back from the line it prints once serving; `stop`
(SIGTERM, then SIGKILL of the daemon and its executors) runs however the caller ends when the
process is used as a context manager.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from clockwork_async.build import PURE_VARIABLE

SERVING = re.compile(
    r"^clockwork-async serving: api=(\S+) metrics=(\S+)(?: http=(\S+))?(?: grpc=(\S+))?"
)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_OWN_VARIABLES = ("CLOCKWORK_ASYNC_", "NOTIFY_SOCKET", "WATCHDOG_", "STATE_DIRECTORY")
# Kept, though ours: which build runs (a side-by-side run's pure daemon must run pure).
_KEPT_VARIABLES = frozenset({PURE_VARIABLE})

SIM_EXECUTOR = """
[[executors]]
backend = "simulated"
page_bytes = 1048576
weights_bytes = 16777216
"""
"""One simulated executor (counted pages only: its arena costs no memory)."""


def write_config(
    folder: Path,
    executors_toml: str = "",
    *,
    repository_toml: str = "",
    sections_toml: str = "",
    drain_timeout_s: float = 5.0,
    log_level: str = "info",
) -> Path:
    """Write ``folder/clockwork-async.toml``: serving on free loopback ports, its repository
    (``folder/models``) and profile cache under ``folder``; returns its path.

    ``executors_toml``: ``[[executors]]`` tables (empty: the daemon's default, one pinned ONNX
    Runtime executor per spare CPU); ``repository_toml``: more keys of ``[repository]``;
    ``sections_toml``: more tables (``[controller]`` ...), placed before the executors."""
    text = f"""
[server]
listen = "127.0.0.1:0"
drain_timeout_s = {drain_timeout_s}
log_level = "{log_level}"
[metrics]
listen = "127.0.0.1:0"
[http]
listen = "127.0.0.1:0"
[grpc]
listen = "127.0.0.1:0"
[repository]
path = "{folder / "models"}"
profile_cache_dir = "{folder / "profiles"}"
{repository_toml}
{sections_toml}
{executors_toml}
"""
    path = folder / "clockwork-async.toml"
    path.write_text(text, encoding="utf-8")
    return path


def add_model(repository: Path, name: str, onnx_bytes: bytes, model_toml: str = "") -> Path:
    """Put one model folder (``model.onnx`` and an optional ``model.toml``) in a repository;
    returns the folder."""
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(onnx_bytes)
    if model_toml:
        (folder / "model.toml").write_text(model_toml, encoding="utf-8")
    return folder


def clean_environ(folder: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment minus the daemon's own and systemd's variables, with XDG homes in
    ``folder``, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k in _KEPT_VARIABLES or not k.startswith(_OWN_VARIABLES)
    }
    env["XDG_STATE_HOME"] = str(folder / "state")
    env["XDG_CACHE_HOME"] = str(folder / "cache")
    env.update(extra or {})
    return env


class DaemonProcess:
    """``clockwork-async serve`` running under ``folder``."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        api: str,
        metrics_url: str,
        log_path: Path,
        log_offset: int = 0,
        front_ends: Mapping[str, str] | None = None,
    ) -> None:
        self.process = process
        self.api = api  # HOST:PORT of the client API
        self.metrics_url = metrics_url  # http://HOST:PORT/metrics
        self.log_path = log_path  # stderr, appended to (a restart in one folder shares it)
        self._log_offset = log_offset  # where this process's part of the log starts
        ends = front_ends or {}
        self.http = ends.get("http", "off")  # HOST:PORT of the Open Inference Protocol, or off
        self.grpc = ends.get("grpc", "off")

    @classmethod
    def start(
        cls,
        folder: Path,
        config: Path | None = None,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cpus: set[int] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        python: str = sys.executable,
    ) -> DaemonProcess:
        """Start ``clockwork-async serve [--config CONFIG] ARGS`` (no config: the embedded
        default) with ``env`` (default: `clean_environ`) on ``cpus`` (default: all), run by
        ``python`` (another interpreter: another install, e.g. an older build to compare);
        returns once it prints where it serves. Raises RuntimeError, with the end of its log,
        if it exits first or takes longer than ``timeout_s``."""
        log_path = folder / "daemon.log"  # a restarted daemon's log follows the last one's
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [python, "-m", "clockwork_async", "serve"]
        argv += ["--config", str(config)] if config is not None else []
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [*argv, *args],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else clean_environ(folder),
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
            )
        try:
            match = _wait_serving_line(process, timeout_s)
        except (RuntimeError, TimeoutError) as error:
            kill_daemon(process)
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the daemon did not start ({error}):\n{tail}") from None
        ends = {"http": match.group(3) or "off", "grpc": match.group(4) or "off"}
        return cls(process, match.group(1), match.group(2), log_path, log_offset, ends)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Wait for the daemon to exit; returns its status. Raises subprocess.TimeoutExpired."""
        return self.process.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL, executors too, after STOP_TIMEOUT_S); returns the exit
        status."""
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

    def log(self) -> str:
        """What this process wrote to its log."""
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def http_get(self, path: str) -> tuple[int, str]:
        """GET ``path`` (``/metrics``, ``/healthz``, ``/readyz``) from the metrics endpoint;
        returns (status, body)."""
        url = self.metrics_url.removesuffix("/metrics") + path
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    # Affinity (benchmarks compare a pinned controller with an unpinned one).

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
    match = _wait_serving_line(process, timeout_s)
    return match.group(1), match.group(2)


def _wait_serving_line(process: subprocess.Popen[bytes], timeout_s: float) -> re.Match[str]:
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
            return match
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
