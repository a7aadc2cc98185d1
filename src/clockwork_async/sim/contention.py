"""Contention: an executor whose CPU is shared, as a seeded two-state slowdown in virtual time.

The model (a Markov-modulated processor share). Each executor alternates between a *fast* state,
where work runs at full speed, and a *slow* state, where it runs ``slow_factor`` times slower
(another process holds part of the CPU). State lengths are exponential: slow spells last
``spell_ns`` on average, fast spells ``spell_ns * (1 - slow_share) / slow_share``, so the
executor is slow a ``slow_share`` of the time in the long run; the first state is drawn from
that share. An action needing ``work_ns`` of full-speed time, started at ``t``, takes the time
it needs to do that work at the speed of each state it crosses (`ContentionClock.stretch`), so
an action that straddles a switch gets a duration between the two.

Invariants:
- A duration is never shorter than the work (``slow_factor`` >= 1): the simulator's upper
  bound on goodput (`sim.bound`) still holds under contention, unlike under ``noise``.
- One clock per executor, drawn from its own generator: the same seed gives the same
  durations, and turning contention on changes no other random draw of a run.
- ``stretch`` is called with start times that never decrease (virtual time only moves
  forward), so spells that ended before the latest start are forgotten.

What it fits (docs/benchmarks.md, "Contention on the virtual clock"): on the shared 2-vCPU VM
the measured execute times of an ONNX Runtime executor had p99 1.4-4.3x their p50; with a slow
share under 1/2 and over 1/100 the p50 here is the work and the p99 near ``slow_factor`` x it.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

MS_NS = 1_000_000


class ContentionError(ValueError):
    """A contention spec that cannot be used."""


@dataclass(frozen=True, slots=True)
class Contention:
    """How an executor's CPU is shared: ``slow_factor`` (>= 1), ``slow_share`` in (0, 1),
    ``spell_ns`` (> 0, the mean slow spell)."""

    slow_factor: float
    slow_share: float
    spell_ns: int

    def __post_init__(self) -> None:
        if not self.slow_factor >= 1.0:
            raise ContentionError(f"slow factor must be >= 1, got {self.slow_factor}")
        if not 0.0 < self.slow_share < 1.0:
            raise ContentionError(f"slow share must be in (0, 1), got {self.slow_share}")
        if self.spell_ns <= 0:
            raise ContentionError(f"slow spell must be > 0 ns, got {self.spell_ns}")

    @classmethod
    def parse(cls, text: str) -> Contention:
        """``FACTOR,SHARE,SPELL_MS`` (e.g. ``3,0.1,20``). Raises ContentionError."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ContentionError(f"expected FACTOR,SHARE,SPELL_MS, got {text!r}")
        try:
            factor, share, spell_ms = (float(part) for part in parts)
        except ValueError:
            raise ContentionError(f"not three numbers: {text!r}") from None
        return cls(factor, share, round(spell_ms * MS_NS))

    @property
    def fast_spell_ns(self) -> float:
        """The mean fast spell."""
        return self.spell_ns * (1.0 - self.slow_share) / self.slow_share

    def describe(self) -> str:
        return f"{self.slow_factor:g},{self.slow_share:g},{self.spell_ns / MS_NS:g}"


class ContentionClock:
    """One executor's fast and slow spells, drawn lazily as virtual time needs them."""

    __slots__ = ("_end_ns", "_factor", "_mean_ns", "_rng", "_slow", "_starts")

    def __init__(self, contention: Contention, rng: random.Random) -> None:
        self._factor = contention.slow_factor
        self._mean_ns = (contention.fast_spell_ns, float(contention.spell_ns))  # fast, slow
        self._rng = rng
        # Known spells cover [_starts[0], _end_ns): spell i starts at _starts[i], slow or not
        # per _slow[i]; they alternate.
        self._starts: deque[int] = deque([0])
        self._slow: deque[bool] = deque([rng.random() < contention.slow_share])
        self._end_ns = self._draw_end(0, self._slow[0])

    def stretch(self, start_ns: int, work_ns: int) -> int:
        """The duration of ``work_ns`` of full-speed work started at ``start_ns``."""
        starts, slow = self._starts, self._slow
        while self._end_ns <= start_ns:  # an idle executor: draw the spells up to the start
            self._extend()
        while len(starts) > 1 and starts[1] <= start_ns:  # spells over before the start
            starts.popleft()
            slow.popleft()
        at_ns, left_ns, index = start_ns, float(work_ns), 0
        while True:
            if index + 1 == len(starts):
                self._extend()
            spell_end_ns = starts[index + 1]
            speed = 1.0 / self._factor if slow[index] else 1.0
            doable_ns = (spell_end_ns - at_ns) * speed
            if doable_ns >= left_ns:
                return round(at_ns + left_ns / speed) - start_ns
            left_ns -= doable_ns
            at_ns = spell_end_ns
            index += 1

    def _extend(self) -> None:
        """Append the next spell (the other state) after the last known one."""
        next_slow = not self._slow[-1]
        self._starts.append(self._end_ns)
        self._slow.append(next_slow)
        self._end_ns = self._draw_end(self._end_ns, next_slow)

    def _draw_end(self, start_ns: int, slow: bool) -> int:
        return start_ns + max(1, round(self._rng.expovariate(1.0 / self._mean_ns[slow])))
