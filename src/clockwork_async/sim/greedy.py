"""A simple greedy scheduler, simulated on its own: the baseline of issue 29.

Not a policy of the core (the core is the production one, `core/`); a standalone event
simulation over the same arrivals, profile and deadlines, with the same idealisations as
`sim.bound` (every model resident everywhere, no LOADs, no message delays, durations exactly the
profile's), so it measures what batching choices alone are worth.

Rules, when an executor is free at time t (and requests wait):
- Work-conserving: it never idles while a request it could still answer in time waits.
- Requests that can no longer be answered in time (t + min_b d(b) > deadline) are dropped.
- Per model and batch size b, the candidate batch is the (up to b) oldest waiting requests
  whose deadlines are >= t + d(b) (older ones that only a smaller batch could still answer are
  passed over, and stay). Among the candidates the one with the best throughput members / d(b)
  runs; ties go to the smaller b, then to the batch whose oldest member's deadline is earliest,
  then to the lower model index.
- Requests of one time arrive before an executor freed at that time chooses; executors free at
  the same time choose in index order.

Invariants: every request ends ``ok`` (its batch ended by its deadline) or ``dropped``, once;
no executor runs two batches at once; a batch holds one model and at most b requests.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from .bound import Requests

Queue = deque[tuple[int, int]]  # (deadline_ns, request index), oldest first


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch the greedy scheduler ran."""

    executor: int
    start_ns: int
    batch_size: int
    members: tuple[int, ...]


@dataclass
class GreedyResult:
    ok: int = 0
    dropped: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    batches: list[Batch] | None = None  # kept when asked (tests)

    def summary(self, duration_ns: int) -> dict[str, object]:
        """ok, dropped, goodput (per second of ``duration_ns``) and batch sizes."""
        return {
            "ok": self.ok,
            "dropped": self.dropped,
            "goodput_rps": round(self.ok * 1e9 / duration_ns, 3),
            "batch_sizes": {str(b): n for b, n in sorted(self.batch_sizes.items())},
        }


def greedy(
    requests: Requests,
    execute_ns: Mapping[int, int],
    executors: int = 1,
    keep_batches: bool = False,
) -> GreedyResult:
    """Run the greedy scheduler over ``requests``; returns its outcome counts."""
    if executors < 1:
        raise ValueError(f"executors must be >= 1, got {executors}")
    sizes = sorted(execute_ns)
    if any(execute_ns[a] > execute_ns[b] for a, b in pairwise(sizes)):
        raise ValueError("greedy needs execute times that grow with the batch size")
    shortest_ns = min(execute_ns.values())
    order = np.argsort(requests.arrival_ns, kind="stable")  # a no-op for a workload's
    arrivals = requests.arrival_ns[order].tolist()
    deadlines = requests.deadline_ns[order].tolist()
    models = requests.instance[order].tolist()
    ids = order.tolist()
    result = GreedyResult(batches=[] if keep_batches else None)
    queues: dict[int, Queue] = {}
    free: list[tuple[int, int]] = [(0, e) for e in range(executors)]  # (free at, executor)
    next_arrival, count, waiting, now_ns = 0, len(arrivals), 0, 0
    while next_arrival < count or waiting:
        free_ns, executor = free[0]  # an executor idle since free_ns is free now
        now_ns = max(now_ns, free_ns if waiting else max(free_ns, arrivals[next_arrival]))
        while next_arrival < count and arrivals[next_arrival] <= now_ns:
            model = models[next_arrival]
            queues.setdefault(model, deque()).append((deadlines[next_arrival], ids[next_arrival]))
            next_arrival += 1
            waiting += 1
        dropped = _drop_hopeless(queues, now_ns + shortest_ns, sizes[-1])
        result.dropped += dropped
        waiting -= dropped
        choice = _choose(queues, now_ns, sizes, execute_ns)
        if choice is None:
            continue
        model, batch_size, positions = choice
        members = _take(queues[model], positions)
        waiting -= len(members)
        result.ok += len(members)
        result.batch_sizes[batch_size] += 1
        if result.batches is not None:
            result.batches.append(Batch(executor, now_ns, batch_size, members))
        heapq.heapreplace(free, (now_ns + execute_ns[batch_size], executor))
    return result


def _drop_hopeless(queues: dict[int, Queue], earliest_end_ns: int, largest: int) -> int:
    """Drop requests no batch can answer in time any more: at the front of each queue, and
    among the ``largest`` oldest (deadlines need not follow arrivals); returns how many."""
    dropped = 0
    for queue in queues.values():
        while queue and queue[0][0] < earliest_end_ns:
            queue.popleft()
            dropped += 1
        head = [entry for _, entry in zip(range(largest), queue, strict=False)]
        if any(deadline_ns < earliest_end_ns for deadline_ns, _ in head):
            kept = [entry for entry in head if entry[0] >= earliest_end_ns]
            dropped += len(head) - len(kept)
            for _ in head:
                queue.popleft()
            queue.extendleft(reversed(kept))
    return dropped


def _choose(
    queues: dict[int, Queue], now_ns: int, sizes: list[int], execute_ns: Mapping[int, int]
) -> tuple[int, int, list[int]] | None:
    """The valid batch with the best throughput: (model, batch size, queue positions of its
    members), or None when no request waits."""
    best: tuple[float, int, int, int] | None = None  # (-throughput, b, oldest deadline, model)
    chosen: list[int] = []
    for model, queue in queues.items():
        for batch_size in sizes:
            positions = _oldest_in_time(queue, batch_size, now_ns + execute_ns[batch_size])
            if not positions:
                break  # larger batches end later still
            first_ns = queue[positions[0]][0]
            key = (-len(positions) / execute_ns[batch_size], batch_size, first_ns, model)
            if best is None or key < best:
                best, chosen = key, positions
            if len(positions) < batch_size:
                break  # a larger batch ends later: no more members, less throughput
    return None if best is None else (best[3], best[1], chosen)


def _oldest_in_time(queue: Queue, batch_size: int, end_ns: int) -> list[int]:
    """Positions of the (up to ``batch_size``) oldest requests whose deadline is >= end_ns."""
    positions: list[int] = []
    for position, (deadline_ns, _) in enumerate(queue):
        if deadline_ns >= end_ns:
            positions.append(position)
            if len(positions) == batch_size:
                break
    return positions


def _take(queue: Queue, positions: list[int]) -> tuple[int, ...]:
    """Remove the entries at ``positions`` (ascending) from ``queue``; return their requests."""
    head = [queue.popleft() for _ in range(positions[-1] + 1)]
    picked = set(positions)
    queue.extendleft(reversed([entry for i, entry in enumerate(head) if i not in picked]))
    return tuple(head[i][1] for i in positions)


def check_schedule(
    requests: Requests, execute_ns: Mapping[int, int], batches: list[Batch]
) -> list[str]:
    """What is wrong with a schedule (empty when it is feasible): overlapping batches on an
    executor, a member served twice, before its arrival or after its deadline, mixed models,
    too many members."""
    problems: list[str] = []
    served: set[int] = set()
    ends: dict[int, int] = {}
    for batch in sorted(batches, key=lambda b: (b.executor, b.start_ns)):
        end_ns = batch.start_ns + execute_ns[batch.batch_size]
        if batch.start_ns < ends.get(batch.executor, 0):
            problems.append(f"overlap on executor {batch.executor} at {batch.start_ns}")
        ends[batch.executor] = end_ns
        if len(batch.members) > batch.batch_size:
            problems.append(f"batch at {batch.start_ns} holds {len(batch.members)}")
        if len({int(requests.instance[j]) for j in batch.members}) > 1:
            problems.append(f"batch at {batch.start_ns} mixes models")
        for j in batch.members:
            if j in served:
                problems.append(f"request {j} served twice")
            served.add(j)
            if requests.arrival_ns[j] > batch.start_ns or requests.deadline_ns[j] < end_ns:
                problems.append(f"request {j} outside its window")
    return problems


def as_requests(arrival: list[int], deadline: list[int], model: list[int]) -> Requests:
    """A `Requests` from plain lists (tests, tiny cases)."""
    return Requests(
        np.asarray(arrival, dtype=np.int64),
        np.asarray(deadline, dtype=np.int64),
        np.asarray(model, dtype=np.int64),
    )
