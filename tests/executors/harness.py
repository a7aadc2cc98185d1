"""Test harness for real executor processes: start one, wait for its ``ready`` line, talk to it
as a controller over a real socket, stop it with SIGTERM and report its exit status.

`ExecutorProcess.stop` always leaves no process behind (SIGTERM, then SIGKILL after a bound).
`Controller` matches replies to actions by ``action_id`` and keeps connection-level `Error`s.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from clockwork_async.connection import Connection, ConnectionClosed, open_connection
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ExecutorInfo,
    Hello,
    Message,
    ModelInfo,
    Ping,
    Pong,
    Role,
    TensorSpec,
)

NEVER_NS = 2**63 - 1
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class ExecutorStartError(RuntimeError):
    """The executor exited or stayed silent instead of printing ``ready <address>``."""


@dataclass
class ExecutorProcess:
    process: subprocess.Popen[bytes]
    address: str

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the executor and wait; kill it if it does not exit in time. Returns its
        exit status (negative: killed by that signal)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


def executor_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "clockwork_async.executors.main", *args]


def _read_line(process: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """One line of the process's stdout, or b'' on exit or timeout."""
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


def start_executor(args: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> ExecutorProcess:
    """Start ``clockwork-async executor ARGS`` and wait for its ``ready`` line. Raises
    ExecutorStartError (after killing it) if it does not get there."""
    process = subprocess.Popen(executor_command(args), stdout=subprocess.PIPE)
    line = _read_line(process, timeout_s).decode(errors="replace").strip()
    if not line.startswith("ready "):
        process.kill()
        status = process.wait()
        raise ExecutorStartError(f"executor {list(args)} exited {status} after {line!r}")
    return ExecutorProcess(process, line.removeprefix("ready "))


# --- a minimal controller -----------------------------------------------------------------


@dataclass
class Controller:
    """The controller side of one executor connection."""

    conn: Connection
    info: ExecutorInfo
    errors: list[Error] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[Message]] = field(default_factory=dict)
    _pongs: dict[int, asyncio.Future[tuple[Pong, int]]] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read())

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
            future = self._pongs.pop(message.seq, None)
            if future is not None and not future.done():
                future.set_result((message, time.monotonic_ns()))
        elif isinstance(message, Error):
            self.errors.append(message)
        else:
            future_reply = self._waiting.pop(getattr(message, "action_id", -1), None)
            if future_reply is not None and not future_reply.done():
                future_reply.set_result(message)

    def send(self, make: Callable[[int], Message]) -> asyncio.Future[Message]:
        """Send ``make(action_id)``; the future resolves with its one reply."""
        action_id = next(self._ids)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._waiting[action_id] = future
        self.conn.send(make(action_id))
        return future

    async def call(self, make: Callable[[int], Message], timeout_s: float = 20.0) -> Message:
        return await asyncio.wait_for(self.send(make), timeout_s)

    async def result(self, make: Callable[[int], Message]) -> ActionResult:
        reply = await self.call(make)
        assert isinstance(reply, ActionResult), reply
        return reply

    async def ping(self, samples: int = 20) -> tuple[int, int]:
        """(offset_ns, round_trip_ns) of the sample with the smallest round trip."""
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

    async def close(self) -> None:
        self.conn.close()
        await self.conn.wait_closed()
        if self._reader is not None:
            await self._reader


async def say_hello(address: str, hello: Hello) -> tuple[Connection, Message]:
    """Connect, send ``hello``, return the connection and the first message back."""
    conn = await open_connection(address)
    conn.send(hello)
    return conn, await asyncio.wait_for(conn.recv(), 20.0)


async def connect(address: str, token: str = "") -> Controller:
    """A handshaken controller. Raises AssertionError if the executor refuses."""
    conn, first = await say_hello(address, Hello(PROTOCOL_VERSION, Role.CONTROLLER, "test", token))
    assert isinstance(first, Hello) and first.role == Role.EXECUTOR, first
    info = await asyncio.wait_for(conn.recv(), 20.0)
    assert isinstance(info, ExecutorInfo), info
    controller = Controller(conn, info)
    controller.start()
    return controller


# --- inputs ---------------------------------------------------------------------------------


def example_inputs(
    specs: Sequence[TensorSpec], batch_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random inputs matching ``specs`` (leading -1 = batch, other -1 = 1)."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in specs:
        shape = [batch_size, *(1 if dim == -1 else dim for dim in spec.shape[1:])]
        inputs[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return inputs


def model_inputs(info: ModelInfo, batch_size: int = 1) -> Mapping[str, np.ndarray]:
    return example_inputs(info.inputs, batch_size)
