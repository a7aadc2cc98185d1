"""A model's queue of waiting requests, sorted by key (the policy's order), for EDF batching.

Invariants: ``keys`` is sorted (ties keep arrival order) and ``keys[i]`` is the key of
``requests[i]``; entries before ``head`` are dead. A request leaves by being taken (its entry is
removed at once, so a request re-queued later has exactly one entry) or by being answered while
queued (it turns DONE and its entry is skipped, then dropped when the head passes it). Finding
the first request with a key at least some time is a binary search, so choosing a batch costs
O(log n + batch), whatever the queue's length.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from enum import Enum
from typing import Final, Generic, TypeVar

COMPACT_AFTER: Final = 64  # dead entries at the front before they are removed


class RequestStatus(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Queued:
    """What a queue reads of a request: the base of entities.RequestState, which sets these
    fields. A base class, not a Protocol: compiled with mypyc, they are read in place instead
    of looked up by name (the queue reads them for every request it passes over)."""

    __slots__ = ("key_ns", "status")

    key_ns: int
    status: RequestStatus

    def queued_for(self) -> object:
        """Return the model it is queued for now (a request re-queued elsewhere is not live
        here)."""
        raise NotImplementedError


RequestState = TypeVar("RequestState", bound=Queued)


class RequestQueue(Generic[RequestState]):
    """Requests of one model (``owner``), earliest key first."""

    __slots__ = ("_head", "_keys", "_owner", "_requests")

    def __init__(self, owner: object) -> None:
        self._owner = owner
        self._keys: list[int] = []
        self._requests: list[RequestState] = []
        self._head = 0

    def _live(self, request: RequestState) -> bool:
        return request.status is RequestStatus.QUEUED and request.queued_for() is self._owner

    def push(self, request: RequestState) -> None:
        """Insert a QUEUED request at its key (after any equal keys)."""
        keys = self._keys
        key_ns = request.key_ns
        if not keys or key_ns >= keys[-1]:
            keys.append(key_ns)
            self._requests.append(request)
            return
        index = bisect_right(keys, key_ns, lo=self._head)
        keys.insert(index, key_ns)
        self._requests.insert(index, request)

    def peek(self) -> RequestState | None:
        """Return the live request with the earliest key, or None."""
        requests = self._requests
        head = self._head
        while head < len(requests) and not self._live(requests[head]):
            head += 1
        self._head = head
        if head >= COMPACT_AFTER and 2 * head >= len(requests):
            del self._keys[:head]
            del requests[:head]
            self._head = head = 0
        return requests[head] if head < len(requests) else None

    def last_key_ns(self) -> int | None:
        """Return the largest key queued (perhaps of a request answered since), or None."""
        return self._keys[-1] if len(self._keys) > self._head else None

    def position_at_least(self, key_ns: int) -> int:
        """Return the position of the first entry whose key is >= ``key_ns``."""
        return bisect_left(self._keys, key_ns, lo=self._head)

    def first_from(self, position: int) -> RequestState | None:
        """Return the first live request at or after ``position``, or None."""
        requests = self._requests
        for index in range(max(position, self._head), len(requests)):
            if self._live(requests[index]):
                return requests[index]
        return None

    def first_live(self, count: int) -> list[RequestState]:
        """Return the first ``count`` live requests in key order (the queue is unchanged)."""
        requests = self._requests
        found: list[RequestState] = []
        for position in range(self._head, len(requests)):
            if len(found) >= count:
                break
            if self._live(requests[position]):
                found.append(requests[position])
        return found

    def live(self) -> Iterator[RequestState]:
        """Yield the live requests in key order (the queue must not change meanwhile)."""
        requests = self._requests
        for position in range(self._head, len(requests)):
            if self._live(requests[position]):
                yield requests[position]

    def nth_live(self, index: int) -> RequestState | None:
        """Return the live request at ``index`` (0: the head) in key order, or None."""
        requests = self._requests
        seen = 0
        for position in range(self._head, len(requests)):
            if self._live(requests[position]):
                if seen == index:
                    return requests[position]
                seen += 1
        return None

    def count_from(self, position: int, limit: int) -> int:
        """Return how many live requests there are from ``position`` on, counting to ``limit``."""
        requests = self._requests
        count = 0
        for index in range(max(position, self._head), len(requests)):
            if count >= limit:
                break
            if self._live(requests[index]):
                count += 1
        return count

    def take_from(self, position: int, count: int) -> list[RequestState]:
        """Remove and return up to ``count`` live requests from ``position`` on, in order."""
        requests = self._requests
        position = max(position, self._head)
        taken: list[RequestState] = []
        index = position
        while index < len(requests) and len(taken) < count:
            if self._live(requests[index]):
                taken.append(requests[index])
            index += 1
        keys = self._keys
        if index == len(requests):
            # The usual case (most queues hold one batch): the run taken reaches the end.
            # Popped, not sliced off: compiled, a slice deletion makes a slice object of two
            # boxed ints and goes through the generic item protocol, twice.
            while len(requests) > position:
                requests.pop()
                keys.pop()
        else:
            del keys[position:index]
            del requests[position:index]
        return taken

    def drain(self) -> list[RequestState]:
        """Remove and return every live request, in order."""
        live = [r for r in self._requests[self._head :] if self._live(r)]
        self._keys.clear()
        self._requests.clear()
        self._head = 0
        return live
