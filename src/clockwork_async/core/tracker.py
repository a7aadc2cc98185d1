"""Per-executor tracking: when each lane will be free, pages, copies and outstanding actions.

Invariants: a lane runs one action at a time, in the order the core committed them; its
``end_ns`` is the predicted end of the last committed action, chained from the last measured
end (``base_ns``) through each outstanding action's ``max(earliest, previous end) + predicted``.
An action's ``earliest_ns`` is when it may start, not when it is planned to: an INFER may
start as soon as it is sent (the lane is work-conserving: an action that ends before its
prediction lets the next one start early, on the executor and in this chain).
Results correct the chain; an executor that falls behind (its first outstanding action is past
its predicted end without a result) is resynchronised: that action is assumed to end now.
``pages_used`` counts loaded and loading copies (a LOAD reserves its pages when it is sent; an
UNLOAD returns them when it is sent, as the executor runs it at once, before any later LOAD).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from enum import Enum

from .events import StartInfer
from .models import ModelState, RequestState
from .profiles import SlidingWindow


class ActionKind(Enum):
    INFER = "infer"
    LOAD = "load"
    UNLOAD = "unload"


class Action:
    """An action the core sent and has not seen the result of."""

    __slots__ = (
        "action_id",
        "batch_size",
        "earliest_ns",
        "executor_id",
        "kind",
        "latest_ns",
        "model",
        "pages",
        "planned_end_ns",
        "predicted_ns",
        "requests",
        "warm_up",
    )

    def __init__(
        self,
        action_id: int,
        kind: ActionKind,
        executor_id: str,
        model: ModelState,
        earliest_ns: int = 0,
        predicted_ns: int = 0,
    ) -> None:
        self.action_id = action_id
        self.kind = kind
        self.executor_id = executor_id
        self.model = model
        self.earliest_ns = earliest_ns
        self.latest_ns = earliest_ns
        self.predicted_ns = predicted_ns
        self.planned_end_ns = earliest_ns + predicted_ns
        self.requests: list[RequestState] = []
        self.batch_size = 0
        self.pages = 0
        self.warm_up = False  # an INFER of no request, to warm its lane (warm_up.py)

    def start_infer(self) -> StartInfer:
        """The command that sends this INFER (committed to its lane: ``planned_end_ns`` set)."""
        return StartInfer(
            self.executor_id,
            self.action_id,
            self.model.name,
            self.batch_size,
            tuple(r.request_id for r in self.requests),
            self.earliest_ns,
            self.latest_ns,
            self.predicted_ns,
            self.planned_end_ns - self.predicted_ns,
        )


class Lane:
    """One lane of an executor (execute or load): strictly one action at a time."""

    __slots__ = (
        "base_ns",
        "cold_extra",
        "cold_extra_ns",
        "end_ns",
        "lead_ns",
        "outstanding",
        "resyncs",
        "warm_gap_ns",
    )

    def __init__(self, warm_gap_ns: int = 0, size: int = 1, percentile: float = 100.0) -> None:
        self.outstanding: deque[Action] = deque()
        self.base_ns = 0  # measured end of the last finished action
        self.end_ns = 0  # predicted end of all committed work
        self.lead_ns = 0  # an action sent now starts no earlier than this from now
        self.resyncs = 0
        # Cold starts (warm_gap_ns > 0): an action that follows more than warm_gap_ns of idle
        # time takes longer than its (back-to-back) prediction by about cold_extra_ns.
        self.warm_gap_ns = warm_gap_ns
        self.cold_extra = SlidingWindow(size, percentile, 0) if warm_gap_ns else None
        self.cold_extra_ns = 0

    def free_at(self, now_ns: int) -> int:
        """Return when the lane is predicted to be free (may be before ``now_ns`` when idle)."""
        outstanding = self.outstanding
        if outstanding and outstanding[0].planned_end_ns < now_ns:
            self._resync(now_ns)
        return self.end_ns

    def start_for(self, now_ns: int) -> int:
        """Return the earliest start for a new action: ``max(now + lead, free_at)``; after an
        idle gap over ``warm_gap_ns``, ``cold_extra_ns`` later (it ends that much later)."""
        free_ns = self.free_at(now_ns)
        ready_ns = now_ns + self.lead_ns
        if free_ns >= ready_ns:
            return free_ns
        if ready_ns - free_ns > self.warm_gap_ns:
            ready_ns += self.cold_extra_ns
        return ready_ns

    def is_cold_now(self, now_ns: int) -> bool:
        """Return True when nothing is committed and an action starting now would be a cold
        start (``is_cold_start``)."""
        return not self.outstanding and self.is_cold_start(now_ns)

    def is_cold_start(self, start_ns: int) -> bool:
        """Return True when an action that started at ``start_ns`` (measured) followed more
        than ``warm_gap_ns`` of idle time; always False with cold starts off."""
        return self.cold_extra is not None and start_ns - self.base_ns > self.warm_gap_ns

    def learn_cold_extra(self, extra_ns: int, now_ns: int) -> None:
        """Add one cold start's measured minus predicted duration (``is_cold_start`` held)."""
        if self.cold_extra is not None:
            self.cold_extra.add(max(0, extra_ns), now_ns)
            self.cold_extra_ns = self.cold_extra.value_ns

    def relax_cold_extra(self, now_ns: int, stale_ns: int, factor: float) -> None:
        """Let a stale cold-start window forget an outlier (profiles.py "Recovery")."""
        if self.cold_extra is not None and self.cold_extra.forget_outlier(now_ns, stale_ns, factor):
            self.cold_extra_ns = self.cold_extra.value_ns

    def commit(self, action: Action, start_ns: int) -> None:
        """Append ``action``, planned to start at ``start_ns`` (``start_for(now)``, no earlier
        than its ``earliest_ns``), to the lane."""
        action.planned_end_ns = start_ns + action.predicted_ns
        self.outstanding.append(action)
        self.end_ns = action.planned_end_ns

    def finish(self, action: Action, ended_ns: int) -> None:
        """Remove ``action`` (result in, or executor gone); re-chain from ``ended_ns``."""
        try:
            self.outstanding.remove(action)
        except ValueError:
            return
        self.base_ns = max(self.base_ns, ended_ns)
        self._chain(self.base_ns)

    def _resync(self, now_ns: int) -> None:
        self.resyncs += 1
        first = self.outstanding[0]
        first.planned_end_ns = now_ns
        end_ns = now_ns
        for action in list(self.outstanding)[1:]:
            action.planned_end_ns = max(action.earliest_ns, end_ns) + action.predicted_ns
            end_ns = action.planned_end_ns
        self.end_ns = end_ns

    def _chain(self, from_ns: int) -> None:
        end_ns = from_ns
        for action in self.outstanding:
            action.planned_end_ns = max(action.earliest_ns, end_ns) + action.predicted_ns
            end_ns = action.planned_end_ns
        self.end_ns = end_ns


class BookedBatch:
    """A batch the admission ledger booked queued requests of one model into, on one
    executor: its predicted start and end (pushed back when work before it grows), the
    earliest internal deadline of its members, how many were booked (``size``, the batch it
    is costed as) and how many are still queued (``live``), and its cost (exec of ``size``
    padded)."""

    __slots__ = ("cost_ns", "deadline_ns", "end_ns", "index", "live", "model", "size", "start_ns")

    def __init__(
        self, model: str, index: int, start_ns: int, cost_ns: int, deadline_ns: int
    ) -> None:
        self.model = model
        self.index = index  # position in the executor's booking order
        self.start_ns = start_ns
        self.end_ns = start_ns + cost_ns
        self.cost_ns = cost_ns
        self.deadline_ns = deadline_ns
        self.size = 1
        self.live = 1


class ExecutorState:
    """What the core knows of one executor. ``loaded`` is in LRU order (least recent first)."""

    __slots__ = (
        "actions",
        "alive",
        "backlog_ns",
        "booked",
        "booked_head",
        "busy",
        "busy_at_ns",
        "exec_lane",
        "executor_id",
        "heap",
        "infers_by_model",
        "joined_ns",
        "kind",
        "load_lane",
        "loaded",
        "loading",
        "open_batches",
        "page_bytes",
        "pages_total",
        "pages_used",
        "reserved",
        "reserved_load_ns",
        "timer_at_ns",
        "timer_version",
    )

    def __init__(
        self, executor_id: str, kind: str, pages_total: int, page_bytes: int, joined_ns: int = 0
    ) -> None:
        self.executor_id = executor_id
        self.joined_ns = joined_ns
        self.kind = kind
        self.pages_total = pages_total
        self.page_bytes = page_bytes
        self.pages_used = 0
        self.exec_lane = Lane()
        self.load_lane = Lane()
        self.loaded: OrderedDict[str, int] = OrderedDict()  # model -> pages, LRU first
        self.loading: dict[str, Action] = {}  # model -> its outstanding LOAD
        self.infers_by_model: dict[str, int] = {}  # model -> outstanding INFERs
        self.actions: dict[int, Action] = {}  # every outstanding action here
        # EDF over the models loaded here: (head key, seq, model version, model).
        self.heap: list[tuple[int, int, int, ModelState]] = []
        self.timer_version = 0
        self.timer_at_ns = -1
        self.busy = 0.0  # decayed committed execute time per unit time
        self.busy_at_ns = joined_ns
        self.alive = True
        # Admission ledger (ledger.py): execute time promised to queued requests, the
        # batches they were booked as, and LOADs promised to cold models (in order).
        self.backlog_ns = 0
        self.booked: list[BookedBatch] = []  # in booking order; dead ones before booked_head
        self.booked_head = 0  # index (as BookedBatch.index) of booked[0]
        self.open_batches: dict[str, BookedBatch] = {}  # model -> its last booked batch
        self.reserved: OrderedDict[str, ModelState] = OrderedDict()
        self.reserved_load_ns = 0

    @property
    def pages_free(self) -> int:
        return self.pages_total - self.pages_used

    def holds(self, name: str) -> bool:
        """Return True when ``name`` is loaded or loading here."""
        return name in self.loaded or name in self.loading

    def is_busy_with(self, name: str) -> bool:
        """Return True when an INFER of ``name`` is outstanding here (it must not be evicted)."""
        return self.infers_by_model.get(name, 0) > 0

    def add_infer(self, name: str) -> None:
        self.infers_by_model[name] = self.infers_by_model.get(name, 0) + 1
        self.loaded.move_to_end(name)

    def remove_infer(self, name: str) -> None:
        left = self.infers_by_model.get(name, 0) - 1
        if left > 0:
            self.infers_by_model[name] = left
        else:
            self.infers_by_model.pop(name, None)

    def record_busy(self, now_ns: int, duration_ns: int, window_ns: int) -> None:
        """Add committed execute time to the decayed busy average."""
        self.busy = self.utilisation(now_ns, window_ns) + duration_ns / window_ns
        self.busy_at_ns = now_ns

    def utilisation(self, now_ns: int, window_ns: int) -> float:
        """Return the execute lane's busy fraction, averaged over about ``window_ns`` (over
        the time since it joined, while that is shorter: no warm-up bias towards idle)."""
        elapsed_ns = now_ns - self.busy_at_ns
        busy = self.busy if elapsed_ns <= 0 else self.busy * math.exp(-elapsed_ns / window_ns)
        age_ns = now_ns - self.joined_ns
        if age_ns >= 8 * window_ns:
            return busy
        seen = 1.0 - math.exp(-max(age_ns, window_ns // 100) / window_ns)
        return busy / seen
