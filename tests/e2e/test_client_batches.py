"""Client batches on the msgpack API in a real daemon (docs/protocol.md, "Client batches"): an
N-row request answers what its N rows answer one by one and what ONNX Runtime computes for
the N rows directly; more rows than the model's largest batch is ``bad_input`` naming the
limit; the CLI sends an N-row tensor; through the IO arena the rows go by reference from the
request's one slot, which comes back after every case (answered, refused, or the client gone
mid-batch)."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.client import Client
from clockwork_async.daemon.lifecycle import Daemon
from clockwork_async.endpoints import open_connection
from clockwork_async.models.demo import build_mlp, build_tiny
from clockwork_async.wire.messages import PROTOCOL_VERSION, Hello, InferRequest

from .harness import DaemonProcess, clean_environ, ort_executor, write_config
from .test_io_arena import _spy_infers, _until_empty, daemon, slow_daemon

__all__ = ["daemon", "slow_daemon"]  # the in-process daemons' fixtures, from test_io_arena

SLO_MS = 5_000.0
MODELS = {"tiny": build_tiny, "mlp": build_mlp}


@pytest.fixture(scope="module")
def ort_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("batches")
    for name, build in MODELS.items():
        (folder / "models" / name).mkdir(parents=True)
        (folder / "models" / name / "model.onnx").write_bytes(build(0).SerializeToString())
    process = DaemonProcess.start(folder, write_config(folder, ort_executor()))
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def client(ort_daemon: DaemonProcess) -> Iterator[Client]:
    with Client(ort_daemon.api, timeout_s=60.0) as connected:
        yield connected


def _largest_batch(client: Client, model: str) -> int:
    (status,) = [status for status in client.models() if status.name == model]
    return max(status.batch_sizes)


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    # Rows may run in batches of other sizes than the direct run's: float32 rounding at the
    # output's scale (kernels sum in another order), as tests/e2e/test_daemon_ort.py allows.
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_batch_equals_its_rows_and_onnx_runtime(
    ort_daemon: DaemonProcess, client: Client, model: str
) -> None:
    session = onnxruntime.InferenceSession(
        str(ort_daemon.log_path.parent / "models" / model / "model.onnx"),
        providers=["CPUExecutionProvider"],
    )
    (spec,) = session.get_inputs()
    (output,) = session.get_outputs()
    rows = _largest_batch(client, model)
    assert rows > 1
    batch = np.random.default_rng(5).standard_normal((rows, spec.shape[1])).astype(np.float32)
    result = client.infer(model, {spec.name: batch}, slo_ms=SLO_MS)
    assert result.ok, result.message
    got = result.outputs[output.name]
    assert got.shape[0] == rows
    _close(got, session.run(None, {spec.name: batch})[0])
    for row, got_row in zip(batch, got, strict=True):
        alone = client.infer(model, {spec.name: row[None]}, slo_ms=SLO_MS)
        assert alone.ok, alone.message
        _close(got_row[None], alone.outputs[output.name])


def test_more_rows_than_the_largest_batch_are_bad_input(client: Client) -> None:
    limit = _largest_batch(client, "mlp")
    batch = np.zeros((limit + 1, 784), np.float32)
    refused = client.infer("mlp", {"x": batch}, slo_ms=SLO_MS)
    assert refused.status == "bad_input", refused
    assert f"limit of {limit} rows" in refused.message
    assert client.infer("mlp", {"x": batch[:limit]}, slo_ms=SLO_MS).ok


def test_the_cli_sends_an_n_row_tensor(
    ort_daemon: DaemonProcess, client: Client, tmp_path: Path
) -> None:
    np.save(tmp_path / "x.npy", np.ones((3, 16), np.float32))
    base = [sys.executable, "-m", "clockwork_async", "infer", "tiny", "--address", ort_daemon.api]
    env = clean_environ(tmp_path)
    for source in (["--input", f"x={tmp_path / 'x.npy'}"], ["--random", "--rows", "3"]):
        done = subprocess.run(
            [*base, *source, "--slo-ms", "5000", "--output-dir", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("ok\n"), done.stdout
        assert np.load(tmp_path / "out" / "y.npy").shape[0] == 3


async def test_batch_rows_go_by_reference_and_the_slot_comes_back(daemon: Daemon) -> None:
    arena = daemon.io_arena
    assert arena is not None
    async with AsyncClient(daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=2_000)
        assert warm.ok, warm  # the LOAD
        (status,) = [s for s in await client.models() if s.name == "tiny"]
        rows = max(status.batch_sizes)
        assert rows > 1
        sent = _spy_infers(daemon)
        batch = np.repeat(np.arange(rows, dtype=np.float32)[:, None], 4, axis=1)
        results = await asyncio.gather(
            *(client.infer("tiny", {"input": batch}, slo_ms=2_000) for _ in range(5))
        )
        past = time.time_ns() - 1_000_000_000
        refused = await client.infer("tiny", {"input": batch}, deadline_unix_ns=past)
    for result in results:
        assert result.ok, result
        assert result.outputs["output"].shape == (rows, 1000)
        np.testing.assert_array_equal(result.outputs["output"][:, 0], batch[:, 0])  # in order
    assert refused.status == "infeasible" and not refused.outputs, refused
    assert sent and all(m.arena_inputs and m.arena_outputs and not m.inputs for m in sent)
    await _until_empty(arena)


async def test_a_client_gone_mid_batch_gives_the_slot_back(slow_daemon: Daemon) -> None:
    arena = slow_daemon.io_arena
    assert arena is not None
    async with AsyncClient(slow_daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
        assert warm.ok, warm
        (status,) = [s for s in await client.models() if s.name == "tiny"]
    sent = _spy_infers(slow_daemon)
    connection = await open_connection(slow_daemon.api_address)
    connection.send(Hello(PROTOCOL_VERSION, "client", "raw", ""))
    assert isinstance(await asyncio.wait_for(connection.recv(), 5.0), Hello)
    batch = np.ones((max(status.batch_sizes), 4), np.float32)
    for request_id in range(3):
        connection.send(InferRequest(request_id, "tiny", {"input": batch}, slo_ms=20_000))
    while not sent:
        await asyncio.sleep(0.005)
    assert arena.used_bytes
    sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.abort()  # a reset, rows running and queued
    await _until_empty(arena)
    async with AsyncClient(slow_daemon.api_address) as client:  # and it still serves
        assert (await client.infer("tiny", {"input": batch}, slo_ms=20_000)).ok
