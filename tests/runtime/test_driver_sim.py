"""The driver against a real simulated executor process (tiny-sim profile), over a real socket.

One executor process serves the whole module; each test attaches a fresh driver (a new
controller connection replaces the previous one, and the driver drops models it does not know).
Tests assert outcomes, never timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import ActionFinished, Command, Event
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.driver import Driver, InferOutcome, RegistrationError
from clockwork_async.runtime.executor_link import LinkError

from .support import (
    MS_NS,
    Collector,
    ExecutorProcess,
    deadline_in,
    new_driver,
    quick_runtime,
    sim_row,
    start_executor,
)

SLO_MS = 1_000.0  # generous: a shared, noisy 2-core machine must still make every deadline


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecutorProcess]:
    process = start_executor(tmp_path_factory.mktemp("sock") / "sim.sock", "sim")
    try:
        yield process
    finally:
        assert process.stop() == 0


@pytest.fixture
async def driver(executor: ExecutorProcess) -> AsyncIterator[Driver]:
    driver = new_driver()
    try:
        await driver.attach_executor("sim", executor.address)
        await driver.register_model("tiny", "tiny-sim")
        yield driver
    finally:
        await driver.close()


async def test_requests_are_answered_ok_with_their_own_rows(driver: Driver) -> None:
    replies = Collector()
    ids = []
    for value in range(20):
        ids.append(
            driver.submit("tiny", sim_row(value), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
        )
        await asyncio.sleep(0.001)
    await replies.wait_for(len(ids))
    assert replies.counts() == {Outcome.OK: 20}
    for value, request_id in enumerate(ids):
        outcome = replies.outcomes[request_id]
        assert outcome.outputs["output"].shape == (1, 1000)
        assert outcome.outputs["output"][0, 0] == value  # the sim echoes the row's input
        assert outcome.executor_id == "sim"
        assert outcome.timing_ns["total"] <= SLO_MS * 1e6  # ok means within the deadline
        assert {"queue", "execute", "predicted_execute"} <= outcome.timing_ns.keys()
    assert replies.duplicates == []


async def test_concurrent_submits_are_batched(driver: Driver) -> None:
    replies = Collector()
    ids = [
        driver.submit("tiny", sim_row(v), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
        for v in range(64)
    ]
    await replies.wait_for(len(ids))
    assert replies.counts() == {Outcome.OK: 64}
    assert max(o.batch_size for o in replies.outcomes.values()) > 1
    for value, request_id in enumerate(ids):
        assert replies.outcomes[request_id].outputs["output"][0, 0] == value
    snapshot = driver.snapshot()
    assert snapshot.outcomes["ok"] == 64
    assert (snapshot.outstanding, snapshot.queued, snapshot.running) == (0, 0, 0)
    (executor,) = snapshot.executors
    assert executor.up and executor.loaded == ("tiny",)
    assert executor.pages_used >= 1


async def test_clock_offset_to_a_local_executor_is_within_its_error_bound(driver: Driver) -> None:
    # Same machine, same monotonic clock: the true offset is 0, and an NTP estimate is off by
    # at most half its round trip (+1 ns of integer rounding).
    (executor,) = driver.snapshot().executors
    assert abs(executor.clock_offset_ns) <= executor.clock_error_ns + 1


async def test_outputs_are_read_only_views(driver: Driver) -> None:
    replies = Collector()
    driver.submit("tiny", sim_row(1), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    await replies.wait_for(1)
    (outcome,) = replies.outcomes.values()
    with pytest.raises(ValueError):
        outcome.outputs["output"][0, 0] = 5.0


async def test_bad_input_and_unknown_model_are_rejected_at_once(driver: Driver) -> None:
    replies = Collector()
    wrong_dtype = {"input": np.zeros((1, 4), dtype=np.float64)}
    bad = driver.submit("tiny", wrong_dtype, deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    missing = driver.submit("tiny", {}, deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    two_rows = {"input": np.zeros((2, 4), dtype=np.float32)}
    rows = driver.submit("tiny", two_rows, deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    unknown = driver.submit("nope", sim_row(0), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    # Answered before submit returned: no waiting needed.
    assert replies.outcomes[bad].outcome is Outcome.BAD_INPUT
    assert "dtype float64" in replies.outcomes[bad].message
    assert replies.outcomes[missing].outcome is Outcome.BAD_INPUT
    assert replies.outcomes[rows].outcome is Outcome.BAD_INPUT
    assert replies.outcomes[unknown].outcome is Outcome.UNKNOWN_MODEL
    assert driver.snapshot().outcomes == {"bad_input": 3, "unknown_model": 1}


async def test_cancel_answers_a_queued_request_cancelled(driver: Driver) -> None:
    replies = Collector()
    ids = [
        driver.submit("tiny", sim_row(v), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
        for v in range(200)
    ]
    driver.cancel(ids[-1])  # far back in the queue: the lane is filled only a few ms ahead
    driver.cancel(10**9)  # unknown ids are ignored
    await replies.wait_for(len(ids))
    assert replies.outcomes[ids[-1]].outcome is Outcome.CANCELLED
    assert replies.counts()[Outcome.OK] == 199
    assert replies.duplicates == []


async def test_a_failing_callback_does_not_break_the_driver(driver: Driver) -> None:
    def explode(_outcome: object) -> None:
        raise RuntimeError("caller bug")

    driver.submit("tiny", sim_row(0), deadline_ns=deadline_in(SLO_MS), on_reply=explode)
    replies = Collector()
    driver.submit("tiny", sim_row(1), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    await replies.wait_for(1)
    assert replies.counts() == {Outcome.OK: 1}


async def test_drain_answers_everything_and_refuses_newcomers(driver: Driver) -> None:
    replies = Collector()
    ids = [
        driver.submit("tiny", sim_row(v), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
        for v in range(100)
    ]
    await driver.drain(timeout_s=10.0)
    assert set(replies.outcomes) == set(ids)
    assert replies.counts() == {Outcome.OK: 100}
    late = driver.submit("tiny", sim_row(0), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    assert replies.outcomes[late].outcome is Outcome.SHUTTING_DOWN


async def test_drain_timeout_answers_the_rest_shutting_down(driver: Driver) -> None:
    replies = Collector()
    ids = [
        driver.submit("tiny", sim_row(v), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
        for v in range(300)
    ]
    await driver.drain(timeout_s=0.0)
    assert set(replies.outcomes) == set(ids)  # all answered, now
    counts = replies.counts()
    assert counts[Outcome.SHUTTING_DOWN] > 0
    assert set(counts) <= {Outcome.OK, Outcome.SHUTTING_DOWN}
    await asyncio.sleep(0.05)  # results still in flight must not answer anyone again
    assert replies.duplicates == []


async def test_unregister_then_register_again(driver: Driver) -> None:
    replies = Collector()
    driver.submit("tiny", sim_row(0), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    await driver.unregister_model("tiny")
    gone = driver.submit("tiny", sim_row(0), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    await replies.wait_for(2)
    assert replies.outcomes[gone].outcome is Outcome.UNKNOWN_MODEL
    assert driver.snapshot().executors[0].loaded == ()
    model = await driver.register_model("tiny", "tiny-sim", profile=None)
    again = await driver.register_model("tiny2", "tiny-sim", profile=model.profile)
    assert again.profile == model.profile  # a cached profile is used as is, not re-measured
    ok = driver.submit("tiny2", sim_row(7), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    await replies.wait_for(3)
    assert replies.outcomes[ok].outcome is Outcome.OK


async def test_registration_errors_are_named(driver: Driver) -> None:
    with pytest.raises(RegistrationError, match="already registered"):
        await driver.register_model("tiny", "tiny-sim")
    with pytest.raises(RegistrationError, match="cannot register 'ghost'"):
        await driver.register_model("ghost", "no-such-profile")
    assert "ghost" not in driver.models()


async def test_attach_to_nothing_raises(tmp_path: Path) -> None:
    driver = new_driver(connect_timeout_s=1.0)
    try:
        with pytest.raises(LinkError, match="cannot connect"):
            await driver.attach_executor("x", f"unix:{tmp_path / 'none.sock'}")
        assert driver.snapshot().executors == ()
    finally:
        await driver.close()


async def test_registering_without_executors_fails() -> None:
    driver = new_driver()
    try:
        with pytest.raises(RegistrationError, match="no executor"):
            await driver.register_model("tiny", "tiny-sim")
    finally:
        await driver.close()


async def test_queued_running_and_cold_starts_are_in_the_snapshot(driver: Driver) -> None:
    replies = Collector()
    for value in range(40):  # the model is not loaded after registration: a cold start
        driver.submit("tiny", sim_row(value), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
    snapshot = driver.snapshot()
    assert snapshot.outstanding == 40 and snapshot.queued + snapshot.running == 40
    assert snapshot.queued >= 1  # no batch can hold all 40 rows
    (model,) = snapshot.models
    assert model.queued == snapshot.queued
    assert snapshot.core_counters["cold_starts"] == 1
    await replies.wait_for(40)
    snapshot = driver.snapshot()
    assert (snapshot.outstanding, snapshot.queued, snapshot.running) == (0, 0, 0)
    assert snapshot.models[0].queued == 0 and snapshot.core_counters["cold_starts"] == 1


class StallBeforeJudging(Controller):
    """The real core; when a result reaches it, the controller's clock jumps ``stall_ns`` (as
    when the loop stalls with the result read but not handled), so the result is judged
    after the deadline."""

    def __init__(self, stall_ns: int) -> None:
        super().__init__(ControllerConfig())
        self.stall_ns = stall_ns
        self.skew_ns = 0

    def now_ns(self) -> int:
        return time.monotonic_ns() + self.skew_ns

    def handle(self, event: Event, now_ns: int) -> list[Command]:
        running = self.pending() - self.queue_depth()
        if isinstance(event, ActionFinished) and running:  # an INFER's result, not the LOAD's
            self.skew_ns += self.stall_ns
            now_ns += self.stall_ns
        return super().handle(event, now_ns)


async def test_a_result_the_core_sees_after_the_deadline_is_late_everywhere(
    executor: ExecutorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    core = StallBeforeJudging(stall_ns=500 * MS_NS)
    driver = Driver(
        ControllerConfig(), now_ns=core.now_ns, runtime=quick_runtime(), controller=core
    )
    seen: list[InferOutcome] = []
    driver.outcome_listeners.append(lambda _model, _group, _slack, outcome: seen.append(outcome))
    try:
        await driver.attach_executor("sim", executor.address)
        await driver.register_model("tiny", "tiny-sim")
        replies = Collector()
        deadline_ns = core.now_ns() + 200 * MS_NS  # ample for a 1 ms LOAD and 0.5 ms INFER
        request = driver.submit("tiny", sim_row(3), deadline_ns=deadline_ns, on_reply=replies)
        await replies.wait_for(1)
        outcome = replies.outcomes[request]
        assert outcome.outcome is Outcome.LATE and "after the deadline" in outcome.message
        assert outcome.outputs["output"][0, 0] == 3  # a late answer keeps its outputs
        assert [o.outcome for o in seen] == [Outcome.LATE]  # listeners (metrics) agree
        assert driver.snapshot().outcomes == {"late": 1}  # and so do the counts
        assert core.stats().outcomes["late"] == 1  # the one judge
        assert "late: the result reached the controller" in caplog.text  # traced in the log
        assert "predicted execute" in caplog.text
    finally:
        await driver.close()


async def test_the_measured_way_there_becomes_the_executors_lead_in_the_core(
    executor: ExecutorProcess,
) -> None:
    core = Controller(ControllerConfig())
    driver = Driver(ControllerConfig(), runtime=quick_runtime(), controller=core)
    try:
        await driver.attach_executor("sim", executor.address)
        await driver.register_model("tiny", "tiny-sim")
        assert core.executor("sim").lead_ns == 0  # nothing measured yet
        replies = Collector()
        for value in range(40):  # one INFER each: 16 results refresh the estimate
            driver.submit("tiny", sim_row(value), deadline_ns=deadline_in(SLO_MS), on_reply=replies)
            await replies.wait_for(value + 1)
        assert replies.counts() == {Outcome.OK: 40}
        lead_ns = core.executor("sim").lead_ns
        assert 0 < lead_ns < SLO_MS * MS_NS  # sent -> read by the executor, over a socket
    finally:
        await driver.close()
