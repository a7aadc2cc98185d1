"""The client verbs and `bench`, run in-process through `cli.main` against a fake-service
server in its own thread."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clockwork_async.cli import main

from .conftest import ThreadedServer

ROW = np.arange(4, dtype=np.float32).reshape(1, 4)


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_infer_with_input_files_writes_outputs(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", ROW)
    out = tmp_path / "out"
    argv = ["infer", "echo", "--input", f"x={tmp_path / 'x.npy'}", "--slo-ms", "20"]
    status = main([*argv, "--output-dir", str(out), "--address", threaded_server.address])
    assert status == 0
    np.testing.assert_array_equal(np.load(out / "y.npy"), ROW * 2)
    printed = capsys.readouterr().out
    assert printed.startswith("ok") and "timing: total" in printed and "executor: e0" in printed
    assert threaded_server.service.submitted[0].slo_ns == 20_000_000


def test_infer_random_json_and_a_refused_request(
    threaded_server: ThreadedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    assert main(["infer", "echo", "--random", "--json", *address]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["status"] == "ok" and reply["outputs"]["y"] == {
        "dtype": "float32",
        "shape": [1, 4],
    }
    sent = threaded_server.service.submitted[0].inputs["x"]
    assert sent.shape == (1, 4) and sent.dtype == np.float32
    assert main(["infer", "nope", "--random", *address]) == 1
    assert "unknown_model" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["infer", "echo"]) == 2  # neither --input nor --random
    assert main(["infer", "echo", "--input", "x"]) == 2
    assert main(["infer", "echo", "--input", f"x={tmp_path / 'missing.npy'}"]) == 2
    assert main(["models", "add", "only-a-name"]) == 2
    assert main(["bench", "--rate", "5"]) == 2
    assert main(["bench", "--model", "m", "--rate", "5", "--concurrency", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "clockwork-async infer" in err


def test_a_refused_connection_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    address = _free_address()
    for argv in (["health"], ["stats"], ["models"], ["infer", "echo", "--random"]):
        assert main([*argv, "--address", address]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("cannot connect") == 4


def test_models_list_add_remove(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    assert main(["models", *address]) == 0
    assert "echo" in capsys.readouterr().out
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"ONNX fake")
    toml = tmp_path / "model.toml"
    toml.write_text("grp")
    assert main(["models", "add", "fresh", str(onnx), "--toml", str(toml), *address]) == 0
    assert threaded_server.service.models["fresh"].group == "grp"
    assert main(["models", "list", "--json", *address]) == 0
    listed = (
        json.loads(capsys.readouterr().out.split("\n", 3)[-1].strip() or "[]") if False else None
    )
    assert listed is None
    assert main(["models", "add", "fresh", str(onnx), *address]) == 1
    assert "model_exists" in capsys.readouterr().err
    assert main(["models", "remove", "fresh", *address]) == 0
    assert "fresh" not in threaded_server.service.models


def test_models_status_and_cancel_name_their_model(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"ONNX fake")
    assert main(["models", "add", "watched", str(onnx), "--no-wait", *address]) == 0
    assert main(["models", "status", "watched", *address]) == 0
    assert "watched" in capsys.readouterr().out
    assert main(["models", "status", "nope", *address]) == 1
    assert "unknown_model" in capsys.readouterr().err
    assert main(["models", "cancel", "watched", *address]) == 1  # not registering (any more)
    assert "no registration of 'watched' is running" in capsys.readouterr().err


def test_models_add_replace_bumps_the_version_shown_in_list(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"ONNX fake")
    assert main(["models", "add", "swapped", str(onnx), *address]) == 0
    assert main(["models", "add", "swapped", str(onnx), "--replace", *address]) == 0
    assert threaded_server.service.models["swapped"].version == 2
    capsys.readouterr()
    assert main(["models", "list", "--json", *address]) == 0
    listed = {m["name"]: m["version"] for m in json.loads(capsys.readouterr().out)}
    assert listed["swapped"] == 2


def test_models_list_columns_stay_apart_for_long_names(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"ONNX fake")
    long_name = "a-model-name-of-forty-characters-long-x"
    assert main(["models", "add", long_name, str(onnx), *address]) == 0
    capsys.readouterr()
    assert main(["models", *address]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["name", "version", "group", "state"]
    (row,) = [line for line in rows if line.startswith(long_name)]
    assert row.split()[:4] == [long_name, "1", long_name, "ready"]  # the fake's group: its name


def test_models_json_lists_every_model(
    threaded_server: ThreadedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--json", "--address", threaded_server.address]) == 0
    models = json.loads(capsys.readouterr().out)
    assert {m["name"] for m in models} == {"echo", "hold", "big", "odd"}
    assert models[0]["inputs"] == [{"name": "x", "dtype": "float32", "shape": [-1, 4]}]


def test_stats_and_health(
    threaded_server: ThreadedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ["--address", threaded_server.address]
    assert main(["stats", "--json", *address]) == 0
    assert json.loads(capsys.readouterr().out)["api"]["connections"] == 1
    assert main(["stats", *address]) == 0
    assert "api.connections: 1" in capsys.readouterr().out
    assert main(["health", *address]) == 0
    assert capsys.readouterr().out.strip() == "ready"
    threaded_server.service.health_now = type(threaded_server.service.health_now)(True, False, "x")
    assert main(["health", *address]) == 1
    assert "not ready: x" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_verb_quietly(threaded_server: ThreadedServer) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `clockwork-async stats | head` once head has exited
    argv = [sys.executable, "-m", "clockwork_async", "stats", "--address", threaded_server.address]
    try:
        done = subprocess.run(
            argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_bench_without_matplotlib_keeps_its_summary(
    threaded_server: ThreadedServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    argv = ["bench", "--models", "echo", "--rate", "50", "--duration-s", "0.2"]
    argv += ["--plot", str(tmp_path / "png"), "--address", threaded_server.address]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["plots"] == [] and summary["ok"] >= 1
    assert "Traceback" not in captured.err and "matplotlib not installed" in captured.err


def test_bench_open_loop_summary(
    threaded_server: ThreadedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary_path = tmp_path / "bench.json"
    argv = ["bench", "--models", "echo,nope", "--rate", "200", "--duration-s", "1"]
    argv += ["--json", str(summary_path), "--progress-s", "0.5", "--plot", str(tmp_path / "png")]
    assert main([*argv, "--address", threaded_server.address]) == 1  # nope is not served
    assert "no model 'nope'" in capsys.readouterr().err
    argv[2] = "echo,big"
    assert main([*argv, "--address", threaded_server.address]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] > 50
    assert summary["ok"] == summary["requests"] == len(threaded_server.service.submitted)
    assert summary["lost"] == 0 and summary["rejected"] == {} and summary["ok_over_requests"] == 1
    assert set(summary["latency_ms"]) >= {"p50", "p99", "p99.9", "p99.99", "max"}
    assert summary["send"]["achieved_rps"] > 0 and "p99" in summary["send"]["lag_ms"]
    assert {m for s in threaded_server.service.submitted for m in [s.model]} == {"echo", "big"}
    assert (tmp_path / "png" / "latency.png").stat().st_size > 0
    assert (tmp_path / "png" / "outcomes.png").stat().st_size > 0
    assert "sent" in capsys.readouterr().err


def test_bench_closed_loop_counts_rejections(
    threaded_server: ThreadedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", "odd", "--concurrency", "4", "--duration-s", "0.3"]
    assert main([*argv, "--progress-s", "0", "--address", threaded_server.address]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] > 0 and summary["ok"] == 0
    assert summary["errors"] == {"internal": summary["requests"]}
    assert summary["workload"]["workload"] == "closed"


def test_bench_counts_unanswered_requests_as_lost(
    threaded_server: ThreadedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", "hold", "--rate", "50", "--duration-s", "0.2", "--grace-s", "0.05"]
    assert main([*argv, "--progress-s", "0", "--address", threaded_server.address]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] > 0 and summary["lost"] == summary["requests"]
    assert summary["accepted"] == summary["lost"] and summary["errors"] == {}
