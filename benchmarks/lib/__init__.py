"""The benchmarks' one library. Every benchmark imports what it shares from here:

- `stats`: percentiles (the house's one, `clockwork_async.core.percentile`), duration
  summaries, and statistics of per-request rows (`clockwork_async.bench --rows`);
- `machine`: what the numbers were measured on, and the load average;
- `processes`: the daemon through `clockwork_async.testing`, its models and profiles, and
  ``clockwork-async bench`` (the one load generator) as a pinned process;
- `report`: results files, tables, logs and copies into docs/img;
- `plots`: matplotlib made optional (a missing one skips the plot, never the run's summary);
- `sim`: one run of the production core on simulated executors (the virtual-time benchmarks).

The names below are re-exported so that a benchmark needs one import line.
"""

from benchmarks.lib.machine import cpu_model, load_average, machine_description
from benchmarks.lib.plots import plot_panels, pyplot, save
from benchmarks.lib.processes import (
    GENERATOR_NICE,
    POLICIES,
    SIM_EXECUTOR,
    DaemonProcess,
    LoadSpec,
    ModelFolder,
    add_model,
    bench_argv,
    cached_profiles,
    children,
    clean_environ,
    collect,
    collect_bench,
    controller_section,
    daemon_config,
    daemon_stats,
    demo_model_bytes,
    generator_cpus,
    kill_daemon,
    record,
    registration_profile,
    run_bench,
    run_uvloop,
    serve_wire,
    shared_model_bytes,
    spawn_bench,
    spawn_recorder,
    start_daemon,
    start_wire_server,
)
from benchmarks.lib.report import (
    DOCS_IMG,
    RESULTS,
    copy_to_docs,
    keep_log,
    percent,
    rejected_text,
    table,
    write_json,
    write_report,
)
from benchmarks.lib.stats import (
    action_errors,
    error_summary,
    histogram_percentile,
    outcome_summary,
    percentile,
    percentile_of,
    percentiles,
    percentiles_ms,
    ratio,
    select,
    summarize_ns,
)

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000

__all__ = [
    "DOCS_IMG",
    "GENERATOR_NICE",
    "NS_PER_MS",
    "NS_PER_S",
    "POLICIES",
    "RESULTS",
    "SIM_EXECUTOR",
    "DaemonProcess",
    "LoadSpec",
    "ModelFolder",
    "action_errors",
    "add_model",
    "bench_argv",
    "cached_profiles",
    "children",
    "clean_environ",
    "collect",
    "collect_bench",
    "controller_section",
    "copy_to_docs",
    "cpu_model",
    "daemon_config",
    "daemon_stats",
    "demo_model_bytes",
    "error_summary",
    "generator_cpus",
    "histogram_percentile",
    "keep_log",
    "kill_daemon",
    "load_average",
    "machine_description",
    "outcome_summary",
    "percent",
    "percentile",
    "percentile_of",
    "percentiles",
    "percentiles_ms",
    "plot_panels",
    "pyplot",
    "ratio",
    "record",
    "registration_profile",
    "rejected_text",
    "run_bench",
    "run_uvloop",
    "save",
    "select",
    "serve_wire",
    "shared_model_bytes",
    "spawn_bench",
    "spawn_recorder",
    "start_daemon",
    "start_wire_server",
    "summarize_ns",
    "table",
    "write_json",
    "write_report",
]
