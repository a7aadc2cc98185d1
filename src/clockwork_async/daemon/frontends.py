"""The daemon's Open Inference Protocol front ends (``[http]``, ``[grpc]``) beside the msgpack
client API: built from the config, bound with the other ports, served, drained.

Invariants: each front end is built only when its section is enabled, and its library is
imported only then; a port that cannot be taken fails the start naming its key
(`FrontEndError`); both front ends take requests through the msgpack API server's door
(`api.v2_door.Door` over `api.server.ApiServer`), so they share its caps, tokens, routes and
drain; `close` stops them listening at once and gives their requests in flight the time given.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from pathlib import Path
from typing import Protocol

from clockwork_async import build
from clockwork_async.api.server import ApiServer
from clockwork_async.api.v2_config import GrpcConfig, HttpConfig
from clockwork_async.api.v2_door import Door
from clockwork_async.wire.addresses import TcpAddress

log = logging.getLogger("clockwork_async.daemon")


class FrontEndError(RuntimeError):
    """A front end could not start; the message names the config key."""


class _FrontEnd(Protocol):
    async def bind(self, listen: TcpAddress) -> str: ...

    async def serve(self) -> None: ...

    async def close(self, timeout_s: float) -> None: ...


class FrontEnds:
    """The enabled v2 front ends of one daemon."""

    def __init__(
        self,
        api: ApiServer,
        http: HttpConfig,
        grpc: GrpcConfig,
        *,
        ssl: ssl_module.SSLContext | None = None,
        tls_paths: tuple[Path, Path] | None = None,
    ) -> None:
        self._http_config = http
        self._grpc_config = grpc
        self._ends: dict[str, _FrontEnd] = {}
        self._auth_enabled = api.auth.enabled
        self.addresses: dict[str, str] = {}  # "http"/"grpc" -> HOST:PORT, once bound
        version = build.version()
        if http.enabled:
            from clockwork_async.api.v2_http import HttpFrontEnd

            door = Door(api, "http", server_version=version)
            self._ends["http"] = HttpFrontEnd(door, http, ssl=ssl)
        if grpc.enabled:
            from clockwork_async.api.v2_grpc import GrpcFrontEnd

            door = Door(api, "grpc", server_version=version)
            self._ends["grpc"] = GrpcFrontEnd(door, grpc, tls_paths=tls_paths)

    async def bind(self) -> None:
        """Take every enabled front end's address. Raises FrontEndError naming the key."""
        listens = {"http": self._http_config.listen, "grpc": self._grpc_config.listen}
        for name, end in self._ends.items():
            if not listens[name].is_loopback and not self._auth_enabled:
                log.warning(
                    "config: %s.listen %s is not loopback and has no tokens", name, listens[name]
                )
            try:
                self.addresses[name] = await end.bind(listens[name])
            except OSError as error:
                raise FrontEndError(
                    f"{name}.listen = {listens[name]}: the {name} front end cannot listen "
                    f"there: {error}"
                ) from error

    async def serve(self) -> None:
        for end in self._ends.values():
            await end.serve()

    async def close(self, timeout_s: float) -> None:
        await asyncio.gather(*(end.close(timeout_s) for end in self._ends.values()))

    def describe(self) -> str:
        """`` http=HOST:PORT grpc=HOST:PORT`` (``off`` for one switched off)."""
        return "".join(f" {name}={self.addresses.get(name, 'off')}" for name in ("http", "grpc"))
