"""Tools for hostile-client tests against the real daemon subprocess (simulated executors).

- `RawClient`: a blocking TCP (or TLS) socket that speaks frames by hand, so a test can send
  bytes no well-behaved client would, and read what the daemon answers until it closes.
- `GoodClient`: a well-behaved client in a thread that keeps sending infers while hostile
  clients run; every answer it gets must be ``ok``.
- `start_daemon`: the daemon on one simulated executor with the ``tiny`` model, everything
  under a test folder (see `e2e.harness.DaemonProcess`); stop it in a finally or fixture.
- `rss_bytes`, `open_fds`: a process's resident memory and open descriptors, from /proc.

Invariant: every socket here has a timeout, so no test waits forever on the daemon.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from clockwork_async.client import Client, InferResult
from clockwork_async.core.outcomes import Outcome
from e2e.harness import DaemonProcess, add_tiny, sim_executor, write_config

__all__ = [
    "CONNECTION_ERRORS",
    "PREFIX",
    "SLO_MS",
    "DaemonProcess",
    "Ending",
    "GoodClient",
    "RawClient",
    "frame",
    "hello_frame",
    "infer_frame",
    "infer_frames",
    "open_fds",
    "rss_bytes",
    "start_daemon",
    "wait_until",
]

PREFIX = struct.Struct(">II")
# The codes of an `error` message the client API may send before closing (docs/protocol.md 7, 9).
CONNECTION_ERRORS = frozenset(
    {"protocol_error", "frame_too_large", "unsupported_version", "unauthorized", "overloaded"}
)
SLO_MS = 5_000.0  # generous: the test machine is small and shared
READ_TIMEOUT_S = 15.0


def frame(header: Any, tail: bytes = b"") -> bytes:
    """One frame: the prefix, ``header`` packed as msgpack, then ``tail``."""
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(packed), len(tail)) + packed + tail


def hello_frame(
    version: Any = 1, role: Any = "client", name: Any = "hostile", token: Any = ""
) -> bytes:
    """The bytes of a ``hello`` (fields may be given wrong types on purpose)."""
    return frame(
        {"t": "hello", "protocol_version": version, "role": role, "name": name, "token": token}
    )


def infer_frame(request_id: int, value: float = 0.0, slo_ms: float = SLO_MS) -> bytes:
    """A valid ``infer_request`` for the ``tiny`` model: one row of 4 float32."""
    tail = np.full(4, value, np.float32).tobytes()
    header = {
        "t": "infer_request",
        "request_id": request_id,
        "model": "tiny",
        "inputs": {"input": ["float32", [1, 4], 0, len(tail)]},
        "slo_ms": slo_ms,
        "deadline_unix_ns": None,
    }
    return frame(header, tail)


def infer_frames(count: int, slo_ms: float = SLO_MS) -> bytes:
    """``count`` valid ``tiny`` infer requests back to back (ids from 2**20 up), made fast:
    one header packed once, its id patched (a msgpack uint32 always takes 5 bytes)."""
    template = infer_frame(0xFFFFFFFF, slo_ms=slo_ms)
    at = template.index(b"\xce\xff\xff\xff\xff")
    head, rest = template[:at], template[at + 5 :]
    return b"".join(
        b"%s\xce%s%s" % (head, (1 << 20 | i).to_bytes(4, "big"), rest) for i in range(count)
    )


@dataclass
class Ending:
    """What a `RawClient` read until the connection ended (or ``how`` = ``timeout``)."""

    headers: list[dict[str, Any]] = field(default_factory=list)
    how: str = "eof"  # eof | reset | timeout

    @property
    def errors(self) -> list[str]:
        """The codes of the ``error`` messages received."""
        return [h.get("code", "") for h in self.headers if h.get("t") == "error"]

    def tags(self) -> list[str]:
        return [str(h.get("t")) for h in self.headers]


class RawClient:
    """A socket that sends raw bytes and reads frames. Use as a context manager."""

    def __init__(
        self, address: str, *, tls: ssl.SSLContext | None = None, timeout_s: float = 5.0
    ) -> None:
        host, _, port = address.rpartition(":")
        plain = socket.create_connection((host, int(port)), timeout=timeout_s)
        wrapped = None if tls is None else tls.wrap_socket(plain, server_hostname=host)
        self.sock: socket.socket = plain if wrapped is None else wrapped
        self._buffer = bytearray()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes) -> bool:
        """Send ``data``; False if the daemon had closed the connection already."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, TimeoutError):
            return False
        return True

    def end_writing(self) -> None:
        """Half-close: the daemon sees end of input (a frame cut short stays cut short)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def hello(self, token: str = "") -> dict[str, Any]:
        """Send a client hello and return the daemon's answer (a hello or an error)."""
        self.send(hello_frame(token=token))
        header = self.read_frame(READ_TIMEOUT_S)
        assert header is not None, "the daemon closed the connection instead of answering"
        return header

    def read_frame(self, timeout_s: float) -> dict[str, Any] | None:
        """The next frame's header (its tail is skipped); None at end of input. Raises
        TimeoutError, ConnectionResetError."""
        self.sock.settimeout(timeout_s)
        prefix = self._read_exactly(PREFIX.size)
        if prefix is None:
            return None
        header_len, tail_len = PREFIX.unpack(prefix)
        body = self._read_exactly(header_len + tail_len)
        assert body is not None, "the daemon closed the connection mid-frame"
        header = msgpack.unpackb(body[:header_len], raw=False)
        assert isinstance(header, dict) and "t" in header, f"not a message: {header!r}"
        return header

    def read_until_closed(self, timeout_s: float = READ_TIMEOUT_S) -> Ending:
        """Every frame until the daemon closes the connection (or ``timeout_s`` passes)."""
        ending = Ending()
        deadline = time.monotonic() + timeout_s
        try:
            while (left_s := deadline - time.monotonic()) > 0:
                header = self.read_frame(left_s)
                if header is None:
                    return ending
                ending.headers.append(header)
            ending.how = "timeout"
        except TimeoutError:
            ending.how = "timeout"
        except (ConnectionResetError, ssl.SSLError):
            ending.how = "reset"
        return ending

    def _read_exactly(self, count: int) -> bytes | None:
        """``count`` bytes; None at end of input before any of them."""
        while len(self._buffer) < count:
            chunk = self.sock.recv(max(65536, count - len(self._buffer)))
            if not chunk:
                assert not self._buffer, "the daemon closed the connection mid-frame"
                return None
            self._buffer += chunk
        data, self._buffer = bytes(self._buffer[:count]), self._buffer[count:]
        return data


class GoodClient:
    """A well-behaved client in a thread: an infer every ``period_s`` until `stop`. `stop`
    returns the statuses it got; exceptions (a closed connection, a timeout) are statuses
    too, named after their class."""

    def __init__(
        self,
        address: str,
        *,
        period_s: float = 0.02,
        slo_ms: float = SLO_MS,
        token: str = "",
        **kwargs: Any,
    ) -> None:
        # The client waits past the SLO: a late request is answered (dropped), not timed out.
        timeout_s = slo_ms / 1000 + READ_TIMEOUT_S
        self._client = Client(address, token=token, timeout_s=timeout_s, **kwargs)
        self._period_s, self._slo_ms = period_s, slo_ms
        self._stopping = threading.Event()
        self.statuses: list[str] = []
        self._thread = threading.Thread(target=self._run, name="good-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        value = 0.0
        while not self._stopping.is_set():
            value += 1
            row = {"input": np.full((1, 4), value, np.float32)}
            try:
                result = self._client.infer("tiny", row, slo_ms=self._slo_ms)
                self.statuses.append(_status(result, value))
            except Exception as error:
                self.statuses.append(type(error).__name__)
            self._stopping.wait(self._period_s)

    def stop(self) -> list[str]:
        self._stopping.set()
        self._thread.join(60)
        self._client.close()
        return self.statuses

    def check(self, *, late_allowed: bool = False) -> None:
        """Stop; assert it was answered ok at least once and every answer was ok, or, with
        ``late_allowed``, ``dropped`` (the scheduler's verdict on a request it could no longer
        start in time: lateness, not a refusal or a broken connection)."""
        statuses = self.stop()
        assert "ok" in statuses, f"the well-behaved client was never answered ok: {statuses[:5]}"
        fine = {"ok", Outcome.DROPPED} if late_allowed else {"ok"}
        bad = [s for s in statuses if s.partition(":")[0] not in fine]
        assert not bad, f"{len(bad)} of {len(statuses)} answers were not ok: {bad[:5]}"


def _status(result: InferResult, value: float) -> str:
    """``ok``, ``wrong output`` (ok, but not this row's echo), or ``STATUS: message``."""
    if not result.ok:
        return f"{result.status}: {result.message}"
    return "ok" if result.outputs["output"][0, 0] == value else "wrong output"


def start_daemon(
    folder: Path,
    *,
    server: str = "",
    repository: str = "",
    controller: str = "",
    slowdown: float = 1.0,
) -> DaemonProcess:
    """The daemon serving ``tiny`` on one simulated executor; ``server``, ``repository`` and
    ``controller`` are extra lines of those config sections. Stop it with ``stop()`` in a
    finally."""
    add_tiny(folder / "models")
    config = write_config(folder, sim_executor(slowdown))
    text = config.read_text().replace("[server]\n", f"[server]\n{server}\n", 1)
    text = text.replace("[repository]\n", f"[repository]\n{repository}\n", 1)
    if controller:
        text = text.replace("[metrics]\n", f"[controller]\n{controller}\n[metrics]\n", 1)
    config.write_text(text)
    return DaemonProcess.start(folder, config)


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    """Descriptors process ``pid`` holds open."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 60.0, period_s: float = 0.05
) -> bool:
    """Poll ``predicate`` until true (returns True) or ``timeout_s`` passes (False). The
    default bound is generous on purpose: it only ends a wait for a state that never comes,
    and a loaded 2-core machine can take many seconds to reach one that does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return bool(predicate())
