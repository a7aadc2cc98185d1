"""The Ray Serve side of `benchmarks.peer_ray`, as seen from the project's Python: its venv, the
`ray_app` process and the two ways of loading it (HTTP, deployment handle).

- `ensure_venv`: ``.bench-venv/ray`` (no system site packages) with
  `benchmarks/requirements-ray.txt` installed once (`benchmarks.lib.venv.ensure_venv`: a
  failure is returned as a reason, and the caller reports the Ray rows as not run).
- `RayApp`: ``benchmarks/ray_app.py`` under the venv's Python, started pinned to the system CPU
  in a session of its own; one JSON command per line in, one JSON line out, each with a
  timeout. Its standard error goes to a log file.
- `http_run` / `handle_run`: one open-loop run of the same arrival schedule
  (`http_loadgen.arrival_schedule`) over HTTP (`benchmarks.http_loadgen`, a process pinned to
  the system CPU at nice 10, as our bench) or through a deployment handle (`ray_app` itself,
  reniced to 10); both return rows in `http_loadgen`'s format.
- `leftovers` / `remove_leftovers`: what Ray writes outside the temp folder it is given
  (``~/.ray``, ``ray/session_*`` in the system temp folder) is removed afterwards if this run
  created it, and only then.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks import http_loadgen
from benchmarks.http_loadgen import arrival_schedule
from benchmarks.lib.venv import ensure_venv as lib_ensure_venv
from benchmarks.lib.venv import free_port, venv_python

VENV = Path(".bench-venv/ray")
REQUIREMENTS = Path("benchmarks/requirements-ray.txt")
APP = Path("benchmarks/ray_app.py")
START_TIMEOUT_S = 180
LOAD_NICE = 10
MAX_LAG_S = 1.0  # a request this late against its schedule is not sent (``behind``)


class RayNotRun(Exception):
    """The Ray side cannot run; the message says why (it goes into the report)."""


# --- the venv ------------------------------------------------------------------------------------


def _python(venv: Path) -> Path:
    return venv_python(venv)


def ensure_venv(venv: Path = VENV, requirements: Path = REQUIREMENTS) -> str | None:
    """`benchmarks.lib.venv.ensure_venv` for Ray: None when ready, else why it is not."""
    return lib_ensure_venv(venv, requirements, "ray, onnxruntime")


# --- what Ray leaves behind ----------------------------------------------------------------------


def _ray_paths() -> list[Path]:
    system_temp = Path(tempfile.gettempdir()) / "ray"
    found = [Path.home() / ".ray", system_temp]
    if system_temp.is_dir():
        found += sorted(system_temp.glob("session_*"))
    return found


def leftovers() -> set[Path]:
    """The paths Ray may create outside its own temp folder that exist now."""
    return {path for path in _ray_paths() if path.exists() or path.is_symlink()}


def remove_leftovers(before: set[Path]) -> list[str]:
    """Remove what `leftovers` finds now but did not find in ``before``; returns them."""
    removed = []
    for path in sorted(leftovers() - before, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(str(path))
    return removed


# --- the app process -----------------------------------------------------------------------------


def _pinned(cpus: set[int], nice: int = 0) -> Any:
    def before_exec() -> None:
        os.sched_setaffinity(0, cpus)
        if nice:
            os.nice(nice)

    return before_exec


@dataclass
class RayApp:
    """A running `ray_app` process and its command channel."""

    process: subprocess.Popen[str]
    port: int
    ready: dict[str, Any]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)

    @classmethod
    def start(
        cls, model: Path, temp_dir: Path, log: IO[str], system_cpus: set[int], **options: Any
    ) -> RayApp:
        """Start the app; returns once Serve serves. Raises RayNotRun."""
        port = free_port()
        argv = [str(_python(VENV)), str(APP), "--model", str(model), "--port", str(port)]
        argv += ["--temp-dir", str(temp_dir)]
        for name, value in options.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            preexec_fn=_pinned(system_cpus),
        )
        app = cls(process, port, {})
        threading.Thread(target=app._read, daemon=True).start()
        try:
            app.ready = app._reply(START_TIMEOUT_S)["ready"]
        except (RayNotRun, KeyError) as error:
            app.close()
            raise RayNotRun(f"ray_app did not start: {error}") from None
        return app

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RayNotRun(f"no answer from ray_app in {timeout_s:g} s") from None
        if not line:
            raise RayNotRun(f"ray_app exited ({self.process.poll()}); see its log")
        try:
            reply: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            raise RayNotRun(f"ray_app wrote {line[:200]!r}, not a reply") from None
        if "error" in reply:
            raise RayNotRun(f"ray_app: {reply['error']}")
        return reply

    def command(self, command: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        """Send one command and return its answer. Raises RayNotRun."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise RayNotRun("ray_app is gone; see its log") from None
        return self._reply(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Ask it to quit (Serve and Ray shut down); kill its session if it does not."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write('{"cmd": "quit"}\n')
                self.process.stdin.close()
                self.process.wait(timeout_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, 9)
                self.process.wait()


# --- runs ----------------------------------------------------------------------------------------


def http_run(
    app: RayApp,
    model: Path,
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    seed: int,
    out: Path,
    load_cpus: set[int],
    protocol: str = "raw",
) -> dict[str, Any]:
    """One `benchmarks.http_loadgen` run against the app's proxy (its body in ``protocol``'s
    form); returns its JSON (rows and settings). Raises RuntimeError if the generator wrote
    nothing."""
    return http_loadgen.run_process(
        app.port,
        model,
        rate_rps,
        duration_s,
        slo_ms,
        seed,
        out,
        cpus=load_cpus,
        nice=LOAD_NICE,
        protocol=protocol,
        max_lag_s=MAX_LAG_S,
    )


def handle_run(
    app: RayApp,
    input_specs: Any,
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """The same schedule through a deployment handle (driven by the app process)."""
    offsets_ns, inputs = arrival_schedule(seed, rate_rps, duration_s, input_specs)
    schedule, row = out.with_suffix(".schedule.npy"), out.with_suffix(".input.npy")
    np.save(schedule, offsets_ns)
    (array,) = inputs.values()
    np.save(row, array)
    command = {"cmd": "handle_load", "schedule": str(schedule), "input": str(row)}
    command |= {"slo_ms": slo_ms, "out": str(out), "max_lag_s": MAX_LAG_S}
    note = app.command(command, timeout_s=duration_s + 2 * slo_ms / 1000 + 120)
    result: dict[str, Any] = json.loads(out.read_text())
    result["note"] = note["handle_load"]
    return result
