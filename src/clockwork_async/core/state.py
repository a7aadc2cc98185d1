"""All mutable state of the controller core, and the few helpers that keep it consistent.

Invariants: every accepted request is in ``requests`` until answered, and is answered through
``answer`` exactly once (``RequestState.move`` raises on a second answer); ``queued_total`` and
``running_total`` count QUEUED and RUNNING requests; commands are appended to ``out`` in the
order the runtime must perform them (an UNLOAD before the LOAD that needs its pages).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from .config import ControllerConfig
from .events import Command, Reply
from .ledger import release, unbook
from .models import ModelState, RequestState
from .outcomes import Outcome
from .profiles import KindPredictions, Predictions
from .queues import RequestStatus
from .tracker import Action, ExecutorState

if TYPE_CHECKING:
    from .policies import Policy

COUNTERS = (
    "infers",
    "loads",
    "cold_starts",
    "warm_ups",
    "unloads",
    "evictions",
    "load_failures",
    "infer_errors",
    "too_late",
    "replans",
    "stray_results",
    "stray_cancels",
    "unload_failures",
    "resident_unknown",
)


class CoreState:
    """The controller's whole state; modules of the core operate on it."""

    def __init__(self, config: ControllerConfig, policy: Policy) -> None:
        self.config = config
        self.policy = policy
        self.predictions = Predictions(config.window_size, config.percentile)
        self.models: dict[str, ModelState] = {}
        self.retiring: dict[str, ModelState] = {}  # unregistered, copies not yet unloaded
        self.requests: dict[int, RequestState] = {}
        self.executors: dict[str, ExecutorState] = {}
        self.kinds: dict[str, int] = {}  # executor kind -> executors of that kind
        self.free_load_slots = 0  # sum over executors of max_loads_in_flight - loads out
        self.actions: dict[int, Action] = {}  # outstanding INFER and LOAD actions
        self.unloads: dict[int, tuple[str, str]] = {}  # action id -> (executor, model)
        self.out: list[Command] = []
        self.now_ns = 0
        self.queued_total = 0
        self.running_total = 0
        self.arrivals = 0
        self.rejected = 0  # answered at arrival, never accepted
        self.outcomes: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.exec_timers: list[tuple[int, int, int, ExecutorState]] = []
        self.drop_timers: list[tuple[int, int, bool, RequestState]] = []  # bool: cold check
        self.to_fill: dict[str, ExecutorState] = {}
        self.cold: dict[str, ModelState] = {}  # queued requests, no copy anywhere
        self.wants_copy: dict[str, ModelState] = {}  # copies could not keep up
        self.reserving: dict[str, ExecutorState] = {}  # executors with reserved LOADs
        self.demand: OrderedDict[str, ModelState] = OrderedDict()  # rejected, loaded nowhere
        self.placement_dirty = False
        self.copies_blocked_until_ns = 0  # no executor had room for a copy: wait a little
        self.shutting_down = False
        self.return_hop_ns = 0  # the runtime's way back (ReturnHop): planned ends come earlier
        self.wake_pending_ns: int | None = None
        self._next_action_id = 1
        self._seq = 0

    # --- ids and predictions -------------------------------------------------------------

    def new_action_id(self) -> int:
        action_id = self._next_action_id
        self._next_action_id += 1
        return action_id

    def seq(self) -> int:
        self._seq += 1
        return self._seq

    def predict(self, model: ModelState, executor: ExecutorState) -> KindPredictions:
        """Return the predictions of ``model`` on ``executor``'s kind."""
        return self._kind_predictions(model, executor.kind)

    def best_exec_b1_ns(self, model: ModelState) -> int:
        """Return the fastest predicted batch-1 execute time over the kinds present (or seeds)."""
        b1 = model.spec.batch_sizes[0]
        return min(self._kind_predictions(model, kind).exec_ns[b1] for kind in self._kinds(model))

    def best_load_ns(self, model: ModelState) -> int:
        """Return the fastest predicted LOAD time over the kinds present (or seeds)."""
        return min(self._kind_predictions(model, kind).load_ns for kind in self._kinds(model))

    def _kinds(self, model: ModelState) -> Iterable[str]:
        return self.kinds or model.spec.profiles

    def _kind_predictions(self, model: ModelState, kind: str) -> KindPredictions:
        found = model.by_kind.get(kind)
        if found is None:
            found = model.by_kind[kind] = self.predictions.get(model.spec, kind)
        return found

    # --- answers -------------------------------------------------------------------------

    def reject(self, request_id: int, outcome: Outcome, message: str) -> None:
        """Answer a request that was never accepted."""
        self.rejected += 1
        self.outcomes[outcome] += 1
        self.out.append(Reply(request_id, outcome, message))

    def answer(
        self,
        request: RequestState,
        outcome: Outcome,
        message: str = "",
        action: Action | None = None,
        details: Mapping[str, int] | None = None,
    ) -> None:
        """Answer an accepted request (QUEUED or RUNNING) and forget it."""
        if request.status is RequestStatus.QUEUED:
            model = request.model
            model.queued -= 1
            self.queued_total -= 1
            unbook(request)
            if not model.queued and model.reserved_on is not None:
                release(model)  # nobody waits for its LOAD any more
        elif request.status is RequestStatus.RUNNING:
            self.running_total -= 1
        request.move(RequestStatus.DONE)
        del self.requests[request.request_id]
        self.outcomes[outcome] += 1
        self.out.append(
            Reply(
                request.request_id,
                outcome,
                message,
                action.action_id if action is not None else None,
                action.executor_id if action is not None else None,
                details if details is not None else {},
            )
        )

    # --- queues --------------------------------------------------------------------------

    def enqueue(self, request: RequestState) -> None:
        """Put a QUEUED request into its model's queue, with its drop timers and fills."""
        model = request.model
        self.queued_total += 1
        if model.push(request):
            self.push_heads(model)
        self.fill_hungry_copies(model)
        drop_at_ns = self.policy.drop_at_ns(self, request)
        if drop_at_ns is not None:
            heapq.heappush(self.drop_timers, (drop_at_ns, self.seq(), False, request))
        if not model.has_copy():
            self.mark_cold(model)
            cold_at_ns = self.policy.cold_drop_at_ns(self, request)
            if cold_at_ns is not None:
                heapq.heappush(self.drop_timers, (cold_at_ns, self.seq(), True, request))

    def requeue(self, request: RequestState) -> None:
        """Return a RUNNING request to its queue (its action failed but it may still be met)."""
        request.move(RequestStatus.QUEUED)
        request.action_id = None
        self.running_total -= 1
        self.counters["replans"] += 1
        self.policy.rebook(self, request)
        self.enqueue(request)

    def push_heads(self, model: ModelState) -> None:
        """Tell every executor holding ``model`` about its (new) queue head."""
        head = model.peek()
        if head is None:
            return
        entry_key = head.key_ns
        for executor_id in model.loaded_on:
            executor = self.executors[executor_id]
            heapq.heappush(executor.heap, (entry_key, self.seq(), model.version, model))

    def push_head(self, executor: ExecutorState, model: ModelState) -> None:
        """Tell ``executor`` (holding ``model``) about the model's queue head, if any."""
        head = model.peek()
        if head is not None:
            entry = (head.key_ns, self.seq(), model.version, model)
            heapq.heappush(executor.heap, entry)

    def fill_hungry_copies(self, model: ModelState) -> None:
        """Queue a fill for every loaded copy whose execute lane wants more work now; make
        sure the others have a timer for when theirs will."""
        ahead_ns = self.config.schedule_ahead_ns
        horizon_ns = self.now_ns + ahead_ns
        for executor_id in model.loaded_on:
            executor = self.executors[executor_id]
            free_ns = executor.exec_lane.free_at(self.now_ns)
            if free_ns <= horizon_ns:
                self.to_fill[executor_id] = executor
            elif executor.timer_at_ns < 0 or executor.timer_at_ns > free_ns - ahead_ns:
                self.arm_timer(executor, free_ns - ahead_ns)

    def mark_cold(self, model: ModelState) -> None:
        """Ask placement for a first copy of ``model`` if it has queued requests and none."""
        if model.name in self.cold or model.reserved_on is not None:
            return
        if model.queued and not model.has_copy() and not model.retired:
            self.cold[model.name] = model
            self.placement_dirty = True

    def note_pressure(self, model: ModelState) -> None:
        """The copies of ``model`` cannot keep up: ask placement for another copy."""
        if self.now_ns < self.copies_blocked_until_ns:
            return
        if not model.retired and model.name not in self.wants_copy:
            self.wants_copy[model.name] = model
            self.placement_dirty = True

    def arm_timer(self, executor: ExecutorState, at_ns: int) -> None:
        """Ask for a fill of ``executor`` at ``at_ns`` (replaces its previous timer)."""
        if executor.timer_at_ns == at_ns:
            return
        executor.timer_version += 1
        executor.timer_at_ns = at_ns
        entry = (at_ns, self.seq(), executor.timer_version, executor)
        heapq.heappush(self.exec_timers, entry)
