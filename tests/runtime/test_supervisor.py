"""Supervisor: default executor layout, command lines, a child that cannot start, clean stop,
a stop while spawning."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from clockwork_async.runtime.supervisor import (
    TOKEN_ENV,
    ExecutorSpec,
    Supervisor,
    SupervisorConfig,
    SupervisorError,
    controller_cpu,
    default_specs,
    pin_controller,
)
from e2e.harness import children


def test_one_pinned_executor_per_cpu_after_the_controllers() -> None:
    specs = default_specs([0, 1, 2, 3])
    assert [(s.name, s.cpus) for s in specs] == [("cpu1", (1,)), ("cpu2", (2,)), ("cpu3", (3,))]
    assert all(s.backend == "onnxruntime" for s in specs)
    assert controller_cpu([0, 1, 2, 3]) == 0


def test_pin_controller_pins_to_the_lowest_cpu() -> None:
    before = os.sched_getaffinity(0)
    try:
        assert pin_controller() == min(before)
        assert os.sched_getaffinity(0) == {min(before)}
    finally:
        os.sched_setaffinity(0, before)


def test_a_single_cpu_still_gets_an_executor() -> None:
    assert [(s.name, s.cpus) for s in default_specs([5])] == [("cpu5", (5,))]


def test_template_fields_are_kept() -> None:
    template = ExecutorSpec("x", backend="simulated", slowdown=3.0, page_bytes=4096)
    (spec,) = default_specs([0, 2], template=template)
    assert (spec.name, spec.cpus, spec.backend, spec.slowdown, spec.page_bytes) == (
        "cpu2",
        (2,),
        "simulated",
        3.0,
        4096,
    )


def test_no_cpu_is_an_error() -> None:
    with pytest.raises(ValueError):
        default_specs([])


def test_argv_carries_the_spec_but_not_the_token() -> None:
    spec = ExecutorSpec(
        "e",
        backend="simulated",
        cpus=(1, 3),
        weights_bytes=1 << 24,
        slowdown=2.5,
        token="secret-token",
        extra_args=("--noise", "0.1"),
    )
    argv = spec.argv("unix:/run/e.sock", python="py")
    assert argv[:3] == ["py", "-m", "clockwork_async.executors.main"]
    joined = " ".join(argv)
    for part in (
        "--backend simulated",
        "--listen unix:/run/e.sock",
        "--cpus 1,3",
        "--weights-bytes 16777216",
        "--slowdown 2.5",
        "--noise 0.1",
    ):
        assert part in joined
    assert "secret-token" not in joined  # passed in the environment instead
    assert TOKEN_ENV == "CLOCKWORK_EXECUTOR_TOKEN"


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError):
        Supervisor([ExecutorSpec("a"), ExecutorSpec("a")])


async def test_a_child_that_cannot_start_is_a_named_error(tmp_path: object) -> None:
    broken = ExecutorSpec("bad", backend="simulated", extra_args=("--no-such-flag",))
    supervisor = Supervisor([broken], SupervisorConfig(ready_timeout_s=30.0))
    with pytest.raises(SupervisorError, match=r"bad.*exited"):
        await supervisor.start()
    assert not supervisor.run_dir.exists()  # closed: its temporary folder is gone


async def test_close_stops_every_child() -> None:
    specs = [ExecutorSpec("s", backend="simulated", weights_bytes=1 << 26)]
    supervisor = Supervisor(specs, SupervisorConfig(python=sys.executable))
    addresses = await supervisor.start()
    assert addresses["s"].startswith("unix:")
    pid = supervisor.children["s"].pid
    assert pid is not None
    await supervisor.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert supervisor.children["s"].process is not None
    assert supervisor.children["s"].process.returncode == 0  # SIGTERM: a clean exit


@pytest.mark.parametrize("iterations", [0, 1, 2, 3, 5, 8])
async def test_a_start_cancelled_while_spawning_leaves_no_process_after_close(
    iterations: int,
) -> None:
    before = set(children(os.getpid(), zombies=True))
    specs = [ExecutorSpec(f"s{i}", backend="simulated", weights_bytes=1 << 24) for i in range(2)]
    supervisor = Supervisor(specs, SupervisorConfig(stop_timeout_s=5.0))
    start = asyncio.ensure_future(supervisor.start())
    for _ in range(iterations):  # cancel somewhere inside the spawn: before, in or after exec
        await asyncio.sleep(0)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await supervisor.close()
    # Every process it created was tracked, stopped and waited for: none is left, not even
    # as a zombie that someone else would reap later.
    assert set(children(os.getpid(), zombies=True)) <= before
    for child in supervisor.children.values():
        assert child.process is None or child.process.returncode is not None
