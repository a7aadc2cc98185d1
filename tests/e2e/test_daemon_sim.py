"""The real daemon with a simulated executor (the built-in ``tiny-sim`` profile), driven by the
blocking client over TCP. One daemon serves the module; the tests that stop or signal a daemon
start their own.

Simulated models take one row of ``input`` (4 floats) and answer ``output`` (1000 floats) whose
first value echoes the row's first input, so a test can tell its rows apart.
"""

from __future__ import annotations

import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.client import ApiError, Client
from clockwork_async.core.outcomes import Outcome
from clockwork_async.models.demo import build_tiny

from .harness import (
    DaemonProcess,
    add_tiny,
    metric_value,
    run_serve,
    sim_executor,
    write_config,
)

MS_NS = 1_000_000
SLO_MS = 2_000.0  # generous: the 2-core test machine is shared and noisy
TINY_FILE = build_tiny(0).SerializeToString()
TINY_BYTES = len(TINY_FILE)
BUDGET_BYTES = TINY_BYTES + TINY_BYTES // 2  # room for one tiny file (any number of names)


def row(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, dtype=np.float32)}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("sim-daemon")
    add_tiny(folder / "models")
    extra = f"weights_budget_bytes = {BUDGET_BYTES}"  # inside [repository]
    # 256 pages of 1 MiB: room for resnet50-v100 (98 pages) beside tiny-sim models.
    config = write_config(folder, sim_executor(weights_bytes=256 << 20), extra=extra)
    process = DaemonProcess.start(folder, config)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.api, timeout_s=30.0) as connected:
        yield connected


def test_requests_are_answered_ok_with_their_own_rows(client: Client) -> None:
    futures = [client.submit("tiny", row(value), slo_ms=SLO_MS) for value in range(40)]
    results = [future.result(30) for future in futures]
    assert [r.status for r in results] == [Outcome.OK] * 40
    for value, result in enumerate(results):
        assert result.outputs["output"].shape == (1, 1000)
        assert result.outputs["output"][0, 0] == value
        assert result.executor_id == "local-0"
        assert result.timing_ns["total"] >= result.timing_ns["execute"] > 0


def test_no_reply_is_ok_after_its_deadline(client: Client) -> None:
    slos_ms = [0.05, 0.5, 1.0, 2.0, 3.0, 5.0, 20.0, 200.0] * 30  # 200 ms: some surely ok
    futures = [client.submit("tiny", row(i), slo_ms=slo) for i, slo in enumerate(slos_ms)]
    results = [future.result(30) for future in futures]
    statuses = {result.status for result in results}
    assert Outcome.OK in statuses
    # `late` (a result that came back after its deadline) is counted honestly, never as ok;
    # `overloaded`: 240 requests in one burst put the daemon's own loop behind what the
    # tightest SLOs allow (the door, docs/controller.md "The daemon as a lane").
    early = {Outcome.INFEASIBLE, Outcome.DROPPED, Outcome.LATE, Outcome.OVERLOADED}
    assert statuses - {Outcome.OK} <= early
    for slo_ms, result in zip(slos_ms, results, strict=True):
        if result.ok:
            assert result.timing_ns["total"] <= slo_ms * MS_NS
    assert results[0].status == Outcome.INFEASIBLE  # 50 µs: less than any execution


def test_absolute_deadlines_are_converted_from_unix_time(client: Client) -> None:
    past = client.infer("tiny", row(1), deadline_unix_ns=time.time_ns() - 1_000 * MS_NS)
    assert past.status == Outcome.INFEASIBLE
    assert "(0.00 ms left)" in past.message and "-" not in past.message  # not a -1000 ms SLO
    future = client.infer("tiny", row(2), deadline_unix_ns=time.time_ns() + 2_000 * MS_NS)
    assert future.ok and future.outputs["output"][0, 0] == 2


def test_deadlines_too_far_for_the_wire_are_bad_input_not_internal(client: Client) -> None:
    huge_slo = client.infer("tiny", row(1), slo_ms=1e15)
    assert huge_slo.status == Outcome.BAD_INPUT and "slo_ms" in huge_slo.message
    for distance_ns in (1 << 63, -(1 << 63)):
        far = client.infer("tiny", row(1), deadline_unix_ns=time.time_ns() + distance_ns)
        assert far.status == Outcome.BAD_INPUT and "deadline_unix_ns" in far.message
    assert client.infer("tiny", row(3), slo_ms=SLO_MS).ok


def test_unknown_models_and_bad_inputs_are_rejected_with_reasons(client: Client) -> None:
    unknown = client.infer("no-such-model", row(0), slo_ms=SLO_MS)
    assert unknown.status == Outcome.UNKNOWN_MODEL and "no-such-model" in unknown.message
    bad = client.infer("tiny", {"input": np.zeros((1, 5), np.float32)}, slo_ms=SLO_MS)
    assert bad.status == Outcome.BAD_INPUT and bad.message


def test_models_are_added_and_removed_at_runtime(daemon: DaemonProcess, client: Client) -> None:
    tiny = build_tiny(0).SerializeToString()
    status = client.add_model("tiny-copy", tiny)
    assert status.name == "tiny-copy" and status.batch_sizes
    assert client.infer("tiny-copy", row(7), slo_ms=SLO_MS).outputs["output"][0, 0] == 7
    assert (Path(daemon_repository(daemon)) / "tiny-copy" / "model.onnx").read_bytes() == tiny
    client.remove_model("tiny-copy")
    assert client.infer("tiny-copy", row(0), slo_ms=SLO_MS).status == Outcome.UNKNOWN_MODEL
    assert "tiny-copy" not in {model.name for model in client.models()}
    assert not (Path(daemon_repository(daemon)) / "tiny-copy").exists()


def test_adding_onto_a_taken_name_is_model_exists(client: Client) -> None:
    with pytest.raises(ApiError) as refused:
        client.add_model("tiny", TINY_FILE)
    assert refused.value.code == "model_exists"
    assert client.infer("tiny", row(2), slo_ms=SLO_MS).ok


async def test_a_replace_finishes_sent_requests_on_the_old_version(daemon: DaemonProcess) -> None:
    image = {"input": np.full((1, 3, 224, 224), 9.0, np.float32)}
    async with (
        await AsyncClient.connect(daemon.api) as sender,
        await AsyncClient.connect(daemon.api) as admin,
    ):
        await admin.add_model("swap", TINY_FILE, 'sim_profile = "resnet50-v100"\n')
        try:
            sent = [sender.start_infer("swap", image, slo_ms=SLO_MS) for _ in range(64)]
            await sender.ping()  # the daemon has read (and routed) every one of them
            status = await admin.add_model("swap", TINY_FILE, replace=True)  # tiny-sim rows
            assert status.version == 2 and status.inputs[0].shape == (-1, 4)
            old = [await pending for pending in sent]
            # Each answered by version 1. On a loaded machine, 38 MB of images can put the
            # daemon's loop past its door (runtime.max_loop_delay_ns): the last are refused
            # `overloaded` at once (by version 1 still). Whatever the replace did, it is not that.
            assert {r.model_version for r in old} == {1}
            assert {r.status for r in old} <= {Outcome.OK, Outcome.OVERLOADED}
            assert Outcome.OK in {r.status for r in old}
            new = await sender.infer("swap", row(6), slo_ms=SLO_MS)
            assert new.ok and new.model_version == 2 and new.outputs["output"][0, 0] == 6
            listed = {m.name: m.version for m in await admin.models()}
            assert listed["swap"] == 2 and listed["tiny"] == 1
        finally:
            await admin.remove_model("swap")


def test_copies_become_instances_sharing_one_file(client: Client) -> None:
    client.add_model("twin", build_tiny(0).SerializeToString(), "copies = 2\n")
    try:
        names = {model.name for model in client.models()}
        assert {"twin-0", "twin-1"} <= names and "twin" not in names
        for name in ("twin-0", "twin-1"):
            assert client.infer(name, row(3), slo_ms=SLO_MS).ok
        with pytest.raises(ApiError) as refused:
            client.remove_model("twin-0")
        assert refused.value.code == "model_exists"
    finally:
        client.remove_model("twin")
    assert not {"twin-0", "twin-1"} & {model.name for model in client.models()}


def test_a_model_can_run_as_another_simulated_profile(client: Client) -> None:
    status = client.add_model("resnet", TINY_FILE, 'sim_profile = "resnet50-v100"\n')
    try:
        assert status.inputs[0].shape == (-1, 3, 224, 224)  # the profile's, not the file's
        image = np.full((1, 3, 224, 224), 9.0, np.float32)
        result = client.infer("resnet", {"input": image}, slo_ms=SLO_MS)
        assert result.ok and result.outputs["output"][0, 0] == 9.0
        assert result.timing_ns["execute"] >= 2_000_000  # ResNet50 on a V100: 2.73 ms at b1
        assert client.infer("tiny", row(4), slo_ms=SLO_MS).ok  # beside tiny-sim models
    finally:
        client.remove_model("resnet")


def test_registration_over_the_weights_budget_fails_clearly(client: Client) -> None:
    other = build_tiny(1).SerializeToString()  # another content hash: more host weights
    with pytest.raises(ApiError) as refused:
        client.add_model("heavy", other)
    assert refused.value.code == "unavailable"
    assert "weights_budget_bytes" in refused.value.message
    assert "heavy" not in {model.name for model in client.models()}


def test_bad_uploads_are_refused_and_leave_nothing(daemon: DaemonProcess, client: Client) -> None:
    with pytest.raises(ApiError) as refused:
        client.add_model("junk", b"this is not an onnx file")
    assert refused.value.code == "bad_model"
    assert not (Path(daemon_repository(daemon)) / "junk").exists()


def test_stats_health_and_metrics_are_served(daemon: DaemonProcess, client: Client) -> None:
    assert client.infer("tiny", row(0), slo_ms=SLO_MS).ok
    stats = client.stats()
    assert stats["daemon"]["state"] == "serving"
    assert [e["executor_id"] for e in stats["executors"] if e["up"]] == ["local-0"]
    assert "tiny" in {model["name"] for model in stats["models"]}
    assert stats["outcomes"]["ok"] >= 1
    health = client.health()
    assert health.live and health.ready
    assert daemon.http_get("/healthz") == (200, "ok\n")
    assert daemon.http_get("/readyz") == (200, "ready\n")
    status, text = daemon.http_get("/metrics")
    assert status == 200
    ok = metric_value(text, "clockwork_requests_total", {"group": "tiny", "outcome": "ok"})
    assert ok is not None and ok >= 1
    assert metric_value(text, "clockwork_executor_up", {"executor": "local-0"}) == 1.0
    assert (metric_value(text, "clockwork_models_registered") or 0) >= 1
    assert (metric_value(text, "clockwork_event_loop_lag_seconds_count") or 0) >= 1
    assert (metric_value(text, "clockwork_client_connections") or 0) >= 1


def daemon_repository(daemon: DaemonProcess) -> str:
    """The repository folder of a daemon started by `DaemonProcess.start` (beside its log)."""
    return str(daemon.log_path.parent / "models")


def test_a_bad_config_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, sim_executor(), extra="bogus_key = 1")
    finished = run_serve(tmp_path, ["--config", str(config)])
    assert finished.returncode == 2
    assert finished.stderr.count("\n") == 1
    assert finished.stderr.startswith("clockwork-async serve: config repository.bogus_key = 1")


def test_a_busy_port_fails_the_start_with_status_1(tmp_path: Path) -> None:
    add_tiny(tmp_path / "models")
    config = write_config(tmp_path, sim_executor())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--config", str(config), "--set", f"server.listen=127.0.0.1:{port}"]
        finished = run_serve(tmp_path, args)
    assert finished.returncode == 1
    assert f"server.listen = 127.0.0.1:{port}: the client API cannot" in finished.stderr
    assert "executor local-0" not in finished.stderr  # the port failed it before any executor
    assert "daemon stopped" in finished.stderr


def test_sighup_registers_new_folders_and_drops_removed_ones(
    daemon: DaemonProcess, client: Client
) -> None:
    folder = add_tiny(Path(daemon_repository(daemon)), "by-hand")
    (Path(daemon_repository(daemon)) / "no-model").mkdir()
    daemon.signal(signal.SIGHUP)
    _wait_for_models(client, lambda names: "by-hand" in names)
    _wait_for_log(daemon, "rescan: added ['by-hand']")
    assert "skipped [no-model (no-model/ has no model.onnx)]" in daemon.log()
    (Path(daemon_repository(daemon)) / "no-model").rmdir()
    assert client.infer("by-hand", row(5), slo_ms=SLO_MS).outputs["output"][0, 0] == 5
    shutil.rmtree(folder)
    daemon.signal(signal.SIGHUP)
    _wait_for_models(client, lambda names: "by-hand" not in names)
    assert client.infer("by-hand", row(5)).status == Outcome.UNKNOWN_MODEL
    assert client.infer("tiny", row(1), slo_ms=SLO_MS).ok


def _wait_for_log(daemon: DaemonProcess, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in daemon.log():
        assert time.monotonic() < deadline, f"{text!r} not logged"
        time.sleep(0.05)


def _wait_for_models(
    client: Client, done: Callable[[set[str]], bool], timeout_s: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done({model.name for model in client.models()}):
        assert time.monotonic() < deadline, "the rescan did not happen"
        time.sleep(0.05)
