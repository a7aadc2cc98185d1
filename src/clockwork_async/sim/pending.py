"""The simulator's requests sent and not yet answered, by request id.

Invariants: request ids are handed out in order from 0, one per ``add``, so the entries sit in
a list at ``request_id - base``; an answered one's slot holds None. ``take`` hands an entry
out at most once (a second reply for the id, or an id never added, gets None). The answered
prefix is cut off once it is at least half of the list and `TRIM_AT` long, so the list holds
the requests from the oldest unanswered one on (all of them if one is never answered, which
the engine counts as lost). A list, not a dict keyed by id: no hashing, no boxed key, and no
deletion per reply (about 1.5% of a compiled simulation).
"""

from __future__ import annotations

from typing import Final, cast

TRIM_AT: Final = 1024  # the shortest answered prefix worth cutting off (a memmove of the rest)

Entry = tuple[int, int, int, bool]  # instance, arrival_ns, deadline_ns, cold


class PendingRequests:
    def __init__(self) -> None:
        self._entries: list[Entry | None] = []
        self._base = 0  # the request id of _entries[0]
        self._head = 0  # every slot before it is None
        self.outstanding = 0

    def add(self, entry: Entry) -> None:
        """Keep ``entry`` for the next request id (``base`` + the entries added before it)."""
        self._entries.append(entry)
        self.outstanding += 1

    def take(self, request_id: int) -> Entry | None:
        """The entry of ``request_id``, forgotten; None if it was taken already or never added."""
        entries = self._entries
        index = request_id - self._base
        if index < 0 or index >= len(entries):
            return None
        # ``object``, then cast back: compiled, a variable narrowed to the tuple type is
        # unpacked into a native tuple and packed into a new one on return (4 boxings).
        entry: object = entries[index]
        if entry is None:
            return None
        entries[index] = None
        self.outstanding -= 1
        if index == self._head:
            self._advance()
        return cast("Entry | None", entry)

    def ids(self) -> list[int]:
        """The ids still outstanding, in order."""
        base = self._base
        return [base + index for index, entry in enumerate(self._entries) if entry is not None]

    def _advance(self) -> None:
        entries, head = self._entries, self._head
        while head < len(entries) and entries[head] is None:
            head += 1
        if head >= TRIM_AT and 2 * head >= len(entries):
            del entries[:head]
            self._base += head
            head = 0
        self._head = head
