"""The Open Inference Protocol (KServe v2) front ends in `benchmarks.fuzz_api`: fuzzed HTTP
requests and gRPC calls and bytes, and the well-behaved v2 clients that measure while they go.

HTTP (`HttpMaker`, `http_connection`): each connection sends a run of requests the daemon
answers and keeps the connection for (valid JSON and binary infers of ``tiny``, and infers
with odd values: unknown models and versions, wrong datatypes and shapes, short data, NaN,
bad ``slo_ms``/``timeout``/``priority``, missing fields, malformed JSON, binary lengths that
disagree with the header or the body, an ``Inference-Header-Content-Length`` past the body,
unknown paths and methods, health and metadata), then usually one hostile request after
which the daemon should close: a declared body over the size limit, a bad ``Content-Length``,
random bytes, bit flips of a valid request, a head over 64 KiB or over 100 headers, a bad
chunked body, or a request cut short (the daemon waits for its bytes: counted
``waited_for_more_bytes`` when this side half-closes after 5 s). Replies are parsed
(`http_loadgen.ReplyParser`) and counted by status.

gRPC (`GrpcMaker`, `grpc_calls`, `grpc_raw_connection`): calls on a ``grpc.aio`` channel:
``ModelInfer`` with odd requests (as HTTP's), its serialized bytes bit-flipped or cut, random
bytes as the message, unknown methods, and now and then a message over the size limit; and
raw TCP connections to the gRPC port carrying random bytes, a truncated or broken HTTP/2
preface, or the preface then garbage frames (the server should close them). Statuses counted.

Invariant: makers draw from a seeded `random.Random` and do no I/O, so a run repeats.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from benchmarks.http_loadgen import ReplyParser

MODEL = "tiny"
INPUT = "input"
ROW = [0.0, 1.0, 2.0, 3.0]
READ_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 5.0
RAW_CLOSE_WAIT_S = 2.0  # raw bytes to the gRPC port: a cut preface waits for more
GRPC_CALL_TIMEOUT_S = 10.0
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # grpc.max_message_bytes's default
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


# --- HTTP requests (no I/O) ----------------------------------------------------------------------


def http_request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def infer_json(model: str = MODEL, **changes: Any) -> dict[str, Any]:
    tensor = {"name": INPUT, "shape": [1, 4], "datatype": "FP32", "data": ROW}
    tensor |= changes.pop("tensor", {})
    return {"id": "fuzz", "parameters": {"slo_ms": 100}, "inputs": [tensor], **changes}


def post_json(document: Any, path: str = f"/v2/models/{MODEL}/infer") -> bytes:
    body = json.dumps(document).encode()
    return http_request("POST", path, body, {"Content-Type": "application/json"})


def post_binary(raw: bytes, declared: int, header_length: int | None = None) -> bytes:
    """A binary-extension infer of ``raw`` declaring ``declared`` bytes for the input; the
    header length is the true one unless given."""
    tensor = {"name": INPUT, "shape": [1, 4], "datatype": "FP32"}
    tensor["parameters"] = {"binary_data_size": declared}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    length = len(header) if header_length is None else header_length
    headers = {"Inference-Header-Content-Length": str(length)}
    return http_request("POST", f"/v2/models/{MODEL}/infer", header + raw, headers)


ROW_BYTES = b"".join(int.to_bytes(v, 4, "little") for v in (0, 0x3F800000, 0x40000000, 0x40400000))


class HttpMaker:
    """Seeded HTTP requests: ``odd`` ones are answered on a kept connection; ``hostile`` ones
    should end it (or are cut short)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        r = self.rng
        self._odd: list[Callable[[], bytes]] = [
            lambda: post_json(infer_json()),
            lambda: post_binary(ROW_BYTES, 16),
            lambda: post_json(infer_json(model="zz" + r.choice(["", "x" * 300, "../tiny"]))),
            lambda: post_json(infer_json(), f"/v2/models/{MODEL}/versions/{r.randrange(99)}/infer"),
            lambda: post_json(infer_json(tensor={"datatype": r.choice(["INT8", "BYTES", "X"])})),
            lambda: post_json(infer_json(tensor={"shape": r.choice([[1, 3], [4], [], [-1, 4]])})),
            lambda: post_json(infer_json(tensor={"data": ROW[: r.randrange(4)]})),
            lambda: post_json(infer_json(tensor={"data": [math.nan, math.inf, 1e300, -0.0]})),
            lambda: post_json(infer_json(tensor={"name": r.choice(["x", "", 7, None])})),
            lambda: post_json(infer_json(parameters={"slo_ms": self._odd_value()})),
            lambda: post_json(infer_json(parameters={"timeout": self._odd_value()})),
            lambda: post_json(infer_json(parameters={"priority": self._odd_value()})),
            lambda: post_json(infer_json(id=self._odd_value())),
            lambda: post_json(r.choice([{}, [], None, 1, {"inputs": {}}, {"inputs": [1]}])),
            lambda: post_json(infer_json(outputs=[{"name": "nope"}])),
            lambda: http_request("POST", f"/v2/models/{MODEL}/infer", b"{not json"),
            lambda: http_request("POST", f"/v2/models/{MODEL}/infer", r.randbytes(64)),
            lambda: post_binary(ROW_BYTES, r.choice([0, 8, 15, 17, 2**40])),
            lambda: post_binary(ROW_BYTES[: r.randrange(16)], 16),
            lambda: post_binary(ROW_BYTES + b"extra", 16),
            lambda: post_binary(ROW_BYTES, 16, header_length=r.choice([0, 10**6, 2**63])),
            lambda: post_binary(ROW_BYTES, 16, header_length=-1),
            lambda: http_request("GET", f"/v2/models/{MODEL}/infer"),
            lambda: http_request("GET", r.choice(["/", "/v3", "/v2/models/", "/v2/%00", "*"])),
            lambda: http_request("GET", r.choice(["/v2/health/ready", "/v2", "/v2/models/tiny"])),
            lambda: http_request("POST", "/v2/repository/index", b'{"ready": true}'),
            lambda: http_request("DELETE", f"/v2/models/{MODEL}"),
        ]
        self._hostile: list[Callable[[], bytes]] = [
            self._too_large,
            self._bad_length,
            self._random_bytes,
            self._bit_flips,
            self._huge_head,
            self._many_headers,
            self._bad_chunks,
            self._truncated,
        ]

    def _odd_value(self) -> Any:
        return self.rng.choice([-1, 0, 1e-9, 1e300, "5", None, [1], {"a": 1}, True, 2**70])

    def odd(self) -> bytes:
        return self.rng.choice(self._odd)()

    def _too_large(self) -> bytes:
        size = self.rng.choice([64 * 1024 * 1024 + 1, 2**40, 2**63 - 1])
        head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: fuzz\r\nContent-Length: {size}"
        return (head + "\r\n\r\n").encode() + self.rng.randbytes(16)

    def _bad_length(self) -> bytes:
        value = self.rng.choice(["-1", "abc", "1 2", "", "0x10", "99999999999999999999999"])
        head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: fuzz\r\nContent-Length: {value}"
        return (head + "\r\n\r\n{}").encode()

    def _random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randrange(1, 300)) + b"\r\n\r\n"

    def _bit_flips(self) -> bytes:
        data = bytearray(self.rng.choice(self._odd[:2])())
        for _ in range(self.rng.randrange(1, 5)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def _huge_head(self) -> bytes:
        return http_request("GET", "/v2/health/live", headers={"X-Big": "a" * (70 * 1024)})

    def _many_headers(self) -> bytes:
        headers = {f"X-{i}": "1" for i in range(150)}
        return http_request("GET", "/v2/health/live", headers=headers)

    def _bad_chunks(self) -> bytes:
        head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: fuzz\r\n"
        head += "Transfer-Encoding: chunked\r\n\r\n"
        body = self.rng.choice([b"zz\r\nabc\r\n0\r\n\r\n", b"ffffffffffffffff\r\n", b"5\r\nab"])
        return head.encode() + body

    def _truncated(self) -> bytes:
        whole = self.odd()
        return whole[: self.rng.randrange(1, len(whole))]

    def connection(self) -> tuple[list[bytes], bool]:
        """The requests of one connection (the answered ones first), and whether the last
        should end it (a hostile one; a truncated one makes the daemon wait for bytes)."""
        requests = [self.odd() for _ in range(self.rng.randrange(0, 20))]
        if self.rng.random() < 0.2:
            return requests, False
        hostile = self.rng.choice(self._hostile)
        return [*requests, hostile()], True


# --- HTTP connections ----------------------------------------------------------------------------


async def http_connection(
    host: str, port: int, requests: list[bytes], hostile: bool, counts: Counter[str]
) -> None:
    """Send ``requests`` and read the replies of the answered ones (all but a hostile last).
    After a hostile one the daemon gets 5 s to close or answer it on a kept connection, then
    this side half-closes and gives it READ_TIMEOUT_S more before counting the connection
    hung."""
    reader, writer = await asyncio.open_connection(host, port)
    counts["connections"] += 1
    state = _Replies(counts)
    try:
        writer.writelines(requests)
        await writer.drain()
        answered = len(requests) - int(hostile)
        while state.replies < answered:
            data = await asyncio.wait_for(reader.read(65536), READ_TIMEOUT_S)
            if not data:
                counts["closed_before_all_answers"] += 1
                return
            state.take(data)
        if not hostile:
            return
        done = lambda: state.replies >= len(requests) and state.kept  # noqa: E731
        if await _settle(reader, state, done, CLOSE_WAIT_S, counts):
            return
        counts["waited_for_more_bytes"] += 1
        writer.write_eof()
        if not await _settle(reader, state, done, READ_TIMEOUT_S, counts):
            counts["hung"] += 1
    except TimeoutError:
        counts["hung"] += 1
    except (ConnectionError, OSError):
        counts["reset_by_server"] += 1
    except ValueError:  # a reply ReplyParser cannot read
        counts["unparsable_reply"] += 1
    finally:
        writer.close()


class _Replies:
    """Replies read on one connection, counted by status; whether the last kept it open."""

    def __init__(self, counts: Counter[str]) -> None:
        self.counts = counts
        self.parser = ReplyParser()
        self.replies = 0
        self.kept = True

    def take(self, data: bytes) -> None:
        for status, keep in self.parser.feed(data):
            self.replies += 1
            self.kept = keep
            self.counts[f"http:{status}"] += 1


async def _settle(
    reader: asyncio.StreamReader,
    state: _Replies,
    done: Callable[[], bool],
    timeout_s: float,
    counts: Counter[str],
) -> bool:
    """Whether, within ``timeout_s``, the daemon closed or ``done()`` came true."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            data = await asyncio.wait_for(reader.read(65536), left)
        except TimeoutError:
            return False
        if not data:
            counts["closed_by_server"] += 1
            return True
        state.take(data)
        if done():
            counts["answered_and_kept"] += 1
            return True
    return False


# --- gRPC (no I/O) -------------------------------------------------------------------------------


class GrpcMaker:
    """Seeded gRPC work: serialized ``ModelInfer`` messages (odd or mangled), and raw bytes
    for TCP connections to the gRPC port."""

    def __init__(self, seed: int) -> None:
        from tritonclient.grpc import service_pb2

        self.pb = service_pb2
        self.rng = random.Random(seed)

    def request(self, **changes: Any) -> Any:
        pb = self.pb
        request = pb.ModelInferRequest(model_name=changes.get("model", MODEL), id="fuzz")
        tensor = request.inputs.add()
        tensor.name = changes.get("name", INPUT)
        tensor.datatype = changes.get("datatype", "FP32")
        tensor.shape.extend(changes.get("shape", [1, 4]))
        request.raw_input_contents.append(changes.get("raw", ROW_BYTES))
        for key, value in changes.get("parameters", {"slo_ms": 100.0}).items():
            parameter = request.parameters[key]
            if isinstance(value, bool):
                parameter.bool_param = value
            elif isinstance(value, int):
                parameter.int64_param = value
            elif isinstance(value, float):
                parameter.double_param = value
            else:
                parameter.string_param = str(value)
        return request

    def message(self) -> tuple[str, bytes]:
        """(method path, serialized request) of one call."""
        r = self.rng
        odd = [
            lambda: self.request(),
            lambda: self.request(model=r.choice(["zz", "", "x" * 300])),
            lambda: self.request(datatype=r.choice(["INT8", "BYTES", "X", ""])),
            lambda: self.request(shape=r.choice([[1, 3], [4], [], [2**40, 4], [-1, 4]])),
            lambda: self.request(raw=ROW_BYTES[: r.randrange(16)] + b"\x00" * r.choice([0, 9])),
            lambda: self.request(name=r.choice(["x", ""])),
            lambda: self.request(parameters={"slo_ms": r.choice([-1.0, 0.0, 1e300, "x"])}),
            lambda: self.request(parameters={"timeout": r.choice([-1, 0, 2**62])}),
            lambda: self.request(parameters={"priority": r.choice([-1, 2**62, True])}),
            lambda: self.pb.ModelInferRequest(model_name=MODEL),  # no inputs
        ]
        draw = r.random()
        if draw < 0.7:
            return INFER_METHOD, r.choice(odd)().SerializeToString()
        valid = self.request().SerializeToString()
        if draw < 0.8:
            data = bytearray(valid)
            for _ in range(r.randrange(1, 5)):
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            return INFER_METHOD, bytes(data)
        if draw < 0.9:
            return INFER_METHOD, valid[: r.randrange(len(valid))]
        if draw < 0.95:
            return INFER_METHOD, r.randbytes(r.randrange(1, 500))
        method = r.choice(["/inference.GRPCInferenceService/Nope", "/x/y", "/"])
        return method, valid

    def oversized(self) -> bytes:
        """One ModelInfer message just over the default size limit."""
        return self.request(raw=b"\x00" * (GRPC_MAX_MESSAGE_BYTES + 16)).SerializeToString()

    def raw_bytes(self) -> bytes:
        """The bytes of one raw TCP connection to the gRPC port."""
        r = self.rng
        frames = [
            lambda: r.randbytes(r.randrange(1, 500)),
            lambda: H2_PREFACE[: r.randrange(1, len(H2_PREFACE))],
            lambda: H2_PREFACE + r.randbytes(r.randrange(1, 500)),
            lambda: H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + r.randbytes(64),
            lambda: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        ]
        return r.choice(frames)()


# --- gRPC I/O ------------------------------------------------------------------------------------


async def grpc_calls(address: str, maker: GrpcMaker, calls: int, counts: Counter[str]) -> None:
    """``calls`` unary calls of `GrpcMaker.message` on one channel (one in 500 an oversized
    message), each counted by its status code."""
    import grpc

    identity: Callable[[bytes], bytes] = lambda data: data  # noqa: E731
    options = [("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        for _ in range(calls):
            method, message = maker.message()
            if maker.rng.random() < 0.002:
                method, message = INFER_METHOD, maker.oversized()
            call = channel.unary_unary(
                method, request_serializer=identity, response_deserializer=identity
            )
            try:
                await call(message, timeout=GRPC_CALL_TIMEOUT_S)
                counts["grpc:OK"] += 1
            except grpc.aio.AioRpcError as error:
                counts[f"grpc:{error.code().name}"] += 1
            counts["grpc_calls"] += 1


async def grpc_raw_connection(host: str, port: int, data: bytes, counts: Counter[str]) -> None:
    """Raw bytes to the gRPC port; the server should close within 2 s, else this side
    half-closes and waits READ_TIMEOUT_S more (then ``hung``)."""
    reader, writer = await asyncio.open_connection(host, port)
    counts["raw_connections"] += 1
    try:
        writer.write(data)
        await writer.drain()
        if not await _raw_closed(reader, RAW_CLOSE_WAIT_S):
            counts["waited_for_more_bytes"] += 1
            writer.write_eof()
            if not await _raw_closed(reader, READ_TIMEOUT_S):
                counts["hung"] += 1
                return
        counts["closed_by_server"] += 1
    except (ConnectionError, OSError):
        counts["reset_by_server"] += 1
    finally:
        writer.close()


async def _raw_closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            if not await asyncio.wait_for(reader.read(65536), left):
                return True
        except TimeoutError:
            return False
    return False


# --- the fuzzer's v2 part ------------------------------------------------------------------------


async def fuzz_http(address: str, total: int, connections: int, seed: int) -> dict[str, Any]:
    """About ``total`` requests over ``connections`` concurrent workers; returns counts."""
    host, _, port = address.rpartition(":")
    counts: Counter[str] = Counter()
    state = {"requests": 0}
    start = time.monotonic()

    async def worker(maker: HttpMaker) -> None:
        while state["requests"] < total:
            requests, hostile = maker.connection()
            state["requests"] += len(requests)
            counts["bytes"] += sum(len(r) for r in requests)
            try:
                await http_connection(host, int(port), requests, hostile, counts)
            except OSError:
                counts["connect_failed"] += 1

    await asyncio.gather(*(worker(HttpMaker(seed * 1000 + k)) for k in range(connections)))
    return _summary("requests", state["requests"], start, counts)


async def fuzz_grpc(address: str, total: int, connections: int, seed: int) -> dict[str, Any]:
    """About ``total`` calls and raw connections (one raw connection per 10 calls) over
    ``connections`` concurrent workers; returns counts."""
    host, _, port = address.rpartition(":")
    counts: Counter[str] = Counter()
    state = {"sent": 0}
    start = time.monotonic()

    async def worker(maker: GrpcMaker) -> None:
        while state["sent"] < total:
            state["sent"] += 11
            try:
                await grpc_calls(address, maker, 10, counts)
                await grpc_raw_connection(host, int(port), maker.raw_bytes(), counts)
            except OSError:
                counts["connect_failed"] += 1

    await asyncio.gather(*(worker(GrpcMaker(seed * 1000 + k)) for k in range(connections)))
    return _summary("sent", state["sent"], start, counts)


def _summary(name: str, sent: int, start: float, counts: Counter[str]) -> dict[str, Any]:
    elapsed_s = time.monotonic() - start
    return {
        name: sent,
        "seconds": round(elapsed_s, 2),
        "per_s": round(sent / elapsed_s, 1),
        "counts": dict(sorted(counts.items())),
    }


# --- well-behaved v2 clients ---------------------------------------------------------------------


async def v2_clients(http: str, grpc: str) -> tuple[dict[str, Any], Callable[[], Any]]:
    """Well-behaved ``tritonclient`` infers (HTTP JSON, gRPC), each returning a status;
    and a function closing the clients."""
    import numpy as np
    import tritonclient.grpc.aio as triton_grpc
    import tritonclient.http.aio as triton_http
    from tritonclient.utils import InferenceServerException

    row = np.asarray([ROW], np.float32)
    http_client = triton_http.InferenceServerClient(http)
    grpc_client = triton_grpc.InferenceServerClient(grpc)

    async def http_infer() -> str:
        tensor = triton_http.InferInput(INPUT, [1, 4], "FP32")
        tensor.set_data_from_numpy(row, binary_data=False)
        try:
            await http_client.infer(MODEL, [tensor], parameters={"slo_ms": 100})
        except InferenceServerException as error:
            return f"error:{error.status()}"
        return "ok"

    async def grpc_infer() -> str:
        tensor = triton_grpc.InferInput(INPUT, [1, 4], "FP32")
        tensor.set_data_from_numpy(row)
        try:
            await grpc_client.infer(MODEL, [tensor], parameters={"slo_ms": 100})
        except InferenceServerException as error:
            return f"error:{error.status()}"
        return "ok"

    async def close() -> None:
        await http_client.close()
        await grpc_client.close()

    return {"http": http_infer, "grpc": grpc_infer}, close
