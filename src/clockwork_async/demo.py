"""`clockwork-async demo`: one ONNX Runtime executor driven by hand, without the daemon.

It generates the demo models into the cache folder, starts one executor subprocess pinned to
a core, registers ``resnet-like``, LOADs it, runs a few INFERs on random inputs inside time
windows, prints the outputs' shapes and the executor's measured timings, UNLOADs, and stops
the executor with SIGTERM: a look at the executor protocol, with measured timings.

The pieces are reused, by ``benchmarks/executor.py`` and the executor tests:
`start_executor` (a process that printed ``ready ADDRESS``; `ExecutorProcess.stop` leaves no
process behind), `spawn_executor` (the same for asyncio callers) and `ExecutorSession` (a small
pipelining controller side: one future per action id, NTP-style clock offset from pings,
connection-level errors kept).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clockwork_async.connection import Connection, ConnectionClosed
from clockwork_async.endpoints import open_connection
from clockwork_async.wire.dtypes import batch_shape, random_values
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ExecutorInfo,
    GetState,
    Hello,
    Infer,
    Load,
    Message,
    ModelInfo,
    Ping,
    Pong,
    RegisterModel,
    Role,
    TensorSpec,
    Unload,
)

NEVER_NS = 2**63 - 1
MS_NS = 1_000_000
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
REPLY_TIMEOUT_S = 60.0


class DemoError(RuntimeError):
    """The executor did not start, refused us, or answered an action with an error."""


# --- the executor process -------------------------------------------------------------------


def executor_command(args: Sequence[str]) -> list[str]:
    """The command line of ``clockwork-async executor ARGS`` in this Python."""
    return [sys.executable, "-m", "clockwork_async.executors.main", *args]


@dataclass
class ExecutorProcess:
    """An executor subprocess that printed ``ready ADDRESS``."""

    process: subprocess.Popen[bytes]
    address: str

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send ``signum`` and wait (SIGKILL after ``timeout_s``). Returns the exit status
        (negative: killed by that signal)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


def start_executor(args: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> ExecutorProcess:
    """Start ``clockwork-async executor ARGS`` and wait (blocking) for its ``ready`` line.
    Raises DemoError (after killing it) if it does not get there in ``timeout_s``."""
    process = subprocess.Popen(
        executor_command(args), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    text = _read_line(process, timeout_s).decode(errors="replace").strip()
    if not text.startswith("ready "):
        process.kill()
        status = process.wait()
        assert process.stdout is not None
        process.stdout.close()
        raise DemoError(f"executor {list(args)} did not start (exit {status}, said {text!r})")
    return ExecutorProcess(process, text.removeprefix("ready "))


def _read_line(process: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """One line of the process's stdout; b'' on exit or timeout."""
    assert process.stdout is not None
    fd, line, deadline = process.stdout.fileno(), b"", time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0 or not select.select([fd], [], [], remaining_s)[0]:
            return b""
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        line += chunk
    return line


@dataclass
class SpawnedExecutor:
    """`ExecutorProcess` for asyncio callers: waiting happens in a worker thread."""

    executor: ExecutorProcess

    @property
    def address(self) -> str:
        return self.executor.address

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.executor.process

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout_s``). Returns the exit status."""
        return await asyncio.to_thread(self.executor.stop, signal.SIGTERM, timeout_s)


async def spawn_executor(args: Sequence[str]) -> SpawnedExecutor:
    """`start_executor` without blocking the event loop. Raises DemoError."""
    return SpawnedExecutor(await asyncio.to_thread(start_executor, args))


# --- a small controller side ------------------------------------------------------------------


@dataclass
class ExecutorSession:
    """A handshaken connection to one executor; replies are matched by action id, pongs by
    sequence number; connection-level `Error`s are kept in ``errors``."""

    conn: Connection
    info: ExecutorInfo
    offset_ns: int = 0  # executor clock - our clock (see `sync_clock`)
    errors: list[Error] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set once the reader ended
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[Message]] = field(default_factory=dict)
    _pongs: dict[int, asyncio.Future[tuple[Pong, int]]] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, address: str, token: str = "", name: str = "demo", timeout_s: float = 20.0
    ) -> ExecutorSession:
        """Connect and handshake. Raises DemoError if the executor refuses, OSError if
        nothing listens there, TimeoutError, ConnectionClosed."""
        hello = Hello(PROTOCOL_VERSION, Role.CONTROLLER.value, name, token)
        conn, first = await say_hello(address, hello, timeout_s)
        if not isinstance(first, Hello) or first.role != Role.EXECUTOR:
            conn.close()
            raise DemoError(f"the executor refused the connection: {first!r}")
        info = await asyncio.wait_for(conn.recv(), timeout_s)
        if not isinstance(info, ExecutorInfo):
            conn.close()
            raise DemoError(f"expected executor_info after the hello, got {info!r}")
        session = cls(conn, info)
        session._reader = asyncio.get_running_loop().create_task(session._read())
        return session

    async def _read(self) -> None:
        try:
            async for message in self.conn:
                self._dispatch(message)
        except ConnectionClosed:
            pass
        finally:
            self.closed.set()

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Pong):
            pong = self._pongs.pop(message.seq, None)
            if pong is not None and not pong.done():
                pong.set_result((message, time.monotonic_ns()))
        elif isinstance(message, Error):
            self.errors.append(message)
        else:
            waiter = self._waiting.pop(getattr(message, "action_id", -1), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)

    def send(self, make: Callable[[int], Message]) -> asyncio.Future[Message]:
        """Send ``make(action_id)``; the future resolves with its one reply."""
        action_id = next(self._ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[action_id] = future
        self.conn.send(make(action_id))
        return future

    async def call(
        self, make: Callable[[int], Message], timeout_s: float = REPLY_TIMEOUT_S
    ) -> Message:
        """The one reply to ``make(action_id)``. Raises TimeoutError."""
        return await asyncio.wait_for(self.send(make), timeout_s)

    async def action(self, make: Callable[[int], Message]) -> ActionResult:
        """The ActionResult of one action, whatever its code. Raises DemoError for another
        kind of reply."""
        reply = await self.call(make)
        if not isinstance(reply, ActionResult):
            raise DemoError(f"expected an action_result, got {reply!r}")
        return reply

    async def result(self, make: Callable[[int], Message]) -> ActionResult:
        """The ActionResult of one action that succeeded. Raises DemoError otherwise."""
        reply = await self.action(make)
        if not reply.ok:
            raise DemoError(f"action failed: {reply!r}")
        return reply

    async def register(self, model: str, path: str) -> ModelInfo:
        reply = await self.call(lambda i: RegisterModel(i, model, path))
        if not isinstance(reply, ModelInfo):
            raise DemoError(f"registering {model!r} failed: {reply!r}")
        return reply

    async def ping(self, samples: int = 20) -> tuple[int, int]:
        """``(offset_ns, round_trip_ns)`` of the sample with the smallest round trip (NTP
        style: the offset is off by at most half that round trip)."""
        best: tuple[int, int] | None = None
        for seq in range(samples):
            future: asyncio.Future[tuple[Pong, int]] = asyncio.get_running_loop().create_future()
            self._pongs[seq] = future
            self.conn.send(Ping(seq, time.monotonic_ns()))
            pong, arrived_ns = await asyncio.wait_for(future, 10.0)
            round_trip_ns = arrived_ns - pong.sent_ns
            offset_ns = pong.peer_ns - (pong.sent_ns + arrived_ns) // 2
            if best is None or round_trip_ns < best[1]:
                best = (offset_ns, round_trip_ns)
        assert best is not None
        return best

    async def sync_clock(self, samples: int = 32) -> int:
        """Estimate the executor's clock offset with `ping`; store and return it."""
        self.offset_ns, _ = await self.ping(samples)
        return self.offset_ns

    def executor_now_ns(self) -> int:
        return time.monotonic_ns() + self.offset_ns

    async def close(self) -> None:
        self.conn.close()
        await self.conn.wait_closed()
        if self._reader is not None:
            await self._reader


async def say_hello(
    address: str, hello: Hello, timeout_s: float = 20.0
) -> tuple[Connection, Message]:
    """Connect, send ``hello``, return the connection and the first message back. Raises
    OSError, TimeoutError."""
    conn = await open_connection(address)
    conn.send(hello)
    try:
        return conn, await asyncio.wait_for(conn.recv(), timeout_s)
    except BaseException:
        conn.abort()
        raise


# --- the demo -------------------------------------------------------------------------------


def random_inputs(
    specs: Sequence[TensorSpec], batch_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded random inputs for ``specs`` (leading -1 = the batch, other -1 = 1; an input
    without a batch axis whole)."""
    rng = np.random.default_rng(seed)
    return {
        spec.name: random_values(rng, batch_shape(spec.shape, batch_size), spec.dtype)
        for spec in specs
    }


def _ms(ns: int) -> str:
    return f"{ns / MS_NS:.3f} ms"


def default_cpu() -> int:
    """The last CPU this process may run on (the first is busiest with everything else)."""
    return max(os.sched_getaffinity(0))


def infer_action(
    model: ModelInfo, batch_size: int, earliest_ns: int, latest_ns: int, seed: int = 0
) -> Callable[[int], Message]:
    """``action_id -> Infer`` of ``model`` on seeded random inputs in the given window."""
    inputs = random_inputs(model.inputs, batch_size, seed)
    return lambda i: Infer(i, model.model, batch_size, inputs, earliest_ns, latest_ns)


async def _run_infers(
    session: ExecutorSession, info: ModelInfo, count: int, batch_size: int
) -> None:
    for index in range(count):
        earliest_ns = session.executor_now_ns() + 2 * MS_NS
        make = infer_action(info, batch_size, earliest_ns, earliest_ns + 100 * MS_NS, index)
        result = await session.result(make)
        shapes = ", ".join(f"{n} {tuple(a.shape)} {a.dtype}" for n, a in result.outputs.items())
        phases = ", ".join(f"{k} {_ms(v)}" for k, v in result.durations_ns.items())
        print(
            f"INFER #{index + 1} b{batch_size}: started {_ms(result.start_ns - earliest_ns)} "
            f"after the window opened; {phases}; outputs {shapes}"
        )


async def run_demo(args: argparse.Namespace) -> int:
    from clockwork_async.models.demo import generate_demo_models

    paths = generate_demo_models(Path(args.cache_dir), names=[args.model])
    print(f"demo model {args.model}: {paths[args.model]}")
    with tempfile.TemporaryDirectory(prefix="clockwork-demo-") as folder:
        executor_args = ["--backend", "onnxruntime", "--name", "demo", "--cpus", str(args.cpu)]
        executor_args += ["--listen", f"unix:{folder}/executor.sock", "--weights-bytes", "256MiB"]
        executor = await spawn_executor(executor_args)
        try:
            await _demo_session(executor.address, args)
        finally:
            status = await executor.stop()
    print(f"executor stopped (exit {status})")
    return 0 if status == 0 else 1


async def _demo_session(address: str, args: argparse.Namespace) -> None:
    session = await ExecutorSession.open(address)
    try:
        info = session.info
        print(
            f"executor {info.name!r} ready at {address}: {info.backend} on {info.device}, "
            f"kind {info.kind}, {info.pages_total} pages of {info.page_bytes >> 20} MiB, "
            f"pinned to CPU {args.cpu}"
        )
        offset_ns = await session.sync_clock()
        print(f"clock offset {offset_ns} ns (same host: about 0)")
        model = await session.register(args.model, str(Path(args.cache_dir) / f"{args.model}.onnx"))
        print(
            f"registered {model.model}: {model.weights_bytes / 1e6:.1f} MB of weights, "
            f"{model.pages_needed} pages, batch sizes {model.batch_sizes}"
        )
        load = await session.result(lambda i: Load(i, model.model, 0, NEVER_NS))
        print(f"LOAD {_ms(load.durations_ns['load'])} (pages free {load.pages_free})")
        await _run_infers(session, model, args.infers, args.batch_size)
        unload = await session.result(lambda i: Unload(i, model.model))
        print(f"UNLOAD {_ms(unload.durations_ns['unload'])} (pages free {unload.pages_free})")
        await session.call(lambda i: GetState(i))
    finally:
        await session.close()
        for error in session.errors:
            print(f"executor error: {error.code}: {error.message}", file=sys.stderr)


def main(argv: Sequence[str]) -> int:
    """Run the demo. Returns 0 on success, 1 if the executor failed."""
    from clockwork_async.models.demo import default_directory

    parser = argparse.ArgumentParser(prog="clockwork-async demo", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--cache-dir", default=str(default_directory()), help="demo models")
    parser.add_argument("--model", default="resnet-like", help="demo model to serve")
    parser.add_argument("--cpu", type=int, default=default_cpu(), help="core to pin it to")
    parser.add_argument("--infers", type=int, default=5, help="how many INFERs to run")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args(list(argv))
    import uvloop

    try:
        return uvloop.run(run_demo(args))
    except DemoError as error:
        print(f"clockwork-async demo: {error}", file=sys.stderr)
        return 1
