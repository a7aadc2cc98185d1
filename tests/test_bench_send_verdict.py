"""The load generator's verdict on its own schedule (`clockwork_async.bench.send_verdict`):
a run whose requests left too late is marked ``behind`` in its summary, and in the
benchmarks' rows, instead of being counted as the daemon's result."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from benchmarks.peer_ray import Point, http_row, our_row
from benchmarks.peer_report import HEADERS, behind_runs, goals, table_rows

from clockwork_async.bench import Run, lag_budget_ms, send_verdict, summarize
from clockwork_async.bench.report import BEHIND_SHARE, LAG_BUDGET_FLOOR_MS
from clockwork_async.cli import main


def test_the_budget_is_a_share_of_the_slo_with_a_floor() -> None:
    assert lag_budget_ms(100.0) == 20.0
    assert lag_budget_ms(25.9) == pytest.approx(5.18)
    assert lag_budget_ms(5.0) == LAG_BUDGET_FLOOR_MS  # 1 ms would be the timer's granularity
    assert lag_budget_ms(100.0, 3.0) == 3.0  # given: as is


def test_behind_once_more_than_one_percent_left_later_than_the_budget() -> None:
    on_time = Counter({0: 900, 1_999: 90})  # µs late; the budget at a 10 ms SLO is 2 ms
    at_share = on_time + Counter({2_001: 10})  # 10 of 1,000: exactly 1%
    verdict = send_verdict(at_share, slo_ms=10.0)
    assert verdict == {"lag_budget_ms": 2.0, "late": 10, "late_share": 0.01, "behind": False}
    over = at_share + Counter({50_000: 1})
    assert send_verdict(over, slo_ms=10.0)["behind"] is True
    assert send_verdict(over, slo_ms=10.0)["late"] == 11
    assert send_verdict(on_time + Counter({2_000: 100}), slo_ms=10.0)["late"] == 0  # = budget
    assert send_verdict(over, slo_ms=10.0, budget_ms=60.0)["behind"] is False


def test_no_requests_is_not_behind() -> None:
    assert send_verdict(Counter(), slo_ms=10.0) == {
        "lag_budget_ms": 2.0,
        "late": 0,
        "late_share": 0.0,
        "behind": False,
    }


async def test_the_summary_carries_the_verdict() -> None:
    run = Run(client=None, inputs={"m": {}})  # type: ignore[arg-type]  # nothing is sent
    run.recorder.slo_ns = 25_000_000
    for lag_ns in [0] * 97 + [6_000_000] * 3:  # 3% left 6 ms late, the budget is 5 ms
        run.recorder.on_scheduled(0)
        run.recorder.on_sent(0, lag_ns)
    send = summarize(run, 1_000_000_000, {"workload": "test"})["send"]
    assert (send["lag_budget_ms"], send["late"], send["behind"]) == (5.0, 3, True)
    send = summarize(run, 1_000_000_000, {"workload": "test"}, lag_budget=7.0)["send"]
    assert (send["late"], send["behind"]) == (0, False)


def test_the_flag_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "m", "--rate", "1", "--max-send-lag-ms", "0"]
    assert main(argv) == 2
    assert "--max-send-lag-ms must be > 0" in capsys.readouterr().err


POINT = Point("10x b1, 200%", "10x b1", 25.0, 2.0, 1800.0, 104)


def _bench_summary(behind: bool) -> dict[str, Any]:
    latency = {"p50": 1.0, "p99": 2.0, "p99.9": 3.0, "max": 4.0}
    return {
        "requests": 10,
        "offered_rps": 10.0,
        "ok": 5,
        "ok_after_slo": 0,
        "duration_seconds": 1.0,
        "latency_ms": latency,
        "late": 0,
        "daemon_latency_ms": latency,
        "rejected": {},
        "dropped": 0,
        "failed": 0,
        "lost": 0,
        "errors": {},
        "send": {"lag_ms": {"p99": 9.0}, "late": 2, "late_share": 0.2, "behind": behind},
    }


def test_peer_rows_say_whether_the_generator_kept_its_schedule() -> None:
    assert our_row(POINT, "clockwork", _bench_summary(True))["generator_behind"] is True
    assert our_row(POINT, "clockwork", _bench_summary(False))["generator_behind"] is False
    rows = {
        "sent_ns": [0, 1, 2],
        "lag_ns": [0, 0, 9_000_000],  # one of three left 9 ms late: budget 5 ms
        "status": ["ok", "ok", "ok"],
        "latency_ns": [1_000_000] * 3,
    }
    assert http_row(POINT, "ray-http", {"rows": rows}, 1.0)["generator_behind"] is True
    rows["lag_ns"] = [0, 0, 4_000_000]
    assert http_row(POINT, "ray-http", {"rows": rows}, 1.0)["generator_behind"] is False
    assert BEHIND_SHARE < 1 / 3


def test_the_peer_report_marks_runs_whose_generator_fell_behind() -> None:
    ours = our_row(POINT, "clockwork", _bench_summary(True))
    calm = our_row(POINT, "fifo", _bench_summary(False))
    result = {"systems": {"clockwork": {"rows": [ours]}, "fifo": {"rows": [calm]}}}
    assert behind_runs(result) == ["clockwork at 10x b1, 200%"]
    cells = {row[1]: row[HEADERS.index("lag p99 ms")] for row in table_rows(result, "10x b1")}
    assert cells == {"clockwork": "9.0 behind", "fifo": 9.0}


def test_the_overload_goal_counts_10x_b1_whatever_the_rounding() -> None:
    b1_ms = 7.827166  # 10x is 78.27166 ms, written 78.272 (µs)
    point = Point("10x b1, 200%", "10x b1", 78.272, 2.0, 570.0, 104)
    ours = our_row(point, "clockwork", _bench_summary(False))
    result = {
        "b1_ms": b1_ms,
        "capacity": {"rps": 285.0},
        "systems": {"clockwork": {"rows": [ours]}},
    }
    found = goals(result)["overload_2x_tight_slo"]
    assert [g["point"] for g in found] == ["10x b1, 200%"]
    assert found[0]["generator_behind"] is False
