"""The Open Inference Protocol bodies the peer benchmarks send (`benchmarks.http_loadgen`) are
read back exactly, row for row, by the daemon's own v2 codec and by the Ray peer's replica
(`benchmarks.ray_app.v2_row`), so the comparisons measure what they say; and the v2 fuzzer's
makers (`benchmarks.fuzz_v2`) repeat from their seed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from benchmarks.fuzz_v2 import HttpMaker
from benchmarks.http_loadgen import request_body
from benchmarks.ray_app import v2_reply, v2_row

from clockwork_async.api.v2_tensors import build_inputs, parse_request

ROW = np.random.default_rng(7).random((1, 3, 4, 4), dtype=np.float32)


def _split(body: bytes, headers: dict[str, str]) -> tuple[bytes, bytes]:
    length = headers.get("Inference-Header-Content-Length")
    cut = len(body) if length is None else int(length)
    return body[:cut], body[cut:]


@pytest.mark.parametrize("protocol", ["v2-binary", "v2-json"])
def test_the_daemon_codec_reads_the_row_and_the_slo(protocol: str) -> None:
    body, headers = request_body(protocol, "image", ROW, 12.5)
    header_bytes, binary = _split(body, headers)
    header = parse_request(header_bytes)
    inputs = build_inputs(header, binary)
    assert list(inputs) == ["image"]
    assert inputs["image"].dtype == np.float32
    assert np.array_equal(inputs["image"], ROW)
    assert json.loads(header_bytes)["parameters"]["timeout"] == 12_500  # µs


@pytest.mark.parametrize("protocol", ["v2-binary", "v2-json"])
def test_the_ray_replica_reads_the_row_and_answers_in_kind(protocol: str) -> None:
    body, headers = request_body(protocol, "image", ROW, 100.0)
    row, binary = v2_row(body, headers.get("Inference-Header-Content-Length"), ROW.shape)
    assert np.array_equal(row, ROW)
    assert binary == (protocol == "v2-binary")
    output = np.arange(10, dtype=np.float32).reshape(1, 10)
    reply, reply_headers = v2_reply("out", output, binary)
    header_bytes, tail = _split(reply, {k.title(): v for k, v in reply_headers.items()})
    (tensor,) = json.loads(header_bytes)["outputs"]
    got = np.frombuffer(tail, np.float32) if binary else np.asarray(tensor["data"], np.float32)
    assert np.array_equal(got.reshape(tensor["shape"]), output)


def test_raw_bodies_are_the_row_bytes() -> None:
    body, headers = request_body("raw", "image", ROW, 100.0)
    assert body == ROW.tobytes()
    assert headers == {"Content-Type": "application/octet-stream"}


def test_the_http_fuzzer_repeats_from_its_seed() -> None:
    first = [HttpMaker(3).connection() for _ in range(1)]
    again = [HttpMaker(3).connection() for _ in range(1)]
    other = [HttpMaker(4).connection() for _ in range(1)]
    assert first == again
    assert first != other
