"""The Open Inference Protocol's tensors through the IO arena in a running daemon (one
simulated executor process): HTTP (JSON and binary) and gRPC requests go to the executor by
reference, their outputs equal the msgpack client's bit for bit, and the arena's occupancy
returns to zero after every case: answered, a client gone mid-body, a client gone while its
request runs, a cancelled gRPC call."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import tritonclient.grpc.aio as triton_aio
import tritonclient.http as triton_http

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.daemon.lifecycle import Daemon

from .test_io_arena import _arena, _spy_infers, _until_empty, daemon, slow_daemon

__all__ = ["daemon", "slow_daemon"]  # the fixtures, shared with test_io_arena
SLO_MS = 5_000.0


def _address(daemon: Daemon, front_end: str) -> str:
    assert daemon.front_ends is not None
    return daemon.front_ends.addresses[front_end]


def _http_infer(address: str, row: np.ndarray, *, binary: bool) -> np.ndarray:
    client = triton_http.InferenceServerClient(address, network_timeout=30.0)
    try:
        tensor = triton_http.InferInput("input", list(row.shape), "FP32")
        tensor.set_data_from_numpy(row, binary_data=binary)
        wanted = triton_http.InferRequestedOutput("output", binary_data=binary)
        result = client.infer("tiny", [tensor], outputs=[wanted], parameters={"slo_ms": SLO_MS})
        output = result.as_numpy("output")
        assert output is not None
        return np.asarray(output)
    finally:
        client.close()


async def _grpc_infer(address: str, row: np.ndarray) -> np.ndarray:
    client = triton_aio.InferenceServerClient(address)
    try:
        tensor = triton_aio.InferInput("input", list(row.shape), "FP32")
        tensor.set_data_from_numpy(row)
        result = await client.infer("tiny", [tensor], parameters={"slo_ms": SLO_MS})
        output = result.as_numpy("output")
        assert output is not None
        return np.asarray(output)
    finally:
        await client.close()


async def test_v2_tensors_go_by_reference_and_equal_the_msgpack_clients(daemon: Daemon) -> None:
    arena = _arena(daemon)
    http, grpc = _address(daemon, "http"), _address(daemon, "grpc")
    async with AsyncClient(daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=SLO_MS)
        assert warm.ok, warm  # the LOAD
        sent = _spy_infers(daemon)
        for i in range(3):
            row = np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)
            expected = (await client.infer("tiny", {"input": row}, slo_ms=SLO_MS)).outputs
            for got in (
                await asyncio.to_thread(_http_infer, http, row, binary=False),
                await asyncio.to_thread(_http_infer, http, row, binary=True),
                await _grpc_infer(grpc, row),
            ):
                np.testing.assert_array_equal(got, expected["output"])
    batch = np.arange(16, dtype=np.float32).reshape(4, 4)  # a client batch: a slot per row
    stacked = await asyncio.to_thread(_http_infer, http, batch, binary=True)
    assert stacked.shape == (4, 1000) and list(stacked[:, 0]) == [0.0, 4.0, 8.0, 12.0]
    assert len(sent) >= 10 and all(
        m.arena_inputs and m.arena_outputs and not m.inputs for m in sent
    )
    await _until_empty(arena)


async def test_clients_gone_mid_body_or_mid_request_and_cancelled_calls_leave_nothing(
    slow_daemon: Daemon,
) -> None:
    arena = _arena(slow_daemon)
    http, grpc = _address(slow_daemon, "http"), _address(slow_daemon, "grpc")
    async with AsyncClient(slow_daemon.api_address) as client:
        warm = await client.infer("tiny", {"input": np.ones((1, 4), np.float32)}, slo_ms=20_000)
        assert warm.ok, warm
    tensor = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    json_body = json.dumps({"inputs": [tensor]}).encode()
    binary = {**tensor, "parameters": {"binary_data_size": 16}}
    del binary["data"]
    header = json.dumps({"inputs": [binary]}).encode()
    binary_body = header + np.ones(4, np.float32).tobytes()
    host, port = http.rsplit(":", 1)

    def gone(body: bytes, cut_bytes: int, wait_s: float, *headers: str) -> int:
        """Send ``body`` less its last ``cut_bytes``, wait, go; the arena's bytes in use."""
        head = "".join(f"{line}\r\n" for line in (f"content-length: {len(body)}", *headers))
        start = f"POST /v2/models/tiny/infer HTTP/1.1\r\nhost: x\r\n{head}\r\n".encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(start + body[: len(body) - cut_bytes])
            time.sleep(wait_s)  # read by the daemon (and, whole, its request running)
            return arena.used_bytes

    sent = _spy_infers(slow_daemon)
    await asyncio.to_thread(gone, json_body, 10, 0.2)  # mid-body
    await _until_empty(arena)
    length = f"inference-header-content-length: {len(header)}"
    assert await asyncio.to_thread(gone, binary_body, 8, 0.2, length)  # mid-body, in a slot
    await _until_empty(arena)
    for body, more in ((json_body, ()), (binary_body, (length,))):
        await asyncio.to_thread(gone, body, 0, 0.01, *more)  # whole, then gone while it runs
        await _until_empty(arena)

    grpc_client = triton_aio.InferenceServerClient(grpc)
    try:
        held = triton_aio.InferInput("input", [1, 4], "FP32")
        held.set_data_from_numpy(np.ones((1, 4), np.float32))
        before = len(sent)
        call = asyncio.ensure_future(grpc_client.infer("tiny", [held], client_timeout=20.0))
        while len(sent) == before and not call.done():
            await asyncio.sleep(0.002)
        assert arena.used_bytes  # its slot, in the executor's hands
        call.cancel()
    finally:
        await grpc_client.close()
    await _until_empty(arena)
