"""The pieces of the real-time buckets benchmark (`benchmarks.buckets_real`) that decide what
it measures: the model it generates masks its padding (so its ``pad = true`` is honest), both
of its declarations register as intended, and the length mix is the skewed one it documents,
the same for the same seed. Nothing is timed and no daemon runs here."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from benchmarks.buckets_real import (
    BUCKETS,
    Inputs,
    by_request_rows,
    draw_lengths,
    model_toml,
    text_model,
)

from clockwork_async.models.axes import Dimension
from clockwork_async.models.info import read_model_info


def test_zero_padding_changes_no_answer_of_the_generated_model() -> None:
    session = ort.InferenceSession(text_model(), providers=["CPUExecutionProvider"])
    row = Inputs(1).of(20)
    (own,) = session.run(None, row)
    padded = {
        "ids": np.pad(row["ids"], ((0, 0), (0, 12))),
        "mask": np.pad(row["mask"], ((0, 0), (0, 12))),
    }
    (at_bucket,) = session.run(None, padded)
    assert own.shape == (1, 256)
    np.testing.assert_allclose(at_bucket, own, rtol=1e-5, atol=1e-6)
    assert not np.allclose(own, session.run(None, Inputs(2).of(20))[0])  # ids matter


def test_the_two_declarations_are_five_buckets_and_one() -> None:
    places = (("ids", 1), ("mask", 1))
    for buckets in (BUCKETS, BUCKETS[-1:]):
        info = read_model_info("text", text_model(), model_toml(buckets).encode())
        assert info.shapes is not None and info.shapes.pad
        assert info.shapes.dimensions == (Dimension("tokens", buckets, places, min_length=1),)


def test_lengths_are_mostly_short_within_the_buckets_and_repeat_by_seed() -> None:
    lengths = draw_lengths(20_000, 5)
    assert lengths.min() >= 1 and lengths.max() <= BUCKETS[-1]
    assert 0.47 < float(np.mean(lengths <= 32)) < 0.53
    assert 0.05 < float(np.mean(lengths > 256)) < 0.075
    np.testing.assert_array_equal(lengths, draw_lengths(20_000, 5))


def test_rows_are_summed_per_request_bucket() -> None:
    columns = {
        "status": ["ok", "late", "ok", "overloaded"],
        "latency_ns": [2_000_000, 60_000_000, 4_000_000, 100_000],
        "batch_size": [1, 2, 4, 0],
    }
    found = by_request_rows(columns, np.array([3, 30, 500, 511]))
    assert found["by_bucket"][32]["requests"] == 2
    assert found["by_bucket"][32]["ok_share"] == 0.5
    assert found["by_bucket"][32]["latency_ms"]["p50"] == 2.0
    assert found["by_bucket"][512]["ok_share"] == 0.5
    assert found["by_bucket"][64]["ok_share"] is None
    assert found["mean_batch"] == round(7 / 3, 2)
