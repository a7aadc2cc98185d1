"""Python clients of the daemon's client API: `AsyncClient` (asyncio, `api.async_client`) and
`Client` (blocking). Both pipeline: many calls may be in flight on one connection at once.

Invariant: `Client` runs one `AsyncClient` on an event loop in a background thread it owns;
its methods block the calling thread only, and may be called from many threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar, Unpack

import numpy as np

from clockwork_async.api.async_client import (
    DEFAULT_ADDRESS,
    ApiError,
    AsyncClient,
    ClientError,
    ConnectError,
    ConnectionClosedError,
    ConnectOptions,
    Deadline,
    Health,
    InferResult,
    ModelStatus,
    PendingInfer,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "ApiError",
    "AsyncClient",
    "Client",
    "ClientError",
    "ConnectError",
    "ConnectOptions",
    "ConnectionClosedError",
    "Deadline",
    "Health",
    "InferResult",
    "ModelStatus",
    "PendingInfer",
]

T = TypeVar("T")


class Client:
    """A blocking client: an `AsyncClient` on an event loop in a background thread. Calls
    may come from many threads at once (they pipeline); `submit` returns a future."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        connect_timeout_s: float = 10.0,
        timeout_s: float | None = None,
        **options: Unpack[ConnectOptions],
    ) -> None:
        """Connect (raises ConnectError, ValueError) as `AsyncClient.connect` does, within
        ``connect_timeout_s``. ``timeout_s`` bounds each call (TimeoutError, after cancelling
        it); None waits for the reply or the connection's end."""
        self.timeout_s = timeout_s
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="clockwork-client")
        self._thread.daemon = True
        self._thread.start()
        connect = AsyncClient.connect(address, timeout_s=connect_timeout_s, **options)
        try:
            self._client = self._run(connect, None)
        except BaseException:
            self._stop_loop()
            raise

    def submit(
        self, model: str, inputs: Mapping[str, np.ndarray], **deadline: Unpack[Deadline]
    ) -> concurrent.futures.Future[InferResult]:
        """Send an infer; the future resolves to its InferResult (or ConnectionClosedError)."""
        return asyncio.run_coroutine_threadsafe(
            self._client.infer(model, inputs, **deadline), self._loop
        )

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], **deadline: Unpack[Deadline]
    ) -> InferResult:
        """Like `AsyncClient.infer`, blocking."""
        return self._run(self._client.infer(model, inputs, **deadline), self.timeout_s)

    def cancel(self, request_id: int) -> None:
        self._run(self._client.cancel(request_id), self.timeout_s)

    def models(self) -> list[ModelStatus]:
        return self._run(self._client.models(), self.timeout_s)

    def add_model(
        self,
        name: str,
        path_or_bytes: str | Path | bytes,
        model_toml: str | None = None,
        *,
        replace: bool = False,
        wait: bool = True,
    ) -> ModelStatus:
        adding = self._client.add_model(name, path_or_bytes, model_toml, replace=replace, wait=wait)
        return self._run(adding, self.timeout_s)

    def cancel_registration(self, name: str) -> ModelStatus:
        return self._run(self._client.cancel_registration(name), self.timeout_s)

    def remove_model(self, name: str) -> None:
        self._run(self._client.remove_model(name), self.timeout_s)

    def stats(self) -> dict[str, Any]:
        return self._run(self._client.stats(), self.timeout_s)

    def health(self) -> Health:
        return self._run(self._client.health(), self.timeout_s)

    def ping(self) -> int:
        return self._run(self._client.ping(), self.timeout_s)

    def close(self) -> None:
        """Close the connection and stop the background loop (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close(), 10.0)
        finally:
            self._stop_loop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no reply within {timeout_s:g} s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
