"""The driver's book: batches from requests, results back to requests, clock translation."""

from __future__ import annotations

import numpy as np

from clockwork_async.core.events import Reply, StartInfer, StartLoad, StartUnload
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.hop import HopEstimate
from clockwork_async.runtime.requests import (
    ActionRecord,
    InferOutcome,
    PendingRequest,
    RequestBook,
)
from clockwork_async.wire.messages import ActionResult, TensorSpec

SPECS = (TensorSpec("x", "float32", (-1, 2)),)
OFFSET_NS = 1_000_000  # executor clock = controller clock + 1 ms


def _request(request_id: int, value: float) -> PendingRequest:
    inputs = {"x": np.full((1, 2), value, dtype=np.float32)}
    return PendingRequest(
        request_id, "m", inputs, lambda _o: None, arrival_ns=100, deadline_ns=10**9
    )


def _book(*values: float) -> RequestBook:
    book = RequestBook()
    for index, value in enumerate(values, start=1):
        book.add_request(_request(index, value))
    return book


def _infer(request_ids: tuple[int, ...], batch_size: int) -> ActionRecord:
    command = StartInfer("e", 7, "m", batch_size, request_ids, 5_000, 6_000, predicted_ns=400)
    return ActionRecord.infer(command, now_ns=4_000)


def test_infer_message_stacks_pads_and_shifts_the_window() -> None:
    book = _book(1.0, 2.0, 3.0)
    message = book.infer_message(_infer((1, 2, 3), 4), SPECS, OFFSET_NS)
    assert message is not None
    assert message.inputs["x"][:, 0].tolist() == [1.0, 2.0, 3.0, 3.0]
    assert (message.earliest_ns, message.latest_ns) == (5_000 + OFFSET_NS, 6_000 + OFFSET_NS)
    assert book.request(1) is not None and book.request(1).sent_ns == 4_000  # type: ignore[union-attr]


def test_a_request_gone_meanwhile_keeps_its_row_position() -> None:
    book = _book(1.0, 2.0, 3.0)
    book.pop_request(2)
    message = book.infer_message(_infer((1, 2, 3), 4), SPECS, 0)
    assert message is not None
    assert message.inputs["x"][:, 0].tolist() == [1.0, 1.0, 3.0, 3.0]
    book.pop_request(1)
    book.pop_request(3)
    assert book.infer_message(_infer((1, 2, 3), 4), SPECS, 0) is None


def test_a_warm_up_of_no_request_runs_on_zeros() -> None:
    message = _book(1.0).infer_message(_infer((), 1), SPECS, OFFSET_NS)
    assert message is not None and message.batch_size == 1
    assert message.inputs["x"].tolist() == [[0.0, 0.0]]
    assert (message.earliest_ns, message.latest_ns) == (5_000 + OFFSET_NS, 6_000 + OFFSET_NS)


def _finished_book() -> tuple[RequestBook, ActionRecord]:
    book = _book(1.0, 2.0)
    action = _infer((1, 2), 2)
    book.add_action(action)
    action.result = ActionResult(
        7,
        start_ns=5_100 + OFFSET_NS,
        end_ns=5_700 + OFFSET_NS,
        durations_ns={"copy_in": 10, "execute": 500, "copy_out": 20},
        outputs={"y": np.array([[10.0], [20.0]], dtype=np.float32)},
    )
    return book, action


def test_finished_event_is_in_controller_time_with_the_execute_phase() -> None:
    _, action = _finished_book()
    assert action.result is not None
    event = action.finished_event(action.result, OFFSET_NS)
    assert (event.start_ns, event.end_ns, event.duration_ns, event.code) == (5_100, 5_700, 500, "")
    not_run = action.finished_event(ActionResult(7, "too_late"), OFFSET_NS)
    assert (not_run.start_ns, not_run.end_ns, not_run.code) == (0, 0, "too_late")


def test_an_ok_reply_gets_its_own_row_and_timings() -> None:
    book, _ = _finished_book()
    request = book.pop_request(2)
    assert request is not None
    outcome = book.outcome(request, Reply(2, Outcome.OK, action_id=7, executor_id="e"), 9_000)
    assert isinstance(outcome, InferOutcome)
    assert outcome.outputs["y"].tolist() == [[20.0]]
    assert (outcome.executor_id, outcome.batch_size) == ("e", 2)
    timing = outcome.timing_ns
    assert (timing["total"], timing["execute"], timing["predicted_execute"]) == (8_900, 500, 400)
    assert timing["executor"] == 600


def test_ok_without_a_result_becomes_failed() -> None:
    book = _book(1.0)
    request = book.pop_request(1)
    assert request is not None
    outcome = book.outcome(request, Reply(1, Outcome.OK, action_id=99), 1_000)
    assert outcome.outcome is Outcome.FAILED and outcome.outputs == {}


def test_action_indexes_follow_the_book() -> None:
    book = RequestBook()
    load = ActionRecord.load(StartLoad("e", 1, "m", 0, 10), 0)
    unload = ActionRecord.unload(StartUnload("f", 2, "m"), 0)
    book.add_action(load)
    book.add_action(unload)
    assert book.actions_for_model("m") == 2
    assert book.actions_of("e") == [load]
    assert book.finish_action(1) is load
    assert book.finish_action(1) is None
    assert book.actions_for_model("m") == 1 and book.actions_of("e") == []
    loaded: set[str] = set()
    load.track_loaded(loaded, ActionResult(1))
    assert loaded == {"m"}
    unload.track_loaded(loaded, ActionResult(2))
    assert loaded == set()
    assert load.load_message(OFFSET_NS).earliest_ns == OFFSET_NS


def test_the_return_hop_estimate_is_a_padded_clamped_percentile() -> None:
    hop = HopEstimate(window=100, percentile=99.0, slack=0.1, initial_ns=500_000, refresh_every=1)
    assert hop.estimate_ns == 500_000
    for _ in range(99):
        hop.add(200_000, 0)
    hop.add(10_000_000, 0)  # one outlier in 100: p99 (nearest rank) is still 200 us
    assert hop.estimate_ns == 220_000
    for _ in range(100):
        hop.add(1_000, 0)
    assert hop.estimate_ns == 50_000  # the floor
    for _ in range(100):
        hop.add(1_000_000_000, 0)
    assert hop.estimate_ns == 10_000_000  # the ceiling


def test_a_stale_return_hop_tail_is_forgotten_once_per_stale_period() -> None:
    hop = HopEstimate(window=100, slack=0.0, refresh_every=1, stale_ns=1_000)
    for i in range(100):
        hop.add(200_000 if i % 2 else 8_000_000, now_ns=10)  # a burst left half the window slow
    assert hop.estimate_ns == 8_000_000
    assert not hop.relieve(now_ns=1_009)  # a sample came less than stale_ns ago
    assert hop.estimate_ns == 8_000_000
    assert hop.relieve(now_ns=1_010)  # no action ran for stale_ns: the slow half goes
    assert hop.estimate_ns == 200_000
    assert not hop.relieve(now_ns=2_009)  # once per stale period
    hop.add(5_000_000, now_ns=2_100)  # measured again: the tail comes back honestly
    assert hop.estimate_ns == 5_000_000
