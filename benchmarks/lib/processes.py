"""Processes of the benchmarks: the daemon (through the product's `clockwork_async.testing`),
its models and profiles, and load generators (``clockwork-async bench``) as processes of their
own.

Invariants:
- The daemon is always `clockwork_async.testing.DaemonProcess`: everything it writes (config,
  repository, profile cache, XDG homes, log) lives in the folder it is given, and it binds
  free loopback ports.
- A load process runs pinned to the controller's CPU (the lowest of this process's mask: no
  executor is pinned there) at nice 10, so it never takes an executor's CPU and the
  controller preempts it when both are ready; its send lag and CPU are in its summary.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.lib.machine import load_average
from clockwork_async.testing import (
    SIM_EXECUTOR,
    DaemonProcess,
    add_model,
    children,
    clean_environ,
    kill_daemon,
    write_config,
)

__all__ = [
    "GENERATOR_NICE",
    "POLICIES",
    "SIM_EXECUTOR",
    "DaemonProcess",
    "LoadSpec",
    "ModelFolder",
    "add_model",
    "bench_argv",
    "cached_profiles",
    "children",
    "clean_environ",
    "collect",
    "collect_bench",
    "controller_section",
    "daemon_config",
    "daemon_stats",
    "demo_model_bytes",
    "generator_cpus",
    "kill_daemon",
    "record",
    "registration_profile",
    "run_bench",
    "run_uvloop",
    "shared_model_bytes",
    "spawn_bench",
    "spawn_recorder",
    "start_daemon",
]

T = TypeVar("T")
NS_PER_MS = 1_000_000
GENERATOR_NICE = 10
POLICIES = ("clockwork", "fifo", "timeout")


def run_uvloop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a uvloop event loop (asyncio's if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


# --- the daemon and its models -------------------------------------------------------------------


def daemon_config(folder: Path, executors_toml: str = "", extra_sections: str = "") -> Path:
    """`clockwork_async.testing.write_config`: ``extra_sections`` are more tables
    (``[controller]``, ``[executor_link]`` ...)."""
    return write_config(folder, executors_toml, sections_toml=extra_sections)


def demo_model_bytes(folder: Path, names: Sequence[str]) -> dict[str, bytes]:
    """The ONNX bytes of demo models, generated under ``folder``."""
    from clockwork_async.models.demo import generate_demo_models

    paths = generate_demo_models(folder, names=list(names))
    return {name: paths[name].read_bytes() for name in names}


def shared_model_bytes(directory: Path) -> dict[str, bytes]:
    """The ``*.onnx`` files of ``directory`` by stem (empty when it is absent)."""
    if not directory.is_dir():
        return {}
    return {path.stem: path.read_bytes() for path in sorted(directory.glob("*.onnx"))}


@dataclass(frozen=True)
class ModelFolder:
    """One folder of the daemon's repository: its ONNX bytes and optional model.toml."""

    onnx: bytes
    toml: str = ""


def controller_section(policy: str, extra: Mapping[str, Any] | None = None) -> str:
    """A ``[controller]`` TOML section choosing ``policy`` (plus ``extra`` keys)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    lines = ["[controller]", f'policy = "{policy}"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in (extra or {}).items()]
    return "\n".join(lines) + "\n"


def start_daemon(
    folder: Path,
    models: Mapping[str, ModelFolder],
    policy: str,
    controller: Mapping[str, Any] | None = None,
) -> DaemonProcess:
    """The daemon on its default executors (one pinned ONNX Runtime executor per CPU after the
    controller's) serving ``models`` under ``policy`` (and ``controller``'s other keys). The
    repository and the profile cache live in ``folder``: a later daemon on the same folder
    reuses the profiles."""
    for name, model in models.items():
        add_model(folder / "models", name, model.onnx, model.toml)
    config = daemon_config(folder, extra_sections=controller_section(policy, controller))
    return DaemonProcess.start(folder, config)


def registration_profile(folder: Path) -> dict[str, Any]:
    """The first profile registration measured (from the daemon's profile cache under
    ``folder``): batch sizes and, per executor kind, ``execute_ns`` by batch size. Raises
    RuntimeError if there is none."""
    for path in sorted((folder / "profiles").glob("*.json")):
        profile = json.loads(path.read_text()).get("profile")
        if profile and profile.get("kinds"):
            return dict(profile)
    raise RuntimeError(f"no registration profile under {folder / 'profiles'}")


def cached_profiles(folder: Path, models: Mapping[str, ModelFolder]) -> dict[str, dict[str, Any]]:
    """Registration profiles from the daemon's cache under ``folder``, by model name (the cache
    is keyed by the file's sha256). Each is ``{"batch_sizes", "execute_ms": {b: ms},
    "load_ms"}`` of the first executor kind; models without a cached profile are left out."""
    found = {}
    for name, model in models.items():
        digest = hashlib.sha256(model.onnx).hexdigest()
        for path in sorted((folder / "profiles").glob(f"{digest}-*.json")):
            profile = json.loads(path.read_text()).get("profile") or {}
            kinds = profile.get("kinds") or {}
            if kinds:
                table_ = next(iter(kinds.values()))
                found[name] = {
                    "batch_sizes": [int(b) for b in profile["batch_sizes"]],
                    "execute_ms": {
                        int(b): ns / NS_PER_MS for b, ns in table_["execute_ns"].items()
                    },
                    "load_ms": int(table_["load_ns"]) / NS_PER_MS,
                }
                break
    return found


async def daemon_stats(address: str) -> dict[str, Any]:
    """The daemon's stats (``client.stats()``)."""
    from clockwork_async.client import AsyncClient

    async with await AsyncClient.connect(address) as client:
        return await client.stats()


# --- load generators as processes ----------------------------------------------------------------


def generator_cpus() -> set[int]:
    """The controller's CPU (the lowest of this process's mask): no executor is pinned there."""
    return {min(os.sched_getaffinity(0))}


def _pinned_nice(cpus: set[int], nice: int = GENERATOR_NICE) -> Callable[[], None]:
    def prepare() -> None:  # in the child, before exec
        os.sched_setaffinity(0, cpus)
        os.nice(nice)

    return prepare


def bench_argv(address: str, summary: Path, flags: Sequence[str]) -> list[str]:
    """``clockwork-async bench`` against ``address`` writing its summary to ``summary``, with
    ``flags`` (``--model M --rate R ...``) and no progress lines."""
    argv = [sys.executable, "-m", "clockwork_async", "bench", "--address", address]
    return [*argv, "--progress-s", "0", *flags, "--json", str(summary)]


def spawn_bench(
    address: str, summary: Path, flags: Sequence[str], pin: bool = True, nice: int = GENERATOR_NICE
) -> subprocess.Popen[str]:
    """Start ``clockwork-async bench`` (`bench_argv`) as a process, pinned to the controller's
    CPU at ``nice`` (default 10) unless ``pin`` is false; see `collect_bench`."""
    return subprocess.Popen(
        bench_argv(address, summary, flags),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_pinned_nice(generator_cpus(), nice) if pin else None,
    )


def collect_bench(process: subprocess.Popen[str], summary: Path) -> dict[str, Any]:
    """Wait for a bench process; returns its summary with ``bench_exit_status`` (1 when some
    requests were lost). Raises RuntimeError if it wrote no summary."""
    _, stderr = process.communicate()
    if not summary.exists():
        raise RuntimeError(f"bench failed ({process.returncode}): {stderr[-2000:]}")
    found: dict[str, Any] = json.loads(summary.read_text())
    found["bench_exit_status"] = process.returncode
    return found


def run_bench(
    address: str, summary: Path, flags: Sequence[str], pin: bool = True, nice: int = GENERATOR_NICE
) -> dict[str, Any]:
    """`spawn_bench` and `collect_bench` in one call, with the load average before and after
    (``load_average_before``, ``load_average_after``)."""
    before = load_average()
    found = collect_bench(spawn_bench(address, summary, flags, pin, nice), summary)
    found["load_average_before"] = before
    found["load_average_after"] = load_average()
    return found


@dataclass(frozen=True)
class LoadSpec:
    """What one recorded bench process sends: open loop (``rate_rps``, Poisson over all
    models) or closed loop (``concurrency``)."""

    models: tuple[str, ...]
    slo_ms: float
    duration_s: float
    rate_rps: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def flags(self) -> list[str]:
        mode = (
            ["--rate", f"{self.rate_rps:.3f}"]
            if self.rate_rps is not None
            else ["--concurrency", str(self.concurrency)]
        )
        return [
            "--models",
            ",".join(self.models),
            *mode,
            "--slo-ms",
            str(self.slo_ms),
            "--duration-s",
            str(self.duration_s),
            "--seed",
            str(self.seed),
        ]


def spawn_recorder(address: str, spec: LoadSpec, out: Path) -> subprocess.Popen[str]:
    """Start a bench process (pinned, nice 10) that keeps one row per request in ``out``;
    see `collect`."""
    return spawn_bench(address, _summary_path(out), [*spec.flags(), "--rows", str(out)])


def collect(process: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    """Wait for a recorder: its rows document (``start_ns``, ``end_ns``: monotonic, when it
    began and stopped sending; ``rows``: `clockwork_async.bench.ROW_COLUMNS`) with its bench
    ``summary``. Raises RuntimeError if it wrote none."""
    summary = collect_bench(process, _summary_path(out))
    recorded: dict[str, Any] = json.loads(out.read_text())
    recorded["summary"] = summary
    return recorded


def record(address: str, spec: LoadSpec, out: Path) -> dict[str, Any]:
    """`spawn_recorder` and `collect` in one call."""
    return collect(spawn_recorder(address, spec, out), out)


def _summary_path(rows: Path) -> Path:
    return rows.with_name(f"{rows.stem}-summary.json")


# --- reference servers (their own processes) -----------------------------------------------------

WIRE_SERVER_READY = "wire server listening on "
Respond = Callable[[Any], Any]  # a wire message in, its answer out (None: no answer)


async def serve_wire(name: str, respond: Respond) -> None:
    """Serve until killed on a loopback port, printed as `WIRE_SERVER_READY` HOST:PORT: each
    connection's hello is answered, then every message gets ``respond(message)`` (unless it
    is None). The project's codec and `connection`, no controller: the floor the daemon's
    benchmarks compare against."""
    from clockwork_async.connection import Connection
    from clockwork_async.endpoints import start_server
    from clockwork_async.wire.messages import PROTOCOL_VERSION, Hello, Role

    async def handle(connection: Connection) -> None:
        await connection.recv()  # the client's hello (expect_hello checks it is one)
        connection.send(Hello(PROTOCOL_VERSION, Role.CONTROLLER.value, name))
        while True:
            answer = respond(await connection.recv())
            if answer is not None:
                connection.send(answer)
            if connection.writing_paused:
                await connection.drain()

    server = await start_server(handle, "tcp:127.0.0.1:0", expect_hello=True)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"{WIRE_SERVER_READY}{host}:{port}", flush=True)
    await asyncio.Event().wait()


def start_wire_server(argv: Sequence[str]) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``argv``, a process that runs `serve_wire`; returns it and its address. Raises
    RuntimeError if it does not say where it listens."""
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    if not line.startswith(WIRE_SERVER_READY):
        process.kill()
        process.wait()
        raise RuntimeError(f"{argv} did not start: {line!r}")
    return process, line.removeprefix(WIRE_SERVER_READY).strip()
