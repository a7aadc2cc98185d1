"""NTP-style estimate of an executor's clock offset from ping round trips. Pure: no I/O, no clock.

Each ping gives a sample: ``t0`` (controller clock, sent), ``t1`` (executor clock, answered) and
``t2`` (controller clock, received). Assuming the two legs take equally long, the executor's
clock reads ``t1 - (t0 + t2) / 2`` more than the controller's at the same instant; the error of
that is at most half the round trip, so the estimate keeps the sample with the smallest round
trip among the most recent ``window`` samples (min-RTT filtering: a round trip stretched by a
busy loop or a scheduler hiccup says little about the offset).

Invariant: ``offset_ns`` is that of the minimum-RTT sample in the window, and
``executor_ns = controller_ns + offset_ns``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class ClockSyncError(ValueError):
    """A sample that cannot be right (received before sent) or an estimate with no samples."""


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One round trip: what it says of the offset and how much to trust it."""

    offset_ns: int
    rtt_ns: int

    @classmethod
    def from_ping(cls, sent_ns: int, peer_ns: int, received_ns: int) -> ClockSample:
        """Build a sample from a Ping/Pong exchange; raises ClockSyncError if time ran back."""
        rtt_ns = received_ns - sent_ns
        if rtt_ns < 0:
            raise ClockSyncError(f"pong received before its ping was sent (rtt {rtt_ns} ns)")
        return cls(offset_ns=peer_ns - (sent_ns + received_ns) // 2, rtt_ns=rtt_ns)


class ClockSync:
    """A sliding window of samples; the offset of the one with the least round trip."""

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: deque[ClockSample] = deque(maxlen=window)
        self._best: ClockSample | None = None

    def add(self, sent_ns: int, peer_ns: int, received_ns: int) -> ClockSample:
        """Record one ping exchange; returns its sample. Raises ClockSyncError if invalid."""
        sample = ClockSample.from_ping(sent_ns, peer_ns, received_ns)
        evicted = self._samples[0] if len(self._samples) == self._samples.maxlen else None
        self._samples.append(sample)
        if self._best is None or sample.rtt_ns <= self._best.rtt_ns:
            self._best = sample
        elif evicted is self._best:
            self._best = min(self._samples, key=lambda s: s.rtt_ns)
        return sample

    @property
    def sample_count(self) -> int:
        return len(self._samples)

    @property
    def synced(self) -> bool:
        return self._best is not None

    @property
    def best(self) -> ClockSample:
        """The sample the estimate rests on; raises ClockSyncError before any sample."""
        if self._best is None:
            raise ClockSyncError("no clock samples yet")
        return self._best

    @property
    def offset_ns(self) -> int:
        """Executor clock minus controller clock; raises ClockSyncError before any sample."""
        return self.best.offset_ns

    @property
    def error_bound_ns(self) -> int:
        """Half the best round trip: how far off the offset can be (if legs are symmetric)."""
        return self.best.rtt_ns // 2

    def to_executor_ns(self, controller_ns: int) -> int:
        return controller_ns + self.offset_ns

    def to_controller_ns(self, executor_ns: int) -> int:
        return executor_ns - self.offset_ns
