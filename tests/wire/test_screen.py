"""A `Screen` sees each frame's header before its tail: a refused frame keeps none of its
tensor bytes and comes out as `Screened`, in order, whatever the read sizes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from clockwork_async.wire.codec import Decoder, Encoder, Screened
from clockwork_async.wire.messages import InferRequest, Ping

ROW = np.arange(1 << 16, dtype=np.float32).reshape(1, -1)  # 256 KiB of tensor bytes


def _frames() -> bytes:
    encoder = Encoder()
    messages = [
        InferRequest(1, "keep", {"x": ROW}, slo_ms=10.0),
        InferRequest(2, "door", {"x": ROW}, slo_ms=5.0),
        Ping(7, 0),
        InferRequest(3, "keep", {"x": ROW[:, :4]}),
    ]
    return b"".join(encoder.encode_bytes(m) for m in messages)


def _screen(seen: list[tuple[str, int]]) -> Any:
    def screen(cls: type[Any], fields: Mapping[str, Any], nbytes: int) -> str | None:
        if cls is InferRequest:
            seen.append((fields["model"], nbytes))
            return "busy" if fields["model"] == "door" else None
        return None

    return screen


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_screened_frame_comes_out_in_order_without_its_tensors(chunk: int) -> None:
    seen: list[tuple[str, int]] = []
    decoder = Decoder(screen=_screen(seen))
    data = memoryview(_frames())
    for start in range(0, len(data), chunk):  # through the BufferedProtocol pair
        piece = data[start : start + chunk]
        while len(piece):
            buffer = decoder.get_buffer()
            count = min(len(buffer), len(piece))
            buffer[:count] = piece[:count]
            decoder.buffer_updated(count)
            piece = piece[count:]
    out = []
    while (message := decoder.next_message()) is not None:
        out.append(message)
    first, screened, ping, last = out
    assert isinstance(first, InferRequest) and np.array_equal(first.inputs["x"], ROW)
    assert isinstance(screened, Screened) and screened.cls is InferRequest
    assert screened.fields["request_id"] == 2 and screened.reason == "busy"
    assert "inputs" not in screened.fields  # its tensors were never kept
    assert isinstance(ping, Ping) and isinstance(last, InferRequest)
    assert [model for model, _ in seen] == ["keep", "door", "keep"]
    assert seen[1][1] >= ROW.nbytes  # the screen saw the tail's size


def test_feeding_bytes_screens_the_same() -> None:
    decoder = Decoder(screen=_screen([]))
    decoder.feed(_frames())
    kinds = []
    while (message := decoder.next_message()) is not None:
        kinds.append(type(message).__name__)
    assert kinds == ["InferRequest", "Screened", "Ping", "InferRequest"]


@pytest.mark.parametrize("chunk", [3, 4096, 1 << 20])
def test_a_lent_buffer_receives_the_tail_and_the_tensors_are_views_of_it(chunk: int) -> None:
    seen: list[tuple[str, int]] = []
    memory = np.zeros(1 << 19, np.uint8)  # stands for the IO arena
    lent: list[np.ndarray] = []

    def lend(nbytes: int) -> np.ndarray | None:
        if lent:  # only the first screened-in tail; the others get their own buffer
            return None
        lent.append(memory[64 : 64 + nbytes])
        return lent[-1]

    decoder = Decoder(screen=_screen(seen))
    decoder.lend = lend
    data = memoryview(_frames())
    for start in range(0, len(data), chunk):
        decoder.feed(data[start : start + chunk])
    first = decoder.next_message()
    assert isinstance(first, InferRequest) and np.array_equal(first.inputs["x"], ROW)
    assert np.shares_memory(first.inputs["x"], memory)  # read straight into the lent slot
    messages = [decoder.next_message() for _ in range(3)]
    last = messages[-1]
    assert isinstance(last, InferRequest) and not np.shares_memory(last.inputs["x"], memory)


def test_a_lent_buffer_of_the_wrong_size_is_not_used() -> None:
    decoder = Decoder(screen=_screen([]))
    decoder.lend = lambda nbytes: np.zeros(nbytes + 1, np.uint8)
    decoder.feed(Encoder().encode_bytes(InferRequest(1, "keep", {"x": ROW})))
    message = decoder.next_message()
    assert isinstance(message, InferRequest) and np.array_equal(message.inputs["x"], ROW)
