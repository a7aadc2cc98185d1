"""A Markov-modulated Poisson process with heavy-tailed bursts (``--workload mmpp``).

States k = 0..K-1 with relative rate levels L_k and mean sojourn times S_k. The process starts
in state 0 (the calm state); when a sojourn ends it moves to another state drawn uniformly (two
states simply alternate). The sojourn in state 0 is exponential with mean S_0; in the other
states (the bursts) it is Pareto with shape ``alpha`` and mean S_k (scale S_k (alpha-1)/alpha):
for 1 < alpha <= 2 its variance is infinite, so a few bursts are very long; ``alpha`` 0 makes
them exponential too. While in state k every instance sends a Poisson process of
``c * L_k / instances`` req/s, all instances switching together; c is chosen so the long-run
mean over all instances is ``rate_rps`` (the embedded chain visits states equally often, so the
time share of state k is S_k / sum(S)).

Invariants: all draws come from the generator the engine passes in (a seed fixes the
workload); the state sequence is drawn lazily, one sojourn at a time, then the arrivals of each
sojourn in pieces of at most a second (`workloads.poisson_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .workloads import NS_PER_S, OpenLoop, RateSegment

DEFAULT_LEVELS = (1.0, 6.0)
DEFAULT_SOJOURN_S = (2.0, 0.25)
DEFAULT_ALPHA = 1.5


def state_rates_rps(
    rate_rps: float, levels: Sequence[float], sojourn_s: Sequence[float]
) -> list[float]:
    """Total req/s in each state, scaled so that the long-run mean is ``rate_rps``."""
    weighted = sum(level * mean for level, mean in zip(levels, sojourn_s, strict=True))
    scale = rate_rps * sum(sojourn_s) / weighted if weighted > 0 else 0.0
    return [level * scale for level in levels]


def _check(levels: Sequence[float], sojourn_s: Sequence[float], alpha: float) -> None:
    if len(levels) < 2 or len(levels) != len(sojourn_s):
        raise ValueError("mmpp needs >= 2 states, one level and one mean sojourn each")
    if any(level < 0 for level in levels) or any(mean <= 0 for mean in sojourn_s):
        raise ValueError("mmpp levels must be >= 0 and mean sojourns > 0")
    if alpha != 0 and alpha <= 1:
        raise ValueError(f"mmpp alpha must be > 1 (a finite mean) or 0, got {alpha}")


def sojourn_ns(rng: np.random.Generator, state: int, mean_s: float, alpha: float) -> int:
    """One sojourn: exponential in state 0 (or with ``alpha`` 0), else Pareto(alpha)."""
    if state == 0 or alpha == 0:
        seconds = rng.exponential(mean_s)
    else:
        seconds = mean_s * (alpha - 1) / alpha * (1.0 + rng.pareto(alpha))
    return max(1, round(float(seconds) * NS_PER_S))


def mmpp(
    instances: int,
    rate_rps: float,
    duration_s: float,
    levels: Sequence[float] = DEFAULT_LEVELS,
    sojourn_s: Sequence[float] = DEFAULT_SOJOURN_S,
    alpha: float = DEFAULT_ALPHA,
) -> OpenLoop:
    """The MMPP of the module header. Raises ValueError on bad parameters."""
    if instances < 1 or duration_s <= 0 or rate_rps < 0:
        raise ValueError("mmpp needs instances >= 1, duration > 0 and rate >= 0")
    _check(levels, sojourn_s, alpha)
    duration_ns = round(duration_s * NS_PER_S)
    totals = state_rates_rps(rate_rps, levels, sojourn_s)
    per_instance = [np.full(instances, total / instances) for total in totals]

    def segments(rng: np.random.Generator) -> Iterator[RateSegment]:
        start_ns, state = 0, 0
        while start_ns < duration_ns:
            end_ns = min(duration_ns, start_ns + sojourn_ns(rng, state, sojourn_s[state], alpha))
            yield RateSegment(start_ns, end_ns, per_instance[state])
            start_ns, state = end_ns, _next_state(rng, state, len(levels))

    details = {
        "rate_rps": rate_rps,
        "state_rates_rps": [round(total, 3) for total in totals],
        "mean_sojourn_s": list(sojourn_s),
        "pareto_alpha": alpha,
    }
    return OpenLoop("mmpp", instances, duration_ns, segments, details)


def _next_state(rng: np.random.Generator, state: int, states: int) -> int:
    """Another state, uniformly (two states alternate without a draw)."""
    if states == 2:
        return 1 - state
    other = int(rng.integers(states - 1))
    return other if other < state else other + 1
