"""Restart and reconnect backoff: exponential, capped, reset after a healthy period. Pure.

Invariant: the n-th consecutive failure waits ``min(initial_s * factor**(n-1), max_s)``; a run
that stayed up for at least ``healthy_s`` before failing counts as the first failure again, so a
process that crashes once a day restarts at once, while one that crashes at start backs off.
Times are plain seconds on whatever monotonic clock the caller passes in. The daemon's one
backoff is ``[executor_link]``'s ``reconnect_backoff_*`` keys (`LinkConfig.reconnect_backoff`),
for reconnecting remote executors and restarting local ones alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from clockwork_async.config.keys import ranged
from clockwork_async.core.config import ConfigError


@dataclass(frozen=True, slots=True)
class BackoffConfig:
    initial_s: float = ranged(0.05, 0.0, 600.0)  # the first wait
    factor: float = ranged(2.0, 1.0, 100.0)  # each consecutive failure multiplies the wait
    max_s: float = ranged(5.0, 0.0, 3600.0)  # the wait never exceeds this
    healthy_s: float = ranged(10.0, 0.0, 86_400.0)  # up this long: the next failure is a first

    def __post_init__(self) -> None:
        if not 0 <= self.initial_s <= self.max_s:
            raise ConfigError("initial_s", self.initial_s, f"0 .. max_s ({self.max_s})")
        if self.factor < 1.0:
            raise ConfigError("factor", self.factor, ">= 1")
        if self.healthy_s < 0:
            raise ConfigError("healthy_s", self.healthy_s, ">= 0")


class Backoff:
    """Tracks one restartable thing: call ``started`` when it comes up, ``failed`` when it dies."""

    def __init__(self, config: BackoffConfig | None = None) -> None:
        self.config = config or BackoffConfig()
        self._consecutive_failures = 0
        self._up_since_s: float | None = None

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    def started(self, now_s: float) -> None:
        """It is up (again) as of ``now_s``."""
        self._up_since_s = now_s

    def failed(self, now_s: float) -> float:
        """It died (or failed to start) at ``now_s``; returns how long to wait before retrying."""
        if self._up_since_s is not None and now_s - self._up_since_s >= self.config.healthy_s:
            self._consecutive_failures = 0
        self._up_since_s = None
        self._consecutive_failures += 1
        return self.delay_s(self._consecutive_failures)

    def delay_s(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (0 for none)."""
        if failures <= 0:
            return 0.0
        delay_s = self.config.initial_s * self.config.factor ** min(failures - 1, 64)
        return min(delay_s, self.config.max_s)
