"""`clockwork-async demo`: one ONNX Runtime executor driven by hand, without the daemon.

It generates the demo models into the cache folder, starts one executor subprocess pinned to
a core, registers ``resnet-like``, LOADs it, runs a few INFERs on random inputs inside time
windows, prints the outputs' shapes and the executor's measured timings, UNLOADs, and stops
the executor with SIGTERM: a look at the executor protocol, with measured timings.

`spawn_executor` and `ExecutorSession` (a small pipelining controller side: one future per
action id, NTP-style clock offset from pings) are reused by ``benchmarks/executor.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clockwork_async.connection import Connection, ConnectionClosed, open_connection
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


class DemoError(RuntimeError):
    """The executor did not start, refused us, or answered an action with an error."""


# --- the executor process -------------------------------------------------------------------


@dataclass
class SpawnedExecutor:
    process: asyncio.subprocess.Process
    address: str

    async def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout_s``). Returns the exit status."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        assert self.process.returncode is not None
        return self.process.returncode


async def spawn_executor(args: Sequence[str]) -> SpawnedExecutor:
    """Start ``python -m clockwork_async.executors.main ARGS`` and wait for ``ready ADDR``.
    Raises DemoError (after killing it) if it does not get there."""
    command = [sys.executable, "-m", "clockwork_async.executors.main", *args]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
    except TimeoutError:
        line = b""
    text = line.decode(errors="replace").strip()
    if not text.startswith("ready "):
        if process.returncode is None:
            process.kill()
        status = await process.wait()
        raise DemoError(f"the executor did not start (exit {status}, said {text!r})")
    return SpawnedExecutor(process, text.removeprefix("ready "))


# --- a small controller side ------------------------------------------------------------------


@dataclass
class ExecutorSession:
    """A handshaken connection to one executor; replies are matched by action id."""

    conn: Connection
    info: ExecutorInfo
    offset_ns: int = 0  # executor clock - our clock (see `sync_clock`)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[Message]] = field(default_factory=dict)
    _pongs: dict[int, asyncio.Future[tuple[Pong, int]]] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, address: str, token: str = "") -> ExecutorSession:
        """Connect and handshake. Raises DemoError if the executor refuses."""
        conn = await open_connection(address)
        conn.send(Hello(PROTOCOL_VERSION, Role.CONTROLLER.value, "demo", token))
        hello, info = await conn.recv(), await conn.recv()
        if not isinstance(hello, Hello) or not isinstance(info, ExecutorInfo):
            conn.close()
            raise DemoError(f"the executor refused the connection: {hello!r}")
        session = cls(conn, info)
        session._reader = asyncio.get_running_loop().create_task(session._read())
        return session

    async def _read(self) -> None:
        try:
            async for message in self.conn:
                self._dispatch(message)
        except ConnectionClosed:
            pass

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Pong):
            pong = self._pongs.pop(message.seq, None)
            if pong is not None and not pong.done():
                pong.set_result((message, time.monotonic_ns()))
            return
        if isinstance(message, Error):
            print(f"executor error: {message.code}: {message.message}", file=sys.stderr)
            return
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

    async def call(self, make: Callable[[int], Message], timeout_s: float = 60.0) -> Message:
        return await asyncio.wait_for(self.send(make), timeout_s)

    async def result(self, make: Callable[[int], Message]) -> ActionResult:
        """The ActionResult of one action. Raises DemoError for an error code."""
        reply = await self.call(make)
        if not isinstance(reply, ActionResult) or not reply.ok:
            raise DemoError(f"action failed: {reply!r}")
        return reply

    async def register(self, model: str, path: str) -> ModelInfo:
        reply = await self.call(lambda i: RegisterModel(i, model, path))
        if not isinstance(reply, ModelInfo):
            raise DemoError(f"registering {model!r} failed: {reply!r}")
        return reply

    async def sync_clock(self, samples: int = 32) -> int:
        """Estimate the executor's clock offset from the lowest-round-trip ping (NTP style);
        store and return it."""
        best_rtt_ns = NEVER_NS
        for seq in range(samples):
            future: asyncio.Future[tuple[Pong, int]] = asyncio.get_running_loop().create_future()
            self._pongs[seq] = future
            self.conn.send(Ping(seq, time.monotonic_ns()))
            pong, arrived_ns = await asyncio.wait_for(future, 10.0)
            if arrived_ns - pong.sent_ns < best_rtt_ns:
                best_rtt_ns = arrived_ns - pong.sent_ns
                self.offset_ns = pong.peer_ns - (pong.sent_ns + arrived_ns) // 2
        return self.offset_ns

    def executor_now_ns(self) -> int:
        return time.monotonic_ns() + self.offset_ns

    async def close(self) -> None:
        self.conn.close()
        await self.conn.wait_closed()
        if self._reader is not None:
            await self._reader


# --- the demo -------------------------------------------------------------------------------


def random_inputs(
    specs: Sequence[TensorSpec], batch_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded random inputs for ``specs`` (leading -1 = the batch, other -1 = 1)."""
    rng = np.random.default_rng(seed)
    return {
        spec.name: rng.standard_normal(
            (batch_size, *(1 if dim == -1 else dim for dim in spec.shape[1:]))
        ).astype(spec.dtype)
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
    from clockwork_async.demo_models import generate_demo_models

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


def main(argv: Sequence[str]) -> int:
    """Run the demo. Returns 0 on success, 1 if the executor failed."""
    from clockwork_async.demo_models import default_directory

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
