"""A quote: where the admission ledger (ledger.py) would book a request, and when the work
booked there would end with it.

Invariants: a quote only describes; booking it is ledger.py's act. ``finish_ns`` includes, for
a new batch, the room for it to grow to its target size; ``ready_ns``, ``load_ns`` and
``victims`` are set only for a model with no copy (a reserved or new LOAD first).
"""

from __future__ import annotations

from .entities import ExecutorState


class Quote:
    """Where a request would be booked and when the work booked there would end with it. A
    plain class, not a dataclass: compiled, a dataclass's generated ``__init__`` would run in
    the interpreter (one or more per arrival)."""

    __slots__ = (
        "ahead_of",
        "executor",
        "finish_ns",
        "in_order",
        "joins",
        "load_ns",
        "open_start_ns",
        "ready_ns",
        "room",
        "share_ns",
        "victims",
    )

    def __init__(
        self,
        executor: ExecutorState,
        finish_ns: int,
        share_ns: int,
        joins: bool,
        open_start_ns: int,
        *,
        ahead_of: int = -1,
        room: int = 1,
    ) -> None:
        self.executor = executor
        # Predicted end of the booked work there, this request included (for a new batch:
        # including room for it to grow to its target size); admit if <= deadline.
        self.finish_ns = finish_ns
        self.share_ns = share_ns  # this request's booked execute time
        self.joins = joins  # joins its model's open batch there (else opens a new one)
        self.open_start_ns = open_start_ns  # predicted start of the new batch (when not joining)
        self.ready_ns = 0  # no copy yet: when the reserved LOAD is predicted to end
        self.load_ns = 0  # a new reservation: its LOAD's predicted duration (else 0)
        self.victims: list[str] | None = None  # a new reservation: the idle models to evict
        self.ahead_of = ahead_of  # a new batch booked ahead: its position in ``booked`` (or -1)
        self.room = room  # a new batch: the rows booked for it (its share is exec of that size)
        self.in_order = True  # the request sorts last in its model's queue (it could join)

    def __repr__(self) -> str:
        return (
            f"Quote(executor={self.executor.executor_id!r}, finish_ns={self.finish_ns}, "
            f"share_ns={self.share_ns}, joins={self.joins}, room={self.room})"
        )
