"""Registration profiling: measure a model's LOAD and per-batch execute times on an executor.

On one executor of each kind: LOAD (``load_iterations`` times, unloading in between), then for
each batch size, ascending, ``warmup_iterations`` INFERs whose times are thrown away and
``iterations`` measured ones, then UNLOAD. A batch size whose measured execute time (the
``percentile`` of its samples, as the core predicts) exceeds ``max_execute_ns`` is not offered,
nor is any larger one (they can only be slower); the smallest batch size is always offered.

The actions run under the core's feet (the core does not know the model yet): each has a wide
window, so it waits its turn in the executor's lanes. A profile is per model *file*; the caller
caches `RegistrationProfile.to_json()` on disk by file hash and machine.

Invariant: every kind in a `RegistrationProfile` has an execute time for every offered batch
size.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clockwork_async.config_keys import internal, ranged
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
    window_ns: int = ranged(30_000 * MS_NS, MS_NS, 3_600_000 * MS_NS)  # an action's wait, at most
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

Act = Callable[[Message], Awaitable[Message]]  # send an action (its id set) and await its reply
ActionId = Callable[[], int]
ExecutorNow = Callable[[], int]  # the executor's clock, as the controller estimates it


@dataclass(slots=True)
class ProfilingTarget:
    """How to run actions on the executor being profiled."""

    act: Act
    next_action_id: ActionId
    executor_now_ns: ExecutorNow


async def measure(
    target: ProfilingTarget,
    model: str,
    inputs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    config: ProfilerConfig,
) -> tuple[ModelProfile, tuple[int, ...]]:
    """Profile ``model`` (registered, not loaded) on one executor.

    Returns its ModelProfile and the batch sizes offered. Raises ProfilingError.
    """
    try:
        load_samples_ns = await _measure_loads(target, model, config)
        execute_ns = await _measure_batches(target, model, inputs, batch_sizes, config)
    except BaseException:
        with contextlib.suppress(Exception):  # best effort: it may not be loaded at all
            await target.act(Unload(target.next_action_id(), model))
        raise
    await _run(target, Unload(target.next_action_id(), model), "UNLOAD")
    profile = ModelProfile(execute_ns, percentile_ns(load_samples_ns, config.percentile))
    return profile, tuple(sorted(execute_ns))


async def _measure_loads(target: ProfilingTarget, model: str, config: ProfilerConfig) -> list[int]:
    samples_ns: list[int] = []
    for iteration in range(config.load_iterations):
        if iteration:
            await _run(target, Unload(target.next_action_id(), model), "UNLOAD")
        earliest_ns = target.executor_now_ns()
        load = Load(target.next_action_id(), model, earliest_ns, earliest_ns + config.window_ns)
        result = await _run(target, load, "LOAD")
        samples_ns.append(_phase_ns(result, "load"))
    return samples_ns


async def _measure_batches(
    target: ProfilingTarget,
    model: str,
    inputs: Sequence[TensorSpec],
    batch_sizes: Sequence[int],
    config: ProfilerConfig,
) -> dict[int, int]:
    execute_ns: dict[int, int] = {}
    for batch_size in sorted(batch_sizes):
        batch = zero_batch(inputs, batch_size)
        samples_ns = []
        for iteration in range(config.warmup_iterations + config.iterations):
            result = await _run(target, _infer(target, model, batch_size, batch, config), "INFER")
            if iteration >= config.warmup_iterations:
                samples_ns.append(_phase_ns(result, "execute"))
        measured_ns = percentile_ns(samples_ns, config.percentile)
        if execute_ns and measured_ns > config.max_execute_ns:
            break  # larger batches can only be slower
        execute_ns[batch_size] = measured_ns
        if measured_ns > config.max_execute_ns:
            break  # the smallest batch is kept, however slow, so the model stays servable
    return execute_ns


def _infer(
    target: ProfilingTarget,
    model: str,
    batch_size: int,
    batch: Mapping[str, np.ndarray],
    config: ProfilerConfig,
) -> Infer:
    earliest_ns = target.executor_now_ns()
    return Infer(
        target.next_action_id(),
        model,
        batch_size,
        batch,
        earliest_ns,
        earliest_ns + config.window_ns,
    )


async def _run(target: ProfilingTarget, action: Message, what: str) -> ActionResult:
    reply = await target.act(action)
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
