"""The contention model (sim/contention.py): exact spells, bounds, seeding, and its wiring into
the simulator and the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clockwork_async.sim import cli
from clockwork_async.sim.compare import bound_note
from clockwork_async.sim.contention import Contention, ContentionClock, ContentionError
from clockwork_async.sim.engine import SimConfig, Simulation, build_controller
from clockwork_async.sim.profiles import resolve_profile
from clockwork_async.sim.workloads import poisson

MS = 1_000_000


class MeanSpells(random.Random):
    """Every spell exactly its mean; the first state slow (``random()`` 0 < any share)."""

    def random(self) -> float:
        return 0.0

    def expovariate(self, lambd: float = 1.0) -> float:
        return 1.0 / lambd


def test_a_spec_parses_and_describes_itself() -> None:
    contention = Contention.parse("3,0.35,10")
    assert contention == Contention(3.0, 0.35, 10 * MS)
    assert contention.describe() == "3,0.35,10"
    assert contention.fast_spell_ns == pytest.approx(10 * MS * 0.65 / 0.35)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3,0.1", "FACTOR,SHARE,SPELL_MS"),
        ("3,x,10", "not three numbers"),
        ("0.5,0.1,10", "slow factor must be >= 1"),
        ("2,0,10", "slow share must be in (0, 1)"),
        ("2,1,10", "slow share must be in (0, 1)"),
        ("2,0.1,0", "slow spell must be > 0"),
    ],
)
def test_bad_specs_are_refused(text: str, message: str) -> None:
    with pytest.raises(ContentionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Contention.parse(text)


def test_work_runs_at_each_spells_speed() -> None:
    """Slow [0, 10), fast [10, 20), slow [20, 30) ms ..., half speed when slow."""
    clock = ContentionClock(Contention(2.0, 0.5, 10 * MS), MeanSpells())
    assert clock.stretch(0, 4 * MS) == 8 * MS  # all slow
    assert clock.stretch(8 * MS, 4 * MS) == 5 * MS  # 2 ms slow (1 ms of work), then 3 fast
    assert clock.stretch(13 * MS, 10 * MS) == 13 * MS  # 7 fast, then 3 of work in 6 slow
    assert clock.stretch(26 * MS, 1 * MS) == 2 * MS  # still slow
    assert clock.stretch(30 * MS, 1 * MS) == 1 * MS  # fast again
    assert clock.stretch(85 * MS, 4 * MS) == 6_500_000  # idle; 5 slow (2.5 of work), 1.5 fast


@settings(max_examples=50, deadline=None)
@given(
    factor=st.floats(1.0, 5.0),
    share=st.floats(0.01, 0.99),
    spell_ms=st.floats(0.1, 50.0),
    seed=st.integers(0, 2**32),
    steps=st.lists(st.tuples(st.integers(0, 200 * MS), st.integers(1, 20 * MS)), max_size=30),
)
def test_a_duration_lies_between_the_work_and_factor_times_it(
    factor: float, share: float, spell_ms: float, seed: int, steps: list[tuple[int, int]]
) -> None:
    contention = Contention(factor, share, max(1, round(spell_ms * MS)))
    clock = ContentionClock(contention, random.Random(seed))
    start_ns = 0
    for gap_ns, work_ns in steps:
        start_ns += gap_ns
        duration_ns = clock.stretch(start_ns, work_ns)
        assert work_ns <= duration_ns <= round(factor * work_ns) + 1


def _run(contention: Contention | None, seed: int = 3, **core: int) -> tuple[int, int, int, int]:
    profile = resolve_profile("resnet50-v100")
    config = SimConfig(profile=profile, slo_ns=30 * MS, seed=seed, contention=contention)
    workload = poisson(1, 600.0, 2.0)
    stats = Simulation(config, workload, build_controller("clockwork", core)).run()
    outcomes = stats.outcomes
    return outcomes["ok"], outcomes["infeasible"], outcomes["late"], outcomes["dropped"]


def test_contention_is_seeded_and_slows_the_run() -> None:
    contention = Contention.parse("3,0.35,10")
    assert _run(contention) == _run(contention)
    ok_with, _, _, _ = _run(contention)
    ok_without, _, late_without, _ = _run(None)
    assert ok_with < ok_without
    assert late_without == 0


def test_pooled_predictions_decide_the_same_without_contention_only() -> None:
    """Durations equal to the profile: every ratio is 1, so pooling changes nothing."""
    assert _run(None, pooled_window_size=50) == _run(None)
    contention = Contention.parse("3,0.35,10")
    assert _run(contention, pooled_window_size=50) != _run(contention)


def test_the_bound_still_holds_under_contention_but_not_noise() -> None:
    workload = poisson(1, 100.0, 1.0)
    assert bound_note(SimConfig(contention=Contention.parse("2,0.1,10")), workload) is None
    assert bound_note(SimConfig(noise=0.1), workload) is not None


def test_the_cli_takes_contention_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["--profile", "tiny-sim", "--slo-ms", "20", "--minutes", "0.02", "--progress-s", "0"]
    flags = ["--rate", "100", "--contention", "2,0.1,10", "--quiet", "--json", str(out)]
    assert cli.main([*args, *flags]) == 0
    summary = json.loads(out.read_text())
    assert summary["config"]["contention"] == "2,0.1,10"
    assert summary["bound"] is not None


def test_a_bad_contention_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--contention", "2,1.5,10"])
    assert exit_info.value.code == 2
    assert "slow share must be in (0, 1)" in capsys.readouterr().err
