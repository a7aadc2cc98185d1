"""Reading Azure Functions 2019 traces and mapping their functions onto instances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clockwork_async.sim.trace import TraceFormatError, TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import trace_replay

SHARED_TRACE = Path("/work/shared/data/traces/azure-functions-2019-500/invocations.csv")
HEADER = "HashOwner,HashApp,HashFunction,Trigger"
# Five functions over minutes 480..482; totals: f0=3, f1=30, f2=6, f3=30, f4=0.
ROWS = [
    ("o", "a", "f0", [1, 1, 1]),
    ("o", "a", "f1", [10, 10, 10]),
    ("o", "b", "f2", [0, 6, 0]),
    ("p", "c", "f3", [30, 0, 0]),
    ("p", "c", "f4", [0, 0, 0]),
]
SORTED = ["o/a/f1", "p/c/f3", "o/b/f2", "o/a/f0", "p/c/f4"]  # ties keep file order


def write_trace(tmp_path: Path, rows: list = ROWS, first_minute: int = 480) -> Path:
    path = tmp_path / "invocations.csv"
    minutes = ",".join(str(first_minute + i) for i in range(len(rows[0][3])))
    lines = [f"{HEADER},{minutes}"]
    lines += [f"{o},{a},{f},http," + ",".join(map(str, counts)) for o, a, f, counts in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_functions_are_sorted_by_total_invocations(tmp_path: Path) -> None:
    trace = read_azure_trace(write_trace(tmp_path))
    assert list(trace.function_ids) == SORTED
    assert trace.totals.tolist() == [30, 30, 6, 3, 0]
    assert trace.first_minute == 480
    assert (trace.functions, trace.minutes) == (5, 3)
    assert trace.counts[1].tolist() == [30, 0, 0]


def test_minutes_count_from_the_first_minute_column(tmp_path: Path) -> None:
    trace = read_azure_trace(write_trace(tmp_path), minutes=1.5)
    assert trace.minutes == 2
    assert trace.counts[:, 0].tolist() == [10, 30, 0, 1, 0]
    assert trace.totals.tolist() == [30, 30, 6, 3, 0]  # sorted on the whole file
    with pytest.raises(ValueError, match="3 minutes"):
        read_azure_trace(write_trace(tmp_path), minutes=4)


def test_fewer_instances_group_contiguous_ranges_of_sorted_functions(tmp_path: Path) -> None:
    mapping = TraceMapping(read_azure_trace(write_trace(tmp_path)), instances=2)
    assert mapping.mode == "grouped"
    assert mapping.range_starts().tolist() == [0, 2]  # ranks {0,1} and {2,3,4}
    assert mapping.instance_counts(0).tolist() == [10 + 30, 0 + 1 + 0]
    assert mapping.instance_counts(1).tolist() == [10 + 0, 6 + 1 + 0]
    assert mapping.describe()["functions_per_instance"] == [2, 3]
    assert mapping.window_total() == 69


def test_as_many_instances_map_one_to_one(tmp_path: Path) -> None:
    mapping = TraceMapping(read_azure_trace(write_trace(tmp_path)), instances=5)
    assert mapping.mode == "one-to-one"
    assert mapping.instance_counts(0).tolist() == [10, 30, 0, 1, 0]


def test_more_instances_replay_function_i_mod_f(tmp_path: Path) -> None:
    mapping = TraceMapping(read_azure_trace(write_trace(tmp_path)), instances=12)
    assert mapping.mode == "modulo"
    assert mapping.instance_counts(0).tolist() == [10, 30, 0, 1, 0] * 2 + [10, 30]
    assert mapping.describe()["copies_per_function"] == [2, 3]


def test_modulo_copies_draw_independent_arrivals(tmp_path: Path) -> None:
    rows = [("o", "a", "f0", [6000])]
    mapping = TraceMapping(read_azure_trace(write_trace(tmp_path, rows)), instances=2)
    times, instances = next(iter(trace_replay(mapping, 1.0).open_arrivals(rng())))
    first = [t for t, i in zip(times, instances, strict=True) if i == 0]
    second = [t for t, i in zip(times, instances, strict=True) if i == 1]
    assert len(first) > 50 and len(second) > 50
    assert first[:20] != second[:20]


def test_replay_rates_follow_each_minute(tmp_path: Path) -> None:
    rows = [("o", "a", "f0", [600, 6000])]  # 10 then 100 req/s
    mapping = TraceMapping(read_azure_trace(write_trace(tmp_path, rows)), instances=1)
    workload = trace_replay(mapping, duration_s=120, load_scale=2.0)
    times = [t for piece, _ in workload.open_arrivals(rng()) for t in piece]
    per_minute = np.bincount(np.asarray(times) // 60_000_000_000, minlength=2)
    assert times == sorted(times) and times[-1] < 120_000_000_000
    assert abs(per_minute[0] - 1200) < 5 * 1200**0.5
    assert abs(per_minute[1] - 12000) < 5 * 12000**0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Owner,HashApp,HashFunction,Trigger,1\n", "header"),
        (f"{HEADER},1,3\n", "consecutive"),
        (f"{HEADER},1,2\no,a,f,http,1\n", "fields"),
        (f"{HEADER},1\no,a,f,http,-1\n", "negative"),
        (f"{HEADER},1\no,a,f,http,x\n", "integers"),
        (f"{HEADER},1\n", "no function rows"),
    ],
)
def test_malformed_traces_are_named_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        read_azure_trace(path)


@pytest.mark.shared_data
@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared Azure sample not present")
def test_the_shared_azure_sample_maps_onto_thousands_of_instances() -> None:
    trace = read_azure_trace(SHARED_TRACE, minutes=2)
    assert trace.functions == 500 and trace.first_minute == 480
    assert trace.totals[0] >= trace.totals[-1]
    mapping = TraceMapping(trace, instances=4026)
    assert mapping.mode == "modulo"
    assert mapping.instance_counts(0).shape == (4026,)


def rng() -> np.random.Generator:
    return np.random.default_rng(7)
