"""Helpers of the paper's experiments 1, 2 and 5 (`predictability`, `slo_sweep`, `isolation`),
and a recording load client that runs as a process of its own:

    python -m benchmarks.exp_common --address A --models M1,M2 (--rate R | --concurrency N)
        --slo-ms S --duration-s D --seed K --out FILE.json

It keeps one row per request (send time, model, status, client latency, batch size, executor,
measured and predicted execute time), which `clockwork-async bench` does not: the experiments
need latency over time and per-action prediction errors.

Invariants of the recorder:
- Open loop (``--rate``): Poisson arrivals on a schedule drawn before the run (seeded); a
  request leaves at its time whether or not earlier ones were answered, and its send lag
  (how late it left against the schedule) is recorded, so a slow daemon cannot slow the
  offered load unseen.
- Closed loop (``--concurrency N``): N workers, each sending its next request when its last is
  answered, until the duration ends.
- Every request sent is one row, answered or not: a request unanswered ``--grace-s`` after the
  last send has status ``lost``.
- Times are ``time.monotonic_ns()`` (one clock for every process on the machine), so rows of
  two recorders and the orchestrator's marks line up.

The orchestrating side (`start_daemon`, `spawn_recorder`) puts the daemon's models and
profiles in a folder it is given and runs load processes pinned to the controller's CPU at
nice 10, as `cpu_serving` does, so they never take an executor's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import DaemonProcess, add_model, daemon_config, nearest_rank

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000
GENERATOR_NICE = 10
DOCS_IMG = Path("docs/img")
POLICIES = ("clockwork", "fifo", "timeout")


# --- models and the daemon -----------------------------------------------------------------------


def demo_model_bytes(folder: Path, names: Sequence[str]) -> dict[str, bytes]:
    """The ONNX bytes of demo models, generated under ``folder``."""
    from clockwork_async.demo_models import generate_demo_models

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


# --- the recorder as a process -------------------------------------------------------------------


def _generator_process(cpus: set[int]) -> None:
    """In a load process, before exec: pin it to ``cpus`` and lower its priority."""
    os.sched_setaffinity(0, cpus)
    os.nice(GENERATOR_NICE)


def generator_cpus() -> set[int]:
    """The controller's CPU (the lowest of this process's mask): no executor is pinned there."""
    return {min(os.sched_getaffinity(0))}


@dataclass(frozen=True)
class LoadSpec:
    """What one recorder process sends."""

    models: tuple[str, ...]
    slo_ms: float
    duration_s: float
    rate_rps: float | None = None  # open loop
    concurrency: int | None = None  # closed loop
    seed: int = 0

    def argv(self, address: str, out: Path) -> list[str]:
        mode = (
            ["--rate", f"{self.rate_rps:.3f}"]
            if self.rate_rps is not None
            else ["--concurrency", str(self.concurrency)]
        )
        return [
            sys.executable,
            "-m",
            "benchmarks.exp_common",
            "--address",
            address,
            "--models",
            ",".join(self.models),
            *mode,
            "--slo-ms",
            str(self.slo_ms),
            "--duration-s",
            str(self.duration_s),
            "--seed",
            str(self.seed),
            "--out",
            str(out),
        ]


def spawn_recorder(address: str, spec: LoadSpec, out: Path) -> subprocess.Popen[str]:
    """Start a recorder process (pinned to the controller's CPU, nice 10); see `collect`."""
    cpus = generator_cpus()
    return subprocess.Popen(
        spec.argv(address, out),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: _generator_process(cpus),
    )


def collect(process: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    """Wait for a recorder and return its JSON. Raises RuntimeError if it wrote none."""
    _, stderr = process.communicate()
    if process.returncode != 0 or not out.exists():
        raise RuntimeError(f"recorder failed ({process.returncode}): {stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def record(address: str, spec: LoadSpec, out: Path) -> dict[str, Any]:
    """`spawn_recorder` and `collect` in one call."""
    return collect(spawn_recorder(address, spec, out), out)


# --- the recorder itself -------------------------------------------------------------------------

# Per request: when it left (monotonic ns) and how late against its schedule; its model; its
# status ("lost" until answered); the client's latency; then what the reply says: batch size,
# executor, measured and predicted execute time of its batch, the daemon's queueing and total
# time, and the two executor hops (sent -> started there, ended there -> result received).
COLUMNS = (
    "sent_ns",
    "lag_ns",
    "model",
    "status",
    "latency_ns",
    "batch_size",
    "executor",
    "execute_ns",
    "predicted_ns",
    "queue_ns",
    "daemon_ns",
    "to_executor_ns",
    "from_executor_ns",
)


@dataclass
class Rows:
    """Column-wise rows, one per request sent."""

    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in COLUMNS})

    def add(self, sent_ns: int, lag_ns: int, model: str) -> int:
        row = len(self.columns["sent_ns"])
        for name, value in zip(
            COLUMNS, (sent_ns, lag_ns, model, "lost", 0, 0, "", 0, 0, 0, 0, 0, 0), strict=True
        ):
            self.columns[name].append(value)
        return row

    def answer(self, row: int, now_ns: int, answer: Any) -> None:
        from clockwork_async.client import ClientError

        columns = self.columns
        columns["latency_ns"][row] = now_ns - columns["sent_ns"][row]
        if isinstance(answer, ClientError):
            columns["status"][row] = "connection_closed"
            return
        columns["status"][row] = answer.status
        columns["batch_size"][row] = answer.batch_size
        columns["executor"][row] = answer.executor_id
        columns["execute_ns"][row] = int(answer.timing_ns.get("execute", 0))
        columns["predicted_ns"][row] = int(answer.timing_ns.get("predicted_execute", 0))
        columns["queue_ns"][row] = int(answer.timing_ns.get("queue", 0))
        columns["daemon_ns"][row] = int(answer.timing_ns.get("total", 0))
        columns["to_executor_ns"][row] = int(answer.timing_ns.get("to_executor", 0))
        columns["from_executor_ns"][row] = int(answer.timing_ns.get("from_executor", 0))


class Recorder:
    """One connection's worth of load, recorded row by row."""

    def __init__(self, client: Any, inputs: Mapping[str, Any], slo_ms: float) -> None:
        self.client = client
        self.inputs = inputs
        self.slo_ms = slo_ms
        self.rows = Rows()
        self.outstanding = 0
        self._idle = asyncio.Event()

    def send(self, model: str, scheduled_ns: int) -> asyncio.Future[None]:
        """Send one request now; the future resolves when it is answered."""
        sent_ns = time.monotonic_ns()
        row = self.rows.add(sent_ns, max(0, sent_ns - scheduled_ns), model)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.outstanding += 1
        self._idle.clear()
        pending = self.client.start_infer(model, self.inputs[model], slo_ms=self.slo_ms)
        pending.add_done_callback(lambda answer: self._answered(row, answer, done))
        return done

    def _answered(self, row: int, answer: Any, done: asyncio.Future[None]) -> None:
        self.rows.answer(row, time.monotonic_ns(), answer)
        self.outstanding -= 1
        if not self.outstanding:
            self._idle.set()
        if not done.done():
            done.set_result(None)

    async def open_loop(
        self, models: Sequence[str], rate_rps: float, duration_s: float, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        count = rng.poisson(rate_rps * duration_s)
        offsets_ns = np.sort(rng.uniform(0, duration_s * NS_PER_S, count)).astype(np.int64)
        picks = rng.integers(len(models), size=count)
        start_ns = time.monotonic_ns()
        for offset_ns, pick in zip(offsets_ns.tolist(), picks.tolist(), strict=True):
            scheduled_ns = start_ns + offset_ns
            delay_ns = scheduled_ns - time.monotonic_ns()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / NS_PER_S)
            self.send(models[pick], scheduled_ns)

    async def closed_loop(self, models: Sequence[str], concurrency: int, duration_s: float) -> None:
        end_ns = time.monotonic_ns() + round(duration_s * NS_PER_S)

        async def worker(index: int) -> None:
            while (now_ns := time.monotonic_ns()) < end_ns:
                await self.send(models[index % len(models)], now_ns)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    async def drain(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the replies still due (the rest stay ``lost``)."""
        if self.outstanding:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)


async def run_recorder(args: argparse.Namespace) -> dict[str, Any]:
    from clockwork_async.cli_client import random_inputs
    from clockwork_async.client import AsyncClient

    models = [m for m in args.models.split(",") if m]
    async with await AsyncClient.connect(args.address) as client:
        served = {m.name: m for m in await client.models()}
        missing = [m for m in models if m not in served]
        if missing:
            raise SystemExit(f"the daemon serves no model {missing[0]!r}")
        rng = np.random.default_rng(args.seed)
        inputs = {m: random_inputs(served[m].inputs, rng) for m in models}
        recorder = Recorder(client, inputs, args.slo_ms)
        start_ns = time.monotonic_ns()
        if args.rate is not None:
            await recorder.open_loop(models, args.rate, args.duration_s, args.seed)
        else:
            await recorder.closed_loop(models, args.concurrency, args.duration_s)
        end_ns = time.monotonic_ns()
        await recorder.drain(
            args.grace_s if args.grace_s is not None else 2 * args.slo_ms / 1e3 + 2
        )
    return {
        "start_ns": start_ns,
        "end_ns": end_ns,
        "mode": "open" if args.rate is not None else "closed",
        "rate_rps": args.rate,
        "concurrency": args.concurrency,
        "slo_ms": args.slo_ms,
        "models": models,
        "rows": recorder.rows.columns,
    }


def recorder_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exp_common")
    parser.add_argument("--address", required=True)
    parser.add_argument("--models", required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="open loop: Poisson requests/s over all models")
    mode.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    parser.add_argument("--slo-ms", type=float, required=True)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace-s", type=float)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from benchmarks.common import run_uvloop

    result = run_uvloop(run_recorder(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result) + "\n")
    return 0


# --- statistics of recorded rows -----------------------------------------------------------------


def select(rows: Mapping[str, list[Any]], keep: Iterable[bool]) -> dict[str, list[Any]]:
    """The rows where ``keep`` is true, column-wise."""
    mask = list(keep)
    return {
        name: [v for v, k in zip(values, mask, strict=True) if k] for name, values in rows.items()
    }


def percentiles_ms(
    values_ns: Iterable[int], points: Sequence[float] = (50, 99, 99.9)
) -> dict[str, float | None]:
    """Nearest-rank percentiles and the max of durations in ns, in ms (None when empty)."""
    ordered = sorted(values_ns)
    found: dict[str, float | None] = {
        f"p{p:g}": round(nearest_rank(ordered, p) / NS_PER_MS, 3) if ordered else None
        for p in points
    }
    found["max"] = round(ordered[-1] / NS_PER_MS, 3) if ordered else None
    return found


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
    under-predicted (actual slower than predicted) and the mean actual execute time."""
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


# --- plots ---------------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return None
    return plt


def save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(recorder_main())
