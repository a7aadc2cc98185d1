"""``clockwork-async bench --replay``: a per-request log sent at its (scaled) times, onto the
served models, each request with its own SLO (against the real `ApiServer` over the fake
service)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.bench import Run, draw_inputs, drive
from clockwork_async.cli import main
from clockwork_async.sim.replay import read_request_log, replay

from .conftest import ThreadedServer
from .fakes import FakeService

LOG = "timestamp_ms,model,slo_ms\n0,echo,30\n10,other,\n20,echo,70\n"


async def test_a_replay_sends_each_request_with_its_own_slo(
    client: AsyncClient, service: FakeService, tmp_path: Path
) -> None:
    path = tmp_path / "log.csv"
    path.write_text(LOG)
    rng = np.random.default_rng(0)
    run = Run(client, await draw_inputs(client, ["echo"], rng))
    workload = replay(read_request_log(path), ["echo"], default_slo_ms=50.0)
    await drive(run, workload, slo_ms=50.0, rng=rng, grace_s=0.5)
    assert [s.model for s in service.submitted] == ["echo"] * 3
    assert [s.slo_ns for s in service.submitted] == [30_000_000, 50_000_000, 70_000_000]


def test_bench_replay_flag(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.csv"
    path.write_text(LOG)
    address = ["--address", threaded_server.address, "--progress-s", "0"]
    argv = ["bench", "--model", "echo", "--replay", str(path), "--time-scale", "2"]
    assert main([*argv, *address]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == summary["ok"] == 3
    assert summary["workload"]["model_mapping"] == {"echo": "echo", "other": "echo"}
    assert summary["config"]["time_scale"] == 2.0
    assert summary["duration_seconds"] == pytest.approx(0.04, abs=1e-6)
    assert main(["bench", "--model", "echo", "--replay", str(path), "--rate", "5", *address]) == 2
