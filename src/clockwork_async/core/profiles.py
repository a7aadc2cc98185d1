"""Duration predictions: per (model, batch size, executor kind) a sliding window of recent
measured durations, predicting a percentile of it; LOAD likewise.

Invariants: a window is seeded with the model's offline profile for that kind and always holds
1..window_size samples, so a prediction always exists; the seed leaves the window once
``window_size`` measurements arrived. An executor kind the spec has no profile for is seeded
with the *slowest* seed over the kinds it has (conservative: late results are the one bug we
must not have), and counted in ``fallback_seeds``.

Pooled (``pooled_size`` > 0, off by default; docs/controller.md, "Predictions under
contention"): per (model, kind) one window of the last ``pooled_size`` execute measurements of
*any* batch size, each as its ratio to that batch size's seed (``RATIO_ONE`` = the seed); every
batch size predicts its seed x the window's ``percentile`` ratio, rounded up. A slowdown one
batch size runs into is then seen by all of them. Seeded with ``RATIO_ONE``, so the first
predictions are the seeds; durations equal to the seeds keep every prediction at its seed.
Probes, staleness and relaxing act on that window. LOAD keeps its own window.

Recovery: a window only learns from actions that run, so one slow outlier could make every
request look infeasible, and then nothing runs to correct it. `Predictions.relax` (called when
a request is refused) lets a window that has had no sample for ``stale_ns`` forget its largest
sample, one per ``stale_ns``, while that sample is over ``outlier_factor`` x the window's
(lower) median. A window of consistent samples does not relax; a probe does (warm_up.py):
a stale window's measurement by a probe drops its samples over ``outlier_factor`` x it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .events import ModelProfile, ModelSpec

RECENT_ERRORS = 1024  # how many recent prediction errors ``recent`` keeps
RATIO_ONE = 1_000_000  # a pooled window's ratios are in millionths


class SlidingWindow:
    """The last ``size`` samples; ``value_ns`` is their ``percentile`` (nearest rank).
    ``_ordered`` holds the same samples sorted, kept up to date on each add (one INFER
    result each) instead of sorting the window again.

    The samples sit in a ring of ``size`` slots (a list, not a deque: compiled with mypyc, a
    deque's methods are generic calls); once it is full, ``_oldest`` is the oldest's slot."""

    __slots__ = (
        "_full_rank",
        "_oldest",
        "_ordered",
        "_percentile",
        "_samples",
        "_size",
        "updated_ns",
        "value_ns",
    )

    def __init__(self, size: int, percentile: float, seed_ns: int) -> None:
        self._samples: list[int] = [seed_ns]
        self._oldest = 0
        self._size = size
        self._ordered: list[int] = [seed_ns]
        self._percentile = percentile
        self._full_rank = _rank(percentile, size)  # the value's index once the window is full
        self.value_ns = seed_ns
        self.updated_ns = 0  # when a sample last came (or was forgotten)

    def add(self, sample_ns: int, now_ns: int = 0) -> None:
        """Add a measurement and update ``value_ns``."""
        samples, ordered = self._samples, self._ordered
        if len(samples) == self._size:  # the oldest sample leaves the window: its slot
            oldest = self._oldest
            ordered.remove(samples[oldest])
            samples[oldest] = sample_ns
            self._oldest = (oldest + 1) % self._size
        else:
            samples.append(sample_ns)
        _insort(ordered, sample_ns)
        self.updated_ns = now_ns
        self._set_value()

    def forget_outlier(self, now_ns: int, stale_ns: int, factor: float) -> bool:
        """Drop the largest sample if no sample came for ``stale_ns`` and it is over ``factor``
        x the lower median; returns whether ``value_ns`` may have changed."""
        if now_ns - self.updated_ns < stale_ns or len(self._samples) < 2:
            return False
        ordered = sorted(self._samples)
        if ordered[-1] <= factor * ordered[(len(ordered) - 1) // 2]:
            return False
        samples = self._oldest_first()
        samples.remove(ordered[-1])  # the oldest of the largest
        self._samples, self._oldest = samples, 0
        self.updated_ns = now_ns
        self._update()
        return True

    def forget_above(self, limit_ns: int) -> None:
        """Drop every sample over ``limit_ns`` (a probe found the machine faster now)."""
        kept = [sample for sample in self._oldest_first() if sample <= limit_ns]
        if kept and len(kept) < len(self._samples):
            self._samples, self._oldest = kept, 0
            self._update()

    def _oldest_first(self) -> list[int]:
        """A copy of the samples, oldest first."""
        samples, oldest = self._samples, self._oldest
        return samples[oldest:] + samples[:oldest]

    def _update(self) -> None:
        """Sort the window again (after samples left it other than oldest first)."""
        self._ordered = sorted(self._samples)
        self._set_value()

    def _set_value(self) -> None:
        ordered = self._ordered
        count = len(ordered)
        rank = self._full_rank if count == self._size else _rank(self._percentile, count)
        self.value_ns = ordered[rank]


def _rank(percentile: float, count: int) -> int:
    """The index of the nearest-rank ``percentile`` among ``count`` sorted samples."""
    return max(0, math.ceil(percentile / 100.0 * count) - 1)


def _insort(ordered: list[int], value_ns: int) -> None:
    """``bisect.insort`` for a window's few samples: a loop, which the compiled core runs
    natively, where a call of ``insort`` goes through the interpreter's generic call."""
    index = len(ordered)
    while index > 0 and ordered[index - 1] > value_ns:
        index -= 1
    ordered.insert(index, value_ns)


class KindPredictions:
    """Predictions for one model on one executor kind. ``exec_ns[b]`` and ``load_ns`` are the
    current predictions (read on every scheduling decision, so kept as plain values)."""

    __slots__ = (
        "_exec_windows",
        "_load_window",
        "_pooled",
        "_seed_exec_ns",
        "exec_ns",
        "kind",
        "load_ns",
        "seed_kind",
        "targets",
    )

    def __init__(
        self,
        profile: ModelProfile,
        kind: str,
        seed_kind: str,
        size: int,
        percentile: float,
        pooled_size: int = 0,
    ) -> None:
        self.kind = kind
        self.seed_kind = seed_kind  # == kind unless seeded from a fallback
        self._exec_windows = {
            batch: SlidingWindow(size, percentile, ns) for batch, ns in profile.execute_ns.items()
        }
        self._seed_exec_ns = dict(profile.execute_ns)
        # Pooled (the module's "Pooled"): one window of measured / seed ratios, in RATIO_ONE
        # units, for every batch size; the per-batch windows then go unused.
        self._pooled = SlidingWindow(pooled_size, percentile, RATIO_ONE) if pooled_size else None
        self._load_window = SlidingWindow(size, percentile, profile.load_ns)
        self.exec_ns: dict[int, int] = dict(profile.execute_ns)
        self.load_ns = profile.load_ns
        self.targets: dict[int, int] = {}  # a cache for the admission ledger (ledger.py)

    def record_execute(self, batch_size: int, measured_ns: int, now_ns: int = 0) -> int:
        """Add a measured execute duration; return the error (measured - predicted before)."""
        window = self._exec_windows.get(batch_size)
        if window is None:
            return 0
        if self._pooled is not None:
            error_ns = measured_ns - self.exec_ns[batch_size]
            self._pooled.add(self._ratio(batch_size, measured_ns), now_ns)
            self._took_pooled()
            return error_ns
        error_ns = measured_ns - window.value_ns
        window.add(measured_ns, now_ns)
        self._took(batch_size, window)
        return error_ns

    def record_load(self, measured_ns: int, now_ns: int = 0) -> int:
        """Add a measured LOAD duration; return the error (measured - predicted before)."""
        error_ns = measured_ns - self._load_window.value_ns
        self._load_window.add(measured_ns, now_ns)
        self.load_ns = self._load_window.value_ns
        return error_ns

    def exec_stale(self, batch_size: int, now_ns: int, stale_ns: int) -> bool:
        """Whether the execute window of ``batch_size`` had no sample for ``stale_ns``."""
        window = self._pooled or self._exec_windows[batch_size]
        return now_ns - window.updated_ns >= stale_ns

    def record_probe(self, batch_size: int, measured_ns: int, now_ns: int, factor: float) -> int:
        """Record a probe's measurement (warm_up.py): the window was stale, so the samples
        over ``factor`` x this one describe a machine that has since changed: forgotten.
        Return the prediction error."""
        if self._pooled is not None:
            error_ns = measured_ns - self.exec_ns[batch_size]
            ratio = self._ratio(batch_size, measured_ns)
            self._pooled.add(ratio, now_ns)
            self._pooled.forget_above(int(factor * ratio))
            self._took_pooled()
            return error_ns
        window = self._exec_windows[batch_size]
        error_ns = measured_ns - window.value_ns
        window.add(measured_ns, now_ns)
        window.forget_above(int(factor * measured_ns))
        self._took(batch_size, window)
        return error_ns

    def _ratio(self, batch_size: int, measured_ns: int) -> int:
        """A measurement over its batch size's seed, in RATIO_ONE units (rounded down)."""
        return measured_ns * RATIO_ONE // max(1, self._seed_exec_ns[batch_size])

    def _took_pooled(self) -> None:
        """Every batch size's prediction: its seed x the pooled window's ratio, rounded up."""
        assert self._pooled is not None
        ratio = self._pooled.value_ns
        exec_ns, changed = self.exec_ns, False
        for batch_size, seed_ns in self._seed_exec_ns.items():
            value_ns = -(-seed_ns * ratio // RATIO_ONE)  # ceil: never below seed x ratio
            if exec_ns[batch_size] != value_ns:
                exec_ns[batch_size] = value_ns
                changed = True
        if changed:
            self.targets.clear()

    def relax(self, now_ns: int, stale_ns: int, factor: float) -> None:
        """Let stale windows forget an outlier (see the module's "Recovery")."""
        if self._pooled is not None:
            if self._pooled.forget_outlier(now_ns, stale_ns, factor):
                self._took_pooled()
        else:
            for batch_size, window in self._exec_windows.items():
                if window.forget_outlier(now_ns, stale_ns, factor):
                    self._took(batch_size, window)
        if self._load_window.forget_outlier(now_ns, stale_ns, factor):
            self.load_ns = self._load_window.value_ns

    def _took(self, batch_size: int, window: SlidingWindow) -> None:
        if self.exec_ns[batch_size] != window.value_ns:
            self.exec_ns[batch_size] = window.value_ns
            self.targets.clear()


@dataclass(frozen=True, slots=True)
class PredictionError:
    """One measured-minus-predicted sample (positive: slower than predicted)."""

    action: str  # "infer" | "load"
    model: str
    kind: str
    batch_size: int  # 0 for LOAD
    error_ns: int


@dataclass(frozen=True, slots=True)
class PredictionErrorStats:
    count: int = 0
    sum_ns: int = 0
    sum_abs_ns: int = 0
    min_ns: int = 0
    max_ns: int = 0


class Predictions:
    """All predictions of the core, created lazily per (model, kind)."""

    def __init__(self, window_size: int, percentile: float, pooled_size: int = 0) -> None:
        self._size = window_size
        self._percentile = percentile
        self._pooled_size = pooled_size
        self._by_model: dict[str, dict[str, KindPredictions]] = {}
        self.fallback_seeds = 0
        self._totals: dict[str, _ErrorTotals] = {}
        # (action, model, kind, batch_size, error_ns): a PredictionError is made only when
        # read (``recent``), not once per INFER (compiled, a dataclass is built in the
        # interpreter).
        self._recent: deque[tuple[str, str, str, int, int]] = deque(maxlen=RECENT_ERRORS)

    @property
    def recent(self) -> list[PredictionError]:
        """The most recent prediction errors, oldest first."""
        return [PredictionError(*sample) for sample in self._recent]

    def get(self, spec: ModelSpec, kind: str) -> KindPredictions:
        """Return the predictions of ``spec`` on ``kind``, seeding them on first use."""
        per_kind = self._by_model.get(spec.name)
        if per_kind is None:
            per_kind = self._by_model[spec.name] = {}
        found = per_kind.get(kind)
        if found is None:
            found = per_kind[kind] = self._seed(spec, kind)
        return found

    def forget(self, name: str) -> None:
        """Drop every window of model ``name`` (unregistered or re-registered)."""
        self._by_model.pop(name, None)

    def record_execute(
        self, spec: ModelSpec, kind: str, batch_size: int, measured_ns: int, now_ns: int = 0
    ) -> int:
        """Record a measured execute duration; return its prediction error."""
        error_ns = self.get(spec, kind).record_execute(batch_size, measured_ns, now_ns)
        self.note_execute_error(spec, kind, batch_size, error_ns)
        return error_ns

    def record_probe(
        self,
        spec: ModelSpec,
        kind: str,
        batch_size: int,
        measured_ns: int,
        now_ns: int,
        factor: float,
    ) -> None:
        """Record a probe's measured execute duration (KindPredictions.record_probe)."""
        error_ns = self.get(spec, kind).record_probe(batch_size, measured_ns, now_ns, factor)
        self.note_execute_error(spec, kind, batch_size, error_ns)

    def note_execute_error(
        self, spec: ModelSpec, kind: str, batch_size: int, error_ns: int
    ) -> None:
        """Count an execute prediction error learned elsewhere (a cold start's, lanes.py)."""
        self._note("infer", spec.name, kind, batch_size, error_ns)

    def record_load(self, spec: ModelSpec, kind: str, measured_ns: int, now_ns: int = 0) -> int:
        """Record a measured LOAD duration; return its prediction error."""
        error_ns = self.get(spec, kind).record_load(measured_ns, now_ns)
        self._note("load", spec.name, kind, 0, error_ns)
        return error_ns

    def relax(self, name: str, now_ns: int, stale_ns: int, factor: float) -> int:
        """Let model ``name``'s stale windows forget an outlier; returns how many of its
        kinds' predictions were looked at."""
        per_kind = self._by_model.get(name, {})
        for predictions in per_kind.values():
            predictions.relax(now_ns, stale_ns, factor)
        return len(per_kind)

    def _seed(self, spec: ModelSpec, kind: str) -> KindPredictions:
        profile = spec.profiles.get(kind)
        if profile is not None:
            return self._predictions(profile, kind, kind)
        self.fallback_seeds += 1
        return self._predictions(slowest_profile(spec), kind, "*slowest*")

    def _predictions(self, profile: ModelProfile, kind: str, seed_kind: str) -> KindPredictions:
        size, percentile, pooled_size = self._size, self._percentile, self._pooled_size
        return KindPredictions(profile, kind, seed_kind, size, percentile, pooled_size)

    def _note(self, action: str, model: str, kind: str, batch_size: int, error_ns: int) -> None:
        self._recent.append((action, model, kind, batch_size, error_ns))
        totals = self._totals.get(action)
        if totals is None:
            totals = self._totals[action] = _ErrorTotals()
        totals.add(error_ns)

    def error_stats(self) -> dict[str, PredictionErrorStats]:
        """Return the error summary per action kind ("infer", "load")."""
        return {action: totals.snapshot() for action, totals in self._totals.items()}


class _ErrorTotals:
    __slots__ = ("count", "max_ns", "min_ns", "sum_abs_ns", "sum_ns")

    def __init__(self) -> None:
        self.count = self.sum_ns = self.sum_abs_ns = self.min_ns = self.max_ns = 0

    def add(self, error_ns: int) -> None:
        # Compares, not min()/max(): compiled, those are generic calls on boxed ints.
        first = self.count == 0
        if first or error_ns < self.min_ns:
            self.min_ns = error_ns
        if first or error_ns > self.max_ns:
            self.max_ns = error_ns
        self.count += 1
        self.sum_ns += error_ns
        self.sum_abs_ns += -error_ns if error_ns < 0 else error_ns

    def snapshot(self) -> PredictionErrorStats:
        return PredictionErrorStats(
            self.count, self.sum_ns, self.sum_abs_ns, self.min_ns, self.max_ns
        )


def slowest_profile(spec: ModelSpec) -> ModelProfile:
    """Return a profile taking, per batch size and for LOAD, the slowest seed over all kinds."""
    profiles = list(spec.profiles.values())
    execute_ns = {b: max(p.execute_ns[b] for p in profiles) for b in spec.batch_sizes}
    return ModelProfile(execute_ns=execute_ns, load_ns=max(p.load_ns for p in profiles))
