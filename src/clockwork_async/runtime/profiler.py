"""Registration profiling: measure a model's LOAD and per-batch execute times on an executor.

On one executor of each kind: LOAD (``load_iterations`` times, unloading in between), then for
each batch size, ascending, ``warmup_iterations`` INFERs whose times are thrown away and
``iterations`` measured ones, then UNLOAD. A batch size whose measured execute time (the
``percentile`` of its samples, as the core predicts) exceeds ``max_execute_ns`` is not offered,
nor is any larger one (they can only be slower); the smallest batch size is always offered.

Each LOAD and INFER runs on a lane the core reserved for it (`ReserveLane`,
core/reservations.py), so no request is planned under it: the reservation is twice the slowest
run seen of the same action plus 5 ms; a batch size not measured yet, linear in the rows from
the largest one measured; the first LOAD and the first INFER, with nothing to go by,
``slow_execute_ns`` (the core holds a reservation's lane past its end until it is released).
The wait for each reply follows its reservation: twice it plus 1 s (the first LOAD and INFER:
what is left of the cap); no fixed timeout.
The time cap: ``max_profile_ns`` per model and kind; what is not measured by then is not
offered (without batch 1, the registration fails). Slow models get fewer runs and batch sizes
(`_repetitions`, `_worth_measuring`): a batch size whose first run took over
``slow_execute_ns`` gets that run as its only warm-up and ``slow_iterations`` measured runs; a
larger size whose linear bound is over ``max_execute_ns``, or whose runs would not fit in the
cap, is not measured. A profile is per model *file*; the caller caches
`RegistrationProfile.to_json()` on disk by file hash and machine.

Invariant: every kind in a `RegistrationProfile` has an execute time for every offered batch
size.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from clockwork_async.config.keys import internal, ranged
from clockwork_async.core.config import ConfigError, ControllerConfig
from clockwork_async.core.events import ModelProfile
from clockwork_async.runtime.batching import zero_batch
from clockwork_async.wire.messages import (
    ActionResult,
    Infer,
    Load,
    Message,
    TensorSpec,
    Unload,
)

MS_NS = 1_000_000
PROFILE_FORMAT_VERSION = 1
RESERVE_FACTOR = 2  # a lane is reserved for twice the slowest run seen of the same action
RESERVE_SLACK_NS = 5 * MS_NS  # plus this: a short action's noise
REPLY_GRACE_NS = 1_000 * MS_NS  # a reply may come this long past twice its reservation
UNLOAD_WAIT_NS = 60_000 * MS_NS  # an UNLOAD waits for the action running in its lane
CORE_PERCENTILE = ControllerConfig().percentile  # the core's default, not a second one


class ProfilingError(RuntimeError):
    """A profiling action failed (no free pages, backend error, executor gone)."""


@dataclass(frozen=True, slots=True)
class ProfilerConfig:
    """How registration profiles: the daemon's ``[profiler]`` section, key for key
    (`config_keys`)."""

    warmup_iterations: int = ranged(2, 0, 1000)  # INFERs per batch size whose times are dropped
    iterations: int = ranged(10, 1, 10_000)  # measured INFERs per batch size
    load_iterations: int = ranged(2, 1, 1000)  # measured LOADs
    max_execute_ns: int = ranged(1_000 * MS_NS, 1_000, 600_000 * MS_NS)  # slower: not offered
    window_ns: int = ranged(30_000 * MS_NS, MS_NS, 3_600_000 * MS_NS)  # past its planned start
    max_profile_ns: int = ranged(300_000 * MS_NS, MS_NS, 86_400_000 * MS_NS)  # per model, kind
    slow_execute_ns: int = ranged(50 * MS_NS, 0, 600_000 * MS_NS)  # a first run over: slow
    slow_iterations: int = ranged(2, 1, 10_000)  # measured INFERs per batch size when slow
    max_concurrent: int = ranged(2, 1, 64)  # registrations profiling at once
    percentile: float = internal(CORE_PERCENTILE)  # as the core predicts (docs/controller.md)

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.load_iterations < 1:
            raise ConfigError("iterations", (self.iterations, self.load_iterations), ">= 1 each")
        if self.warmup_iterations < 0:
            raise ConfigError("warmup_iterations", self.warmup_iterations, ">= 0")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError("percentile", self.percentile, "in (0, 100]")
        if self.max_execute_ns <= 0:
            raise ConfigError("max_execute_ns", self.max_execute_ns, "> 0")
        if self.window_ns <= 0:
            raise ConfigError("window_ns", self.window_ns, "> 0")
        if self.max_profile_ns <= 0 or self.slow_iterations < 1 or self.max_concurrent < 1:
            raise ConfigError(
                "max_profile_ns, slow_iterations, max_concurrent",
                (self.max_profile_ns, self.slow_iterations, self.max_concurrent),
                "> 0 each",
            )


@dataclass(frozen=True, slots=True)
class RegistrationProfile:
    """What registration measured: the offered batch sizes and, per executor kind, the LOAD
    time and the execute time of each offered batch size."""

    batch_sizes: tuple[int, ...]
    kinds: Mapping[str, ModelProfile]

    def __post_init__(self) -> None:
        for kind, profile in self.kinds.items():
            missing = [b for b in self.batch_sizes if b not in profile.execute_ns]
            if missing:
                raise ValueError(f"profile of kind {kind!r} lacks batch sizes {missing}")

    def merged(self, other: RegistrationProfile) -> RegistrationProfile:
        """Both profiles' kinds (``other`` wins a tie), offering the sizes both offer."""
        sizes = tuple(b for b in self.batch_sizes if b in other.batch_sizes) or (
            min(self.batch_sizes),
        )
        kinds = {**self.kinds, **other.kinds}
        return RegistrationProfile(sizes, {k: _only(p, sizes) for k, p in kinds.items()})

    def to_json(self) -> str:
        """A JSON document that `from_json` reads back."""
        kinds = {
            kind: {
                "load_ns": profile.load_ns,
                "execute_ns": {str(b): ns for b, ns in sorted(profile.execute_ns.items())},
            }
            for kind, profile in sorted(self.kinds.items())
        }
        document = {
            "version": PROFILE_FORMAT_VERSION,
            "batch_sizes": list(self.batch_sizes),
            "kinds": kinds,
        }
        return json.dumps(document, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RegistrationProfile:
        """Parse `to_json` output. Raises ValueError naming what is wrong."""
        try:
            document = json.loads(text)
            if document.get("version") != PROFILE_FORMAT_VERSION:
                raise ValueError(f"unsupported profile version {document.get('version')!r}")
            sizes = tuple(_positive(b, "batch size") for b in document["batch_sizes"])
            kinds = {str(kind): _model_profile(table) for kind, table in document["kinds"].items()}
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a registration profile: {error!r}") from None
        if not sizes:
            raise ValueError("a registration profile offers no batch size")
        return cls(sizes, kinds)


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _model_profile(table: Mapping[str, Any]) -> ModelProfile:
    execute = {
        _positive(int(b), "batch size"): _positive(ns, "execute_ns")
        for b, ns in table["execute_ns"].items()
    }
    return ModelProfile(execute_ns=execute, load_ns=_positive(table["load_ns"], "load_ns"))


def _only(profile: ModelProfile, sizes: Sequence[int]) -> ModelProfile:
    return ModelProfile({b: profile.execute_ns[b] for b in sizes}, profile.load_ns)


def percentile_ns(samples: Sequence[int], percentile: float) -> int:
    """Nearest-rank percentile of ``samples`` (non-empty)."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(percentile / 100.0 * len(ordered)))
    return ordered[rank - 1]


# --- measuring on one executor ----------------------------------------------------------------

# Builds the action to run from its window, in the executor's clock (its id already chosen).
Build = Callable[[int, int], Message]
# Run an action in ``lane`` ("execute", "load"; "" for UNLOAD: no lane) with the lane reserved
# for ``reserve_ns`` (core/reservations.py): send ``build(window)``, await its reply for at most
# ``wait_ns`` (raising ProfilingError after that).
RunReserved = Callable[[str, int, int, Build], Awaitable[Message]]
ActionId = Callable[[], int]


@dataclass(slots=True)
class ProfilingTarget:
    """How to run actions on the executor being profiled: each with its lane reserved
    (`run`), ids apart from the core's, and the controller's clock for the time cap."""

    run: RunReserved
    next_action_id: ActionId
    now_ns: Callable[[], int] = time.monotonic_ns
    progress: Callable[[str], None] = lambda what: None  # "LOAD 1/2", "batch 4: run 3/12"


@dataclass(slots=True)
class _Budget:
    """What is left of ``max_profile_ns`` for one model on one executor."""

    target: ProfilingTarget
    until_ns: int

    def left_ns(self) -> int:
        return self.until_ns - self.target.now_ns()

    def reserve(self, predicted_ns: int | None, config: ProfilerConfig) -> tuple[int, int]:
        """The lane time to reserve for an action predicted at ``predicted_ns`` and how long
        to wait for its reply: twice the prediction plus `RESERVE_SLACK_NS`, and twice that
        plus `REPLY_GRACE_NS`; with no prediction (None), ``slow_execute_ns`` (the core holds
        the lane past it until the reply) and all that is left of the cap. Raises
        ProfilingError once the cap is spent."""
        left_ns = self.left_ns()
        if left_ns <= 0:
            raise ProfilingError("its profiling took longer than profiler.max_profile_ns")
        if predicted_ns is None:
            return min(left_ns, max(config.slow_execute_ns, MS_NS)), left_ns
        reserve_ns = min(left_ns, RESERVE_FACTOR * predicted_ns + RESERVE_SLACK_NS)
        return reserve_ns, min(left_ns, 2 * reserve_ns + REPLY_GRACE_NS)


async def measure(
    target: ProfilingTarget,
    model: str,
    inputs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    config: ProfilerConfig,
) -> tuple[ModelProfile, tuple[int, ...]]:
    """Profile ``model`` (registered, not loaded) on one executor, each action on a lane
    reserved for its prediction, within ``config.max_profile_ns``.

    Returns its ModelProfile and the batch sizes offered. Raises ProfilingError.
    """
    budget = _Budget(target, target.now_ns() + config.max_profile_ns)
    try:
        load_samples_ns = await _measure_loads(target, model, config, budget)
        execute_ns = await _measure_batches(target, model, inputs, batch_sizes, config, budget)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort: it may not be loaded at all
            await _unload(target, model)
        raise
    await _check(await _unload(target, model), "UNLOAD")
    profile = ModelProfile(execute_ns, percentile_ns(load_samples_ns, config.percentile))
    return profile, tuple(sorted(execute_ns))


async def _unload(target: ProfilingTarget, model: str) -> Message:
    action_id = target.next_action_id()
    wait_ns = REPLY_GRACE_NS + UNLOAD_WAIT_NS
    return await target.run("", 0, wait_ns, lambda earliest_ns, latest_ns: Unload(action_id, model))


async def _measure_loads(
    target: ProfilingTarget, model: str, config: ProfilerConfig, budget: _Budget
) -> list[int]:
    samples_ns: list[int] = []
    for iteration in range(config.load_iterations):
        if iteration:
            await _check(await _unload(target, model), "UNLOAD")
        target.progress(f"LOAD {iteration + 1}/{config.load_iterations}")
        action_id = target.next_action_id()
        times = budget.reserve(max(samples_ns) if samples_ns else None, config)
        result = await _run(target, "load", times, partial(Load, action_id, model), "LOAD", config)
        samples_ns.append(_phase_ns(result, "load"))
    return samples_ns


async def _measure_batches(
    target: ProfilingTarget,
    model: str,
    inputs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    config: ProfilerConfig,
    budget: _Budget,
) -> dict[int, int]:
    execute_ns: dict[int, int] = {}
    for batch_size in sorted(batch_sizes):
        guess_ns = _extrapolated_ns(execute_ns, batch_size)
        if execute_ns and not _worth_measuring(guess_ns, config, budget):
            break  # larger batches can only be slower (and the cap is the cap)
        batch = zero_batch(inputs, batch_size)
        samples_ns: list[int] = []
        first_ns: int | None = None
        done = 0
        while done < (runs := sum(_repetitions(first_ns, config))):
            target.progress(f"batch {batch_size}: run {done + 1}/{runs}")
            known_ns = max(samples_ns) if samples_ns else first_ns
            times = budget.reserve(known_ns if known_ns is not None else guess_ns, config)
            build = partial(Infer, target.next_action_id(), model, batch_size, batch)
            result = await _run(target, "execute", times, build, "INFER", config)
            measured_ns = _phase_ns(result, "execute")
            first_ns = measured_ns if first_ns is None else first_ns
            if done >= _repetitions(first_ns, config)[0]:
                samples_ns.append(measured_ns)
            done += 1
        measured_ns = percentile_ns(samples_ns, config.percentile)
        if execute_ns and measured_ns > config.max_execute_ns:
            break  # larger batches can only be slower
        execute_ns[batch_size] = measured_ns
        if measured_ns > config.max_execute_ns:
            break  # the smallest batch is kept, however slow, so the model stays servable
    return execute_ns


def _repetitions(first_ns: int | None, config: ProfilerConfig) -> tuple[int, int]:
    """Warm-up and measured INFERs of one batch size. The slow rule: when its first run took
    over ``slow_execute_ns``, that run is its only warm-up and ``slow_iterations`` (at most
    ``iterations``) are measured."""
    if first_ns is None or first_ns <= config.slow_execute_ns:
        return config.warmup_iterations, config.iterations
    return 1, min(config.iterations, config.slow_iterations)


def _extrapolated_ns(execute_ns: Mapping[int, int], batch_size: int) -> int | None:
    """A bound on a batch size's time from the largest measured one: linear in the rows
    (batching rarely costs more per row); None before any is measured."""
    if not execute_ns:
        return None
    largest = max(execute_ns)
    return execute_ns[largest] * batch_size // largest


def _worth_measuring(guess_ns: int | None, config: ProfilerConfig, budget: _Budget) -> bool:
    """The fewer-batch-sizes rule: a size whose bound is over ``max_execute_ns`` (it would
    not be offered), or whose runs would not fit in what is left of the cap, is skipped."""
    if guess_ns is None:
        return True
    runs = sum(_repetitions(guess_ns, config))
    return guess_ns <= config.max_execute_ns and runs * guess_ns <= budget.left_ns()


async def _run(
    target: ProfilingTarget,
    lane: str,
    times: tuple[int, int],
    build: Callable[[int, int], Message],
    what: str,
    config: ProfilerConfig,
) -> ActionResult:
    """Run one action: its lane reserved and its reply awaited for ``times`` (`_Budget`)."""

    def window(earliest_ns: int, planned_start_ns: int) -> Message:
        return build(earliest_ns, planned_start_ns + config.window_ns)

    reserve_ns, wait_ns = times
    return await _check(await target.run(lane, reserve_ns, wait_ns, window), what)


async def _check(reply: Message, what: str) -> ActionResult:
    if not isinstance(reply, ActionResult):
        raise ProfilingError(f"{what} answered with {type(reply).__name__}")
    if not reply.ok:
        raise ProfilingError(f"{what} failed: {reply.code}: {reply.message}")
    return reply


def _phase_ns(result: ActionResult, phase: str) -> int:
    duration_ns = result.durations_ns.get(phase)
    if duration_ns is None:
        duration_ns = result.end_ns - result.start_ns  # a backend that reports no phases
    return max(1, duration_ns)
