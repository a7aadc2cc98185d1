"""How much execute time the admission ledger books for a batch (docs/controller.md,
"Admission", "Room"): the capacity rule's target batch, and the rows a new batch is booked
as when its model's arrivals are expected to fill it.

Invariants: these functions only read the state, but ``note_booking`` (a model's share of
in-order bookings); a booked batch's cost is exec(max(members, room rows), padded), so room
booked for members still to come keeps other work from being promised that time. Room
beyond batch 1 is booked only while the model is refused (admission is the bottleneck: the
lane time is worth sharing out in full batches) and its arrivals mostly sort last in its
queue (they could join); it is sized to serve the most rows per unit of execute time for
the members expected before the batch's booked start (the model's decayed arrival rate).
"""

from __future__ import annotations

from .entities import BookedBatch, ModelState
from .profiles import KindPredictions
from .state import CoreState

IN_ORDER_GAIN = 1 / 32  # weight of the newest booking in a model's ``in_order_share``
# Below this share of in-order bookings (mixed deadlines) a new batch books no room beyond
# batch 1: few arrivals could join it (on the mixed-SLO soak of tests/core/test_soak.py,
# rooms without this rule cost 8% of goodput over ten seeds).
IN_ORDER_MIN = 0.9
TARGET_CACHE = 64  # target batch times cached per (model, kind), by SLO budget


def rows_per_ns(rows: int, expected: float, exec_ns: dict[int, int]) -> float:
    """Requests served per ns by a batch of ``rows`` that ``expected`` members join."""
    return min(rows, expected) / exec_ns[rows]


def arrival_rate(core: CoreState, model: ModelState) -> float:
    """``model``'s recent arrivals per ns (accepted or not; the decayed demand)."""
    window_ns = core.config.utilisation_window_ns
    return model.demand_now(core.now_ns, window_ns) / window_ns


def room_rows(
    core: CoreState,
    model: ModelState,
    exec_ns: dict[int, int],
    room_ns: int,
    budget_ns: int,
    start_ns: int,
) -> int:
    """Return the rows to book a new batch starting at ``start_ns`` as: the batch size that
    serves the most requests per unit of execute time for the members expected by then
    (ties: the smaller), no costlier than ``room_ns`` (the target) and ending within the
    request's ``budget_ns``; batch 1 unless the model was refused within the last half of
    that budget and its bookings mostly sort last in its queue."""
    now_ns = core.now_ns
    sizes = model.spec.batch_sizes
    if (
        model.in_order_share < IN_ORDER_MIN
        or now_ns - model.refused_at_ns > budget_ns // 2
        or start_ns <= now_ns
    ):
        return sizes[0]
    expected = 1.0 + model.in_order_share * arrival_rate(core, model) * (start_ns - now_ns)
    best = sizes[0]
    best_rate = rows_per_ns(best, expected, exec_ns)
    for size in sizes[1:]:
        size_ns = exec_ns[size]
        if size_ns > room_ns or start_ns + size_ns > now_ns + budget_ns:
            break
        size_rate = rows_per_ns(size, expected, exec_ns)
        if size_rate > best_rate:
            best, best_rate = size, size_rate
    return best


def grow_pays(
    core: CoreState,
    model: ModelState,
    exec_ns: dict[int, int],
    batch: BookedBatch,
    rows_now: int,
    rows_grown: int,
) -> bool:
    """Whether growing ``batch`` past its padded size (``rows_now`` -> ``rows_grown``) serves
    at least as many requests per unit of execute time, for the members expected by its
    booked start; if not, the request opens a new batch instead (when that fits)."""
    wait_ns = max(0, batch.start_ns - core.now_ns)
    expected = batch.size + 1 + arrival_rate(core, model) * wait_ns
    return rows_per_ns(rows_grown, expected, exec_ns) >= rows_per_ns(rows_now, expected, exec_ns)


def note_booking(model: ModelState, in_order: bool) -> None:
    """Count a booking in ``model``'s share of bookings that sorted last in its queue."""
    model.in_order_share += (float(in_order) - model.in_order_share) * IN_ORDER_GAIN


def target_ns(model: ModelState, predictions: KindPredictions, budget_ns: int) -> int:
    """Return ``target_batch_ns``, cached per budget until a prediction changes."""
    targets = predictions.targets
    found_ns = targets.get(budget_ns)
    if found_ns is None:
        if len(targets) >= TARGET_CACHE:
            targets.clear()
        found_ns = targets[budget_ns] = target_batch_ns(model, predictions.exec_ns, budget_ns)
    return found_ns


def target_batch_ns(model: ModelState, exec_ns: dict[int, int], budget_ns: int) -> int:
    """Return exec(b) for the largest batch size b with 2 * exec(b) <= ``budget_ns`` (the
    request's internal SLO), or 0 when none fits."""
    found_ns = 0
    for size in model.spec.batch_sizes:
        size_ns = exec_ns[size]
        if 2 * size_ns > budget_ns:
            break
        found_ns = size_ns
    return found_ns
