"""The build: the pure core compiled to C with mypyc when it can be (issue 28), pure otherwise.

Metadata lives in pyproject.toml; this file only decides which modules are compiled.

    pip install .                                  # compiled if a C compiler, Python headers
                                                   # and mypy are there; else pure (one line)
    pip install -e .                               # pure, always, unless asked:
    CLOCKWORK_ASYNC_COMPILE=1 pip install -e .     # compiled; fails if it cannot be
    CLOCKWORK_ASYNC_COMPILE=0 pip install .        # pure

Invariants:
- The compiled modules are the same source: pyproject.toml's ``[tool.clockwork-async.mypyc]``
  globs (every core module, so the list follows the core, and the simulator modules measured
  to gain: docs/benchmarks.md, "Compiled core"). A module mypyc cannot handle is excluded there.
- ``auto`` (the default) never fails an install for want of a compiler: any failure to compile
  falls back to the pure modules and says so in one line starting with ``clockwork-async
  build:`` (``pip install -v`` shows it; ``clockwork-async --version`` shows what was built).
  ``1`` fails loudly instead (CI uses it, so a module mypyc rejects is noticed).
- A compiled build also installs ``clockwork_async/_compiled.json``: the sha256 of each compiled
  module's source when it was built. `clockwork_async.build` refuses a compiled module whose
  ``.py`` beside it has changed since (an editable compiled build that was edited afterwards):
  then every module is loaded from its source.
- No extension of an earlier build reaches a wheel (setuptools reuses build/: they are removed
  from it first), and a pure editable build removes an earlier compiled editable build's files
  from src/.
- mypycify runs (type check + C generation, the slow part) only in build_ext, never for the
  metadata steps pip runs first.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

MODE_VARIABLE = "CLOCKWORK_ASYNC_COMPILE"
ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "clockwork_async"
MANIFEST = "_compiled.json"
GROUP_NAME = "clockwork_async_compiled"  # the shared library: clockwork_async_compiled__mypyc
PLACEHOLDER = "clockwork_async._placeholder"  # replaced by mypycify's extensions in build_ext
EDITABLE_COMMANDS = ("editable_wheel", "develop")


def log(message: str) -> None:
    print(f"clockwork-async build: {message}", file=sys.stderr, flush=True)


def mode() -> str:
    """auto | on | off, from the environment."""
    value = os.environ.get(MODE_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "yes", "true", "on"):
        return "on"
    if value in ("0", "no", "false", "off"):
        return "off"
    raise SystemExit(f"{MODE_VARIABLE}={value!r}: expected auto, 1 or 0")


def editable() -> bool:
    return any(command in sys.argv for command in EDITABLE_COMMANDS)


def compiled_sources() -> list[Path]:
    """The modules compiled: pyproject.toml's [tool.clockwork-async.mypyc] globs."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["clockwork-async"]
    chosen = settings["mypyc"]
    included = {path for pattern in chosen["include"] for path in (ROOT / "src").glob(pattern)}
    excluded = {path for pattern in chosen["exclude"] for path in (ROOT / "src").glob(pattern)}
    return sorted(included - excluded)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT / "src").with_suffix("").parts)


def wanted() -> bool:
    """Whether this build tries to compile (before knowing whether it can)."""
    chosen = mode()
    # Development (editable) stays pure unless asked.
    return chosen == "on" or (chosen == "auto" and not editable())


def compiler_problem(command: build_ext) -> str | None:
    """Why nothing can be compiled here (no mypy, no compiler, no headers), or None."""
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypy (mypyc) is not importable"
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler, get_python_inc

    compiler = new_compiler(compiler=command.compiler)
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.c"
        probe.write_text("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        try:
            compiler.compile(
                [str(probe)], output_dir=folder, include_dirs=[get_python_inc()], extra_postargs=[]
            )
        except Exception as error:  # CompileError, or no compiler at all (an OSError)
            return f"cannot compile a C file against Python.h ({type(error).__name__})"
    return None


def source_digests(sources: list[Path]) -> dict[str, str]:
    return {module_name(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in sources}


class BuildCompiledCore(build_ext):
    """build_ext that compiles the core with mypyc, or falls back to pure Python in auto mode."""

    def finalize_options(self) -> None:
        # mypycify's extensions replace the placeholder before setuptools prepares them.
        self._sources: list[Path] = []
        self._problem: str | None = None
        if self.distribution.ext_modules:
            self.distribution.ext_modules = self._mypycify()
        super().finalize_options()

    def _mypycify(self) -> list[Extension]:
        self._problem = compiler_problem(self)
        if self._problem is not None:
            return []
        from mypyc.build import mypycify

        sources = compiled_sources()
        os.chdir(ROOT)  # mypy reads [tool.mypy] from pyproject.toml here
        try:
            extensions = mypycify(
                [str(path.relative_to(ROOT)) for path in sources],
                opt_level="3",
                group_name=GROUP_NAME,
                target_dir=str(ROOT / "build" / "mypyc"),
            )
        except (Exception, SystemExit) as error:  # mypyc exits on a type error
            self._problem = f"mypyc failed: {type(error).__name__}: {error}"
            return []
        self._sources = sources
        return list(extensions)

    def run(self) -> None:
        self._remove_earlier_outputs()
        if self._problem is not None:
            self._fall_back(self._problem)
            return
        self.parallel = os.cpu_count() or 1
        try:
            super().run()
        except Exception as error:  # CompileError, LinkError
            self._remove_outputs()
            self._fall_back(f"the C compiler failed: {type(error).__name__}: {error}")
            return
        self._write_manifest(self._sources)
        log(f"compiled {len(self._sources)} modules with mypyc")

    def _remove_earlier_outputs(self) -> None:
        """An earlier build's extensions and manifest in the build folder (setuptools reuses
        it) must not reach this wheel: a module no longer compiled would shadow its source."""
        if self.inplace:
            return  # remove_compiled_leftovers' job, and the stale check's
        build_lib = Path(self.build_lib)
        package = build_lib / "clockwork_async"
        earlier = [*package.rglob("*.so"), *build_lib.glob(f"{GROUP_NAME}*"), package / MANIFEST]
        for path in earlier:
            path.unlink(missing_ok=True)

    def _remove_outputs(self) -> None:
        for extension in self.extensions:
            Path(self.get_ext_fullpath(extension.name)).unlink(missing_ok=True)

    def _manifest_path(self) -> Path:
        if self.inplace:  # an editable compiled build: beside the sources (git ignores it)
            return PACKAGE / MANIFEST
        return Path(self.build_lib) / "clockwork_async" / MANIFEST

    def _write_manifest(self, sources: list[Path]) -> None:
        path = self._manifest_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"modules": source_digests(sources)}, indent=1) + "\n")

    def _fall_back(self, problem: str) -> None:
        if mode() == "on":
            raise SystemExit(f"clockwork-async build: {MODE_VARIABLE}=1 but {problem}")
        log(f"installing the pure-Python modules: {problem}")
        self.extensions = []
        self.distribution.ext_modules = []
        if self.inplace:
            (PACKAGE / MANIFEST).unlink(missing_ok=True)


def remove_compiled_leftovers() -> None:
    """A pure editable build after a compiled one: the old extension modules in the source tree
    would shadow the edited sources (Python prefers the .so), so they go."""
    # The project has no C sources of its own: every extension in the package is mypyc's.
    leftovers = [*PACKAGE.rglob("*.so"), *(ROOT / "src").glob(f"{GROUP_NAME}*")]
    leftovers += [path for path in (PACKAGE / MANIFEST,) if path.exists()]
    for path in leftovers:
        path.unlink()
    if leftovers:
        log(f"removed {len(leftovers)} compiled files of an earlier build from the source tree")


def ext_modules() -> list[Extension]:
    if not wanted():
        if editable():
            remove_compiled_leftovers()
        return []
    # A placeholder so that setuptools runs build_ext and tags the wheel for this platform;
    # build_ext replaces it with mypycify's extensions (or none).
    return [Extension(PLACEHOLDER, sources=[])]


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildCompiledCore})
