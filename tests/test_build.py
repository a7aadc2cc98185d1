"""The compiled build (issue 28): stale compiled modules are refused, the running build is
reported, and the compiled core decides exactly what the pure one does.

The comparison runs the guard's scenarios (shortened) twice from one compiled install: once
compiled, once with ``CLOCKWORK_ASYNC_PURE=1`` (the same ``.py`` files, loaded as source), and
compares the digests of every request's outcome, batch size and executor. It needs a compiled
build: the running one, or the folder named by ``CLOCKWORK_ASYNC_COMPILED`` (a
``pip install --target`` of a compiled wheel; .ci/run makes one); else it skips.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import clockwork_async
from clockwork_async import build
from clockwork_async.cli import main
from clockwork_async.daemon.metrics import _build_info
from clockwork_async.testing import SIM_EXECUTOR, DaemonProcess, clean_environ, write_config

ROOT = Path(__file__).resolve().parents[1]
COMPILED_VARIABLE = "CLOCKWORK_ASYNC_COMPILED"
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


# --- stale compiled modules ----------------------------------------------------------------


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package ``fakepkg`` with ``sub/mod.py`` and a bogus extension ``sub/mod*.so`` beside
    it: importing the extension fails, so a test sees which one was loaded."""
    package = tmp_path / "fakepkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "mod.py").write_text("ANSWER = 42\n")
    (package / "sub" / f"mod{SUFFIX}").write_bytes(b"not an ELF file")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(build, "_refused", [])
    yield package
    for name in [name for name in sys.modules if name.startswith("fakepkg")]:
        del sys.modules[name]


def record(package: Path, source: bytes) -> None:
    digest = hashlib.sha256(source).hexdigest()
    (package / build.MANIFEST).write_text(json.dumps({"modules": {"fakepkg.sub.mod": digest}}))


def test_a_compiled_module_whose_source_changed_is_stale(fake_package: Path) -> None:
    record(fake_package, b"ANSWER = 41\n")
    assert build.stale_modules(fake_package) == {"fakepkg.sub.mod": fake_package / "sub/mod.py"}
    record(fake_package, (fake_package / "sub" / "mod.py").read_bytes())
    assert build.stale_modules(fake_package) == {}


def test_an_unrecorded_compiled_module_is_stale(fake_package: Path) -> None:
    assert list(build.stale_modules(fake_package)) == ["fakepkg.sub.mod"]


def test_a_stale_build_loads_every_module_from_source(fake_package: Path) -> None:
    with pytest.raises(ImportError):  # the bogus extension is what Python picks by default
        importlib.import_module("fakepkg.sub.mod")
    build.guard_stale_modules(fake_package)
    module = importlib.import_module("fakepkg.sub.mod")
    assert module.ANSWER == 42 and not build.is_compiled(module)


def test_a_fresh_build_is_left_alone(fake_package: Path) -> None:
    record(fake_package, (fake_package / "sub" / "mod.py").read_bytes())
    before = list(sys.meta_path)
    build.guard_stale_modules(fake_package)
    assert sys.meta_path == before


# --- what is compiled can be compiled -----------------------------------------------------

# Classes that subclass a compiled class not open to them, in code that runs only on the pure
# build. Empty it, do not grow it.
PURE_ONLY_SUBCLASSES: set[tuple[str, str]] = set()
CHECKED_FOLDERS = ("src", "executors", "benchmarks", "tests/core", "tests/sim")


def compiled_module_names() -> set[str]:
    chosen = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["clockwork-async"]
    paths = {p for pattern in chosen["mypyc"]["include"] for p in (ROOT / "src").glob(pattern)}
    paths -= {p for pattern in chosen["mypyc"]["exclude"] for p in (ROOT / "src").glob(pattern)}
    return {".".join(path.relative_to(ROOT / "src").with_suffix("").parts) for path in paths}


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "src":
        parts = parts[1:]
    elif parts[0] == "executors":
        parts = ("clockwork_async", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> module it was imported from (``from X import name``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, source] if source else base)
            for alias in node.names:
                names[alias.asname or alias.name] = source
    return names


def open_to_subclasses(compiled: set[str]) -> set[tuple[str, str]]:
    """(module, class) of compiled classes marked allow_interpreted_subclasses=True."""
    marked = set()
    for module in compiled:
        path = ROOT / "src" / Path(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(decorator, ast.Call)
                and any(
                    keyword.arg == "allow_interpreted_subclasses"
                    and isinstance(keyword.value, ast.Constant)
                    and keyword.value.value is True
                    for keyword in decorator.keywords
                )
                for decorator in node.decorator_list
            ):
                marked.add((module, node.name))
    return marked


def subclasses_of_compiled(compiled: set[str]) -> set[tuple[str, str]]:
    """(file, class) of Python classes whose base is a compiled class not open to them."""
    open_ = open_to_subclasses(compiled)
    found = set()
    for folder in CHECKED_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            module = module_of(path)
            if module in compiled:
                continue
            tree = ast.parse(path.read_text())
            names = imported_names(tree, module, path.name == "__init__.py")
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(base, ast.Name)
                    and names.get(base.id) in compiled
                    and (names[base.id], base.id) not in open_
                    for base in node.bases
                ):
                    found.add((str(path.relative_to(ROOT)), node.name))
    return found


def test_no_python_class_subclasses_a_compiled_class() -> None:
    compiled = compiled_module_names()
    assert "clockwork_async.core.controller" in compiled
    assert "clockwork_async.core.__init__" not in compiled
    assert ("clockwork_async.sim.stats", "SimStats") in open_to_subclasses(compiled)
    assert ("clockwork_async.core.controller", "Controller") in open_to_subclasses(compiled)
    assert subclasses_of_compiled(compiled) == PURE_ONLY_SUBCLASSES


# --- the running build is visible ----------------------------------------------------------


def test_version_names_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"clockwork-async {build.version()} (core ")
    assert ("compiled with mypyc" in line) == build.core_compiled()


def test_build_info_metric_has_the_core_label() -> None:
    (sample,) = _build_info().samples
    assert sample.labels == {"version": build.version(), "core": build.core_label()}
    assert build.core_label() in {"compiled", "pure"}


# --- pure and compiled decide the same -----------------------------------------------------

COMPARE = """
import dataclasses, json
from benchmarks import guard
from clockwork_async import build
chosen = {"overload-2x": 3.0, "bursty": 4.0, "poisson-100pct": 4.0, "overload-2x-timeout": 2.0}
digests = {}
for scenario in guard.SCENARIOS:
    if scenario.name in chosen:
        short = dataclasses.replace(scenario, duration_s=chosen[scenario.name])
        digests[scenario.name] = guard.run_scenario(short).record["digest"]
print(json.dumps({"core": build.core_label(), "digests": digests}))
"""


def compiled_install() -> Path | None:
    """A folder holding a compiled ``clockwork_async`` package, or None."""
    named = os.environ.get(COMPILED_VARIABLE)
    if named:
        return Path(named)
    if build.core_compiled():
        return Path(clockwork_async.__file__).resolve().parents[1]
    return None


def simulate_with(install: Path, pure: bool) -> dict[str, object]:
    environment = {**os.environ, "PYTHONPATH": f"{install}{os.pathsep}{ROOT}"}
    environment[build.PURE_VARIABLE] = "1" if pure else "0"
    done = subprocess.run(
        [sys.executable, "-c", COMPARE],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


@pytest.mark.slow
def test_compiled_and_pure_cores_decide_the_same() -> None:
    install = compiled_install()
    if install is None:
        pytest.skip(f"no compiled build: not running one and {COMPILED_VARIABLE} is unset")
    compiled = simulate_with(install, pure=False)
    pure = simulate_with(install, pure=True)
    assert (compiled["core"], pure["core"]) == ("compiled", "pure")
    assert compiled["digests"] == pure["digests"]
    assert len(pure["digests"]) == 4  # type: ignore[arg-type]


# --- a daemon started for a test or a benchmark runs the build it was asked for ---------------


def test_clean_environ_keeps_the_build_switch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A side-by-side benchmark's "pure" daemon ran the compiled core while `clean_environ`
    dropped ``CLOCKWORK_ASYNC_PURE`` with the daemon's config variables."""
    monkeypatch.setenv(build.PURE_VARIABLE, "1")
    monkeypatch.setenv("CLOCKWORK_ASYNC_SERVER_LISTEN", "127.0.0.1:1")
    environment = clean_environ(tmp_path)
    assert environment[build.PURE_VARIABLE] == "1"
    assert "CLOCKWORK_ASYNC_SERVER_LISTEN" not in environment


@pytest.mark.slow
@pytest.mark.parametrize("pure", [True, False])
def test_a_daemon_runs_the_build_it_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pure: bool
) -> None:
    install = compiled_install()
    if install is None:
        pytest.skip(f"no compiled build: not running one and {COMPILED_VARIABLE} is unset")
    monkeypatch.setenv("PYTHONPATH", f"{install}{os.pathsep}{ROOT}")
    monkeypatch.setenv(build.PURE_VARIABLE, "1" if pure else "0")
    config = write_config(tmp_path, SIM_EXECUTOR)
    with DaemonProcess.start(tmp_path, config) as daemon:
        metrics = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    expected = "pure" if pure else "compiled"
    assert f'core="{expected}"' in metrics
