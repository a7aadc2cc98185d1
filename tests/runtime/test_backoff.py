"""Restart backoff policy: exact delays for failure sequences on a hand-driven clock."""

from __future__ import annotations

import pytest

from clockwork_async.runtime.backoff import Backoff, BackoffConfig


def _policy() -> Backoff:
    return Backoff(BackoffConfig(initial_s=0.1, factor=2.0, max_s=1.0, healthy_s=10.0))


def test_consecutive_failures_double_up_to_the_cap() -> None:
    backoff = _policy()
    delays = []
    now_s = 0.0
    for _ in range(6):
        backoff.started(now_s)
        now_s += 0.5  # dies quickly every time
        delays.append(backoff.failed(now_s))
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff.consecutive_failures == 6


def test_a_healthy_run_resets_the_backoff() -> None:
    backoff = _policy()
    backoff.started(0.0)
    assert backoff.failed(1.0) == 0.1
    backoff.started(1.1)
    assert backoff.failed(2.0) == 0.2
    backoff.started(2.2)
    assert backoff.failed(12.2) == 0.1  # up for 10 s: healthy, starts over
    assert backoff.consecutive_failures == 1


def test_failing_to_start_keeps_backing_off() -> None:
    backoff = _policy()
    assert backoff.failed(0.0) == 0.1  # never started
    assert backoff.failed(100.0) == 0.2  # still never up: no reset however long it took


def test_delay_for_no_failures_is_zero() -> None:
    assert _policy().delay_s(0) == 0.0


def test_huge_failure_counts_do_not_overflow() -> None:
    assert _policy().delay_s(10_000) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": -1.0},
        {"initial_s": 2.0, "max_s": 1.0},
        {"factor": 0.5},
        {"healthy_s": -1.0},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackoffConfig(**kwargs)
