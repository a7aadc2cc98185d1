"""The daemon's log lines: JSON objects or plain text, tagged with request ids."""

from __future__ import annotations

import io
import json
import logging

import pytest

from clockwork_async.logs import configure_logging, request_extra

log = logging.getLogger("clockwork_async.test")


def test_json_lines_carry_the_request_id_and_the_exception() -> None:
    stream = io.StringIO()
    restore = configure_logging("json", "debug", stream)
    try:
        log.info("answered %s", "ok", extra=request_extra(42, model="tiny"))
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            log.exception("it failed")
    finally:
        restore()
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "answered ok" and first["level"] == "info"
    assert first["request_id"] == 42 and first["model"] == "tiny"
    assert first["logger"] == "clockwork_async.test" and first["ts"].endswith("Z")
    assert second["message"] == "it failed" and "ValueError: boom" in second["exception"]


def test_plain_lines_tag_requests_and_indent_tracebacks() -> None:
    stream = io.StringIO()
    restore = configure_logging("plain", "info", stream)
    try:
        log.debug("hidden below the level")
        log.warning("slow reply", extra=request_extra(7))
        try:
            raise KeyError("gone")
        except KeyError:
            log.exception("lookup failed")
    finally:
        restore()
    lines = stream.getvalue().splitlines()
    assert "WARNING" in lines[0] and lines[0].endswith(
        "clockwork_async.test: slow reply [request 7]"
    )
    assert lines[1].endswith("lookup failed")
    assert lines[2:] and all(line.startswith("    ") for line in lines[2:])


def test_configure_logging_restores_the_previous_handlers_and_refuses_unknown_names() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("json", "error", io.StringIO())()
    assert root.handlers == handlers and root.level == level
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")
    with pytest.raises(ValueError, match="log level"):
        configure_logging("plain", "loud")
