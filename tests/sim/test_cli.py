"""`clockwork-async simulate`: flags, errors, JSON keys, plots and logs (small runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clockwork_async.sim import cli

from .standin import StandInController
from .test_trace import write_trace

REQUIRED_KEYS = {
    "requests",
    "accepted",
    "ok",
    "dropped",
    "failed",
    "late",
    "cancelled",
    "lost",
    "rejected",
    "goodput_rps",
    "latency_ms",
    "ok_over_accepted",
    "ok_over_requests",
    "cold_starts",
    "loads",
    "evictions",
    "simulated_seconds",
    "wall_seconds",
    "config",
    "workload",
}
SMALL = ["--profile", "tiny-sim", "--slo-ms", "20", "--minutes", "0.02", "--progress-s", "0"]


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the CLI on the stand-in controller (the engine and CLI are under test here)."""
    monkeypatch.setattr(cli, "build_controller", lambda policy, overrides: StandInController())


@pytest.mark.usefixtures("standin")
@pytest.mark.parametrize(
    "workload",
    [
        ["--workload", "poisson", "--rate", "200"],
        ["--workload", "closed"],
        ["--workload", "bursty", "--rate", "200"],
        ["--workload", "ramp"],
    ],
)
def test_a_run_writes_a_summary_with_the_documented_keys(
    tmp_path: Path, workload: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert cli.main([*SMALL, *workload, "--instances", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert REQUIRED_KEYS <= summary.keys()
    assert set(summary["latency_ms"]) >= {"p50", "p99", "p99.9", "p99.99", "max"}
    assert summary["requests"] > 0 and summary["lost"] == 0
    assert summary["config"]["policy"] == "clockwork"
    assert "ok/acc" in capsys.readouterr().out


@pytest.mark.usefixtures("standin")
def test_an_azure_run_states_its_mapping(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    trace = write_trace(tmp_path)
    args = [*SMALL, "--workload", "azure", "--trace", str(trace), "--instances", "12"]
    assert cli.main([*args, "--load-scale", "3", "--json", str(out)]) == 0
    mapping = json.loads(out.read_text())["workload"]["mapping"]
    assert mapping["mode"] == "modulo" and mapping["copies_per_function"] == [2, 3]


@pytest.mark.usefixtures("standin")
def test_a_sweep_reports_one_run_per_slo(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    args = [*SMALL, "--workload", "sweep", "--slos-ms", "5,20", "--rate", "100"]
    assert cli.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [run["config"]["slo_ms"] for run in result["runs"]] == [5.0, 20.0]
    assert result["requests"] == sum(run["requests"] for run in result["runs"])


@pytest.mark.usefixtures("standin")
def test_logs_and_plots_are_written(tmp_path: Path) -> None:
    requests, actions = tmp_path / "requests.csv", tmp_path / "actions.jsonl"
    args = [*SMALL, "--rate", "100", "--plot", str(tmp_path / "plots")]
    assert cli.main([*args, "--log-requests", str(requests), "--log-actions", str(actions)]) == 0
    lines = requests.read_text().splitlines()
    assert lines[0].startswith("request_id,model,arrival_ns") and len(lines) > 10
    first_action = json.loads(actions.read_text().splitlines()[0])
    assert first_action["type"] == "StartLoad" and first_action["code"] == ""
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["batch_sizes.png", "goodput.png", "latency.png", "loaded_models.png"]


def test_a_lost_request_makes_the_exit_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forgetful = StandInController(forget=frozenset({0}))
    monkeypatch.setattr(cli, "build_controller", lambda policy, overrides: forgetful)
    assert cli.main([*SMALL, "--rate", "100", "--quiet"]) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "nope"], "known profiles: resnet50-v100"),
        (["--workload", "azure"], "needs --trace"),
        (["--load-scale", "2"], "azure only"),
        (["--rate", "-1"], "must be >= 0"),
        (["--executors", "0"], "must be > 0"),
        (["--rate", "1", "--load-scale", "1"], "not allowed with"),
        (["--workload", "nope"], "invalid choice"),
        (["--core", "no_such_field=1"], "KEY one of"),
        (["--core", "window_size=0"], "window_size = 0: expected > 0"),
    ],
)
def test_bad_flags_are_argparse_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_trace_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--workload", "azure", "--trace", str(tmp_path / "missing.csv"), "--quiet"]
    assert cli.main(args) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_a_profile_file_is_accepted(tmp_path: Path, standin: None) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text(
        'name = "p"\nload_ms = 1.0\nweights_bytes = 1000\n[execute_ms]\n1 = 0.5\n2 = 0.8\n'
    )
    out = tmp_path / "out.json"
    args = [*SMALL[2:], "--profile", str(profile), "--rate", "50", "--json", str(out)]
    assert cli.main(args) == 0
    assert json.loads(out.read_text())["config"]["profile"] == "p"
