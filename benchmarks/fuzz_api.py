"""Fuzzing the client API and the Open Inference Protocol front ends (HTTP, gRPC) of the real
daemon while well-behaved clients measure their latency.

    python -m benchmarks.fuzz_api [--quick] [--frames N] [--connections K] [--seed S]
        [--v2-requests M] [--json OUT]

The daemon (``clockwork-async serve``, temporary config) serves ``tiny`` on one simulated
executor (the ``tiny-sim`` profile, 0.5-2 ms). A separate fuzzer process (this module with
``--fuzzer``) keeps ``K`` connections busy until it has sent ``N`` frames (default 10^6; quick
10^4): each connection sends a hello (or, now and then, a hostile opener), a run of well-typed
requests with odd values (unknown models, bad shapes, NaN and negative SLOs, duplicate ids,
cancels of unknown ids, pings, junk uploads), and then usually one hostile frame (truncated,
oversized or huge declared lengths, random bytes, bit flips, fields of the wrong type, unknown
or executor-side tags, deep nesting, tensors that disagree with dtype x shape, a second hello).
After a hostile frame it waits for the daemon to close the connection (5 s; then it
half-closes, counted as ``waited_for_more_bytes``: a frame the bit flips left incomplete);
otherwise it half-closes at once (the daemon answers what it has in flight, then closes). A
connection still open 30 s after the half-close counts as ``hung``. Frames come
from a seeded `random.Random`, so a run can be repeated.

The same fuzzer process fuzzes the v2 front ends at the same time (`benchmarks.fuzz_v2`): about
``M`` HTTP requests (default 30,000, about as long as 10^6 frames take; quick 2,000) over 4
connections at a time (odd infers answered on kept connections, then malformed JSON, binary
lengths that disagree, oversized and bad bodies and heads, random bytes, cut requests) and
about ``M`` gRPC calls and raw connections over 2 workers (odd and mangled ``ModelInfer``
messages, random bytes as messages, unknown methods, a message over the size limit now and
then; random bytes and broken HTTP/2 prefaces to the gRPC port). ``--v2-requests 0`` fuzzes
the msgpack API alone.

Meanwhile the well-behaved clients (this process: the msgpack client on its own connection,
``tritonclient`` over HTTP and gRPC) each send one infer at a time, 10 ms apart, before the
fuzzer starts, while it runs and after it ends.

Reported: crashes (goal 0: the daemon process still alive, ``health`` live and ready, no
executor restarted, and each v2 client served after the fuzzing), frames sent and their rate,
connections, errors the daemon sent by code, connections closed by the server with an error,
hung connections, the v2 fuzzers' counts by status, the well-behaved clients' statuses and
p50/p99 before / during / after, and the daemon's RSS (start, peak, end, and every 5 s with its
open descriptors). Writes ``results/fuzz_api.json``; the fuzzer prints its progress every
50,000 frames.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from benchmarks.fuzz_v2 import fuzz_grpc, fuzz_http, v2_clients
from benchmarks.lib import (
    RESULTS,
    keep_log,
    load_average,
    machine_description,
    run_uvloop,
    summarize_ns,
    table,
    write_report,
)
from benchmarks.overload import ProcSampler, start_daemon
from clockwork_async.client import AsyncClient, ClientError
from clockwork_async.testing import DaemonProcess

PREFIX = struct.Struct(">II")
PROGRESS_FRAMES = 50_000  # the fuzzer reports on stderr every this many frames
READ_TIMEOUT_S = 30.0
GOOD_PERIOD_S = 0.01
GOOD_SLO_MS = 100.0
FLOAT_ROW = np.arange(4, dtype=np.float32).tobytes()


# --- fuzzed frames (no I/O) ----------------------------------------------------------------------


def frame(header: dict[str, Any], tail: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(packed), len(tail)) + packed + tail


def hello(version: Any = 1, role: Any = "client") -> bytes:
    return frame({"t": "hello", "protocol_version": version, "role": role, "name": "fuzz"})


def infer(request_id: int, /, **changes: Any) -> bytes:
    """A ``tiny`` infer request (one row of 4 float32) with ``changes`` to its header; a
    ``tail`` change replaces the tail."""
    tail = changes.pop("tail", FLOAT_ROW)
    header = {
        "t": "infer_request",
        "request_id": request_id,
        "model": "tiny",
        "inputs": {"input": ["float32", [1, 4], 0, 16]},
        "slo_ms": 100.0,
        "deadline_unix_ns": None,
    }
    return frame({**header, **changes}, tail)


class FrameMaker:
    """Seeded fuzzed frames: ``odd`` ones are well-typed client requests (answered, the
    connection stays open); ``hostile`` ones should end the connection (or are cut short)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._odd: list[Callable[[int], bytes]] = [
            lambda i: infer(i, tail=self._floats()),
            lambda i: infer(i, model=self._name()),
            lambda i: infer(i, slo_ms=self.rng.choice([math.nan, -1.0, 0.0, math.inf, 1e300])),
            lambda i: infer(i, slo_ms=self.rng.uniform(0.001, 50.0)),
            lambda i: infer(i, deadline_unix_ns=self.rng.randrange(-(2**63), 2**63)),
            lambda i: infer(i, deadline_unix_ns=time.time_ns() + 10**8),  # and slo_ms: both
            lambda i: infer(i, inputs={"input": ["float32", [1, 3], 0, 12]}, tail=bytes(12)),
            lambda i: infer(i, inputs={"x": ["int8", [1, 4], 0, 4]}, tail=bytes(4)),
            lambda i: frame({"t": "cancel_infer", "request_id": self.rng.randrange(2**63)}),
            lambda i: frame({"t": "list_models", "request_id": i}),
            lambda i: frame({"t": "get_health", "request_id": i}),
            lambda i: frame({"t": "ping", "seq": i, "sent_ns": self.rng.randrange(2**63)}),
            lambda i: frame({"t": "remove_model", "request_id": i, "name": self._name()}),
        ]
        self._hostile: list[Callable[[], bytes]] = [
            self._truncated,
            self._oversized,
            self._random_bytes,
            self._bit_flips,
            self._wrong_type,
            self._unknown_tag,
            self._executor_side,
            self._deep,
            self._huge_length,
            self._tensor_mismatch,
            lambda: hello(),
        ]

    def opener(self) -> tuple[bool, bytes]:
        """(whether it is a valid hello, the first frame of a connection)."""
        draw = self.rng.random()
        if draw < 0.95:
            return True, hello()
        if draw < 0.97:
            return False, hello(version=self.rng.choice([0, 2, -1, 2**40, "1", None]))
        if draw < 0.98:
            return False, hello(role=self.rng.choice(["executor", "controller", "", 7]))
        return False, self._random_bytes()

    def odd(self) -> bytes:
        request_id = next(self._ids) if self.rng.random() > 0.02 else 1  # duplicates too
        if self.rng.random() < 0.002:
            return self._junk_upload(request_id)
        if self.rng.random() < 0.005:
            return frame({"t": "get_stats", "request_id": request_id})
        return self.rng.choice(self._odd)(request_id)

    # Odd values.

    def _floats(self) -> bytes:
        values = [self.rng.choice([0.0, -1e38, 1e38, math.nan, math.inf]) for _ in range(4)]
        return struct.pack("<4f", *values)

    def _name(self) -> str:
        letters = "abcdefghijklmnopqrstuvwxyz0123456789-_./\x00"
        size = self.rng.choice([0, 1, 8, 64, 65, 300])
        return "zz" + "".join(self.rng.choice(letters) for _ in range(size))

    def _junk_upload(self, request_id: int) -> bytes:
        junk = self.rng.randbytes(self.rng.randrange(1, 4096))
        files = {"model.onnx": ["uint8", [len(junk)], 0, len(junk)]}
        header = {"t": "add_model", "request_id": request_id, "name": self._name()}
        return frame({**header, "files": files, "model_toml": None}, junk)

    # Hostile frames.

    def _truncated(self) -> bytes:
        whole = self.odd()
        return whole[: self.rng.randrange(1, len(whole))]

    def _oversized(self) -> bytes:
        header_len = self.rng.choice([(1 << 20) + 1, 2**32 - 1, 5])
        tail_len = self.rng.choice([(64 << 20) + 1, 2**32 - 1]) if header_len == 5 else 0
        return PREFIX.pack(header_len, tail_len) + self.rng.randbytes(16)

    def _random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(1, 200))

    def _bit_flips(self) -> bytes:
        data = bytearray(self.odd())
        for _ in range(self.rng.randrange(1, 5)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def _wrong_type(self) -> bytes:
        key = self.rng.choice(["request_id", "model", "inputs", "slo_ms", "bogus"])
        value = self.rng.choice([None, True, -1, 2**64 - 1, 1.5, "x", b"x", [1], {"a": 1}])
        return infer(next(self._ids), **{key: value})

    def _unknown_tag(self) -> bytes:
        tag = self.rng.choice(["", "infer", "Infer_request", "x" * 100, 1, None])
        return frame({"t": tag, "request_id": 1})

    def _executor_side(self) -> bytes:
        load = {"t": "load", "action_id": 1, "model": "tiny", "earliest_ns": 0, "latest_ns": 1}
        pong = {"t": "pong", "seq": 1, "sent_ns": 1, "peer_ns": 1}
        return frame(self.rng.choice([load, pong, {"t": "get_state", "action_id": 1}]))

    def _deep(self) -> bytes:
        body = b"\x82\xa1t\xablist_models\xaarequest_id" + b"\x91" * 3000 + b"\x01"
        return PREFIX.pack(len(body), 0) + body

    def _huge_length(self) -> bytes:
        marker = self.rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf"])
        body = b"\x82\xa1t\xablist_models\xaarequest_id" + marker + b"\xff\xff\xff\xf0"
        return PREFIX.pack(len(body), 0) + body

    def _tensor_mismatch(self) -> bytes:
        dtype = self.rng.choice(["float32", "float64", "int8", "complex64", "object"])
        shape = [self.rng.choice([1, 4, 2**40, -1]) for _ in range(self.rng.randrange(0, 4))]
        nbytes = self.rng.choice([0, 15, 16, 17, 2**63])
        offset = self.rng.choice([0, 8, 2**32])
        return infer(next(self._ids), inputs={"input": [dtype, shape, offset, nbytes]})

    def connection(self) -> tuple[list[bytes], bool]:
        """The frames of one connection, and whether the daemon should close it (after a
        frame it cannot take) rather than wait for more bytes."""
        valid, first = self.opener()
        if not valid:
            return [first], True
        frames = [first, *(self.odd() for _ in range(self.rng.randrange(0, 200)))]
        if self.rng.random() < 0.1:
            return frames, False
        hostile = self.rng.choice(self._hostile)
        return [*frames, hostile()], hostile is not self._truncated


# --- the fuzzer process --------------------------------------------------------------------------


async def read_until_closed(reader: asyncio.StreamReader, counts: Counter[str]) -> None:
    """Read frames until end of input, counting their tags and error codes."""
    while True:
        prefix = await reader.readexactly(PREFIX.size)
        header_len, tail_len = PREFIX.unpack(prefix)
        header = msgpack.unpackb(await reader.readexactly(header_len), raw=False)
        if tail_len:
            await reader.readexactly(tail_len)
        counts[f"tag:{header.get('t')}"] += 1
        if header.get("t") == "error":
            counts[f"error:{header.get('code')}"] += 1


async def one_connection(
    address: str, frames: list[bytes], expect_close: bool, counts: Counter[str]
) -> None:
    """Send ``frames`` and read until the daemon closes. Where it should close by itself
    (``expect_close``) it gets 5 s to; otherwise, or after that, this side half-closes and
    waits READ_TIMEOUT_S more before counting the connection as hung."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    counts["connections"] += 1
    reading = asyncio.ensure_future(read_until_closed(reader, counts))
    try:
        writer.writelines(frames)
        await writer.drain()
        if not expect_close or not await _ended(reading, 5.0, counts):
            counts["half_closed" if not expect_close else "waited_for_more_bytes"] += 1
            writer.write_eof()
            if not await _ended(reading, READ_TIMEOUT_S, counts):
                counts["hung"] += 1
    except (ConnectionError, OSError):
        counts["closed_while_sending"] += 1
        await _ended(reading, READ_TIMEOUT_S, counts)
    finally:
        reading.cancel()
        writer.close()


async def _ended(reading: asyncio.Future[None], timeout_s: float, counts: Counter[str]) -> bool:
    """Whether the daemon closed the connection within ``timeout_s`` (counted by how)."""
    try:
        await asyncio.wait_for(asyncio.shield(reading), timeout_s)
    except TimeoutError:
        return False
    except asyncio.IncompleteReadError as end:
        counts["closed_mid_frame" if end.partial else "closed_by_server"] += 1
    except (ConnectionError, OSError):
        counts["reset_by_server"] += 1
    return True


def progress(before: int, now: int, total: int, start: float, counts: Counter[str]) -> None:
    """Print a line on stderr each time the frames sent pass a multiple of PROGRESS_FRAMES."""
    if now // PROGRESS_FRAMES > before // PROGRESS_FRAMES:
        rate = now / (time.monotonic() - start)
        line = f"  fuzzer: {now}/{total} frames ({rate:.0f}/s), hung {counts['hung']}"
        print(line, file=sys.stderr, flush=True)


async def fuzz(address: str, total_frames: int, connections: int, seed: int) -> dict[str, Any]:
    """Send ``total_frames`` over ``connections`` concurrent connections; returns counts."""
    counts: Counter[str] = Counter()
    makers = [FrameMaker(seed * 1000 + k) for k in range(connections)]
    state = {"frames": 0}
    start = time.monotonic()

    async def worker(maker: FrameMaker) -> None:
        while state["frames"] < total_frames:
            frames, expect_close = maker.connection()
            if len(frames) > total_frames - state["frames"]:
                frames, expect_close = frames[: total_frames - state["frames"]], False
            state["frames"] += len(frames)
            counts["bytes"] += sum(len(f) for f in frames)
            progress(state["frames"] - len(frames), state["frames"], total_frames, start, counts)
            try:
                await one_connection(address, frames, expect_close, counts)
            except OSError:
                counts["connect_failed"] += 1

    await asyncio.gather(*(worker(m) for m in makers))
    elapsed_s = time.monotonic() - start
    return {
        "frames": state["frames"],
        "seconds": round(elapsed_s, 2),
        "frames_per_s": round(state["frames"] / elapsed_s, 1),
        "counts": dict(sorted(counts.items())),
    }


async def fuzz_all(args: argparse.Namespace) -> dict[str, Any]:
    """The fuzzer process's work: the msgpack API, and the v2 front ends at the same time."""
    work = {"msgpack": fuzz(args.fuzzer, args.frames, args.connections, args.seed)}
    if args.v2_requests and args.fuzz_http and args.fuzz_http != "off":
        work["http"] = fuzz_http(args.fuzz_http, args.v2_requests, 4, args.seed)
    if args.v2_requests and args.fuzz_grpc and args.fuzz_grpc != "off":
        work["grpc"] = fuzz_grpc(args.fuzz_grpc, args.v2_requests, 2, args.seed)
    results = await asyncio.gather(*work.values())
    return dict(zip(work, results, strict=True))


# --- the well-behaved client and the run ---------------------------------------------------------


async def good_client(
    client: AsyncClient, until: asyncio.Event, log: list[tuple[str, int]]
) -> None:
    """Serial infers, ``GOOD_PERIOD_S`` apart, until ``until`` is set; appends (status,
    latency_ns) to ``log``."""
    row = {"input": np.ones((1, 4), np.float32)}
    while not until.is_set():
        start = time.perf_counter_ns()
        try:
            result = await client.infer("tiny", row, slo_ms=GOOD_SLO_MS)
            log.append((result.status, time.perf_counter_ns() - start))
        except ClientError as error:
            log.append((type(error).__name__, time.perf_counter_ns() - start))
            return
        await asyncio.sleep(GOOD_PERIOD_S)


async def timed_phase(
    client: AsyncClient, seconds: float | None, work: Any = None, v2: dict[str, Any] | None = None
) -> tuple[dict[str, list[tuple[str, int]]], Any]:
    """The good clients' logs (``msgpack`` and each of ``v2``'s calls) while ``seconds``
    pass or ``work`` (an awaitable) finishes."""
    logs: dict[str, list[tuple[str, int]]] = {"msgpack": []}
    until = asyncio.Event()
    measuring = [asyncio.create_task(good_client(client, until, logs["msgpack"]))]
    for name, call in (v2 or {}).items():
        logs[name] = []
        measuring.append(asyncio.create_task(good_loop(call, until, logs[name])))
    result = await (work if work is not None else asyncio.sleep(seconds or 0))
    until.set()
    await asyncio.gather(*measuring)
    return logs, result


async def run_fuzzer_process(
    address: str, frames: int, connections: int, seed: int, v2: tuple[str, str, int]
) -> Any:
    """The fuzzer process: ``v2`` = (HTTP address, gRPC address, requests to each)."""
    argv = ["-m", "benchmarks.fuzz_api", "--fuzzer", address, "--frames", str(frames)]
    argv += ["--connections", str(connections), "--seed", str(seed)]
    argv += ["--fuzz-http", v2[0], "--fuzz-grpc", v2[1], "--v2-requests", str(v2[2])]
    process = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the fuzzer failed with status {process.returncode}")
    return json.loads(out)


async def good_loop(
    call: Callable[[], Any], until: asyncio.Event, log: list[tuple[str, int]]
) -> None:
    """`good_client` for a v2 client: ``call()`` returns a status."""
    while not until.is_set():
        start = time.perf_counter_ns()
        try:
            status = await call()
        except Exception as error:  # the client's own failure (a reset, say) is a status too
            status = f"exception:{type(error).__name__}"
        log.append((status, time.perf_counter_ns() - start))
        await asyncio.sleep(GOOD_PERIOD_S)


def good_summary(log: list[tuple[str, int]]) -> dict[str, Any]:
    statuses = Counter(status for status, _ in log)
    return {
        "statuses": dict(statuses),
        "latency": summarize_ns(ns for status, ns in log if status == "ok"),
    }


async def session(daemon: DaemonProcess, args: argparse.Namespace) -> dict[str, Any]:
    address = daemon.api
    sampler = ProcSampler(daemon.pid, 0.25)
    sampling = asyncio.create_task(sampler.run())
    v2, close_v2 = await v2_clients(daemon.http, daemon.grpc) if args.v2_requests else ({}, None)
    try:
        async with await AsyncClient.connect(address) as client:
            before, _ = await timed_phase(client, args.before_s, v2=v2)
            fuzzing = run_fuzzer_process(
                address,
                args.frames,
                args.connections,
                args.seed,
                (daemon.http, daemon.grpc, args.v2_requests),
            )
            during, fuzzed = await timed_phase(client, None, fuzzing, v2)
            after, _ = await timed_phase(client, args.after_s, v2=v2)
        async with await AsyncClient.connect(address) as checker:
            health, stats = await checker.health(), await checker.stats()
    finally:
        sampling.cancel()
        if close_v2 is not None:
            await close_v2()
    phases = {"before": before, "during": during, "after": after}
    return {
        "fuzzer": fuzzed["msgpack"],
        "fuzzer_v2": {k: v for k, v in fuzzed.items() if k != "msgpack"},
        "good_client": {phase: good_summary(logs["msgpack"]) for phase, logs in phases.items()},
        "good_client_v2": {
            name: {phase: good_summary(logs[name]) for phase, logs in phases.items()} for name in v2
        },
        "health": {"live": health.live, "ready": health.ready, "reason": health.reason},
        "executor_restarts": sum(e["restarts"] for e in stats["executors"]),
        "api": stats["api"],
        "daemon_rss_mib": {
            "start": sampler.samples[0]["daemon_rss_mib"],
            "peak": sampler.peak("daemon_rss_mib"),
            "end": sampler.samples[-1]["daemon_rss_mib"],
        },
        # every 5 s: whether the daemon's memory grows with frames or levels off
        "daemon_rss_series": [
            (s["t_s"], round(s["daemon_rss_mib"], 2), s["daemon_fds"])
            for s in sampler.samples[::20]
        ],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="clockwork-fuzz-api-") as name:
        folder = Path(name)
        with start_daemon(folder, 1.0) as daemon:
            result = run_uvloop(session(daemon, args))
            result["daemon_alive"] = daemon.process.poll() is None
        keep_log(folder / "daemon.log", RESULTS / "fuzz_api-daemon.log")
    health = result["health"]
    crashed = not (result["daemon_alive"] and health["live"] and health["ready"])
    unserved = [
        name
        for name, phases in result["good_client_v2"].items()
        if not phases["after"]["statuses"].get("ok")
    ]
    result["v2_clients_unserved_after"] = unserved
    result["crashes"] = int(crashed) + result["executor_restarts"] + len(unserved)
    return result


def print_report(result: dict[str, Any]) -> None:
    fuzzer, counts = result["fuzzer"], result["fuzzer"]["counts"]
    errors = {k.removeprefix("error:"): v for k, v in counts.items() if k.startswith("error:")}
    print(
        f"crashes {result['crashes']} (goal 0); frames {fuzzer['frames']} in "
        f"{fuzzer['seconds']} s ({fuzzer['frames_per_s']}/s) over {counts.get('connections')} "
        f"connections; hung {counts.get('hung', 0)}; errors sent {errors}"
    )
    rows = []
    for phase, summary in result["good_client"].items():
        latency = summary["latency"]
        rows.append([phase, latency.get("n"), latency.get("p50_us"), latency.get("p99_us")])
        rows[-1].append(", ".join(f"{k} {v}" for k, v in summary["statuses"].items()))
    print(table(["good client", "n", "p50 µs", "p99 µs", "statuses"], rows))
    for name, fuzzed in result["fuzzer_v2"].items():
        print(f"{name} fuzzer: {fuzzed}")
    rows = []
    for name, phases in result["good_client_v2"].items():
        for phase, summary in phases.items():
            latency = summary["latency"]
            rows.append([f"{name} {phase}", latency.get("n"), latency.get("p50_us")])
            rows[-1] += [latency.get("p99_us")]
            rows[-1].append(", ".join(f"{k} {v}" for k, v in summary["statuses"].items()))
    if rows:
        print(table(["v2 good client", "n", "p50 µs", "p99 µs", "statuses"], rows))
    rss = result["daemon_rss_mib"]
    print(f"daemon RSS {rss['start']:.1f} -> peak {rss['peak']:.1f} -> {rss['end']:.1f} MiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_api", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="10^4 frames, short phases")
    parser.add_argument("--frames", type=int, help="frames to send (default 10^6; quick 10^4)")
    parser.add_argument("--connections", type=int, default=8, help="concurrent fuzz connections")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS / "fuzz_api.json")
    parser.add_argument(
        "--v2-requests",
        type=int,
        help="HTTP requests and gRPC calls to fuzz each v2 front end with (default 30,000; "
        "quick 2,000; 0: the msgpack API alone)",
    )
    parser.add_argument("--fuzzer", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--fuzz-http", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--fuzz-grpc", metavar="ADDRESS", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.frames is None:
        args.frames = 10_000 if args.quick else 1_000_000
    if args.v2_requests is None:
        args.v2_requests = 2_000 if args.quick else 30_000
    if args.fuzzer:  # the fuzzer process: JSON counts on stdout
        print(json.dumps(run_uvloop(fuzz_all(args))))
        return 0
    args.before_s, args.after_s = (5.0, 3.0) if args.quick else (20.0, 10.0)
    result: dict[str, Any] = {
        "benchmark": "fuzz_api",
        "quick": args.quick,
        "machine": machine_description(),
        "frames_asked": args.frames,
        "connections": args.connections,
        "seed": args.seed,
        **run(args),
        "load_average_after": load_average(),
    }
    print_report(result)
    path = write_report(args.json.stem, result, args.json.parent)
    print(f"wrote {path}")
    return 0 if result["crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
