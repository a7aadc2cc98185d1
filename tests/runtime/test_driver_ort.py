"""The driver with a real ONNX Runtime executor: served outputs equal direct ONNX Runtime's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from clockwork_async.core.outcomes import Outcome
from clockwork_async.models.demo import generate_demo_models
from clockwork_async.runtime.supervisor import ExecutorSpec, Supervisor

from .support import Collector, deadline_in, new_driver


async def test_tiny_model_outputs_equal_onnxruntime(tmp_path: Path) -> None:
    model_path = generate_demo_models(tmp_path, names=["tiny"])["tiny"]
    spec = ExecutorSpec("ort0", backend="onnxruntime", page_bytes=4096, weights_bytes=64 * 4096)
    supervisor = Supervisor([spec])
    await supervisor.start()
    driver = new_driver()
    try:
        await driver.attach_supervised(supervisor)
        model = await driver.register_model("tiny", str(model_path))
        assert [spec.name for spec in model.inputs] == ["x"]
        rows = np.random.default_rng(7).standard_normal((24, 16)).astype(np.float32)
        replies = Collector()
        ids = [
            driver.submit(
                "tiny", {"x": rows[i : i + 1]}, deadline_ns=deadline_in(2_000), on_reply=replies
            )
            for i in range(len(rows))
        ]
        await replies.wait_for(len(ids))
        assert replies.counts() == {Outcome.OK: len(rows)}
        served = np.concatenate([replies.outcomes[i].outputs["y"] for i in ids])
        session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        (expected,) = session.run(["y"], {"x": rows})
        np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    finally:
        await driver.close()
        await supervisor.close()
