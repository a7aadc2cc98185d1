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
so a turn also keeps a lower bound of how long it kept bytes waiting: when a spent turn ends
with bytes still in the socket (``unread``), it marks that the stream up to that offset had
arrived by then. A frame read later that ends at or before a mark's offset waited at least
since the mark (`backlog_ns`, from the first mark at or past the bytes received so far, which
a frame being decoded ends before). The door takes that as the frame's wait for the loop and
refuses it ``overloaded`` past its share of the SLO, so a backlog drains at the rate frames are
refused. (An upper bound, or bytes over hand-over rate, refused 46-75% of 1,500 req/s that
the daemon then served whole without them: a turn stretched by preemption looked like a
backlog.)

Invariants: a turn starts at the first `over` of an iteration and ends in the next one
(``call_soon``), calling ``on_end`` only if the budget was spent; at least one message is
handed over per turn, so a connection always makes progress. Marks grow in offset and time;
one is kept only while bytes before its offset remain unread (at most one per spent turn).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
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
        self._received_bytes = 0  # from the stream so far
        self._marks: deque[tuple[int, int]] = deque()  # (stream offset, when it had arrived)

    def backlog_ns(self) -> int:
        """At least how long the frame being decoded waited unread (0: no sign it did)."""
        marks = self._marks
        while marks and marks[0][0] < self._received_bytes:
            marks.popleft()  # bytes before that offset are all read
        return self._clock() - marks[0][1] if marks else 0

    def received(self, nbytes: int) -> None:
        """``nbytes`` more of the stream were read (before they are decoded)."""
        self._received_bytes += nbytes

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

    def _end(self) -> None:
        self._started_ns = None
        spent, self.spent = self.spent, False
        if spent:
            unread = self._unread()
            if unread:
                self._marks.append((self._received_bytes + unread, self._clock()))
            self._on_end()
