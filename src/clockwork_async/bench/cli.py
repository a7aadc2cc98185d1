"""The ``clockwork-async bench`` verb: flags, the workload they describe, the run, the
summary printed (and written with ``--json``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clockwork_async.api.async_client import AsyncClient, ClientError
from clockwork_async.api.auth import client_ssl_context
from clockwork_async.cli_client import Parser, UsageError, add_connection_flags, random_inputs
from clockwork_async.sim.replay import read_request_log, replay
from clockwork_async.sim.trace import TraceMapping, read_azure_trace
from clockwork_async.sim.workloads import (
    Workload,
    poisson,
    trace_replay,
)

from .report import summarize, write_plots, write_rows
from .run import NS_PER_S, RequestRows, Run, drive

# --- the verb ------------------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(prog="clockwork-async bench", description="Load a running daemon.")
    add = parser.add_argument
    add("--model", help="the model to send to")
    add("--models", help="comma-separated models; request i goes to model i mod N")
    add("--copies", type=int, help="send to the copies NAME-0 .. NAME-{N-1} of --model NAME")
    add("--rate", type=float, help="open loop: Poisson requests per second, all models")
    add("--concurrency", type=int, help="closed loop: requests kept in flight")
    add("--trace", type=Path, help="open loop: replay an Azure Functions invocations CSV")
    add("--load-scale", type=float, default=1.0, help="--trace: multiplies its rates")
    add("--replay", type=Path, help="open loop: replay a per-request CSV log (sim.replay)")
    add("--time-scale", type=float, default=1.0, help="--replay: multiplies its gaps")
    add("--duration-s", type=float, help="default 10 (--replay: the whole log)")
    add("--quick", action="store_true", help="a 1 s run (for smoke tests)")
    add("--slo-ms", type=float, default=100.0)
    add("--seed", type=int, default=0)
    add("--grace-s", type=float, help="wait for late replies (default: 2 SLOs + 2 s)")
    add(
        "--max-send-lag-ms",
        type=float,
        help="the run is marked behind (send.behind) when over 1%% of requests leave later "
        "than this against the schedule (default: 20%% of the SLO, at least 2 ms)",
    )
    add("--progress-s", type=float, default=1.0, help="progress line period (0: off)")
    add("--json", type=Path, help="write the summary here (it is printed too)")
    add("--plot", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    add("--rows", type=Path, help="write one row per request (JSON, columns) here")
    add("--timeline", action="store_true", help="per-second series in the summary")
    add_connection_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> list[str]:
    """Cross-flag checks; returns the model names. Raises UsageError."""
    models = [m for m in (args.models or args.model or "").split(",") if m]
    if not models:
        raise UsageError("give --model M or --models M1,M2")
    if args.copies is not None:
        if args.models or args.copies < 1:
            raise UsageError("--copies N (N >= 1) goes with --model NAME")
        models = copy_names(models[0], args.copies)
    modes = sum(x is not None for x in (args.rate, args.concurrency, args.trace, args.replay))
    if modes != 1:
        raise UsageError(
            "give exactly one of --rate R, --concurrency N, --trace FILE, --replay FILE"
        )
    if args.quick:
        args.duration_s = 1.0
    if args.duration_s is None and args.replay is None:
        args.duration_s = 10.0
    positive = {"--slo-ms": args.slo_ms, "--time-scale": args.time_scale}
    if args.max_send_lag_ms is not None:
        positive["--max-send-lag-ms"] = args.max_send_lag_ms
    if args.duration_s is not None:
        positive["--duration-s"] = args.duration_s
    if args.rate is not None:
        positive["--rate"] = args.rate
    if args.concurrency is not None:
        positive["--concurrency"] = args.concurrency
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    return models


def copy_names(model: str, copies: int) -> list[str]:
    """The daemon's names of a model's copies: ``NAME-i``, or ``NAME`` for one copy."""
    return [model] if copies == 1 else [f"{model}-{i}" for i in range(copies)]


def open_workload(args: argparse.Namespace, models: Sequence[str]) -> Workload:
    """The open-loop workload of the flags (a replay fills in ``args.duration_s`` when it was
    not given). Raises ValueError (TraceFormatError, RequestLogError), OSError."""
    instances = len(models)
    if args.replay is not None:
        duration_s = args.duration_s
        workload = replay(
            read_request_log(args.replay),
            models,
            time_scale=args.time_scale,
            duration_s=duration_s,
            default_slo_ms=args.slo_ms,
        )
        args.duration_s = workload.duration_ns / NS_PER_S
        return workload
    if args.trace is None:
        return poisson(instances, args.rate, args.duration_s)
    trace = read_azure_trace(args.trace, args.duration_s / 60.0)
    return trace_replay(TraceMapping(trace, instances), args.duration_s, args.load_scale)


async def draw_inputs(
    client: AsyncClient, models: Sequence[str], rng: np.random.Generator, shared: bool = False
) -> dict[str, Mapping[str, np.ndarray]]:
    """Random inputs per model as the daemon describes them (``shared``: one for all, drawn
    for the first: copies of one model). Raises ClientError for a model it does not serve."""
    served = {m.name: m for m in await client.models()}
    missing = [m for m in models if m not in served]
    if missing:
        raise ClientError(f"unknown_model: the daemon serves no model {missing[0]!r}")
    if shared:
        one = random_inputs(served[models[0]].inputs, rng)
        return dict.fromkeys(models, one)
    return {m: random_inputs(served[m].inputs, rng) for m in models}


async def bench(args: argparse.Namespace, models: list[str]) -> dict[str, Any]:
    """Run the bench the flags describe; returns its summary. Raises ClientError."""
    ssl = client_ssl_context(args.tls_ca) if args.tls or args.tls_ca else None
    async with await AsyncClient.connect(args.address, token=args.token, ssl=ssl) as client:
        rng = np.random.default_rng(args.seed)
        inputs = await draw_inputs(client, models, rng, shared=args.copies is not None)
        workload = None if args.concurrency else open_workload(args, models)
        run = Run(client, inputs)
        rows = RequestRows(run.start_ns) if args.rows is not None else None
        if rows is not None:
            run.observers = (rows,)
        await drive(
            run,
            workload,
            slo_ms=args.slo_ms,
            rng=rng,
            grace_s=args.grace_s,
            concurrency=args.concurrency or 0,
            duration_s=args.duration_s,
            progress_s=args.progress_s,
        )
    described: Mapping[str, Any] = (
        {"workload": "closed", "concurrency": args.concurrency}
        if workload is None
        else workload.describe()
    )
    duration_ns = round(args.duration_s * NS_PER_S)
    named: list[str] | str = models
    if args.copies is not None:  # thousands of copies are named by their range
        named = f"{models[0]} .. {models[-1]} ({len(models)} copies)"
    summary = summarize(
        run, duration_ns, {**described, "models": named}, args.timeline, args.max_send_lag_ms
    )
    send = summary["send"]
    if send["behind"]:
        print(
            f"clockwork-async bench: the generator fell behind its schedule: "
            f"{send['late']} requests ({100 * send['late_share']:.1f}%) left more than "
            f"{send['lag_budget_ms']:g} ms late; the daemon saw bursts the schedule did not "
            f"have (a busy CPU?)",
            file=sys.stderr,
        )
    summary["config"] = {"address": args.address, "slo_ms": args.slo_ms, "seed": args.seed}
    if args.trace is not None:
        summary["config"]["load_scale"] = args.load_scale
    if args.replay is not None:
        summary["config"]["time_scale"] = args.time_scale
    if rows is not None:
        write_rows(args.rows, run, rows)
        summary["rows"] = str(args.rows)
    if args.plot is not None:
        summary["plots"] = [str(p) for p in write_plots(run, duration_ns, args.plot, args.slo_ms)]
    return summary


def main(argv: list[str]) -> int:
    """Entry point of the verb: 0 done, 1 lost requests or no connection, 2 usage error."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        models = check_args(args)
        summary = _run_loop(bench(args, models))
    except UsageError as error:
        print(f"clockwork-async bench: {error}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except (ClientError, ValueError, OSError) as error:
        print(f"clockwork-async bench: {error}", file=sys.stderr)
        return 1
    text = json.dumps(summary, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 1 if summary["lost"] else 0


def _run_loop(coroutine: Any) -> dict[str, Any]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        result: dict[str, Any] = asyncio.run(coroutine)
        return result
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)  # type: ignore[no-any-return]
