"""The pure parts of `benchmarks.overload_ab`: the stalled schedule, the schedule file a bench
replays, the statistics of one run's rows and the rank correlation."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.overload_ab import (
    analyse_rows,
    rank_correlation,
    ranks,
    stalled_ns,
    write_schedule,
)

from clockwork_async.sim.replay import read_request_log

MS = 1_000_000


def test_a_stalled_generator_sends_what_fell_due_at_the_end_of_each_stall() -> None:
    times = [0, 5 * MS, 19 * MS, 20 * MS, 50 * MS, 100 * MS, 130 * MS]
    assert stalled_ns(times, 100 * MS, 20 * MS) == [
        20 * MS,
        20 * MS,
        20 * MS,
        20 * MS,  # the stall's end itself is on time
        50 * MS,
        120 * MS,
        130 * MS,
    ]


def test_the_schedule_file_replays_at_its_times(tmp_path: Path) -> None:
    times = [20 * MS, 20 * MS, 50 * MS, 120 * MS]
    log = read_request_log(write_schedule(tmp_path / "s.csv", times, "m"))
    assert list(log.offsets_ns) == [0, 20 * MS, 50 * MS, 120 * MS]  # the first moves to 0
    assert len(log) == len(times)


def test_rank_correlation() -> None:
    assert ranks([3.0, 1.0, 2.0, 1.0]) == [3.0, 0.5, 2.0, 0.5]
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 45]) == 1.0
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert rank_correlation([1, 2], [1, 2]) is None  # too few
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None  # constant


def test_analyse_rows() -> None:
    rows = {
        "sent_ns": [0, 100_000, 200_000, 5 * MS],
        "lag_ns": [0, 0, 3 * MS, 0],
        "status": ["ok", "ok", "infeasible", "ok"],
        "latency_ns": [2 * MS, 11 * MS, 0, 3 * MS],
        "batch_size": [2, 2, 0, 1],
        "execute_ns": [4 * MS, 4 * MS, 0, 2 * MS],
        "predicted_ns": [5 * MS, 5 * MS, 0, 3 * MS],
    }
    found = analyse_rows(rows, slo_ms=10.0, duration_s=1.0)
    assert (found["requests"], found["in_slo"]) == (4, 2)  # one ok arrived after the SLO
    assert found["max_sends_per_ms"] == 3
    assert found["max_gap_ms"] == pytest.approx(4.8)
    assert (found["sent_lagged_over_2ms"], found["refused_after_lag"]) == (1, 1)
    assert found["ok_batch_sizes"] == {1: 1, 2: 2}
    assert found["ok_mean_batch"] == pytest.approx(1.67)
