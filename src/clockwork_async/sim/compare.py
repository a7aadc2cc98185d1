"""A run's goodput beside what any scheduler could do (`sim.bound`) and what the greedy
baseline does (`sim.greedy`), on the very arrivals of the run.

Invariants: the arrivals are drawn again from the run's workload generator
(`engine.workload_rng` of the run's seed), so they are the run's own; nothing here runs the
core. The bound holds only for open-loop arrivals (a closed loop's arrivals depend on the
replies) and for durations no shorter than the profile's (with noise a batch may run shorter;
contention, sim/contention.py, only slows, so the bound holds there): in the other cases no
bound is given, and the note says why.
"""

from __future__ import annotations

from typing import Any

from .bound import open_requests, stream_bound
from .engine import SimConfig, workload_rng
from .greedy import greedy
from .workloads import ClosedLoop, Workload, request_slos_ns

NS_PER_S = 1_000_000_000


def bound_note(config: SimConfig, workload: Workload) -> str | None:
    """Why no bound holds for this run, or None when it does."""
    if isinstance(workload, ClosedLoop):
        return "closed loop: arrivals depend on the replies"
    if config.noise > 0:
        return "noise > 0: batches may run shorter than the profile"
    return None


def compare(
    config: SimConfig, workload: Workload, ok: int, with_greedy: bool = False
) -> dict[str, Any]:
    """Summary keys ``bound`` (ok and goodput of the bound), ``goodput_over_bound`` and, with
    ``with_greedy``, ``greedy`` (its ok, dropped, goodput, batch sizes and share of the bound)."""
    note = bound_note(config, workload)
    if note is not None:
        return {"bound": None, "goodput_over_bound": None, "bound_note": note}
    execute_ns = config.profile.execute_ns
    limit, _ = stream_bound(
        workload, workload_rng(config.seed), config.slo_ns, execute_ns, config.executors
    )
    duration_s = workload.duration_ns / NS_PER_S
    found: dict[str, Any] = {
        "bound": {"ok": limit, "goodput_rps": round(limit / duration_s, 3)},
        "goodput_over_bound": ok / limit if limit else None,
    }
    if with_greedy:
        requests = open_requests(
            workload, workload_rng(config.seed), config.slo_ns, request_slos_ns(workload)
        )
        result = greedy(requests, execute_ns, config.executors)
        found["greedy"] = {
            **result.summary(workload.duration_ns),
            "over_bound": result.ok / limit if limit else None,
        }
    return found
