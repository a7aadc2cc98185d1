"""``clockwork-async bench``: a load generator against a running daemon.

Modes: open-loop Poisson (``--rate``), replay of an Azure Functions trace (``--trace``; the
workloads of `sim.workloads`, drawn on the same schedule the simulator uses), replay of a
per-request log (``--replay FILE.csv``, `sim.replay`: its times scaled by ``--time-scale``, its
models mapped onto ``--models`` by name or else round-robin, its ``slo_ms`` per request), or
closed loop
(``--concurrency N``: N requests always in flight). ``--copies N`` sends to the N copies
``NAME-0`` .. ``NAME-{N-1}`` of ``--model NAME`` (model.toml's ``copies``), all with one input.
The summary has the outcome keys and latency percentiles of ``clockwork-async simulate`` plus
what the generator itself achieved: requests scheduled against sent, its send rate, its send
lag (how late each request left against its schedule) and its own CPU time, so a generator
that cannot keep up is visible rather than mistaken for a slow daemon: ``send.behind`` marks a
run where over 1% of requests left later than the lag budget (``--max-send-lag-ms``, default
20% of the SLO, at least 2 ms; `send_verdict`), and a warning says so. ``--rows FILE`` keeps
one row per request (`RequestRows`), ``--timeline`` per-second series.

It is also the load generator of the benchmarks, called in-process: `drive` runs a `Run` (on
a connection the caller holds) through any open-loop schedule (`sim.workloads`, `phases`) or a
closed loop, with observers (`Observer`) that see every request sent and answered.

Invariants: open-loop arrivals leave on their schedule from this process and never wait for a
reply (nor for the socket to drain); every request sent is counted exactly once in the summary,
as an outcome, an error status or ``lost`` (no answer before the end of the grace period).
Latency is measured here, from the moment a request was handed to the socket to its reply.
"""

from .cli import copy_names, draw_inputs, main
from .report import lag_budget_ms, send_verdict, summarize
from .run import ROW_COLUMNS, Observer, Recorder, RequestRows, Run, drive, phases

__all__ = [
    "ROW_COLUMNS",
    "Observer",
    "Recorder",
    "RequestRows",
    "Run",
    "copy_names",
    "draw_inputs",
    "drive",
    "lag_budget_ms",
    "main",
    "phases",
    "send_verdict",
    "summarize",
]
