"""A discrete-event simulation of the controller core driving simulated executors.

One idea: virtual time around the production core.

The core is the production one (`core.controller.Controller`), fed events on a virtual clock;
the executors are `sim.executors.SimExecutor`s that follow the real executor's action rules.

Invariants:
- Virtual time only moves forward; events at one time run in the order they were scheduled
  (a heap of ``(time_ns, seq, ...)``), and heap events run before an arrival at the same time,
  so a run is a pure function of its config, workload and seed.
- The controller's clock is the virtual clock. Actions reach an executor, and results reach the
  controller, ``message_delay_ns`` after they were sent; clients talk to the controller
  directly.
- With no message delay, a result skips the heap while arrivals are sent (`_flush_results`):
  it is fed after every heap event at its instant pushed before it and before every event
  pushed after it, which is the heap's order, so the controller sees the same events at the
  same times in the same order as through the heap (tests/sim/test_result_shortcut.py).
- Every request gets exactly one Reply. A second reply, an ``ok`` after the deadline or an
  UNLOAD under running work is counted in ``violations``; requests unanswered when the run
  ends (nothing left to happen, or no reply for ``drain_limit_ns`` after the arrivals ended)
  are counted as ``lost``.
- A WakeAt replaces the previous one: only the Tick of the latest WakeAt is delivered.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TextIO, cast

import numpy as np

from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    ExecutorJoined,
    ModelProfile,
    ModelRegistered,
    ModelSpec,
    Reply,
    RequestArrived,
    StartInfer,
    StartLoad,
    StartUnload,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome

from .contention import Contention, ContentionClock
from .executors import ExecutorHost, LaneIndex, SimExecutor, SimLane
from .pending import PendingRequests
from .profiles import RESNET50_V100, SimProfile
from .stats import RecordSink, SimStats
from .workloads import OpenLoop, Workload, request_slos_ns

NS_PER_S = 1_000_000_000
# Final: a compiled module keeps these in C statics instead of looking them up per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop
_OK = Outcome.OK  # enum attribute lookups are slow in hot paths
_TICK: Final = Tick()  # one for every Tick: it has no fields and is frozen
EXECUTOR_KIND = "simulated"

# Engine event kinds (executor lane events use 0 and 1, see sim.executors).
EV_DELIVER = 2  # an action reaches its executor
EV_RESULT = 3  # an executor's result reaches the controller
EV_TICK = 4  # a WakeAt fires
EV_ARRIVAL = 5  # a closed-loop request is sent


class ControllerLike(Protocol):
    """The one entry point of the core."""

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]: ...


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's fixed settings."""

    executors: int = 1
    profile: SimProfile = RESNET50_V100
    slo_ns: int = 100_000_000
    message_delay_ns: int = 0
    noise: float = 0.0  # relative standard deviation of durations (0: deterministic)
    seed: int = 0
    interval_ns: int = NS_PER_S  # timeline resolution
    drain_ns: int | None = None  # give up after this long without a reply; max(10 s, 10 SLOs)
    progress_s: float = 0.0  # seconds of wall time between progress lines (0: none)
    preload: bool = False  # start with instance i resident on executor i mod N (pages allowing)
    contention: Contention | None = None  # a shared CPU's slow spells (sim/contention.py)

    def __post_init__(self) -> None:
        if self.executors < 1:
            raise ValueError(f"executors must be >= 1, got {self.executors}")
        if self.slo_ns <= 0 or self.message_delay_ns < 0 or self.noise < 0:
            raise ValueError("slo must be > 0, message delay and noise >= 0")

    @property
    def drain_limit_ns(self) -> int:
        return self.drain_ns if self.drain_ns is not None else max(10 * NS_PER_S, 10 * self.slo_ns)


def build_controller(policy: str, overrides: Mapping[str, Any] | None = None) -> ControllerLike:
    """The production core with ``policy`` ("clockwork", "fifo" or "timeout") and any other
    ControllerConfig fields in ``overrides``. Raises ConfigError (a ValueError) on bad values."""
    return Controller(ControllerConfig(policy=policy, **dict(overrides or {})))


def model_name(instance: int) -> str:
    return f"m{instance}"


def model_spec(profile: SimProfile, instance: int, slo_ns: int) -> ModelSpec:
    """The ModelSpec of one instance of ``profile`` on simulated executors."""
    seed = ModelProfile(execute_ns=dict(profile.execute_ns), load_ns=profile.load_ns)
    return ModelSpec(
        name=model_name(instance),
        batch_sizes=profile.batch_sizes,
        weights_pages=profile.weights_pages,
        profiles={EXECUTOR_KIND: seed},
        group=profile.name,
        default_slo_ns=slo_ns,
    )


def workload_rng(seed: int) -> np.random.Generator:
    """The generator a run with ``seed`` draws its workload from (so `sim.bound` and
    `sim.greedy` see the very arrivals the run saw)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])


def noise_seed(seed: int) -> int:
    """The seed of the executors' duration noise of a run with ``seed``."""
    return int(np.random.SeedSequence(seed).spawn(2)[1].generate_state(1)[0])


class Simulation(ExecutorHost):
    """One run: ``Simulation(config, workload, controller).run()`` returns its SimStats."""

    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        controller: ControllerLike,
        *,
        request_log: RecordSink | None = None,
        action_log: RecordSink | None = None,
        progress: TextIO | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        self.controller = controller
        # The production core, called directly (compiled: native, not through the Protocol).
        self._core = controller if isinstance(controller, Controller) else None
        self.stats = SimStats(config.interval_ns)
        self.now_ns = 0
        self._heap: list[tuple[int, int, int, object, object]] = []
        self._last_seq = 0  # the heap's tie-breaker: events at one time run in push order
        # Results sent back with no delay while arrivals are sent: (seq, result), fed by
        # `_flush_results` in heap order instead of a heap push and pop each (0.9 a request).
        self._ready: list[tuple[int, ActionFinished]] = []
        self._result_shortcut = config.message_delay_ns == 0  # tests turn it off to compare
        self._direct_results = False  # the shortcut is in use (in `run`'s arrival loop only)
        self._pending = PendingRequests()  # id -> instance, arrival, deadline, cold
        self._next_request_id = 0
        self._scheduled_arrivals = 0
        self._wake_generation = 0
        self._last_reply_ns = 0
        self._open_loop = isinstance(workload, OpenLoop)  # after_reply is always None
        self._names = [model_name(i) for i in range(workload.instances)]
        self._slos_ns = request_slos_ns(workload)  # a replayed log's own SLOs
        self._instance_of = {name: i for i, name in enumerate(self._names)}
        self._resident = [0] * workload.instances  # copies loaded (not loading) per instance
        self._actions: dict[int, tuple[int, StartLoad | StartInfer | StartUnload]] = {}
        self._request_log = request_log
        self._action_log = action_log
        self._progress = progress if config.progress_s > 0 else None
        self._wall_start = self._last_progress = 0.0
        self._rng = workload_rng(config.seed)
        self.executors = self._make_executors(noise_seed(config.seed))

    def _make_executors(self, noise_seed: int) -> dict[str, SimExecutor]:
        """Executors ``e0``..``e{N-1}``, each with its own seeded noise generator (and
        contention clock, on a generator of its own so that no other draw changes)."""
        config = self.config
        return {
            f"e{i}": SimExecutor(
                f"e{i}",
                config.profile,
                self,
                config.noise,
                random.Random(noise_seed + i),
                self._contention_clock(noise_seed, i),
            )
            for i in range(config.executors)
        }

    def _contention_clock(self, noise_seed: int, index: int) -> ContentionClock | None:
        contention = self.config.contention
        if contention is None:
            return None
        return ContentionClock(contention, random.Random(f"contention-{noise_seed}-{index}"))

    # --- running ------------------------------------------------------------------------

    def run(self) -> SimStats:
        """Run to the end of the workload and drain; return the stats (also ``self.stats``)."""
        wall_start = self._wall_start = self._last_progress = time.perf_counter()
        self._announce()
        heap, ready = self._heap, self._ready
        # Not while announcing or draining: the drain may stop with a result unfed.
        self._direct_results = self._result_shortcut
        for times_ns, instances in self.workload.open_arrivals(self._rng):
            if len(times_ns) != len(instances):
                raise ValueError("a workload's piece has as many times as instances")
            for index in range(len(times_ns)):  # (indexing: native lists when compiled)
                arrival_ns = times_ns[index]
                while heap and heap[0][0] <= arrival_ns:
                    self._step(_heappop(heap))  # (not a local: a bound method is a generic call)
                    if ready:
                        self._flush_results()
                self._arrive(arrival_ns, instances[index])
                if ready:
                    self._flush_results()
        self._direct_results = False
        self._drain(self.workload.duration_ns)
        self._finish(wall_start)
        return self.stats

    def _announce(self) -> None:
        """At time 0 every instance is registered, then the executors join (with their
        preloaded copies, if ``config.preload``)."""
        profile = self.config.profile
        for instance in range(self.workload.instances):
            self._feed(ModelRegistered(model_spec(profile, instance, self.config.slo_ns)), 0)
        resident = self._preload() if self.config.preload else {}
        for executor_id in self.executors:
            loaded = tuple(resident.get(executor_id, ()))
            joined = ExecutorJoined(
                executor_id, EXECUTOR_KIND, profile.pages_total, profile.page_bytes, loaded
            )
            self._feed(joined, 0)

    def _preload(self) -> dict[str, list[str]]:
        """Put instance i on executor ``i mod N`` while it has pages; return who holds what."""
        resident: dict[str, list[str]] = {}
        executors = list(self.executors.values())
        for instance in range(self.workload.instances):
            executor = executors[instance % len(executors)]
            name = self._names[instance]
            if executor.preload(name):
                resident.setdefault(executor.executor_id, []).append(name)
                self._resident[instance] += 1
                self.stats.on_resident_change(0, 1)
        return resident

    def _drain(self, end_ns: int) -> None:
        """Run heap events while requests are outstanding or still to be sent, until no
        request has been answered for ``drain_limit_ns`` past the last arrival or reply."""
        heap, quiet_ns = self._heap, self.config.drain_limit_ns
        while heap and (self._pending.outstanding or self._scheduled_arrivals):
            if heap[0][0] > max(end_ns, self._last_reply_ns) + quiet_ns:
                break
            self._step(_heappop(heap))

    def _finish(self, wall_start: float) -> None:
        stats = self.stats
        stats.simulated_ns = self.now_ns
        stats.wall_s = time.perf_counter() - wall_start
        stats.lost = self._pending.outstanding
        stats.lost_examples = self._pending.ids()[:10]
        if self._progress is not None:
            self._print_progress(time.perf_counter(), wall_start)

    def _step(self, event: tuple[int, int, int, object, object]) -> None:
        now_ns, _seq, kind, first, second = event  # not ``_``: compiled, it would box the int
        self.now_ns = now_ns
        # The casts check the type and let the compiled engine call the method directly.
        if kind <= 1:
            cast(SimExecutor, first).on_event(kind, cast(SimLane, second), now_ns)
        elif kind == EV_RESULT:
            self._feed(cast(ActionFinished, first), now_ns)
        elif kind == EV_DELIVER:
            cast(SimExecutor, first).deliver(
                cast(StartInfer | StartLoad | StartUnload, second), now_ns
            )
        elif kind == EV_TICK:
            if cast(int, first) == self._wake_generation:
                self._feed(_TICK, now_ns)
        else:
            self._scheduled_arrivals -= 1
            self._arrive(now_ns, first)  # type: ignore[arg-type]
        self._count_event()

    def _flush_results(self) -> None:
        """Feed the results held in ``_ready`` where the heap would have: each after the heap
        events due before it (earlier, or at its instant with a smaller seq), including those
        pushed while feeding, and before the rest. Results added meanwhile join the queue (their
        seqs are larger)."""
        ready, heap = self._ready, self._heap
        index = 0
        while index < len(ready):
            seq, finished = ready[index]
            index += 1
            now_ns = finished.end_ns  # the heap's time for it (no delay)
            while heap:
                head_ns = heap[0][0]
                if head_ns > now_ns or (head_ns == now_ns and heap[0][1] > seq):
                    break
                self._step(_heappop(heap))
            self._feed(finished, now_ns)
            self._count_event()
        ready.clear()

    def _count_event(self) -> None:
        stats = self.stats
        stats.events += 1
        if self._progress is not None and stats.events & 0x3FF == 0:
            wall_now = time.perf_counter()
            if wall_now - self._last_progress >= self.config.progress_s:
                self._print_progress(wall_now, self._wall_start)

    def _print_progress(self, wall_now: float, wall_start: float) -> None:
        self._last_progress = wall_now
        stats, elapsed_s = self.stats, max(wall_now - wall_start, 1e-9)
        simulated_s = self.now_ns / NS_PER_S
        print(
            f"sim: t={simulated_s:,.1f} s  requests={stats.requests:,}  "
            f"ok={stats.outcomes['ok']:,}  pending={self._pending.outstanding:,}  "
            f"{stats.requests / elapsed_s:,.0f} req/s  {simulated_s / elapsed_s:,.2f}x real time",
            file=self._progress,
            flush=True,
        )

    def schedule_event(self, time_ns: int, kind: int, first: object, second: object) -> None:
        self._last_seq += 1
        _heappush(self._heap, (time_ns, self._last_seq, kind, first, second))

    # --- the controller side ------------------------------------------------------------

    def _feed(self, event: Event, now_ns: int) -> None:
        self.now_ns = now_ns
        core = self._core
        if core is not None:
            commands = core.handle(event, now_ns)
        else:
            commands = list(self.controller.handle(event, now_ns))
        for command in commands:
            # Most common first; isinstance lets the compiled engine call each directly.
            if isinstance(command, Reply):
                self._on_reply(command, now_ns)
            elif isinstance(command, (StartInfer, StartLoad, StartUnload)):
                self._send_action(command, now_ns)
            elif isinstance(command, WakeAt):
                self._on_wake_at(command, now_ns)
            else:
                raise TypeError(f"the simulator cannot perform {command!r}")

    def _arrive(self, now_ns: int, instance: int) -> None:
        self.now_ns = now_ns
        request_id = self._next_request_id
        self._next_request_id += 1
        slo_ns = self.config.slo_ns if self._slos_ns is None else self._slos_ns[request_id]
        deadline_ns = now_ns + slo_ns
        cold = self._resident[instance] == 0
        self._pending.add((instance, now_ns, deadline_ns, cold))  # at request_id
        self.stats.on_arrival(now_ns, cold)
        self._feed(RequestArrived(request_id, self._names[instance], deadline_ns), now_ns)
        self._count_event()

    def _send_action(self, command: StartLoad | StartInfer | StartUnload, now_ns: int) -> None:
        executor = self.executors.get(command.executor_id)
        if executor is None:
            self.stats.violations["action_for_unknown_executor"] += 1
            return
        if self._action_log is not None:
            self._actions[command.action_id] = (now_ns, command)
        delay_ns = self.config.message_delay_ns
        if delay_ns:
            self.schedule_event(now_ns + delay_ns, EV_DELIVER, executor, command)
        else:
            executor.deliver(command, now_ns)

    def _on_wake_at(self, command: WakeAt, now_ns: int) -> None:
        self._wake_generation += 1
        self.schedule_event(max(command.time_ns, now_ns), EV_TICK, self._wake_generation, None)

    def _on_reply(self, reply: Reply, now_ns: int) -> None:
        entry = self._pending.take(reply.request_id)
        if entry is None:
            known = 0 <= reply.request_id < self._next_request_id
            self.stats.violations["second_reply" if known else "reply_to_unknown_request"] += 1
            return
        instance, arrival_ns, deadline_ns, cold = entry
        self._last_reply_ns = now_ns
        outcome = reply.outcome
        ok = outcome == _OK
        if ok and now_ns > deadline_ns:
            self.stats.violations["ok_after_deadline"] += 1
        self.stats.on_reply(outcome, now_ns, arrival_ns)
        if self._request_log is not None:
            self._request_log.write(
                reply.request_id,
                self._names[instance],
                arrival_ns,
                deadline_ns,
                now_ns,
                str(outcome),
                now_ns - arrival_ns,
                reply.executor_id,
                reply.action_id,
                cold,
            )
        if self._open_loop:
            return  # no client waits for this reply to send again
        next_ns = self.workload.after_reply(instance, now_ns, ok)
        if next_ns is not None:
            self._scheduled_arrivals += 1
            self.schedule_event(next_ns, EV_ARRIVAL, instance, None)

    # --- the executor side --------------------------------------------------------------

    def on_action_result(
        self,
        executor: SimExecutor,
        command: StartLoad | StartInfer | StartUnload,
        finished: ActionFinished,
    ) -> None:
        """An executor finished (or refused) an action: count it, send the result back."""
        now_ns = finished.end_ns
        if finished.code:
            self.stats.action_errors[finished.code] += 1
        elif isinstance(command, StartInfer):
            self.stats.on_infer(now_ns, command.batch_size, len(command.request_ids))
        else:
            self._on_residency(executor, command, now_ns)
        if self._action_log is not None:
            self._log_action(command, finished)
        if self._direct_results:
            self._last_seq += 1
            self._ready.append((self._last_seq, finished))
        else:
            self.schedule_event(now_ns + self.config.message_delay_ns, EV_RESULT, finished, None)

    def _on_residency(
        self, executor: SimExecutor, command: StartLoad | StartUnload, now_ns: int
    ) -> None:
        instance = self._instance_of.get(command.model)
        delta = 1 if isinstance(command, StartLoad) else -1
        if delta < 0:
            self.stats.evictions += 1
            if executor.running_model(LaneIndex.EXECUTE) == command.model:
                self.stats.violations["unload_under_running_infer"] += 1
        else:
            self.stats.loads += 1
        if instance is not None:
            self._resident[instance] += delta
        self.stats.on_resident_change(now_ns, delta)

    def _log_action(
        self, command: StartLoad | StartInfer | StartUnload, finished: ActionFinished
    ) -> None:
        assert self._action_log is not None
        issued_ns, _ = self._actions.pop(command.action_id, (-1, command))
        batch: tuple[int | None, int | None] = (None, None)
        window: tuple[int | None, int | None] = (None, None)
        if isinstance(command, StartInfer):
            batch = (command.batch_size, len(command.request_ids))
        if not isinstance(command, StartUnload):
            window = (command.earliest_ns, command.latest_ns)
        self._action_log.write(
            command.action_id,
            finished.executor_id,
            type(command).__name__,
            command.model,
            *batch,
            issued_ns,
            *window,
            finished.start_ns,
            finished.end_ns,
            finished.code,
        )


def unanswered_message(stats: SimStats) -> str | None:
    """A sentence about lost requests, or None when every request was answered."""
    if not stats.lost:
        return None
    return f"{stats.lost} request(s) never answered (a core bug), e.g. ids {stats.lost_examples}"
