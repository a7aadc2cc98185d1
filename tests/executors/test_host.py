"""The executor host over the simulated backend, in one process (no sockets): model states,
input validation, page accounting, UNLOAD ordering, failures answered with named codes. (The
simulated backend alone: test_simulated.py.)"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import pytest
from clockwork_async.executors.arena import CountingArena
from clockwork_async.executors.backend import BackendError, LoadedModel
from clockwork_async.executors.host import ExecutorHost
from clockwork_async.executors.model_entry import InvalidTransition, ModelEntry, ModelState
from clockwork_async.executors.pages import PageCache
from clockwork_async.executors.simulated import SimRegistered, SimulatedBackend
from clockwork_async.executors.validation import Refused, serving_inputs, validate_inputs

from clockwork_async.lane_rules import UNLOAD_WAIT_NS
from clockwork_async.sim.profiles import TINY_SIM
from clockwork_async.wire.messages import (
    ActionResult,
    ErrorCode,
    GetState,
    Infer,
    Load,
    Message,
    ModelInfo,
    RegisterModel,
    State,
    TensorSpec,
    Unload,
    UnregisterModel,
)

MIB = 1 << 20
NEVER_NS = 2**63 - 1


class Replies:
    """Collects the host's replies (delivered in lane threads here) by action id."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.by_id: dict[int, list[Message]] = {}

    def __call__(self, message: Message) -> None:
        with self._cond:
            self.by_id.setdefault(getattr(message, "action_id", -1), []).append(message)
            self._cond.notify_all()

    def arrived(self, action_id: int, timeout_s: float) -> bool:
        """Whether the reply to ``action_id`` arrives within ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: action_id in self.by_id, timeout_s)

    def wait(self, action_id: int, timeout_s: float = 5.0) -> Message:
        assert self.arrived(action_id, timeout_s)
        with self._cond:
            return self.by_id[action_id][0]


class Driver:
    """A host over a simulated backend, with one call per action that waits for its reply."""

    def __init__(self, backend: SimulatedBackend, pages_total: int) -> None:
        self.pages = PageCache(pages_total)
        self.host = ExecutorHost(backend, self.pages)
        self.replies = Replies()
        self._ids = itertools.count(1)
        self.host.start(lambda callback: callback())

    def send(self, make: Callable[[int], object]) -> int:
        action_id = next(self._ids)
        self.host.submit(make(action_id), self.replies)  # type: ignore[arg-type]
        return action_id

    def call(self, make: Callable[[int], object]) -> Message:
        return self.replies.wait(self.send(make))

    def register(self, model: str, path: str = "tiny-sim") -> Message:
        return self.call(lambda i: RegisterModel(i, model, path))

    def load(self, model: str, earliest_ns: int = 0, latest_ns: int = NEVER_NS) -> Message:
        return self.call(lambda i: Load(i, model, earliest_ns, latest_ns))

    def infer(self, model: str, batch_size: int = 1, **window: int) -> Message:
        inputs = {"input": np.full((batch_size, 4), 7.0, dtype=np.float32)}
        earliest_ns, latest_ns = window.get("earliest_ns", 0), window.get("latest_ns", NEVER_NS)
        return self.call(lambda i: Infer(i, model, batch_size, inputs, earliest_ns, latest_ns))

    def unload(self, model: str) -> Message:
        return self.call(lambda i: Unload(i, model))


def _result(message: Message) -> ActionResult:
    assert isinstance(message, ActionResult), message
    return message


@pytest.fixture
def driver() -> Iterator[Driver]:
    backend = SimulatedBackend(CountingArena(16 * MIB, 2))
    driver = Driver(backend, pages_total=2)
    try:
        yield driver
    finally:
        driver.host.close()
    assert driver.pages.pages_free == driver.pages.pages_total  # nothing leaked


# --- states and the happy path --------------------------------------------------------------


def test_register_load_infer_unload_accounts_pages(driver: Driver) -> None:
    info = driver.register("m")
    assert isinstance(info, ModelInfo)
    assert (info.pages_needed, info.batch_sizes) == (1, (1, 2, 4, 8, 16))
    assert info.inputs == (TensorSpec("input", "float32", (-1, 4)),)
    assert driver.host.model_state("m") is ModelState.REGISTERED

    loaded = _result(driver.load("m"))
    assert loaded.ok and loaded.pages_free == 1 and loaded.durations_ns["load"] > 0
    assert driver.host.model_state("m") is ModelState.LOADED

    result = _result(driver.infer("m", batch_size=2))
    assert result.ok and set(result.durations_ns) == {"copy_in", "execute", "copy_out"}
    assert result.start_ns <= result.end_ns
    output = result.outputs["output"]
    assert output.shape == (2, 1000) and output[:, 0].tolist() == [7.0, 7.0]
    assert output[0, 1:4].tolist() == [1.0, 2.0, 3.0]

    unloaded = _result(driver.unload("m"))
    assert unloaded.ok and unloaded.pages_free == 2
    assert driver.host.model_state("m") is ModelState.REGISTERED


def test_state_reports_pages_and_models(driver: Driver) -> None:
    driver.register("a")
    driver.register("b")
    driver.load("b")
    state = driver.call(lambda i: GetState(i))
    assert state == State(1 + 3, 16 * MIB, 2, 1, registered=("a", "b"), loaded=("b",))
    driver.unload("b")


def test_invalid_state_moves_raise() -> None:
    entry = ModelEntry("m")
    with pytest.raises(InvalidTransition):
        entry.move(ModelState.LOADED)
    entry.move(ModelState.REGISTERING)
    entry.move(ModelState.REGISTERED)
    with pytest.raises(InvalidTransition):
        entry.move(ModelState.UNLOADING)


# --- named errors ----------------------------------------------------------------------------


def test_unknown_models_and_profiles_are_named(driver: Driver) -> None:
    assert _result(driver.load("ghost")).code == ErrorCode.UNKNOWN_MODEL
    assert _result(driver.infer("ghost")).code == ErrorCode.UNKNOWN_MODEL
    assert _result(driver.unload("ghost")).code == ErrorCode.UNKNOWN_MODEL
    bad = _result(driver.register("m", path="no-such-profile"))
    assert bad.code == ErrorCode.BAD_MODEL and "no-such-profile" in bad.message
    assert driver.host.model_state("m") is None


def test_already_loaded_not_loaded_and_no_pages(driver: Driver) -> None:
    for name in ("a", "b", "c"):
        driver.register(name)
    assert _result(driver.infer("a")).code == ErrorCode.NOT_LOADED
    assert _result(driver.unload("a")).code == ErrorCode.NOT_LOADED
    assert _result(driver.load("a")).ok
    assert _result(driver.load("a")).code == ErrorCode.ALREADY_LOADED
    assert _result(driver.load("b")).ok
    no_pages = _result(driver.load("c"))
    assert (no_pages.code, no_pages.pages_free) == (ErrorCode.NO_PAGES, 0)
    assert "needs 1 pages, 0 of 2 are free" in no_pages.message
    assert driver.host.model_state("c") is ModelState.REGISTERED
    unregister = driver.call(lambda i: UnregisterModel(i, "a"))
    assert _result(unregister).code == ErrorCode.ALREADY_LOADED
    for name in ("a", "b"):
        assert _result(driver.unload(name)).ok
    assert _result(driver.call(lambda i: UnregisterModel(i, "a"))).ok
    assert driver.host.model_state("a") is None


def test_too_late_and_empty_windows_are_not_run(driver: Driver) -> None:
    driver.register("m")
    past_ns = time.monotonic_ns() - 1_000_000
    too_late = _result(driver.load("m", earliest_ns=0, latest_ns=past_ns))
    assert (too_late.code, too_late.start_ns, too_late.durations_ns) == ("too_late", 0, {})
    assert driver.host.model_state("m") is ModelState.REGISTERED
    empty = _result(driver.load("m", earliest_ns=10, latest_ns=5))
    assert empty.code == ErrorCode.BAD_INPUT and "empty window" in empty.message


def _model(batch_sizes: tuple[int, ...] = (1, 2, 4)) -> SimRegistered:
    spec = TensorSpec("x", "float32", (-1, 3, 2))
    return SimRegistered("m", 0, (), (spec,), (), batch_sizes, TINY_SIM)


@pytest.mark.parametrize(
    ("batch_size", "inputs", "expected"),
    [
        (3, {"x": np.zeros((3, 3, 2), np.float32)}, "batch size 3 is not one of"),
        (1, {}, "missing input 'x'"),
        (1, {"x": np.zeros((1, 3, 2), np.float32), "y": np.zeros(1)}, "unexpected input 'y'"),
        (1, {"x": np.zeros((1, 3, 2), np.float64)}, "has dtype float64, expected float32"),
        (1, {"x": np.zeros((1, 6), np.float32)}, "expected rank 3"),
        (2, {"x": np.zeros((1, 3, 2), np.float32)}, "leading axis 1, but the action's batch"),
        (1, {"x": np.zeros((1, 3, 5), np.float32)}, "has shape (1, 3, 5), expected (-1, 3, 2)"),
    ],
)
def test_bad_inputs_are_named(
    batch_size: int, inputs: Mapping[str, np.ndarray], expected: str
) -> None:
    with pytest.raises(Refused) as refused:
        validate_inputs(_model(), batch_size, inputs)
    assert refused.value.code is ErrorCode.BAD_INPUT
    assert expected in refused.value.message


def test_good_inputs_pass_validation() -> None:
    validate_inputs(_model(), 2, {"x": np.zeros((2, 3, 2), np.float32)})


def test_an_input_without_a_batch_axis_comes_whole() -> None:
    specs = (TensorSpec("scale", "float32", ()), TensorSpec("table", "bool", (3, 2)))
    model = SimRegistered("m", 0, (), specs, (), (1,), TINY_SIM)
    whole = {"scale": np.array(2.0, np.float32), "table": np.zeros((3, 2), bool)}
    validate_inputs(model, 1, whole)
    with pytest.raises(Refused, match=r"'table' has shape \(1, 2\), expected \(3, 2\)"):
        validate_inputs(model, 1, {**whole, "table": np.zeros((1, 2), bool)})
    with pytest.raises(Refused, match="'scale' has shape \\(1,\\), expected rank 0"):
        validate_inputs(model, 1, {**whole, "scale": np.ones(1, np.float32)})


def test_declared_input_shapes_must_fit_the_file() -> None:
    found = (TensorSpec("ids", "int64", (-1, -1)), TensorSpec("s", "float32", ()))
    declared = (TensorSpec("ids", "int64", (-1, 12)), TensorSpec("s", "float32", ()))
    assert serving_inputs("m", found, ()) == found
    assert serving_inputs("m", found, declared) == declared
    for wrong, says in [
        ((declared[0],), "declared inputs ['ids'] differ from the file's ['ids', 's']"),
        ((TensorSpec("ids", "int32", (-1, 12)), declared[1]), "declared int32 [-1, 12]"),
        ((declared[0], TensorSpec("s", "float32", (1,))), "but the file has float32 []"),
    ]:
        with pytest.raises(BackendError, match=re.escape(says)) as caught:
            serving_inputs("m", found, wrong)
        assert caught.value.code is ErrorCode.BAD_MODEL


def test_bad_input_is_answered_and_the_host_serves_on(driver: Driver) -> None:
    driver.register("m")
    driver.load("m")
    bad = driver.call(lambda i: Infer(i, "m", 1, {"input": np.zeros((1, 5), np.float32)}, 0, 1))
    assert _result(bad).code == ErrorCode.BAD_INPUT
    assert _result(driver.infer("m")).ok
    driver.unload("m")


# --- ordering of UNLOAD against INFER and LOAD ----------------------------------------------


def test_an_infer_queued_behind_an_unload_answers_not_loaded(driver: Driver) -> None:
    driver.register("m")
    driver.load("m")
    unload_id = driver.send(lambda i: Unload(i, "m"))
    later_ns = time.monotonic_ns() + 2_000_000
    inputs = {"input": np.zeros((1, 4), np.float32)}
    infer_id = driver.send(lambda i: Infer(i, "m", 1, inputs, later_ns, NEVER_NS))
    assert _result(driver.replies.wait(unload_id)).ok
    assert _result(driver.replies.wait(infer_id)).code == ErrorCode.NOT_LOADED


class SlowReleaseBackend(SimulatedBackend):
    """Holds every ``unload`` (its session still alive) until the test releases it."""

    def __init__(self, arena: CountingArena) -> None:
        super().__init__(arena)
        self.unloading = threading.Event()
        self.release = threading.Event()

    def unload(self, loaded: LoadedModel) -> None:
        self.unloading.set()
        assert self.release.wait(5)


def _load_behind_a_held_unload(driver: Driver, backend: SlowReleaseBackend) -> tuple[int, int]:
    """On one page: load "old", send its UNLOAD (held in the backend), then a LOAD of "new",
    which must wait for the old page rather than be answered. Returns (unload, load) ids."""
    driver.register("old")
    driver.register("new")
    driver.load("old")
    unload_id = driver.send(lambda i: Unload(i, "old"))
    assert backend.unloading.wait(5)
    assert driver.host.model_state("old") is ModelState.UNLOADING
    load_id = driver.send(lambda i: Load(i, "new", 0, NEVER_NS))
    assert not driver.replies.arrived(load_id, timeout_s=0.05)
    return unload_id, load_id


def test_pages_are_not_reused_while_a_session_can_still_read_them() -> None:
    backend = SlowReleaseBackend(CountingArena(16 * MIB, 1))
    driver = Driver(backend, pages_total=1)
    try:
        # The LOAD waits for the pages of the UNLOAD ahead of it, not refused and not given
        # pages the old session can still read.
        unload_id, load_id = _load_behind_a_held_unload(driver, backend)
        assert driver.host.model_state("new") is ModelState.REGISTERED
        backend.release.set()
        unloaded = _result(driver.replies.wait(unload_id))
        loaded = _result(driver.replies.wait(load_id))
        assert unloaded.ok and loaded.ok and loaded.end_ns >= unloaded.end_ns
        driver.unload("new")
    finally:
        backend.release.set()
        driver.host.close()


def test_a_model_unregistered_while_its_load_waits_is_named_unknown() -> None:
    backend = SlowReleaseBackend(CountingArena(16 * MIB, 1))
    driver = Driver(backend, pages_total=1)
    try:
        unload_id, load_id = _load_behind_a_held_unload(driver, backend)
        assert _result(driver.call(lambda i: UnregisterModel(i, "new"))).ok
        backend.release.set()
        assert _result(driver.replies.wait(unload_id)).ok
        assert _result(driver.replies.wait(load_id)).code == ErrorCode.UNKNOWN_MODEL
        assert driver.pages.pages_free == 1
    finally:
        backend.release.set()
        driver.host.close()


class HeldInferBackend(SimulatedBackend):
    """Holds every ``infer`` (the execute lane busy) until the test releases it."""

    def __init__(self, arena: CountingArena) -> None:
        super().__init__(arena)
        self.inferring = threading.Event()
        self.release = threading.Event()

    def infer(
        self, loaded: LoadedModel, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        self.inferring.set()
        assert self.release.wait(5)
        return super().infer(loaded, batch_size, inputs)


def test_an_eviction_behind_a_running_infer_frees_pages_for_the_load_after_it() -> None:
    # What a controller's eviction looks like: UNLOAD b, then at once LOAD c into b's pages,
    # while an INFER of a runs and another waits. The UNLOAD goes ahead of the waiting INFER
    # and the LOAD waits for it instead of answering NO_PAGES.
    backend = HeldInferBackend(CountingArena(16 * MIB, 2))
    driver = Driver(backend, pages_total=2)
    try:
        for name in ("a", "b", "c"):
            driver.register(name)
        driver.load("a")
        driver.load("b")
        inputs = {"input": np.zeros((1, 4), np.float32)}
        running_id = driver.send(lambda i: Infer(i, "a", 1, inputs, 0, NEVER_NS))
        assert backend.inferring.wait(5)
        waiting_id = driver.send(lambda i: Infer(i, "a", 1, inputs, 1, NEVER_NS))
        unload_id = driver.send(lambda i: Unload(i, "b"))
        load_id = driver.send(lambda i: Load(i, "c", 0, NEVER_NS))
        assert not driver.replies.arrived(load_id, timeout_s=0.05)
        backend.release.set()
        results = [_result(driver.replies.wait(i)) for i in (running_id, unload_id, waiting_id)]
        assert all(r.ok for r in results), results
        _, unloaded, waited = results
        assert unloaded.end_ns <= waited.start_ns  # the UNLOAD went ahead of the INFER
        loaded = _result(driver.replies.wait(load_id))
        assert loaded.ok and loaded.end_ns >= unloaded.end_ns
        for name in ("a", "c"):
            driver.unload(name)
    finally:
        backend.release.set()
        driver.host.close()


def test_a_load_without_pending_unloads_is_refused_at_once(driver: Driver) -> None:
    for name in ("a", "b", "c"):
        driver.register(name)
    driver.load("a")
    driver.load("b")
    assert _result(driver.unload("ghost")).code == ErrorCode.UNKNOWN_MODEL
    started_s = time.monotonic()
    refused = _result(driver.load("c"))
    assert refused.code == ErrorCode.NO_PAGES
    assert time.monotonic() - started_s < UNLOAD_WAIT_NS / 1e9  # it did not wait for nothing
    for name in ("a", "b"):
        driver.unload(name)


# --- short INFERs run inline on the loop thread ------------------------------------------------


class Posted:
    """A ``post`` that records from which thread each reply was posted, then delivers it."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def __call__(self, callback: Callable[[], None]) -> None:
        self.threads.append(threading.get_ident())
        callback()


def _inline_driver(backend: SimulatedBackend, **host_options: int) -> tuple[Driver, Posted]:
    driver = Driver(backend, pages_total=1)
    driver.host.close()  # rebuilt below with a recording post and the options
    driver.host = ExecutorHost(backend, driver.pages, **host_options)
    posted = Posted()
    driver.host.start(posted)
    return driver, posted


def test_a_short_infer_runs_inline_once_it_ran_short() -> None:
    backend = SimulatedBackend(CountingArena(16 * MIB, 1), slowdown=0.01)  # b1: 5 us
    driver, posted = _inline_driver(backend)
    try:
        driver.register("m")
        driver.load("m")
        posts = len(posted.threads)
        first = _result(driver.infer("m"))  # never ran: through the lane thread
        assert first.ok and posted.threads[posts:] == [posted.threads[-1]]
        assert posted.threads[-1] != threading.get_ident()
        inline, posts = _answered_inline(driver, posted)
        assert inline.ok and inline.received_ns <= inline.start_ns <= inline.end_ns
        assert inline.outputs["output"][0, 0] == 1.0 and inline.durations_ns["execute"] > 0
        assert _result(driver.infer("m", batch_size=2)).ok  # another batch size: the lane
        assert len(posted.threads) == posts + 1
        too_late = _result(driver.infer("m", earliest_ns=0, latest_ns=1))  # lane: rejected
        assert too_late.code == ErrorCode.TOO_LATE
        driver.unload("m")
    finally:
        driver.host.close()


def _answered_inline(driver: Driver, posted: Posted) -> tuple[ActionResult, int]:
    """Send INFERs until one is answered before ``submit`` returns, not posted (the lane
    counts a job answered only after its reply was posted, so the first may find it busy).
    Returns that result and the posts made before it."""
    inputs = {"input": np.ones((1, 4), np.float32)}
    for _ in range(200):
        posts = len(posted.threads)
        action_id = driver.send(lambda i: Infer(i, "m", 1, inputs, 0, NEVER_NS))
        if action_id in driver.replies.by_id and len(posted.threads) == posts:
            return _result(driver.replies.by_id[action_id][0]), posts
        driver.replies.wait(action_id)
        time.sleep(0.001)
    raise AssertionError("no INFER ran inline")


@pytest.mark.parametrize("options", [{"inline_max_ns": 0}, {"inline_max_ns": 1}])
def test_an_infer_longer_than_the_inline_bound_always_goes_through_the_lane(
    options: dict[str, int],
) -> None:
    backend = SimulatedBackend(CountingArena(16 * MIB, 1), slowdown=0.01)
    driver, posted = _inline_driver(backend, **options)
    try:
        driver.register("m")
        driver.load("m")
        for _ in range(3):
            assert _result(driver.infer("m")).ok
        assert len(posted.threads) == 5 and threading.get_ident() not in posted.threads
        driver.unload("m")
    finally:
        driver.host.close()


class FlakyBackend(SimulatedBackend):
    """Fails its first ``infer`` with a plain exception (a backend bug)."""

    failures = 1

    def infer(
        self, loaded: LoadedModel, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("device fell over")
        return super().infer(loaded, batch_size, inputs)


def test_a_backend_exception_answers_internal_and_the_host_serves_on() -> None:
    driver = Driver(FlakyBackend(CountingArena(16 * MIB, 1)), pages_total=1)
    try:
        driver.register("m")
        driver.load("m")
        failed = _result(driver.infer("m"))
        assert failed.code == ErrorCode.INTERNAL and "device fell over" in failed.message
        assert failed.start_ns > 0  # it did start
        assert _result(driver.infer("m")).ok
        driver.unload("m")
    finally:
        driver.host.close()


def test_close_answers_queued_actions_and_releases_loaded_models() -> None:
    driver = Driver(SimulatedBackend(CountingArena(16 * MIB, 1)), pages_total=1)
    driver.register("m")
    driver.load("m")
    far_ns = time.monotonic_ns() + 60 * 10**9
    inputs = {"input": np.zeros((1, 4), np.float32)}
    queued_id = driver.send(lambda i: Infer(i, "m", 1, inputs, far_ns, NEVER_NS))
    driver.host.close()
    queued = _result(driver.replies.wait(queued_id))
    assert queued.code == ErrorCode.INTERNAL and "shutting down" in queued.message
    assert driver.pages.pages_free == 1
    late = _result(driver.load("m"))
    assert late.code == ErrorCode.INTERNAL
