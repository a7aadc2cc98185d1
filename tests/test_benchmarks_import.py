"""Every module of benchmarks/ imports, and every benchmark's argument parser accepts its
defaults (and ``--quick`` where it has one), so that none rots unseen between the runs that
use it. Nothing is run: parsing only.

A module whose import needs an optional package that is missing (Ray Serve lives in its own
venv, atheris and the GPU libraries are extras) is skipped, naming the module, the package and
why; any other import error fails. Today every module imports its optional packages inside
the functions that need them, so nothing is skipped where the project's dependencies are.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# Packages the project does not install by default, and where they come from.
OPTIONAL_PACKAGES = {
    "ray": "Ray Serve runs in its own venv (.bench-venv/ray, benchmarks/requirements-ray.txt)",
    "atheris": "the fuzz extra (pip install .[fuzz])",
    "matplotlib": "the plot extra (pip install .[plot])",
    "cupy": "the gpu extra (docs/gpu.md)",
    "pynvml": "the gpu extra (docs/gpu.md)",
}
# Modules with no command line of their own: libraries, and the atheris target (libFuzzer
# parses its arguments).
NO_PARSER = {"benchmarks.fuzz_atheris_target", "benchmarks.gpu_models", "benchmarks.ray_side"}
# Arguments a parser requires (a generator process always told where to send, a verb).
REQUIRED_ARGS = {
    "benchmarks.guard": ["check"],
    "benchmarks.http_loadgen": [
        *("--port", "1", "--model", "m.onnx", "--rate", "1", "--duration-s", "1"),
        *("--slo-ms", "100", "--out", "out.json"),
    ],
    "benchmarks.ray_app": ["--model", "m.onnx", "--port", "1", "--temp-dir", "t"],
}


def _module_names() -> list[str]:
    found = []
    for info in pkgutil.walk_packages([str(BENCHMARKS)], prefix="benchmarks."):
        found.append(info.name)
    return sorted(found)


MODULES = _module_names()


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        package = (error.name or "").partition(".")[0]
        if package not in OPTIONAL_PACKAGES:
            raise
        pytest.skip(f"{name} needs {package}, not installed: {OPTIONAL_PACKAGES[package]}")


def test_the_walk_finds_the_benchmarks() -> None:
    assert {"benchmarks.lib", "benchmarks.lib.stats", "benchmarks.overload"} <= set(MODULES)
    assert len(MODULES) > 25


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_and_parses_its_defaults(name: str) -> None:
    module = _import(name)
    build_parser = getattr(module, "build_parser", None)
    if build_parser is None:
        assert (
            name in NO_PARSER or not hasattr(module, "main") or name.startswith("benchmarks.lib")
        ), f"{name} has a main() but no build_parser()"
        return
    parser = build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    base = REQUIRED_ARGS.get(name, [])
    parser.parse_args(base)
    if any("--quick" in action.option_strings for action in parser._actions):
        assert parser.parse_args([*base, "--quick"]).quick is True
