"""Coverage-guided fuzzing (atheris, libFuzzer) of the wire decoder and the client API handler.

    python -m benchmarks.fuzz_atheris [--quick] [--runs N] [--max-len BYTES] [--seed S]
        [--json OUT]

Needs ``pip install atheris`` (a binary wheel for CPython 3.11 on x86-64 Linux; no clang);
without it this prints why and exits 2. Never part of the test suite: a run is bounded by
``--runs`` inputs (default 300,000; quick 20,000), not by a property holding.

One input is the bytes a client sends on one connection. For each, the target checks:

1. *The decoder.* A server-side `Decoder` (``expect_hello``, the client API's wire limits) is fed
   the input in two pieces, cut where the input's last byte says. It may only return messages
   or raise `ProtocolError`; anything else is a crash. Each message it returns is encoded,
   decoded and encoded again: both encodings must be equal (what the codec accepts, it
   carries unchanged).
2. *The client API.* The same bytes go to the real connection handler (`ApiServer`, serving,
   over a `Service` stub that answers at once) through an in-memory transport, in the same two
   pieces, then end of input (a half-close). The handler must end within 5 s, log nothing at
   ERROR (its catch-all for bugs), and write only frames a client decodes; the ``error`` it
   sends, if any, is the last frame and the one the decoder and the API rules predict (none for
   clean input); with clean input every ``infer_request`` gets one ``infer_reply``.

The work runs in a child process (libFuzzer ends its process when done); this process seeds a
corpus with valid frames of every client message, reads libFuzzer's report (inputs run, exec/s,
edges and features covered, corpus size) and any crash with its reproducer file, prints a
table and writes ``results/fuzz_atheris[-quick].json``. Coverage counts the instrumented
modules: `clockwork_async.wire`, `connection` and `api`, and the `clockwork_async` modules they
import (a few of `core` and `runtime`).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import RESULTS, load_average, machine_description, table, write_report

CHILD_TIMEOUT_S = 3600
INPUT_TIMEOUT_S = 5.0
_STATUS = re.compile(
    r"^#(?P<runs>\d+)\s+(?P<event>\w+)\s+cov: (?P<cov>\d+) ft: (?P<ft>\d+)"
    r"(?: corp: (?P<corp>\d+)/\S+)?.*?(?:exec/s: (?P<eps>\d+))?.*?(?:rss: (?P<rss>\d+)Mb)?$"
)
_STAT = re.compile(r"^stat::(?P<name>\w+):\s+(?P<value>\d+)$")


# --- the parent: seed, run the child, read its report -----------------------------------------


def seed_corpus(folder: Path) -> int:
    """Write one file per seed input (valid frames of every client message); returns how many."""
    from benchmarks.fuzz_atheris_target import seed_inputs

    folder.mkdir(parents=True, exist_ok=True)
    seeds = seed_inputs()
    for index, data in enumerate(seeds):
        (folder / f"seed-{index:03d}").write_bytes(data)
    return len(seeds)


def run_child(args: argparse.Namespace, corpus: Path, artifacts: Path) -> tuple[int, str, float]:
    """Run libFuzzer in a child; returns its exit status, its output and its wall time."""
    command = [
        *(sys.executable, "-m", "benchmarks.fuzz_atheris_target", str(corpus)),
        f"-runs={args.runs}",
        f"-max_len={args.max_len}",
        f"-seed={args.seed}",
        f"-timeout={int(INPUT_TIMEOUT_S * 2)}",
        "-rss_limit_mb=3072",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/",
    ]
    print("$", " ".join(command[1:]), flush=True)
    started = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            if line.startswith("#") and ("pulse" in line or "DONE" in line):
                print(line.rstrip(), flush=True)
        status = child.wait(CHILD_TIMEOUT_S)
    return status, "".join(lines), time.monotonic() - started


def parse_report(output: str) -> dict[str, Any]:
    """libFuzzer's last status line, its final stats, and any crash it reported."""
    last: dict[str, Any] = {}
    stats: dict[str, int] = {}
    for line in output.splitlines():
        if match := _STATUS.match(line.strip()):
            last = {k: int(v) for k, v in match.groupdict().items() if v and k != "event"}
            last["event"] = match["event"]
        elif match := _STAT.match(line.strip()):
            stats[match["name"]] = int(match["value"])
    crash_files = re.findall(r"Test unit written to (\S+)", output)
    marker = "=== Uncaught Python exception: ==="
    crash_text = output[output.index(marker) :][:4000] if marker in output else ""
    return {
        "last_status": last,
        "final_stats": stats,
        "crash_files": crash_files,
        "crash": crash_text,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="clockwork-atheris-") as name:
        corpus = Path(name) / "corpus"
        seeds = seed_corpus(corpus)
        artifacts = RESULTS / "fuzz_atheris-artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        status, output, wall_s = run_child(args, corpus, artifacts)
        corpus_files = len(list(corpus.iterdir()))
    (RESULTS / "fuzz_atheris.log").write_text(output)
    report = parse_report(output)
    stats = report["final_stats"]
    crashes = len(report["crash_files"]) or int(bool(report["crash"]) or status not in (0,))
    return {
        "exit_status": status,
        "wall_s": round(wall_s, 1),
        "seed_inputs": seeds,
        "corpus_files_at_end": corpus_files,
        "runs": stats.get("number_of_executed_units", report["last_status"].get("runs")),
        "exec_per_s": stats.get("average_exec_per_sec", report["last_status"].get("eps")),
        "edges_covered": report["last_status"].get("cov"),
        "features": report["last_status"].get("ft"),
        "peak_rss_mb": stats.get("peak_rss_mb"),
        "new_units_added": stats.get("new_units_added"),
        "crashes": crashes,
        "crash_files": report["crash_files"],
        "crash": report["crash"],
    }


def print_report(result: dict[str, Any]) -> None:
    rows = [
        ["inputs run", result["runs"]],
        ["exec/s", result["exec_per_s"]],
        ["edges covered (cov)", result["edges_covered"]],
        ["features (ft)", result["features"]],
        ["corpus: seeds -> end", f"{result['seed_inputs']} -> {result['corpus_files_at_end']}"],
        ["peak RSS MB", result["peak_rss_mb"]],
        ["crashes (goal 0)", result["crashes"]],
        ["wall s", result["wall_s"]],
    ]
    print(table(["fuzz_atheris", "value"], rows))
    if result["crash"]:
        print(result["crash"])
        print("reproducers:", ", ".join(result["crash_files"]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_atheris", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="20,000 inputs")
    parser.add_argument("--runs", type=int, help="inputs to run (default 300,000; quick 20,000)")
    parser.add_argument("--max-len", type=int, default=4096, help="largest input in bytes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("atheris") is None:
        print("atheris is not installed: pip install atheris (docs/reliability.md)")
        return 2
    if args.runs is None:
        args.runs = 20_000 if args.quick else 300_000
    name = "fuzz_atheris-quick" if args.quick else "fuzz_atheris"
    json_path = args.json or RESULTS / f"{name}.json"
    result = {
        "benchmark": "fuzz_atheris",
        "quick": args.quick,
        "machine": machine_description(),
        "runs_asked": args.runs,
        "max_len": args.max_len,
        "seed": args.seed,
        **run(args),
        "load_average_after": load_average(),
    }
    print_report(result)
    path = write_report(json_path.stem, result, json_path.parent)
    print(f"wrote {path}")
    return 0 if result["crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
