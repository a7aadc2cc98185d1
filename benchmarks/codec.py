"""Wire codec cost: encode and decode of a small Infer, a 602 KB Infer and an ActionResult.

    python -m benchmarks.codec [--quick] [--json results/codec.json]

"Receive" rows model a socket with memcpy: bytes of a ready frame are copied, 64 KiB at a time,
into the buffers the decoder lends (`get_buffer`, as a BufferedProtocol transport does with
recv_into) or into one preallocated receive buffer that `msgpack.unpackb` then parses (the
baseline: a tensor as a msgpack ``bin``, which unpackb copies once more). Times are per message,
median and p99 over many repeats, in microseconds, on whatever machine runs this.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from benchmarks.lib import percentile
from clockwork_async.wire.codec import Decoder, Encoder
from clockwork_async.wire.messages import ActionResult, Infer, Message

RECV_CHUNK_BYTES = 64 << 10  # what libuv asks for per read


def _cases() -> dict[str, Message]:
    rng = np.random.default_rng(0)
    image = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)  # 602,112 bytes
    small = rng.standard_normal((1, 16), dtype=np.float32)
    logits = rng.standard_normal((1, 1000), dtype=np.float32)
    durations_ns = {"copy_in": 12_000, "execute": 2_730_000, "copy_out": 9_000}
    return {
        "small_infer": Infer(1, "mlp", 1, {"x": small}, 10**12, 10**12 + 10**6),
        "image_infer_602KB": Infer(2, "resnet50", 1, {"x": image}, 10**12, 10**12 + 10**7),
        "action_result": ActionResult(3, "", "", 1, 2, durations_ns, {"y": logits}, 60),
    }


def _timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    for _ in range(min(repeats, 50)):
        fn()  # warm up caches and the allocator
    gc.collect()
    samples_ns = []
    for _ in range(repeats):
        start_ns = time.perf_counter_ns()
        fn()
        samples_ns.append(time.perf_counter_ns() - start_ns)
    ordered = sorted(samples_ns)
    return {
        "median_us": percentile(ordered, 50) / 1000,
        "p99_us": percentile(ordered, 99) / 1000,
        "n": repeats,
    }


def _receive_into_decoder(decoder: Decoder, frame: memoryview) -> Message | None:
    position = 0
    while position < len(frame):
        buffer = decoder.get_buffer(RECV_CHUNK_BYTES)
        count = min(len(buffer), RECV_CHUNK_BYTES, len(frame) - position)
        buffer[:count] = frame[position : position + count]
        decoder.buffer_updated(count)
        position += count
    return decoder.next_message()


def _receive_then_unpackb(receive_buffer: memoryview, frame: memoryview) -> Any:
    for position in range(0, len(frame), RECV_CHUNK_BYTES):
        chunk = frame[position : position + RECV_CHUNK_BYTES]
        receive_buffer[position : position + len(chunk)] = chunk
    header = msgpack.unpackb(receive_buffer[: len(frame)], raw=False)
    return np.frombuffer(header["x"], np.float32).reshape(header["shape"])


def _codec_rows(name: str, message: Message, repeats: int) -> dict[str, dict[str, float]]:
    encoder, decoder = Encoder(), Decoder()
    frame = memoryview(encoder.encode_bytes(message))
    return {
        f"{name}: encode (pieces)": _timed(lambda: encoder.encode(message), repeats),
        f"{name}: encode_bytes (joined)": _timed(lambda: encoder.encode_bytes(message), repeats),
        f"{name}: decode via feed": _timed(lambda: _feed_one(decoder, frame), repeats),
        f"{name}: receive+decode via get_buffer": _timed(
            lambda: _receive_into_decoder(decoder, frame), repeats
        ),
    }


def _feed_one(decoder: Decoder, frame: memoryview) -> Message | None:
    decoder.feed(frame)
    return decoder.next_message()


def _baseline_rows(message: Infer, repeats: int) -> dict[str, dict[str, float]]:
    array = message.inputs["x"]
    packer = msgpack.Packer(use_bin_type=True)
    packed = memoryview(packer.pack({"x": array.tobytes(), "shape": list(array.shape)}))
    receive_buffer = memoryview(bytearray(len(packed)))
    return {
        "image_infer_602KB: baseline receive+unpackb(bin)": _timed(
            lambda: _receive_then_unpackb(receive_buffer, packed), repeats
        ),
        "image_infer_602KB: baseline reused Packer.pack(bin)": _timed(
            lambda: packer.pack({"x": array.data, "shape": list(array.shape)}), repeats
        ),
    }


def run(repeats: int) -> dict[str, dict[str, float]]:
    """Every row name -> {median_us, p99_us, n}."""
    rows: dict[str, dict[str, float]] = {}
    cases = _cases()
    for name, message in cases.items():
        rows.update(_codec_rows(name, message, repeats))
    image = cases["image_infer_602KB"]
    assert isinstance(image, Infer)
    rows.update(_baseline_rows(image, repeats))
    return rows


def _table(rows: dict[str, dict[str, float]]) -> str:
    width = max(map(len, rows))
    lines = [f"{'case':<{width}}  {'median µs':>10}  {'p99 µs':>10}"]
    for name, row in rows.items():
        lines.append(f"{name:<{width}}  {row['median_us']:>10.1f}  {row['p99_us']:>10.1f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codec", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run")
    parser.add_argument("--json", type=Path, default=Path("results/codec.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    repeats = 300 if args.quick else 5000
    rows = run(repeats)
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "python": platform.python_version()}
    machine["cpus"] = str(os.cpu_count())
    report = {"benchmark": "codec", "quick": args.quick, "machine": machine, "rows": rows}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
