"""Per-request log replay (sim.replay), the MMPP generator (sim.mmpp), and both through
``clockwork-async simulate`` with the bound and the greedy baseline in the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clockwork_async.sim import cli
from clockwork_async.sim.bound import upper_bound
from clockwork_async.sim.engine import SimConfig, Simulation
from clockwork_async.sim.mmpp import mmpp, sojourn_ns, state_rates_rps
from clockwork_async.sim.profiles import TINY_SIM
from clockwork_async.sim.replay import RequestLogError, map_models, read_request_log, replay
from clockwork_async.sim.workloads import NS_PER_S

from .standin import StandInController

MS = 1_000_000
LOG = """timestamp_ms,model,slo_ms,extra
1005.5,resnet,,x
1000,bert,50,x
1000,resnet,,x
2500,bert,,x
"""


def write_log(tmp_path: Path, text: str = LOG) -> Path:
    path = tmp_path / "requests.csv"
    path.write_text(text)
    return path


def arrivals(workload: Any) -> tuple[list[int], list[int]]:
    times: list[int] = []
    instances: list[int] = []
    for piece_times, piece_instances in workload.open_arrivals(np.random.default_rng(0)):
        assert piece_times == sorted(piece_times)
        times += piece_times
        instances += piece_instances
    return times, instances


def test_a_log_is_read_in_time_order_from_its_first_request(tmp_path: Path) -> None:
    log = read_request_log(write_log(tmp_path))
    assert log.names == ("bert", "resnet")
    assert log.offsets_ns.tolist() == [0, 0, 5_500_000, 1_500_000_000]
    assert log.model_index.tolist() == [0, 1, 1, 0]  # ties keep file order
    assert log.slos_ms is not None
    assert np.isnan(log.slos_ms[1]) and log.slos_ms[0] == 50.0


def test_a_replay_sends_the_log_scaled_with_its_own_slos(tmp_path: Path) -> None:
    log = read_request_log(write_log(tmp_path))
    workload = replay(log, ["m0", "m1"], time_scale=0.5, default_slo_ms=20.0)
    assert arrivals(workload) == ([0, 0, 2_750_000, 750_000_000], [0, 1, 1, 0])
    assert workload.request_slos_ns == [50 * MS, 20 * MS, 20 * MS, 20 * MS]
    assert workload.duration_ns == 750_000_001
    cut = replay(log, ["m0", "m1"], duration_s=0.5)
    assert arrivals(cut) == ([0, 0, 5_500_000], [0, 1, 1])
    assert cut.request_slos_ns == [50 * MS, 100 * MS, 100 * MS]


def test_seconds_and_no_slo_column(tmp_path: Path) -> None:
    log = read_request_log(write_log(tmp_path, "model,timestamp_s\na,3.5\na,1\n"))
    assert log.offsets_ns.tolist() == [0, 2_500_000_000] and log.slos_ms is None
    assert replay(log, ["m0"]).request_slos_ns is None


def test_models_map_by_name_else_sorted_round_robin() -> None:
    assert map_models(["m1", "m0"], ["m0", "m1", "m2"]) == [1, 0]
    assert map_models(["a", "b", "c"], ["m0", "m1"]) == [0, 1, 0]
    assert map_models(["a", "b"], ["m0", "m1", "m2"]) == [0, 1]


def test_arrivals_come_in_pieces_of_at_most_a_second(tmp_path: Path) -> None:
    rows = "".join(f"{t / 10},a\n" for t in range(40))  # 0 .. 3.9 s
    log = read_request_log(write_log(tmp_path, "timestamp_s,model\n" + rows))
    pieces = list(replay(log, ["m0"]).open_arrivals(np.random.default_rng(0)))
    assert [len(times) for times, _ in pieces] == [10, 10, 10, 10]
    assert all(t < (i + 1) * NS_PER_S for i, (times, _) in enumerate(pieces) for t in times)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,model\n1,a\n", "one of timestamp_s"),
        ("timestamp_s,timestamp_ms,model\n1,1,a\n", "one of timestamp_s"),
        ("timestamp_s,model\nsoon,a\n", "not a number"),
        ("timestamp_s,model\ninf,a\n", "not finite"),
        ("timestamp_s,model,slo_ms\n1,a,0\n", "slo_ms must be > 0"),
        ("timestamp_s,model\n", "no requests"),
    ],
)
def test_bad_logs_are_named_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(RequestLogError, match=message):
        read_request_log(write_log(tmp_path, text))


class Deadlines:
    """A request log that keeps each request's deadline."""

    def __init__(self) -> None:
        self.deadline_ns: dict[int, int] = {}

    def write(self, *values: Any) -> None:
        self.deadline_ns[values[0]] = values[3] - values[2]

    def close(self) -> None:
        pass


def test_the_engine_gives_each_replayed_request_its_own_slo(tmp_path: Path) -> None:
    workload = replay(read_request_log(write_log(tmp_path)), ["m0", "m1"], default_slo_ms=20.0)
    log = Deadlines()
    config = SimConfig(profile=TINY_SIM, slo_ns=20 * MS)
    Simulation(config, workload, StandInController(), request_log=log).run()  # type: ignore[arg-type]
    assert log.deadline_ns == {0: 50 * MS, 1: 20 * MS, 2: 20 * MS, 3: 20 * MS}


def test_mmpp_state_rates_keep_the_long_run_mean() -> None:
    rates = state_rates_rps(100.0, [1.0, 6.0], [2.0, 0.25])
    assert rates[1] == pytest.approx(6 * rates[0])
    assert (rates[0] * 2.0 + rates[1] * 0.25) / 2.25 == pytest.approx(100.0)


def test_mmpp_bursts_are_pareto_with_the_given_mean() -> None:
    rng = np.random.default_rng(7)
    draws = np.array([sojourn_ns(rng, 1, 0.25, 1.5) for _ in range(20_000)]) / NS_PER_S
    assert draws.min() >= 0.25 / 3 - 1e-9  # the Pareto scale: mean (alpha - 1) / alpha
    assert np.median(draws) == pytest.approx(0.25 / 3 * 2 ** (1 / 1.5), rel=0.05)
    calm = np.array([sojourn_ns(rng, 0, 2.0, 1.5) for _ in range(20_000)]) / NS_PER_S
    assert calm.mean() == pytest.approx(2.0, rel=0.05)  # exponential


def test_mmpp_mean_rate_and_seeding() -> None:
    workload = mmpp(4, 400.0, 300.0, [1.0, 6.0], [2.0, 0.25], 0.0)  # exponential sojourns
    times, instances = arrivals(workload)
    assert len(times) == pytest.approx(400 * 300, rel=0.1)
    assert set(instances) == {0, 1, 2, 3}
    assert arrivals(mmpp(2, 100.0, 5.0)) == arrivals(mmpp(2, 100.0, 5.0))


@pytest.mark.parametrize(
    ("levels", "sojourn", "alpha"),
    [([1.0], [1.0], 1.5), ([1.0, 2.0], [1.0], 1.5), ([1.0, 2.0], [1.0, 0.0], 1.5),
     ([1.0, 2.0], [1.0, 1.0], 1.0)],
)  # fmt: skip
def test_mmpp_rejects_bad_parameters(
    levels: list[float], sojourn: list[float], alpha: float
) -> None:
    with pytest.raises(ValueError):
        mmpp(1, 10.0, 1.0, levels, sojourn, alpha)


SMALL = ["--profile", "tiny-sim", "--slo-ms", "5", "--progress-s", "0", "--quiet"]


def test_simulate_replays_a_log_with_the_bound_and_greedy(tmp_path: Path) -> None:
    rows = "".join(f"{t * 0.1:.1f},{'ab'[t % 2]}\n" for t in range(300))  # 0.1 ms apart
    path = write_log(tmp_path, "timestamp_ms,model\n" + rows)
    out = tmp_path / "out.json"
    assert cli.main([*SMALL, "--workload", "replay", "--requests", str(path), "--greedy",
                     "--json", str(out)]) == 0  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["requests"] == 300 and summary["workload"]["instances"] == 2
    assert summary["workload"]["model_mapping"] == {"a": "m0", "b": "m1"}
    arrival_ns = np.arange(300, dtype=np.int64) * 100_000
    expected = upper_bound(arrival_ns, arrival_ns + 5 * MS, TINY_SIM.execute_ns)
    assert summary["bound"]["ok"] == expected < 300
    assert summary["ok"] <= expected and summary["greedy"]["ok"] <= expected
    assert summary["goodput_over_bound"] == summary["ok"] / expected


def test_simulate_runs_mmpp_and_has_no_bound_for_a_closed_loop(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = [*SMALL, "--minutes", "0.02", "--workload", "mmpp", "--rate", "300"]
    assert cli.main([*args, "--mmpp-levels", "1,4,9", "--mmpp-sojourn-s", "1,0.1,0.1",
                     "--json", str(out)]) == 0  # fmt: skip
    summary = json.loads(out.read_text())
    assert summary["workload"]["workload"] == "mmpp" and summary["bound"]["ok"] >= summary["ok"]
    assert cli.main([*SMALL, "--minutes", "0.01", "--workload", "closed", "--json", str(out)]) == 0
    closed = json.loads(out.read_text())
    assert closed["bound"] is None and "closed loop" in closed["bound_note"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "replay"], "goes with --requests"),
        (["--requests", "x.csv"], "goes with --requests"),
        (["--workload", "replay", "--requests", "x.csv", "--rate", "5"], "--time-scale"),
        (["--time-scale", "0"], "must be > 0"),
        (["--mmpp-levels", "1,x"], "comma-separated"),
    ],
)
def test_bad_replay_flags_are_argparse_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main(args)
    assert message in capsys.readouterr().err
