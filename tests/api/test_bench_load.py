"""`clockwork_async.bench` as the benchmarks' load generator: its callable API (`Run`,
`drive`, observers, `phases`) and the flags benchmarks use (``--rows``, ``--timeline``,
``--copies``), against the real `ApiServer` over the fake service."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.api.async_client import AsyncClient
from clockwork_async.bench import (
    ROW_COLUMNS,
    RequestRows,
    Run,
    copy_names,
    draw_inputs,
    drive,
    phases,
    summarize,
)
from clockwork_async.cli import main
from clockwork_async.sim.workloads import poisson

from .conftest import ThreadedServer
from .fakes import FakeService

NS_PER_S = 1_000_000_000


def test_phases_follow_each_other_at_their_rates() -> None:
    workload = phases(2, [(400.0, 0.5), (0.0, 0.25), (40.0, 0.25)])
    assert workload.duration_ns == NS_PER_S
    times = np.concatenate([t for t, _ in workload.open_arrivals(np.random.default_rng(3))])
    assert 100 < np.count_nonzero(times < NS_PER_S // 2) < 300
    assert np.count_nonzero((times >= NS_PER_S // 2) & (times < 3 * NS_PER_S // 4)) == 0
    assert np.count_nonzero(times >= 3 * NS_PER_S // 4) < 40
    assert workload.describe()["phases"] == [[400.0, 0.5], [0.0, 0.25], [40.0, 0.25]]
    with pytest.raises(ValueError):
        phases(1, [])
    with pytest.raises(ValueError):
        phases(1, [(10.0, 0.0)])


def test_copy_names_match_the_repository() -> None:
    assert copy_names("r50", 1) == ["r50"]
    assert copy_names("r50", 3) == ["r50-0", "r50-1", "r50-2"]


class Phases:
    """An observer that tells requests apart by when they were scheduled."""

    def __init__(self) -> None:
        self.scheduled_ns: list[int] = []
        self.answered: list[int] = []

    def on_sent(self, index: int, model: str, scheduled_ns: int, sent_ns: int) -> None:
        assert index == len(self.scheduled_ns)
        self.scheduled_ns.append(scheduled_ns)

    def on_answer(self, index: int, sent_ns: int, now_ns: int, answer: object) -> None:
        self.answered.append(index)


async def test_drive_counts_every_request_in_rows_and_observers(
    client: AsyncClient, service: FakeService
) -> None:
    rng = np.random.default_rng(5)
    inputs = await draw_inputs(client, ["echo", "hold"], rng)
    run = Run(client, inputs)
    rows, seen = RequestRows(run.start_ns), Phases()
    run.observers = (rows, seen)
    await drive(run, poisson(2, 200.0, 0.3), slo_ms=50.0, rng=rng, grace_s=0.05)
    summary = summarize(run, round(0.3 * NS_PER_S), {"workload": "test"})
    sent = summary["requests"]
    assert sent == len(service.submitted) == len(seen.scheduled_ns) > 10
    assert summary["scheduled"]["requests"] == sent
    assert set(rows.columns) == set(ROW_COLUMNS)
    assert all(len(column) == sent for column in rows.columns.values())
    statuses = rows.columns["status"]
    models = rows.columns["model"]
    assert {s for s, m in zip(statuses, models, strict=True) if m == "echo"} == {"ok"}
    assert {s for s, m in zip(statuses, models, strict=True) if m == "hold"} == {"lost"}
    assert summary["lost"] == statuses.count("lost") == len(service.held)
    assert sorted(seen.answered) == [i for i, s in enumerate(statuses) if s != "lost"]
    assert min(rows.columns["sent_ns"]) >= run.start_ns
    assert set(summary["client"]) == {"cpu_s", "cpu_share"}
    assert summary["wall_seconds"] >= 0.3  # the run lasts its schedule, then the grace period


def test_bench_rows_timeline_and_copies_flags(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address, "--progress-s", "0"]
    rows_path = tmp_path / "rows.json"
    argv = ["bench", "--model", "echo", "--rate", "100", "--duration-s", "1", "--timeline"]
    assert main([*argv, "--rows", str(rows_path), *address]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = json.loads(rows_path.read_text())
    assert rows["start_ns"] < rows["end_ns"]
    assert len(rows["rows"]["sent_ns"]) == summary["requests"] > 0
    assert len(summary["timeline"]["time_s"]) == len(summary["scheduled"]["per_s"]) == 1
    assert sum(summary["scheduled"]["per_s"]) == summary["scheduled"]["requests"]
    assert summary["client_within_slo"]["ok_within"] <= summary["ok"]
    assert main(["bench", "--models", "a,b", "--copies", "2", "--rate", "5", *address]) == 2
    argv = ["bench", "--model", "echo", "--copies", "2", "--rate", "5", "--duration-s", "0.2"]
    assert main([*argv, *address]) == 1  # the fake serves no echo-0
    assert "no model 'echo-0'" in capsys.readouterr().err
