"""A tiny stand-in controller for testing the engine on its own (never used by the product).

It loads each model on the first executor when a request for it arrives, then runs its queue
one request at a time (batch 1), dispatching on a Tick a little after the work appears, so the
engine's WakeAt/Tick path is exercised. Misbehaviours for the engine's checks: ``forget`` (never
answer these request ids), ``double_reply`` (answer twice).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    ExecutorJoined,
    ModelRegistered,
    ModelSpec,
    Reply,
    RequestArrived,
    StartInfer,
    StartLoad,
    Tick,
    WakeAt,
)
from clockwork_async.core.outcomes import Outcome

DISPATCH_DELAY_NS = 100_000


class StandInController:
    def __init__(self, *, forget: frozenset[int] = frozenset(), double_reply: bool = False):
        self.forget = forget
        self.double_reply = double_reply
        self.executor: str | None = None
        self.specs: dict[str, ModelSpec] = {}
        self.state: dict[str, str] = {}  # model -> "loading" | "loaded"
        self.queue: deque[tuple[int, str, int]] = deque()  # (request, model, deadline)
        self.busy = False
        self.infers: dict[int, tuple[int, int]] = {}  # action -> (request, deadline)
        self.loads: dict[int, str] = {}  # action -> model
        self.next_action = 0
        self.events: list[tuple[int, Event]] = []

    def handle(self, event: Event, now_ns: int) -> Sequence[Command]:
        self.events.append((now_ns, event))
        if isinstance(event, ExecutorJoined):
            self.executor = self.executor or event.executor_id
            return []
        if isinstance(event, ModelRegistered):
            self.specs[event.spec.name] = event.spec
            return []
        if isinstance(event, RequestArrived):
            return self._arrived(event, now_ns)
        if isinstance(event, ActionFinished):
            return self._finished(event, now_ns)
        if isinstance(event, Tick):
            return self._dispatch(now_ns)
        return []

    def _arrived(self, event: RequestArrived, now_ns: int) -> list[Command]:
        if event.model not in self.specs:
            return [Reply(event.request_id, Outcome.UNKNOWN_MODEL)]
        self.queue.append((event.request_id, event.model, event.deadline_ns))
        commands: list[Command] = []
        if event.model not in self.state and self.executor is not None:
            self.state[event.model] = "loading"
            commands.append(self._action_load(event.model, now_ns))
        commands.append(WakeAt(now_ns + DISPATCH_DELAY_NS))
        return commands

    def _action_load(self, model: str, now_ns: int) -> StartLoad:
        self.next_action += 1
        assert self.executor is not None
        self.loads[self.next_action] = model
        return StartLoad(self.executor, self.next_action, model, now_ns, now_ns + 10**9)

    def _dispatch(self, now_ns: int) -> list[Command]:
        commands: list[Command] = []
        while self.queue and not self.busy:
            request_id, model, deadline_ns = self.queue[0]
            if self.state.get(model) != "loaded":
                return commands
            self.queue.popleft()
            execute_ns = self.specs[model].profiles["simulated"].execute_ns[1]
            if now_ns + execute_ns > deadline_ns:
                commands.append(Reply(request_id, Outcome.DROPPED))
                continue
            self.next_action += 1
            self.infers[self.next_action] = (request_id, deadline_ns)
            assert self.executor is not None
            commands.append(
                StartInfer(
                    self.executor,
                    self.next_action,
                    model,
                    1,
                    (request_id,),
                    now_ns,
                    now_ns + 1_000_000,
                    execute_ns,
                )
            )
            self.busy = True
        return commands

    def _finished(self, event: ActionFinished, now_ns: int) -> list[Command]:
        commands: list[Command] = []
        if event.action_id in self.infers:
            self.busy = False
            request_id, deadline_ns = self.infers.pop(event.action_id)
            outcome = Outcome.OK if now_ns <= deadline_ns else Outcome.LATE
            if event.code:
                outcome = Outcome.FAILED
            if request_id not in self.forget:
                commands.append(Reply(request_id, outcome, action_id=event.action_id))
                if self.double_reply:
                    commands.append(Reply(request_id, outcome))
        elif event.action_id in self.loads:
            self.state[self.loads.pop(event.action_id)] = "loaded"
        return commands + self._dispatch(now_ns)
