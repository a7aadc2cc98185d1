"""``[http]`` and ``[grpc]``: the Open Inference Protocol front ends' config sections.

Their own module, free of the front ends' libraries, so that reading the config (which the CLI
does before anything slow) imports neither httptools nor grpcio. Tokens, TLS and the caps on
requests in flight are the ``[server]`` section's, shared by every front end.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork_async.config.keys import ranged
from clockwork_async.wire.addresses import TcpAddress

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_HTTP_LISTEN = TcpAddress("127.0.0.1", 8000)  # the port Triton's HTTP clients default to
DEFAULT_GRPC_LISTEN = TcpAddress("127.0.0.1", 8001)  # and its gRPC clients


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """``[http]``: the Open Inference Protocol over HTTP/REST (docs/protocol-v2.md)."""

    enabled: bool = True
    listen: TcpAddress = DEFAULT_HTTP_LISTEN
    max_body_bytes: int = ranged(64 * MiB, 1024, 2 * GiB)  # one request's body: else 413
    max_connections: int = ranged(1024, 1, 1_000_000)  # open at once: more are closed at once
    request_timeout_s: float = ranged(30.0, 0.1, 3600.0)  # first byte to whole request: else 408
    idle_timeout_s: float = ranged(60.0, 0.1, 3600.0)  # a kept-alive connection with no request


@dataclass(frozen=True, slots=True)
class GrpcConfig:
    """``[grpc]``: the Open Inference Protocol over gRPC (docs/protocol-v2.md)."""

    enabled: bool = True
    listen: TcpAddress = DEFAULT_GRPC_LISTEN
    max_message_bytes: int = ranged(64 * MiB, 1024, 2 * GiB - 1)  # either way: else refused
    max_concurrent_streams: int = ranged(1024, 1, 1_000_000)  # requests at once per connection
