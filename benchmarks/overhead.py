"""What the daemon adds: its round trip and throughput against a raw echo server, same client.

    python -m benchmarks.overhead [--quick] [--pipeline N] [--no-flipped] [--before PYTHON]
                                  [--json OUT]

Targets, all driven by the same `clockwork_async.client.AsyncClient` over loopback TCP from
this process, in interleaved blocks (echo, daemon, daemon-no-poll, daemon-flipped, echo, ...)
so that a change in the machine's load hits every target alike:

- ``echo``: a raw uvloop server in its own process, on the project's codec and
  `clockwork_async.connection`, that answers each InferRequest with an InferReply holding the
  same tensor (and each Ping with a Pong). One hop, no controller.
- ``daemon``: the real daemon (``clockwork-async serve`` on a temporary config, pinning as it
  is configured by default) with one simulated executor pinned to the last CPU. Its model is
  the built-in ``tiny-sim`` profile with ``slowdown`` 0.02: 10 µs at batch 1, 40 µs at batch
  16. Requests cross two hops (client -> daemon -> executor and back) and the controller core.
  Its controller has CPU 0 to itself, so it busy-polls after work (``server.busy_poll_us``).
- ``daemon-no-poll``: a second such daemon (its executor on the same CPU, idle while the other
  is measured) with ``server.busy_poll_us = 0``: what the polling buys.
- ``daemon-before`` (with ``--before PYTHON``): the same daemon as ``daemon``, run by another
  install's interpreter (an older commit in a worktree of its own with its own venv): a
  before/after comparison in one run, the machine's load hitting both alike.
- ``daemon-pinned`` or ``daemon-unpinned``: the same daemon process with its controller's
  affinity flipped for its blocks (every daemon thread pinned to the lowest CPU if the daemon
  runs unpinned, allowed every CPU if it pinned itself), and restored after each block. It
  keeps busy-polling, which the daemon would not choose unpinned.

Measured: serial round trips (one request in flight; client-side perf_counter around
``await client.infer``) p50/p99/p99.9; the API ping (Ping/Pong, no controller); pipelined
throughput with N requests always in flight (replies/s and ok replies/s). From the daemon's
``stats``: event-loop lag (ready-callback wait) and the controller's cost per request (core,
driver total, sends), as deltas over each target's blocks.

Goals (issue 4): serial round trip <= 3x the echo's; pipelined throughput >= 25% of the echo's.

The probes (`serial`, `pipelined`) are closed loops of their own, not ``clockwork-async
bench``: they measure one connection's round trip and a fixed number in flight, the same way
against the echo server and the daemon, adding samples up over interleaved blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
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
    ratio,
    run_uvloop,
    serve_wire,
    start_wire_server,
    summarize_ns,
    table,
    write_report,
)
from clockwork_async.client import AsyncClient, ClientError, InferResult
from clockwork_async.testing import children, clean_environ

SLO_MS = 1000.0  # generous: this measures overhead, not scheduling
SLOWDOWN = 0.02  # tiny-sim b1 500 µs x 0.02 = 10 µs
INPUTS = {"input": np.zeros((1, 4), dtype=np.float32)}  # what simulated models take
MODEL = "near-zero"
BUSY_POLL_VARIABLE = "CLOCKWORK_ASYNC_SERVER_BUSY_POLL_US"
# The daemon's own timing of a request: arrival to reply, arrival to sent to the executor, and
# the executor's start to end (its lane's wait for the window's start is outside it).
DAEMON_TIMINGS = ("total", "queue", "executor")


@dataclass(frozen=True)
class Plan:
    blocks: int  # serial and pipelined blocks per target, interleaved
    serial_per_block: int
    pipelined_s_per_block: float
    pings_per_block: int
    warmup: int = 200


QUICK = Plan(blocks=4, serial_per_block=300, pipelined_s_per_block=1.5, pings_per_block=100)
FULL = Plan(blocks=20, serial_per_block=1000, pipelined_s_per_block=5.0, pings_per_block=500)


@dataclass
class Samples:
    """Everything measured for one target."""

    serial_ns: list[int] = field(default_factory=list)
    daemon_ns: dict[str, list[int]] = field(default_factory=dict)  # timing_ns, serial requests
    ping_ns: list[int] = field(default_factory=list)
    pipelined_replies: int = 0
    pipelined_ok: int = 0
    pipelined_s: float = 0.0
    pipelined_ns: list[int] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    batch_sizes: Counter[int] = field(default_factory=Counter)  # pipelined replies
    cost: Counter[str] = field(default_factory=Counter)  # controller totals over its blocks
    load_averages: list[tuple[float, float, float]] = field(default_factory=list)


# --- the echo server (its own process) -----------------------------------------------------------


def echo(message: Any) -> Any:
    """The echo server's answers: InferRequest -> InferReply(same tensors), Ping -> Pong."""
    from clockwork_async.wire.messages import InferReply, InferRequest, Ping, Pong

    if isinstance(message, InferRequest):
        return InferReply(message.request_id, "ok", "", message.inputs)
    if isinstance(message, Ping):
        return Pong(message.seq, message.sent_ns, time.monotonic_ns())
    return None


def start_echo() -> tuple[subprocess.Popen[bytes], str]:
    """The echo server process and its address. Raises RuntimeError if it does not start."""
    return start_wire_server([sys.executable, "-m", "benchmarks.overhead", "--serve-echo"])


# --- measuring one target ------------------------------------------------------------------------


async def serial(client: AsyncClient, count: int, samples: Samples | None) -> None:
    """``count`` requests one at a time; records round trips when ``samples`` is given."""
    for _ in range(count):
        start_ns = time.perf_counter_ns()
        result = await client.infer(MODEL, INPUTS, slo_ms=SLO_MS)
        elapsed_ns = time.perf_counter_ns() - start_ns
        if samples is not None:
            samples.serial_ns.append(elapsed_ns)
            samples.statuses[result.status] += 1
            for key in DAEMON_TIMINGS:
                if key in result.timing_ns:
                    samples.daemon_ns.setdefault(key, []).append(result.timing_ns[key])


async def pings(client: AsyncClient, count: int, samples: Samples) -> None:
    for _ in range(count):
        samples.ping_ns.append(await client.ping())


async def pipelined(
    client: AsyncClient, in_flight: int, duration_s: float, samples: Samples
) -> None:
    """Keep ``in_flight`` requests outstanding for ``duration_s``; count the replies."""
    finished = asyncio.Event()
    outstanding = 0
    deadline_ns = time.perf_counter_ns() + round(duration_s * 1e9)

    def send() -> None:
        nonlocal outstanding
        sent_ns = time.perf_counter_ns()
        pending = client.start_infer(MODEL, INPUTS, slo_ms=SLO_MS)
        outstanding += 1
        pending.add_done_callback(lambda answer: answered(sent_ns, answer))

    def answered(sent_ns: int, answer: InferResult | ClientError) -> None:
        nonlocal outstanding
        now_ns = time.perf_counter_ns()
        outstanding -= 1
        samples.pipelined_replies += 1
        samples.pipelined_ns.append(now_ns - sent_ns)
        status = answer.status if isinstance(answer, InferResult) else "connection_closed"
        if isinstance(answer, InferResult):
            samples.batch_sizes[answer.batch_size] += 1
        samples.statuses[status] += 1
        samples.pipelined_ok += status == "ok"
        if now_ns < deadline_ns and not client.closed:
            send()
        elif outstanding == 0:
            finished.set()

    start = time.perf_counter()
    for _ in range(in_flight):
        send()
    await finished.wait()
    samples.pipelined_s += time.perf_counter() - start


# --- the daemon's own view -----------------------------------------------------------------------

COST_KEYS = ("core_ns_per_request", "driver_ns_per_request", "send_ns_per_request")


def cost_totals(stats: dict[str, Any]) -> Counter[str]:
    """Cumulative controller ns (core, driver, send) and the requests they were spent on."""
    submitted = int(stats.get("submitted", 0))
    totals: Counter[str] = Counter({"submitted": submitted})
    for key in COST_KEYS:
        totals[key.removesuffix("_per_request")] = round(float(stats.get(key, 0.0)) * submitted)
    return totals


def per_request_us(cost: Counter[str]) -> dict[str, float | None]:
    submitted = cost["submitted"]
    return {
        f"{key.removesuffix('_ns_per_request')}_us": (
            round(cost[key.removesuffix("_per_request")] / submitted / 1000, 1)
            if submitted
            else None
        )
        for key in COST_KEYS
    }


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_counters(pid: int) -> Counter[str]:
    """CPU time (µs, in clock ticks) and context switches of every thread of ``pid``, from
    /proc; empty once it is gone."""
    counters: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2]
                utime, stime = fields.split()[11:13]
                counters["cpu_us"] += (int(utime) + int(stime)) * 1_000_000 // CLOCK_TICKS_PER_S
                for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                        counters[key.removesuffix("_ctxt_switches")] += int(value)
    return counters


@dataclass
class Target:
    name: str
    client: AsyncClient
    before_block: Callable[[], None] = lambda: None
    after_block: Callable[[], None] = lambda: None
    is_daemon: bool = False
    samples: Samples = field(default_factory=Samples)
    # The daemon's and its executor's processes: their CPU and context switches are counted
    # over the serial blocks (what one request costs each side, whatever else the machine runs).
    processes: dict[str, int] = field(default_factory=dict)
    process_cost: dict[str, Counter[str]] = field(default_factory=dict)
    core_build: str = ""  # a daemon's `stats` build.core: "compiled" or "pure"

    async def block(self, plan: Plan, in_flight: int, phase: str) -> None:
        """One serial or pipelined block, with the daemon's cost counted around it."""
        self.before_block()
        before: Counter[str] = Counter()
        if self.is_daemon:
            stats = await self.client.stats()
            before = cost_totals(stats)
            self.core_build = stats.get("build", {}).get("core", "")
        self.samples.load_averages.append(load_average())
        if phase == "serial":
            counted = {name: process_counters(pid) for name, pid in self.processes.items()}
            await serial(self.client, plan.serial_per_block, self.samples)
            for name, pid in self.processes.items():
                spent = process_counters(pid) - counted[name]
                self.process_cost[name] = self.process_cost.get(name, Counter()) + spent
            await pings(self.client, plan.pings_per_block, self.samples)
        else:
            await pipelined(self.client, in_flight, plan.pipelined_s_per_block, self.samples)
        if self.is_daemon:
            self.samples.cost += cost_totals(await self.client.stats()) - before
        self.after_block()


async def measure(
    targets: list[Target], plan: Plan, in_flight: int, stats_client: AsyncClient
) -> dict[str, Any]:
    """Serial blocks (targets interleaved), then pipelined blocks; returns the daemon's loop
    lag after each phase."""
    for target in targets:
        await serial(target.client, plan.warmup, None)
    lag: dict[str, Any] = {}
    for phase in ("serial", "pipelined"):
        for index in range(plan.blocks):
            load = load_average()[0]
            print(f"  {phase} block {index + 1}/{plan.blocks} (load {load})", file=sys.stderr)
            for target in targets:
                await target.block(plan, in_flight, phase)
        lag[phase] = loop_lag_us((await stats_client.stats()).get("loop_lag", {}))
    return lag


def loop_lag_us(lag: dict[str, Any]) -> dict[str, Any]:
    """The driver's LagProbe stats in µs (its window: the last 600 probes, one per 100 ms)."""
    in_us = {
        k.removesuffix("_ns") + "_us": round(v / 1000, 1)
        for k, v in lag.items()
        if k.endswith("_ns")
    }
    return {**in_us, "samples": lag.get("samples")}


# --- the run -------------------------------------------------------------------------------------


def near_zero_executor(cpu: int) -> str:
    return f"""
[[executors]]
backend = "simulated"
cpus = [{cpu}]
page_bytes = 16777216
weights_bytes = 1073741824
slowdown = {SLOWDOWN}
"""


def start_daemon(
    folder: Path, *, busy_poll_us: float | None = None, python: str = sys.executable
) -> DaemonProcess:
    """The daemon as it configures itself, or with ``server.busy_poll_us`` set, run by
    ``python`` (another install's interpreter: the build to compare against)."""
    from clockwork_async.models.demo import build_tiny

    folder.mkdir(exist_ok=True)
    add_model(folder / "models", MODEL, build_tiny(0).SerializeToString())
    executor_cpu = max(os.sched_getaffinity(0))
    config = daemon_config(folder, near_zero_executor(executor_cpu))
    extra = {} if busy_poll_us is None else {BUSY_POLL_VARIABLE: str(busy_poll_us)}
    return DaemonProcess.start(folder, config, env=clean_environ(folder, extra), python=python)


async def run(
    plan: Plan, in_flight: int, flipped_variant: bool, folder: Path, before: str | None = None
) -> dict[str, Any]:
    echo_process, echo_address = start_echo()
    try:
        with contextlib.ExitStack() as stack:
            daemon = stack.enter_context(start_daemon(folder))
            no_poll = stack.enter_context(start_daemon(folder / "no-poll", busy_poll_us=0))
            others = {}
            if before is not None:
                others["daemon-before"] = stack.enter_context(
                    start_daemon(folder / "before", python=before)
                )
            result = await run_targets(
                plan, in_flight, flipped_variant, echo_address, daemon, no_poll, others
            )
            return {"daemon_controller_cpus": daemon.controller_cpus(), **result}
    finally:
        echo_process.kill()
        echo_process.wait()


async def flipped_target(daemon: DaemonProcess) -> Target:
    """The same daemon with its controller pinned the other way round for its blocks: pinned
    to the lowest CPU if it runs unpinned, unpinned (every CPU) if it pinned itself."""
    shipped = daemon.affinities()
    all_cpus = set(os.sched_getaffinity(0))
    pinned = len(daemon.controller_cpus()) == 1
    flipped = all_cpus if pinned else {min(all_cpus)}
    return Target(
        "daemon-unpinned" if pinned else "daemon-pinned",
        await AsyncClient.connect(daemon.api),
        before_block=lambda: daemon.pin(flipped),
        after_block=lambda: daemon.restore(shipped),
        is_daemon=True,
    )


async def run_targets(
    plan: Plan,
    in_flight: int,
    flipped_variant: bool,
    echo_address: str,
    daemon: DaemonProcess,
    no_poll: DaemonProcess,
    others: dict[str, DaemonProcess],
) -> dict[str, Any]:
    echo = await AsyncClient.connect(echo_address)
    targets = [Target("echo", echo)]
    daemons = {"daemon": daemon, "daemon-no-poll": no_poll, **others}
    for name, process in daemons.items():
        client = await AsyncClient.connect(process.api)
        targets.append(Target(name, client, is_daemon=True, processes=daemon_processes(process)))
    plain = targets[1].client
    if flipped_variant:
        targets.append(await flipped_target(daemon))
    try:
        lag = await measure(targets, plan, in_flight, plain)
        final_stats = await plain.stats()
    finally:
        for target in targets:
            await target.client.close()
    return report(targets, final_stats, lag, in_flight)


def daemon_processes(daemon: DaemonProcess) -> dict[str, int]:
    """The daemon's process and its one local executor's."""
    executors = children(daemon.pid)
    return {"daemon": daemon.pid, **({"executor": executors[0]} if len(executors) == 1 else {})}


def per_serial_request(target: Target) -> dict[str, dict[str, float]]:
    """CPU µs and voluntary/involuntary context switches per serial request, per process."""
    count = len(target.samples.serial_ns)
    return {
        name: {key: round(value / count, 2) for key, value in sorted(cost.items())}
        for name, cost in target.process_cost.items()
        if count
    }


def target_report(target: Target) -> dict[str, Any]:
    s = target.samples
    row: dict[str, Any] = {
        "serial_round_trip": summarize_ns(s.serial_ns),
        "api_ping": summarize_ns(s.ping_ns),
        "pipelined_rps": round(s.pipelined_replies / s.pipelined_s, 1) if s.pipelined_s else None,
        "pipelined_ok_rps": round(s.pipelined_ok / s.pipelined_s, 1) if s.pipelined_s else None,
        "pipelined_latency": summarize_ns(s.pipelined_ns),
        "statuses": dict(s.statuses),
        "load_average_1m": [min(a[0] for a in s.load_averages), max(a[0] for a in s.load_averages)],
    }
    if target.is_daemon:
        row["daemon_timing"] = {key: summarize_ns(v) for key, v in s.daemon_ns.items()}
        row["pipelined_batch_sizes"] = dict(sorted(s.batch_sizes.items()))
        row["controller_cost_per_request"] = per_request_us(s.cost)
        row["processes_per_serial_request"] = per_serial_request(target)
        row["core_build"] = target.core_build
    return row


def report(
    targets: list[Target], final_stats: dict[str, Any], lag: dict[str, Any], in_flight: int
) -> dict[str, Any]:
    rows = {target.name: target_report(target) for target in targets}
    echo = rows["echo"]
    for name, row in rows.items():
        if name != "echo":
            row["serial_p50_over_echo"] = ratio(
                row["serial_round_trip"]["p50_us"], echo["serial_round_trip"]["p50_us"]
            )
            row["serial_p99_over_echo"] = ratio(
                row["serial_round_trip"]["p99_us"], echo["serial_round_trip"]["p99_us"]
            )
            row["pipelined_over_echo"] = ratio(row["pipelined_ok_rps"], echo["pipelined_rps"])
    return {
        "benchmark": "overhead",
        "model": f"tiny-sim x {SLOWDOWN} (b1 {500 * SLOWDOWN:g} µs)",
        "in_flight": in_flight,
        "targets": rows,
        "daemon_loop_lag_us": lag,
        "daemon_prediction_errors": final_stats.get("prediction_errors"),
        "goals": {"serial_p50_over_echo_max": 3.0, "pipelined_over_echo_min": 0.25},
    }


def print_report(result: dict[str, Any]) -> None:
    headers = [
        "target",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "x echo p50",
        "ping p50",
        "pipe rps",
        "pipe ok rps",
        "x echo rps",
        "load 1m",
    ]
    rows = []
    for name, row in result["targets"].items():
        rt, ping = row["serial_round_trip"], row["api_ping"]
        rows.append(
            [
                name,
                rt["p50_us"],
                rt["p99_us"],
                rt["p999_us"],
                row.get("serial_p50_over_echo"),
                ping["p50_us"],
                row["pipelined_rps"],
                row["pipelined_ok_rps"],
                row.get("pipelined_over_echo"),
                "-".join(map(str, row["load_average_1m"])),
            ]
        )
    print(table(headers, rows))
    print(
        f"\nin flight when pipelined: {result['in_flight']}; goals: p50 <= 3x echo, "
        "pipelined ok rps >= 0.25x echo"
    )
    for name, row in result["targets"].items():
        if "controller_cost_per_request" in row:
            cost = row["controller_cost_per_request"]
            timing = {
                k: (v.get("p50_us"), v.get("p99_us")) for k, v in row["daemon_timing"].items()
            }
            print(
                f"{name}: controller per request (µs) {cost}; daemon timing of serial requests "
                f"(p50, p99 µs) {timing}; pipelined batch sizes {row['pipelined_batch_sizes']}; "
                f"statuses {row['statuses']}; per serial request (CPU µs, context switches) "
                f"{row['processes_per_serial_request']}"
            )
    for phase, lag in result["daemon_loop_lag_us"].items():
        print(f"daemon loop lag after the {phase} phase (ready-callback wait, µs): {lag}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="a smoke run (about a minute)")
    parser.add_argument("--pipeline", type=int, default=32, help="requests in flight")
    parser.add_argument(
        "--no-flipped", action="store_true", help="skip the daemon-(un)pinned target"
    )
    parser.add_argument(
        "--before",
        metavar="PYTHON",
        help="also measure a daemon run by this interpreter (another install) as daemon-before",
    )
    parser.add_argument("--json", type=Path, help="default: results/overhead.json")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_echo:
        run_uvloop(serve_wire("echo", echo))
        return 0
    plan = QUICK if args.quick else FULL
    machine = machine_description()
    json_path = RESULTS / "overhead.json" if args.json is None else args.json
    with tempfile.TemporaryDirectory(prefix="clockwork-overhead-") as folder:
        try:
            flipped = not args.no_flipped
            result = run_uvloop(run(plan, args.pipeline, flipped, Path(folder), args.before))
        finally:
            keep_log(Path(folder) / "daemon.log", json_path.with_name("overhead-daemon.log"))
    result = {"quick": args.quick, "machine": machine, "plan": plan.__dict__, **result}
    result["load_average_after"] = load_average()
    print_report(result)
    path = write_report(json_path.stem, result, json_path.parent)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
