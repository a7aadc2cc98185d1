"""Spawns local executor processes, waits until each is ready, restarts the dead, stops them all.

Each executor is ``python -m clockwork_async.executors.main`` listening on a Unix socket in the
supervisor's run folder; it is ready when it prints ``ready <address>``. A process that exits
(or is killed because its link stopped answering) is restarted after a backoff
(`backoff.Backoff`: exponential, reset after a healthy period), and ``on_ready`` is told its
address again so the controller reconnects at once.

States of one child: ``STARTING -> RUNNING -> BACKING_OFF -> STARTING ...``, ``-> STOPPED``
once the supervisor closes. Invariants: every process created is recorded as its child's
``process`` even when the spawn awaiting it is cancelled (a stop during a start), and none is
created once ``close`` began; so after ``close`` no child process is left running (SIGTERM,
then SIGKILL after ``stop_timeout_s``), and each is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from clockwork_async.runtime.backoff import Backoff, BackoffConfig

log = logging.getLogger(__name__)

MIB = 1 << 20
PARENT_PID_ENV = "CLOCKWORK_EXECUTOR_PARENT_PID"
TOKEN_ENV = "CLOCKWORK_EXECUTOR_TOKEN"  # read by the executor; argv would show it in ps


class SupervisorError(RuntimeError):
    """An executor process could not be started (exited early, never became ready)."""


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """How to start one local executor process."""

    name: str
    backend: str = "onnxruntime"
    device: str = "cpu"  # cpu, sim or cuda:N
    cpus: tuple[int, ...] = ()
    lane_scheduling: str = "auto"  # the executor's --lane-scheduling: auto, idle or normal
    page_bytes: int = 16 * MIB
    weights_bytes: int | None = None  # None: the backend's default
    intra_op_threads: int = 1
    slowdown: float = 1.0
    keep_warm_ms: float = 0.0  # the executor's --keep-warm-ms (0: off)
    token: str = ""
    extra_args: tuple[str, ...] = ()  # e.g. ("--profile-file", PATH, "--noise", "0.01")

    def argv(self, listen: str, python: str = sys.executable) -> list[str]:
        """The command line that starts this executor listening on ``listen``."""
        args = [python, "-m", "clockwork_async.executors.main", "--backend", self.backend]
        if self.device != "cpu":
            args += ["--device", self.device]
        args += ["--listen", listen, "--name", self.name, "--page-bytes", str(self.page_bytes)]
        if self.weights_bytes is not None:
            args += ["--weights-bytes", str(self.weights_bytes)]
        if self.cpus:
            args += ["--cpus", ",".join(str(cpu) for cpu in self.cpus)]
        if self.lane_scheduling != "auto":
            args += ["--lane-scheduling", self.lane_scheduling]
        args += ["--intra-op-threads", str(self.intra_op_threads)]
        if self.slowdown != 1.0:
            args += ["--slowdown", repr(self.slowdown)]
        if self.keep_warm_ms:
            args += ["--keep-warm-ms", repr(self.keep_warm_ms)]
        return [*args, *self.extra_args]


def default_specs(
    cpus: Sequence[int] | None = None, *, template: ExecutorSpec | None = None
) -> list[ExecutorSpec]:
    """One executor per CPU left after the controller's (the lowest CPU), each pinned to its
    CPU and named ``cpuN``; one sharing the controller's CPU when there is only one. The other
    fields come from ``template`` (default: an ONNX Runtime executor)."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not available:
        raise ValueError("no CPU to run an executor on")
    base = template or ExecutorSpec(name="cpu")
    return [replace(base, name=f"cpu{cpu}", cpus=(cpu,)) for cpu in available[1:] or available[:1]]


def controller_cpu(cpus: Sequence[int] | None = None, *, taken: Iterable[int] = ()) -> int:
    """The lowest of ``cpus`` (default: this process's CPUs) not in ``taken`` (CPUs executors
    are pinned to), else the lowest: with no ``taken``, the CPU `default_specs` leaves to the
    controller. Raises ValueError for no CPU."""
    available = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not available:
        raise ValueError("no CPU to run the controller on")
    busy = set(taken)
    return next((cpu for cpu in available if cpu not in busy), available[0])


def pin_controller(cpus: Sequence[int] | None = None, *, taken: Iterable[int] = ()) -> int:
    """Pin the calling thread (the controller's event loop) and the threads it starts later
    to `controller_cpu`, away from the executors; returns the CPU. Unpinned, the controller
    can land on an executor's CPU, and each action's socket write then hands that CPU to the
    executor it woke (measured: ~5x the cost of a send). Call it after `default_specs` (which
    reads this process's CPUs): executors spawned later inherit the pin unless their spec
    names CPUs (the default specs do). Raises OSError if the affinity cannot be set."""
    cpu = controller_cpu(cpus, taken=taken)
    os.sched_setaffinity(0, {cpu})
    return cpu


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    ready_timeout_s: float = 60.0  # importing onnxruntime on a loaded box takes a while
    stop_timeout_s: float = 5.0  # SIGTERM, then SIGKILL after this
    backoff: BackoffConfig = field(default_factory=BackoffConfig)  # the daemon's: [executor_link]
    run_dir: Path | None = None  # where the sockets go; None: a fresh temporary folder
    python: str = sys.executable
    log_level: str = "WARNING"  # the executors' stderr logging
    io_arena_fd: int | None = None  # the IO arena's memfd, inherited by every executor


class ChildState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    BACKING_OFF = "backing_off"
    STOPPED = "stopped"


@dataclass(slots=True)
class Child:
    """One supervised executor process."""

    spec: ExecutorSpec
    listen: str
    state: ChildState = ChildState.STARTING
    address: str = ""
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    last_exit: int | None = None
    backoff: Backoff = field(default_factory=Backoff)
    watcher: asyncio.Task[None] | None = None
    stdout_reader: asyncio.Task[None] | None = None

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


ReadyCallback = Callable[[str, str], None]  # (executor name, address)


class Supervisor:
    """Starts ``specs`` as child processes and keeps them running until `close`."""

    def __init__(
        self,
        specs: Sequence[ExecutorSpec],
        config: SupervisorConfig | None = None,
        *,
        on_ready: ReadyCallback | None = None,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"executor names must be unique and non-empty: {names}")
        self.config = config or SupervisorConfig()
        self.on_ready: ReadyCallback = on_ready or (lambda _name, _address: None)
        self._owns_run_dir = self.config.run_dir is None
        run_dir = self.config.run_dir or Path(tempfile.mkdtemp(prefix="clockwork-executors-"))
        self.run_dir = run_dir
        self.children = {
            spec.name: Child(
                spec,
                f"unix:{run_dir / (spec.name + '.sock')}",
                backoff=Backoff(self.config.backoff),
            )
            for spec in specs
        }
        self._closing = False
        self._creating: set[asyncio.Task[asyncio.subprocess.Process]] = set()

    async def start(self) -> dict[str, str]:
        """Start every executor and wait until all are ready; returns name -> address.

        Raises SupervisorError (after stopping the others) if one cannot start.
        """
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        results = await asyncio.gather(
            *(self._spawn(child) for child in self.children.values()), return_exceptions=True
        )
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            await self.close()
            raise SupervisorError("; ".join(str(error) for error in errors))
        for child in self.children.values():
            child.watcher = asyncio.create_task(self._watch(child), name=f"watch-{child.spec.name}")
        return {name: child.address for name, child in self.children.items()}

    def kill(self, name: str, reason: str) -> bool:
        """SIGKILL a running executor (hung, or its link failed); it is restarted. Returns
        whether a live process was killed."""
        child = self.children[name]
        process = child.process
        if self._closing or process is None or process.returncode is not None:
            return False
        log.warning("killing executor %s (pid %d): %s", name, process.pid, reason)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        return True

    async def close(self, *, force: bool = False) -> None:
        """Stop every executor: SIGTERM, SIGKILL after ``stop_timeout_s`` (``force``: SIGKILL
        at once, a second stop signal); wait for each."""
        self._closing = True
        for child in self.children.values() if force else ():
            if child.process is not None and child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
        watchers = [c.watcher for c in self.children.values() if c.watcher is not None]
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await asyncio.gather(*self._creating, return_exceptions=True)  # record their processes
        await asyncio.gather(*(self._stop(child) for child in self.children.values()))
        if self._owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # --- one child ------------------------------------------------------------------------------

    async def _spawn(self, child: Child) -> None:
        """Start ``child`` and wait for its ``ready`` line. Raises SupervisorError."""
        if self._closing:
            raise SupervisorError(f"executor {child.spec.name}: the supervisor is closing")
        child.state = ChildState.STARTING
        child.starts += 1
        socket_path = Path(child.listen.removeprefix("unix:"))
        socket_path.unlink(missing_ok=True)
        child.process = await asyncio.shield(self._create_process(child))
        try:
            child.address = await asyncio.wait_for(
                self._read_ready(child), self.config.ready_timeout_s
            )
        except (TimeoutError, SupervisorError) as error:
            await self._stop(child)
            if isinstance(error, TimeoutError):
                message = f"not ready after {self.config.ready_timeout_s} s"
                raise SupervisorError(f"executor {child.spec.name}: {message}") from None
            raise
        child.stdout_reader = asyncio.create_task(self._drain_stdout(child))
        child.state = ChildState.RUNNING
        child.backoff.started(time.monotonic())
        log.info("executor %s ready at %s (pid %d)", child.spec.name, child.address, child.pid)

    def _create_process(self, child: Child) -> asyncio.Task[asyncio.subprocess.Process]:
        """Start ``child``'s process in a task of its own that records it as
        ``child.process`` when created, even if the spawn awaiting it was cancelled meanwhile
        (`close` waits for these tasks, then stops what they created)."""
        # The executor asks for SIGTERM when this process dies (executors/main.py).
        env = {**os.environ, TOKEN_ENV: child.spec.token, PARENT_PID_ENV: str(os.getpid())}
        argv = child.spec.argv(child.listen, self.config.python)
        argv += ["--log-level", self.config.log_level]
        # The IO arena goes by inheritance at spawn, never by name: only processes started
        # here get it, at the same number (the fd is close-on-exec everywhere else).
        arena_fd = self.config.io_arena_fd
        pass_fds = () if arena_fd is None else (arena_fd,)
        if arena_fd is not None:
            argv += ["--io-arena-fd", str(arena_fd)]
        creating = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                pass_fds=pass_fds,
                start_new_session=True,  # a terminal's ^C reaches the daemon, which stops these
            )
        )
        self._creating.add(creating)

        def record(task: asyncio.Task[asyncio.subprocess.Process]) -> None:
            self._creating.discard(task)
            if not task.cancelled() and task.exception() is None:
                child.process = task.result()

        creating.add_done_callback(record)
        return creating

    async def _read_ready(self, child: Child) -> str:
        assert child.process is not None and child.process.stdout is not None
        while True:
            line = await child.process.stdout.readline()
            if not line:
                code = await child.process.wait()
                raise SupervisorError(f"executor {child.spec.name} exited with {code} at start")
            text = line.decode(errors="replace").strip()
            if text.startswith("ready "):
                return text.removeprefix("ready ").strip()
            log.info("executor %s: %s", child.spec.name, text)

    async def _drain_stdout(self, child: Child) -> None:
        """Keep reading the child's stdout so it never blocks on a full pipe."""
        process = child.process
        assert process is not None and process.stdout is not None
        while line := await process.stdout.readline():
            log.info("executor %s: %s", child.spec.name, line.decode(errors="replace").rstrip())

    async def _watch(self, child: Child) -> None:
        """Restart ``child`` whenever its process ends, after the backoff."""
        while not self._closing:
            assert child.process is not None
            child.last_exit = await child.process.wait()
            log.warning("executor %s exited with %s", child.spec.name, child.last_exit)
            child.state = ChildState.BACKING_OFF
            await asyncio.sleep(child.backoff.failed(time.monotonic()))
            try:
                await self._spawn(child)
            except SupervisorError as error:
                log.warning("restarting executor %s failed: %s", child.spec.name, error)
                continue
            self.on_ready(child.spec.name, child.address)

    async def _stop(self, child: Child) -> None:
        process = child.process
        child.state = ChildState.STOPPED
        if process is None:
            return
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
            except TimeoutError:
                log.warning("executor %s ignored SIGTERM; killing it", child.spec.name)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if child.stdout_reader is not None:
            child.stdout_reader.cancel()
            await asyncio.gather(child.stdout_reader, return_exceptions=True)
            child.stdout_reader = None
