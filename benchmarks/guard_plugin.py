"""A pytest plugin loaded only by the guard (``-p benchmarks.guard_plugin --guard-out FILE``):
for each test, its result and the outcome of every reply its clients received.

Two places are wrapped, at class level and for this pytest process only (product code is
untouched):
- `AsyncClient.infer` (the blocking `Client` runs it too): the ``status`` of each answer, or
  ``raised:<Error>`` when the call raised;
- `Driver.submit`: the ``outcome`` each ``on_reply`` callback is given (the runtime tests, and
  a daemon run in-process, whose API service submits through its driver).

Invariants: a reply is charged to the test running when it arrives (replies arrive on client
threads; the current test id is one global, set around each test's setup, call and teardown);
a wrap point that is missing is named in the output (``missing_hooks``), and results are still
written. The output is one JSON object: ``{"tests": {nodeid: {"result", "replies"}}, ...}``.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

OUTSIDE = "<outside a test>"
_RANK = {"passed": 0, "skipped": 1, "failed": 2}  # a test's result is its worst phase's

_lock = threading.Lock()
_current = [OUTSIDE]
_replies: dict[str, Counter[str]] = {}
_results: dict[str, str] = {}
_missing: list[str] = []


def note_reply(outcome: str) -> None:
    """Charge one reply with ``outcome`` to the test running now."""
    with _lock:
        _replies.setdefault(_current[0], Counter())[outcome] += 1


def _wrap_client() -> None:
    from clockwork_async.api.async_client import AsyncClient

    original = AsyncClient.infer

    @functools.wraps(original)
    async def infer(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = await original(self, *args, **kwargs)
        except Exception as error:
            note_reply(f"raised:{type(error).__name__}")
            raise
        note_reply(str(result.status))
        return result

    AsyncClient.infer = infer  # type: ignore[method-assign]


def _wrap_driver() -> None:
    from clockwork_async.runtime.driver import Driver

    original = Driver.submit

    @functools.wraps(original)
    def submit(self: Any, *args: Any, on_reply: Callable[[Any], None], **kwargs: Any) -> Any:
        def noted(outcome: Any) -> None:
            note_reply(str(outcome.outcome))
            on_reply(outcome)

        return original(self, *args, on_reply=noted, **kwargs)

    Driver.submit = submit  # type: ignore[method-assign]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--guard-out", help="write the guard's per-test record (JSON) here")


def pytest_configure(config: pytest.Config) -> None:
    for name, wrap in (("AsyncClient.infer", _wrap_client), ("Driver.submit", _wrap_driver)):
        try:
            wrap()
        except (ImportError, AttributeError):
            _missing.append(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    _current[0] = item.nodeid
    try:
        yield
    finally:
        _current[0] = OUTSIDE


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    result = "passed" if report.passed else "skipped" if report.skipped else "failed"
    before = _results.get(report.nodeid, "passed")
    _results[report.nodeid] = max(before, result, key=_RANK.__getitem__)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = session.config.getoption("--guard-out")
    if not out:
        return
    with _lock:
        tests = {
            nodeid: {"result": result, "replies": dict(sorted(_replies.get(nodeid, {}).items()))}
            for nodeid, result in sorted(_results.items())
        }
        outside = dict(sorted(_replies.get(OUTSIDE, {}).items()))
    record = {
        "tests": tests,
        "replies_outside_tests": outside,
        "missing_hooks": _missing,
        "exitstatus": int(exitstatus),
    }
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
