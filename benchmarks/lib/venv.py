"""The benchmark peers' own virtual environments (Ray Serve, MLServer: never the project's
environment) and the free ports their servers listen on.

- `ensure_venv`: a venv without system site packages with a requirements file installed
  once; pip's output is printed as it goes. A marker file holds the requirements' sha256, so
  a changed file reinstalls. Failure (no network, say) is returned as a reason, never raised:
  the caller reports the peer's rows as not run and goes on.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import time
from pathlib import Path

MARKER = "requirements.sha256"
INSTALL_TIMEOUT_S = 1200


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, requirements: Path, imports: str) -> str | None:
    """Make ``venv`` hold ``requirements`` (checked by importing ``imports``, a comma-separated
    list of modules, the first of which has a ``__version__``); returns None when ready, else
    why it is not."""
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    marker = venv / MARKER
    if venv_python(venv).exists() and marker.exists() and marker.read_text().strip() == digest:
        return None
    print(f"  creating {venv} and installing {requirements} (once)", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        status = _pip_install(venv, requirements)
    except (OSError, subprocess.SubprocessError) as error:
        return f"could not create {venv}: {error}"
    if status is not None:
        return status
    first = imports.split(",")[0].strip()
    check = subprocess.run(
        [str(venv_python(venv)), "-c", f"import {imports}; print({first}.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        return f"{first} does not import in {venv}: {check.stderr.strip()[-300:]}"
    marker.write_text(digest + "\n")
    took_s = time.monotonic() - started
    print(f"  {first} {check.stdout.strip()} installed in {took_s:.0f} s", file=sys.stderr)
    return None


def _pip_install(venv: Path, requirements: Path) -> str | None:
    """pip install, its lines printed as they come; returns None or why it failed."""
    argv = [str(venv_python(venv)), "-m", "pip", "install", "--progress-bar", "off"]
    process = subprocess.Popen(
        [*argv, "-r", str(requirements)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    last = ""
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    for line in process.stdout:
        if line.strip():
            last = line.strip()
            print(f"    pip: {last}", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            process.kill()
            return f"pip install took more than {INSTALL_TIMEOUT_S} s"
    if process.wait() != 0:
        return f"pip install failed ({process.returncode}): {last[-300:]}"
    return None


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
