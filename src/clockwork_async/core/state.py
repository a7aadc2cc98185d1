"""All mutable state of the controller core, as data, and the lookups that only read it.

Invariants: every accepted request is in ``requests`` until answered (requests.py answers it
exactly once: ``RequestState.move`` raises on a second answer); ``queued_total`` and
``running_total`` count QUEUED and RUNNING requests; commands are appended to ``out`` in the
order the runtime must perform them (an UNLOAD before the LOAD that needs its pages).
``CoreState`` holds data only: it calls nothing. The functions here read it (and hand out ids);
the modules above change it (the layers: controller.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .config import ControllerConfig
from .entities import Action, ExecutorState, ModelState, RequestState, Reservation
from .events import Command
from .outcomes import Outcome
from .profiles import KindPredictions, Predictions

COUNTERS = (
    "infers",
    "loads",
    "cold_starts",
    "warm_ups",
    "probes",
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

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.predictions = Predictions(
            config.window_size, config.percentile, config.pooled_window_size
        )
        self.models: dict[str, ModelState] = {}
        self.retiring: dict[str, ModelState] = {}  # unregistered, copies not yet unloaded
        self.requests: dict[int, RequestState] = {}
        self.executors: dict[str, ExecutorState] = {}
        self.kinds: dict[str, int] = {}  # executor kind -> executors of that kind
        self.free_load_slots = 0  # sum over executors of max_loads_in_flight - loads out
        self.actions: dict[int, Action] = {}  # outstanding INFER and LOAD actions
        self.unloads: dict[int, tuple[str, str]] = {}  # action id -> (executor, model)
        # (executor id, reservation id) -> lanes and pages held (ReserveLane, reservations.py)
        self.reservations: dict[tuple[str, int], Reservation] = {}
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
        self.last_action_id = 0  # ids are handed out by new_action_id
        self.last_seq = 0  # tie-breakers of the heaps, by next_seq
        self.fill_rounds = 0  # `run_fills` calls that filled (executors count fills per call)


def new_action_id(core: CoreState) -> int:
    """Return a new action id (1, 2, ...)."""
    core.last_action_id += 1
    return core.last_action_id


def next_seq(core: CoreState) -> int:
    """Return a new tie-breaker for a heap entry (heaps pop equal times in push order)."""
    core.last_seq += 1
    return core.last_seq


def predict(core: CoreState, model: ModelState, executor: ExecutorState) -> KindPredictions:
    """Return the predictions of ``model`` on ``executor``'s kind."""
    return _kind_predictions(core, model, executor.kind)


def best_exec_b1_ns(core: CoreState, model: ModelState) -> int:
    """Return the fastest predicted batch-1 execute time over the kinds present (or seeds)."""
    b1 = model.spec.batch_sizes[0]
    if not core.kinds:  # no executor: the seeds (rare)
        return min(_kind_predictions(core, model, kind).exec_ns[b1] for kind in _kinds(core, model))
    # A loop over the dict, not min(generator) over an Iterable: compiled, both of those are
    # generic iterations.
    best_ns, first = 0, True
    for kind in core.kinds:
        exec_ns = _kind_predictions(core, model, kind).exec_ns[b1]
        if first or exec_ns < best_ns:
            best_ns, first = exec_ns, False
    return best_ns


def best_load_ns(core: CoreState, model: ModelState) -> int:
    """Return the fastest predicted LOAD time over the kinds present (or seeds)."""
    if not core.kinds:  # no executor: the seeds (rare)
        return min(_kind_predictions(core, model, kind).load_ns for kind in _kinds(core, model))
    best_ns, first = 0, True  # a loop over the dict, as in best_exec_b1_ns
    for kind in core.kinds:
        load_ns = _kind_predictions(core, model, kind).load_ns
        if first or load_ns < best_ns:
            best_ns, first = load_ns, False
    return best_ns


def _kinds(core: CoreState, model: ModelState) -> Iterable[str]:
    return core.kinds or model.spec.profiles


def _kind_predictions(core: CoreState, model: ModelState, kind: str) -> KindPredictions:
    found = model.by_kind.get(kind)
    if found is None:  # cached on the model (set_spec clears it)
        found = model.by_kind[kind] = core.predictions.get(model.spec, kind)
    return found
