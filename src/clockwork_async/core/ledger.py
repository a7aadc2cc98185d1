"""The admission ledger: the execute work each executor has promised to requests still queued,
and the LOADs promised to models that have no copy yet (docs/controller.md, "Admission").

The clockwork policy accepts a request only when this ledger, kept from the scheduler's own
state, says it will be served by its internal deadline: on the chosen executor, after the
committed work of its execute lane and every batch booked there (whatever its model), or,
when that is too late, ahead of the booked batches with later deadlines, if they all still
end by theirs.

One idea: the admission ledger (quote, book, unbook, reserve), one module because every
function keeps the same chain of booked batches that the argument below rests on.

Invariants:
- every QUEUED request the clockwork policy accepted is booked in exactly one BookedBatch of
  one executor (``request.planned_on``, ``request.booked_batch``); a batch's ``live`` counts
  its members still queued, its ``cost_ns`` is exec(its size, padded) and an executor's
  ``backlog_ns`` is the sum of its live batches' costs; a booking leaves when its request
  leaves the queue (dispatched, or answered), and a batch's cost when its last member does;
- an executor's ``booked`` list is in the order its batches are predicted to run: booking
  order, except that a batch booked ahead sits before the later-deadline batches it
  overtook; ``index`` is a batch's position (plus ``booked_head``); each live batch's
  predicted start is no earlier than the end of the live one before it or than its model's
  LOAD (projections only move later: pushed by growth or by a batch booked ahead of them,
  never pulled earlier), except a batch booked after one whose members all ran early (in
  the gap before a LOAD): it starts after the committed work and the booked cost;
- a model with queued requests and no copy has at most one reserved LOAD (``reserved_on``),
  listed in that executor's ``reserved`` in reservation order, its pages held (counted in
  ``pages_used``) until placement starts it, before any other LOAD on that executor.

Why this keeps promises: earliest deadline first serves a request r after the requests with
earlier deadlines only. When the last of those was admitted, all the work booked before it
(them included) fitted before its deadline, which is no later than r's; and when r is booked
ahead of later-deadline batches, each of them is checked to still end in time behind it (work
booked before r with a later deadline ends, pushed by r, no later than r's deadline, so by
its own). Batches make it approximate:
a request joins its model's last batch only while that batch and every batch booked after it
still end in time, and the scheduler takes no request booked later into a batch when that
would push other booked work past its deadline (batching.count_keeping_promises).
"""

from __future__ import annotations

from .entities import BookedBatch, ExecutorState, ModelState, RequestState
from .eviction import choose_victims, send_unload
from .quotes import Quote
from .room import grow_pays, note_booking, room_rows, target_ns
from .state import CoreState, predict

DEMAND_MODELS = 4096  # most models remembered as wanted after rejections (oldest forgotten)


def best_quote(core: CoreState, model: ModelState, internal_deadline_ns: int) -> Quote | None:
    """Return the quote that ends soonest: over the model's copies (loaded, or loading), or,
    with no copy, a reserved or new LOAD then execute. None when no executor could hold it."""
    if not model.has_copy():
        return quote_cold(core, model, internal_deadline_ns)
    # Loaded copies, then loading ones (two calls, not a loop over a tuple of both: compiled,
    # a loop over a tuple is a generic iteration).
    best = _best_copy_quote(core, model, model.loaded_on, None, internal_deadline_ns)
    return _best_copy_quote(core, model, model.loading_on, best, internal_deadline_ns)


def _best_copy_quote(
    core: CoreState,
    model: ModelState,
    copies: dict[str, None],
    best: Quote | None,
    internal_deadline_ns: int,
) -> Quote | None:
    """Return the quote that ends soonest: ``best`` or one on a copy in ``copies``."""
    executors = core.executors
    for executor_id in copies:
        quote = quote_copy(core, model, executors[executor_id], internal_deadline_ns)
        if best is None or quote.finish_ns < best.finish_ns:
            best = quote
    return best


def quote_copy(
    core: CoreState, model: ModelState, executor: ExecutorState, internal_deadline_ns: int
) -> Quote:
    """Quote a request on a copy (loading: not before its LOAD is predicted to end)."""
    now_ns = core.now_ns
    ready_ns = 0
    load = executor.loading.get(model.name)
    if load is not None:
        executor.load_lane.free_at(now_ns)  # resynchronises the LOAD's predicted end
        ready_ns = load.planned_end_ns
    return _quote_on(core, model, executor, ready_ns, internal_deadline_ns)


def quote_cold(core: CoreState, model: ModelState, internal_deadline_ns: int) -> Quote | None:
    """Quote a request of a model with no copy: behind its reserved LOAD if it has one, else
    a new reservation on the executor where it would end soonest (None: none can hold it)."""
    now_ns = core.now_ns
    reserved = model.reserved_on
    if reserved is not None:
        ready_ns = model.reserved_ready_ns
        quote = _quote_on(core, model, reserved, ready_ns, internal_deadline_ns)
        quote.ready_ns = ready_ns
        return quote
    best: Quote | None = None
    need_pages = model.spec.weights_pages
    for executor in core.executors.values():
        if executor.pages_total < need_pages:
            continue
        load_ns = predict(core, model, executor).load_ns
        load_start_ns = executor.load_lane.start_for(now_ns) + executor.reserved_load_ns
        ready_ns = load_start_ns + load_ns
        quote = _quote_on(core, model, executor, ready_ns, internal_deadline_ns)
        # Pages now: free, or held by evicting idle models (never ones with queued work).
        victims = choose_victims(core, executor, need_pages, False, for_model=model)
        if victims is None:
            continue
        quote.ready_ns, quote.load_ns, quote.victims = ready_ns, load_ns, victims
        if best is None or _better_cold(quote, best, internal_deadline_ns):
            best = quote
    return best


def _better_cold(quote: Quote, best: Quote, internal_deadline_ns: int) -> bool:
    """Whether a cold start as ``quote`` says beats ``best``: when both meet the deadline, one
    that evicts nothing wins (an eviction now is a LOAD later), then the one ending sooner;
    otherwise the one ending sooner."""
    if quote.finish_ns <= internal_deadline_ns and best.finish_ns <= internal_deadline_ns:
        return (bool(quote.victims), quote.finish_ns) < (bool(best.victims), best.finish_ns)
    return quote.finish_ns < best.finish_ns


def booked_end_ns(executor: ExecutorState, now_ns: int) -> int:
    """Return when the work booked on ``executor`` is predicted to end: its committed work,
    then the booked cost; no earlier than the last booked batch's end (batches may wait for
    a LOAD, leaving gaps the cost alone does not show)."""
    end_ns = executor.exec_lane.start_for(now_ns) + executor.backlog_ns
    booked = executor.booked
    if booked and booked[-1].live and booked[-1].end_ns > end_ns:
        return booked[-1].end_ns
    return end_ns


def waits_for_load_before(executor: ExecutorState, batch: BookedBatch | None) -> int | None:
    """Return when the LOAD of a model is predicted to end whose batch is booked on
    ``executor`` before ``batch`` (None: no such batch, or ``batch`` is not booked here)."""
    if batch is None or not executor.loading:
        return None
    booked = executor.booked
    for position in range(max(0, batch.index - executor.booked_head)):
        earlier = booked[position]
        load = executor.loading.get(earlier.model)
        if earlier.live and load is not None:
            return load.planned_end_ns
    return None


def _quote_on(
    core: CoreState,
    model: ModelState,
    executor: ExecutorState,
    ready_ns: int,
    internal_deadline_ns: int,
) -> Quote:
    """Quote a request on ``executor``, where its model's copy is ready at ``ready_ns``.

    A request that sorts last in its model's queue joins its model's last booked batch there
    while that batch still ends by its earliest deadline and every batch booked after it,
    pushed back by the growth, still ends by its own. Else it opens a new batch, booked a
    batch-1 time, but admitted only if it would still end in time grown to the model's
    *target batch* (the largest b with 2 * exec(b) <= its internal SLO: the capacity rule),
    or half-way there for the model's first batch on this executor. That room is what later
    requests join into, or what joins into earlier batches push it back by; without it,
    under overload every request opens a batch at the very edge of its deadline and the lane
    degenerates into batches of one (docs/controller.md has the measurements). While its
    model is being refused, a new batch is booked as the rows its expected members fill
    (room.py), and a join that would grow a batch past its padded size opens a new batch
    instead when that serves fewer requests per unit of time (and a new batch fits). A new batch
    that would not end in time after all the booked work may go ahead of the batches with
    later deadlines (``_quote_ahead``).
    """
    now_ns = core.now_ns
    base_ns = max(booked_end_ns(executor, now_ns), ready_ns)
    predictions = predict(core, model, executor)
    exec_ns = predictions.exec_ns
    batch = executor.open_batches.get(model.name)
    last_key_ns = model.queue.last_key_ns()
    in_order = last_key_ns is None or internal_deadline_ns >= last_key_ns
    joined: Quote | None = None
    if batch is not None and batch.size < model.max_batch and in_order:
        rows_now = model.padded_batch(max(batch.size, batch.room))
        rows_grown = model.padded_batch(max(batch.size + 1, batch.room))
        grown_ns = exec_ns[rows_grown]
        share_ns = grown_ns - exec_ns[rows_now]
        end_ns = batch.start_ns + grown_ns
        if end_ns <= min(batch.deadline_ns, internal_deadline_ns) and _chain(
            executor, batch.index + 1, batch.end_ns + share_ns, {}, apply=False
        ):
            joined = Quote(executor, base_ns + share_ns, share_ns, True, batch.start_ns)
            if share_ns == 0 or grow_pays(core, model, exec_ns, batch, rows_now, rows_grown):
                return joined
    budget_ns = internal_deadline_ns - now_ns
    room_ns = target_ns(model, predictions, budget_ns)
    rows = room_rows(core, model, exec_ns, room_ns, budget_ns, base_ns)
    share_ns = exec_ns[rows]
    if batch is None and room_ns > share_ns:  # its first batch here: half the room
        room_ns = share_ns + (room_ns - share_ns) // 2
    grow_ns = max(share_ns, room_ns)
    quote = Quote(executor, base_ns + grow_ns, share_ns, False, base_ns, room=rows)
    quote.in_order = in_order
    # Ahead, but not of its own model's open batch: booked apart from it, it would be costed
    # as a batch of its own that the scheduler will not run (it batches them together).
    if quote.finish_ns > internal_deadline_ns and (in_order or batch is None):
        b1_ns = exec_ns[model.spec.batch_sizes[0]]
        ahead = _quote_ahead(core, executor, ready_ns, b1_ns, grow_ns, internal_deadline_ns)
        if ahead is not None:
            return ahead
    if quote.finish_ns > internal_deadline_ns and joined is not None:
        return joined
    return quote


def _quote_ahead(
    core: CoreState,
    executor: ExecutorState,
    ready_ns: int,
    share_ns: int,
    grow_ns: int,
    internal_deadline_ns: int,
) -> Quote | None:
    """Quote a new batch booked ahead of the batches at the end of ``executor``'s booking
    order whose deadlines are later than ``internal_deadline_ns`` (earliest deadline first
    serves it before them): it starts after the live batch before them, and is admitted
    only when it ends in time grown by ``grow_ns`` and every batch it overtakes, pushed back
    by ``share_ns``, still ends by its deadline. None when there is nothing to overtake or
    it does not fit. This is what keeps a short-SLO model served beside a saturating
    long-SLO one (isolation)."""
    booked = executor.booked
    position = len(booked)
    while position > 0 and (
        booked[position - 1].live <= 0 or booked[position - 1].deadline_ns > internal_deadline_ns
    ):
        position -= 1
    if position == len(booked) or not any(batch.live > 0 for batch in booked[position:]):
        return None
    start_ns = max(executor.exec_lane.start_for(core.now_ns), ready_ns)
    if position > 0:
        start_ns = max(start_ns, booked[position - 1].end_ns)
    finish_ns = start_ns + grow_ns
    if finish_ns > internal_deadline_ns:
        return None
    overtaken = executor.booked_head + position
    if not _chain(executor, overtaken, start_ns + share_ns, {}, apply=False):
        return None
    return Quote(executor, finish_ns, share_ns, False, start_ns, ahead_of=position)


def _chain(
    executor: ExecutorState,
    index: int,
    running_ns: int,
    released: dict[int, tuple[BookedBatch, int, int]],
    apply: bool,
) -> bool:
    """Walk the batches booked on ``executor`` from ``index`` on, after work ending at
    ``running_ns``: each starts at the later of its booked start (it may wait for a LOAD) and
    the previous end. Return False if one would end after its deadline (``apply``: push each
    back instead). Batches in ``released`` (by index: batch, members kept, cost released) are
    skipped when emptied, else costed less. Stops at the first batch not pushed at all."""
    booked = executor.booked
    first = index - executor.booked_head
    if first >= len(booked):  # nothing booked after: nothing to push
        return True
    for position in range(max(0, first), len(booked)):
        batch = booked[position]
        if batch.live <= 0:
            continue
        cost_ns = batch.cost_ns
        entry = released.get(batch.index)
        if entry is not None:
            if entry[1] <= 0:
                continue
            cost_ns -= entry[2]
        start_ns = max(batch.start_ns, running_ns)
        end_ns = start_ns + cost_ns
        if end_ns <= batch.end_ns:
            return True
        if not apply and end_ns > batch.deadline_ns:
            return False
        if apply:
            batch.start_ns, batch.end_ns = start_ns, end_ns
        running_ns = end_ns
    return True


def book(core: CoreState, request: RequestState, quote: Quote) -> None:
    """Book a QUEUED request as ``quote`` says (and reserve its model's LOAD if new)."""
    executor = quote.executor
    model = request.model
    note_booking(model, quote.in_order)
    if quote.joins:
        batch = executor.open_batches[model.name]
        batch.size += 1
        batch.live += 1
        batch.cost_ns += quote.share_ns
        batch.end_ns += quote.share_ns
        batch.deadline_ns = min(batch.deadline_ns, request.internal_deadline_ns)
        _chain(executor, batch.index + 1, batch.end_ns, {}, apply=True)
    else:
        batch = _open_batch(executor, model.name, quote, request.internal_deadline_ns)
    executor.backlog_ns += quote.share_ns
    request.planned_on = executor
    request.booked_batch = batch
    if quote.load_ns and model.reserved_on is None:
        reserve(core, model, executor, quote)


def _open_batch(executor: ExecutorState, name: str, quote: Quote, deadline_ns: int) -> BookedBatch:
    """Book a new batch of one request of model ``name`` as ``quote`` says: at the end of
    the booking order, or ahead of later-deadline batches, which it pushes back."""
    booked = executor.booked
    position = len(booked) if quote.ahead_of < 0 else quote.ahead_of
    index = executor.booked_head + position
    batch = BookedBatch(name, index, quote.open_start_ns, quote.share_ns, deadline_ns, quote.room)
    booked.insert(position, batch)
    for later in booked[position + 1 :]:
        later.index += 1
    if quote.ahead_of >= 0:
        _chain(executor, index + 1, batch.end_ns, {}, apply=True)
    executor.open_batches[name] = batch
    return batch


def unbook(request: RequestState) -> None:
    """Take a request off its booked batch (it left the queue; no-op if not booked). The
    batch keeps its cost until its last member leaves (a dropped member's slot is not
    reused: conservative)."""
    executor = request.planned_on
    batch = request.booked_batch
    if executor is None or batch is None:
        return
    request.planned_on = None
    request.booked_batch = None
    batch.live -= 1
    if batch.live <= 0:
        _close(executor, batch, request.model.name)


def _close(executor: ExecutorState, batch: BookedBatch, name: str) -> None:
    executor.backlog_ns -= batch.cost_ns
    batch.cost_ns = 0
    if executor.open_batches.get(name) is batch:
        del executor.open_batches[name]  # all its members left: nothing to join any more
    booked = executor.booked
    dead = 0
    while dead < len(booked) and booked[dead].live <= 0:
        dead += 1
    if dead:
        del booked[:dead]
        executor.booked_head += dead


def _released_by(
    core: CoreState, executor: ExecutorState, requests: list[RequestState]
) -> dict[int, tuple[BookedBatch, int, int]]:
    """For each batch booked on ``executor`` that ``requests`` take members of, keyed by its
    index: (the batch, members it keeps, booked cost released: all of it when emptied, else
    its cost less a batch of the members it keeps)."""
    taken: dict[int, tuple[BookedBatch, int]] = {}
    for request in requests:
        batch = request.booked_batch
        if batch is not None and request.planned_on is executor:
            count = taken[batch.index][1] if batch.index in taken else 0
            taken[batch.index] = (batch, count + 1)
    model = requests[0].model if requests else None
    released: dict[int, tuple[BookedBatch, int, int]] = {}
    for index, (batch, count) in taken.items():
        left = batch.live - count
        released_ns = batch.cost_ns
        if left > 0 and model is not None:
            exec_ns = predict(core, model, executor).exec_ns
            released_ns -= exec_ns[model.padded_batch(min(left, model.max_batch))]
        released[index] = (batch, left, released_ns)
    return released


def dispatch_fits(
    core: CoreState,
    executor: ExecutorState,
    requests: list[RequestState],
    start_ns: int,
    cost_ns: int,
) -> bool:
    """Return True when dispatching ``requests`` as one batch of ``cost_ns`` on ``executor``
    at ``start_ns`` leaves every other batch booked there ending by its deadline."""
    released = _released_by(core, executor, requests)
    return _chain(executor, executor.booked_head, start_ns + cost_ns, released, apply=False)


def unbook_dispatched(
    core: CoreState,
    executor: ExecutorState,
    requests: list[RequestState],
    start_ns: int,
    cost_ns: int,
) -> None:
    """Take a batch dispatched on ``executor`` (``start_ns``, ``cost_ns``) off the ledger.

    A booked batch the dispatch took only part of is costed again as a batch of the members
    it keeps; the batches still booked on ``executor`` are pushed back behind the real batch
    where it overlaps them."""
    if len(requests) == 1 and _unbook_whole(executor, requests[0]):
        _chain(executor, executor.booked_head, start_ns + cost_ns, {}, apply=True)
        return
    released = _released_by(core, executor, requests)
    others: dict[int, BookedBatch] = {}
    for request in requests:
        batch = request.booked_batch
        if batch is not None and request.planned_on is not executor:
            others[id(batch)] = batch  # booked on another copy: its batch shrinks there
        unbook(request)
    for batch, left, released_ns in released.values():
        if left > 0:
            _recost(executor, batch, released_ns)
    _chain(executor, executor.booked_head, start_ns + cost_ns, {}, apply=True)
    for batch in others.values():
        if batch.live > 0:
            batch.size = min(batch.size, batch.live)


def _unbook_whole(executor: ExecutorState, request: RequestState) -> bool:
    """Unbook ``request`` if it is the last live member of a batch booked on ``executor``
    (the common case: nothing to re-cost); return whether it was."""
    batch = request.booked_batch
    if batch is None or request.planned_on is not executor or batch.live != 1:
        return False
    unbook(request)
    return True


def _recost(executor: ExecutorState, batch: BookedBatch, released_ns: int) -> None:
    """Cost a split batch as a batch of its live members (``released_ns`` less than now)."""
    executor.backlog_ns -= released_ns
    batch.cost_ns -= released_ns
    batch.end_ns = batch.start_ns + batch.cost_ns
    batch.size = batch.live
    batch.room = min(batch.room, batch.live)


def reserve(core: CoreState, model: ModelState, executor: ExecutorState, quote: Quote) -> None:
    """Promise ``model`` a LOAD on ``executor``, predicted to end at ``quote.ready_ns``: evict
    the quote's victims now and hold the pages (counted as used) until the LOAD starts."""
    for name in quote.victims or ():
        send_unload(core, executor, name, eviction=True)
    pages = model.spec.weights_pages
    executor.pages_used += pages
    model.reserved_on = executor
    model.reserved_ready_ns = quote.ready_ns
    model.reserved_load_ns = quote.load_ns
    model.reserved_pages = pages
    executor.reserved[model.name] = model
    executor.reserved_load_ns += quote.load_ns
    core.reserving[executor.executor_id] = executor
    core.demand.pop(model.name, None)
    core.placement_dirty = True


def release(model: ModelState) -> None:
    """Cancel ``model``'s reserved LOAD and free its held pages (it is about to start, or no
    request waits for it any more)."""
    executor = model.reserved_on
    if executor is None:
        return
    model.reserved_on = None
    executor.reserved.pop(model.name, None)
    executor.reserved_load_ns -= model.reserved_load_ns
    executor.pages_used -= model.reserved_pages
    model.reserved_load_ns = 0
    model.reserved_pages = 0


def release_if_unwaited(model: ModelState) -> None:
    """Cancel ``model``'s reserved LOAD once none of its requests is queued: nobody waits
    for it (its last one was answered, or runs on a copy elsewhere)."""
    if not model.queued and model.reserved_on is not None:
        release(model)


def note_demand(core: CoreState, model: ModelState) -> None:
    """A request of ``model`` (no copy, no reserved LOAD) was rejected: remember the model
    as wanted, so placement may load it when a load lane has nothing promised to do."""
    demand = core.demand
    if model.name in demand or model.retired:
        return
    demand[model.name] = model
    if len(demand) > DEMAND_MODELS:
        demand.popitem(last=False)
    core.placement_dirty = True
