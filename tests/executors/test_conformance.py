"""The executor conformance suite: every backend, as a real process over a real socket.

Each backend runs in one executor process per module (started by a fixture, stopped with
SIGTERM in teardown, which must exit 0). Every test connects as the controller and must leave
nothing loaded: the `controller` fixture checks that all pages are free again at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from clockwork_async.executors.flags import parse_bytes, parse_cpus

from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    ErrorCode,
    GetState,
    Hello,
    Infer,
    Load,
    Message,
    ModelInfo,
    RegisterModel,
    Role,
    State,
    Unload,
    UnregisterModel,
)

from .harness import (
    NEVER_NS,
    Controller,
    ExecutorProcess,
    connect,
    executor_command,
    model_inputs,
    say_hello,
    start_executor,
)

MS_NS = 1_000_000
_names = itertools.count()


@dataclass(frozen=True)
class Case:
    backend: str
    args: tuple[str, ...]
    model_path: str  # what RegisterModel names


@dataclass
class Running:
    case: Case
    process: ExecutorProcess

    @property
    def address(self) -> str:
        return self.process.address


def _case(backend: str, models_dir: Path) -> Case:
    if backend == "onnxruntime-cuda":  # the CUDA executor: same backend name, a device
        from clockwork_async.executors.device_ops import cuda_unavailable_reason

        reason = cuda_unavailable_reason("cuda:0")
        if reason is not None:
            pytest.skip(f"no CUDA device: {reason}")
        cpu_case = _case("onnxruntime", models_dir)
        return Case("onnxruntime", (*cpu_case.args, "--device", "cuda:0"), cpu_case.model_path)
    if backend == "simulated":
        # tiny-sim: 3 MiB of weights = 3 pages of 1 MiB; 8 pages hold two copies.
        args: tuple[str, ...] = ("--page-bytes", "1MiB", "--weights-bytes", "8MiB")
        return Case(backend, ("--backend", backend, *args), "tiny-sim")
    from clockwork_async.models.demo import generate_demo_models

    path = generate_demo_models(models_dir, names=["tiny"])["tiny"]
    args: tuple[str, ...] = ("--page-bytes", "4KiB", "--weights-bytes", "16KiB")
    return Case(backend, ("--backend", backend, *args), str(path))


@pytest.fixture(scope="module", params=["simulated", "onnxruntime", "onnxruntime-cuda"])
def executor(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Running]:
    case = _case(request.param, tmp_path_factory.mktemp("models"))
    socket_path = tmp_path_factory.mktemp("sock") / "executor.sock"
    process = start_executor(
        [*case.args, "--name", case.backend, "--listen", f"unix:{socket_path}"]
    )
    try:
        yield Running(case, process)
    finally:
        status = process.stop()
    assert status == 0, f"executor exited {status} on SIGTERM"
    assert not socket_path.exists(), "the executor left its socket file behind"


@pytest.fixture
async def controller(executor: Running) -> AsyncIterator[Controller]:
    controller = await connect(executor.address)
    try:
        yield controller
        state = await controller.call(lambda i: GetState(i))
        assert isinstance(state, State)
        assert (state.loaded, state.pages_free) == ((), state.pages_total), "leaked pages"
        assert controller.errors == []
    finally:
        await controller.close()


async def _register(controller: Controller, executor: Running) -> ModelInfo:
    name = f"m{next(_names)}"
    info = await controller.call(lambda i: RegisterModel(i, name, executor.case.model_path))
    assert isinstance(info, ModelInfo), info
    return info


def _infer(
    info: ModelInfo, batch_size: int = 1, earliest_ns: int = 0, latest_ns: int = NEVER_NS
) -> Callable[[int], Message]:
    inputs = model_inputs(info, batch_size)
    return lambda i: Infer(i, info.model, batch_size, inputs, earliest_ns, latest_ns)


# --- the handshake and the clock ----------------------------------------------------------------


async def test_hello_is_answered_with_executor_info(
    controller: Controller, executor: Running
) -> None:
    info = controller.info
    assert (info.backend, info.name) == (executor.case.backend, executor.case.backend)
    assert {"load", "execute"} <= set(info.lanes)
    assert info.pages_total > 0 and info.pages_free == info.pages_total
    assert info.page_bytes > 0


async def test_ping_offset_is_sane(controller: Controller) -> None:
    offset_ns, round_trip_ns = await controller.ping(samples=20)
    assert 0 < round_trip_ns < 1_000 * MS_NS
    # Same host, same monotonic clock: the true offset is 0, so the estimate lies within
    # half the round trip (the Pong was stamped between send and arrival).
    assert abs(offset_ns) <= round_trip_ns // 2 + 1


async def test_version_mismatch_is_rejected(executor: Running) -> None:
    conn, reply = await say_hello(executor.address, Hello(PROTOCOL_VERSION + 1, "controller", "t"))
    assert isinstance(reply, Error) and reply.code == ErrorCode.UNSUPPORTED_VERSION
    await conn.wait_closed()


async def test_a_non_controller_hello_is_rejected(executor: Running) -> None:
    conn, reply = await say_hello(executor.address, Hello(PROTOCOL_VERSION, Role.CLIENT, "t"))
    assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL_ERROR
    await conn.wait_closed()


async def test_a_message_out_of_place_closes_the_connection(executor: Running) -> None:
    controller = await connect(executor.address)
    try:
        controller.conn.send(ActionResult(action_id=1))  # executors send these, never receive
        await asyncio.wait_for(controller.closed.wait(), 10)
        assert [e.code for e in controller.errors] == [ErrorCode.PROTOCOL_ERROR]
        assert "action_result" in controller.errors[0].message
    finally:
        await controller.close()


async def test_a_new_controller_replaces_the_current_one(executor: Running) -> None:
    first = await connect(executor.address)
    second = await connect(executor.address)
    try:
        await asyncio.wait_for(first.closed.wait(), 10)
        assert [e.code for e in first.errors] == [ErrorCode.PROTOCOL_ERROR]
        assert "replaced" in first.errors[0].message
        assert isinstance(await second.call(lambda i: GetState(i)), State)
    finally:
        await first.close()
        await second.close()


# --- actions -------------------------------------------------------------------------------------


async def test_load_infer_unload_takes_and_frees_the_same_pages(
    controller: Controller, executor: Running
) -> None:
    info = await _register(controller, executor)
    pages_total = controller.info.pages_total
    loaded = await controller.action(lambda i: Load(i, info.model, 0, NEVER_NS))
    assert loaded.ok, loaded
    assert loaded.pages_free == pages_total - info.pages_needed
    assert loaded.durations_ns["load"] > 0 and loaded.start_ns <= loaded.end_ns

    for batch_size in (1, max(info.batch_sizes)):
        result = await controller.action(_infer(info, batch_size))
        assert result.ok, result
        assert {"copy_in", "execute", "copy_out"} <= set(result.durations_ns)
        assert result.durations_ns["execute"] > 0
        for spec in info.outputs:
            output = result.outputs[spec.name]
            assert output.dtype == np.dtype(spec.dtype) and output.shape[0] == batch_size

    state = await controller.call(lambda i: GetState(i))
    assert isinstance(state, State) and info.model in state.loaded
    unloaded = await controller.action(lambda i: Unload(i, info.model))
    assert unloaded.ok and unloaded.pages_free == pages_total
    assert (await controller.action(_infer(info))).code == ErrorCode.NOT_LOADED
    assert (await controller.action(lambda i: UnregisterModel(i, info.model))).ok


async def test_windows_are_honoured(controller: Controller, executor: Running) -> None:
    info = await _register(controller, executor)
    assert (await controller.action(lambda i: Load(i, info.model, 0, NEVER_NS))).ok
    offset_ns, _ = await controller.ping(samples=5)
    base_ns = time.monotonic_ns() + offset_ns + 20 * MS_NS
    earliest = [base_ns + k * 3 * MS_NS for k in (2, 0, 1)]
    sent_ns = time.monotonic_ns()  # one host, one monotonic clock: the executor's too
    results = await asyncio.gather(*(controller.send(_infer(info, 1, e)) for e in earliest))
    for earliest_ns, result in zip(earliest, results, strict=True):
        assert isinstance(result, ActionResult) and result.ok, result
        assert result.start_ns >= earliest_ns
        assert sent_ns <= result.received_ns <= result.start_ns  # read, then run in its window
    assert (await controller.action(lambda i: Unload(i, info.model))).ok


async def test_too_late_is_rejected_without_running(
    controller: Controller, executor: Running
) -> None:
    info = await _register(controller, executor)
    past_ns = time.monotonic_ns() - 10 * MS_NS
    never_loaded = await controller.action(lambda i: Load(i, info.model, 0, past_ns))
    assert (never_loaded.code, never_loaded.start_ns, never_loaded.durations_ns) == (
        ErrorCode.TOO_LATE,
        0,
        {},
    )
    assert never_loaded.pages_free == controller.info.pages_total
    assert (await controller.action(lambda i: Load(i, info.model, 0, NEVER_NS))).ok
    # Two INFERs due at the same instant T, the second with the window [T, T]: the first
    # starts at or after T and takes time, so the second cannot start by T.
    due_ns = time.monotonic_ns() + 20 * MS_NS
    first = controller.send(_infer(info, 1, due_ns))
    second = controller.send(_infer(info, 1, due_ns, due_ns))
    ran, rejected = await asyncio.gather(first, second)
    assert isinstance(ran, ActionResult) and ran.ok and ran.start_ns >= due_ns
    assert isinstance(rejected, ActionResult) and rejected.code == ErrorCode.TOO_LATE
    assert (rejected.start_ns, rejected.durations_ns, rejected.outputs) == (0, {}, {})
    assert 0 < never_loaded.received_ns <= ran.received_ns <= rejected.received_ns
    assert (await controller.action(lambda i: Unload(i, info.model))).ok


async def test_one_action_at_a_time_per_lane(controller: Controller, executor: Running) -> None:
    a, b = await _register(controller, executor), await _register(controller, executor)
    due_ns = time.monotonic_ns() + 10 * MS_NS
    loads = [
        controller.send(lambda i, m=m: Load(i, m, due_ns, NEVER_NS)) for m in (a.model, b.model)
    ]
    load_results = [await f for f in loads]
    infers = [controller.send(_infer(a, 1, due_ns + 5 * MS_NS)) for _ in range(6)]
    infer_results = [await f for f in infers]
    for results in (load_results, infer_results):
        assert all(isinstance(r, ActionResult) and r.ok for r in results), results
        spans = [(r.start_ns, r.end_ns) for r in results if isinstance(r, ActionResult)]
        # Ties on earliest run in order of arrival, each after the previous one ended.
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    for model in (a.model, b.model):
        assert (await controller.action(lambda i, m=model: Unload(i, m))).ok


async def test_out_of_pages_is_named(controller: Controller, executor: Running) -> None:
    copies = controller.info.pages_total // (await _register(controller, executor)).pages_needed
    infos = [await _register(controller, executor) for _ in range(copies + 1)]
    results = [await controller.action(lambda i, m=x.model: Load(i, m, 0, NEVER_NS)) for x in infos]
    assert all(r.ok for r in results[:copies]), results
    assert results[-1].code == ErrorCode.NO_PAGES and "pages" in results[-1].message
    assert results[-1].pages_free < infos[-1].pages_needed
    for info in infos[:copies]:
        assert (await controller.action(lambda i, m=info.model: Unload(i, m))).ok


async def test_unknown_models_are_named(controller: Controller, executor: Running) -> None:
    for make in (
        lambda i: Load(i, "ghost", 0, NEVER_NS),
        lambda i: Infer(i, "ghost", 1, {}, 0, NEVER_NS),
        lambda i: Unload(i, "ghost"),
        lambda i: UnregisterModel(i, "ghost"),
    ):
        result = await controller.action(make)
        assert result.code == ErrorCode.UNKNOWN_MODEL and "ghost" in result.message
    bad = await controller.action(lambda i: RegisterModel(i, "bad", "/no/such/model.onnx"))
    assert bad.code == ErrorCode.BAD_MODEL


async def test_bad_inputs_are_named_and_the_executor_serves_on(
    controller: Controller, executor: Running
) -> None:
    info = await _register(controller, executor)
    assert (await controller.action(lambda i: Load(i, info.model, 0, NEVER_NS))).ok
    good = dict(model_inputs(info, 1))
    name, array = next(iter(good.items()))
    cases = {
        "dtype": {**good, name: array.astype(np.float64)},
        "shape": {**good, name: np.concatenate([array, array], axis=-1)},
        "missing input": {k: v for k, v in good.items() if k != name},
        "leading axis": {**good, name: np.concatenate([array, array])},
    }
    for expected, inputs in cases.items():
        result = await controller.action(
            lambda i, x=inputs: Infer(i, info.model, 1, x, 0, NEVER_NS)  # type: ignore[misc]
        )
        assert result.code == ErrorCode.BAD_INPUT and expected in result.message, result
    wrong_batch = await controller.action(_infer(info, 3))
    assert wrong_batch.code == ErrorCode.BAD_INPUT and "batch size 3" in wrong_batch.message
    assert (await controller.action(_infer(info))).ok
    assert (await controller.action(lambda i: Unload(i, info.model))).ok


# --- process-level behaviour (simulated backend only) ------------------------------------------

SIM_ARGS = ("--backend", "simulated", "--page-bytes", "1MiB", "--weights-bytes", "8MiB")


def _start_sim(tmp_path: Path, *extra: str) -> ExecutorProcess:
    listen = ("--listen", f"unix:{tmp_path / 'x.sock'}")
    return start_executor([*SIM_ARGS, *listen, *extra])


async def test_a_token_is_required_when_set(tmp_path: Path) -> None:
    process = _start_sim(tmp_path, "--token", "s3cret")
    try:
        hello = Hello(PROTOCOL_VERSION, Role.CONTROLLER, "t", token="guess")
        conn, reply = await say_hello(process.address, hello)
        assert isinstance(reply, Error) and reply.code == ErrorCode.UNAUTHORIZED
        await conn.wait_closed()
        controller = await connect(process.address, token="s3cret")
        assert isinstance(await controller.call(lambda i: GetState(i)), State)
        await controller.close()
    finally:
        assert process.stop() == 0


async def test_serves_over_tcp(tmp_path: Path) -> None:
    process = start_executor([*SIM_ARGS, "--listen", "tcp:127.0.0.1:0"])
    try:
        assert process.address.startswith("tcp:127.0.0.1:")
        assert not process.address.endswith(":0")
        controller = await connect(process.address)
        info = await controller.call(lambda i: RegisterModel(i, "m", "tiny-sim"))
        assert isinstance(info, ModelInfo)
        assert (await controller.action(lambda i: Load(i, "m", 0, NEVER_NS))).ok
        assert (await controller.action(_infer(info, 2))).ok
        assert (await controller.action(lambda i: Unload(i, "m"))).ok
        await controller.close()
    finally:
        assert process.stop() == 0


async def test_sigterm_answers_queued_actions_and_exits_0(tmp_path: Path) -> None:
    process = _start_sim(tmp_path)
    try:
        controller = await connect(process.address)
        info = await controller.call(lambda i: RegisterModel(i, "m", "tiny-sim"))
        assert isinstance(info, ModelInfo)
        assert (await controller.action(lambda i: Load(i, "m", 0, NEVER_NS))).ok
        far_ns = time.monotonic_ns() + 3_600 * 1_000 * MS_NS
        queued = controller.send(_infer(info, 1, far_ns))
        assert isinstance(await controller.call(lambda i: GetState(i)), State)  # it arrived
        stopping = asyncio.get_running_loop().run_in_executor(None, process.stop)
        answer = await asyncio.wait_for(queued, 15)
        assert isinstance(answer, ActionResult) and answer.code == ErrorCode.INTERNAL
        assert "shutting down" in answer.message
        assert await stopping == 0
        await controller.close()
    finally:
        process.stop()


def _cpus_allowed_of(status_path: Path) -> str:
    status = status_path.read_text()
    return next(
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_cpus_pins_the_whole_process(tmp_path: Path) -> None:
    process = _start_sim(tmp_path, "--cpus", "0")
    try:
        tasks = list(Path(f"/proc/{process.process.pid}/task").iterdir())
        assert len(tasks) > 1  # the lanes at least
        assert {_cpus_allowed_of(task / "status") for task in tasks} == {"0"}
    finally:
        assert process.stop() == 0


def _policies_of(pid: int) -> list[int]:
    """The scheduling policy of each thread of ``pid`` (field 41 of /proc/PID/task/TID/stat)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int((task / "stat").read_text().rsplit(")", 1)[1].split()[38]) for task in tasks]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize(
    ("flags", "idle_lanes"),
    [
        (("--cpus", "0"), True),  # auto: pinned
        ((), False),  # auto: not pinned
        (("--cpus", "0", "--lane-scheduling", "normal"), False),
        (("--lane-scheduling", "idle"), True),
    ],
)
def test_lane_threads_yield_to_the_event_loop_when_pinned(
    tmp_path: Path, flags: tuple[str, ...], idle_lanes: bool
) -> None:
    process = _start_sim(tmp_path, *flags)
    try:
        policies = _policies_of(process.process.pid)
        idle = policies.count(os.SCHED_IDLE)
        assert policies.count(os.SCHED_OTHER) >= 1  # the event loop's thread
        assert idle >= 2 if idle_lanes else idle == 0  # the register lane and the backend's
    finally:
        assert process.stop() == 0


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--page-bytes", "100"), "page_bytes must be a positive multiple of 64"),
        (("--cpus", "x"), "not a CPU list"),
        (("--weights-bytes", "lots"), "not a size"),
        (("--backend", "tpu"), "invalid choice"),
        (("--keep-warm-ms", "-1"), "not milliseconds"),
        (("--keep-warm-ms", "nan"), "not milliseconds"),
    ],
)
def test_bad_flags_exit_2_with_a_sentence(flags: tuple[str, ...], expected: str) -> None:
    done = subprocess.run(
        executor_command(["--backend", "simulated", *flags]), capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert expected in done.stderr.decode()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64k", 64_000), ("1MiB", 1 << 20), ("16mib", 16 << 20), ("1.5GiB", 3 << 29)],
)
def test_sizes_parse(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_cpu_lists_parse() -> None:
    assert parse_cpus("0,2-3") == (0, 2, 3)
    assert parse_cpus("1") == (1,)


def test_a_second_executor_on_a_live_socket_refuses_to_start(tmp_path: Path) -> None:
    first = _start_sim(tmp_path)
    try:
        listen = ("--listen", first.address)
        done = subprocess.run(
            executor_command([*SIM_ARGS, *listen]), capture_output=True, timeout=60
        )
        assert done.returncode == 1 and b"another process is listening" in done.stderr
        assert Path(first.address.removeprefix("unix:")).is_socket()  # left alone
    finally:
        assert first.stop() == 0
