"""Workloads for the simulator: who sends which request when, in virtual time.

Invariants:
- Open-loop arrivals are drawn lazily, one piece of at most ``PIECE_NS`` at a time, and each
  piece comes back sorted by time (ties keep instance order), so millions of requests never sit
  in memory at once.
- Inside a piece every instance's arrivals are a Poisson process of that piece's rate: a Poisson
  count, then uniform times. All draws come from the one generator the engine passes in, so a
  seed fixes the whole workload.
- A closed-loop client sends its next request only when the previous one is answered (after a
  think time, or a back-off when it was not ``ok``, so a rejection never loops in zero time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .trace import TraceMapping

NS_PER_S = 1_000_000_000
NS_PER_MINUTE = 60 * NS_PER_S
PIECE_NS = NS_PER_S  # longest stretch drawn at once

Arrivals = tuple[list[int], list[int]]  # (times_ns ascending, instance indices)
Rates = npt.NDArray[np.float64]  # requests per second, one per instance
RngFactory = Callable[[np.random.Generator], Iterator["RateSegment"]]


@dataclass(frozen=True, slots=True)
class RateSegment:
    """Each instance sends a Poisson process of ``rates_rps[i]`` over [start_ns, end_ns)."""

    start_ns: int
    end_ns: int
    rates_rps: Rates


class Workload(Protocol):
    """What the engine asks of a workload."""

    @property
    def instances(self) -> int: ...

    @property
    def duration_ns(self) -> int: ...

    def open_arrivals(self, rng: np.random.Generator) -> Iterator[Arrivals]:
        """Arrivals known in advance, in time order, in pieces."""
        ...

    def after_reply(self, instance: int, now_ns: int, ok: bool) -> int | None:
        """The time of the next request of the client that was just answered, or None."""
        ...

    def describe(self) -> dict[str, object]: ...


def request_slos_ns(workload: object) -> Sequence[int] | None:
    """A workload's own SLO per request (``request_slos_ns``, indexed by open-loop arrival
    order), or None when every request has the run's SLO."""
    slos: Sequence[int] | None = getattr(workload, "request_slos_ns", None)
    return slos


def draw_piece(rng: np.random.Generator, start_ns: int, end_ns: int, rates: Rates) -> Arrivals:
    """Poisson arrivals of every instance over [start_ns, end_ns), sorted by time."""
    span_ns = end_ns - start_ns
    counts = rng.poisson(rates * (span_ns / NS_PER_S))
    total = int(counts.sum())
    if total == 0:
        return [], []
    instances = np.repeat(np.arange(len(rates), dtype=np.int64), counts)
    offsets_ns = (rng.random(total) * span_ns).astype(np.int64)
    order = np.argsort(offsets_ns, kind="stable")
    return (offsets_ns[order] + start_ns).tolist(), instances[order].tolist()


def poisson_pieces(
    segments: Iterable[RateSegment], rng: np.random.Generator, piece_ns: int = PIECE_NS
) -> Iterator[Arrivals]:
    """Arrivals of piecewise-constant Poisson rates, one piece of <= ``piece_ns`` at a time."""
    for segment in segments:
        for start_ns in range(segment.start_ns, segment.end_ns, piece_ns):
            end_ns = min(segment.end_ns, start_ns + piece_ns)
            yield draw_piece(rng, start_ns, end_ns, segment.rates_rps)


@dataclass(frozen=True)
class OpenLoop:
    """An open-loop workload defined by its rate segments (drawn from the same generator)."""

    name: str
    instances: int
    duration_ns: int
    segments: RngFactory
    details: Mapping[str, object] = field(default_factory=dict)

    def open_arrivals(self, rng: np.random.Generator) -> Iterator[Arrivals]:
        return poisson_pieces(self.segments(rng), rng)

    def after_reply(self, instance: int, now_ns: int, ok: bool) -> int | None:
        return None

    def describe(self) -> dict[str, object]:
        return {"workload": self.name, "instances": self.instances, **self.details}


def _check(instances: int, duration_s: float) -> int:
    """Validate the common arguments; return the duration in ns."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s} s")
    return round(duration_s * NS_PER_S)


def poisson(instances: int, rate_rps: float, duration_s: float) -> OpenLoop:
    """Poisson open loop: ``rate_rps`` in total, split evenly over the instances."""
    duration_ns = _check(instances, duration_s)
    rates = np.full(instances, rate_rps / instances)

    def segments(_rng: np.random.Generator) -> Iterator[RateSegment]:
        yield RateSegment(0, duration_ns, rates)

    return OpenLoop("poisson", instances, duration_ns, segments, {"rate_rps": rate_rps})


def bursty(
    instances: int,
    rate_rps: float,
    duration_s: float,
    on_s: float = 1.0,
    off_s: float = 1.0,
) -> OpenLoop:
    """On/off modulated Poisson: all instances burst together. On and off periods are
    exponential (means ``on_s``, ``off_s``); the rate while on is ``rate_rps * (on+off)/on`` so
    the long-run mean is ``rate_rps``; nothing is sent while off."""
    duration_ns = _check(instances, duration_s)
    if on_s <= 0 or off_s < 0:
        raise ValueError("burst periods must be on > 0 and off >= 0 seconds")
    peak = np.full(instances, rate_rps * (on_s + off_s) / on_s / instances)

    def segments(rng: np.random.Generator) -> Iterator[RateSegment]:
        start_ns, on = 0, True
        while start_ns < duration_ns:
            mean_s = on_s if on else off_s
            end_ns = min(duration_ns, start_ns + max(1, round(rng.exponential(mean_s) * 1e9)))
            if on:
                yield RateSegment(start_ns, end_ns, peak)
            start_ns, on = end_ns, not on

    details = {"rate_rps": rate_rps, "burst_on_s": on_s, "burst_off_s": off_s}
    return OpenLoop("bursty", instances, duration_ns, segments, details)


def ramp(instances: int, rate_rps: float, duration_s: float, step_s: float = 1.0) -> OpenLoop:
    """Instance i becomes active at ``i * step_s``; ``rate_rps`` is split evenly over the
    instances active at each moment (the paper's "one more model each second")."""
    duration_ns = _check(instances, duration_s)
    step_ns = round(step_s * NS_PER_S)

    def segments(_rng: np.random.Generator) -> Iterator[RateSegment]:
        for index, start_ns in enumerate(range(0, duration_ns, step_ns)):
            active = min(index + 1, instances)
            rates = np.zeros(instances)
            rates[:active] = rate_rps / active
            yield RateSegment(start_ns, min(duration_ns, start_ns + step_ns), rates)

    details = {"rate_rps": rate_rps, "step_s": step_s}
    return OpenLoop("ramp", instances, duration_ns, segments, details)


def trace_replay(mapping: TraceMapping, duration_s: float, load_scale: float = 1.0) -> OpenLoop:
    """Replay a mapped Azure trace: per minute, each instance sends a Poisson process of
    ``count * load_scale / 60`` req/s. ``duration_s`` may end inside a minute."""
    duration_ns = _check(mapping.instances, duration_s)
    if duration_ns > mapping.trace.minutes * NS_PER_MINUTE:
        raise ValueError(f"the mapped trace window holds {mapping.trace.minutes} minutes")
    if load_scale < 0:
        raise ValueError(f"load scale must be >= 0, got {load_scale}")

    def segments(_rng: np.random.Generator) -> Iterator[RateSegment]:
        for minute, start_ns in enumerate(range(0, duration_ns, NS_PER_MINUTE)):
            rates = mapping.instance_counts(minute).astype(np.float64) * (load_scale / 60.0)
            yield RateSegment(start_ns, min(duration_ns, start_ns + NS_PER_MINUTE), rates)

    details = {"load_scale": load_scale, "mapping": mapping.describe()}
    return OpenLoop("azure", mapping.instances, duration_ns, segments, details)


@dataclass(frozen=True)
class ClosedLoop:
    """``clients`` clients, client c sending to instance ``c mod instances`` and keeping
    ``in_flight`` requests outstanding; all start at time 0."""

    instances: int
    duration_ns: int
    clients: int
    in_flight: int
    think_ns: int = 0
    backoff_ns: int = 1_000_000  # after a reply that was not ok

    def open_arrivals(self, rng: np.random.Generator) -> Iterator[Arrivals]:
        slots = range(self.clients * self.in_flight)
        yield [0] * len(slots), [(slot // self.in_flight) % self.instances for slot in slots]

    def after_reply(self, instance: int, now_ns: int, ok: bool) -> int | None:
        next_ns = now_ns + (self.think_ns if ok else max(self.think_ns, self.backoff_ns))
        return next_ns if next_ns < self.duration_ns else None

    def describe(self) -> dict[str, object]:
        return {
            "workload": "closed",
            "instances": self.instances,
            "clients": self.clients,
            "in_flight_per_client": self.in_flight,
            "think_ms": self.think_ns / 1e6,
        }


def closed_loop(
    instances: int, clients: int, in_flight: int, duration_s: float, think_ms: float = 0.0
) -> ClosedLoop:
    """Closed loop; raises ValueError on non-positive counts."""
    duration_ns = _check(instances, duration_s)
    if clients < 1 or in_flight < 1:
        raise ValueError("clients and in-flight must be >= 1")
    return ClosedLoop(instances, duration_ns, clients, in_flight, round(think_ms * 1e6))


DEFAULT_SLO_FACTORS = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 25.0, 50.0)


def slo_sweep_ms(b1_ms: float, factors: Iterable[float] = DEFAULT_SLO_FACTORS) -> list[float]:
    """SLOs for a sweep: multiples of the batch-1 execute time, ascending."""
    return sorted(round(b1_ms * factor, 3) for factor in factors)
