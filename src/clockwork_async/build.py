"""Which build is running: the core compiled with mypyc, or pure Python (issue 28).

setup.py compiles the core (and a few simulator modules) when it can and writes
``clockwork_async/_compiled.json``: the sha256 of each compiled module's source at build time.

Invariants:
- A compiled module is used only if its ``.py`` beside it is the source it was built from.
  `guard_stale_modules` (run by the package's ``__init__``, before any of them is imported)
  checks every extension module in the package against the manifest; if one is stale or
  unaccounted for (no manifest entry: a hand-made build), every such module is loaded from its
  source instead, all of them, since mypyc's modules call one another directly and must not
  be mixed across two versions. One log line says so; `describe` reports it.
- What is reported is what was imported: `core_compiled` asks the loaded controller module,
  not the files on disk.
- `mypyc_attr` is mypy_extensions' class decorator for type checking and mypyc, a no-op when
  this module runs (it is never compiled).
- Stdlib only and cheap (a directory listing; hashing a few hundred kB only in a compiled
  build): every process imports it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # mypyc reads the real decorator (its attributes change how a class is compiled); the
    # pure build runs the no-op below and needs no mypy_extensions.
    from mypy_extensions import mypyc_attr as mypyc_attr
else:

    def mypyc_attr(*_names: Any, **_settings: Any) -> Any:
        """No-op at run time (see the TYPE_CHECKING import above)."""
        return lambda cls: cls


PACKAGE = "clockwork_async"
MANIFEST = "_compiled.json"
PURE_VARIABLE = "CLOCKWORK_ASYNC_PURE"  # "1": load every module from source (side by side runs)
PROBE_MODULE = f"{PACKAGE}.core.controller"  # compiled in every compiled build
_HERE = Path(__file__).resolve().parent
_refused: list[str] = []  # why compiled modules were not used, for `describe`


class _FromSource(importlib.abc.MetaPathFinder):
    """Loads the named modules from their ``.py``, past the extension beside it."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self._sources = sources

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        source = self._sources.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def _extension_modules(root: Path) -> dict[str, Path]:
    """Module name -> its ``.py``, for each extension module with a source beside it."""
    found: dict[str, Path] = {}
    folders = [root, *(entry for entry in root.iterdir() if entry.is_dir())]
    for folder in folders:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            for extension in folder.glob(f"*{suffix}"):
                source = extension.with_name(extension.name[: -len(suffix)] + ".py")
                if source.exists():
                    parts = source.relative_to(root.parent).with_suffix("").parts
                    found[".".join(parts)] = source
    return found


def _recorded_digests(root: Path) -> dict[str, str]:
    import json  # here, as hashlib and logging below: a pure build never needs them

    try:
        modules = json.loads((root / MANIFEST).read_text())["modules"]
    except (OSError, ValueError, KeyError):
        return {}
    return {str(name): str(digest) for name, digest in modules.items()}


def stale_modules(root: Path = _HERE) -> dict[str, Path]:
    """The extension modules in the package whose source is not the one they were built from."""
    extensions = _extension_modules(root)
    if not extensions:
        return {}
    import hashlib

    recorded = _recorded_digests(root)
    return {
        name: source
        for name, source in extensions.items()
        if recorded.get(name) != hashlib.sha256(source.read_bytes()).hexdigest()
    }


def guard_stale_modules(root: Path = _HERE) -> None:
    """If any compiled module is stale (or ``CLOCKWORK_ASYNC_PURE=1``), load every compiled
    module from its source."""
    if os.environ.get(PURE_VARIABLE) == "1":
        _load_from_source(root, f"{PURE_VARIABLE}=1")
        return
    stale = sorted(stale_modules(root))
    if not stale:
        return
    _load_from_source(root, f"compiled build refused: {len(stale)} module(s) stale")
    import logging

    logging.getLogger(f"{PACKAGE}.build").warning(
        "clockwork-async: %d compiled module(s) do not match their source (%s); using the "
        "pure-Python modules; rebuild (docs/benchmarks.md, 'Compiled core') to compile again",
        len(stale),
        ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else ""),
    )


def _load_from_source(root: Path, reason: str) -> None:
    extensions = _extension_modules(root)
    if extensions:
        sys.meta_path.insert(0, _FromSource(extensions))
        _refused[:] = [reason]


def is_compiled(module: ModuleType) -> bool:
    """Whether a loaded module is an extension (mypyc) rather than Python source."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


@cache
def core_compiled() -> bool:
    """Whether the running core is the mypyc-compiled one."""
    return is_compiled(importlib.import_module(PROBE_MODULE))


def core_label() -> str:
    """``compiled`` or ``pure``: the metric label and the stats field."""
    return "compiled" if core_compiled() else "pure"


@cache
def version() -> str:
    from importlib import metadata  # 20 ms to import: only when asked

    try:
        return metadata.version("clockwork-async")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe() -> str:
    """One line for ``--version``: the version and which build runs."""
    if core_compiled():
        build = f"core compiled with mypyc ({len(_extension_modules(_HERE))} modules)"
    elif _refused:
        build = f"core pure Python ({_refused[0]})"
    else:
        build = "core pure Python"
    return f"clockwork-async {version()} ({build})"
