"""A model's request queue: taking a run of live requests leaves the rest in key order,
whether the run reaches the end of the queue or not."""

from __future__ import annotations

from clockwork_async.core.entities import ModelState, RequestState
from clockwork_async.core.queues import RequestStatus

from .harness import make_spec


def queue_of(keys: list[int]) -> tuple[ModelState, list[RequestState]]:
    model = ModelState(make_spec("a"))
    requests = [RequestState(i, model, 0, 10 * key, 10 * key, key) for i, key in enumerate(keys)]
    for request in requests:
        model.queue.push(request)
    return model, requests


def ids(requests: list[RequestState]) -> list[int]:
    return [request.request_id for request in requests]


def test_taking_to_the_end_leaves_the_front() -> None:
    model, requests = queue_of([1, 2, 3, 4])
    requests[3].status = RequestStatus.DONE  # answered while queued: skipped, then removed
    assert ids(model.queue.take_from(1, 5)) == [1, 2]
    assert ids(list(model.queue.live())) == [0]
    assert model.queue.last_key_ns() == 1
    model.queue.push(requests[3])  # back, alive: keys and requests still pair up
    requests[3].status = RequestStatus.QUEUED
    assert ids(list(model.queue.live())) == [0, 3]


def test_taking_from_the_middle_leaves_both_sides_in_order() -> None:
    model, _requests = queue_of([1, 2, 3, 4, 5])
    assert ids(model.queue.take_from(1, 2)) == [1, 2]
    assert ids(list(model.queue.live())) == [0, 3, 4]
    assert model.queue.position_at_least(4) == 1  # keys moved with their requests
    assert ids(model.queue.take_from(0, 3)) == [0, 3, 4]
    assert model.queue.peek() is None and model.queue.last_key_ns() is None
