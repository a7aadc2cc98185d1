"""An upper bound on the requests any scheduler could answer in time, for one arrival sequence.

The problem bounded: requests j with arrival a_j and deadline D_j; E executors, each running at
most one batch at a time; a batch of k requests of one model runs at a supported batch size
b >= k for d(b) (the profile's execute time) over [s, s + d(b)]; a member is answered in time
iff a_j <= s and s + d(b) <= D_j. LOADs are ignored: every model is taken to be resident on
every executor from the start (dropping a constraint can only raise the optimum), and so are
message delays and the controller's own margins. Durations are exactly the profile's (with
``--noise`` a run may beat the profile, so no bound is reported there).

The relaxation. Let p = min_b d(b)/b (the shortest time per request any batch achieves; 1.083 ms
for ResNet50-V100, at b16). In any feasible schedule, cut each batch [s, s + d(b)] of k <= b
members into k consecutive pieces of length d(b)/k >= d(b)/b >= p and keep the first p of each.
Every answered request then owns a piece [x_j, x_j + p] inside [a_j, D_j], and the pieces of one
executor do not overlap. Number time slots by floor(t / p): on one executor two pieces have
x' >= x + p, hence distinct slots, so slot k holds at most E pieces; a request's slot lies in
[floor(a_j / p), floor(D_j / p) - 1] (from a_j <= x_j <= D_j - p). Also D_j - a_j >= min_b d(b)
(its batch fits in its window). So the answered requests of any schedule form a matching of
requests into slots (capacity E per slot, an interval of slots per request), and the largest
such matching is an upper bound on what any scheduler answers. The intervals make the graph
convex, where sweeping the slots in order and giving each slot to the waiting requests with the
earliest last slot (EDF) finds a maximum matching (Glover 1967); `upper_bound` does that in
O(n log n), with exact integer arithmetic (slot of t = floor(t * b* / d(b*))).

How loose it is: under overload of one model it is the b* capacity (E / p req/s) less what
arrives too late to matter, within one slot per window (about 1% at a 100 ms SLO). It ignores
that a batch must wait for its members and that a batch holds one model only, so with many
lightly loaded models (little to batch) the true optimum can be far below it (down to p / d(1):
40% for ResNet50-V100, batch 1 vs batch 16); with several executors it is the sum of their
capacities. `brute_force_optimum` solves tiny cases exactly, to test that the bound holds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import combinations

import numpy as np
import numpy.typing as npt

from .workloads import Workload, request_slos_ns

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Requests:
    """An arrival sequence: per request its arrival, deadline and instance (model index),
    in arrival order (ties keep the workload's order)."""

    arrival_ns: IntArray
    deadline_ns: IntArray
    instance: IntArray

    def __len__(self) -> int:
        return len(self.arrival_ns)


def open_requests(
    workload: Workload,
    rng: np.random.Generator,
    slo_ns: int,
    slos_ns: Sequence[int] | None = None,
) -> Requests:
    """The open-loop arrivals of ``workload`` drawn from ``rng`` (the engine's workload
    generator: `engine.workload_rng`), deadlines ``arrival + slo`` (``slos_ns[i]`` for
    request i when given)."""
    times: list[int] = []
    instances: list[int] = []
    for piece_times, piece_instances in workload.open_arrivals(rng):
        times += piece_times
        instances += piece_instances
    arrival_ns = np.asarray(times, dtype=np.int64)
    slo = np.asarray(slos_ns, dtype=np.int64) if slos_ns is not None else slo_ns
    return Requests(arrival_ns, arrival_ns + slo, np.asarray(instances, dtype=np.int64))


def best_batch(execute_ns: Mapping[int, int]) -> tuple[int, int]:
    """``(b, d(b))`` with the least time per request d(b)/b (the smaller b on ties)."""
    return min(execute_ns.items(), key=lambda item: (item[1] / item[0], item[0]))


def slot_windows(
    arrival_ns: IntArray, deadline_ns: IntArray, execute_ns: Mapping[int, int]
) -> tuple[IntArray, IntArray]:
    """Each servable request's first and last slot (see the module header); requests that no
    batch could answer in time are left out."""
    batch, duration_ns = best_batch(execute_ns)
    servable = deadline_ns - arrival_ns >= min(execute_ns.values())
    first = (arrival_ns[servable] * batch) // duration_ns
    last = (deadline_ns[servable] * batch) // duration_ns - 1
    keep = last >= first
    return first[keep], last[keep]


def upper_bound(
    arrival_ns: IntArray,
    deadline_ns: IntArray,
    execute_ns: Mapping[int, int],
    executors: int = 1,
) -> int:
    """The most requests any schedule on ``executors`` executors of this profile could answer
    in time (the module header's relaxation): a maximum slot matching."""
    first, last = slot_windows(
        np.asarray(arrival_ns, np.int64), np.asarray(deadline_ns, np.int64), execute_ns
    )
    order = np.argsort(first, kind="stable")
    matcher = SlotMatcher(executors)
    matcher.add(first[order].tolist(), last[order].tolist())
    return matcher.finish()


class SlotMatcher:
    """A maximum matching of intervals [first, last] into integer slots of ``per_slot`` places,
    fed in order of ``first``: slots are handed out in order, each to the waiting intervals that
    end first (optimal for intervals). Memory holds only the intervals still waiting."""

    def __init__(self, per_slot: int) -> None:
        if per_slot < 1:
            raise ValueError(f"executors must be >= 1, got {per_slot}")
        self.per_slot = per_slot
        self.matched = 0
        self._slot = 0  # the next slot to hand out
        self._waiting: list[int] = []  # heap of last slots
        self._last_first = -1

    def add(self, firsts: Sequence[int], lasts: Sequence[int]) -> None:
        """More intervals; ``firsts`` ascending and not below any added before."""
        for first, last in zip(firsts, lasts, strict=True):
            if first < self._last_first:
                raise ValueError("intervals must come in order of their first slot")
            self._last_first = first
            self._hand_out(until=first)
            heapq.heappush(self._waiting, last)

    def finish(self) -> int:
        """Hand out slots until nothing waits; the matching's size."""
        self._hand_out(until=None)
        return self.matched

    def _hand_out(self, until: int | None) -> None:
        """Give slots before ``until`` (all, when None) to the waiting intervals."""
        waiting, per_slot = self._waiting, self.per_slot
        while waiting and (until is None or self._slot < until):
            slot = self._slot
            while waiting and waiting[0] < slot:
                heapq.heappop(waiting)
            for _ in range(min(per_slot, len(waiting))):
                heapq.heappop(waiting)
                self.matched += 1
            self._slot = slot + 1
        if until is not None and self._slot < until:
            self._slot = until  # nothing waits: skip the idle slots


def stream_bound(
    workload: Workload,
    rng: np.random.Generator,
    slo_ns: int,
    execute_ns: Mapping[int, int],
    executors: int = 1,
) -> tuple[int, int]:
    """`upper_bound` of ``workload``'s open-loop arrivals drawn from ``rng`` (the engine's:
    `engine.workload_rng`) with deadlines ``arrival + slo`` (a workload's own per-request SLOs,
    ``request_slos_ns``, when it has them), piece by piece in bounded memory. Returns
    ``(bound, requests)``."""
    matcher = SlotMatcher(executors)
    slos = request_slos_ns(workload)
    seen = 0
    for times, _ in workload.open_arrivals(rng):
        arrival = np.asarray(times, dtype=np.int64)
        slo = slo_ns if slos is None else np.asarray(slos[seen : seen + len(times)], np.int64)
        first, last = slot_windows(arrival, arrival + slo, execute_ns)
        order = np.argsort(first, kind="stable")
        matcher.add(first[order].tolist(), last[order].tolist())
        seen += len(times)
    return matcher.finish(), seen


def bound_of(requests: Requests, execute_ns: Mapping[int, int], executors: int) -> int:
    """`upper_bound` of a `Requests`."""
    return upper_bound(requests.arrival_ns, requests.deadline_ns, execute_ns, executors)


# --- exact optimum of tiny cases (tests) ---------------------------------------------------------


def brute_force_optimum(
    arrival: Sequence[int],
    deadline: Sequence[int],
    model: Sequence[int],
    execute: Mapping[int, int],
    executors: int = 1,
) -> int:
    """The most requests any schedule answers in time, by exhaustive search (a handful of
    requests, small integer times). With integer data some optimal schedule starts every batch
    at an integer time (shift each batch left to the latest of its members' arrivals and its
    executor's previous end), so the search steps time by 1: the executor that frees first
    either idles one unit or starts a batch of waiting requests of one model."""
    sizes = sorted(execute)
    horizon = max(deadline, default=0)

    def duration(members: int) -> int | None:
        fitting = [b for b in sizes if b >= members]
        return execute[fitting[0]] if fitting else None

    @cache
    def best(free: tuple[int, ...], served: frozenset[int]) -> int:
        now, rest = free[0], free[1:]
        if now >= horizon:
            return 0
        found = best(tuple(sorted((now + 1, *rest))), served)
        for batch, took in _batches(now, served, arrival, deadline, model, duration):
            after = tuple(sorted((now + took, *rest)))
            found = max(found, len(batch) + best(after, served | batch))
        return found

    return best((0,) * executors, frozenset())


def _batches(
    now: int,
    served: frozenset[int],
    arrival: Sequence[int],
    deadline: Sequence[int],
    model: Sequence[int],
    duration: Callable[[int], int | None],
) -> Iterator[tuple[frozenset[int], int]]:
    """Every batch that may start at ``now``: waiting requests of one model, all in time."""
    waiting = [j for j in range(len(arrival)) if j not in served and arrival[j] <= now]
    for size in range(1, len(waiting) + 1):
        took = duration(size)
        if took is None:
            break
        for members in combinations(waiting, size):
            if len({model[j] for j in members}) == 1 and all(
                deadline[j] >= now + took for j in members
            ):
                yield frozenset(members), took
