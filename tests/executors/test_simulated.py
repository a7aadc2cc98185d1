"""The simulated backend alone: profile durations, seeded noise, counted pages, profile files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clockwork_async.executors.arena import CountingArena
from clockwork_async.executors.backend import BackendError, PageRun
from clockwork_async.executors.simulated import SimulatedBackend, load_profile_file

from clockwork_async.wire.messages import ErrorCode, TensorSpec

MIB = 1 << 20


class FakeWait:
    """Records requested waits and returns them as if measured exactly."""

    def __init__(self) -> None:
        self.requested_ns: list[int] = []

    def __call__(self, duration_ns: int) -> int:
        self.requested_ns.append(duration_ns)
        return duration_ns


def _run_twice(backend: SimulatedBackend, wait: FakeWait) -> None:
    model = backend.register("m", "tiny-sim", ())
    loaded, durations_ns = backend.load(model, [PageRun(0, 1)])
    assert durations_ns == {"load": wait.requested_ns[-1]}
    for _ in range(2):
        backend.infer(loaded, 1, {"input": np.zeros((1, 4), np.float32)})


def test_slowdown_scales_profile_durations() -> None:
    wait = FakeWait()
    _run_twice(SimulatedBackend(CountingArena(16 * MIB, 1), slowdown=2.0, wait_ns=wait), wait)
    assert wait.requested_ns == [2_000_000, 1_000_000, 1_000_000]


def test_noise_is_seeded_and_reproducible() -> None:
    def durations(seed: int) -> list[int]:
        wait = FakeWait()
        backend = SimulatedBackend(CountingArena(16 * MIB, 1), seed=seed, noise=0.1, wait_ns=wait)
        _run_twice(backend, wait)
        return wait.requested_ns

    assert durations(3) == durations(3)
    assert durations(3) != durations(4)
    assert len(set(durations(3)[1:])) == 2  # noise varies execution to execution


def test_resnet50_profile_counts_pages_without_memory() -> None:
    backend = SimulatedBackend(CountingArena(16 * MIB, 1376))
    model = backend.register("r", "resnet50-v100", (1, 16))
    assert (model.run_pages, model.batch_sizes) == ((1,) * 7, (1, 16))
    assert model.inputs == (TensorSpec("input", "float32", (-1, 3, 224, 224)),)
    with pytest.raises(BackendError) as error:
        backend.register("r", "resnet50-v100", (3,))
    assert error.value.code is ErrorCode.BAD_MODEL


def test_profile_files_load_and_bad_ones_are_named(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        "[profiles.small]\nweights_bytes = 1000\nload_ns = 5000\n"
        "execute_ns = { 1 = 100, 4 = 300 }\ninput_shape = [2]\n"
    )
    (profile,) = load_profile_file(good).values()
    assert (profile.execute_ns, profile.input_shape) == ({1: 100, 4: 300}, (2,))
    backend = SimulatedBackend(CountingArena(MIB, 4))
    model = backend.register("s", str(good), ())
    assert (model.batch_sizes, model.run_pages) == ((1, 4), (1,))

    bad = tmp_path / "bad.toml"
    bad.write_text("[profiles.x]\nweights_bytes = -1\nload_ns = 1\nexecute_ns = { 1 = 1 }\n")
    with pytest.raises(BackendError) as error:
        backend.register("x", str(bad), ())
    assert error.value.code is ErrorCode.BAD_MODEL and "weights_bytes" in error.value.message
