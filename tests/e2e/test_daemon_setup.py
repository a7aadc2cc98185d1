"""How the daemon builds its parts from the config: executor specs around the controller's
pin, the profile cache keys of simulated models, the metrics' live view of a driver snapshot."""

from __future__ import annotations

from pathlib import Path

from clockwork_async.config.daemon import DaemonConfig, MachineFacts, load_config
from clockwork_async.daemon import setup
from clockwork_async.models.repository import Repository
from clockwork_async.runtime.snapshot import DriverSnapshot, ExecutorSnapshot, ModelSnapshot
from clockwork_async.runtime.supervisor import controller_cpu

from .harness import add_tiny

MACHINE = MachineFacts(cpus=(0, 1, 2, 3), memory_bytes=8 << 30)


def config(tmp_path: Path, executors: str) -> DaemonConfig:
    overrides = {"repository.path": str(tmp_path / "models"), "executors": executors}
    overrides["repository.profile_cache_dir"] = str(tmp_path / "profiles")
    return load_config(None, {}, overrides, machine=MACHINE)


def test_unpinned_executors_keep_the_daemons_cpus_and_the_controller_avoids_pinned_ones(
    tmp_path: Path,
) -> None:
    daemon = config(tmp_path, '[{backend = "simulated", cpus = [0]}, {backend = "simulated"}]')
    specs = setup.executor_specs(daemon, unpinned_cpus=(0, 1, 2, 3))
    assert [(s.name, s.cpus) for s in specs] == [("local-0", (0,)), ("local-1", (0, 1, 2, 3))]
    assert [s.cpus for s in setup.executor_specs(daemon)] == [(0,), ()]  # not pinning: as is
    assert setup.pinned_executor_cpus(daemon) == {0}
    assert controller_cpu([0, 1, 2, 3], taken={0}) == 1
    assert controller_cpu([0, 1], taken={0, 1}) == 0  # every CPU has an executor: the lowest


def test_lanes_run_idle_class_only_on_cpus_an_executor_has_to_itself(tmp_path: Path) -> None:
    executors = (
        '[{backend = "simulated", cpus = [1]}, {backend = "simulated", cpus = [2, 3]},'
        ' {backend = "simulated", cpus = [3]}]'
    )
    daemon = config(tmp_path, executors)
    specs = setup.executor_specs(daemon, unpinned_cpus=(0, 1, 2, 3), controller_cpu=0)
    assert [s.lane_scheduling for s in specs] == ["idle", "normal", "normal"]  # 3 is shared
    assert "--lane-scheduling" in specs[0].argv("unix:/x") and "idle" in specs[0].argv("unix:/x")
    on_controller = setup.executor_specs(daemon, (0, 1, 2, 3), controller_cpu=1)
    assert on_controller[0].lane_scheduling == "normal"  # CPU 1 is the controller's
    unpinned_controller = setup.executor_specs(daemon, (0, 1, 2, 3), controller_cpu=None)
    assert {s.lane_scheduling for s in unpinned_controller} == {"normal"}
    alone = config(tmp_path, '[{backend = "simulated", cpus = [1]}]')
    assert [s.lane_scheduling for s in setup.executor_specs(alone, (), 0)] == ["idle"]
    roaming = config(tmp_path, '[{backend = "simulated", cpus = [1]}, {backend = "simulated"}]')
    specs = setup.executor_specs(roaming, (0, 1, 2, 3), 0)  # the second may run on CPU 1
    assert [s.lane_scheduling for s in specs] == ["normal", "normal"]


def test_keep_warm_reaches_the_executors_command_line_only_when_set(tmp_path: Path) -> None:
    daemon = config(tmp_path, '[{backend = "simulated", keep_warm_ms = 20.0}, {}]')
    warm, cold = (spec.argv("unix:/x") for spec in setup.executor_specs(daemon, (), None))
    assert warm[warm.index("--keep-warm-ms") + 1] == "20.0"
    assert "--keep-warm-ms" not in cold


def test_simulated_models_run_as_their_profile_and_are_cached_per_profile(tmp_path: Path) -> None:
    daemon = config(tmp_path, '[{backend = "simulated", slowdown = 2.0}]')
    add_tiny(tmp_path / "models", "plain")
    add_tiny(tmp_path / "models", "big", toml='sim_profile = "resnet50-v100"\n')
    plain, big = sorted(Repository(tmp_path / "models").scan(), key=lambda e: e.name != "plain")
    assert plain.sha256 == big.sha256  # the same file...
    registration = setup.registration(daemon)
    assert (registration.path_for(plain), registration.path_for(big)) == (
        "tiny-sim",
        "resnet50-v100",
    )
    keys = {registration.machine_for(plain), registration.machine_for(big)}
    assert len(keys) == 2  # ...profiled and cached apart
    assert all("x[2.0]" in key for key in keys)


def test_onnxruntime_models_are_registered_by_file(tmp_path: Path) -> None:
    daemon = config(tmp_path, '[{backend = "onnxruntime"}]')
    add_tiny(tmp_path / "models", "m", toml='sim_profile = "resnet50-v100"\n')
    (entry,) = Repository(tmp_path / "models").scan()
    registration = setup.registration(daemon)
    assert registration.path_for(entry) == str(entry.onnx_path)


def test_live_gauges_split_queued_and_running_and_carry_the_cores_cold_starts() -> None:
    executor = ExecutorSnapshot("e0", "unix:/x", True, "sim", 3, 16, ("a-0",), 0, 0, 1, 0, 0, 0, "")
    models = (
        ModelSnapshot("a-0", "a", (1,), 1, ("e0",), queued=2),
        ModelSnapshot("a-1", "a", (1,), 1, (), queued=3),
        ModelSnapshot("b", "b", (1,), 1, (), queued=0),
    )
    snapshot = DriverSnapshot(
        state="running",
        executors=(executor,),
        models=models,
        outstanding=9,
        queued=5,
        running=4,
        submitted=20,
        outcomes={},
        core_counters={"cold_starts": 2, "loads": 3},
        prediction_errors=None,  # type: ignore[arg-type]
        loop_lag=None,  # type: ignore[arg-type]
        timer=None,  # type: ignore[arg-type]
        busy_poll=None,  # type: ignore[arg-type]
        core_ns_per_request=0.0,
        driver_ns_per_request=0.0,
        send_ns_per_request=0.0,
    )
    live = setup.live_snapshot(snapshot, connections=7)
    assert (live.queue_depth, live.running_requests, live.outstanding_requests) == (5, 4, 9)
    assert live.queue_depth_by_group == {"a": 5, "b": 0}
    assert live.cold_starts == 2 and live.client_connections == 7 and live.models_registered == 3
    assert live.executors[0].pages_used == 3 and live.executors[0].models_loaded == 1
