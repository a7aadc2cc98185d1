"""Which requests of one model go in the next batch: the building blocks of the policies.

Invariants: these functions only read the state; a Batch is a plan, not an act: ``count``
live requests of one model from queue ``position`` on, in queue order (the scheduler takes
them out of the queue when it dispatches the batch), padded to the smallest supported size
that holds them; ``latest_ns`` is the last start that still ends by the
earliest internal deadline in it (the executor refuses it after that: ``too_late``). The
clockwork helpers never take a request whose deadline the batch would miss, and take no
request booked in a later batch when that would push other work booked on the executor
(ledger.py) past its deadline; the head's own booked batch always goes (it was promised).
"""

from __future__ import annotations

from .entities import ExecutorState, ModelState
from .ledger import dispatch_fits
from .state import CoreState, predict

FAR_FUTURE_NS = 1 << 62  # the latest start of a batch that has no deadline to keep


class Batch:
    """Run the ``count`` live requests from queue ``position`` on (in queue order) as one
    INFER of ``batch_size`` rows. A plain class, not a dataclass: compiled, a dataclass's
    generated ``__init__`` would run in the interpreter (one per fill)."""

    __slots__ = ("batch_size", "count", "latest_ns", "position", "predicted_ns")

    def __init__(
        self, position: int, count: int, batch_size: int, predicted_ns: int, latest_ns: int
    ) -> None:
        self.position = position
        self.count = count
        self.batch_size = batch_size
        self.predicted_ns = predicted_ns
        self.latest_ns = latest_ns

    def __repr__(self) -> str:
        return (
            f"Batch(position={self.position}, count={self.count}, "
            f"batch_size={self.batch_size}, predicted_ns={self.predicted_ns}, "
            f"latest_ns={self.latest_ns})"
        )


def fitting_count(model: ModelState, exec_ns: dict[int, int], budget_ns: int) -> int:
    """Return the largest supported batch size whose execution fits ``budget_ns`` (or 0)."""
    fitting = 0
    for size in model.spec.batch_sizes:
        if exec_ns[size] > budget_ns:
            break
        fitting = size
    return fitting


def batch_from(
    model: ModelState, exec_ns: dict[int, int], position: int, count: int, deadline_ns: int
) -> Batch:
    """Plan the ``count`` live requests from ``position`` on (there are that many) as one
    padded batch."""
    padded = model.padded_batch(count)
    return Batch(position, count, padded, exec_ns[padded], deadline_ns - exec_ns[padded])


def count_keeping_promises(
    core: CoreState,
    executor: ExecutorState,
    model: ModelState,
    exec_ns: dict[int, int],
    start_ns: int,
    count: int,
) -> int:
    """Return how many of the first ``count`` queued requests to batch so that the work the
    admission ledger booked on ``executor`` for other batches still meets its deadlines: all
    of them if that fits, else the largest smaller batch size that does, but never fewer than
    the head's own booked batch holds at the front of the queue (it was promised that)."""
    requests = model.queue.first_live(count)
    head_batch = requests[0].booked_batch
    floor = 1
    while floor < count and requests[floor].booked_batch is head_batch is not None:
        floor += 1
    if floor >= count:
        return count
    for candidate in (count, *(b for b in reversed(model.spec.batch_sizes) if floor < b < count)):
        cost_ns = exec_ns[model.padded_batch(candidate)]
        if dispatch_fits(core, executor, requests[:candidate], start_ns, cost_ns):
            return candidate
    return floor


def head_first_loses(
    model: ModelState, exec_ns: dict[int, int], after_ns: int, head_count: int
) -> bool:
    """Return True when the first request left behind by the head's batch could no longer
    start, even alone, once that batch ends at ``after_ns``: the lane is behind what
    admission promised, and some request is lost whichever batch goes first. Otherwise the
    head's batch goes, as the admission ledger booked it, and nobody is lost."""
    following = model.queue.nth_live(head_count)
    if following is None:
        return False
    return after_ns + exec_ns[model.spec.batch_sizes[0]] > following.internal_deadline_ns


def fuller_batch(
    model: ModelState,
    exec_ns: dict[int, int],
    start_ns: int,
    head_count: int,
    head_exec_ns: int,
) -> Batch | None:
    """Return a batch of more than ``head_count`` requests that skips the most urgent ones,
    when serving the head's batch first would make it miss; else None (head first). Asked
    only when some request is lost either way (``_head_first_loses``).

    For each batch size b, largest first, the candidate is the b requests from the first whose
    deadline allows a batch of b to start now. The first candidate larger than the head's
    batch decides: if it could still start after the head's batch, the head goes first (no
    loss); otherwise the larger batch goes now and the skipped requests are left to other
    copies or dropped (under overload this keeps batches, hence goodput, at their largest).
    """
    queue = model.queue
    for size in reversed(model.spec.batch_sizes):
        if size <= head_count:
            return None
        position = queue.position_at_least(start_ns + exec_ns[size])
        first = queue.first_from(position)
        if first is None:
            continue
        count = min(size, _live_count_from(model, position, size))
        if count <= head_count:
            continue
        latest_ns = first.internal_deadline_ns - exec_ns[model.padded_batch(count)]
        if latest_ns >= start_ns + head_exec_ns:
            return None
        return batch_from(model, exec_ns, position, count, first.internal_deadline_ns)
    return None


def _live_count_from(model: ModelState, position: int, limit: int) -> int:
    return model.queue.count_from(position, limit)


def fifo_batch(core: CoreState, executor: ExecutorState, model: ModelState) -> Batch:
    """Plan the first queued requests, up to the largest batch, with no deadline to keep."""
    count = min(model.queued, model.max_batch)
    padded = model.padded_batch(count)
    predicted_ns = predict(core, model, executor).exec_ns[padded]
    return Batch(0, count, padded, predicted_ns, FAR_FUTURE_NS)
