"""Lanes: ordering by earliest start, too-late rejection, one job at a time, clean shutdown.

Ordering is checked exactly on a virtual clock that jumps (jobs submitted before the lane
starts, so the thread's run is deterministic); the pure `LaneQueue` is in test_lane_rules.py."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
from clockwork_async.executors.lanes import Lane, LaneClosed, LaneJob, Rejection, WarmClock
from clockwork_async.executors.precise import precise_wait_ns, precise_wait_until, yield_while

from clockwork_async.lane_rules import NEVER_NS


def _noop_job(earliest_ns: int, latest_ns: int = NEVER_NS) -> LaneJob:
    return LaneJob(earliest_ns, latest_ns, run=lambda _start: None, reject=lambda _w, _n: None)


# --- Lane on a virtual clock ----------------------------------------------------------------


class VirtualClock:
    """A clock that jumps: timed waits and spins advance it instead of sleeping."""

    def __init__(self, now_ns: int = 0) -> None:
        self.now = now_ns

    def now_ns(self) -> int:
        return self.now

    def take(self, inbox: queue.SimpleQueue[LaneJob], timeout_ns: int | None) -> LaneJob | None:
        if timeout_ns is None or not inbox.empty():
            return inbox.get()
        self.now += timeout_ns
        return None

    def spin_until(self, deadline_ns: int) -> None:
        self.now = max(self.now, deadline_ns)


class Recorder:
    """Builds jobs that take ``duration_ns`` of virtual time and records what happened."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.events: list[tuple[str, str, int]] = []  # (job, "run"/"reject:why", time)
        self.running = 0
        self.max_running = 0
        self.expected = 0
        self.all_answered = threading.Event()

    def _record(self, label: str, what: str, time_ns: int) -> None:
        self.events.append((label, what, time_ns))
        if len(self.events) == self.expected:
            self.all_answered.set()

    def job(self, label: str, earliest_ns: int, latest_ns: int, duration_ns: int) -> LaneJob:
        def run(start_ns: int) -> None:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.clock.now += duration_ns
            self.running -= 1
            self._record(label, "run", start_ns)

        def reject(why: Rejection, now_ns: int) -> None:
            self._record(label, f"reject:{why}", now_ns)

        return LaneJob(earliest_ns, latest_ns, run, reject)


def _run_lane(recorder: Recorder, jobs: list[LaneJob]) -> None:
    """Run ``jobs`` (all queued before the thread starts) until each was answered."""
    lane = Lane("test", clock=recorder.clock, spin_ns=1_000)
    for job in jobs:
        lane.submit(job)
    recorder.expected = len(jobs)
    lane.start()
    try:
        assert recorder.all_answered.wait(5)
    finally:
        lane.close()


def test_lane_runs_jobs_by_earliest_start_one_at_a_time() -> None:
    recorder = Recorder(VirtualClock(now_ns=0))
    jobs = [
        recorder.job("c", 5_000, NEVER_NS, 1_000),
        recorder.job("a", 1_000, NEVER_NS, 3_000),
        recorder.job("b", 2_000, NEVER_NS, 1_000),  # due at 2000, lane busy until 4000
    ]
    _run_lane(recorder, jobs)
    assert recorder.events == [("a", "run", 1_000), ("b", "run", 4_000), ("c", "run", 5_000)]
    assert recorder.max_running == 1


def test_lane_rejects_a_job_whose_window_closed_while_the_lane_was_busy() -> None:
    recorder = Recorder(VirtualClock(now_ns=0))
    jobs = [
        recorder.job("long", 0, NEVER_NS, 10_000),
        recorder.job("short-window", 1_000, 5_000, 1_000),
        recorder.job("after", 2_000, NEVER_NS, 1_000),
    ]
    _run_lane(recorder, jobs)
    assert recorder.events == [
        ("long", "run", 0),
        ("short-window", "reject:too_late", 10_000),
        ("after", "run", 10_000),
    ]


def test_close_rejects_queued_jobs_and_leaves_no_thread() -> None:
    recorder = Recorder(VirtualClock(now_ns=0))
    lane = Lane("closing", clock=recorder.clock)
    lane.submit(recorder.job("never", NEVER_NS - 1, NEVER_NS, 1))
    lane.close()  # never started: queued jobs are still answered
    assert recorder.events == [("never", "reject:closed", 0)]
    with pytest.raises(LaneClosed):
        lane.submit(recorder.job("late", 0, NEVER_NS, 1))
    assert not [t for t in threading.enumerate() if t.name == "lane-closing"]


def test_close_lets_the_running_job_finish_then_rejects_the_rest() -> None:
    started, release = threading.Event(), threading.Event()
    outcomes: list[str] = []

    def blocking_run(_start_ns: int) -> None:
        started.set()
        release.wait(5)
        outcomes.append("ran")

    lane = Lane("busy")
    lane.start()
    lane.submit(LaneJob(0, NEVER_NS, blocking_run, lambda why, _n: outcomes.append(why)))
    lane.submit(
        LaneJob(0, NEVER_NS, lambda _s: outcomes.append("x"), lambda w, _n: outcomes.append(w))
    )
    assert started.wait(5)
    closer = threading.Thread(target=lane.close)
    closer.start()
    release.set()
    closer.join(5)
    assert outcomes == ["ran", Rejection.CLOSED]
    assert not [t for t in threading.enumerate() if t.name == "lane-busy"]


def test_a_failing_callback_does_not_stop_the_lane() -> None:
    done = threading.Event()

    def broken(_start_ns: int) -> None:
        raise RuntimeError("bug in a job")

    lane = Lane("sturdy")
    lane.start()
    try:
        lane.submit(LaneJob(0, NEVER_NS, broken, lambda _w, _n: None))
        lane.submit(LaneJob(0, NEVER_NS, lambda _s: done.set(), lambda _w, _n: None))
        assert done.wait(5)
    finally:
        lane.close()


# --- run_now: a due job on the caller's thread when the lane is idle -------------------------


def test_run_now_runs_a_due_job_on_the_calling_thread_when_the_lane_is_idle() -> None:
    clock = VirtualClock(now_ns=1_000)
    lane = Lane("inline", clock=clock)
    lane.start()
    ran: list[tuple[int, int]] = []
    try:
        assert lane.run_now(500, 2_000, lambda start: ran.append((start, threading.get_ident())))
        assert ran == [(1_000, threading.get_ident())]  # at once, here
        for earliest_ns, latest_ns in ((1_001, NEVER_NS), (0, 999)):  # not due, too late
            assert not lane.run_now(earliest_ns, latest_ns, lambda _s: ran.append((0, 0)))
        assert len(ran) == 1
    finally:
        lane.close()
    assert not lane.run_now(0, NEVER_NS, lambda _s: ran.append((0, 0)))  # closed
    assert len(ran) == 1


def test_run_now_waits_for_a_window_that_opens_within_its_wait() -> None:
    clock = VirtualClock(now_ns=1_000)
    lane = Lane("inline-wait", clock=clock)
    lane.start()
    starts: list[int] = []
    try:
        assert not lane.run_now(1_501, NEVER_NS, starts.append, wait_ns=500)  # opens too late
        assert clock.now == 1_000 and starts == []
        assert lane.run_now(1_500, NEVER_NS, starts.append, wait_ns=500)
        assert starts == [1_500]  # spun to the window's start, as the lane would
    finally:
        lane.close()


def test_run_now_declines_while_a_submitted_job_runs_or_waits() -> None:
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []

    def held(_start_ns: int) -> None:
        started.set()
        assert release.wait(5)
        ran.append("held")

    lane = Lane("held")
    lane.start()
    try:
        lane.submit(LaneJob(0, NEVER_NS, held, _noop))
        assert started.wait(5)
        assert not lane.run_now(0, NEVER_NS, lambda _s: ran.append("inline"))
        release.set()
        far_ns = time.monotonic_ns() + 60 * 10**9
        lane.submit(LaneJob(far_ns, NEVER_NS, lambda _s: ran.append("far"), _noop))  # waits
        assert not lane.run_now(0, NEVER_NS, lambda _s: ran.append("inline"))
    finally:
        lane.close()
    assert ran == ["held"]
    lane = Lane("idle-again")
    lane.start()
    try:
        lane.submit(LaneJob(0, NEVER_NS, lambda _s: finished.set(), _noop))
        assert finished.wait(5)
        deadline_s = time.monotonic() + 5  # the lane counts the job answered after its callback
        while not lane.run_now(0, NEVER_NS, lambda _s: ran.append("inline")):
            assert time.monotonic() < deadline_s
            time.sleep(0.001)
    finally:
        lane.close()
    assert ran == ["held", "inline"]


def test_nothing_is_submitted_beside_a_job_run_now() -> None:
    inside, release, lane_ran = threading.Event(), threading.Event(), threading.Event()
    events: list[str] = []

    def inline(_start_ns: int) -> None:
        inside.set()
        assert release.wait(5)
        events.append("inline ends")

    def lane_job(_start_ns: int) -> None:
        events.append("lane job")
        lane_ran.set()

    lane = Lane("exclusive")
    lane.start()
    runner = threading.Thread(target=lane.run_now, args=(0, NEVER_NS, inline))
    runner.start()
    try:
        assert inside.wait(5)
        submitter = threading.Thread(
            target=lane.submit,
            args=(LaneJob(0, NEVER_NS, lane_job, _noop),),
        )
        submitter.start()
        submitter.join(0.05)
        assert submitter.is_alive()  # it waits for the inline job to end
        release.set()
        submitter.join(5)
        runner.join(5)
        assert lane_ran.wait(5)
    finally:
        release.set()
        lane.close()
    assert events == ["inline ends", "lane job"]


def test_real_lane_never_starts_a_job_before_its_earliest() -> None:
    starts: list[tuple[int, int]] = []
    finished = threading.Event()
    lane = Lane("real")
    lane.start()
    try:
        now_ns = time.monotonic_ns()
        for offset_ns in (3_000_000, 1_000_000, 2_000_000):
            earliest_ns = now_ns + offset_ns

            def run(start_ns: int, earliest_ns: int = earliest_ns) -> None:
                starts.append((earliest_ns, start_ns))
                if len(starts) == 3:
                    finished.set()

            lane.submit(LaneJob(earliest_ns, NEVER_NS, run, lambda _w, _n: None))
        assert finished.wait(5)
    finally:
        lane.close()
    assert [earliest for earliest, _ in starts] == sorted(earliest for earliest, _ in starts)
    assert all(start >= earliest for earliest, start in starts)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("background", [True, False])
def test_a_background_lane_runs_its_jobs_at_idle_priority(background: bool) -> None:
    seen: queue.SimpleQueue[int] = queue.SimpleQueue()
    lane = Lane("sched", background=background)
    lane.start()
    try:
        job = LaneJob(0, NEVER_NS, lambda _start: seen.put(os.sched_getscheduler(0)), _noop)
        lane.submit(job)
        assert seen.get(timeout=5) == (os.SCHED_IDLE if background else os.SCHED_OTHER)
    finally:
        lane.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the test's own thread is untouched


def _noop(*_args: object) -> None:
    pass


def test_precise_wait_never_returns_early() -> None:
    deadline_ns = time.monotonic_ns() + 500_000
    precise_wait_until(deadline_ns)
    assert time.monotonic_ns() >= deadline_ns
    assert precise_wait_ns(300_000) >= 300_000


def test_yield_while_returns_whether_it_still_waits() -> None:
    assert yield_while(lambda: True, 1_000_000) is True  # ran out of time
    flags = iter([True, True, False])
    assert yield_while(lambda: next(flags), 10**9) is False  # the wait ended first


def _put_later(inbox: queue.SimpleQueue[LaneJob], job: LaneJob, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, inbox.put, (job,))
    timer.start()
    return timer


def test_a_warm_take_gets_a_job_that_comes_while_it_polls_or_after_it_sleeps() -> None:
    inbox: queue.SimpleQueue[LaneJob] = queue.SimpleQueue()
    job = _noop_job(0)
    polling = WarmClock(warm_ns=5 * 10**9)
    timer = _put_later(inbox, job, 0.02)
    assert polling.take(inbox, None) is job  # came during the poll
    timer.join()
    sleeping = WarmClock(warm_ns=1_000_000)
    timer = _put_later(inbox, job, 0.05)
    assert sleeping.take(inbox, None) is job  # came after the poll, to the blocking wait
    timer.join()
    assert sleeping.take(inbox, 2_000_000) is None  # nothing within the timeout
    assert polling.take(inbox, 2_000_000) is None  # a timeout shorter than the poll bounds it


def test_a_warm_lane_runs_its_jobs_in_order() -> None:
    starts: queue.SimpleQueue[int] = queue.SimpleQueue()
    lane = Lane("warm", clock=WarmClock(warm_ns=50_000_000))
    lane.start()
    try:
        now_ns = time.monotonic_ns()
        for offset_ns in (2_000_000, 1_000_000):
            lane.submit(LaneJob(now_ns + offset_ns, NEVER_NS, starts.put, _noop))
        first, second = starts.get(timeout=5), starts.get(timeout=5)
        assert now_ns + 1_000_000 <= first < second
    finally:
        lane.close()
