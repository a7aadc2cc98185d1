"""The loop as a lane (runtime/timers.py LoopLane) and the door it keeps (Dispatcher):
learned costs, delay, refusal ``overloaded`` while the loop is too far behind; exactly, on
hand-moved clocks."""

from __future__ import annotations

import pytest

from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.outcomes import Outcome
from clockwork_async.runtime.config import RuntimeConfig
from clockwork_async.runtime.dispatcher import Dispatcher
from clockwork_async.runtime.timers import LoopCost, LoopLane

from .test_dispatch import FakeLink, _model, _row

MS = 1_000_000
US = 1_000


def test_booked_work_is_the_lanes_delay_and_a_refusal_books_less() -> None:
    lane = LoopLane(prior=LoopCost(request_ns=100 * US, byte_ns=1.0, refusal_ns=10 * US))
    lane.book(0, 1_000, admitted=True)  # 100 us + 1,000 bytes x 1 ns
    lane.book(0, 0, admitted=False)
    assert lane.delay_ns(0) == 111 * US
    assert lane.delay_ns(50 * US) == 61 * US
    assert lane.delay_ns(1 * MS) == 0
    lane.book(1 * MS, 0, admitted=True)  # an idle lane starts from now
    assert lane.delay_ns(1 * MS) == 100 * US


def _samples(lane: LoopLane, truth: LoopCost, other_ns: int) -> None:
    """Eight intervals whose requests, bytes and refusals vary independently; each busy for
    exactly what ``truth`` says, plus ``other_ns`` of other work."""
    plan = [
        (10, 5, 1),
        (20, 1, 4),
        (5, 3, 9),
        (30, 8, 2),
        (15, 2, 7),
        (25, 6, 5),
        (8, 9, 3),
        (12, 4, 8),
    ]
    for admitted, kib_each, refused in plan:
        for _ in range(admitted):
            lane.book(0, kib_each * 1024, admitted=True)
        for _ in range(refused):
            lane.book(0, 0, admitted=False)
        busy_ns = (
            admitted * (truth.request_ns + kib_each * 1024 * truth.byte_ns)
            + refused * truth.refusal_ns
            + other_ns
        )
        lane.observe(int(busy_ns))


def test_costs_are_learned_from_the_loops_busy_time() -> None:
    prior = LoopCost(request_ns=50 * US, byte_ns=0.5, refusal_ns=15 * US)
    lane = LoopLane(prior=prior, min_samples=4)
    lane.observe(1 * MS)
    assert lane.cost == prior  # too few samples with requests: the prior
    truth = LoopCost(request_ns=200 * US, byte_ns=2.0, refusal_ns=20 * US)
    _samples(lane, truth, other_ns=0)
    assert lane.cost.request_ns == pytest.approx(truth.request_ns, rel=1e-6)
    assert lane.cost.byte_ns == pytest.approx(truth.byte_ns, rel=1e-6)
    assert lane.cost.refusal_ns == pytest.approx(truth.refusal_ns, rel=1e-6)


def test_the_loops_other_work_is_not_charged_to_requests() -> None:
    prior = LoopCost(request_ns=50 * US, byte_ns=0.5, refusal_ns=15 * US)
    lane = LoopLane(prior=prior, min_samples=4)
    truth = LoopCost(request_ns=100 * US, byte_ns=1.0, refusal_ns=20 * US)
    _samples(lane, truth, other_ns=5 * MS)  # uploads and heartbeats in every interval
    assert lane.cost.request_ns == pytest.approx(truth.request_ns, rel=1e-6)
    assert lane.cost.byte_ns == pytest.approx(truth.byte_ns, rel=1e-6)
    assert lane.cost.refusal_ns == pytest.approx(truth.refusal_ns, rel=1e-6)


async def test_the_door_refuses_overloaded_while_the_loop_is_too_far_behind() -> None:
    now = [1_000 * MS]
    runtime = RuntimeConfig(max_loop_delay_ns=1 * MS)  # under a quarter of the 100 ms SLO
    dispatcher = Dispatcher(ControllerConfig(), runtime, now_ns=lambda: now[0])
    dispatcher.add_model(_model())
    dispatcher.executor_joined("e1", FakeLink(), ("a",))  # type: ignore[arg-type]
    dispatcher.loop_lane.cost = LoopCost(request_ns=400 * US, byte_ns=0.0, refusal_ns=10 * US)
    replies: dict[int, Outcome] = {}
    messages: dict[int, str] = {}

    def submit() -> int:
        def reply(outcome: object) -> None:
            replies[outcome.request_id] = outcome.outcome  # type: ignore[attr-defined]
            messages[outcome.request_id] = outcome.message  # type: ignore[attr-defined]

        return dispatcher.submit_by("a", _row(), deadline_ns=now[0] + 100 * MS, on_reply=reply)

    ids = [submit() for _ in range(4)]  # 0, 0.4, then 0.8 and 1.2 ms of work ahead (limit 1)
    assert [replies.get(i) for i in ids] == [None, None, None, Outcome.OVERLOADED]
    refusal = messages[ids[3]]
    assert "the daemon itself is overloaded" in refusal and "retry after" in refusal
    now[0] += 1 * MS  # the loop caught up
    later = submit()
    assert later not in replies
    # With a long cap, a quarter of the SLO is the limit: 0.4 ms ahead > 0.25 ms.
    dispatcher.runtime = RuntimeConfig(max_loop_delay_ns=50 * MS)
    dispatcher.submit_by("a", _row(), deadline_ns=now[0] + 1 * MS, on_reply=print)
    assert dispatcher.book.outcomes["overloaded"] == 2
    dispatcher.close()


async def test_the_door_screens_a_header_by_its_deadline_and_counts_the_refusal() -> None:
    now = [1_000 * MS]
    dispatcher = Dispatcher(ControllerConfig(), now_ns=lambda: now[0], unix_now_ns=lambda: 0)
    dispatcher.add_model(_model())
    assert dispatcher.screen("a", 10 * MS, None, 1_000) is None  # an idle loop takes anything
    dispatcher.loop_lane.book(now[0], 0, admitted=True)  # 60 us of the prior ahead
    assert dispatcher.screen("a", 100 * US, None, 1_000) is not None  # a quarter: 25 us
    assert dispatcher.screen("a", None, None, 1_000) is None  # the model's default: 100 ms
    answers: list[Outcome] = []
    dispatcher.refuse("a", "busy", 1_000, lambda o: answers.append(o.outcome))
    assert answers == [Outcome.OVERLOADED]
    assert dispatcher.book.outcomes == {"overloaded": 1} and dispatcher.book.request_count == 0
    dispatcher.close()


def test_a_requests_wait_for_the_loop_is_its_measured_delay() -> None:
    lane = LoopLane(prior=LoopCost(request_ns=100 * US, byte_ns=0.0, refusal_ns=10 * US))
    slo_ns, share, cap_ns = 80 * MS, 0.25, 50 * MS  # a limit of 20 ms
    assert lane.refusal(slo_ns, 0, share=share, cap_ns=cap_ns, waited_ns=20 * MS) is None
    refusal = lane.refusal(slo_ns, 0, share=share, cap_ns=cap_ns, waited_ns=21 * MS)
    assert refusal is not None and "runs 21.00 ms behind" in refusal
    lane.book(0, 0, admitted=True)  # booked work ahead (0.1 ms) adds nothing to a longer wait
    assert lane.refusal(slo_ns, 0, share=share, cap_ns=cap_ns, waited_ns=20 * MS) is None
    assert lane.refusal(slo_ns, 0, share=share, cap_ns=0, waited_ns=60 * MS) is None  # cap 0


async def test_a_screens_slo_counts_from_before_the_requests_wait_for_the_loop() -> None:
    now = [1_000 * MS]
    dispatcher = Dispatcher(ControllerConfig(), now_ns=lambda: now[0], unix_now_ns=lambda: 0)
    dispatcher.add_model(_model())
    # 20 ms waited of a 100 ms SLO: 80 ms left, a quarter of it 20 ms: taken; 21 ms: refused
    assert dispatcher.screen("a", 100 * MS, None, 1_000, waited_ns=20 * MS) is None
    assert dispatcher.screen("a", 100 * MS, None, 1_000, waited_ns=21 * MS) is not None
    assert dispatcher.screen("a", None, None, 1_000, waited_ns=21 * MS) is not None  # default
    # a Unix deadline 200 ms away keeps all of it (a limit of 50 ms), not 155 ms (38.75 ms)
    assert dispatcher.screen("a", None, 200 * MS, 1_000, waited_ns=45 * MS) is None
    # a Unix deadline is absolute: the wait is not taken from it again
    assert dispatcher._deadline_ns("a", None, 2 * MS, now[0], waited_ns=5 * MS) == now[0] + 2 * MS
    assert dispatcher._deadline_ns("a", 30 * MS, None, now[0], waited_ns=5 * MS) == now[0] + 25 * MS
    assert dispatcher._deadline_ns("a", None, None, now[0], waited_ns=5 * MS) == now[0] + 95 * MS
    dispatcher.close()


def test_a_wait_unread_in_the_socket_is_held_to_its_share_of_the_slo_not_the_cap() -> None:
    """A frame that waited unread (`ReadTurn.backlog_ns`): refused past a quarter of its SLO,
    however long that is (the cap bounds work still ahead, not a wait already over)."""
    lane = LoopLane(prior=LoopCost(request_ns=100 * US, byte_ns=0.0, refusal_ns=10 * US))
    share, cap_ns = 0.25, 50 * MS
    assert lane.refusal(10_000 * MS, 0, share=share, cap_ns=cap_ns, unread_ns=90 * MS) is None
    refusal = lane.refusal(100 * MS, 0, share=share, cap_ns=cap_ns, unread_ns=26 * MS)
    assert refusal is not None and "waited 26.00 ms unread in its connection" in refusal
    assert lane.refusal(100 * MS, 0, share=share, cap_ns=cap_ns, unread_ns=25 * MS) is None
    assert lane.refusal(100 * MS, 0, share=share, cap_ns=0, unread_ns=90 * MS) is None  # no door
