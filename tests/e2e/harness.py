"""Runs the real daemon (`clockwork-async serve`) as a subprocess for end-to-end tests.

`DaemonProcess.start` writes nothing outside the folder it is given: the config, the model
repository, the profile cache and XDG state/cache homes all live there, and ports are picked
by the daemon (port 0) and read back from the line it prints once serving. `stop` (SIGTERM,
then SIGKILL) must run in a finally or a fixture teardown; executors die with the daemon.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import children as children  # re-exported for the e2e tests
from benchmarks.common import kill_daemon, wait_serving

from clockwork_async.demo_models import build_tiny

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

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
    folder: Path, executors: str, *, drain_timeout_s: float = 5.0, extra: str = ""
) -> Path:
    """A config serving on free loopback ports, everything under ``folder``."""
    text = f"""
[server]
listen = "127.0.0.1:0"
drain_timeout_s = {drain_timeout_s}
log_level = "debug"
[metrics]
listen = "127.0.0.1:0"
[repository]
path = "{folder / "models"}"
profile_cache_dir = "{folder / "profiles"}"
{extra}
{executors}
"""
    path = folder / "clockwork-async.toml"
    path.write_text(text, encoding="utf-8")
    return path


def add_tiny(repository: Path, name: str = "tiny", *, seed: int = 0, toml: str = "") -> Path:
    """Put the demo ``tiny`` model (weights seeded by ``seed``) into a repository folder."""
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(build_tiny(seed).SerializeToString())
    if toml:
        (folder / "model.toml").write_text(toml, encoding="utf-8")
    return folder


def clean_environ(folder: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment minus our own variables and systemd's, with XDG homes in ``folder``."""
    drop = ("CLOCKWORK_ASYNC_", "NOTIFY_SOCKET", "WATCHDOG_", "STATE_DIRECTORY")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["XDG_STATE_HOME"] = str(folder / "state")
    env["XDG_CACHE_HOME"] = str(folder / "cache")
    env.update(extra or {})
    return env


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    api: str
    metrics_url: str
    log_path: Path

    @classmethod
    def start(
        cls,
        folder: Path,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        cpus: set[int] | None = None,
    ) -> DaemonProcess:
        """Start ``clockwork-async serve ARGS``; returns once it prints where it listens.
        ``cpus``: the CPUs it may use (the default config runs an executor per CPU but one).
        Raises RuntimeError (with its log) if it exits or takes longer than ``timeout_s``."""
        log_path = folder / f"daemon-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-m", "clockwork_async", "serve", *args]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else clean_environ(folder),
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
            )
        try:
            api, metrics = wait_serving(process, timeout_s)
        except BaseException:
            kill_daemon(process)
            raise RuntimeError(f"the daemon did not start:\n{log_path.read_text()}") from None
        return cls(process, api, metrics.removesuffix("/metrics"), log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM and wait (SIGKILL, executors too, after the timeout); returns the exit
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
        return self.log_path.read_text(errors="replace")

    def http_get(self, path: str) -> tuple[int, str]:
        """GET ``path`` from the metrics endpoint; returns (status, body)."""
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()


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
