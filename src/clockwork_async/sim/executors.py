"""Simulated executors: the real executor's action rules, in virtual time.

Each executor has a load lane and an execute lane. Invariants (the same as ``executors/lanes.py``
and the executor host):
- A lane runs at most one action at a time. Among queued actions the one with the smallest
  ``earliest_ns`` goes next, ties in order of arrival; none starts before its ``earliest_ns``.
- When a lane is free at ``now`` and its head's ``latest_ns`` has passed, the head is rejected
  ``too_late`` without running.
- At start: LOAD of a model loaded or loading -> ``already_loaded``; without enough free pages
  -> ``no_pages`` (pages are taken when a LOAD starts and freed by UNLOAD); INFER of a model not
  loaded (or still loading) -> ``not_loaded``; a batch size the profile lacks, or more requests
  than the batch size -> ``bad_input``. UNLOAD runs at once on delivery (no lane).
- Every delivered action gets exactly one result, through ``report``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from enum import IntEnum

from clockwork_async.core.events import ActionFinished, StartInfer, StartLoad, StartUnload
from clockwork_async.wire.messages import ErrorCode

from .profiles import SimProfile

LaneCommand = StartLoad | StartInfer
Schedule = Callable[[int, int, object, object], None]  # (time_ns, kind, executor, lane)
Report = Callable[["SimExecutor", StartLoad | StartInfer | StartUnload, ActionFinished], None]

EV_LANE_DUE = 0  # a lane's head may be due: look again
EV_LANE_DONE = 1  # the running action of a lane ends


class LaneIndex(IntEnum):
    LOAD = 0
    EXECUTE = 1


class ModelState(IntEnum):
    LOADING = 0
    LOADED = 1


_LOADING = ModelState.LOADING  # module constants: enum attribute lookups are slow in hot paths
_LOADED = ModelState.LOADED


class SimLane:
    """Queued actions by (earliest_ns, arrival); the running one; the wake-up asked for."""

    __slots__ = ("index", "queue", "running", "seq", "wake_ns")

    def __init__(self, index: LaneIndex) -> None:
        self.index = index
        self.queue: list[tuple[int, int, LaneCommand]] = []
        self.running: tuple[LaneCommand, int] | None = None  # (action, start_ns)
        self.seq = 0
        self.wake_ns = -1  # a pending EV_LANE_DUE time, or -1

    def push(self, command: LaneCommand) -> None:
        heapq.heappush(self.queue, (command.earliest_ns, self.seq, command))
        self.seq += 1


class SimExecutor:
    """One simulated device: pages, resident models and two lanes."""

    def __init__(
        self,
        executor_id: str,
        profile: SimProfile,
        schedule: Schedule,
        report: Report,
        noise: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.executor_id = executor_id
        self.profile = profile
        self.pages_free = profile.pages_total
        self.models: dict[str, ModelState] = {}
        self.lanes = (SimLane(LaneIndex.LOAD), SimLane(LaneIndex.EXECUTE))
        self._schedule = schedule
        self._report = report
        self._noise = noise
        self._rng = rng or random.Random(0)

    def deliver(self, command: StartLoad | StartInfer | StartUnload, now_ns: int) -> None:
        """An action arrives from the controller at ``now_ns``."""
        if isinstance(command, StartUnload):
            self._unload(command, now_ns)
            return
        lane = self.lanes[LaneIndex.LOAD if isinstance(command, StartLoad) else LaneIndex.EXECUTE]
        lane.push(command)
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
        """Start, reject or wait for the lane's head, if the lane is free."""
        queue = lane.queue
        while lane.running is None and queue:
            earliest_ns, _, command = queue[0]
            if now_ns > command.latest_ns:
                heapq.heappop(queue)
                self._fail(command, ErrorCode.TOO_LATE, now_ns)
            elif now_ns >= earliest_ns:
                heapq.heappop(queue)
                self._start(lane, command, now_ns)
            else:
                if lane.wake_ns < now_ns or earliest_ns < lane.wake_ns:
                    lane.wake_ns = earliest_ns
                    self._schedule(earliest_ns, EV_LANE_DUE, self, lane)
                return

    def _start(self, lane: SimLane, command: LaneCommand, now_ns: int) -> None:
        if isinstance(command, StartLoad):
            code, base_ns = self._check_load(command), self.profile.load_ns
        else:
            code, base_ns = self._check_infer(command)
        if code is not None:
            self._fail(command, code, now_ns)
            return
        if isinstance(command, StartLoad):
            self.pages_free -= self.profile.weights_pages
            self.models[command.model] = _LOADING
        lane.running = (command, now_ns)
        self._schedule(now_ns + self._duration(base_ns), EV_LANE_DONE, self, lane)

    def _check_load(self, command: StartLoad) -> ErrorCode | None:
        if command.model in self.models:
            return ErrorCode.ALREADY_LOADED
        if self.pages_free < self.profile.weights_pages:
            return ErrorCode.NO_PAGES
        return None

    def _check_infer(self, command: StartInfer) -> tuple[ErrorCode | None, int]:
        if self.models.get(command.model) is not _LOADED:
            return ErrorCode.NOT_LOADED, 0
        base_ns = self.profile.execute_ns.get(command.batch_size)
        if base_ns is None or len(command.request_ids) > command.batch_size:
            return ErrorCode.BAD_INPUT, 0
        return None, base_ns

    def _duration(self, base_ns: int) -> int:
        """The profile's duration, with seeded noise: base * max(0.5, 1 + noise * N(0, 1))."""
        if not self._noise:
            return base_ns
        return round(base_ns * max(0.5, 1.0 + self._noise * self._rng.gauss(0.0, 1.0)))

    def _finish(self, lane: SimLane, now_ns: int) -> None:
        assert lane.running is not None, "a lane finished with nothing running"
        command, start_ns = lane.running
        lane.running = None
        if isinstance(command, StartLoad):
            self.models[command.model] = _LOADED
        finished = ActionFinished(
            self.executor_id, command.action_id, "", start_ns, now_ns, now_ns - start_ns
        )
        self._report(self, command, finished)

    def _unload(self, command: StartUnload, now_ns: int) -> None:
        if self.models.get(command.model) is not _LOADED:
            self._fail(command, ErrorCode.NOT_LOADED, now_ns)
            return
        del self.models[command.model]
        self.pages_free += self.profile.weights_pages
        self._report(
            self, command, ActionFinished(self.executor_id, command.action_id, "", now_ns, now_ns)
        )

    def _fail(
        self, command: StartLoad | StartInfer | StartUnload, code: ErrorCode, now_ns: int
    ) -> None:
        finished = ActionFinished(self.executor_id, command.action_id, code.value, now_ns, now_ns)
        self._report(self, command, finished)

    def running_model(self, lane: LaneIndex) -> str | None:
        """The model of the action running on ``lane``, if any."""
        running = self.lanes[lane].running
        return None if running is None else running[0].model
