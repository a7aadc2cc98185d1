"""`DaemonService` over a fake driver, a real repository and real metrics: the metrics listen to
the driver's answers as they are, instances of ``copies``, profile caching and all-or-nothing
registration, exactly. (Requests do not pass the service: tests/runtime/test_dispatch.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from clockwork_async.api.service import ModelRoute, ServiceError
from clockwork_async.core.events import ModelProfile
from clockwork_async.core.outcomes import Outcome
from clockwork_async.daemon.admin import DaemonService
from clockwork_async.daemon.instances import Registration
from clockwork_async.daemon.metrics import Metrics
from clockwork_async.models.demo import build_tiny
from clockwork_async.models.profile_cache import ProfileCache
from clockwork_async.models.repository import Repository
from clockwork_async.runtime.driver import InferOutcome, RegisteredModel
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.runtime.registration import RegistrationError

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
class Queued:
    name: str
    queued: int
    loaded_on: tuple[str, ...] = ()


@dataclass
class FakeDriver:
    """Records what the service asks; registration of names in ``refuse`` fails."""

    refuse: set[str] = field(default_factory=set)
    registered: dict[str, RegistrationProfile | None] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)  # requests waiting, by served name
    outcome_listeners: list[Callable[[str, str, int, InferOutcome], None]] = field(
        default_factory=list
    )
    action_listeners: list[Any] = field(default_factory=list)

    def snapshot(self) -> Snapshot:
        return Snapshot((Up(),), tuple(Queued(name, n) for name, n in self.queued.items()))

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


@dataclass
class Setup:
    service: DaemonService
    driver: FakeDriver
    registry: CollectorRegistry
    cache: ProfileCache


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    add_tiny(tmp_path / "models", toml="default_slo_ms = 50\ncopies = 2\n")
    driver = FakeDriver()
    registry = CollectorRegistry()
    cache = ProfileCache(tmp_path / "profiles")
    registration = Registration(
        cache, lambda _entry: "test-machine", 1 << 20, lambda entry: str(entry.onnx_path)
    )
    service = DaemonService(
        driver,  # type: ignore[arg-type]
        Repository(tmp_path / "models"),
        Metrics(registry, include_process=False),
        registration,
    )
    return Setup(service, driver, registry, cache)


TOML = "default_slo_ms = 50\ncopies = 2\n"


def make_service(setup: Setup, root: Path) -> DaemonService:
    """Another service over the same repository and cache (a restarted daemon)."""
    registration = Registration(
        setup.cache, lambda _entry: "test-machine", 1 << 20, lambda entry: str(entry.onnx_path)
    )
    return DaemonService(
        setup.driver,  # type: ignore[arg-type]
        Repository(root),
        Metrics(CollectorRegistry(), include_process=False),
        registration,
    )


def ok_outcome(request_id: int) -> InferOutcome:
    return InferOutcome(request_id, Outcome.OK, "", {}, {"total": 1}, "sim", 1)


async def test_instances_share_one_profile_measured_once_then_cached(setup: Setup) -> None:
    report = await setup.service.rescan()
    assert report.added == ("tiny",)
    assert setup.driver.registered == {"tiny-0": None, "tiny-1": PROFILE}
    assert [m.name for m in setup.service.list_models()] == ["tiny-0", "tiny-1"]
    sha = setup.service.served["tiny"].sha256
    assert setup.cache.get(sha, "test-machine", RegistrationProfile.from_json) == PROFILE


async def test_the_metrics_count_the_drivers_answers_as_they_are(setup: Setup) -> None:
    await setup.service.rescan()
    (listener,) = setup.driver.outcome_listeners
    listener("tiny-1", "tiny", 5 * MS_NS, ok_outcome(1))
    late = InferOutcome(2, Outcome.LATE, "after the deadline", {}, {}, "sim", 1)
    listener("tiny-1", "tiny", -MS_NS, late)  # the core judged it late; it stays late
    listener("other", "other", 0, InferOutcome(3, Outcome.UNKNOWN_MODEL, "", {}, {}, None, 0))
    for outcome in ("ok", "late"):
        labels = {"group": "tiny", "outcome": outcome}
        assert setup.registry.get_sample_value("clockwork_requests_total", labels) == 1.0
    labels = {"instance": "other", "outcome": "unknown_model"}
    assert setup.registry.get_sample_value("clockwork_instance_requests_total", labels) == 1.0


async def test_a_failed_instance_unregisters_its_siblings(setup: Setup) -> None:
    setup.driver.refuse.add("tiny-1")
    report = await setup.service.rescan()
    assert report.failed == ("tiny",)
    assert setup.driver.registered == {}
    (failed,) = setup.service.list_models()  # not served: its registration, and why
    assert (failed.name, failed.state, failed.reason) == (
        "tiny",
        "failed",
        "cannot register 'tiny-1'",
    )


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


async def test_adding_onto_a_taken_name_is_model_exists_and_changes_nothing(
    setup: Setup, tmp_path: Path
) -> None:
    await setup.service.rescan()
    before = (tmp_path / "models" / "tiny" / "model.onnx").read_bytes()
    with pytest.raises(ServiceError) as refused:
        await setup.service.add_model("tiny", build_tiny(1).SerializeToString(), TOML)
    assert refused.value.code == "model_exists" and "replace" in refused.value.message
    assert set(setup.driver.registered) == {"tiny-0", "tiny-1"}
    assert (tmp_path / "models" / "tiny" / "model.onnx").read_bytes() == before
    assert [m.version for m in setup.service.list_models()] == [1, 1]


async def test_a_replace_serves_the_new_version_at_once_and_retires_the_old_when_idle(
    setup: Setup, tmp_path: Path
) -> None:
    await setup.service.rescan()
    setup.driver.queued["tiny-0"] = 1  # a request still waits on version 1
    new_file = build_tiny(1).SerializeToString()
    replacing = asyncio.ensure_future(setup.service.add_model("tiny", new_file, TOML, replace=True))
    while setup.service.routes["tiny-0"].version != 2:
        await asyncio.sleep(0)
    assert setup.service.routes["tiny-1"] == ModelRoute("tiny-1@v2", 2)
    assert set(setup.driver.registered) == {"tiny-0", "tiny-1", "tiny-0@v2", "tiny-1@v2"}
    status = await replacing  # answered once version 2 serves (its job retires version 1)
    assert (status.name, status.version) == ("tiny-0", 2)
    await asyncio.sleep(0.01)
    assert "tiny-0" in setup.driver.registered  # the old version waits for its request
    setup.driver.queued["tiny-0"] = 0
    for listener in list(setup.driver.outcome_listeners):
        listener("tiny-0", "tiny", MS_NS, ok_outcome(1))
    while set(setup.driver.registered) != {"tiny-0@v2", "tiny-1@v2"}:
        await asyncio.sleep(0)
    assert len(setup.driver.outcome_listeners) == 1  # the metrics' alone again
    assert [(m.name, m.version) for m in setup.service.list_models()] == [
        ("tiny-0", 2),
        ("tiny-1", 2),
    ]
    setup.driver.outcome_listeners[0]("tiny-0@v2", "tiny", MS_NS, ok_outcome(2))
    labels = {"instance": "tiny-0", "outcome": "ok"}
    counted = setup.registry.get_sample_value("clockwork_instance_requests_total", labels)
    assert counted == 2.0  # one answer by version 1, one by version 2: both are tiny-0
    assert (tmp_path / "models" / "tiny" / "model.onnx").read_bytes() == new_file
    restarted = make_service(setup, tmp_path / "models")
    setup.driver.registered.clear()
    await restarted.rescan()
    assert restarted.routes["tiny-0"] == ModelRoute("tiny-0@v2", 2)  # the version persists


async def test_a_failed_replace_keeps_the_old_version_served_and_its_files(
    setup: Setup, tmp_path: Path
) -> None:
    await setup.service.rescan()
    before = (tmp_path / "models" / "tiny" / "model.onnx").read_bytes()
    setup.driver.refuse.add("tiny-1@v2")
    with pytest.raises(ServiceError) as refused:
        await setup.service.add_model("tiny", build_tiny(1).SerializeToString(), TOML, replace=True)
    assert refused.value.code == "bad_model"
    assert set(setup.driver.registered) == {"tiny-0", "tiny-1"}
    assert setup.service.routes["tiny-0"] == ModelRoute("tiny-0", 1)
    assert (tmp_path / "models" / "tiny" / "model.onnx").read_bytes() == before
    assert Repository(tmp_path / "models").get("tiny").version == 1


async def test_a_rescan_reports_the_folders_it_skipped_with_why(
    setup: Setup, tmp_path: Path
) -> None:
    (tmp_path / "models" / "empty").mkdir()
    (tmp_path / "models" / "junk").mkdir()
    (tmp_path / "models" / "junk" / "model.onnx").write_bytes(b"not onnx")
    report = await setup.service.rescan()
    assert report.added == ("tiny",) and report.failed == ()
    assert [problem.folder for problem in report.skipped] == ["empty", "junk"]
    summary = report.summary()
    assert "failed [], skipped [empty (empty/ has no model.onnx); junk (model 'junk'" in summary
