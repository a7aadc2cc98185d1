"""Structured logging for the daemon: plain lines or JSON lines, with request ids.

Invariants: in JSON every record is one line (newlines in messages and tracebacks escaped); in
plain text a record is one line, with a traceback, if any, indented on the lines after it;
everything goes to one stream; a record concerning a request carries its id
(``log.info("...", extra=request_extra(request_id))``) as ``request_id`` in JSON and as
``[request N]`` in plain text. `configure_logging` replaces the root logger's handlers and
returns an undo function that puts the previous ones back (tests, embedding).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

REQUEST_ID = "request_id"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR
# Attributes every LogRecord has; anything else was passed with ``extra=``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def request_extra(request_id: int, **fields: Any) -> dict[str, Any]:
    """The ``extra=`` mapping that tags a record with a request id (and other fields)."""
    return {REQUEST_ID: request_id, **fields}


def _timestamp(created_s: float) -> str:
    """UTC ISO 8601 with milliseconds, e.g. ``2024-05-01T12:00:00.123Z``."""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created_s))
    return f"{whole}.{int(created_s % 1 * 1000):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        document.update(_extras(record))
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str, separators=(",", ":"))


class PlainFormatter(logging.Formatter):
    """``TIME LEVEL logger: message [request N] key=value``; tracebacks indented below."""

    def format(self, record: logging.LogRecord) -> str:
        extras = _extras(record)
        request_id = extras.pop(REQUEST_ID, None)
        line = f"{_timestamp(record.created)} {record.levelname:<7} {record.name}: "
        line += record.getMessage()
        if request_id is not None:
            line += f" [request {request_id}]"
        line += "".join(f" {key}={value}" for key, value in sorted(extras.items()))
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "\n" + "\n".join("    " + part for part in trace.splitlines())
        return line


FORMATTERS: Mapping[str, Callable[[], logging.Formatter]] = {
    "plain": PlainFormatter,
    "json": JsonFormatter,
}


def configure_logging(
    log_format: str = "plain", level: str = "info", stream: TextIO | None = None
) -> Callable[[], None]:
    """Send every log record at ``level`` and above to ``stream`` (default stderr) in
    ``log_format``; returns a function that restores the previous root configuration.
    Raises ValueError for an unknown format or level."""
    if log_format not in FORMATTERS:
        raise ValueError(f"log format must be one of {sorted(FORMATTERS)}, not {log_format!r}")
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {sorted(_LEVELS)}, not {level!r}")
    root = logging.getLogger()
    previous_handlers, previous_level = list(root.handlers), root.level
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(FORMATTERS[log_format]())
    root.handlers = [handler]
    root.setLevel(_LEVELS[level])

    def restore() -> None:
        root.handlers = previous_handlers
        root.setLevel(previous_level)

    return restore
