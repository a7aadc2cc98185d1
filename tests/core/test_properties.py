"""Hypothesis stateful tests: random event sequences against the invariants of the core.

The machine plays the executors (each lane runs its actions in order, from their earliest,
for a random multiple of the prediction, refusing what cannot start by its latest), the
clients (arrivals, cancellations) and the operator (models and executors come and go), and
checks after every step: an INFER carries only requests of its model (of one bucket, for the
variants of a bucketed model); every request answered at most once (exactly once after draining);
never `ok` after its deadline; an INFER only for a model loaded on that executor; a LOAD only
for a model neither loaded nor loading there; never more pages than the executor has (pages
held for reserved LOADs included); the planned windows of an executor's outstanding INFERs
never overlap; the admission ledger's booked work is never negative, and none is left (nor
any reserved LOAD) once nothing is queued.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from clockwork_async.core.buckets import variant_name
from clockwork_async.core.config import ControllerConfig
from clockwork_async.core.controller import Controller
from clockwork_async.core.events import (
    ActionFinished,
    Command,
    Event,
    ExecutorJoined,
    ExecutorLeft,
    LaneReserved,
    ModelProfile,
    ModelRegistered,
    ModelSpec,
    ModelUnregistered,
    ReleaseLane,
    Reply,
    RequestArrived,
    RequestCancelled,
    ReserveLane,
    StartInfer,
    StartLoad,
    StartUnload,
    Tick,
    WakeAt,
)
from clockwork_async.core.lanes import OVERRUN_WINDOW
from clockwork_async.core.outcomes import Outcome

from .harness import MS, US

SIZES = (1, 2, 4, 8)
POOL = {  # name -> (pages, b1 execute ns, load ns)
    "a": (3, 1 * MS, 2 * MS),
    "b": (5, 2 * MS, 4 * MS),
    "c": (7, 500 * US, 1 * MS),
    "d": (9, 3 * MS, 6 * MS),
    # Two buckets of one model (core/buckets.py): variants with their own queues.
    variant_name("v", (32,)): (4, 1 * MS, 3 * MS),
    variant_name("v", (128,)): (4, 3 * MS, 3 * MS),
}
KINDS = ("fast", "slow")


def pool_spec(name: str) -> ModelSpec:
    pages, b1_ns, load_ns = POOL[name]
    execute_ns = {b: b1_ns + (b - 1) * b1_ns // 3 for b in SIZES}
    return ModelSpec(name, SIZES, pages, {"fast": ModelProfile(execute_ns, load_ns)})


@dataclass
class FakeExecutor:
    pages_total: int
    loaded: set[str] = field(default_factory=set)
    loading: dict[int, str] = field(default_factory=dict)
    infers: list[StartInfer] = field(default_factory=list)  # sent, result not delivered
    loads: list[StartLoad] = field(default_factory=list)
    unloads: list[StartUnload] = field(default_factory=list)
    lane_end_ns: dict[str, int] = field(default_factory=lambda: {"execute": 0, "load": 0})
    # Reserved work (registration's profiling): reservation id -> (pages, when it ends).
    reserved: dict[int, tuple[int, int]] = field(default_factory=dict)


class ControllerMachine(RuleBasedStateMachine):
    policy = "clockwork"

    def __init__(self) -> None:
        super().__init__()
        self.ctl = Controller(ControllerConfig(policy=self.policy, max_queued_per_model=50))
        self.now_ns = 0
        self.wake_ns: int | None = None
        self.executors: dict[str, FakeExecutor] = {}
        self.registered: set[str] = set()
        self.deadlines: dict[int, int] = {}
        self.model_of: dict[int, str] = {}
        self.replies: dict[int, list[Reply]] = {}
        self.next_request = 0
        self.next_executor = 0
        self.next_reservation = 0
        self.overrun = 1.0  # how much longer than reserved the next reserved work runs

    # --- driving the controller ------------------------------------------------------------

    def send(self, event: Event, arrival: int | None = None) -> None:
        commands = self.ctl.handle(event, self.now_ns)
        for command in commands:
            self.check_and_apply(command, arrival, event)

    def check_and_apply(self, command: Command, arrival: int | None, event: Event) -> None:
        if isinstance(command, Reply):
            self.check_reply(command, arrival, event)
        elif isinstance(command, WakeAt):
            assert command.time_ns > self.now_ns
            self.wake_ns = command.time_ns
        elif isinstance(command, StartInfer):
            self.check_infer(command)
        elif isinstance(command, LaneReserved):
            self.run_reserved(command, event)
        elif isinstance(command, StartLoad):
            executor = self.executors[command.executor_id]
            assert command.model not in executor.loaded
            assert command.model not in executor.loading.values()
            executor.loading[command.action_id] = command.model
            executor.loads.append(command)
        else:
            executor = self.executors[command.executor_id]
            executor.loaded.discard(command.model)
            executor.unloads.append(command)

    def run_reserved(self, reserved: LaneReserved, event: Event) -> None:
        """Reserved work runs in its lane from now, after what the lane runs, for its
        duration times ``overrun`` (it may take longer than reserved: the core holds on)."""
        assert isinstance(event, ReserveLane) and reserved.reservation_id == event.reservation_id
        executor = self.executors.get(reserved.executor_id)
        if executor is None or reserved.refused:
            return
        assert reserved.start_ns >= self.now_ns
        end_ns = self.now_ns + int(event.duration_ns * self.overrun)
        if event.lane:
            end_ns = max(self.now_ns, executor.lane_end_ns[event.lane]) + end_ns - self.now_ns
            executor.lane_end_ns[event.lane] = end_ns
        executor.reserved[reserved.reservation_id] = (event.pages, end_ns)

    def check_reply(self, reply: Reply, arrival: int | None, event: Event) -> None:
        previous = self.replies.setdefault(reply.request_id, [])
        assert not previous, f"request {reply.request_id} answered twice: {previous}, {reply}"
        previous.append(reply)
        if reply.outcome is Outcome.OK:
            assert self.now_ns <= self.deadlines[reply.request_id]
        if reply.outcome is Outcome.LATE:
            assert self.now_ns > self.deadlines[reply.request_id]
        if reply.outcome.rejected_at_arrival and reply.request_id != arrival:
            assert reply.outcome is Outcome.UNKNOWN_MODEL
            assert isinstance(event, ModelUnregistered)
        if self.policy == "fifo":
            assert reply.outcome not in (Outcome.DROPPED, Outcome.INFEASIBLE)

    def check_infer(self, infer: StartInfer) -> None:
        executor = self.executors[infer.executor_id]
        assert infer.model in executor.loaded, "INFER of a model not loaded there"
        count = len(infer.request_ids)
        assert {self.model_of[r] for r in infer.request_ids} <= {infer.model}, "mixed batch"
        assert infer.batch_size == min(b for b in SIZES if b >= count)
        assert infer.earliest_ns >= self.now_ns and infer.latest_ns >= infer.earliest_ns
        assert infer.planned_start_ns >= infer.earliest_ns
        executor.infers.append(infer)

    def advance_to(self, time_ns: int) -> None:
        """Move time forward, delivering each asked-for Tick on the way (as a timer would)."""
        while self.wake_ns is not None and self.wake_ns <= time_ns:
            self.now_ns = max(self.now_ns, self.wake_ns)
            self.wake_ns = None
            self.send(Tick())
        self.now_ns = max(self.now_ns, time_ns)

    # --- rules -----------------------------------------------------------------------------

    @initialize(
        names=st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=4, unique=True),
        pages=st.integers(min_value=8, max_value=24),
    )
    def start(self, names: list[str], pages: int) -> None:
        """Most runs start with registered models and an executor holding the first one."""
        for name in names:
            self.register(name)
        self.join(pages, "fast", names[:1])

    @rule(name=st.sampled_from(sorted(POOL)))
    def register(self, name: str) -> None:
        self.registered.add(name)
        self.send(ModelRegistered(pool_spec(name)))

    @rule(name=st.sampled_from(sorted(POOL)))
    def unregister(self, name: str) -> None:
        self.registered.discard(name)
        self.send(ModelUnregistered(name))

    @rule(
        pages=st.integers(min_value=0, max_value=24),
        kind=st.sampled_from(KINDS),
        resident=st.lists(st.sampled_from(sorted(POOL)), max_size=3, unique=True),
    )
    def join(self, pages: int, kind: str, resident: list[str]) -> None:
        fits = [
            n
            for n in resident
            if sum(POOL[m][0] for m in resident[: resident.index(n) + 1]) <= pages
        ]
        self.next_executor += 1
        executor_id = f"e{self.next_executor}"
        self.executors[executor_id] = FakeExecutor(pages, set(fits))
        self.send(ExecutorJoined(executor_id, kind, pages, 1 << 24, tuple(fits)))

    @precondition(lambda self: self.executors)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        executor_id = data.draw(st.sampled_from(sorted(self.executors)))
        del self.executors[executor_id]
        self.send(ExecutorLeft(executor_id, "test"))

    @rule(
        model=st.sampled_from([*sorted(POOL), "unknown"]),
        slo_ns=st.integers(min_value=500 * US, max_value=200 * MS),
    )
    def arrive(self, model: str, slo_ns: int) -> None:
        self.arrive_one(model, slo_ns)

    @precondition(lambda self: self.registered)
    @rule(
        data=st.data(),
        count=st.integers(min_value=1, max_value=12),
        slo_ns=st.integers(min_value=3 * MS, max_value=60 * MS),
    )
    def burst(self, data: st.DataObject, count: int, slo_ns: int) -> None:
        model = data.draw(st.sampled_from(sorted(self.registered)))
        for index in range(count):
            self.arrive_one(model, slo_ns + index * 100 * US)

    def arrive_one(self, model: str, slo_ns: int) -> None:
        self.next_request += 1
        request_id = self.next_request
        self.deadlines[request_id] = self.now_ns + slo_ns
        self.model_of[request_id] = model
        self.send(RequestArrived(request_id, model, self.now_ns + slo_ns), arrival=request_id)

    @precondition(lambda self: self.next_request)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        request_id = data.draw(st.integers(min_value=1, max_value=self.next_request))
        self.send(RequestCancelled(request_id))

    @precondition(lambda self: self.executors)
    @rule(
        data=st.data(),
        lane=st.sampled_from(["execute", "load", ""]),
        duration_ns=st.integers(min_value=0, max_value=20 * MS),
        pages=st.integers(min_value=0, max_value=6),
        overrun=st.floats(min_value=0.5, max_value=3.0),
    )
    def reserve(
        self, data: st.DataObject, lane: str, duration_ns: int, pages: int, overrun: float
    ) -> None:
        executor_id = data.draw(st.sampled_from(sorted(self.executors)))
        self.next_reservation += 1
        self.overrun = overrun
        self.send(ReserveLane(executor_id, self.next_reservation, lane, duration_ns, pages))

    @precondition(lambda self: any(e.reserved for e in self.executors.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        holding = sorted(e for e, x in self.executors.items() if x.reserved)
        executor_id = data.draw(st.sampled_from(holding))
        reservation_id = min(self.executors[executor_id].reserved)
        _, end_ns = self.executors[executor_id].reserved.pop(reservation_id)
        self.advance_to(end_ns)
        self.send(ReleaseLane(executor_id, reservation_id, end_ns))

    @rule(delta_ns=st.integers(min_value=0, max_value=30 * MS))
    def wait(self, delta_ns: int) -> None:
        self.advance_to(self.now_ns + delta_ns)
        self.send(Tick())

    @precondition(lambda self: any(e.infers for e in self.executors.values()))
    @rule(
        data=st.data(),
        factor=st.floats(min_value=0.5, max_value=1.6),
        code=st.sampled_from(["", "", "", "", "too_late", "internal", "not_loaded"]),
    )
    def finish_infer(self, data: st.DataObject, factor: float, code: str) -> None:
        busy = sorted(e for e, x in self.executors.items() if x.infers)
        executor_id = data.draw(st.sampled_from(busy))
        executor = self.executors[executor_id]
        infer = executor.infers.pop(0)
        start_ns = max(infer.earliest_ns, executor.lane_end_ns["execute"])
        if code == "" and start_ns > infer.latest_ns:
            code = "too_late"
        if code:
            self.advance_to(max(self.now_ns, start_ns if code == "too_late" else self.now_ns))
            if code == "not_loaded":
                executor.loaded.discard(infer.model)
            self.send(ActionFinished(executor_id, infer.action_id, code))
            return
        duration_ns = int(infer.predicted_ns * factor)
        end_ns = start_ns + duration_ns
        executor.lane_end_ns["execute"] = end_ns
        self.advance_to(end_ns)
        if executor_id in self.executors:  # a Tick on the way cannot remove it, but be sure
            self.send(
                ActionFinished(executor_id, infer.action_id, "", start_ns, end_ns, duration_ns)
            )

    @precondition(lambda self: any(e.loads for e in self.executors.values()))
    @rule(
        data=st.data(), code=st.sampled_from(["", "", "", "no_pages", "too_late", "already_loaded"])
    )
    def finish_load(self, data: st.DataObject, code: str) -> None:
        busy = sorted(e for e, x in self.executors.items() if x.loads)
        executor_id = data.draw(st.sampled_from(busy))
        executor = self.executors[executor_id]
        load = executor.loads.pop(0)
        model = executor.loading.pop(load.action_id)
        start_ns = max(load.earliest_ns, executor.lane_end_ns["load"])
        if code == "" and start_ns > load.latest_ns:
            code = "too_late"
        if code in ("", "already_loaded"):
            end_ns = start_ns + POOL[model][2]
            executor.lane_end_ns["load"] = end_ns
            executor.loaded.add(model)
            self.advance_to(end_ns)
            self.send(
                ActionFinished(
                    executor_id,
                    load.action_id,
                    code,
                    start_ns,
                    end_ns,
                    POOL[model][2] if not code else 0,
                )
            )
        else:
            self.send(ActionFinished(executor_id, load.action_id, code))

    @precondition(lambda self: any(e.unloads for e in self.executors.values()))
    @rule()
    def finish_unloads(self) -> None:
        for executor_id, executor in list(self.executors.items()):
            while executor.unloads:
                unload = executor.unloads.pop(0)
                self.send(ActionFinished(executor_id, unload.action_id))

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def pages_never_overcommitted(self) -> None:
        for executor_id, executor in self.executors.items():
            held = executor.loaded | set(executor.loading.values())
            used = sum(POOL[name][0] for name in held)
            assert used <= executor.pages_total, (executor_id, held)
            stats = self.ctl.executor(executor_id)
            held = sum(pages for pages, _ in executor.reserved.values())  # lane reservations
            assert stats.pages_used - stats.reserved_pages - held == used  # and LOADs
            assert stats.pages_used <= executor.pages_total

    @invariant()
    def booked_work_leaves_with_the_queue(self) -> None:
        queued = self.ctl.queue_depth()
        for executor_id in self.executors:
            stats = self.ctl.executor(executor_id)
            assert stats.booked_ns >= 0 and stats.reserved_loads >= 0
            if not queued:
                assert (stats.booked_ns, stats.reserved_loads) == (0, 0), executor_id

    @invariant()
    def booked_batches_are_indexed_by_position(self) -> None:
        """A batch booked ahead of others shifts their indexes: each stays its position."""
        for executor in self.ctl._core.executors.values():
            for position, batch in enumerate(executor.booked):
                assert batch.index == executor.booked_head + position
                if batch.live > 0:
                    assert batch.end_ns == batch.start_ns + batch.cost_ns

    @invariant()
    def booked_rooms_and_overruns_are_in_range(self) -> None:
        """A live batch's room is a batch of 1 to the largest size and it has no more live
        members than were booked; each execute lane's overrun is the largest of its window."""
        for executor in self.ctl._core.executors.values():
            for batch in executor.booked:
                if batch.live > 0:
                    assert 1 <= batch.room <= SIZES[-1] and batch.live <= batch.size
            lane = executor.exec_lane
            assert len(lane.overruns) <= OVERRUN_WINDOW
            assert lane.overrun_ns == max(lane.overruns, default=0) >= 0

    @invariant()
    def lanes_hold_one_action_at_a_time(self) -> None:
        """The core plans each lane's outstanding actions one after another (each may start
        early, when the one before ends early: the chain moves with the results)."""
        for executor in self.ctl._core.executors.values():
            for lane in (executor.exec_lane, executor.load_lane):
                for before, after in itertools.pairwise(lane.outstanding):
                    assert after.planned_end_ns - after.predicted_ns >= before.planned_end_ns

    @invariant()
    def counts_agree(self) -> None:
        stats = self.ctl.stats(with_executors=False)
        answered = sum(stats.outcomes.values())
        assert answered == sum(len(r) for r in self.replies.values())
        assert stats.arrivals == answered + self.ctl.pending()

    def teardown(self) -> None:
        """Drain: one big executor, every result delivered, time runs out; then every request
        must have exactly one answer."""
        self.next_executor += 1
        drain_id = f"e{self.next_executor}"
        self.executors[drain_id] = FakeExecutor(1000)
        self.send(ExecutorJoined(drain_id, "fast", 1000, 1 << 24))
        for _ in range(400):
            if not self.ctl.pending():
                break
            self.deliver_everything()
            self.advance_to(self.now_ns + 50 * MS)
            self.send(Tick())
        assert self.ctl.pending() == 0
        assert sorted(self.replies) == list(range(1, self.next_request + 1))

    def deliver_everything(self) -> None:
        for executor_id, executor in list(self.executors.items()):
            for reservation_id, (_, end_ns) in sorted(executor.reserved.items()):
                self.advance_to(end_ns)
                self.send(ReleaseLane(executor_id, reservation_id, end_ns))
            executor.reserved.clear()
            while executor.unloads:
                self.send(ActionFinished(executor_id, executor.unloads.pop(0).action_id))
            while executor.loads:
                load = executor.loads.pop(0)
                model = executor.loading.pop(load.action_id)
                executor.loaded.add(model)
                self.advance_to(max(self.now_ns, load.earliest_ns))
                self.send(
                    ActionFinished(executor_id, load.action_id, "", self.now_ns, self.now_ns, 1)
                )
            while executor.infers:
                infer = executor.infers.pop(0)
                self.advance_to(max(self.now_ns, infer.earliest_ns))
                end_ns = self.now_ns + infer.predicted_ns
                self.advance_to(end_ns)
                self.send(
                    ActionFinished(
                        executor_id,
                        infer.action_id,
                        "",
                        end_ns - infer.predicted_ns,
                        end_ns,
                        infer.predicted_ns,
                    )
                )


class FifoMachine(ControllerMachine):
    policy = "fifo"


class TimeoutMachine(ControllerMachine):
    policy = "timeout"


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestClockwork = ControllerMachine.TestCase
TestClockwork.settings = SETTINGS
TestFifo = FifoMachine.TestCase
TestFifo.settings = SETTINGS
TestTimeout = TimeoutMachine.TestCase
TestTimeout.settings = SETTINGS
