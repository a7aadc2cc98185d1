"""Helpers for the fault tests: slow simulated profiles, supervised executors under a driver,
a collector that knows each request's deadline, and waits on the driver's snapshot.

Profiles are slow on purpose (a 300 ms LOAD, a 200 ms INFER) so that a fault injected "during
LOAD" or "during INFER" lands there reliably on a loaded machine; the tests check that it did
(from the driver's snapshot) before injecting it. Models are registered with the profile they
run at (`registration_profile`), so no test waits for profiling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.driver import Driver, InferOutcome
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.snapshot import ExecutorSnapshot
from clockwork_async.runtime.supervisor import ExecutorSpec, Supervisor, SupervisorConfig
from runtime.support import MS_NS, Collector, new_driver, sim_row

SLOW_LOAD = "slow-load"  # LOAD 300 ms, INFER 2-4 ms
SLOW_INFER = "slow-infer"  # LOAD 2 ms, INFER 200 ms at batch 1 and 2
LOAD_NS = 300 * MS_NS
INFER_NS = 200 * MS_NS
EXECUTE_NS = {
    SLOW_LOAD: {1: 2 * MS_NS, 2: 3 * MS_NS, 4: 4 * MS_NS},
    SLOW_INFER: {1: INFER_NS, 2: INFER_NS},
}
LOADS_NS = {SLOW_LOAD: LOAD_NS, SLOW_INFER: 2 * MS_NS}
SIM_KIND = "sim"  # what simulated executors report as their kind
NAMED_FAILURES = frozenset({Outcome.DROPPED, Outcome.FAILED})
# A request whose SLO leaves room for one INFER only: the admission ledger may refuse it at
# arrival (its batch could not grow before its deadline); accepted, it ends as a named failure.
TIGHT_ENDINGS = NAMED_FAILURES | {Outcome.INFEASIBLE}
FAST_RESTART = SupervisorConfig(backoff=BackoffConfig(initial_s=0.0, max_s=0.5, healthy_s=5.0))


def _profile_table(name: str) -> str:
    execute = ", ".join(f"{batch} = {ns}" for batch, ns in EXECUTE_NS[name].items())
    return (
        f"[profiles.{name}]\nweights_bytes = 3145728\nload_ns = {LOADS_NS[name]}\n"
        f"execute_ns = {{ {execute} }}\ninput_shape = [4]\n"
    )


def write_profiles(folder: Path) -> Path:
    """Write the slow profiles as an executor ``--profile-file``; returns its path."""
    path = folder / "slow-profiles.toml"
    path.write_text("\n".join(_profile_table(name) for name in EXECUTE_NS), encoding="utf-8")
    return path


def registration_profile(name: str, slowdown: float = 1.0) -> RegistrationProfile:
    """What profiling would measure for profile ``name`` at ``slowdown`` x its durations."""
    execute_ns = {batch: round(ns * slowdown) for batch, ns in EXECUTE_NS[name].items()}
    model = ModelProfile(execute_ns=execute_ns, load_ns=round(LOADS_NS[name] * slowdown))
    return RegistrationProfile(tuple(execute_ns), {SIM_KIND: model})


def sim_spec(name: str, profile_file: Path, *, slowdown: float = 1.0) -> ExecutorSpec:
    """A simulated executor (16 pages of 1 MiB) that knows the slow profiles."""
    return ExecutorSpec(
        name,
        backend="simulated",
        page_bytes=1 << 20,
        weights_bytes=16 << 20,
        slowdown=slowdown,
        extra_args=("--profile-file", str(profile_file)),
    )


@asynccontextmanager
async def supervised(
    specs: Sequence[ExecutorSpec], **link: float
) -> AsyncIterator[tuple[Supervisor, Driver]]:
    """Executor processes under a supervisor (restarted at once), attached to a new driver
    with ``link`` timing. Both are closed on the way out, and no process is left running."""
    supervisor = Supervisor(specs, FAST_RESTART)
    await supervisor.start()
    driver = new_driver(**link)
    try:
        await driver.attach_supervised(supervisor)
        yield supervisor, driver
    finally:
        await driver.close()
        await supervisor.close()
    children = supervisor.children.values()
    assert all(c.process is None or c.process.returncode is not None for c in children)


async def register(driver: Driver, name: str, *, slowdown: float = 1.0) -> None:
    """Register slow profile ``name`` as a model of the same name, with its known durations."""
    await driver.register_model(name, name, profile=registration_profile(name, slowdown))


@dataclass
class Replies(Collector):
    """A Collector that also knows each request's deadline and when its answer came."""

    deadlines_ns: dict[int, int] = field(default_factory=dict)
    answered_ns: dict[int, int] = field(default_factory=dict)

    def __call__(self, outcome: InferOutcome) -> None:
        self.answered_ns.setdefault(outcome.request_id, time.monotonic_ns())
        super().__call__(outcome)

    def submit(self, driver: Driver, model: str, value: float, slo_ms: float) -> int:
        """Submit one row due ``slo_ms`` from now; returns the request id."""
        deadline_ns = time.monotonic_ns() + round(slo_ms * MS_NS)
        request_id = driver.submit(model, sim_row(value), deadline_ns=deadline_ns, on_reply=self)
        self.deadlines_ns[request_id] = deadline_ns
        return request_id

    def outcome(self, request_id: int) -> Outcome:
        return self.outcomes[request_id].outcome

    def ok_after_deadline(self) -> list[int]:
        """Requests answered ``ok`` after their deadline (must stay empty)."""
        return [
            request_id
            for request_id, reply in self.outcomes.items()
            if reply.outcome is Outcome.OK
            and self.answered_ns[request_id] > self.deadlines_ns[request_id]
        ]

    def check_each_answered_once(self) -> None:
        """Every submitted request answered, none twice, no ``ok`` past its deadline."""
        assert set(self.outcomes) == set(self.deadlines_ns)
        assert self.duplicates == []
        assert self.ok_after_deadline() == []


async def wait_until(
    condition: Callable[[], bool], what: str, timeout_s: float = 15.0, period_s: float = 0.005
) -> None:
    """Poll ``condition`` until it holds. Raises AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(period_s)


def executor(driver: Driver, executor_id: str) -> ExecutorSnapshot:
    """The driver's current view of one executor. Raises StopIteration for an unknown id."""
    return next(e for e in driver.snapshot().executors if e.executor_id == executor_id)


def loading(driver: Driver, executor_id: str, model: str) -> bool:
    """An action is outstanding on the executor and ``model`` is not loaded there yet."""
    state = executor(driver, executor_id)
    return state.up and state.outstanding_actions > 0 and model not in state.loaded


def running(driver: Driver, executor_id: str, model: str) -> bool:
    """``model`` is loaded on the executor and an action (its INFER) is outstanding."""
    state = executor(driver, executor_id)
    return state.up and state.outstanding_actions > 0 and model in state.loaded


def serving_again(driver: Driver, executor_id: str, restarts: int) -> Callable[[], bool]:
    """A condition: the executor rejoined after at least ``restarts`` restarts."""

    def check() -> bool:
        state = executor(driver, executor_id)
        return state.up and state.restarts >= restarts

    return check


def busy_executor(driver: Driver) -> str:
    """The one executor with outstanding actions. Raises AssertionError unless exactly one."""
    busy = [e.executor_id for e in driver.snapshot().executors if e.outstanding_actions]
    assert len(busy) == 1, f"expected one busy executor, found {busy}"
    return busy[0]
