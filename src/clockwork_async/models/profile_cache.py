"""Registration profiles cached on disk, keyed by model content hash and machine, so a restart
does not re-profile.

Invariants: one JSON file per key, written whole (temporary file, fsync, rename), so a reader
sees an old document or a new one; a file that does not parse, or whose recorded key differs
from the one asked for, is ignored with a warning (and rewritten by the next ``put``), never
raised: a bad cache costs a re-profile, not the daemon. The profile document itself is the
caller's (``RegistrationProfile.to_json()``); ``get`` hands it to the caller's parser.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import tempfile
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
T = TypeVar("T")


class ProfileCache:
    """Profiles under ``directory`` (created if missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o750)

    def path(self, content_hash: str, machine: str) -> Path:
        """The file of one key; raises ValueError for a malformed content hash."""
        if not _SHA256.match(content_hash):
            raise ValueError(f"content hash must be 64 lowercase hex digits, not {content_hash!r}")
        machine_digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
        return self.directory / f"{content_hash}-{machine_digest}.json"

    def get(self, content_hash: str, machine: str, parse: Callable[[str], T]) -> T | None:
        """The cached profile parsed by ``parse`` (which raises ValueError when it cannot), or
        None when absent, corrupt or recorded for another key (warned in the log)."""
        path = self.path(content_hash, machine)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            log.warning("profile cache %s unreadable, ignored: %s", path, error)
            return None
        try:
            return parse(_unwrap(text, content_hash, machine))
        except ValueError as error:
            log.warning("profile cache %s is corrupt, ignored: %s", path, error)
            return None

    def put(self, content_hash: str, machine: str, document: str | Mapping[str, Any]) -> Path:
        """Store ``document`` (JSON text or a JSON-able mapping) for the key; returns the file.
        Raises ValueError if ``document`` is not JSON, OSError if the disk fails."""
        profile = json.loads(document) if isinstance(document, str) else dict(document)
        envelope = {
            "format": CACHE_FORMAT_VERSION,
            "content_hash": content_hash,
            "machine": machine,
            "profile": profile,
        }
        path = self.path(content_hash, machine)
        _write_atomically(path, json.dumps(envelope, indent=1, sort_keys=True))
        return path


def _unwrap(text: str, content_hash: str, machine: str) -> str:
    """The profile document inside a cache file; raises ValueError."""
    try:
        envelope = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(envelope, dict) or envelope.get("format") != CACHE_FORMAT_VERSION:
        raise ValueError("not a cache file of this format")
    if envelope.get("content_hash") != content_hash or envelope.get("machine") != machine:
        raise ValueError("recorded for another model or machine")
    if "profile" not in envelope:
        raise ValueError("no profile in it")
    return json.dumps(envelope["profile"])


def _write_atomically(path: Path, text: str) -> None:
    fd, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def machine_key(
    backend: str, *, cpu_model: str | None = None, runtime_version: str | None = None
) -> str:
    """What makes measured durations comparable: CPU model, backend and its runtime version
    (``onnxruntime`` for ONNX Runtime backends)."""
    cpu = cpu_model if cpu_model is not None else _cpu_model()
    version = runtime_version if runtime_version is not None else _runtime_version(backend)
    return f"cpu={cpu}; backend={backend}; runtime={version}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _runtime_version(backend: str) -> str:
    package = "onnxruntime" if backend.startswith("onnxruntime") else "clockwork-async"
    for name in (package, "onnxruntime-gpu") if package == "onnxruntime" else (package,):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
