"""The simulated backend: the executor protocol and page accounting without a device.

Invariants:
- Memory is counted, never allocated: the arena is a `CountingArena`, so a simulated executor
  can stand for a 32 GB device. A model takes ``pages_for(weights_bytes, page_bytes)`` pages,
  each its own run (simulated weights have no tensors that need contiguity).
- A model is a duration profile (`clockwork_async.sim.profiles.SimProfile`): a built-in name
  (``resnet50-v100``, ``tiny-sim``), a name from ``--profile-file``, or the path of a profile
  file holding one profile.
- LOAD and INFER take the profile's duration x ``slowdown`` x (1 + ``noise`` x N(0, 1), at
  least 0), waited precisely; the reported durations are measured, not the profile's.
  Noise is seeded: one generator per lane, so a seed gives the same sequence per lane.
- Registered models are held in the backends' one `model_registry.ModelRegistry`: a model
  this backend did not register (or already forgot) is UNKNOWN_MODEL.
- Outputs are deterministic: ``output[b, k] = k`` except ``output[b, 0]``, the first input
  value of item ``b`` (so a test can tell batch rows apart).

Profile file (TOML), one table per profile::

    [profiles.my-model]
    weights_bytes = 102000000
    load_ns = 8300000
    execute_ns = { 1 = 2730000, 2 = 4050000 }   # batch size -> ns
    input_shape = [3, 224, 224]                  # optional, per item, float32
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clockwork_async.sim.profiles import BUILTIN_PROFILES, MIB, SimProfile
from clockwork_async.wire.messages import ErrorCode, TensorSpec

from .arena import CountingArena, pages_for
from .backend import Arena, BackendError, LoadedModel, PageRun, RegisteredModel
from .model_registry import ModelRegistry
from .precise import precise_wait_ns

OUTPUT_CLASSES = 1000
DEFAULT_PAGES_TOTAL = 1376  # a 32 GB V100's weights cache in 16 MiB pages (the paper)


@dataclass(slots=True)  # mutable attributes, as the backend protocols declare them
class SimRegistered:
    name: str
    weights_bytes: int
    run_pages: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]
    profile: SimProfile


@dataclass(slots=True)
class SimLoaded:
    model: RegisteredModel  # a SimRegistered
    runs: tuple[PageRun, ...]


def _bad_model(message: str) -> BackendError:
    return BackendError(ErrorCode.BAD_MODEL, message)


def _positive_int(table: Mapping[str, Any], key: str, where: str) -> int:
    value = table.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _bad_model(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _execute_ns(table: Mapping[str, Any], where: str) -> dict[int, int]:
    raw = table.get("execute_ns")
    if not isinstance(raw, dict) or not raw:
        raise _bad_model(f"{where}: execute_ns must be a table of batch size -> ns")
    if not all(str(key).isdigit() and int(key) > 0 for key in raw):
        raise _bad_model(f"{where}: execute_ns keys must be positive batch sizes, got {list(raw)}")
    return {int(key): _positive_int(raw, key, f"{where}.execute_ns") for key in raw}


def _input_shape(table: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = table.get("input_shape", [3, 224, 224])
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 for dim in shape
    ):
        raise _bad_model(f"{where}: input_shape must be a list of positive integers")
    return tuple(shape)


def profile_from_table(name: str, table: Mapping[str, Any], where: str) -> SimProfile:
    """A SimProfile from one TOML table. Raises BackendError(BAD_MODEL) naming the field."""
    weights_bytes = _positive_int(table, "weights_bytes", where)
    return SimProfile(
        name=name,
        execute_ns=_execute_ns(table, where),
        load_ns=_positive_int(table, "load_ns", where),
        weights_bytes=weights_bytes,
        weights_pages=pages_for(weights_bytes, 16 * MIB),
        input_shape=_input_shape(table, where),
    )


def load_profile_file(path: str | Path) -> dict[str, SimProfile]:
    """Every ``[profiles.NAME]`` table of a TOML file. Raises BackendError(BAD_MODEL)."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise _bad_model(f"cannot read profile file {str(path)!r}: {error}") from None
    tables = document.get("profiles")
    if not isinstance(tables, dict) or not tables:
        raise _bad_model(f"profile file {str(path)!r} has no [profiles.NAME] tables")
    return {
        name: profile_from_table(name, table, f"{path}: profiles.{name}")
        for name, table in tables.items()
        if isinstance(table, dict)
    }


class SimulatedBackend:
    """Waits for profiled durations instead of computing; counts pages instead of holding them."""

    name: str = "simulated"
    device: str = "sim"
    kind: str = "sim"
    lanes: tuple[str, ...] = ("load", "execute")

    def __init__(
        self,
        arena: CountingArena,
        *,
        seed: int = 0,
        noise: float = 0.0,
        slowdown: float = 1.0,
        profiles: Mapping[str, SimProfile] | None = None,
        wait_ns: Callable[[int], int] = precise_wait_ns,
    ) -> None:
        """``wait_ns(duration)`` waits and returns the measured ns (tests inject a fake)."""
        if noise < 0 or slowdown <= 0:
            raise ValueError(f"need noise >= 0 and slowdown > 0, got {noise}, {slowdown}")
        self.arena: Arena = arena
        self._noise = noise
        self._slowdown = slowdown
        self._wait_ns = wait_ns
        self._profiles = {**BUILTIN_PROFILES, **(profiles or {})}
        self._registered = ModelRegistry(SimRegistered)
        load_seed, execute_seed = np.random.SeedSequence(seed).spawn(2)
        self._load_rng = np.random.default_rng(load_seed)
        self._execute_rng = np.random.default_rng(execute_seed)

    def _profile(self, path: str) -> SimProfile:
        if path in self._profiles:
            return self._profiles[path]
        if not Path(path).is_file():
            known = ", ".join(sorted(self._profiles))
            raise _bad_model(f"{path!r} is neither a known profile ({known}) nor a profile file")
        profiles = load_profile_file(path)
        if len(profiles) != 1:
            raise _bad_model(f"profile file {path!r} holds {len(profiles)} profiles, not one")
        return next(iter(profiles.values()))

    def register(
        self,
        name: str,
        path: str,
        batch_sizes: Sequence[int],
        inputs: Sequence[TensorSpec] = (),
    ) -> SimRegistered:
        """A model timed by profile ``path``. Its one input is the profile's: the shapes
        declared for a model file (``inputs``) do not apply. Raises BackendError(BAD_MODEL)."""
        profile = self._profile(path)
        unknown = sorted(set(batch_sizes) - set(profile.batch_sizes))
        if unknown:
            raise _bad_model(f"profile {profile.name!r} has no duration for batch sizes {unknown}")
        pages = pages_for(profile.weights_bytes, self.arena.page_bytes)
        model = SimRegistered(
            name=name,
            weights_bytes=profile.weights_bytes,
            run_pages=(1,) * pages,
            inputs=(TensorSpec("input", "float32", (-1, *profile.input_shape)),),
            outputs=(TensorSpec("output", "float32", (-1, OUTPUT_CLASSES)),),
            batch_sizes=tuple(sorted(batch_sizes)) or profile.batch_sizes,
            profile=profile,
        )
        self._registered.add(model)
        return model

    def unregister(self, model: RegisteredModel) -> None:
        """Forget ``model``. Raises BackendError(UNKNOWN_MODEL)."""
        self._registered.remove(model)

    def _duration_ns(self, base_ns: int, rng: np.random.Generator) -> int:
        factor = self._slowdown
        if self._noise:
            factor *= max(0.0, 1.0 + self._noise * float(rng.standard_normal()))
        return round(base_ns * factor)

    def load(
        self, model: RegisteredModel, runs: Sequence[PageRun]
    ) -> tuple[SimLoaded, dict[str, int]]:
        """Wait the profile's LOAD time. Returns the loaded model and ``{"load": ns}``."""
        registered = self._registered.own(model)
        if [run.count for run in runs] != list(registered.run_pages):
            raise BackendError(ErrorCode.INTERNAL, f"runs {runs} do not fit {registered.name!r}")
        load_ns = self._wait_ns(self._duration_ns(registered.profile.load_ns, self._load_rng))
        return SimLoaded(registered, tuple(runs)), {"load": load_ns}

    def infer(
        self, loaded: LoadedModel, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Wait the profile's execute time for ``batch_size``. Returns deterministic outputs
        and measured ``copy_in``/``execute``/``copy_out`` durations."""
        model = self._registered.own(loaded.model)
        start_ns = time.monotonic_ns()
        first_values = np.asarray(inputs["input"]).reshape(batch_size, -1)[:, 0]
        copied_ns = time.monotonic_ns()
        base_ns = model.profile.execute_ns[batch_size]
        execute_ns = self._wait_ns(self._duration_ns(base_ns, self._execute_rng))
        out_start_ns = time.monotonic_ns()
        output = np.empty((batch_size, OUTPUT_CLASSES), dtype=np.float32)
        output[:] = np.arange(OUTPUT_CLASSES, dtype=np.float32)
        output[:, 0] = first_values
        durations_ns = {
            "copy_in": copied_ns - start_ns,
            "execute": execute_ns,
            "copy_out": time.monotonic_ns() - out_start_ns,
        }
        return {"output": output}, durations_ns

    def unload(self, loaded: LoadedModel) -> None:
        """Nothing reads simulated pages; releasing is immediate."""

    def close(self) -> None:
        self._registered.clear()
        self.arena.close()


def make_simulated_backend(
    page_bytes: int,
    weights_bytes: int | None,
    *,
    seed: int = 0,
    noise: float = 0.0,
    slowdown: float = 1.0,
    profile_file: str | None = None,
) -> SimulatedBackend:
    """A simulated backend over a counting arena of ``weights_bytes // page_bytes`` pages
    (default: the paper's V100, 1,376 pages). Raises BackendError(BAD_MODEL) for a bad
    profile file, ValueError for bad geometry."""
    pages_total = DEFAULT_PAGES_TOTAL if weights_bytes is None else weights_bytes // page_bytes
    profiles = load_profile_file(profile_file) if profile_file else None
    return SimulatedBackend(
        CountingArena(page_bytes, pages_total),
        seed=seed,
        noise=noise,
        slowdown=slowdown,
        profiles=profiles,
    )
