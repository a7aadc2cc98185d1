"""The daemon config: defaults, file < environment < flags, and a named error for bad input."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

from clockwork_async.api.server import ServerLimits
from clockwork_async.build import PURE_VARIABLE
from clockwork_async.cli_client import TOKEN_ENV
from clockwork_async.config.daemon import (
    MOVED_KEYS,
    OTHER_VARIABLES,
    SECTIONS,
    ConfigError,
    DaemonConfig,
    LocalExecutorConfig,
    LogFormat,
    MachineFacts,
    RemoteExecutorConfig,
    default_executors,
    load_config,
    redacted,
)
from clockwork_async.config.fields import Raw, build_section, section_keys
from clockwork_async.config.keys import internal, nested, ranged
from clockwork_async.core.config import ControllerConfig
from clockwork_async.daemon import setup
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.executor_link import LinkConfig
from clockwork_async.runtime.profiler import ProfilerConfig
from clockwork_async.wire.addresses import TcpAddress

REPO = Path(__file__).resolve().parents[1]

MACHINE = MachineFacts(cpus=(0, 1), memory_bytes=8 << 30)
TOKEN_A = "a" * 32
TOKEN_B = "b" * 32


def load(
    text: str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
    *,
    tmp_path: Path | None = None,
    machine: MachineFacts = MACHINE,
) -> DaemonConfig:
    path = None
    if text is not None:
        assert tmp_path is not None
        path = tmp_path / "clockwork-async.toml"
        path.write_text(text)
    env = {"HOME": "/home/op", **(environ or {})}
    return load_config(path, env, overrides or {}, machine=machine)


def test_defaults_are_loopback_and_machine_sized() -> None:
    config = load()
    assert config.server.listen == TcpAddress("127.0.0.1", 7470)
    assert config.metrics.listen == TcpAddress("127.0.0.1", 9470)
    assert config.repository.path == Path("/home/op/.local/state/clockwork-async/models")
    assert config.repository.profile_cache_dir.name == "profiles"
    assert config.repository.weights_budget_bytes == 4 << 30
    assert config.executors == (LocalExecutorConfig(name="local-0", cpus=(1,)),)
    cpu_warm_ups = {"warm_gap_ns": 2_000_000, "warm_up_infers": 2}  # CPU executors only
    assert config.controller == dataclasses.replace(ControllerConfig(), **cpu_warm_ups)
    assert config.server.log_format is LogFormat.PLAIN
    assert not config.server.auth_enabled
    assert config.warnings() == []


@pytest.mark.parametrize(
    ("text", "warm_gap_ns", "warm_up_infers"),
    [
        ("", 2_000_000, 2),  # only ONNX Runtime CPU executors: warm-ups on
        ("[controller]\nwarm_up_infers = 0\n", 0, 0),  # either key set: no kind default
        ("[controller]\nwarm_gap_ns = 1000000\n", 1_000_000, 0),
        ('[[executors]]\nbackend = "simulated"\ndevice = "sim"\n', 0, 0),
        ('[[executors]]\ndevice = "cuda:0"\n', 0, 0),
        ('[[executors]]\ntype = "remote"\naddress = "gpu-box:7471"\n', 0, 0),
        ('[[executors]]\n[[executors]]\ntype = "remote"\naddress = "gpu-box:7471"\n', 0, 0),
    ],
)
def test_warm_ups_are_the_default_only_where_every_executor_is_an_onnxruntime_cpu_one(
    tmp_path: Path, text: str, warm_gap_ns: int, warm_up_infers: int
) -> None:
    config = load(text, tmp_path=tmp_path)
    assert (config.controller.warm_gap_ns, config.controller.warm_up_infers) == (
        warm_gap_ns,
        warm_up_infers,
    )


@pytest.mark.parametrize(
    ("cpus", "pinned"),
    [((0,), [(0,)]), ((0, 1), [(1,)]), ((2, 5, 7, 9), [(5,), (7,), (9,)])],
)
def test_default_executors_leave_the_first_cpu_to_the_controller(
    cpus: tuple[int, ...], pinned: list[tuple[int, ...]]
) -> None:
    executors = default_executors(cpus)
    assert [e.cpus for e in executors] == pinned
    assert all(e.backend == "onnxruntime" and e.device == "cpu" for e in executors)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"STATE_DIRECTORY": "/var/lib/clockwork-async"}, "/var/lib/clockwork-async/models"),
        ({"XDG_STATE_HOME": "/xdg"}, "/xdg/clockwork-async/models"),
        ({"XDG_STATE_HOME": "relative"}, "/home/op/.local/state/clockwork-async/models"),
    ],
)
def test_repository_default_follows_systemd_then_xdg(
    environ: dict[str, str], expected: str
) -> None:
    assert load(environ=environ).repository.path == Path(expected)


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    text = """
[server]
max_connections = 10
drain_timeout_s = 3
log_format = "json"
[metrics]
instance_label_limit = 7
"""
    assert load(text, tmp_path=tmp_path).server.limits.max_connections == 10
    env = {
        "CLOCKWORK_ASYNC_SERVER_MAX_CONNECTIONS": "20",
        "CLOCKWORK_ASYNC_METRICS_ENABLED": "false",
    }
    config = load(text, env, {"server.max_connections": "30"}, tmp_path=tmp_path)
    assert config.server.limits.max_connections == 30
    assert config.server.limits.drain_timeout_s == 3.0
    assert config.server.log_format is LogFormat.JSON
    assert config.metrics.instance_label_limit == 7
    assert config.metrics.enabled is False
    assert config.source == str(tmp_path / "clockwork-async.toml")
    assert load(text, env, tmp_path=tmp_path).server.limits.max_connections == 20


def test_the_config_is_frozen() -> None:
    config = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server = config.server  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ({"server.max_connections": "0"}, "server.max_connections", "at least 1"),
        ({"server.max_connections": "many"}, "server.max_connections", "TOML value"),
        ({"server.max_connections": "1.5"}, "server.max_connections", "an integer"),
        ({"server.drain_timeout_s": "true"}, "server.drain_timeout_s", "a number"),
        ({"metrics.enabled": "yes"}, "metrics.enabled", "TOML value"),
        ({"server.log_level": "loud"}, "server.log_level", "debug, info, warning, error"),
        ({"server.colour": "blue"}, "server.colour", "a key of [server]"),
        ({"servers.listen": "x:1"}, "servers", "a known section"),
        ({"server": "x"}, "server", "section.key"),
        ({"repository.path": "models"}, "repository.path", "absolute path"),
        ({"server.listen": "localhost"}, "server.listen", "host:port"),
        ({"server.listen": "127.0.0.1:70000"}, "server.listen", "1..65535"),
        ({"server.listen": "[::1:80"}, "server.listen", "hostname"),
        ({"server.listen": "bad host:80"}, "server.listen", "hostname"),
        ({"server.listen": "[1.2.3.4]:80"}, "server.listen", "IPv6"),
        ({"controller.window_size": "0"}, "controller.window_size", "> 0"),
        ({"controller.policy": "lottery"}, "controller.policy", "clockwork, fifo, timeout"),
        ({"controller.schedule_ahead_ms": "3"}, "controller.schedule_ahead_ms", "a key of"),
        (
            {"server.max_outstanding_per_connection": "100", "server.max_outstanding_total": "10"},
            "server.max_outstanding_per_connection",
            "at most",
        ),
    ],
)
def test_bad_values_name_key_value_and_expectation(
    overrides: dict[str, str], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load(overrides=overrides)
    assert raised.value.key == key
    assert says in raised.value.expected
    assert key in str(raised.value)


def test_errors_say_where_the_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"from \$CLOCKWORK_ASYNC_SERVER_MAX_CONNECTIONS"):
        load(environ={"CLOCKWORK_ASYNC_SERVER_MAX_CONNECTIONS": "-1"})
    with pytest.raises(ConfigError, match=r"clockwork-async\.toml"):
        load("[server]\nmax_connections = '12'\n", tmp_path=tmp_path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server\n", "file"),
        ("[sever]\nlisten = '127.0.0.1:1'\n", "sever"),
        ("server = 3\n", "server"),
        ("[server]\nlisten = 7470\n", "server.listen"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load(text, tmp_path=tmp_path)
    assert raised.value.key == key


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable file"):
        load_config(tmp_path / "absent.toml", {}, {}, machine=MACHINE)


def test_unknown_environment_variables_with_our_prefix_are_refused() -> None:
    with pytest.raises(ConfigError, match="CLOCKWORK_ASYNC_SEVER_LISTEN"):
        load(environ={"CLOCKWORK_ASYNC_SEVER_LISTEN": "127.0.0.1:1"})
    with pytest.raises(ConfigError, match="a key of"):
        load(environ={"CLOCKWORK_ASYNC_EXECUTOR_LINK_HEARTBEAT_MS": "5"})
    link = load(environ={"CLOCKWORK_ASYNC_EXECUTOR_LINK_HEARTBEAT_INTERVAL_MS": "50"})
    assert link.executor_link.heartbeat_interval_ms == 50.0


def test_our_variables_that_are_not_config_keys_are_skipped() -> None:
    """A shell that holds the CLI's token or a build switch can still start the daemon (the
    token and ``CLOCKWORK_ASYNC_PURE`` were refused as unknown config keys)."""
    assert {TOKEN_ENV, PURE_VARIABLE, "CLOCKWORK_ASYNC_COMPILE"} <= OTHER_VARIABLES
    assert 'MODE_VARIABLE = "CLOCKWORK_ASYNC_COMPILE"' in (REPO / "setup.py").read_text()
    environ = {name: "1" for name in OTHER_VARIABLES}
    heartbeat = {"CLOCKWORK_ASYNC_EXECUTOR_LINK_HEARTBEAT_INTERVAL_MS": "50"}
    config = load(environ={**environ, **heartbeat})
    assert config.executor_link.heartbeat_interval_ms == 50.0
    assert config == load(environ=heartbeat)


def test_every_controller_field_maps_from_its_key() -> None:
    defaults = ControllerConfig()
    for spec in dataclasses.fields(ControllerConfig):
        value = getattr(defaults, spec.name)
        text = value if isinstance(value, str) else repr(value)
        config = load(overrides={f"controller.{spec.name}": text})
        assert getattr(config.controller, spec.name) == value
    assert load(overrides={"controller.window_size": "25"}).controller.window_size == 25


def test_tokens_are_checked_and_never_printed(tmp_path: Path) -> None:
    for bad in ("short", "has a space in it ok", "x" * 15):
        with pytest.raises(ConfigError, match="redacted") as raised:
            load(overrides={"server.infer_token": bad})
        assert bad not in str(raised.value)
    with pytest.raises(ConfigError, match="different"):
        load(overrides={"server.infer_token": TOKEN_A, "server.admin_token": TOKEN_A})
    with pytest.raises(ConfigError) as raised:
        load(f"[server]\nadmin_token = ['{TOKEN_A}']\n", tmp_path=tmp_path)
    assert TOKEN_A not in str(raised.value)
    config = load(overrides={"server.infer_token": TOKEN_A, "server.admin_token": TOKEN_B})
    assert config.server.auth_enabled
    assert TOKEN_A not in repr(config)
    assert redacted(config)["server"]["admin_token"] == "<redacted>"


def test_tls_needs_both_files_and_they_must_exist(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    with pytest.raises(ConfigError, match="both"):
        load(overrides={"server.tls_cert_path": str(cert)})
    with pytest.raises(ConfigError, match="existing"):
        load(overrides={"server.tls_cert_path": str(cert), "server.tls_key_path": str(key)})
    cert.write_text("x")
    key.write_text("x")
    paths = {"server.tls_cert_path": str(cert), "server.tls_key_path": str(key)}
    assert load(overrides=paths).server.tls_enabled


def test_executors_local_and_remote(tmp_path: Path) -> None:
    text = f"""
[[executors]]
backend = "simulated"
slowdown = 3
cpus = [0]
[[executors]]
type = "remote"
address = "gpu-box.lan:7480"
token = "{TOKEN_A}"
[[executors]]
name = "spare"
"""
    local, remote, spare = load(text, tmp_path=tmp_path).executors
    assert local == LocalExecutorConfig(
        name="local-0", backend="simulated", cpus=(0,), slowdown=3.0
    )
    assert isinstance(remote, RemoteExecutorConfig)
    assert (remote.name, remote.address, remote.token) == (
        "remote-0",
        TcpAddress("gpu-box.lan", 7480),
        TOKEN_A,
    )
    assert spare == LocalExecutorConfig(name="spare")


def test_executors_replaced_whole_from_the_environment() -> None:
    env = {"CLOCKWORK_ASYNC_EXECUTORS": '[{backend = "simulated"}, {backend = "simulated"}]'}
    names = [e.name for e in load(environ=env).executors]
    assert names == ["local-0", "local-1"]


@pytest.mark.parametrize(
    ("executors", "key", "says"),
    [
        ("[]", "executors", "non-empty"),
        ("[1]", "executors[0]", "a table"),
        ('[{type = "gpu"}]', "executors[0].type", "local, remote"),
        ('[{address = "h:1"}]', "executors[0].address", 'type = "remote"'),
        ('[{type = "remote"}]', "executors[0]", "required"),
        ('[{type = "remote", address = "h:0"}]', "executors[0].address", "1..65535"),
        ('[{backend = "tensorrt"}]', "executors[0].backend", "onnxruntime, simulated"),
        ('[{device = "tpu"}]', "executors[0].device", "cuda:N"),
        ("[{cpus = [3]}]", "executors[0].cpus", "[0, 1]"),
        ("[{cpus = [1, 1]}]", "executors[0].cpus", "distinct"),
        ("[{page_bytes = 8192, weights_bytes = 4096}]", "executors[0].page_bytes", "at most"),
        ('[{name = "a"}, {name = "a"}]', "executors[1].name", "unique"),
        ('[{name = "../x"}]', "executors[0].name", "letters"),
        ("[{intra_op_threads = 0}]", "executors[0].intra_op_threads", "at least 1"),
    ],
)
def test_bad_executors_are_named(executors: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load(overrides={"executors": executors})
    assert raised.value.key == key
    assert says in raised.value.expected


def test_warnings_for_exposed_listeners() -> None:
    exposed = load(overrides={"server.listen": "0.0.0.0:7470", "metrics.listen": "[::]:9470"})
    notes = " ".join(exposed.warnings())
    assert "no tokens" in notes
    assert "no TLS" in notes
    assert "metrics.listen [::]:9470" in notes


@pytest.mark.parametrize(
    ("text", "address", "loopback"),
    [
        ("127.0.0.1:1", TcpAddress("127.0.0.1", 1), True),
        ("[::1]:7470", TcpAddress("::1", 7470), True),
        ("localhost:0", TcpAddress("localhost", 0), True),
        ("10.0.0.2:80", TcpAddress("10.0.0.2", 80), False),
        ("node-1.example.org:9", TcpAddress("node-1.example.org", 9), False),
    ],
)
def test_addresses_parse_and_print_back(text: str, address: TcpAddress, loopback: bool) -> None:
    assert TcpAddress.parse(text) == address
    assert str(address) == text
    assert address.is_loopback is loopback


# --- one dataclass per section -----------------------------------------------------------------


def test_each_section_is_the_dataclass_its_part_uses_with_its_defaults() -> None:
    config = load()
    assert config.server.limits == ServerLimits()
    assert config.executor_link == LinkConfig()
    assert config.executor_link.reconnect_backoff == BackoffConfig()
    assert config.profiler == ProfilerConfig()
    runtime = setup.runtime_config(config)
    assert runtime.link is config.executor_link and runtime.profiler is config.profiler
    assert setup.supervisor_config(config).backoff is config.executor_link.reconnect_backoff


def test_keys_reach_the_runtime_dataclasses_and_nested_keys_take_their_prefix() -> None:
    config = load(
        overrides={
            "server.max_connections": "7",
            "server.flush_timeout_s": "0.5",
            "executor_link.heartbeat_interval_ms": "50",
            "executor_link.heartbeat_miss_limit": "1",
            "executor_link.reconnect_backoff_max_s": "0.5",
            "profiler.max_execute_ns": "50000000",
        }
    )
    assert (config.server.limits.max_connections, config.server.limits.flush_timeout_s) == (7, 0.5)
    link = config.executor_link
    assert link.heartbeat_interval_s == 0.05
    assert link.heartbeat_timeout_s == pytest.approx(0.075)  # 1.5 periods
    assert link.reconnect_backoff == BackoffConfig(max_s=0.5)
    assert config.profiler.max_execute_ns == 50_000_000


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (  # BackoffConfig's own check, named by the key the user wrote
            {
                "executor_link.reconnect_backoff_initial_s": "9",
                "executor_link.reconnect_backoff_max_s": "1",
            },
            "executor_link.reconnect_backoff_initial_s",
            "0 .. max_s (1.0)",
        ),
        ({"executor_link.limits": "{}"}, "executor_link.limits", "a key of"),  # internal
        ({"executor_link.reconnect": "1"}, "executor_link.reconnect", "a key of"),
        ({"server.limits": "1"}, "server.limits", "a key of"),
        ({"profiler.percentile": "90"}, "profiler.percentile", "a key of"),  # the core's
        ({"profiler.iterations": "0"}, "profiler.iterations", "at least 1"),
        (
            {"controller.margin_min_ns": "9", "controller.margin_max_ns": "1"},
            "controller.margin_max_ns",
            ">= margin_min_ns",
        ),
    ],
)
def test_a_dataclass_refusing_a_value_is_named_by_its_key(
    overrides: dict[str, str], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load(overrides=overrides)
    assert raised.value.key == key
    assert says in raised.value.expected


def test_the_logged_config_lists_keys_as_a_file_sets_them() -> None:
    plain = redacted(load(overrides={"server.admin_token": TOKEN_A}))
    assert plain["server"]["max_connections"] == 4096 and "limits" not in plain["server"]
    assert plain["server"]["admin_token"] == "<redacted>"
    assert plain["executor_link"]["reconnect_backoff_max_s"] == 5.0
    assert "controller_name" not in plain["executor_link"]
    assert plain["profiler"]["max_execute_ns"] == 1_000_000_000
    assert plain["executors"][0]["cpus"] == [1]


# --- moved keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), [(old, new) for old, (new, _) in MOVED_KEYS.items()])
def test_a_moved_key_is_refused_from_every_source_naming_its_new_key(
    tmp_path: Path, old: str, new: str
) -> None:
    section, key = old.split(".")
    new_section, new_key = new.split(".")
    assert key not in section_keys(SECTIONS[section])  # gone from where it was
    assert new_key in section_keys(SECTIONS[new_section])  # a key where it went
    variable = f"CLOCKWORK_ASYNC_{section}_{key}".upper()
    for attempt in (
        lambda: load(f"[{section}]\n{key} = 1\n", tmp_path=tmp_path),
        lambda: load(environ={variable: "1"}),
        lambda: load(overrides={old: "1"}),
    ):
        with pytest.raises(ConfigError) as raised:
            attempt()
        assert raised.value.key == old
        assert f"{new} instead" in str(raised.value)


def test_the_profiler_bound_moved_to_nanoseconds() -> None:
    with pytest.raises(ConfigError, match=r"profiler\.max_execute_ns instead.*1000000000"):
        load(overrides={"repository.max_profile_execute_ms": "1000.0"})


@dataclasses.dataclass(frozen=True)
class _Inner:
    size_bytes: int = ranged(1, 1, 10)
    shared: int = 0


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = nested(_Inner)
    flat: _Inner = nested(_Inner, prefix="flat_")
    note: str = internal("code only")


@dataclasses.dataclass(frozen=True)
class _Clashing:
    shared: int = 0
    inner: _Inner = nested(_Inner, prefix="")


def test_the_key_rule_prefixes_nested_fields_skips_internal_ones_and_refuses_clashes() -> None:
    assert list(section_keys(_Outer)) == [
        "inner_size_bytes",
        "inner_shared",
        "flat_size_bytes",
        "flat_shared",
    ]
    built = build_section(_Outer, "toy", {"flat_size_bytes": Raw(3, "test")})
    assert built == _Outer(flat=_Inner(size_bytes=3))
    with pytest.raises(ConfigError, match="at most 10"):
        build_section(_Outer, "toy", {"inner_size_bytes": Raw(11, "test")})
    with pytest.raises(TypeError, match="shared"):
        section_keys(_Clashing)
