"""The libFuzzer target of `benchmarks.fuzz_atheris` (run as its child process; see there).

    python -m benchmarks.fuzz_atheris_target CORPUS_DIR [libFuzzer flags]

Invariants it checks per input (any violation raises, which libFuzzer reports as a crash with
the input saved): the decoder returns messages or raises `ProtocolError`, nothing else; what
it returns re-encodes to the same bytes after a second decode; the client API handler, fed the
same bytes then end of input over an in-memory transport, ends within `HANDLER_TIMEOUT_S`,
logs no ERROR, writes only decodable frames, sends exactly the ``error`` the oracle predicts
(last, or none) and, for clean input, one ``infer_reply`` per ``infer_request``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

HANDLER_TIMEOUT_S = 5.0
MAX_YIELDS = 1000  # loop rounds an input may take to be read before it counts as stuck


def _import_instrumented() -> None:
    """Import the modules under test inside atheris's instrumentation (before anything else
    imports them), so libFuzzer sees their branch coverage."""
    import atheris

    with atheris.instrument_imports(include=["clockwork_async"]):
        import clockwork_async.api.server
        import clockwork_async.api.session
        import clockwork_async.connection
        import clockwork_async.wire.codec
        import clockwork_async.wire.messages
        import clockwork_async.wire.schema  # noqa: F401


if __name__ == "__main__":
    _import_instrumented()

from clockwork_async.api.server import ApiServer, ServerLimits  # noqa: E402
from clockwork_async.api.service import Health, InferOutcome  # noqa: E402
from clockwork_async.connection import Connection  # noqa: E402
from clockwork_async.core.outcomes import Outcome  # noqa: E402
from clockwork_async.endpoints import _WireProtocol  # noqa: E402
from clockwork_async.wire.codec import Decoder, Encoder, ProtocolError  # noqa: E402
from clockwork_async.wire.messages import (  # noqa: E402
    PROTOCOL_VERSION,
    AddModel,
    CancelInfer,
    Error,
    GetHealth,
    GetStats,
    Hello,
    InferReply,
    InferRequest,
    ListModels,
    Message,
    ModelStatus,
    Ping,
    RemoveModel,
)

CLIENT_TYPES = (InferRequest, CancelInfer, ListModels, AddModel, RemoveModel, GetStats, GetHealth)
CLIENT_TYPES += (Ping,)
LIMITS = ServerLimits()
WIRE_LIMITS = LIMITS.wire_limits()


class BugLogged(AssertionError):
    """The API logged at ERROR: its catch-all caught a bug."""


# --- stubs -------------------------------------------------------------------------------------


class StubService:
    """Answers every infer at once (``ok``, outputs = inputs; ``unknown_model`` for ``nope``)."""

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        on_reply: Callable[[InferOutcome], None],
    ) -> int:
        outcome = Outcome.UNKNOWN_MODEL if model == "nope" else Outcome.OK
        on_reply(InferOutcome(1, outcome, "", dict(inputs), {"queue": 1}, "stub", 1))
        return 1

    def cancel(self, request_id: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def screen(
        self, model: str, slo_ns: int | None, deadline_unix_ns: int | None, nbytes: int
    ) -> str | None:
        return None

    def refuse(
        self, model: str, reason: str, nbytes: int, on_reply: Callable[[InferOutcome], None]
    ) -> int:
        on_reply(InferOutcome(1, Outcome.OVERLOADED, reason, {}, {}, None, 0))
        return 1

    def list_models(self) -> list[ModelStatus]:
        return [ModelStatus("m", "m", "ready")]

    async def add_model(self, name: str, onnx_bytes: bytes, model_toml: str | None) -> ModelStatus:
        return ModelStatus(name, name, "ready")

    async def remove_model(self, name: str) -> None:
        pass

    def stats(self) -> dict[str, object]:
        return {"stub": True}

    def health(self) -> Health:
        return Health(live=True, ready=True)


class MemoryTransport(asyncio.Transport):
    """Collects what the server writes; closing it tells the protocol, as a socket would."""

    def __init__(self, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self._protocol = protocol
        self.written = bytearray()
        self.closed = False
        self.reading_paused = False
        self._limits = (16 * 1024, 64 * 1024)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("fuzz", 0) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        high = 64 * 1024 if high is None else high
        self._limits = (high // 4 if low is None else low, high)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._limits

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:
            self.written += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()


class _ErrorTrap(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# --- the oracle ------------------------------------------------------------------------------


def decode_all(data: bytes, split: int) -> tuple[list[Message], ProtocolError | None]:
    """What a server-side decoder makes of ``data`` fed in two pieces; raises anything but
    ProtocolError (a crash)."""
    decoder = Decoder(WIRE_LIMITS, expect_hello=True)
    messages: list[Message] = []
    for piece in (data[:split], data[split:]):
        decoder.feed(piece)
        try:
            while (message := decoder.next_message()) is not None:
                messages.append(message)
        except ProtocolError as error:
            return messages, error
    return messages, None


def check_round_trip(message: Message) -> None:
    encoder = Encoder(WIRE_LIMITS)
    first = encoder.encode_bytes(message)
    decoder = Decoder(WIRE_LIMITS)
    decoder.feed(first)
    again = decoder.next_message()
    assert again is not None and type(again) is type(message), (message, again)
    second = encoder.encode_bytes(again)
    assert first == second, f"{type(message).__name__} changed in a round trip"


def expected_error(messages: list[Message], error: ProtocolError | None) -> str | None:
    """The code of the ``error`` the server must send for this input, or None."""
    if messages:
        first = messages[0]
        if not isinstance(first, Hello) or first.role != "client":
            return "protocol_error"
        if any(not isinstance(m, CLIENT_TYPES) for m in messages[1:]):
            return "protocol_error"
    return None if error is None else error.code.value


def check_output(written: bytes, messages: list[Message], error: ProtocolError | None) -> None:
    decoder = Decoder(WIRE_LIMITS)
    decoder.feed(written)
    replies: list[Message] = []
    while (message := decoder.next_message()) is not None:  # a ProtocolError is a crash
        replies.append(message)
    assert not decoder.mid_frame, "the server wrote a frame cut short"
    errors = [m for m in replies if isinstance(m, Error)]
    expected = expected_error(messages, error)
    if expected is None:
        assert not errors, f"unexpected error {errors}"
        requests = Counter(m.request_id for m in messages if isinstance(m, InferRequest))
        answered = Counter(m.request_id for m in replies if isinstance(m, InferReply))
        if messages:
            assert answered == requests, f"requests {requests} answered {answered}"
    else:
        assert len(errors) == 1 and replies[-1] is errors[0], f"expected {expected}: {replies}"
        assert errors[0].code == expected, f"expected {expected}, got {errors[0]}"


# --- driving the handler ---------------------------------------------------------------------


async def feed(protocol: _WireProtocol, transport: MemoryTransport, data: bytes) -> None:
    """Deliver ``data`` as a socket would: into the protocol's buffers, never while reading
    is paused (yielding to the loop until it resumes)."""
    view, yields = memoryview(data), 0
    while view and not transport.closed:
        if transport.reading_paused:
            yields += 1
            assert yields < MAX_YIELDS, "reading stayed paused"
            await asyncio.sleep(0)
            continue
        buffer = protocol.get_buffer(len(view))
        count = min(len(buffer), len(view))
        buffer[:count] = view[:count]
        protocol.buffer_updated(count)
        view = view[count:]
    await asyncio.sleep(0)


async def serve_once(api: ApiServer, data: bytes, split: int) -> bytes:
    connection = Connection(
        WIRE_LIMITS,
        expect_hello=True,
        max_queued_messages=LIMITS.max_queued_messages,
        max_queued_bytes=LIMITS.max_frame_bytes,
        write_high_water_bytes=LIMITS.max_write_buffer_bytes,
        allow_half_close=True,
    )
    protocol = _WireProtocol(connection)
    transport = MemoryTransport(protocol)
    protocol.connection_made(transport)
    handler = asyncio.get_running_loop().create_task(api._serve(connection))
    await feed(protocol, transport, data[:split])
    await feed(protocol, transport, data[split:])
    if not transport.closed and not protocol.eof_received():
        transport.close()
    await asyncio.wait_for(handler, HANDLER_TIMEOUT_S)
    transport.close()
    await asyncio.sleep(0)  # connection_lost
    return bytes(transport.written)


class Target:
    """One event loop and one serving ApiServer for every input."""

    def __init__(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.api = ApiServer(StubService(), limits=LIMITS)  # type: ignore[arg-type]
        self.loop.run_until_complete(self.api.start("127.0.0.1:0"))
        self.trap = _ErrorTrap()
        logger = logging.getLogger("clockwork_async")
        logger.addHandler(self.trap)
        logger.setLevel(logging.ERROR)
        logger.propagate = False

    def __call__(self, data: bytes) -> None:
        split = data[-1] * len(data) // 256 if data else 0
        messages, error = decode_all(data, split)
        for message in messages:
            check_round_trip(message)
        written = self.loop.run_until_complete(serve_once(self.api, data, split))
        if self.trap.records:
            record = self.trap.records[0]
            raise BugLogged(f"{record.getMessage()}\n{record.exc_text or ''}")
        check_output(written, messages, error)


# --- seeds -----------------------------------------------------------------------------------


def seed_inputs() -> list[bytes]:
    """Valid client conversations, one message type each (and a few together)."""
    encoder = Encoder(WIRE_LIMITS)
    hello = encoder.encode_bytes(Hello(PROTOCOL_VERSION, "client", "seed"))
    row = np.arange(4, dtype=np.float32).reshape(1, 4)
    onnx = np.frombuffer(b"ONNX-bytes", np.uint8)
    bodies: list[Message] = [
        InferRequest(1, "m", {"x": row}, slo_ms=20.0),
        InferRequest(2, "nope", {"x": row}, deadline_unix_ns=1),
        InferRequest(3, "m", {"a": row, "b": row.astype(np.int64)}),
        CancelInfer(1),
        ListModels(4),
        AddModel(5, "m2", {"model.onnx": onnx}, "name = 'm2'"),
        RemoveModel(6, "m2"),
        GetStats(7),
        GetHealth(8),
        Ping(9, 10),
    ]
    seeds = [hello] + [hello + encoder.encode_bytes(body) for body in bodies]
    seeds.append(hello + b"".join(encoder.encode_bytes(body) for body in bodies))
    return seeds


def main() -> None:
    import atheris

    target = Target()
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
