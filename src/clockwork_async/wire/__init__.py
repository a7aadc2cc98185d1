"""The wire protocol: typed messages (`messages`), their checked schema (`schema`) and the
framing codec (`codec`). Nothing here does I/O; `clockwork_async.connection` adapts it to
asyncio."""

from clockwork_async.wire.codec import (
    DEFAULT_LIMITS,
    Decoder,
    DecoderState,
    EncodeError,
    Encoder,
    Limits,
    ProtocolError,
)

__all__ = [
    "DEFAULT_LIMITS",
    "Decoder",
    "DecoderState",
    "EncodeError",
    "Encoder",
    "Limits",
    "ProtocolError",
]
