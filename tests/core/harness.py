"""Helpers for driving the controller core by hand (exact schedules) or with tiny simulated
executors that run each action for a given duration (soak tests, micro-benchmark)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

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

MS = 1_000_000
US = 1_000
KIND = "gpu"
SIZES = (1, 2, 4, 8, 16)
RESNET = ModelProfile(
    execute_ns={1: 2_730_000, 2: 4_050_000, 4: 5_880_000, 8: 9_930_000, 16: 17_330_000},
    load_ns=8_300_000,
)

C = TypeVar("C")


def make_spec(name: str, pages: int = 7, profile: ModelProfile = RESNET) -> ModelSpec:
    return ModelSpec(name, SIZES, pages, {KIND: profile})


def only(commands: Iterable[Command], kind: type[C]) -> list[C]:
    return [c for c in commands if isinstance(c, kind)]


class Harness:
    """A controller driven by hand on a virtual clock that only moves forward."""

    def __init__(self, **config: object) -> None:
        self.ctl = Controller(ControllerConfig(**config))  # type: ignore[arg-type]
        self.now_ns = 0
        self.replies: dict[int, list[Reply]] = {}
        self.wake_ns: int | None = None

    def at(self, time_ns: int, event: Event) -> list[Command]:
        assert time_ns >= self.now_ns
        self.now_ns = time_ns
        commands = self.ctl.handle(event, time_ns)
        for reply in only(commands, Reply):
            self.replies.setdefault(reply.request_id, []).append(reply)
        for wake in only(commands, WakeAt):
            self.wake_ns = wake.time_ns
        return commands

    def tick(self, time_ns: int) -> list[Command]:
        return self.at(time_ns, Tick())

    def ticks_until(self, time_ns: int) -> list[Command]:
        """Deliver each asked-for Tick up to ``time_ns`` (as a timer would); return all."""
        out: list[Command] = []
        while self.wake_ns is not None and self.wake_ns <= time_ns:
            wake_ns, self.wake_ns = self.wake_ns, None
            out += self.tick(max(wake_ns, self.now_ns))
        if time_ns > self.now_ns:
            out += self.tick(time_ns)
        return out

    def join(self, executor_id: str, pages: int = 1376, loaded: Sequence[str] = ()) -> None:
        self.at(self.now_ns, ExecutorJoined(executor_id, KIND, pages, 16 << 20, tuple(loaded)))

    def register(self, *names: str, pages: int = 7) -> None:
        for name in names:
            self.at(self.now_ns, ModelRegistered(make_spec(name, pages)))

    def request(
        self, request_id: int, model: str, slo_ns: int, at_ns: int | None = None
    ) -> list[Command]:
        time_ns = self.now_ns if at_ns is None else at_ns
        return self.at(time_ns, RequestArrived(request_id, model, time_ns + slo_ns))

    def finish(
        self,
        action: StartInfer | StartLoad,
        end_ns: int | None = None,
        code: str = "",
        at_ns: int | None = None,
    ) -> list[Command]:
        """Report ``action`` done: ran from its planned start for its prediction unless told."""
        if isinstance(action, StartInfer):
            predicted_ns, planned_ns = action.predicted_ns, action.planned_start_ns
        else:
            predicted_ns, planned_ns = RESNET.load_ns, action.earliest_ns
        start_ns = 0 if code else planned_ns
        end = 0 if code else (planned_ns + predicted_ns if end_ns is None else end_ns)
        duration_ns = end - start_ns if not code else 0
        when_ns = max(self.now_ns, end) if at_ns is None else at_ns
        event = ActionFinished(
            action.executor_id, action.action_id, code, start_ns, end, duration_ns
        )
        return self.at(when_ns, event)

    def outcome(self, request_id: int) -> Outcome:
        (reply,) = self.replies[request_id]
        return reply.outcome


@dataclass(order=True)
class _Pending:
    time_ns: int
    seq: int
    event: Event = field(compare=False)


class MiniSim:
    """Simulated executors: each lane runs one action at a time from its earliest; an action
    that cannot start by its latest is refused ``too_late``; UNLOAD answers at once."""

    def __init__(
        self,
        ctl: Controller,
        duration_ns: Callable[[StartInfer | StartLoad, int], int] | None = None,
        delay_ns: int = 0,
    ) -> None:
        self.ctl = ctl
        self.now_ns = 0
        self._queue: list[_Pending] = []
        self._seq = 0
        self._lane_free: dict[tuple[str, str], int] = {}
        self._duration = duration_ns or _predicted
        self._delay_ns = delay_ns
        self._wake: tuple[int, int] | None = None
        self.replies: list[Reply] = []
        self.replied_at_ns: dict[int, int] = {}  # request id -> when its reply was sent
        self.commands = 0

    def schedule(self, time_ns: int, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._queue, _Pending(time_ns, self._seq, event))

    def run(self, until_ns: int | None = None) -> None:
        while self._queue and (until_ns is None or self._queue[0].time_ns <= until_ns):
            pending = heapq.heappop(self._queue)
            if isinstance(pending.event, Tick) and (
                self._wake is None or pending.seq != self._wake[1]
            ):
                continue
            self.now_ns = max(self.now_ns, pending.time_ns)
            self._perform(self.ctl.handle(pending.event, self.now_ns))

    def _perform(self, commands: list[Command]) -> None:
        self.commands += len(commands)
        for command in commands:
            if isinstance(command, Reply):
                self.replies.append(command)
                self.replied_at_ns[command.request_id] = self.now_ns
            elif isinstance(command, WakeAt):
                self.schedule(command.time_ns, Tick())
                self._wake = (command.time_ns, self._seq)
            elif isinstance(command, StartUnload):
                done = ActionFinished(command.executor_id, command.action_id)
                self.schedule(self.now_ns + self._delay_ns, done)
            else:
                self._run_action(command)

    def _run_action(self, action: StartInfer | StartLoad) -> None:
        lane = (action.executor_id, "execute" if isinstance(action, StartInfer) else "load")
        arrive_ns = self.now_ns + self._delay_ns
        start_ns = max(action.earliest_ns, self._lane_free.get(lane, 0), arrive_ns)
        if start_ns > action.latest_ns:
            refused = ActionFinished(action.executor_id, action.action_id, "too_late")
            self.schedule(start_ns + self._delay_ns, refused)
            return
        duration_ns = self._duration(action, start_ns)
        end_ns = start_ns + duration_ns
        self._lane_free[lane] = end_ns
        done = ActionFinished(
            action.executor_id, action.action_id, "", start_ns, end_ns, duration_ns
        )
        self.schedule(end_ns + self._delay_ns, done)


def _predicted(action: StartInfer | StartLoad, start_ns: int) -> int:
    return action.predicted_ns if isinstance(action, StartInfer) else RESNET.load_ns
