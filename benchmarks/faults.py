"""Fault injection under open-loop load: executors killed and hung while the daemon serves.

    python -m benchmarks.faults [--quick] [--faults N] [--rate R] [--executors N] [--json OUT]

The real daemon (``clockwork-async serve`` on a temporary config) runs several simulated
executors; this process sends Poisson open-loop requests (`clockwork_async.bench`'s `Run`) over
16 instances of a model (more than the executors hold, so LOADs keep happening) and, one fault
at a time, injects:

- ``kill-load``, ``kill-infer``, ``kill-idle``: SIGKILL while the executor's load lane runs a
  LOAD, its execute lane an INFER, or neither. The phase is read from ``/proc``: a lane thread
  inside the simulated backend's wait sleeps in ``hrtimer_nanosleep`` (the lanes are the
  executor's two newest threads: ``load`` then ``execute``). The injector waits up to
  ``PHASE_WAIT_S`` for the wanted phase; the fault is recorded under the phase it really hit.
- ``stop``: SIGSTOP for a random 0.2-1.2 s, then SIGCONT. Shorter than the heartbeat timeout
  it is a pause nobody detects (``stop-pause``); longer, the daemon declares the executor
  down, kills it and starts a new one (``stop-detected``).
- A slowed executor cannot be injected: ``slowdown`` is fixed when an executor starts (the
  tests in ``tests/reliability`` cover it).

Victims rotate over the executors and each fault waits until every executor is up again, so
faults do not overlap. Measured: requests sent, answered, connection errors, lost (no answer
within the SLO plus a grace period; goal 0); outcomes overall and of the requests in flight at
each kind of fault; detection (fault -> the daemon's stats show the executor down) and recovery
(fault -> up again, restarted) p50/max, goal <= 2 s; the first ``ok`` the victim served after.
Stats are polled every ``POLL_S``, which bounds the resolution of both times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import (
    RESULTS,
    DaemonProcess,
    add_model,
    daemon_config,
    keep_log,
    load_average,
    machine_description,
    percentile,
    run_uvloop,
    table,
    write_report,
)
from clockwork_async.bench import Run, copy_names
from clockwork_async.client import AsyncClient, ClientError, InferResult
from clockwork_async.sim.workloads import poisson

NS_PER_S = 1_000_000_000
MODEL = "m"  # served as m-0 .. m-{COPIES-1}
COPIES = 16
SENDING_HORIZON_S = 24 * 3600.0  # arrivals are drawn lazily; sending stops when cancelled
SLOWDOWN = 100.0  # tiny-sim x100: LOAD 100 ms, INFER 50/60/80 ms at batch 1/2/4
PAGE_BYTES = 1 << 20  # tiny-sim holds 3 MiB: 3 pages
MODELS_PER_EXECUTOR = 4
POLL_S = 0.01
PHASE_WAIT_S = 3.0
SETTLE_S = (0.2, 0.6)  # random wait between one recovery and the next fault
STOP_S = (0.2, 1.2)
RECOVERY_TIMEOUT_S = 20.0
GRACE_S = 5.0
KINDS = ("kill-load", "kill-infer", "kill-idle", "stop")


@dataclass(frozen=True)
class Plan:
    faults: int
    rate_per_s: float
    executors: int
    slo_ms: float = 1000.0
    seed: int = 1


FULL = Plan(faults=100, rate_per_s=40.0, executors=4)
QUICK = Plan(faults=20, rate_per_s=30.0, executors=3)


# --- the daemon ----------------------------------------------------------------------------------


def executors_toml(count: int) -> str:
    weights_bytes = MODELS_PER_EXECUTOR * 3 * PAGE_BYTES
    table_text = (
        f'[[executors]]\nbackend = "simulated"\npage_bytes = {PAGE_BYTES}\n'
        f"weights_bytes = {weights_bytes}\nslowdown = {SLOWDOWN}\n"
    )
    return "\n".join([table_text] * count)


# Default heartbeats (200 ms x 3 missed: down after 0.7 s of silence). The restart backoff
# counts as healthy after 2 s instead of 10 s: the benchmark kills each executor every few
# seconds on purpose, which the default would treat as a crash loop and slow down.
LINK_SECTION = """[profiler]
max_execute_ns = 100000000
[executor_link]
reconnect_backoff_healthy_s = 2.0
"""


def start_daemon(folder: Path, plan: Plan) -> DaemonProcess:
    from clockwork_async.models.demo import build_tiny

    model_toml = f'copies = {COPIES}\nsim_profile = "tiny-sim"\n'
    add_model(folder / "models", MODEL, build_tiny(0).SerializeToString(), model_toml)
    config = daemon_config(folder, executors_toml(plan.executors), LINK_SECTION)
    return DaemonProcess.start(folder, config)


# --- executors seen from /proc -------------------------------------------------------------------


def executor_pids(daemon_pid: int) -> dict[str, int]:
    """The daemon's live child processes by their ``--name``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if int(stat[1]) == daemon_pid and stat[0] != "Z" and b"--name" in args:
                found[args[args.index(b"--name") + 1].decode()] = int(entry.name)
    return found


def lane_phase(pid: int) -> str:
    """``load``, ``infer``, ``both`` or ``idle``: which lane thread sleeps in a simulated
    action's wait right now (``gone`` if the process is)."""
    try:
        tasks = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())
        load, execute = (_sleeping(pid, tid) for tid in tasks[-2:])
    except (OSError, ValueError):
        return "gone"
    return {(True, True): "both", (True, False): "load", (False, True): "infer"}.get(
        (load, execute), "idle"
    )


def _sleeping(pid: int, tid: int) -> bool:
    return "nanosleep" in Path(f"/proc/{pid}/task/{tid}/wchan").read_text()


async def wait_for_phase(pid: int, wanted: str, timeout_s: float) -> str:
    """Poll until the executor is in ``wanted`` (``both`` counts as load and infer); returns
    the phase at the end (the wanted one, or whatever it was when the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        phase = lane_phase(pid)
        if phase == wanted or (phase == "both" and wanted in ("load", "infer")):
            return wanted
        if time.monotonic() > deadline or phase == "gone":
            return phase
        await asyncio.sleep(0.002)


# --- open-loop load ------------------------------------------------------------------------------


@dataclass
class Sent:
    sent_ns: int
    reply_ns: int = 0
    status: str = ""  # an outcome, an error status, or "connection_error"
    executor_id: str = ""


@dataclass
class SentLog:
    """A `clockwork_async.bench.Observer`: one `Sent` per request, times monotonic ns."""

    origin_ns: int  # the bench run's start
    requests: list[Sent] = field(default_factory=list)

    def on_sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None:
        self.requests.append(Sent(self.origin_ns + sent_ns))

    def on_answer(
        self, index: int, sent_ns: int, now_ns: int, answer: InferResult | ClientError
    ) -> None:
        record = self.requests[index]
        record.reply_ns = self.origin_ns + now_ns
        if isinstance(answer, InferResult):
            record.status, record.executor_id = answer.status, answer.executor_id
        else:
            record.status = "connection_error"


def sender(client: AsyncClient, plan: Plan) -> tuple[Run, SentLog, Iterator[Any]]:
    """A bench run over the model's copies, its log, and Poisson arrivals over the copies at
    the plan's rate that go on until the sending task is cancelled."""
    inputs = {"input": np.ones((1, 4), np.float32)}
    run = Run(client, dict.fromkeys(copy_names(MODEL, COPIES), inputs))
    log = SentLog(run.start_ns)
    run.observers = (log,)
    workload = poisson(COPIES, plan.rate_per_s, SENDING_HORIZON_S)
    return run, log, workload.open_arrivals(np.random.default_rng(plan.seed))


# --- faults --------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str  # kill-load, kill-infer, kill-idle (the phase it hit), stop-detected, stop-pause
    wanted: str
    executor: str
    at_ns: int
    stop_s: float = 0.0
    detected_s: float | None = None
    recovered_s: float | None = None
    first_ok_s: float | None = None


async def executor_states(client: AsyncClient) -> dict[str, dict[str, Any]]:
    stats = await client.stats()
    return {e["executor_id"]: e for e in stats["executors"]}


async def wait_all_up(client: AsyncClient, timeout_s: float) -> dict[str, dict[str, Any]]:
    """The executors' states once every one is up. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await executor_states(client)
        if all(state["up"] for state in states.values()):
            return states
        if time.monotonic() > deadline:
            raise TimeoutError(f"executors not all up after {timeout_s:g} s: {states.keys()}")
        await asyncio.sleep(POLL_S)


async def inject(daemon_pid: int, victim: str, wanted: str, rng: random.Random) -> Fault:
    """Inject one fault of kind ``wanted`` into executor ``victim``; returns its record."""
    pid = executor_pids(daemon_pid)[victim]
    if wanted == "stop":
        stop_s = rng.uniform(*STOP_S)
        os.kill(pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(stop_s, _resume, pid)
        return Fault("stop", wanted, victim, time.monotonic_ns(), stop_s=stop_s)
    phase = await wait_for_phase(pid, wanted.removeprefix("kill-"), PHASE_WAIT_S)
    os.kill(pid, signal.SIGKILL)
    return Fault(f"kill-{phase}", wanted, victim, time.monotonic_ns())


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the daemon killed it: it was detected
        os.kill(pid, signal.SIGCONT)


async def observe(client: AsyncClient, fault: Fault, before: dict[str, Any]) -> None:
    """Poll the daemon's stats until the victim is back (or, for a pause nobody detected,
    until well after it resumed); fills in detection and recovery times."""
    deadline_s = time.monotonic() + RECOVERY_TIMEOUT_S
    quiet_until_s = time.monotonic() + fault.stop_s + 1.0  # a pause shorter than the timeout
    while time.monotonic() < deadline_s:
        state = (await executor_states(client))[fault.executor]
        since_s = (time.monotonic_ns() - fault.at_ns) / NS_PER_S
        restarted = state["restarts"] > before["restarts"]
        if fault.detected_s is None and (not state["up"] or restarted):
            fault.detected_s = since_s
        if restarted and state["up"]:
            fault.recovered_s = since_s
            return
        if fault.kind == "stop" and fault.detected_s is None and time.monotonic() > quiet_until_s:
            return
        await asyncio.sleep(POLL_S)


async def run_faults(daemon: DaemonProcess, client: AsyncClient, plan: Plan) -> list[Fault]:
    rng = random.Random(plan.seed)
    faults: list[Fault] = []
    names = sorted(await wait_all_up(client, RECOVERY_TIMEOUT_S))
    for index in range(plan.faults):
        states = await wait_all_up(client, RECOVERY_TIMEOUT_S)
        await asyncio.sleep(rng.uniform(*SETTLE_S))
        victim = names[index % len(names)]
        fault = await inject(daemon.pid, victim, rng.choice(KINDS), rng)
        await observe(client, fault, states[victim])
        if fault.kind == "stop":
            fault.kind = "stop-pause" if fault.detected_s is None else "stop-detected"
        faults.append(fault)
        print(f"  fault {index + 1}/{plan.faults}: {_describe(fault)}", flush=True)
    return faults


def _describe(fault: Fault) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    return (
        f"{fault.kind:<10} on {fault.executor}: detected {seconds(fault.detected_s)}, "
        f"recovered {seconds(fault.recovered_s)}"
    )


# --- the run -------------------------------------------------------------------------------------


async def run(plan: Plan, folder: Path) -> dict[str, Any]:
    with start_daemon(folder, plan) as daemon:
        sender_client = await AsyncClient.connect(daemon.api)
        stats_client = await AsyncClient.connect(daemon.api)
        load, log, arrivals = sender(sender_client, plan)
        sending = asyncio.create_task(load.open_loop(arrivals, plan.slo_ms))
        try:
            await asyncio.sleep(2.0)  # warm up: models loaded, predictions learned
            faults = await run_faults(daemon, stats_client, plan)
            await asyncio.sleep(1.0)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
        await load.finish(plan.slo_ms / 1000 + GRACE_S)
        daemon_stats = await stats_client.stats()
        for client in (sender_client, stats_client):
            await client.close()
    first_ok_after(faults, log.requests)
    return report(plan, log.requests, faults, daemon_stats)


def first_ok_after(faults: list[Fault], requests: list[Sent]) -> None:
    """Fill in, per fault, when the victim first answered ``ok`` once it was back (restarted,
    or resumed from a pause nobody detected): serving again, seen from the client."""
    served = sorted((r.reply_ns, r.executor_id) for r in requests if r.status == "ok")
    for fault in faults:
        back_s = fault.recovered_s if fault.recovered_s is not None else fault.stop_s
        back_ns = fault.at_ns + round(back_s * NS_PER_S)
        after = (ns for ns, executor in served if executor == fault.executor and ns > back_ns)
        first_ns = next(after, None)
        if first_ns is not None:
            fault.first_ok_s = (first_ns - fault.at_ns) / NS_PER_S


def in_flight_outcomes(requests: list[Sent], at_ns: int) -> Counter[str]:
    """Outcomes of the requests sent before ``at_ns`` and answered after it (or never)."""
    return Counter(
        r.status or "lost" for r in requests if r.sent_ns < at_ns and not 0 < r.reply_ns < at_ns
    )


def seconds_summary(values: list[float | None]) -> dict[str, Any]:
    measured = sorted(v for v in values if v is not None)
    if not measured:
        return {"n": 0}
    return {
        "n": len(measured),
        "p50_s": round(percentile(measured, 50), 3),
        "max_s": round(measured[-1], 3),
    }


def report(
    plan: Plan, requests: list[Sent], faults: list[Fault], daemon_stats: dict[str, Any]
) -> dict[str, Any]:
    statuses = Counter(r.status or "lost" for r in requests)
    by_kind: dict[str, Any] = {}
    for kind in sorted({f.kind for f in faults}):
        chosen = [f for f in faults if f.kind == kind]
        in_flight: Counter[str] = Counter()
        for fault in chosen:
            in_flight += in_flight_outcomes(requests, fault.at_ns)
        by_kind[kind] = {
            "faults": len(chosen),
            "wanted": dict(Counter(f.wanted for f in chosen)),
            "detected": sum(f.detected_s is not None for f in chosen),
            "detection": seconds_summary([f.detected_s for f in chosen]),
            "recovery": seconds_summary([f.recovered_s for f in chosen]),
            "first_ok_after": seconds_summary([f.first_ok_s for f in chosen]),
            "in_flight_outcomes": dict(in_flight),
        }
    restarted = [f for f in faults if f.recovered_s is not None]
    return {
        "plan": asdict(plan),
        "slowdown": SLOWDOWN,
        "models": f"{COPIES} instances of tiny-sim, {MODELS_PER_EXECUTOR} fit per executor",
        "slowed_executor": "not injected: slowdown is fixed at start (tests/reliability)",
        "requests": {
            "sent": len(requests),
            "answered": sum(statuses[s] for s in statuses if s not in ("lost", "connection_error")),
            "connection_errors": statuses["connection_error"],
            "lost": statuses["lost"],
            "statuses": dict(statuses),
        },
        "faults": len(faults),
        "recovery_all": seconds_summary([f.recovered_s for f in restarted]),
        "detection_all": seconds_summary([f.detected_s for f in faults]),
        "by_kind": by_kind,
        "daemon_outcomes": daemon_stats.get("outcomes", {}),
        "daemon_restarts": {e["executor_id"]: e["restarts"] for e in daemon_stats["executors"]},
        "fault_log": [asdict(f) for f in faults],
    }


def print_report(result: dict[str, Any]) -> None:
    requests = result["requests"]
    print(
        f"\nrequests: sent {requests['sent']}, answered {requests['answered']}, "
        f"connection errors {requests['connection_errors']}, lost {requests['lost']} (goal 0)"
    )
    print(f"statuses: {requests['statuses']}")
    rows = []
    for kind, row in result["by_kind"].items():
        detection, recovery, first_ok = row["detection"], row["recovery"], row["first_ok_after"]
        rows.append(
            [
                kind,
                row["faults"],
                row["detected"],
                detection.get("p50_s"),
                detection.get("max_s"),
                recovery.get("p50_s"),
                recovery.get("max_s"),
                first_ok.get("p50_s"),
                row["in_flight_outcomes"],
            ]
        )
    headers = ["kind", "faults", "detected", "detect p50", "max", "recover p50", "max"]
    print(table([*headers, "first ok p50", "in flight at fault"], rows))
    recovery = result["recovery_all"]
    print(
        f"recovery over {recovery.get('n', 0)} restarts: p50 {recovery.get('p50_s')} s, "
        f"max {recovery.get('max_s')} s (goal <= 2 s)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="20 faults, 3 executors")
    parser.add_argument("--faults", type=int, help="how many faults to inject")
    parser.add_argument("--rate", type=float, help="requests per second, open loop")
    parser.add_argument("--executors", type=int, help="simulated executors (at least 2)")
    parser.add_argument("--json", type=Path, default=RESULTS / "faults.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    overrides = {"faults": args.faults, "rate_per_s": args.rate, "executors": args.executors}
    plan = Plan(**{**asdict(plan), **{k: v for k, v in overrides.items() if v is not None}})
    if plan.faults < 1 or plan.rate_per_s <= 0 or plan.executors < 2:
        parser.error("need --faults >= 1, --rate > 0 and --executors >= 2")
    machine = machine_description()
    with tempfile.TemporaryDirectory(prefix="cw-faults-") as folder:
        try:
            result = run_uvloop(run(plan, Path(folder)))
        finally:  # the daemon's log explains slow recoveries (restart attempts, backoff)
            keep_log(Path(folder) / "daemon.log", RESULTS / f"{args.json.stem}-daemon.log")
    result = {"quick": args.quick, "machine": machine, **result}
    result["load_average_after"] = load_average()
    print_report(result)
    path = write_report(args.json.stem, result, args.json.parent)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
