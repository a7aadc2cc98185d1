"""Helpers for runtime tests: executor processes, a reply collector, quick configs."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clockwork_async import demo
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.outcomes import Outcome
from clockwork_async.demo import ExecutorProcess
from clockwork_async.runtime.config import RuntimeConfig
from clockwork_async.runtime.driver import Driver, InferOutcome
from clockwork_async.runtime.executor_link import LinkConfig
from clockwork_async.runtime.profiler import ProfilerConfig

MS_NS = 1_000_000
SIM_ARGS = ("--backend", "simulated", "--page-bytes", "1MiB", "--weights-bytes", "16MiB")
QUICK_PROFILER = ProfilerConfig(warmup_iterations=1, iterations=3, load_iterations=1)


def quick_runtime(**link: float) -> RuntimeConfig:
    """Fast profiling; link timing overridable (e.g. heartbeat_miss_limit=6)."""
    return RuntimeConfig(link=LinkConfig(**link), profiler=QUICK_PROFILER)  # type: ignore[arg-type]


def new_driver(**link: float) -> Driver:
    return Driver(ControllerConfig(), runtime=quick_runtime(**link))


def start_executor(socket_path: Path, name: str, args: Sequence[str] = SIM_ARGS) -> ExecutorProcess:
    """Start an executor listening on ``socket_path``; returns once it printed ``ready``
    (`ExecutorProcess.stop` must be called, in a finally)."""
    return demo.start_executor([*args, "--name", name, "--listen", f"unix:{socket_path}"])


@dataclass
class Collector:
    """Collects InferOutcomes; records duplicates (a request answered twice)."""

    outcomes: dict[int, InferOutcome] = field(default_factory=dict)
    duplicates: list[InferOutcome] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, outcome: InferOutcome) -> None:
        if outcome.request_id in self.outcomes:
            self.duplicates.append(outcome)
        self.outcomes[outcome.request_id] = outcome
        self._changed.set()

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        """Wait until ``count`` distinct requests were answered."""
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < count:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))

    def counts(self) -> Counter[Outcome]:
        return Counter(outcome.outcome for outcome in self.outcomes.values())


def sim_row(value: float) -> dict[str, np.ndarray]:
    """One row for the tiny-sim model (4 floats); the sim echoes ``value`` as output[0, 0]."""
    return {"input": np.full((1, 4), value, dtype=np.float32)}


def deadline_in(ms: float) -> int:
    return time.monotonic_ns() + int(ms * MS_NS)
