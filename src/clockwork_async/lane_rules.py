"""The executor's lane rules, pure: no threads, no clock reads, no I/O.

The real executor drives these rules in real time (``executors/lanes.py``, ``executors/host.py``)
and the simulator on its virtual clock (`clockwork_async.sim.executors`), so virtual time follows
the real executor's rules by construction. (They live in the package, not in ``executors/``, so
the simulator and mypy reach them without the executor.) Invariants:

- Which lane: LOAD runs in the ``load`` lane; INFER and UNLOAD in the ``execute`` lane, so an
  UNLOAD never runs while an INFER of its model is running; RegisterModel/UnregisterModel in
  the ``register`` lane (`LANE_OF`).
- Windows: LOAD and INFER carry their own ``[earliest_ns, latest_ns]``. UNLOAD, REGISTER and
  UNREGISTER get `UNTIMED` = ``[0, NEVER_NS]``: earliest 0 puts an UNLOAD ahead of every INFER
  waiting in its lane (it starts when the running action ends), and it is never too late.
- Order (`LaneQueue`): among waiting actions the one with the smallest ``earliest_ns`` goes
  next, ties in order of arrival; none starts before its ``earliest_ns``; a lane that is free
  at ``now_ns > latest_ns`` of its head rejects that head (too late) without running it.
- Pages (`load_verdict`): a LOAD of a model that is loading, loaded or unloading answers
  ALREADY_LOADED. One whose pages do not fit waits, the lane held, while UNLOADs of loaded
  models are pending and it has waited less than `UNLOAD_WAIT_NS`; then NO_PAGES. (A
  controller evicts by sending UNLOADs and at once the LOAD that needs their pages.)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Final, Generic, TypeVar

NEVER_NS = 2**63 - 1  # a latest_ns that never passes
UNTIMED = (0, NEVER_NS)  # the window of UNLOAD, REGISTER and UNREGISTER
UNLOAD_WAIT_NS = 2_000_000_000  # the longest a LOAD waits for pending UNLOADs to free pages

REGISTER_LANE = "register"
LOAD_LANE = "load"
EXECUTE_LANE = "execute"


class ActionKind(StrEnum):
    REGISTER = "register"
    UNREGISTER = "unregister"
    LOAD = "load"
    INFER = "infer"
    UNLOAD = "unload"


# Final: compiled, kept in a C static rather than looked up on the module per call.
_heappush: Final = heapq.heappush
_heappop: Final = heapq.heappop

LANE_OF: dict[ActionKind, str] = {
    ActionKind.REGISTER: REGISTER_LANE,
    ActionKind.UNREGISTER: REGISTER_LANE,
    ActionKind.LOAD: LOAD_LANE,
    ActionKind.INFER: EXECUTE_LANE,
    ActionKind.UNLOAD: EXECUTE_LANE,
}

T = TypeVar("T")


class _Popped(Generic[T]):
    """A job popped from the queue, and what to do with it (the class says).

    A written class, not a dataclass: mypyc compiles this module (pyproject.toml), and a
    generic dataclass fails there at import. Not frozen: a frozen __init__ costs ~0.5 us."""

    __slots__ = ("job",)

    def __init__(self, job: T) -> None:
        self.job = job

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Popped) and type(other) is type(self) and self.job == other.job

    def __repr__(self) -> str:
        return f"{type(self).__name__}(job={self.job!r})"


class RunJob(_Popped[T]):
    """Start ``job`` now (it was popped)."""

    __slots__ = ()


class RejectJob(_Popped[T]):
    """Answer ``job`` too late without running it (it was popped)."""

    __slots__ = ()


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a lane step ~0.5 us
class WaitUntil:
    """Nothing is due before ``time_ns``, when the head's earliest start comes."""

    time_ns: int


Step = RunJob[T] | RejectJob[T] | WaitUntil | None  # None: nothing queued


class LaneQueue(Generic[T]):
    """The waiting actions of one lane: a heap by (earliest_ns, arrival)."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, T]] = []  # (earliest, seq, latest, job)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, job: T, earliest_ns: int, latest_ns: int) -> None:
        """Queue ``job`` with its window."""
        _heappush(self._heap, (earliest_ns, self._seq, latest_ns, job))
        self._seq += 1

    def next_step(self, now_ns: int) -> Step[T]:
        """What a free lane does at ``now_ns``: run or reject the head (popping it), wait
        until the head is due, or None when nothing is queued."""
        heap = self._heap
        if not heap:
            return None
        earliest_ns, _seq, latest_ns, job = heap[0]
        if now_ns > latest_ns:
            _heappop(heap)
            return RejectJob(job)
        if now_ns >= earliest_ns:
            _heappop(heap)
            return RunJob(job)
        return WaitUntil(earliest_ns)

    def drain(self) -> list[T]:
        """Remove and return every queued job, in lane order."""
        heap = self._heap
        return [_heappop(heap)[3] for _ in range(len(heap))]


class LoadVerdict(Enum):
    START = "start"  # take the pages and load
    WAIT = "wait"  # hold the lane until an UNLOAD ends (or the wait is over), then ask again
    ALREADY_LOADED = "already_loaded"
    NO_PAGES = "no_pages"


def load_verdict(
    *, registered: bool, pages_fit: bool, unloads_pending: bool, waited_ns: int
) -> LoadVerdict:
    """What a LOAD that has started does: ``registered`` (neither loading, loaded nor
    unloading), whether its pages fit now, whether UNLOADs of loaded models are pending, and
    how long it has waited for them."""
    if not registered:
        return LoadVerdict.ALREADY_LOADED
    if pages_fit:
        return LoadVerdict.START
    if unloads_pending and waited_ns < UNLOAD_WAIT_NS:
        return LoadVerdict.WAIT
    return LoadVerdict.NO_PAGES
