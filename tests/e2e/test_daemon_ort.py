"""The embedded default with real ONNX Runtime executors: `clockwork-async serve` with no config
file, its state and cache folders in a temporary XDG home, at most two CPUs (so one pinned
executor). It generates the demo models, registers them, and must answer exactly what ONNX
Runtime computes directly; a second start uses the cached profiles instead of measuring again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from clockwork_async.client import Client
from clockwork_async.core.outcomes import Outcome

from .harness import DaemonProcess, clean_environ

pytestmark = pytest.mark.slow
SLO_MS = 5_000.0
DEMO_MODELS = {"tiny", "mlp", "resnet-like"}
FREE_PORTS = {
    "CLOCKWORK_ASYNC_SERVER_LISTEN": "127.0.0.1:0",
    "CLOCKWORK_ASYNC_METRICS_LISTEN": "127.0.0.1:0",
    "CLOCKWORK_ASYNC_HTTP_LISTEN": "127.0.0.1:0",
    "CLOCKWORK_ASYNC_GRPC_LISTEN": "127.0.0.1:0",
}


@dataclass
class Embedded:
    daemon: DaemonProcess
    folder: Path
    env: dict[str, str]
    cpus: set[int]

    @property
    def repository(self) -> Path:
        return self.folder / "state" / "clockwork-async" / "models"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Embedded]:
    folder = tmp_path_factory.mktemp("embedded")
    env = clean_environ(folder, FREE_PORTS)
    cpus = set(sorted(os.sched_getaffinity(0))[-2:])
    daemon = DaemonProcess.start(folder, env=env, cpus=cpus)
    try:
        yield Embedded(daemon, folder, env, cpus)
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def client(embedded: Embedded) -> Iterator[Client]:
    with Client(embedded.daemon.api, timeout_s=60.0) as connected:
        yield connected


def test_the_demo_models_are_generated_and_served(embedded: Embedded, client: Client) -> None:
    assert {model.name for model in client.models()} == DEMO_MODELS
    assert {path.name for path in embedded.repository.iterdir()} >= DEMO_MODELS
    cache = embedded.folder / "cache" / "clockwork-async" / "demo-models"
    assert {path.stem for path in cache.glob("*.onnx")} == DEMO_MODELS
    assert client.health().ready
    assert embedded.daemon.http_get("/readyz")[0] == 200


@pytest.mark.parametrize("model", sorted(DEMO_MODELS))
def test_outputs_equal_onnx_runtime_run_directly(
    embedded: Embedded, client: Client, model: str
) -> None:
    session = onnxruntime.InferenceSession(
        str(embedded.repository / model / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (spec,) = session.get_inputs()
    shape = [1 if isinstance(dim, str) else dim for dim in spec.shape]
    rng = np.random.default_rng(7)
    rows = [{spec.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(24)]
    futures = [client.submit(model, inputs, slo_ms=SLO_MS) for inputs in rows]  # batched
    for inputs, future in zip(rows, futures, strict=True):
        result = future.result(60)
        assert result.status == Outcome.OK, result.message
        expected = dict(
            zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True)
        )
        assert result.outputs.keys() == expected.keys()
        for name, array in expected.items():
            # Batched kernels sum in another order: allow float32 rounding at the output's scale.
            scale = float(np.abs(array).max())
            np.testing.assert_allclose(result.outputs[name], array, rtol=1e-5, atol=1e-5 * scale)


def test_a_second_start_uses_the_cached_profiles(embedded: Embedded) -> None:
    again = DaemonProcess.start(embedded.folder, env=embedded.env, cpus=embedded.cpus)
    try:
        with Client(again.api, timeout_s=60.0) as client:
            assert {model.name for model in client.models()} == DEMO_MODELS
            assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, slo_ms=SLO_MS).ok
    finally:
        assert again.stop() == 0
    assert "profiled" not in again.log()
    assert "demo models added" not in again.log()
    assert "profiled 'tiny'" in embedded.daemon.log()
