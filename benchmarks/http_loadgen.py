"""An open-loop HTTP load generator for the peers of `benchmarks.peer_ray` and
`benchmarks.peer_mlserver`, run as a process of its own. It stays apart from
``clockwork-async bench`` (the one generator of every other benchmark) because it speaks HTTP,
not the daemon's client API: to Ray Serve's proxy, to MLServer, and to our daemon's Open
Inference Protocol front end alike; it shares bench's arrival schedule (`arrival_schedule`)
and the library's statistics.

    python -m benchmarks.http_loadgen --port P --model M.onnx --rate R --duration-s D
        --slo-ms S --seed K --out FILE.json [--host H] [--path /] [--max-connections N]
        [--protocol raw|v2-binary|v2-json]

Each request POSTs the model's one input row over HTTP/1.1 keep-alive connections, with the
header ``x-request-timeout-seconds: SLO`` (Ray Serve's per-request end-to-end timeout; other
servers ignore it), as (``--protocol``, `request_body`):
- ``raw`` (the default): the row's float32 bytes (``application/octet-stream``), raw back;
- ``v2-binary``: an Open Inference Protocol (KServe v2) infer request with the binary tensor
  data extension, as ``tritonclient`` sends large tensors: a JSON header
  (``Inference-Header-Content-Length`` bytes), then the row's bytes; outputs asked binary;
- ``v2-json``: the same request with the row as a flat JSON ``data`` list, JSON back.
Both v2 forms carry the SLO as Triton's ``timeout`` request parameter (µs), which our daemon
takes as the request's SLO; a server without SLOs ignores it. The same bytes go to every
server of a comparison: one body per run, built once.

Invariants:
- Same arrivals as ``clockwork-async bench``: `arrival_schedule` draws them exactly as the
  bench does for one model (a ``numpy`` generator seeded with ``--seed``, first the random
  input row of `cli_client.random_inputs`, then `sim.workloads.poisson`'s arrivals), so a
  bench and this generator with the same seed, rate and duration send the same input at the
  same offsets from their start.
- Open loop: a request leaves at its time whether or not earlier ones were answered; it goes
  on an idle connection, or a new one (up to ``--max-connections``, then it is ``not_sent``).
  Its send lag (how late it left against the schedule) is recorded. A request that would leave
  more than ``--max-lag-s`` late is not sent (``behind``): the generator fell behind (on these
  2 CPUs, because the server took the CPU it shares), and a run ends near its schedule's end.
- Every scheduled request is one row: ``ok`` (200 within the SLO, client clock), ``late`` (200
  after it), ``timeout`` (408, the server's timeout), ``http_<code>``, ``connection_closed``,
  ``not_sent``, ``behind`` or ``abandoned`` (no answer ``2 SLO + 50 ms`` after it was sent:
  its connection is closed). Latency runs from the moment the request was written to the
  socket to the end of its reply.
- `summarize_rows` turns rows (of this generator or of `ray_app`'s handle load) into the
  numbers `peer_ray` reports: a success counts as ``ok`` (the server's verdict, as our
  daemon's ``ok``), and ``late`` says how many of them the client got after the SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lib import percentiles_ms

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
PROTOCOLS = ("raw", "v2-binary", "v2-json")
# numpy dtype -> the Open Inference Protocol's datatype (the ones a demo model's input has)
V2_DATATYPES = {"float32": "FP32", "float64": "FP64", "int64": "INT64", "int32": "INT32"}
ABANDON_EXTRA_S = 0.05
YIELD_EVERY = 64  # sends in a row (when behind schedule) before letting replies in
HEADER_END = b"\r\n\r\n"


# --- the schedule --------------------------------------------------------------------------------


def model_input_specs(onnx_bytes: bytes) -> tuple[Any, ...]:
    """The input specs the daemon reports for these model bytes."""
    from clockwork_async.models.info import read_model_info

    return read_model_info("peer", onnx_bytes, None).inputs


def arrival_schedule(
    seed: int, rate_rps: float, duration_s: float, input_specs: Sequence[Any]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Send offsets (ns from the start, int64, ascending) and the input row, drawn as
    ``clockwork-async bench --model M --rate R --duration-s D --seed K`` draws them."""
    from clockwork_async.cli_client import random_inputs
    from clockwork_async.sim.workloads import poisson

    rng = np.random.default_rng(seed)
    inputs = random_inputs(tuple(input_specs), rng)
    pieces = [times for times, _ in poisson(1, rate_rps, duration_s).open_arrivals(rng)]
    offsets = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)
    return offsets, inputs


# --- HTTP/1.1 on asyncio -------------------------------------------------------------------------


class ReplyParser:
    """Incremental parser of HTTP/1.1 responses (Content-Length or chunked bodies)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bool]]:
        """Complete replies in ``data`` so far: (status code, server keeps the connection)."""
        self.buffer += data
        replies = []
        while (reply := self._one()) is not None:
            replies.append(reply)
        return replies

    def _one(self) -> tuple[int, bool] | None:
        end = self.buffer.find(HEADER_END)
        if end < 0:
            return None
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        body_start = end + len(HEADER_END)
        if headers.get("transfer-encoding") == "chunked":
            body_end = self._chunked_end(body_start)
        else:
            body_end = body_start + int(headers.get("content-length", "0"))
        if body_end is None or len(self.buffer) < body_end:
            return None
        del self.buffer[:body_end]
        return status, headers.get("connection") != "close"

    def _chunked_end(self, start: int) -> int | None:
        position = start
        while True:
            line_end = self.buffer.find(b"\r\n", position)
            if line_end < 0:
                return None
            size = int(bytes(self.buffer[position:line_end]).split(b";")[0], 16)
            position = line_end + 2 + size + 2
            if size == 0:
                return position if len(self.buffer) >= position else None


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = ReplyParser()
        self.transport: asyncio.Transport | None = None
        self.on_reply: Any = None  # called with a status string, once per request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, on_reply: Any) -> None:
        self.on_reply = on_reply
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        for status, keep in self.parser.feed(data):
            self._answer("ok" if status == 200 else f"http_{status}")
            if keep:
                self.pool.release(self)
            elif self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._answer("connection_closed")
        self.pool.forget(self)

    def abort(self) -> None:
        """Drop the request in flight: the connection cannot be reused."""
        self.on_reply = None
        if self.transport is not None:
            self.transport.abort()

    def _answer(self, status: str) -> None:
        callback, self.on_reply = self.on_reply, None
        if callback is not None:
            callback(status)


class Pool:
    """Idle connections to one server, opened on demand up to a cap."""

    def __init__(self, host: str, port: int, max_connections: int) -> None:
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.idle: collections.deque[Connection] = collections.deque()
        self.open = 0  # connected or connecting

    async def connect(self) -> Connection:
        self.open += 1
        try:
            transport, protocol = await asyncio.get_running_loop().create_connection(
                lambda: Connection(self), self.host, self.port
            )
        except OSError:
            self.open -= 1
            raise
        protocol.connection_made(transport)  # uvloop may call it only after this returns
        return protocol

    async def warm(self, count: int) -> None:
        """Open ``count`` connections before the run (connecting is not what is measured)."""
        opened = await asyncio.gather(*(self.connect() for _ in range(count)))
        self.idle.extend(opened)

    def release(self, connection: Connection) -> None:
        self.idle.append(connection)

    def forget(self, connection: Connection) -> None:
        self.open -= 1
        with contextlib.suppress(ValueError):  # not idle: it was carrying a request
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in list(self.idle):
            if connection.transport is not None:
                connection.transport.close()


# --- the load ------------------------------------------------------------------------------------


def request_body(
    protocol: str, name: str, row: np.ndarray, slo_ms: float
) -> tuple[bytes, dict[str, str]]:
    """The body of one request carrying input ``name`` = ``row`` (see the module doc), and its
    headers beyond the length."""
    if protocol == "raw":
        return row.tobytes(), {"Content-Type": "application/octet-stream"}
    tensor: dict[str, Any] = {
        "name": name,
        "shape": list(row.shape),
        "datatype": V2_DATATYPES[str(row.dtype)],
    }
    parameters: dict[str, Any] = {"timeout": max(1, round(slo_ms * 1000))}
    if protocol == "v2-json":
        tensor["data"] = row.ravel().tolist()
        request = {"parameters": parameters, "inputs": [tensor]}
        return json.dumps(request).encode(), {"Content-Type": "application/json"}
    if protocol != "v2-binary":
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    tensor["parameters"] = {"binary_data_size": row.nbytes}
    parameters["binary_data_output"] = True
    header = json.dumps({"parameters": parameters, "inputs": [tensor]}).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + row.tobytes(), headers


def request_bytes(
    host: str, port: int, path: str, body: bytes, slo_ms: float, headers: Mapping[str, str]
) -> bytes:
    """One POST of ``body`` with ``headers`` and the per-request timeout header set to the
    SLO."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{key}: {value}" for key, value in headers.items()]
    lines += [f"Content-Length: {len(body)}", f"x-request-timeout-seconds: {slo_ms / 1000:.6f}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


class HttpLoad:
    """Rows of one open-loop run (columns ``sent_ns``, ``lag_ns``, ``status``, ``latency_ns``)."""

    def __init__(self, pool: Pool, request: bytes, slo_ms: float) -> None:
        self.pool = pool
        self.request = request
        self.slo_ns = round(slo_ms * NS_PER_MS)
        self.abandon_s = 2 * slo_ms / 1000 + ABANDON_EXTRA_S
        self.columns: dict[str, list[Any]] = {
            "sent_ns": [],
            "lag_ns": [],
            "status": [],
            "latency_ns": [],
        }
        self.outstanding = 0
        self.idle = asyncio.Event()
        self.start_ns = 0

    def now_ns(self) -> int:
        return time.monotonic_ns() - self.start_ns

    async def run(self, offsets_ns: Sequence[int], max_lag_ns: int) -> None:
        self.start_ns = time.monotonic_ns()
        behind = 0
        for scheduled_ns in offsets_ns:
            delay_ns = scheduled_ns - self.now_ns()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / NS_PER_S)
                behind = 0
            elif -delay_ns > max_lag_ns:
                self.columns["status"][self._row(scheduled_ns)] = "behind"
                continue
            elif (behind := behind + 1) % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            self.start(scheduled_ns)
        if self.outstanding:
            await self.idle.wait()

    def start(self, scheduled_ns: int) -> None:
        index = self._row(scheduled_ns)
        if self.pool.idle:
            self._send(self.pool.idle.popleft(), index, scheduled_ns)
        elif self.pool.open < self.pool.max_connections:
            self._begin()
            asyncio.get_running_loop().create_task(self._connect_and_send(index, scheduled_ns))
        else:
            self.columns["status"][index] = "not_sent"

    def _row(self, scheduled_ns: int) -> int:
        index = len(self.columns["status"])
        self.columns["sent_ns"].append(scheduled_ns)
        self.columns["lag_ns"].append(0)
        self.columns["status"].append("abandoned")
        self.columns["latency_ns"].append(0)
        return index

    def _begin(self) -> None:
        self.outstanding += 1
        self.idle.clear()

    async def _connect_and_send(self, index: int, scheduled_ns: int) -> None:
        try:
            connection = await self.pool.connect()
        except OSError:
            self.columns["status"][index] = "connection_closed"
            self._end()
            return
        self._send(connection, index, scheduled_ns)
        self._end()  # after _send counted it again, so `idle` never flickers

    def _send(self, connection: Connection, index: int, scheduled_ns: int) -> None:
        sent_ns = self.now_ns()
        self.columns["sent_ns"][index] = sent_ns
        self.columns["lag_ns"][index] = max(0, sent_ns - scheduled_ns)
        self._begin()
        loop = asyncio.get_running_loop()
        abandon = loop.call_later(self.abandon_s, self._abandon, connection, index)

        def answered(status: str) -> None:
            abandon.cancel()
            latency_ns = self.now_ns() - sent_ns
            if status == "ok" and latency_ns > self.slo_ns:
                status = "late"
            self.columns["status"][index] = status
            self.columns["latency_ns"][index] = latency_ns
            self._end()

        connection.send(self.request, answered)

    def _abandon(self, connection: Connection, index: int) -> None:
        connection.abort()
        self.columns["status"][index] = "abandoned"
        self._end()

    def _end(self) -> None:
        self.outstanding -= 1
        if not self.outstanding:
            self.idle.set()


def warm_connections(rate_rps: float, slo_ms: float, max_connections: int) -> int:
    """Connections to open before the run: what the rate keeps in flight for one SLO, x1.5."""
    return max(4, min(max_connections, math.ceil(1.5 * rate_rps * slo_ms / 1000) + 4))


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    onnx_bytes = Path(args.model).read_bytes()
    offsets_ns, inputs = arrival_schedule(
        args.seed, args.rate, args.duration_s, model_input_specs(onnx_bytes)
    )
    ((name, row),) = inputs.items()
    body, headers = request_body(args.protocol, name, row, args.slo_ms)
    request = request_bytes(args.host, args.port, args.path, body, args.slo_ms, headers)
    pool = Pool(args.host, args.port, args.max_connections)
    warm = warm_connections(args.rate, args.slo_ms, args.max_connections)
    await pool.warm(warm)
    load = HttpLoad(pool, request, args.slo_ms)
    await load.run(offsets_ns.tolist(), round(args.max_lag_s * NS_PER_S))
    wall_s = load.now_ns() / NS_PER_S
    pool.close()
    return {
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "slo_ms": args.slo_ms,
        "seed": args.seed,
        "protocol": args.protocol,
        "path": args.path,
        "request_bytes": len(request),
        "warm_connections": warm,
        "max_connections": args.max_connections,
        "max_lag_s": args.max_lag_s,
        "wall_s": round(wall_s, 3),
        "rows": load.columns,
    }


# --- the generator as a process (the caller's side) ----------------------------------------------


def run_process(
    port: int,
    model: Path,
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    seed: int,
    out: Path,
    *,
    cpus: set[int],
    nice: int,
    path: str = "/",
    protocol: str = "raw",
    max_lag_s: float = 1.0,
) -> dict[str, Any]:
    """One run of this generator as a process pinned to ``cpus`` at ``nice``, against
    ``127.0.0.1:port``; returns its JSON (rows and settings). Raises RuntimeError if it wrote
    nothing."""
    argv = [sys.executable, "-m", "benchmarks.http_loadgen", "--port", str(port)]
    argv += ["--model", str(model), "--rate", f"{rate_rps:.3f}", "--duration-s", str(duration_s)]
    argv += ["--slo-ms", str(slo_ms), "--seed", str(seed), "--out", str(out)]
    argv += ["--max-lag-s", str(max_lag_s), "--path", path, "--protocol", protocol]

    def pin() -> None:  # in the child, before exec
        os.sched_setaffinity(0, cpus)
        os.nice(nice)

    done = subprocess.run(
        argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL, preexec_fn=pin
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"http_loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# --- summaries -----------------------------------------------------------------------------------


def summarize_rows(rows: Mapping[str, Sequence[Any]], duration_s: float) -> dict[str, Any]:
    """Outcomes, goodput, ok share, latency and send lag of some rows. ``ok`` counts every
    success the server gave (``ok`` and ``late`` rows: Ray's proxy answers 408 once a request
    passes its timeout, so a 200 is its verdict of "in time", as ``ok`` is our daemon's);
    ``late`` = those the client received after the SLO; ``*_client`` counts only the rest."""
    statuses = collections.Counter(rows["status"])
    requests = len(rows["status"])
    in_time = statuses.get("ok", 0)
    late = statuses.get("late", 0)
    ok = in_time + late
    by_status = list(zip(rows["status"], rows["latency_ns"], strict=True))
    unsent = ("not_sent", "behind")
    sent = [lag for lag, s in zip(rows["lag_ns"], rows["status"], strict=True) if s not in unsent]
    return {
        "requests": requests,
        "statuses": dict(sorted(statuses.items())),
        "ok": ok,
        "late": late,
        "ok_share": round(ok / requests, 5) if requests else None,
        "goodput_rps": round(ok / duration_s, 2),
        "ok_share_client": round(in_time / requests, 5) if requests else None,
        "goodput_client_rps": round(in_time / duration_s, 2),
        "offered_rps": round(requests / duration_s, 2),
        "latency_ms": percentiles_ms([lat for s, lat in by_status if s in ("ok", "late")]),
        "send_lag_ms": percentiles_ms(sent),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.http_loadgen", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="raw", help="the body's form")
    parser.add_argument("--model", type=Path, required=True, help="the served ONNX file")
    parser.add_argument("--rate", type=float, required=True, help="Poisson requests/s")
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--slo-ms", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument(
        "--max-lag-s",
        type=float,
        default=1.0,
        help="a request this late against its schedule is not sent (status behind)",
    )
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from benchmarks.lib import run_uvloop

    result = run_uvloop(run_load(args))
    result["summary"] = summarize_rows(result["rows"], args.duration_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
