"""The simulator's outstanding requests: each entry handed out once, ids kept across the
cuts of the answered prefix."""

from __future__ import annotations

from clockwork_async.sim.pending import TRIM_AT, PendingRequests


def entry(request_id: int) -> tuple[int, int, int, bool]:
    return (request_id % 7, request_id, request_id + 100, request_id % 2 == 0)


def test_each_entry_is_taken_once_and_unknown_ids_get_none() -> None:
    pending = PendingRequests()
    for request_id in range(3):
        pending.add(entry(request_id))
    assert pending.take(1) == entry(1)
    assert pending.take(1) is None  # a second reply
    assert pending.take(3) is None and pending.take(-1) is None  # never added
    assert (pending.outstanding, pending.ids()) == (2, [0, 2])


def test_the_answered_prefix_is_cut_and_ids_still_find_their_entries() -> None:
    pending = PendingRequests()
    count = 3 * TRIM_AT
    for request_id in range(count):
        pending.add(entry(request_id))
    for request_id in range(2 * TRIM_AT):  # answered in order: the prefix is cut
        assert pending.take(request_id) == entry(request_id)
    assert len(pending._entries) < count  # cut (a list slot a request otherwise)
    assert pending.take(5) is None  # below the cut: answered already
    pending.add(entry(count))
    assert pending.take(count) == entry(count)
    assert pending.take(2 * TRIM_AT + 1) == entry(2 * TRIM_AT + 1)
    assert pending.outstanding == TRIM_AT - 1
    assert pending.ids() == [2 * TRIM_AT, *range(2 * TRIM_AT + 2, count)]


def test_an_unanswered_request_keeps_every_later_one_findable() -> None:
    pending = PendingRequests()
    for request_id in range(4 * TRIM_AT):
        pending.add(entry(request_id))
    for request_id in range(1, 4 * TRIM_AT):  # 0 is never answered: nothing can be cut
        assert pending.take(request_id) == entry(request_id)
    assert (pending.outstanding, pending.ids()) == (1, [0])
    assert pending.take(0) == entry(0)
    assert pending.outstanding == 0 and pending.ids() == []
