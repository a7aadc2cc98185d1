"""How long one loop iteration may spend on one connection's messages (`Connection`'s
``read_turn_ns``), and how far behind that leaves the connection.

libuv reads a readable stream up to 32 times in one iteration before it looks at any other
socket or timer, and `Connection.dispatch` hands every decoded message over from that read
callback. A client that keeps the daemon's socket full (16-byte requests: ~160 frames a 16 KiB
read, ~5,000 an iteration) so held the loop for up to 0.8 s at a time: the core's wake-ups
fired that late, INFERs went out past their latest start, executors' results waited unread,
and what the door had admitted was dropped (issue 26: 87 of 103 INFERs ``too_late`` at 8,000
req/s). With a turn, a connection that has used its budget in this iteration (from the first
message it handed over) stops handing messages over and stops reading; the rest waits in the
decoder (within its bounds) and in the socket, and goes on in the next iteration, after its
timers and the other sockets.

What waits in the socket is out of the door's sight (`Door.screen` books only what was read),
so a turn also tells how long its connection may have kept frames waiting: since the end of
its last turn that left no more unread (decoded and not handed over, or in the socket:
``unread``) than it handed over (`handed`: the next turn gets through it), `backlog_ns`.
Every frame read since arrived after that moment, so it
waited at most that long; the door takes that as its wait for the loop and refuses it
``overloaded`` past its share of the SLO, so a backlog drains at the rate frames are refused.

Invariants: a turn starts at the first `over` of an iteration and ends in the next one
(``call_soon``), calling ``on_end`` only if the budget was spent; at least one message is
handed over per turn, so a connection always makes progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class ReadTurn:
    """One connection's budget of loop time per iteration (``budget_ns``, by ``clock``)."""

    def __init__(
        self,
        budget_ns: int,
        on_end: Callable[[], None],
        unread: Callable[[], int],
        *,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if budget_ns <= 0:
            raise ValueError("a read turn's budget must be positive")
        self._budget_ns = budget_ns
        self._on_end = on_end
        self._unread = unread
        self._clock = clock
        self._started_ns: int | None = None  # None: no turn in this iteration yet
        self.spent = False  # the budget ran out in this iteration: no more reading in it
        self._handed_bytes = 0  # frames handed over in this iteration's turn
        self._behind = False  # the last turn left frames unread
        self._caught_up_ns = 0  # when the last turn that left nothing unread ended

    def backlog_ns(self) -> int:
        """At most how long a frame read now may have waited unread (0: not behind)."""
        return self._clock() - self._caught_up_ns if self._behind else 0

    def over(self) -> bool:
        """Whether this iteration's budget is spent (the first call of one starts it)."""
        if self.spent:
            return True
        now_ns = self._clock()
        if self._started_ns is None:
            self._started_ns = now_ns
            asyncio.get_running_loop().call_soon(self._end)
            return False
        self.spent = now_ns - self._started_ns >= self._budget_ns
        return self.spent

    def handed(self, nbytes: int) -> None:
        """A frame of ``nbytes`` was handed over in this turn."""
        self._handed_bytes += nbytes

    def _end(self) -> None:
        self._started_ns = None
        spent, self.spent = self.spent, False
        handed, self._handed_bytes = self._handed_bytes, 0
        self._behind = spent and self._unread() > handed
        if not self._behind:
            self._caught_up_ns = self._clock()
        if spent:
            self._on_end()
