"""The systemd unit, the example config and the operations docs agree with the code: the unit
verifies and scores <= 3.0 where systemd-analyze exists, MemoryDenyWriteExecute holds for ONNX
Runtime where the kernel can enforce it, every config key and metric is documented."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tomllib
from enum import Enum
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from clockwork_async.api.server import ServerLimits
from clockwork_async.config import daemon as config_module
from clockwork_async.config.daemon import MachineFacts, load_config
from clockwork_async.config.fields import section_keys, section_values
from clockwork_async.core.config import ControllerConfig
from clockwork_async.daemon.metrics import ExecutorGauges, LiveSnapshot, Metrics
from clockwork_async.models.info import ModelSettings
from clockwork_async.wire.addresses import TcpAddress

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "packaging" / "systemd" / "clockwork-async.service"
EXAMPLE = ROOT / "packaging" / "config" / "clockwork-async.toml"
CONFIGURATION_DOC = ROOT / "docs" / "configuration.md"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
MACHINE = MachineFacts(cpus=(0, 1), memory_bytes=8 << 30)
MAX_EXPOSURE = 3.0


def unit_settings() -> dict[str, list[str]]:
    """Key -> values (in order) of the unit's [Service] and [Unit] sections."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|min)?", value)
    assert match, value
    return float(match[1]) * (60 if match[2] == "min" else 1)


def test_unit_is_notify_with_watchdog_reload_and_drain_bounds() -> None:
    unit = unit_settings()
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]
    assert seconds(unit["WatchdogSec"][0]) > 0
    assert unit["ExecStart"] == [
        "/usr/bin/clockwork-async serve --config /etc/clockwork-async/clockwork-async.toml"
    ]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["KillMode"] == ["mixed"]
    assert seconds(unit["TimeoutStopSec"][0]) > ServerLimits().drain_timeout_s + 10
    assert int(unit["LimitNOFILE"][0]) >= ServerLimits().max_connections + 1024
    assert unit["DynamicUser"] == ["yes"] or unit.get("User") == ["clockwork"]
    assert unit["StateDirectory"] == ["clockwork-async"]


def test_unit_hardening_settings() -> None:
    unit = unit_settings()
    for key in (
        "NoNewPrivileges",
        "PrivateTmp",
        "ProtectHome",
        "PrivateDevices",
        "RestrictNamespaces",
        "LockPersonality",
        "MemoryDenyWriteExecute",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
    ):
        assert unit[key] == ["yes"], key
    assert unit["ProtectSystem"] == ["strict"]
    assert unit["CapabilityBoundingSet"] == [""]
    assert unit["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert "@system-service" in unit["SystemCallFilter"]


@pytest.fixture
def checkable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at a binary that exists here (verify checks it)."""
    text = UNIT.read_text().replace("ExecStart=/usr/bin/clockwork-async ", "ExecStart=/bin/true ")
    path = tmp_path / UNIT.name
    path.write_text(text)
    return path


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


@needs_systemd_analyze
def test_systemd_analyze_verify_is_clean(checkable_unit: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(checkable_unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""  # unknown keys only warn: none allowed


@needs_systemd_analyze
@pytest.mark.skipif(Path("/usr/bin/clockwork-async").exists(), reason="installed here")
def test_verify_of_the_shipped_unit_fails_only_as_its_comment_and_the_docs_say(
    tmp_path: Path,
) -> None:
    shipped = tmp_path / UNIT.name
    shipped.write_text(UNIT.read_text())
    result = subprocess.run(
        ["systemd-analyze", "verify", str(shipped)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    said = "Command /usr/bin/clockwork-async is not executable"
    assert f"{UNIT.name}: {said}: No such file or directory" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # that and nothing else
    assert said in UNIT.read_text()
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert f"`{said}: No such file or directory`" in " ".join(operations.split())


@needs_systemd_analyze
def test_systemd_analyze_security_exposure_is_at_most_3(checkable_unit: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(checkable_unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= MAX_EXPOSURE


MDWE_CHILD = r"""
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    print("unsupported"); sys.exit(0)
import asyncio
import numpy as np, onnxruntime as ort, uvloop
from onnx import TensorProto, helper, numpy_helper
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])
w = numpy_helper.from_array(np.ones((32, 32), np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
for threads in (1, 2):
    options = ort.SessionOptions(); options.intra_op_num_threads = threads
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": np.ones((8, 32), np.float32)})[0]
    assert out.shape == (8, 32) and float(out[0, 0]) == 32.0
async def main(): return 7
assert uvloop.run(main()) == 7
assert ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda v: v + 1)(1) == 2
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except OSError:
    print("enforced-and-working")
else:
    print("not-enforced")
"""


def test_onnxruntime_works_when_writable_executable_memory_is_denied() -> None:
    result = subprocess.run(
        [sys.executable, "-c", MDWE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "unsupported":
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
    assert result.stdout.strip() == "enforced-and-working"


def test_example_config_holds_every_default() -> None:
    environ = {"HOME": "/home/op"}
    example = load_config(EXAMPLE, environ, {}, machine=MACHINE)
    defaults = load_config(None, environ, {}, machine=MACHINE)
    assert dataclasses.replace(example, source="") == defaults


MACHINE_DEPENDENT = {"path", "profile_cache_dir", "weights_budget_bytes", "name", "address"}


def documented_defaults() -> dict[str, dict[str, str]]:
    """The default column of docs/configuration.md, per section (``executors`` for local
    executors, ``remote executors``) and key, as written."""
    defaults: dict[str, dict[str, str]] = {}
    section = ""
    for line in CONFIGURATION_DOC.read_text().splitlines():
        heading = re.match(r"^#+ (?:`\[\[?(\w+)\]?\]`)?", line)
        if heading:
            section = heading[1] or ""
            continue
        if line.startswith("| key |") and section in defaults:
            section = "remote executors"  # the second table under [[executors]]
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)]
        key = re.fullmatch(r"`(\w+)`", cells[1]) if len(cells) == 6 else None
        if section and key:
            defaults.setdefault(section, {})[key[1]] = cells[3]
    return defaults


def documented_value(cell: str) -> object:
    """A default cell as a value: ``67108864 (64 MiB)`` -> 67108864, ```plain``` -> "plain",
    ``unset`` -> None."""
    text = re.sub(r"\s*\(.*\)$", "", cell).strip("`")
    if text == "unset":
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def test_documented_defaults_are_the_dataclasses() -> None:
    """Each default in docs/configuration.md is the one its section's dataclass holds (the
    example config is checked against them by test_example_config_holds_every_default)."""
    built = load_config(None, {"HOME": "/home/op"}, {}, machine=MACHINE)
    sections: dict[str, object] = {name: getattr(built, name) for name in config_module.SECTIONS}
    sections["executors"] = config_module.LocalExecutorConfig()
    sections["remote executors"] = config_module.RemoteExecutorConfig(TcpAddress("h", 1))
    documented = documented_defaults()
    assert set(documented) == set(sections)
    compared = 0
    for section, instance in sections.items():
        plain = {k: v for k, (v, _secret) in section_values(instance).items()}
        assert set(documented[section]) == set(plain), section
        for key, cell in documented[section].items():
            if key in MACHINE_DEPENDENT:
                continue
            value = plain[key]
            if isinstance(value, TcpAddress | Enum):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            assert documented_value(cell) == value, (section, key, cell)
            compared += 1
    assert compared > 60


def every_key() -> dict[str, list[str]]:
    sections = {name: cls for name, cls in config_module.SECTIONS.items()}
    sections["executors"] = config_module.LocalExecutorConfig
    sections["remote executors"] = config_module.RemoteExecutorConfig
    return {name: list(section_keys(cls)) for name, cls in sections.items()}


def test_every_key_is_in_the_example_and_the_docs() -> None:
    example = EXAMPLE.read_text()
    docs = CONFIGURATION_DOC.read_text()
    for section, keys in every_key().items():
        for key in keys:
            assert re.search(rf"^#? ?{key} = ", example, re.MULTILINE), (section, key)
            assert f"| `{key}` |" in docs, (section, key)
    for key in (f.name for f in dataclasses.fields(ModelSettings)):
        assert f"| `{key}` |" in docs, ("model.toml", key)
    assert len(every_key()["controller"]) == len(dataclasses.fields(ControllerConfig))


def test_every_metric_is_documented() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, include_process=False)
    live = LiveSnapshot((ExecutorGauges("local-0", True, 1, 2, 1),), 1, {"g": 1}, 1, 1, 1, 1, 1)
    metrics.set_snapshot_source(lambda: live)
    docs = OPERATIONS_DOC.read_text()
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in docs, name


def test_every_package_folder_ships_in_the_wheel() -> None:
    """setuptools installs only the packages pyproject lists: a new sub-package left out would
    import in the source tree and be missing from every installed daemon."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    source = ROOT / "src"
    folders = {
        ".".join(init.parent.relative_to(source).parts)
        for init in source.glob("clockwork_async/**/__init__.py")
    }
    assert folders - {"clockwork_async.executors"} <= listed, sorted(folders - listed)
    assert "clockwork_async.executors" in listed
