"""`DaemonService` over a fake driver, a real repository and real metrics, on fake clocks:
deadline conversion, replies counted as the driver judged them, instances of ``copies``,
profile caching and all-or-nothing registration, exactly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from clockwork_async.api.service import ServiceError
from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import Outcome
from clockwork_async.metrics import Metrics
from clockwork_async.profile_cache import ProfileCache
from clockwork_async.repository import Repository
from clockwork_async.runtime.driver import InferOutcome, RegisteredModel
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import RegistrationError
from clockwork_async.runtime.requests import ActionRecord
from clockwork_async.service_impl import DaemonService, Registration
from clockwork_async.wire.messages import ActionResult

from .harness import add_tiny

MS_NS = 1_000_000
PROFILE = RegistrationProfile((1, 2), {"sim": ModelProfile({1: 100_000, 2: 150_000}, 500_000)})


@dataclass
class Snapshot:
    executors: tuple[Any, ...]
    models: tuple[Any, ...] = ()


@dataclass
class Up:
    up: bool = True


@dataclass
class FakeDriver:
    """Records what the service asks; registration of names in ``refuse`` fails."""

    refuse: set[str] = field(default_factory=set)
    registered: dict[str, RegistrationProfile | None] = field(default_factory=dict)
    submitted: list[tuple[str, int, Callable[[InferOutcome], None]]] = field(default_factory=list)
    action_listeners: list[Any] = field(default_factory=list)

    def snapshot(self) -> Snapshot:
        return Snapshot((Up(),))

    async def register_model(self, name: str, path: str, **options: Any) -> RegisteredModel:
        if name in self.refuse:
            raise RegistrationError(f"cannot register {name!r}")
        self.registered[name] = options["profile"]
        return RegisteredModel(
            name=name,
            path=path,
            group=options["group"],
            default_slo_ns=options["default_slo_ns"],
            batch_sizes=PROFILE.batch_sizes,
            inputs=(),
            outputs=(),
            weights_bytes=100,
            weights_pages=1,
            profile=PROFILE,
        )

    async def unregister_model(self, name: str) -> None:
        del self.registered[name]

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_ns: int,
        on_reply: Callable[[InferOutcome], None],
    ) -> int:
        self.submitted.append((model, deadline_ns, on_reply))
        return len(self.submitted)


@dataclass
class Setup:
    service: DaemonService
    driver: FakeDriver
    registry: CollectorRegistry
    cache: ProfileCache
    clock_ns: list[int]


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    add_tiny(tmp_path / "models", toml="default_slo_ms = 50\ncopies = 2\n")
    driver = FakeDriver()
    registry = CollectorRegistry()
    cache = ProfileCache(tmp_path / "profiles")
    registration = Registration(
        cache, lambda _entry: "test-machine", 1 << 20, lambda entry: str(entry.onnx_path)
    )
    clock_ns = [1_000 * MS_NS]
    service = DaemonService(
        driver,  # type: ignore[arg-type]
        Repository(tmp_path / "models"),
        Metrics(registry, include_process=False),
        registration,
        now_ns=lambda: clock_ns[0],
        unix_now_ns=lambda: clock_ns[0] + 5_000_000 * MS_NS,  # Unix = monotonic + 5000 s
    )
    return Setup(service, driver, registry, cache, clock_ns)


def ok_outcome(request_id: int) -> InferOutcome:
    return InferOutcome(request_id, Outcome.OK, "", {}, {"total": 1}, "sim", 1)


async def test_instances_share_one_profile_measured_once_then_cached(setup: Setup) -> None:
    report = await setup.service.rescan()
    assert report.added == ("tiny",)
    assert setup.driver.registered == {"tiny-0": None, "tiny-1": PROFILE}
    assert [m.name for m in setup.service.list_models()] == ["tiny-0", "tiny-1"]
    sha = setup.service.served["tiny"].sha256
    assert setup.cache.get(sha, "test-machine", RegistrationProfile.from_json) == PROFILE


async def test_deadlines_come_from_the_slo_the_unix_deadline_or_the_model(setup: Setup) -> None:
    await setup.service.rescan()
    now_ns = setup.clock_ns[0]
    unix_deadline_ns = now_ns + 5_000_000 * MS_NS + 30 * MS_NS
    for slo_ns, deadline_unix_ns in ((20 * MS_NS, None), (None, unix_deadline_ns), (None, None)):
        setup.service.submit(
            "tiny-0", {}, slo_ns=slo_ns, deadline_unix_ns=deadline_unix_ns, on_reply=ignore
        )
    deadlines_ns = [deadline_ns - now_ns for _, deadline_ns, _ in setup.driver.submitted]
    assert deadlines_ns == [20 * MS_NS, 30 * MS_NS, 50 * MS_NS]  # the last: default_slo_ms


async def test_the_drivers_outcomes_are_replied_and_counted_as_they_are(setup: Setup) -> None:
    await setup.service.rescan()
    replies: list[InferOutcome] = []
    for _ in range(2):
        setup.service.submit(
            "tiny-1", {}, slo_ns=10 * MS_NS, deadline_unix_ns=None, on_reply=replies.append
        )
    (_, deadline_ns, in_time), (_, _, too_late) = setup.driver.submitted
    setup.clock_ns[0] = deadline_ns
    in_time(ok_outcome(1))
    late = InferOutcome(2, Outcome.LATE, "the result reached the daemon late", {}, {}, "sim", 1)
    too_late(late)  # the driver judges late (runtime/driver.py); the service passes it on
    assert [reply.outcome for reply in replies] == [Outcome.OK, Outcome.LATE]
    for outcome in ("ok", "late"):
        labels = {"group": "tiny", "outcome": outcome}
        assert setup.registry.get_sample_value("clockwork_requests_total", labels) == 1.0


async def test_a_failed_instance_unregisters_its_siblings(setup: Setup) -> None:
    setup.driver.refuse.add("tiny-1")
    report = await setup.service.rescan()
    assert report.failed == ("tiny",)
    assert setup.driver.registered == {}
    assert setup.service.list_models() == []


async def test_unknown_models_are_counted_as_other(setup: Setup) -> None:
    setup.service.submit("made-up", {}, slo_ns=None, deadline_unix_ns=None, on_reply=ignore)
    (_, _, reply) = setup.driver.submitted[0]
    reply(InferOutcome(1, Outcome.UNKNOWN_MODEL, "no", {}, {"total": 1}, None, 0))
    labels = {"instance": "other", "outcome": "unknown_model"}
    assert setup.registry.get_sample_value("clockwork_instance_requests_total", labels) == 1.0


async def test_removing_an_instance_name_is_refused(setup: Setup) -> None:
    await setup.service.rescan()
    with pytest.raises(ServiceError) as refused:
        await setup.service.remove_model("tiny-0")
    assert refused.value.code == "model_exists"
    await setup.service.remove_model("tiny")
    assert setup.driver.registered == {}
    with pytest.raises(ServiceError) as gone:
        await setup.service.remove_model("tiny")
    assert gone.value.code == "unknown_model"


async def test_actions_feed_busy_time_prediction_error_and_loads(setup: Setup) -> None:
    await setup.service.rescan()
    (listener,) = setup.driver.action_listeners
    infer = ActionRecord("infer", "sim", 1, "tiny-0", 0, predicted_ns=3 * MS_NS)
    load = ActionRecord("load", "sim", 2, "tiny-0", 0)
    listener(
        infer,
        ActionResult(
            1, start_ns=10 * MS_NS, end_ns=14 * MS_NS, durations_ns={"execute": 4 * MS_NS}
        ),
    )
    listener(load, ActionResult(2, start_ns=0, end_ns=2 * MS_NS, durations_ns={"load": 2 * MS_NS}))
    listener(infer, ActionResult(3, code="too_late"))  # failed actions count nowhere
    value = setup.registry.get_sample_value
    busy = "clockwork_executor_busy_seconds_total"
    assert value(busy, {"executor": "sim", "kind": "infer"}) == 0.004
    assert value(busy, {"executor": "sim", "kind": "load"}) == 0.002
    error = {"kind": "infer", "direction": "slower"}
    assert value("clockwork_prediction_error_seconds_sum", error) == 0.001
    assert value("clockwork_load_duration_seconds_count", {"group": "tiny"}) == 1


def ignore(outcome: InferOutcome) -> None:
    del outcome
