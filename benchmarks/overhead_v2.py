"""The daemon's CPU per request by front end: msgpack, HTTP and gRPC (the Open Inference
Protocol), same daemon, same model, `benchmarks.overhead`'s near-zero executor.

    python -m benchmarks.overhead_v2 [--quick] [--in-flight N] [--before PYTHON] [--json OUT]

One daemon serves all three front ends; each is driven by its own client from this process
(msgpack: `clockwork_async.client.AsyncClient`; HTTP: ``tritonclient.http.aio``, JSON tensors
and binary ones; gRPC: ``tritonclient.grpc.aio``), in interleaved blocks so that the machine's
load hits each alike. Per block: ``serial`` requests one at a time, then ``concurrent`` ones
with N in flight. Measured per front end:

- the daemon's CPU per request (the number to compare): the CPU time of every thread of the
  daemon process (``/proc/PID/task/*/schedstat``, ns; the executor is another process) over
  the block, divided by its requests. The daemon runs with ``server.busy_poll_us = 0``: its
  polling after work burns CPU in proportion to the time between requests, which differs by
  client, not by front end;
- the client's round trip p50/p99 (serial) and its own CPU per request (this process's
  ``time.process_time`` over the block): clients differ and share the CPUs, so these are
  context, not the comparison.

``msgpack-conns`` is the msgpack API again with one connection per request in flight (as
HTTP/1.1 clients connect: one request at a time on each), a reference for the HTTP rows: over
one connection (``msgpack``, as gRPC's one channel) requests in flight arrive and are answered
in bursts, one read and one write for several, and the daemon's work per loop round (the
schedule, the sends to the executor) is shared by them; over one connection each, much less.

With ``--before PYTHON`` a second daemon, run by another install's interpreter (the build to
compare against), is driven the same way in the same blocks: its targets are named
``NAME-before`` and compared with its own msgpack API, so a before/after ratio comes from one
run, the machine's load hitting both alike.

Goal (issue 32): the standard front ends add at most 50% to the daemon's CPU per request over
the msgpack API's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tritonclient.grpc.aio as triton_grpc
import tritonclient.http.aio as triton_http

from benchmarks.lib import (
    RESULTS,
    load_average,
    machine_description,
    ratio,
    run_uvloop,
    summarize_ns,
    table,
    write_report,
)
from benchmarks.overhead import INPUTS, MODEL, SLO_MS, start_daemon
from clockwork_async.client import AsyncClient
from clockwork_async.testing import DaemonProcess

INPUT = INPUTS["input"]


@dataclass(frozen=True)
class Plan:
    blocks: int
    serial_per_block: int
    concurrent_per_block: int
    warmup: int = 100


QUICK = Plan(blocks=3, serial_per_block=200, concurrent_per_block=400)
FULL = Plan(blocks=10, serial_per_block=500, concurrent_per_block=2000)


@dataclass
class Samples:
    round_trip_ns: list[int] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=lambda: {"serial": 0, "concurrent": 0})
    daemon_cpu_ns: dict[str, int] = field(default_factory=lambda: {"serial": 0, "concurrent": 0})
    client_cpu_ns: dict[str, int] = field(default_factory=lambda: {"serial": 0, "concurrent": 0})
    wall_ns: dict[str, int] = field(default_factory=lambda: {"serial": 0, "concurrent": 0})
    concurrent_threads_ns: Counter[str] = field(default_factory=Counter)  # daemon CPU by thread


Infer = Callable[[], Awaitable[None]]


@dataclass
class Target:
    name: str
    infer: Infer
    close: Callable[[], Awaitable[None]]
    pid: int  # the daemon it drives
    samples: Samples = field(default_factory=Samples)


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far (ns, from the scheduler's statistics)."""
    return sum(thread_cpu_ns(pid).values())


def thread_cpu_ns(pid: int) -> Counter[str]:
    """CPU time so far (ns) of the threads of ``pid``, summed by thread name (``comm``): the
    event loop's thread carries the process's name, grpcio's and the lanes' their own."""
    spent: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            spent[name] += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return spent


async def targets_of(daemon: DaemonProcess, in_flight: int, suffix: str = "") -> list[Target]:
    msgpack = await AsyncClient.connect(daemon.api)

    async def msgpack_infer() -> None:
        result = await msgpack.infer(MODEL, INPUTS, slo_ms=SLO_MS)
        assert result.status == "ok", result.message

    idle = [await AsyncClient.connect(daemon.api) for _ in range(in_flight)]
    connections = list(idle)

    async def msgpack_conns_infer() -> None:  # a connection of its own while in flight
        client = idle.pop()
        try:
            result = await client.infer(MODEL, INPUTS, slo_ms=SLO_MS)
        finally:
            idle.append(client)
        assert result.status == "ok", result.message

    async def close_conns() -> None:
        for client in connections:
            await client.close()

    http = triton_http.InferenceServerClient(daemon.http)
    grpc = triton_grpc.InferenceServerClient(daemon.grpc)

    def http_infer(binary: bool) -> Infer:
        async def infer() -> None:
            tensor = triton_http.InferInput("input", [1, 4], "FP32")
            tensor.set_data_from_numpy(INPUT, binary_data=binary)
            output = triton_http.InferRequestedOutput("output", binary_data=binary)
            await http.infer(MODEL, [tensor], outputs=[output], parameters={"slo_ms": SLO_MS})

        return infer

    async def grpc_infer() -> None:
        tensor = triton_grpc.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(INPUT)
        await grpc.infer(MODEL, [tensor], parameters={"slo_ms": SLO_MS})

    async def nothing() -> None:
        return None

    return [
        Target(f"msgpack{suffix}", msgpack_infer, msgpack.close, daemon.pid),
        Target(f"msgpack-conns{suffix}", msgpack_conns_infer, close_conns, daemon.pid),
        Target(f"http-json{suffix}", http_infer(False), nothing, daemon.pid),
        Target(f"http-binary{suffix}", http_infer(True), http.close, daemon.pid),
        Target(f"grpc{suffix}", grpc_infer, grpc.close, daemon.pid),
    ]


async def block(target: Target, phase: str, count: int, in_flight: int) -> None:
    samples, pid = target.samples, target.pid
    threads_before, client_before = thread_cpu_ns(pid), time.process_time_ns()
    start_ns = time.perf_counter_ns()
    if phase == "serial":
        for _ in range(count):
            sent_ns = time.perf_counter_ns()
            await target.infer()
            samples.round_trip_ns.append(time.perf_counter_ns() - sent_ns)
    else:
        left = count

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await target.infer()

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    samples.wall_ns[phase] += time.perf_counter_ns() - start_ns
    threads = thread_cpu_ns(pid)
    threads.subtract(threads_before)
    samples.daemon_cpu_ns[phase] += sum(threads.values())
    if phase == "concurrent":
        samples.concurrent_threads_ns.update(threads)
    samples.client_cpu_ns[phase] += time.process_time_ns() - client_before
    samples.requests[phase] += count


async def run(plan: Plan, in_flight: int, folder: Path, before: str | None) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(start_daemon(folder, busy_poll_us=0))
        targets = await targets_of(daemon, in_flight)
        if before is not None:
            other = start_daemon(folder / "before", busy_poll_us=0, python=before)
            targets += await targets_of(stack.enter_context(other), in_flight, "-before")
        try:
            for target in targets:
                for _ in range(plan.warmup):
                    await target.infer()
            for phase, count in (
                ("serial", plan.serial_per_block),
                ("concurrent", plan.concurrent_per_block),
            ):
                for index in range(plan.blocks):
                    print(f"  {phase} block {index + 1}/{plan.blocks}", file=sys.stderr)
                    for target in targets:
                        await block(target, phase, count, in_flight)
        finally:
            for target in targets:
                await target.close()
    return report(targets, in_flight)


def report(targets: list[Target], in_flight: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for target in targets:
        s = target.samples
        row: dict[str, Any] = {"serial_round_trip": summarize_ns(s.round_trip_ns)}
        for phase in ("serial", "concurrent"):
            n = s.requests[phase]
            row[f"{phase}_daemon_cpu_us_per_request"] = round(s.daemon_cpu_ns[phase] / n / 1e3, 1)
            row[f"{phase}_client_cpu_us_per_request"] = round(s.client_cpu_ns[phase] / n / 1e3, 1)
            row[f"{phase}_rps"] = round(n / (s.wall_ns[phase] / 1e9), 1)
        n = s.requests["concurrent"]
        row["concurrent_daemon_cpu_us_per_request_by_thread"] = {
            name: round(ns / n / 1e3, 1) for name, ns in s.concurrent_threads_ns.most_common()
        }
        rows[target.name] = row
    for name, row in rows.items():
        suffix = "-before" if name.endswith("-before") else ""
        base, conns = rows[f"msgpack{suffix}"], rows[f"msgpack-conns{suffix}"]
        for phase in ("serial", "concurrent"):
            key = f"{phase}_daemon_cpu_us_per_request"
            row[f"{phase}_daemon_cpu_over_msgpack"] = ratio(row[key], base[key])
            row[f"{phase}_daemon_cpu_over_msgpack_conns"] = ratio(row[key], conns[key])
    return {
        "benchmark": "overhead_v2",
        "model": MODEL,
        "in_flight": in_flight,
        "targets": rows,
        "goals": {"daemon_cpu_over_msgpack_max": 1.5},
    }


def print_report(result: dict[str, Any]) -> None:
    headers = [
        "front end",
        "p50 µs",
        "p99 µs",
        "daemon µs/req serial",
        "x msgpack",
        "daemon µs/req conc.",
        "x msgpack",
        "x msgpack-conns",
        "client µs/req conc.",
        "conc. rps",
    ]
    rows = []
    for name, row in result["targets"].items():
        rt = row["serial_round_trip"]
        rows.append([
            name, rt["p50_us"], rt["p99_us"],
            row["serial_daemon_cpu_us_per_request"], row["serial_daemon_cpu_over_msgpack"],
            row["concurrent_daemon_cpu_us_per_request"], row["concurrent_daemon_cpu_over_msgpack"],
            row["concurrent_daemon_cpu_over_msgpack_conns"],
            row["concurrent_client_cpu_us_per_request"], row["concurrent_rps"],
        ])  # fmt: skip
    print(table(headers, rows))
    print(f"\nin flight when concurrent: {result['in_flight']}; goal: daemon CPU <= 1.5x msgpack")
    print("\ndaemon CPU µs per request by thread, concurrent:")
    for name, row in result["targets"].items():
        threads = row["concurrent_daemon_cpu_us_per_request_by_thread"]
        print(f"  {name}: " + ", ".join(f"{t} {us}" for t, us in threads.items() if us >= 1))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead_v2", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--in-flight", type=int, default=8, help="concurrent requests")
    parser.add_argument(
        "--before",
        metavar="PYTHON",
        help="also measure a daemon run by this interpreter (another install), as NAME-before",
    )
    parser.add_argument("--json", type=Path, help="default: results/overhead_v2.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = QUICK if args.quick else FULL
    json_path = RESULTS / "overhead_v2.json" if args.json is None else args.json
    machine = machine_description()
    with tempfile.TemporaryDirectory(prefix="clockwork-overhead-v2-") as folder:
        result = run_uvloop(run(plan, args.in_flight, Path(folder), args.before))
    result = {"quick": args.quick, "machine": machine, "plan": plan.__dict__, **result}
    result["load_average_after"] = load_average()
    print_report(result)
    print(f"\nwrote {write_report(json_path.stem, result, json_path.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
