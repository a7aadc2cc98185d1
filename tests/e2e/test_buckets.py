"""Models served by shape buckets, end to end: a real daemon with one ONNX Runtime executor.
``seq`` (an embedding and the mean over ``tokens``: padding would change its output) declares
three lengths and no padding, so requests must have one of them exactly; ``tok`` (masked:
zero padding changes nothing) pads requests up to their bucket and cuts its ``hidden`` output
back to the request's own length. Outputs equal ONNX Runtime run directly at the request's own
shapes; each bucket is its own core model (``NAME~LEN``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from clockwork_async.client import Client
from clockwork_async.core.outcomes import Outcome
from typed_models import (
    BUCKETS,
    MASKED_TOKENS_TOML,
    SEQUENCE_BUCKETS_TOML,
    masked_tokens_model,
    sequence_model,
)

from .harness import DaemonProcess, ort_executor, write_config
from .test_typed_models import FAST_PROFILING, SLO_MS, direct_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("buckets")
    config = write_config(folder, ort_executor(), sections=FAST_PROFILING)
    started = DaemonProcess.start(folder, config)
    try:
        with Client(started.api, timeout_s=120.0) as connected:
            connected.add_model("seq", sequence_model(), SEQUENCE_BUCKETS_TOML)
            connected.add_model("tok", masked_tokens_model(), MASKED_TOKENS_TOML)
        yield started
    finally:
        assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.api, timeout_s=120.0) as connected:
        yield connected


def ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 20, (1, length), dtype=np.int64)


def test_each_bucket_is_a_core_model_and_the_name_lists_its_largest_shape(client: Client) -> None:
    listed = {m.name: m for m in client.models()}
    assert listed["seq"].inputs[0].shape == (-1, BUCKETS[-1])
    core = {m["name"] for m in client.stats()["models"]}  # type: ignore[union-attr]
    assert {f"seq~{length}" for length in BUCKETS} <= core
    assert {f"tok~{length}" for length in BUCKETS} <= core


def test_exact_lengths_of_a_model_that_does_not_pad_equal_a_direct_run(client: Client) -> None:
    rows = [{"ids": ids(length, seed)} for seed, length in enumerate(BUCKETS * 3)]
    futures = [client.submit("seq", row, slo_ms=SLO_MS) for row in rows]
    for row, future in zip(rows, futures, strict=True):
        result = future.result(60)
        assert result.status == Outcome.OK, result.message
        np.testing.assert_allclose(
            result.outputs["y"], direct_run(sequence_model(), row)["y"], rtol=1e-6
        )
    listed = {m.name: m for m in client.models()}
    assert listed["seq"].state == "loaded"  # any bucket's copy counts


def v2_infer(daemon: DaemonProcess, model: str, ids: np.ndarray) -> tuple[int, dict[str, Any]]:
    """A KServe v2 JSON infer over HTTP: (status, body)."""
    tensor = {"name": "ids", "datatype": "INT64", "shape": list(ids.shape)}
    body = json.dumps({"inputs": [{**tensor, "data": ids.ravel().tolist()}]}).encode()
    url = f"http://{daemon.http}/v2/models/{model}/infer"
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_v2_front_end_serves_buckets_row_by_row(daemon: DaemonProcess) -> None:
    batch = np.concatenate([ids(8, 1), ids(8, 2)])
    status, body = v2_infer(daemon, "seq", batch)
    assert status == 200, body
    (output,) = body["outputs"]
    got = np.array(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_allclose(got, direct_run(sequence_model(), {"ids": batch})["y"], rtol=1e-6)
    status, body = v2_infer(daemon, "seq", ids(5, 0))
    assert status == 400 and "it takes only [4, 8, 12]" in body["error"], body


def test_a_length_between_buckets_is_bad_input_when_the_model_does_not_pad(
    client: Client,
) -> None:
    result = client.infer("seq", {"ids": ids(5, 0)}, slo_ms=SLO_MS)
    assert result.status == Outcome.BAD_INPUT
    assert result.message == (
        "input 'ids' axis 1 ('tokens') has length 5; it takes only [4, 8, 12] "
        "(this model does not pad)"
    )


@pytest.mark.parametrize("length", [1, 3, 4, 7, 12])
def test_padded_requests_answer_their_own_length_like_a_direct_run(
    client: Client, length: int
) -> None:
    row = {"ids": ids(length, length), "mask": np.ones((1, length), np.float32)}
    result = client.infer("tok", row, slo_ms=SLO_MS)
    assert result.status == Outcome.OK, result.message
    expected = direct_run(masked_tokens_model(), row)
    assert result.outputs["hidden"].shape == (1, length, 4)
    np.testing.assert_array_equal(result.outputs["hidden"], expected["hidden"])
    np.testing.assert_allclose(result.outputs["pooled"], expected["pooled"], rtol=1e-6)


def test_mixed_padded_lengths_at_once_each_get_their_own_answer(client: Client) -> None:
    rows = [
        {"ids": ids(length, seed), "mask": np.ones((1, length), np.float32)}
        for seed, length in enumerate([2, 9, 4, 11, 6, 12, 1, 8])
    ]
    futures = [client.submit("tok", row, slo_ms=SLO_MS) for row in rows]
    for row, future in zip(rows, futures, strict=True):
        result = future.result(60)
        assert result.status == Outcome.OK, result.message
        expected = direct_run(masked_tokens_model(), row)
        np.testing.assert_array_equal(result.outputs["hidden"], expected["hidden"])
        np.testing.assert_allclose(result.outputs["pooled"], expected["pooled"], rtol=1e-6)


def test_over_the_largest_bucket_or_disagreeing_lengths_are_bad_input(client: Client) -> None:
    long = {"ids": ids(13, 0), "mask": np.ones((1, 13), np.float32)}
    result = client.infer("tok", long, slo_ms=SLO_MS)
    assert result.status == Outcome.BAD_INPUT
    assert "input 'ids' axis 1 ('tokens') has length 13, over its largest bucket" in result.message
    uneven = {"ids": ids(3, 0), "mask": np.ones((1, 5), np.float32)}
    result = client.infer("tok", uneven, slo_ms=SLO_MS)
    assert result.status == Outcome.BAD_INPUT
    assert "along axis 'tokens'" in result.message
    empty = {"ids": np.zeros((1, 0), np.int64), "mask": np.zeros((1, 0), np.float32)}
    result = client.infer("tok", empty, slo_ms=SLO_MS)
    assert result.status == Outcome.BAD_INPUT
    assert "has length 0, under its declared min 1" in result.message
