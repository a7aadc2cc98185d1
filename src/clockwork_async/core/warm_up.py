"""Warm-up INFERs: keep a cold CPU lane from refusing a model whose requests keep coming.

On CPU executors an execution after a few ms of idle runs slower, and so does the one after
it (docs/benchmarks-experiments-a.md, "Execution after an idle gap"); with ``warm_gap_ns``
the core plans a new INFER on such a lane that much later. At a tight SLO that can refuse
every request: each finds the lane idle and cold, none runs, and the lane stays cold. With
``warm_up_infers`` set, such a refusal sends that many batch-1 INFERs of no request to the
lane, so that the requests arriving behind them find it busy (planned after them, with no
cold extra) and, once they run, warm.

Invariants: warm-ups go only to an executor holding the model loaded whose execute lane has
nothing committed and would start a cold action now, with a cold extra over 0; only when a
batch of 1 would have fitted on a warm lane (the SLO is not what refused it) and the model's
recent arrivals (its decayed demand) put the next one within ``warm_gap_ns``; at most one
series at a time (the lane is busy with it). Each warm-up is planned to take batch 1's
prediction plus the cold extra (the first starts that much later, as any cold start; the ones
behind it take that much longer), answers no request, and never corrects the model's window:
the first teaches the cold extra, as any cold start does, and the ones behind it run slow too.

Probes (on with the clockwork policy). A prediction only learns from actions that run: after
a slow spell (a busy machine), ten consistent slow samples can refuse every request of a
model, and nothing runs to correct them (the outlier rule in profiles.py relaxes one outlier,
not a consistent window). So when a request is refused ``infeasible``, the model's batch-1
prediction on an idle lane holding it would not have fitted, and that window had no sample
for ``prediction_stale_ns``, one batch-1 INFER of no request (a probe) goes to that lane. Its
measurement teaches the window and drops the samples over ``outlier_factor`` x it: a machine
fast again is believed at once; a model simply too slow for its SLOs costs one probe per
``prediction_stale_ns`` (the probe's sample makes the window fresh) and stays refused.
"""

from __future__ import annotations

from .entities import Action, ActionKind, ExecutorState, ModelState
from .state import CoreState, new_action_id, predict


def warm_up(core: CoreState, model: ModelState, internal_ns: int) -> None:
    """After ``model``'s request (internal deadline ``internal_ns``) was refused
    ``infeasible``: warm a cold lane it is loaded on, when that is worth it (module header)."""
    config = core.config
    now_ns = core.now_ns
    if model.demand_now(now_ns, config.utilisation_window_ns) * config.warm_gap_ns < (
        config.utilisation_window_ns
    ):
        return  # the next request is not expected within the warm gap
    b1 = model.spec.batch_sizes[0]
    for executor_id in model.loaded_on:
        executor = core.executors[executor_id]
        lane = executor.exec_lane
        if not lane.cold_extra_ns or not lane.is_cold_now(now_ns):
            continue  # warm already, or its cold starts cost nothing: warming would not help
        if now_ns + lane.lead_ns + predict(core, model, executor).exec_ns[b1] > internal_ns:
            continue  # not even a warm lane would serve it in time
        for _ in range(config.warm_up_infers):
            _send_warm_up(core, executor, model)
        return


def probe(core: CoreState, model: ModelState, internal_ns: int) -> None:
    """After ``model``'s request (internal deadline ``internal_ns``) was refused
    ``infeasible``: send one batch-1 INFER of no request to an idle lane holding it, when the
    model's batch-1 prediction there is stale and is what refused the request (module
    header, "Probes")."""
    now_ns = core.now_ns
    stale_ns = core.config.prediction_stale_ns
    b1 = model.spec.batch_sizes[0]
    for executor_id in model.loaded_on:
        executor = core.executors[executor_id]
        lane = executor.exec_lane
        if lane.outstanding:
            continue  # busy: what runs there is measured anyway
        predictions = predict(core, model, executor)
        if not predictions.exec_stale(b1, now_ns, stale_ns):
            continue
        if now_ns + lane.lead_ns + predictions.exec_ns[b1] <= internal_ns:
            continue  # a batch of 1 was predicted to fit there: not what refused it
        _send_empty(core, executor, model, probe=True)
        core.counters["probes"] += 1
        return


def _send_warm_up(core: CoreState, executor: ExecutorState, model: ModelState) -> None:
    """Commit one warm-up INFER to ``executor``'s execute lane and send it."""
    _send_empty(core, executor, model, probe=False)
    core.counters["warm_ups"] += 1


def _send_empty(core: CoreState, executor: ExecutorState, model: ModelState, probe: bool) -> None:
    """Commit one batch-1 INFER of no request (a warm-up or a probe) and send it."""
    lane = executor.exec_lane
    b1 = model.spec.batch_sizes[0]
    predicted_ns = predict(core, model, executor).exec_ns[b1]
    if not lane.is_cold_now(core.now_ns):  # behind the first: its start is not moved for it
        predicted_ns += lane.cold_extra_ns
    action = Action(
        new_action_id(core),
        ActionKind.INFER,
        executor.executor_id,
        model,
        core.now_ns,
        predicted_ns,
    )
    start_ns = lane.start_for(core.now_ns)
    action.latest_ns = start_ns + predicted_ns  # later, it would not warm anything in time
    action.batch_size = b1
    action.warm_up = not probe
    action.probe = probe
    lane.commit(action, start_ns)
    executor.actions[action.action_id] = action
    core.actions[action.action_id] = action
    executor.add_infer(model.name)
    core.out.append(action.start_infer())
