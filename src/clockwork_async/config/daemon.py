"""The daemon's one frozen configuration: TOML file, then environment, then command-line flags.

One idea: from the sources a user writes to one validated, frozen `DaemonConfig`.

Invariants: a ``DaemonConfig`` only exists validated (``load_config`` is the one way to make one
from outside input), it is frozen and passed down, and nothing below the CLI reads the
environment or the file again. Every bad value raises ``ConfigError`` naming the key, the value,
where it came from and what was expected. Each section is the dataclass its part uses
(``SECTIONS``: `ServerLimits` inside `ServerConfig`, `LinkConfig`, `ProfilerConfig`,
`ControllerConfig` ...), mapped generically from its table (`config_keys` says which fields are
keys), so a new field needs no parsing code, and each default and range is written once, beside
its field. Units are in key names (``_ns``, ``_ms``, ``_s``, ``_bytes``), the same on both sides.
A key that moved (``MOVED_KEYS``) is refused, from any source, naming where it went.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from clockwork_async.api.server import ServerLimits
from clockwork_async.api.v2_config import GrpcConfig, HttpConfig
from clockwork_async.config.fields import (
    ConfigError,
    Raw,
    build_section,
    choices,
    parse_toml_value,
    plain_section,
)
from clockwork_async.config.keys import RANGE, nested, ranged, secret
from clockwork_async.core.config import ControllerConfig
from clockwork_async.runtime.executor_link import LinkConfig
from clockwork_async.runtime.profiler import ProfilerConfig
from clockwork_async.wire.addresses import TcpAddress

__all__ = ["ConfigError", "DaemonConfig", "TcpAddress", "load_config"]

ENV_PREFIX = "CLOCKWORK_ASYNC_"
# Ours but not config keys, skipped so that one shell can build, serve and call: the CLI's token,
# the build switches (setup.py, build.py) and the compiled build tests and benchmarks use
# (tests/test_build.py). tests/test_config.py checks these names against theirs.
OTHER_VARIABLES = frozenset(ENV_PREFIX + name for name in ("TOKEN", "COMPILE", "PURE", "COMPILED"))
MIN_TOKEN_CHARS = 16
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SERVER_LISTEN = TcpAddress("127.0.0.1", 7470)
DEFAULT_METRICS_LISTEN = TcpAddress("127.0.0.1", 9470)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
_TOKEN = re.compile(r"^[\x21-\x7e]+\Z")  # printable ASCII, no spaces


class LogFormat(StrEnum):
    PLAIN = "plain"
    JSON = "json"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class ExecutorType(StrEnum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``[server]``: the client API listener, its limits (`ServerLimits`, whose fields are keys
    of this section as they are), logging, authentication and TLS, whether the daemon pins
    itself (the controller) to one CPU and how long its loop busy-polls after work."""

    listen: TcpAddress = DEFAULT_SERVER_LISTEN
    limits: ServerLimits = nested(ServerLimits, prefix="")
    log_format: LogFormat = LogFormat.PLAIN
    log_level: LogLevel = LogLevel.INFO
    infer_token: str = secret()
    admin_token: str = secret()
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    pin_controller: bool = True  # the daemon's own process, to a CPU no executor is pinned to
    busy_poll_us: float = ranged(300.0, 0.0, 100_000.0)  # after work, poll sockets, not sleep

    @property
    def auth_enabled(self) -> bool:
        return bool(self.infer_token or self.admin_token)

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_path is not None


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint (``/metrics``, ``/healthz``, ``/readyz``)."""

    enabled: bool = True
    listen: TcpAddress = DEFAULT_METRICS_LISTEN
    instance_label_limit: int = ranged(100, 0, 100_000)


@dataclass(frozen=True, slots=True)
class RepositoryConfig:
    """``[repository]``: model folders, host weights budget, profile cache. Paths have
    machine-dependent defaults, filled in by ``load_config``."""

    path: Path
    profile_cache_dir: Path
    weights_budget_bytes: int = field(metadata={RANGE: (1, None)})
    max_model_bytes: int = ranged(GiB, 1024, 2 * GiB)


@dataclass(frozen=True, slots=True)
class LocalExecutorConfig:
    """``[[executors]]`` with ``type = "local"``: a subprocess the daemon spawns and supervises."""

    name: str = ""
    backend: str = "onnxruntime"
    device: str = "cpu"
    cpus: tuple[int, ...] = ()
    page_bytes: int = ranged(16 * MiB, 4096, 4 * GiB)
    weights_bytes: int = ranged(GiB, 4096, 1 << 44)
    intra_op_threads: int = ranged(1, 1, 256)
    slowdown: float = ranged(1.0, 0.01, 1000.0)
    keep_warm_ms: float = ranged(0.0, 0.0, 60_000.0)


@dataclass(frozen=True, slots=True)
class RemoteExecutorConfig:
    """``[[executors]]`` with ``type = "remote"``: started elsewhere (``executor --listen``)."""

    address: TcpAddress
    name: str = ""
    token: str = secret()
    tls_ca_path: Path | None = None


ExecutorConfig = LocalExecutorConfig | RemoteExecutorConfig
BACKENDS = frozenset({"onnxruntime", "simulated"})
_DEVICE = re.compile(r"^(cpu|sim|cuda:[0-9]{1,2})\Z")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything the daemon needs, validated. Build it with ``load_config``."""

    repository: RepositoryConfig
    executors: tuple[ExecutorConfig, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)  # the v2 front ends (api/v2_config)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    executor_link: LinkConfig = field(default_factory=LinkConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    source: str = ""  # the file it came from, for logs ("" = built-in defaults)

    def warnings(self) -> list[str]:
        """Legal but risky settings, one sentence each, for the daemon to log at start."""
        notes = []
        if not self.server.listen.is_loopback and not self.server.auth_enabled:
            notes.append(f"server.listen {self.server.listen} is not loopback and has no tokens")
        if not self.server.listen.is_loopback and not self.server.tls_enabled:
            notes.append(f"server.listen {self.server.listen} is not loopback and has no TLS")
        if self.metrics.enabled and not self.metrics.listen.is_loopback:
            notes.append(f"metrics.listen {self.metrics.listen} exposes metrics beyond loopback")
        return notes


SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "metrics": MetricsConfig,
    "http": HttpConfig,
    "grpc": GrpcConfig,
    "repository": RepositoryConfig,
    "controller": ControllerConfig,
    "executor_link": LinkConfig,
    "profiler": ProfilerConfig,
}
# Keys that moved: refused where they were, with where they went (section.key: new, note).
MOVED_KEYS: dict[str, tuple[str, str]] = {
    "repository.max_profile_execute_ms": (
        "profiler.max_execute_ns",
        "nanoseconds, like every [profiler] time: 1000.0 ms is 1000000000",
    ),
}
EXECUTOR_TYPES: dict[str, type[Any]] = {
    ExecutorType.LOCAL: LocalExecutorConfig,
    ExecutorType.REMOTE: RemoteExecutorConfig,
}


@dataclass(frozen=True, slots=True)
class MachineFacts:
    """What machine-dependent defaults are computed from (injectable for tests)."""

    cpus: tuple[int, ...]
    memory_bytes: int

    @classmethod
    def probe(cls) -> MachineFacts:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(cpus, memory_bytes)


def load_config(
    path: Path | None,
    environ: Mapping[str, str],
    overrides: Mapping[str, str],
    *,
    machine: MachineFacts | None = None,
) -> DaemonConfig:
    """Read ``path`` (TOML; None = built-in defaults), apply ``CLOCKWORK_ASYNC_<SECTION>_<KEY>``
    variables of ``environ``, then ``overrides`` (``section.key`` -> text); returns the validated
    config. Raises ConfigError (also for an unreadable or malformed file)."""
    facts = machine or MachineFacts.probe()
    layers = _Layers()
    if path is not None:
        layers.add_file(path)
    layers.add_environ(environ)
    layers.add_overrides(overrides)
    return _build(layers, _machine_defaults(environ, facts), facts)


def default_executors(cpus: Sequence[int]) -> tuple[LocalExecutorConfig, ...]:
    """One pinned ONNX Runtime CPU executor per CPU left after the controller's (the first);
    one executor on the only CPU when there is just one."""
    spare = list(cpus[1:]) if len(cpus) > 1 else list(cpus[:1])
    return tuple(LocalExecutorConfig(name=f"local-{i}", cpus=(cpu,)) for i, cpu in enumerate(spare))


def state_directory(environ: Mapping[str, str]) -> Path:
    """``$STATE_DIRECTORY`` (systemd's StateDirectory=), else ``$XDG_STATE_HOME/clockwork-async``,
    else ``~/.local/state/clockwork-async``."""
    systemd_dirs = environ.get("STATE_DIRECTORY", "")
    if systemd_dirs:
        return Path(systemd_dirs.split(":")[0])
    xdg = environ.get("XDG_STATE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "clockwork-async"
    home = Path(environ["HOME"]) if environ.get("HOME") else Path.home()
    return home / ".local" / "state" / "clockwork-async"


def _machine_defaults(environ: Mapping[str, str], facts: MachineFacts) -> dict[str, Any]:
    state = state_directory(environ)
    return {
        "path": state / "models",
        "profile_cache_dir": state / "profiles",
        "weights_budget_bytes": max(facts.memory_bytes // 2, 1),
    }


# --- Layers: where each raw value came from -------------------------------------------------


class _Layers:
    """Raw values per section and key, later layers replacing earlier ones."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Raw]] = {name: {} for name in SECTIONS}
        self.executors: Raw | None = None
        self.file = ""

    def add_file(self, path: Path) -> None:
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise ConfigError("file", str(path), f"a readable file ({error.strerror})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ConfigError("file", str(path), f"valid TOML ({error})") from None
        self.file = str(path)
        for section, table in document.items():
            self._addbuild_section(section, table, str(path))

    def _addbuild_section(self, section: str, table: Any, source: str) -> None:
        if section == "executors":
            self.executors = Raw(table, source)
            return
        if section not in SECTIONS:
            raise ConfigError(section, table, f"a known section ({choices(self._sections())})")
        if not isinstance(table, dict):
            raise ConfigError(section, table, "a table ([section])", source)
        for key, value in table.items():
            _refuse_moved(section, key, value, source)
            self.tables[section][key] = Raw(value, source)

    def add_environ(self, environ: Mapping[str, str]) -> None:
        for name in sorted(environ):
            if name.startswith(ENV_PREFIX) and name not in OTHER_VARIABLES:
                section, key = _split_env_name(name, environ[name])
                self._set(section, key, environ[name], f"${name}")

    def add_overrides(self, overrides: Mapping[str, str]) -> None:
        for dotted, text in overrides.items():
            section, _, key = dotted.partition(".")
            if (section == "executors") != (key == ""):
                raise ConfigError(dotted, text, "section.key, or executors=[...]", "flag")
            self._set(section, key, text, f"flag {dotted}")

    def _set(self, section: str, key: str, text: str, source: str) -> None:
        if section == "executors":
            self.executors = Raw(parse_toml_value("executors", text, source), source)
        elif section in SECTIONS:
            _refuse_moved(section, key, text, source)
            self.tables[section][key] = Raw(text, source, is_text=True)
        else:
            raise ConfigError(
                section, text, f"a known section ({choices(self._sections())})", source
            )

    @staticmethod
    def _sections() -> list[str]:
        return [*SECTIONS, "executors"]


def _refuse_moved(section: str, key: str, value: Any, source: str) -> None:
    moved = MOVED_KEYS.get(f"{section}.{key}")
    if moved is not None:
        new, note = moved
        raise ConfigError(
            f"{section}.{key}", value, f"{new} instead: the key moved ({note})", source
        )


def _split_env_name(name: str, value: str) -> tuple[str, str]:
    rest = name[len(ENV_PREFIX) :].lower()
    if rest == "executors":
        return "executors", ""
    for section in sorted(SECTIONS, key=len, reverse=True):
        if rest.startswith(section + "_") and len(rest) > len(section) + 1:
            return section, rest[len(section) + 1 :]
    expected = f"{ENV_PREFIX}<SECTION>_<KEY> with SECTION in {choices(list(SECTIONS))}"
    raise ConfigError(name, value, expected + f" or {ENV_PREFIX}EXECUTORS", "environment")


# --- Building and checking sections ---------------------------------------------------------


def _build(layers: _Layers, machine_defaults: dict[str, Any], facts: MachineFacts) -> DaemonConfig:
    executors = _executors(layers.executors, facts)
    tables = dict(layers.tables)
    tables["repository"] = {k: Raw(v, "default") for k, v in machine_defaults.items()}
    tables["repository"].update(layers.tables["repository"])
    tables["controller"] = _kind_defaults(executors, tables["controller"])
    sections = {name: build_section(cls, name, tables[name]) for name, cls in SECTIONS.items()}
    config = DaemonConfig(executors=executors, source=layers.file, **sections)
    _check(config, facts)
    return config


def _kind_defaults(executors: tuple[ExecutorConfig, ...], given: dict[str, Raw]) -> dict[str, Raw]:
    """``[controller]``'s ``given`` keys plus the defaults that follow the executors: with only
    local ONNX Runtime CPU executors, warm-ups (docs/controller.md, "Decision (issue 29, point
    4)"), unless the config sets either of their two keys."""
    cpu = all(
        isinstance(e, LocalExecutorConfig) and (e.backend, e.device) == ("onnxruntime", "cpu")
        for e in executors
    )
    if not cpu or {"warm_gap_ns", "warm_up_infers"} & given.keys():
        return given
    source = "default for CPU executors"
    return {"warm_gap_ns": Raw(2_000_000, source), "warm_up_infers": Raw(2, source), **given}


def _executors(raw: Raw | None, facts: MachineFacts) -> tuple[ExecutorConfig, ...]:
    if raw is None:
        return default_executors(facts.cpus)
    if not isinstance(raw.value, list) or not raw.value:
        raise ConfigError("executors", raw.value, "a non-empty array of tables", raw.source)
    built = tuple(_executor(i, table, raw.source) for i, table in enumerate(raw.value))
    return _name_executors(built)


def _executor(index: int, table: Any, source: str) -> ExecutorConfig:
    key = f"executors[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(key, table, "a table", source)
    table = dict(table)
    kind = table.pop("type", ExecutorType.LOCAL.value)
    if kind not in EXECUTOR_TYPES:
        raise ConfigError(f"{key}.type", kind, f"one of {choices(list(EXECUTOR_TYPES))}", source)
    if kind == ExecutorType.LOCAL and "address" in table:
        raise ConfigError(f"{key}.address", table["address"], 'type = "remote" with it', source)
    raw = {k: Raw(v, source) for k, v in table.items()}
    if kind == ExecutorType.REMOTE and "address" in table:
        raw["address"] = Raw(_remote_address(f"{key}.address", table["address"], source), source)
    executor: ExecutorConfig = build_section(EXECUTOR_TYPES[kind], key, raw)
    return executor


def _remote_address(key: str, value: Any, source: str) -> TcpAddress:
    try:
        return TcpAddress.parse(value, allow_port_zero=False)
    except (ValueError, AttributeError, TypeError) as error:
        raise ConfigError(key, value, str(error) or "host:port", source) from None


def _name_executors(executors: tuple[ExecutorConfig, ...]) -> tuple[ExecutorConfig, ...]:
    counts = {ExecutorType.LOCAL: 0, ExecutorType.REMOTE: 0}
    named = []
    for executor in executors:
        kind = (
            ExecutorType.LOCAL if isinstance(executor, LocalExecutorConfig) else ExecutorType.REMOTE
        )
        if not executor.name:
            executor = dataclasses.replace(executor, name=f"{kind.value}-{counts[kind]}")
        counts[kind] += 1
        named.append(executor)
    return tuple(named)


def _check(config: DaemonConfig, facts: MachineFacts) -> None:
    """Cross-key checks no single field can make."""
    _check_server(config.server)
    _check_executors(config.executors, facts)


def _check_server(server: ServerConfig) -> None:
    limits = server.limits
    if limits.max_outstanding_per_connection > limits.max_outstanding_total:
        raise ConfigError(
            "server.max_outstanding_per_connection",
            limits.max_outstanding_per_connection,
            f"at most server.max_outstanding_total ({limits.max_outstanding_total})",
        )
    if limits.max_upload_bytes_in_flight < limits.max_frame_bytes:
        raise ConfigError(
            "server.max_upload_bytes_in_flight",
            limits.max_upload_bytes_in_flight,
            f"at least server.max_frame_bytes ({limits.max_frame_bytes}), the largest upload",
        )
    for key in ("infer_token", "admin_token"):
        _check_token(f"server.{key}", getattr(server, key))
    if server.infer_token and server.infer_token == server.admin_token:
        raise ConfigError("server.admin_token", "<redacted>", "a token different from infer_token")
    if (server.tls_cert_path is None) != (server.tls_key_path is None):
        raise ConfigError("server.tls_key_path", server.tls_key_path, "both tls paths or neither")
    for key in ("tls_cert_path", "tls_key_path"):
        _check_file(f"server.{key}", getattr(server, key))


def _check_token(key: str, token: str) -> None:
    if token and (len(token) < MIN_TOKEN_CHARS or not _TOKEN.match(token)):
        expected = f"at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces"
        raise ConfigError(key, "<redacted>", expected + " (e.g. `openssl rand -hex 32`)")


def _check_file(key: str, path: Path | None) -> None:
    if path is not None and not path.is_file():
        raise ConfigError(key, str(path), "an existing readable file")


def _check_executors(executors: tuple[ExecutorConfig, ...], facts: MachineFacts) -> None:
    names = [executor.name for executor in executors]
    for i, executor in enumerate(executors):
        key = f"executors[{i}]"
        if not _NAME.match(executor.name):
            raise ConfigError(f"{key}.name", executor.name, "letters, digits, - and _ (<= 64)")
        if executor.name in names[:i]:
            raise ConfigError(f"{key}.name", executor.name, "a name unique among executors")
        if isinstance(executor, LocalExecutorConfig):
            _check_local(key, executor, facts.cpus)
        else:
            _check_token(f"{key}.token", executor.token)
            _check_file(f"{key}.tls_ca_path", executor.tls_ca_path)


def _check_local(key: str, executor: LocalExecutorConfig, cpus: Sequence[int]) -> None:
    if executor.backend not in BACKENDS:
        raise ConfigError(f"{key}.backend", executor.backend, f"one of {choices(sorted(BACKENDS))}")
    if not _DEVICE.match(executor.device):
        raise ConfigError(f"{key}.device", executor.device, "cpu, sim or cuda:N")
    if executor.page_bytes > executor.weights_bytes:
        raise ConfigError(f"{key}.page_bytes", executor.page_bytes, "at most weights_bytes")
    if len(set(executor.cpus)) != len(executor.cpus) or not set(executor.cpus) <= set(cpus):
        expected = f"distinct CPUs among those this process may use ({list(cpus)})"
        raise ConfigError(f"{key}.cpus", list(executor.cpus), expected)


def redacted(config: DaemonConfig) -> dict[str, Any]:
    """The config as plain data for logs, section by section and key by key as a file would
    set them, with every secret replaced by ``"<redacted>"``."""
    plain: dict[str, Any] = {name: plain_section(getattr(config, name)) for name in SECTIONS}
    plain["executors"] = [plain_section(executor) for executor in config.executors]
    plain["source"] = config.source
    return plain
