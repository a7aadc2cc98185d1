"""The simulator driving the production core: small scenarios in virtual time."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from clockwork_async.sim import cli
from clockwork_async.sim.engine import SimConfig, Simulation, build_controller
from clockwork_async.sim.profiles import RESNET50_V100
from clockwork_async.sim.report import summarize
from clockwork_async.sim.stats import SimStats
from clockwork_async.sim.workloads import Workload, bursty, closed_loop, poisson, ramp

MS = 1_000_000
SMALL_GPU = replace(RESNET50_V100, pages_total=7 * 6)  # room for 6 copies: forces evictions


def run(policy: str, workload: Workload, **config: object) -> SimStats:
    settings: dict[str, object] = {"profile": RESNET50_V100, **config}
    simulation = Simulation(SimConfig(**settings), workload, build_controller(policy))  # type: ignore[arg-type]
    return simulation.run()


def assert_sound(stats: SimStats) -> None:
    assert stats.lost == 0, stats.lost_examples
    assert not stats.violations
    assert sum(stats.outcomes.values()) == stats.requests > 0


@pytest.mark.parametrize(
    "workload",
    [
        poisson(instances=4, rate_rps=600.0, duration_s=3.0),
        bursty(instances=4, rate_rps=600.0, duration_s=3.0, on_s=0.2, off_s=0.2),
        closed_loop(instances=3, clients=6, in_flight=2, duration_s=2.0),
    ],
    ids=["poisson", "bursty", "closed"],
)
def test_clockwork_is_never_late_and_answers_everything(workload: Workload) -> None:
    stats = run("clockwork", workload, executors=2, slo_ns=50 * MS)
    assert_sound(stats)
    assert stats.outcomes["late"] == 0
    assert stats.outcomes["ok"] > 0.9 * stats.requests  # the scenario is mostly servable


def test_cold_starts_and_evictions_with_more_copies_than_memory() -> None:
    stats = run(
        "clockwork",
        ramp(instances=20, rate_rps=300.0, duration_s=4.0, step_s=0.1),
        executors=1,
        profile=SMALL_GPU,
        slo_ns=100 * MS,
    )
    assert_sound(stats)
    assert stats.outcomes["late"] == 0
    assert stats.cold_starts >= 20 and stats.loads > 20 and stats.evictions > 0
    assert max(count for _, count in stats.loaded_changes) <= 6


@pytest.mark.parametrize("policy", ["fifo", "timeout"])
def test_baselines_answer_everything(policy: str) -> None:
    stats = run(policy, poisson(instances=2, rate_rps=1500.0, duration_s=2.0), slo_ns=50 * MS)
    assert_sound(stats)


def test_a_run_on_the_core_is_a_function_of_its_seed() -> None:
    def summary(seed: int) -> dict[str, object]:
        workload = poisson(instances=3, rate_rps=800.0, duration_s=1.0)
        stats = run("clockwork", workload, slo_ns=20 * MS, seed=seed, noise=0.02)
        result = summarize(stats, workload.duration_ns, {}, {})
        del result["wall_seconds"], result["speedup"]
        return result

    assert summary(1) == summary(1)
    assert summary(1) != summary(2)


def test_message_delays_keep_clockwork_on_time() -> None:
    stats = run(
        "clockwork",
        poisson(instances=2, rate_rps=500.0, duration_s=2.0),
        slo_ns=30 * MS,
        message_delay_ns=100_000,
    )
    assert_sound(stats)
    assert stats.outcomes["late"] == 0 and stats.outcomes["ok"] > 0.9 * stats.requests


def test_the_cli_runs_on_the_core(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["--instances", "3", "--rate", "300", "--minutes", "0.03", "--progress-s", "0"]
    assert cli.main([*args, "--json", str(out), "--quiet"]) == 0
    summary = json.loads(out.read_text())
    assert summary["late"] == 0 and summary["lost"] == 0 and summary["ok"] > 0
    assert summary["capacity_rps"] == pytest.approx(923.3, abs=0.1)


def test_preload_fills_memory_and_no_more() -> None:
    workload = poisson(instances=20, rate_rps=400.0, duration_s=1.0)
    stats = run("clockwork", workload, executors=2, profile=SMALL_GPU, preload=True)
    assert_sound(stats)
    assert stats.loaded_changes[12] == (0, 12)  # 6 copies fit on each executor
    assert all(time_ns > 0 for time_ns, _ in stats.loaded_changes[13:])


def test_preload_makes_a_tight_slo_servable_without_cold_starts() -> None:
    workload = poisson(instances=4, rate_rps=400.0, duration_s=1.0)
    stats = run("clockwork", workload, executors=2, slo_ns=8 * MS, preload=True)
    assert_sound(stats)
    assert stats.cold_starts == 0 and stats.outcomes["ok"] > 0.9 * stats.requests
