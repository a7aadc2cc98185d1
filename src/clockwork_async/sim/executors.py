"""Simulated executors: the real executor's lane rules, driven on the virtual clock.

The rules are `clockwork_async.executors.lane_rules`, the very module the real executor's lanes
and host run, so virtual time follows them by construction. Each executor has a load lane and an
execute lane, each a `LaneQueue`. Invariants:
- Lanes: LOAD in the load lane; INFER and UNLOAD in the execute lane (`LANE_OF`). An UNLOAD's
  window is `UNTIMED`: it goes ahead of the INFERs waiting there and starts when the running
  action ends. A lane runs one action at a time, in `LaneQueue` order (smallest
  ``earliest_ns``, ties by arrival, none before its ``earliest_ns``); a lane free after its
  head's ``latest_ns`` rejects that head ``too_late`` without running it.
- On delivery (the real host's checks on arrival): an empty window, a batch size the profile
  lacks or more requests than the batch size -> ``bad_input``. An UNLOAD of a loaded model is
  pending from delivery until it runs.
- At start: LOAD per `load_verdict`: ``already_loaded`` for a model loading or loaded; pages
  are taken when it starts loading; short of pages while UNLOADs are pending it holds the load
  lane and asks again whenever an UNLOAD ends (for at most ``UNLOAD_WAIT_NS``), else
  ``no_pages``. INFER of a model not loaded (or still loading) -> ``not_loaded``. UNLOAD of a
  model not loaded -> ``not_loaded``, else it frees the pages; it takes no time.
- Durations come from the profile (seeded noise optional), stretched by the executor's
  `ContentionClock` when the run models a shared CPU (sim/contention.py). As on a real
  executor, a LOAD's ``start_ns`` is when its lane started it and its ``duration_ns`` the
  loading alone.
- Every delivered action gets exactly one result, through its host's ``on_action_result``.
"""

from __future__ import annotations

import random
from enum import IntEnum

from clockwork_async.build import mypyc_attr
from clockwork_async.core.events import ActionFinished, StartInfer, StartLoad, StartUnload
from clockwork_async.lane_rules import (
    EXECUTE_LANE,
    LANE_OF,
    LOAD_LANE,
    UNLOAD_WAIT_NS,
    UNTIMED,
    ActionKind,
    LaneQueue,
    LoadVerdict,
    RejectJob,
    RunJob,
    load_verdict,
)
from clockwork_async.wire.messages import ErrorCode

from .contention import ContentionClock
from .profiles import SimProfile

Command = StartLoad | StartInfer | StartUnload

EV_LANE_DUE = 0  # a lane's head may be due, or a LOAD's wait for pages is over: look again
EV_LANE_DONE = 1  # the running action of a lane ends


class LaneIndex(IntEnum):
    LOAD = 0
    EXECUTE = 1


class ModelState(IntEnum):
    LOADING = 0
    LOADED = 1


_LOADING = ModelState.LOADING  # module constants: enum attribute lookups are slow in hot paths
_LOADED = ModelState.LOADED
_START = LoadVerdict.START
_WAIT = LoadVerdict.WAIT
_REFUSAL = {
    LoadVerdict.ALREADY_LOADED: ErrorCode.ALREADY_LOADED,
    LoadVerdict.NO_PAGES: ErrorCode.NO_PAGES,
}
_INDEX_OF_LANE = {LOAD_LANE: LaneIndex.LOAD, EXECUTE_LANE: LaneIndex.EXECUTE}
_LOAD_LANE = _INDEX_OF_LANE[LANE_OF[ActionKind.LOAD]]  # each action's lane, from the rules
_INFER_LANE = _INDEX_OF_LANE[LANE_OF[ActionKind.INFER]]
_UNLOAD_LANE = _INDEX_OF_LANE[LANE_OF[ActionKind.UNLOAD]]
_UNTIMED_EARLIEST_NS, _UNTIMED_LATEST_NS = UNTIMED


class SimLane:
    """Queued actions (`LaneQueue`); the running one; a LOAD holding the lane while it waits
    for pages; the wake-up asked for."""

    __slots__ = ("begun_ns", "blocked", "index", "queue", "running", "start_ns", "wake_ns")

    def __init__(self, index: LaneIndex) -> None:
        self.index = index
        self.queue: LaneQueue[Command] = LaneQueue()
        # The running action, when its lane started it and when it began (a LOAD may wait for
        # pages in between). Fields, not a tuple: compiled, a tuple boxes both ints.
        self.running: StartLoad | StartInfer | None = None
        self.start_ns = 0
        self.begun_ns = 0
        self.blocked: tuple[StartLoad, int] | None = None  # (LOAD, start_ns): waits for pages
        self.wake_ns = -1  # a pending EV_LANE_DUE time, or -1


@mypyc_attr(allow_interpreted_subclasses=True)  # tests/sim/test_executors.py's harness
class ExecutorHost:
    """What a SimExecutor asks of the engine that runs it (sim/engine.py).

    A base class the engine extends, not two callables: compiled with mypyc, a call is a
    direct native call with unboxed ints instead of a generic call through a bound method."""

    def schedule_event(self, time_ns: int, kind: int, first: object, second: object) -> None:
        """Hand ``kind``, ``first`` and ``second`` back at virtual ``time_ns``; an executor
        schedules as ``(time_ns, kind, itself, lane)`` and is called ``on_event(kind, lane,
        time_ns)`` then."""
        raise NotImplementedError

    def on_action_result(
        self, executor: SimExecutor, command: Command, finished: ActionFinished
    ) -> None:
        """Take the one result of an action ``executor`` was delivered."""
        raise NotImplementedError


class SimExecutor:
    """One simulated device: pages, resident models and two lanes."""

    def __init__(
        self,
        executor_id: str,
        profile: SimProfile,
        host: ExecutorHost,
        noise: float = 0.0,
        rng: random.Random | None = None,
        contention: ContentionClock | None = None,
    ) -> None:
        self.executor_id = executor_id
        self.profile = profile
        self.pages_free = profile.pages_total
        self.models: dict[str, ModelState] = {}
        self.lanes = (SimLane(LaneIndex.LOAD), SimLane(LaneIndex.EXECUTE))
        self._unloading: set[str] = set()  # loaded models whose UNLOAD is pending
        self._host = host
        self._noise = noise
        self._rng = rng or random.Random(0)
        self._contention = contention

    def deliver(self, command: Command, now_ns: int) -> None:
        """An action arrives from the controller at ``now_ns``: checked as the real host
        checks on arrival, then queued in its lane."""
        if isinstance(command, StartInfer):
            earliest_ns, latest_ns, batch_size = (
                command.earliest_ns,
                command.latest_ns,
                command.batch_size,
            )
            if (
                earliest_ns > latest_ns
                or batch_size not in self.profile.execute_ns
                or len(command.request_ids) > batch_size
            ):
                self._fail(command, ErrorCode.BAD_INPUT, now_ns)
                return
            lane = self.lanes[_INFER_LANE]
        elif isinstance(command, StartLoad):
            earliest_ns, latest_ns = command.earliest_ns, command.latest_ns
            if earliest_ns > latest_ns:
                self._fail(command, ErrorCode.BAD_INPUT, now_ns)
                return
            lane = self.lanes[_LOAD_LANE]
        else:
            earliest_ns, latest_ns = _UNTIMED_EARLIEST_NS, _UNTIMED_LATEST_NS
            if self.models.get(command.model) is _LOADED:
                self._unloading.add(command.model)
            lane = self.lanes[_UNLOAD_LANE]
        lane.queue.push(command, earliest_ns, latest_ns)
        self.poke(lane, now_ns)

    def preload(self, model: str) -> bool:
        """Make ``model`` resident before the run starts; False when pages are short."""
        pages = self.profile.weights_pages
        if model in self.models or self.pages_free < pages:
            return False
        self.pages_free -= pages
        self.models[model] = _LOADED
        return True

    def on_event(self, kind: int, lane: SimLane, now_ns: int) -> None:
        """Handle an engine event scheduled by this executor."""
        if kind == EV_LANE_DONE:
            self._finish(lane, now_ns)
        elif lane.wake_ns == now_ns:
            lane.wake_ns = -1
        self.poke(lane, now_ns)

    def poke(self, lane: SimLane, now_ns: int) -> None:
        """Start, reject or wait for the lane's head, if the lane is free (a LOAD waiting for
        pages asks again first)."""
        if lane.blocked is not None:
            command, start_ns = lane.blocked
            self._start_load(lane, command, start_ns, now_ns)
        queue = lane.queue
        while lane.running is None and lane.blocked is None:
            step = queue.next_step(now_ns)
            if step is None:
                return
            if isinstance(step, RunJob):
                self._start(lane, step.job, now_ns)
            elif isinstance(step, RejectJob):
                self._fail(step.job, ErrorCode.TOO_LATE, now_ns)
            else:
                wake_ns = step.time_ns
                if lane.wake_ns < now_ns or wake_ns < lane.wake_ns:
                    lane.wake_ns = wake_ns
                    self._host.schedule_event(wake_ns, EV_LANE_DUE, self, lane)
                return

    def _start(self, lane: SimLane, command: Command, now_ns: int) -> None:
        if isinstance(command, StartInfer):
            if self.models.get(command.model) is not _LOADED:
                self._fail(command, ErrorCode.NOT_LOADED, now_ns)
                return
            lane.running = command
            lane.start_ns = lane.begun_ns = now_ns
            duration_ns = self._duration(self.profile.execute_ns[command.batch_size], now_ns)
            self._host.schedule_event(now_ns + duration_ns, EV_LANE_DONE, self, lane)
        elif isinstance(command, StartLoad):
            self._start_load(lane, command, now_ns, now_ns)
        else:
            self._unload(command, now_ns)

    def _start_load(self, lane: SimLane, command: StartLoad, start_ns: int, now_ns: int) -> None:
        """Follow `load_verdict` for a LOAD that its lane started at ``start_ns``."""
        verdict = load_verdict(
            registered=command.model not in self.models,
            pages_fit=self.pages_free >= self.profile.weights_pages,
            unloads_pending=bool(self._unloading),
            waited_ns=now_ns - start_ns,
        )
        if verdict is _START:
            self._begin_load(lane, command, start_ns, now_ns)
        elif verdict is _WAIT:
            if lane.blocked is None:  # look again when the longest wait is over
                self._host.schedule_event(start_ns + UNLOAD_WAIT_NS, EV_LANE_DUE, self, lane)
            lane.blocked = (command, start_ns)
        else:
            lane.blocked = None
            self._fail(command, _REFUSAL[verdict], now_ns)

    def _begin_load(self, lane: SimLane, command: StartLoad, start_ns: int, now_ns: int) -> None:
        """Take the pages and load from ``now_ns``; the lane started it at ``start_ns``."""
        self.pages_free -= self.profile.weights_pages
        self.models[command.model] = _LOADING
        lane.blocked = None
        lane.running = command
        lane.start_ns = start_ns
        lane.begun_ns = now_ns
        self._host.schedule_event(
            now_ns + self._duration(self.profile.load_ns, now_ns), EV_LANE_DONE, self, lane
        )

    def _duration(self, base_ns: int, now_ns: int) -> int:
        """The profile's duration, with seeded noise: base * max(0.5, 1 + noise * N(0, 1)),
        then stretched by contention for an action starting at ``now_ns``."""
        if self._noise:
            base_ns = round(base_ns * max(0.5, 1.0 + self._noise * self._rng.gauss(0.0, 1.0)))
        if self._contention is not None:
            return self._contention.stretch(now_ns, base_ns)
        return base_ns

    def _finish(self, lane: SimLane, now_ns: int) -> None:
        command = lane.running
        assert command is not None, "a lane finished with nothing running"
        start_ns = lane.start_ns
        begun_ns = lane.begun_ns
        lane.running = None
        if isinstance(command, StartLoad):
            self.models[command.model] = _LOADED
        finished = ActionFinished(
            self.executor_id, command.action_id, "", start_ns, now_ns, now_ns - begun_ns
        )
        self._host.on_action_result(self, command, finished)

    def _unload(self, command: StartUnload, now_ns: int) -> None:
        """Run an UNLOAD (it takes no time); a LOAD waiting for pages then asks again."""
        self._unloading.discard(command.model)
        if self.models.get(command.model) is not _LOADED:
            self._fail(command, ErrorCode.NOT_LOADED, now_ns)
        else:
            del self.models[command.model]
            self.pages_free += self.profile.weights_pages
            finished = ActionFinished(self.executor_id, command.action_id, "", now_ns, now_ns)
            self._host.on_action_result(self, command, finished)
        load_lane = self.lanes[LaneIndex.LOAD]
        if load_lane.blocked is not None:
            self.poke(load_lane, now_ns)

    def _fail(self, command: Command, code: ErrorCode, now_ns: int) -> None:
        finished = ActionFinished(self.executor_id, command.action_id, code.value, now_ns, now_ns)
        self._host.on_action_result(self, command, finished)

    def running_model(self, lane: LaneIndex) -> str | None:
        """The model of the action running on ``lane``, if any."""
        running = self.lanes[lane].running
        return None if running is None else running.model
