"""``clockwork-async simulate``: run the controller core on simulated executors in virtual time.

One idea: the verb's flags, checked at the edge, into runs and their summaries.

Flags are parsed and checked here, at the edge (bad ones: an argparse error, exit status 2);
the run itself is `sim.engine`. Exit status 1 when a run lost a request or broke a core promise
(see ``violations``), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clockwork_async.core.config import ConfigError, ControllerConfig

from .compare import compare
from .contention import Contention, ContentionError
from .engine import SimConfig, Simulation, build_controller, model_name
from .mmpp import DEFAULT_ALPHA, DEFAULT_LEVELS, DEFAULT_SOJOURN_S, mmpp
from .profiles import ProfileError, SimProfile, resolve_profile
from .replay import RequestLogError, read_request_log, replay
from .report import capacity_rps, summarize, write_plots
from .stats import ACTION_LOG_FIELDS, REQUEST_LOG_FIELDS, RecordWriter, SimStats
from .trace import TraceFormatError, TraceMapping, read_azure_trace
from .workloads import (
    Workload,
    bursty,
    closed_loop,
    poisson,
    ramp,
    slo_sweep_ms,
    trace_replay,
)

WORKLOADS = ("poisson", "closed", "bursty", "sweep", "azure", "ramp", "mmpp", "replay")
POLICIES = ("clockwork", "fifo", "timeout")
DEFAULT_RATE_RPS = 100.0


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _slo_list(text: str) -> list[float]:
    try:
        values = sorted(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ms: {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError("SLOs must be > 0 ms")
    return values


def _float_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None


def _contention(text: str) -> Contention:  # (e.g. 3,0.35,10; sim/contention.py)
    try:
        return Contention.parse(text)
    except ContentionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    """The simulate verb's flags."""
    parser = argparse.ArgumentParser(
        prog="clockwork-async simulate",
        description="Run the controller core on simulated executors in virtual time.",
    )
    add = parser.add_argument
    add("--workload", choices=WORKLOADS, default="poisson")
    add("--trace", type=Path, help="Azure Functions 2019 invocations CSV (--workload azure)")
    add("--requests", type=Path, help="per-request CSV log (--workload replay)")
    add("--time-scale", type=_positive(float), default=1.0, help="replay: multiplies gaps")
    add("--executors", type=_positive(int), default=1)
    instances_help = "model instances (default 1; replay: the log's models)"
    add("--instances", type=_positive(int), help=instances_help)
    add("--profile", default="resnet50-v100", help="a built-in profile name or a profile file")
    add("--slo-ms", type=_positive(float), default=100.0)
    add("--slos-ms", type=_slo_list, help="SLOs of a sweep (default: multiples of the b1 time)")
    minutes_help = "simulated minutes of arrivals (default 1; replay: the whole log)"
    add("--minutes", type=_positive(float), help=minutes_help)
    rates = parser.add_mutually_exclusive_group()
    rates.add_argument("--rate", type=_non_negative, help="req/s over all instances")
    rates.add_argument("--load-scale", type=_non_negative, help="multiplies the trace's rates")
    add("--policy", choices=POLICIES, default="clockwork")
    core_help = "a ControllerConfig field, e.g. schedule_ahead_ns=2000000 (repeatable)"
    add("--core", action="append", default=[], metavar="KEY=VALUE", help=core_help)
    add("--seed", type=int, default=0)
    add("--clients", type=_positive(int), default=16, help="closed loop: clients")
    add("--in-flight", type=_positive(int), default=1, help="closed loop: requests per client")
    add("--think-ms", type=_non_negative, default=0.0, help="closed loop: pause after a reply")
    add("--burst-on-s", type=_positive(float), default=1.0, help="bursty: mean on period")
    add("--burst-off-s", type=_non_negative, default=1.0, help="bursty: mean off period")
    add("--mmpp-levels", type=_float_list, default=list(DEFAULT_LEVELS), help="mmpp: rate levels")
    sojourn_help = "mmpp: mean sojourn per state"
    add("--mmpp-sojourn-s", type=_float_list, default=list(DEFAULT_SOJOURN_S), help=sojourn_help)
    add("--mmpp-alpha", type=_non_negative, default=DEFAULT_ALPHA, help="mmpp: Pareto shape")
    add("--greedy", action="store_true", help="add the greedy baseline to the summary")
    add("--no-bound", action="store_true", help="skip the upper bound (about 1 s per 500k)")
    add("--ramp-step-s", type=_positive(float), default=1.0, help="ramp: s between activations")
    add("--message-delay-us", type=_non_negative, default=0.0, help="controller<->executor")
    add("--preload", action="store_true", help="start with instances resident (pages allowing)")
    add("--noise", type=_non_negative, default=0.0, help="relative stddev of durations")
    contention_help = "a shared CPU: x FACTOR a SHARE of the time, in spells of SPELL_MS mean"
    add("--contention", type=_contention, metavar="FACTOR,SHARE,SPELL_MS", help=contention_help)
    add("--interval-s", type=_positive(float), help="timeline resolution (default: automatic)")
    add("--progress-s", type=_non_negative, default=5.0, help="progress line period (0: off)")
    add("--json", type=Path, help="write the summary here")
    add("--plot", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    add("--log-requests", type=Path, help="per-request log (.csv, else JSON lines)")
    add("--log-actions", type=Path, help="per-action log (.csv, else JSON lines)")
    add("--quiet", action="store_true", help="print no summary")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SimProfile:
    """Cross-flag checks (parser.error exits with status 2); return the profile."""
    if args.workload == "azure" and args.trace is None:
        parser.error("--workload azure needs --trace FILE")
    if (args.workload == "replay") != (args.requests is not None):
        parser.error("--workload replay goes with --requests FILE (and only it)")
    if args.workload == "replay" and args.rate is not None:
        parser.error("--workload replay sends the log's requests (use --time-scale, not --rate)")
    if args.workload != "replay" and args.minutes is None:
        args.minutes = 1.0
    if args.workload != "replay" and args.instances is None:
        args.instances = 1
    if args.workload != "azure" and args.load_scale is not None:
        parser.error("--load-scale applies to --workload azure only (use --rate)")
    if args.workload == "closed" and args.rate is not None:
        parser.error("--workload closed is driven by --clients/--in-flight, not --rate")
    if args.workload == "sweep" and (args.log_requests or args.log_actions):
        parser.error("--log-requests/--log-actions log one run; not with --workload sweep")
    args.core_overrides = _core_overrides(parser, args.core, args.policy)
    try:
        return resolve_profile(args.profile)
    except ProfileError as error:
        parser.error(str(error))
    raise AssertionError("unreachable")


def _core_overrides(
    parser: argparse.ArgumentParser, pairs: list[str], policy: str
) -> dict[str, Any]:
    """``--core KEY=VALUE`` pairs as ControllerConfig keyword arguments (checked)."""
    types: dict[str, Callable[[str], Any]] = {
        f.name: type(f.default) for f in dataclasses.fields(ControllerConfig)
    }
    del types["policy"]
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or key not in types:
            parser.error(f"--core {pair!r}: expected KEY=VALUE, KEY one of {', '.join(types)}")
        try:
            overrides[key] = types[key](text)
        except ValueError:
            parser.error(
                f"--core {pair!r}: {text!r} is not a {getattr(types[key], '__name__', '')}"
            )
    try:
        ControllerConfig(policy=policy, **overrides)
    except ConfigError as error:
        parser.error(f"--core: {error}")
    return overrides


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags describe. Raises ValueError, TraceFormatError or OSError."""
    if args.workload == "replay":
        return _replay_workload(args)
    duration_s = args.minutes * 60.0
    rate = DEFAULT_RATE_RPS if args.rate is None else args.rate
    if args.workload == "mmpp":
        levels, sojourn_s = args.mmpp_levels, args.mmpp_sojourn_s
        return mmpp(args.instances, rate, duration_s, levels, sojourn_s, args.mmpp_alpha)
    if args.workload in ("poisson", "sweep"):
        return poisson(args.instances, rate, duration_s)
    if args.workload == "bursty":
        return bursty(args.instances, rate, duration_s, args.burst_on_s, args.burst_off_s)
    if args.workload == "ramp":
        return ramp(args.instances, rate, duration_s, args.ramp_step_s)
    if args.workload == "closed":
        return closed_loop(args.instances, args.clients, args.in_flight, duration_s, args.think_ms)
    mapping = TraceMapping(read_azure_trace(args.trace, args.minutes), args.instances)
    scale = args.load_scale if args.load_scale is not None else 1.0
    if args.rate is not None:
        mean_rps = mapping.window_total() / (mapping.trace.minutes * 60.0)
        scale = args.rate / mean_rps if mean_rps else 0.0
    return trace_replay(mapping, duration_s, scale)


def _replay_workload(args: argparse.Namespace) -> Workload:
    """The replayed log; fills in ``--instances`` (the log's models) and ``--minutes`` (its
    span) when they were not given."""
    log = read_request_log(args.requests)
    if args.instances is None:
        args.instances = len(log.names)
    duration_s = None if args.minutes is None else args.minutes * 60.0
    targets = [model_name(i) for i in range(args.instances)]
    workload = replay(
        log,
        targets,
        time_scale=args.time_scale,
        duration_s=duration_s,
        default_slo_ms=args.slo_ms,
    )
    args.minutes = workload.duration_ns / 60e9
    return workload


def _interval_ns(args: argparse.Namespace) -> int:
    if args.interval_s is not None:
        return round(float(args.interval_s) * 1e9)
    return max(1, round(float(args.minutes) * 60.0 / 600)) * 1_000_000_000  # <= ~600 points


def run_once(
    args: argparse.Namespace,
    profile: SimProfile,
    workload: Workload,
    slo_ms: float,
    plot_dir: Path | None = None,
) -> dict[str, Any]:
    """One simulation with ``slo_ms``; returns its summary (plots and logs as flagged)."""
    config = _sim_config(args, profile, slo_ms)
    stats = _simulate(args, config, workload)
    summary = summarize(
        stats, workload.duration_ns, _config_of(args, profile, slo_ms), workload.describe()
    )
    summary["capacity_rps"] = round(capacity_rps(profile, config.slo_ns) * args.executors, 1)
    if not args.no_bound:
        summary.update(compare(config, workload, summary["ok"], args.greedy))
    if plot_dir is not None:
        title = f"{args.workload} / {args.policy} / SLO {slo_ms:g} ms"
        write_plots(stats, workload.duration_ns, plot_dir, slo_ms, title)
    return summary


def _sim_config(args: argparse.Namespace, profile: SimProfile, slo_ms: float) -> SimConfig:
    return SimConfig(
        executors=args.executors,
        profile=profile,
        slo_ns=round(slo_ms * 1e6),
        message_delay_ns=round(args.message_delay_us * 1000),
        noise=args.noise,
        seed=args.seed,
        interval_ns=_interval_ns(args),
        progress_s=args.progress_s,
        preload=args.preload,
        contention=args.contention,
    )


def _simulate(args: argparse.Namespace, config: SimConfig, workload: Workload) -> SimStats:
    """Run on the production core, with the logs the flags ask for (always closed)."""
    request_log = RecordWriter(args.log_requests, REQUEST_LOG_FIELDS) if args.log_requests else None
    action_log = RecordWriter(args.log_actions, ACTION_LOG_FIELDS) if args.log_actions else None
    try:
        controller = build_controller(args.policy, args.core_overrides)
        logs = {"request_log": request_log, "action_log": action_log}
        return Simulation(config, workload, controller, **logs, progress=sys.stderr).run()
    finally:
        for log in (request_log, action_log):
            if log is not None:
                log.close()


def _config_of(args: argparse.Namespace, profile: SimProfile, slo_ms: float) -> dict[str, Any]:
    return {
        "workload": args.workload,
        "trace": str(args.trace) if args.trace else None,
        "requests_file": str(args.requests) if args.requests else None,
        "time_scale": args.time_scale,
        "executors": args.executors,
        "instances": args.instances,
        "profile": profile.name,
        "slo_ms": slo_ms,
        "minutes": args.minutes,
        "rate": args.rate,
        "load_scale": args.load_scale,
        "policy": args.policy,
        "core": args.core_overrides,
        "seed": args.seed,
        "message_delay_us": args.message_delay_us,
        "noise": args.noise,
        "contention": args.contention.describe() if args.contention else None,
        "preload": args.preload,
    }


def run_sweep(args: argparse.Namespace, profile: SimProfile) -> dict[str, Any]:
    """One Poisson run per SLO; returns ``{"runs": [...], ...totals}``."""
    b1_ms = profile.execute_ns[min(profile.execute_ns)] / 1e6
    slos = args.slos_ms or slo_sweep_ms(b1_ms)
    runs = [
        run_once(args, profile, build_workload(args), slo, _sweep_plot_dir(args.plot, slo))
        for slo in slos
    ]
    totals = {k: sum(run[k] for run in runs) for k in ("requests", "ok", "late", "lost")}
    return {"workload": "sweep", "slos_ms": slos, **totals, "runs": runs}


def _sweep_plot_dir(plot: Path | None, slo_ms: float) -> Path | None:
    return None if plot is None else plot / f"slo_{slo_ms:g}ms"


def main(argv: list[str]) -> int:
    """Entry point of the verb; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    profile = _check_args(parser, args)
    try:
        if args.workload == "sweep":
            result = run_sweep(args, profile)
            runs = result["runs"]
        else:
            result = run_once(args, profile, build_workload(args), args.slo_ms, args.plot)
            runs = [result]
    except (TraceFormatError, RequestLogError, ValueError, OSError) as error:
        print(f"clockwork-async simulate: {error}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not args.quiet:
        print_table(runs)
    return 1 if any(run["lost"] or run["violations"] for run in runs) else 0


def print_table(runs: list[dict[str, Any]]) -> None:
    """One line per run: outcome counts, attainment, goodput and latency."""
    print(
        f"{'policy':<10}{'slo_ms':>8}{'requests':>10}{'ok':>10}{'dropped':>9}{'rejected':>9}"
        f"{'late':>6}{'lost':>5}{'ok/acc':>10}{'goodput':>9}{'bound':>9}{'ok/bound':>9}"
        f"{'p99_ms':>8}{'max_ms':>8}"
    )
    for run in runs:
        latency = run["latency_ms"]
        print(
            f"{run['config']['policy']:<10}{run['config']['slo_ms']:>8g}{run['requests']:>10}"
            f"{run['ok']:>10}{run['dropped']:>9}{sum(run['rejected'].values()):>9}"
            f"{run['late']:>6}{run['lost']:>5}{_fraction(run['ok_over_accepted']):>10}"
            f"{run['goodput_rps']:>9.1f}{_bound(run)}{_ms(latency['p99'])}{_ms(latency['max'])}"
        )
        if "greedy" in run:
            greedy = run["greedy"]
            print(
                f"{'greedy':<10}{run['config']['slo_ms']:>8g}{run['requests']:>10}"
                f"{greedy['ok']:>10}{greedy['dropped']:>9}{'':>30}{greedy['goodput_rps']:>9.1f}"
                f"{_bound(run, greedy['over_bound'])}"
            )
    for run in runs:
        mapping = run["workload"].get("mapping")
        if mapping:
            print(f"trace mapping: {json.dumps(mapping)}")


def _bound(run: dict[str, Any], share: float | None = None) -> str:
    """The bound's goodput and a share of it (the run's own by default), or dashes."""
    bound = run.get("bound")
    if not bound:
        return f"{'-':>9}{'-':>9}"
    share = run["goodput_over_bound"] if share is None else share
    return f"{bound['goodput_rps']:>9.1f}{'-' if share is None else f'{100 * share:.1f}%':>9}"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.4f}%"


def _ms(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>8.2f}"
