"""The model repository: one folder per model under one root, holding ``model.onnx`` and an
optional ``model.toml``; plus the host-memory budget check and the on-disk profile cache.

Invariants (security): a folder name is a model name and matches ``MODEL_NAME`` (letters,
digits, ``-``, ``_``; no dots, no slashes), so no name can leave the root; files are opened
read-only, never through a symlink that resolves outside the root, and only regular files are
read; an ONNX file that refers to external data is refused (it would make the runtime open
other paths); nothing in a folder is ever executed. Writes go to a hidden staging folder and
are renamed into place, so a reader sees the old model or the new one, never half of one.
Every method blocks on file I/O, so the daemon calls them from a worker thread, one call at a
time (a Repository is not thread-safe).

Versions: a folder's ``version`` file holds its version, a decimal integer (1 when the file is
absent); `add` writes it, so a replaced model keeps its count across restarts.

Instances: ``copies = N`` in model.toml registers the file under ``N`` names, ``NAME-0`` to
``NAME-{N-1}`` (``copies = 1``, the default, registers just ``NAME``). They share host weights
and profiles (by content hash) and have their own device pages.

One idea: the model folders on disk, read only through validated entries and written only by
an atomic swap that a crash cannot leave half done.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from clockwork_async.core.buckets import Bucket, all_buckets
from clockwork_async.models.axes import AxisDeclaration, ShapePlan
from clockwork_async.models.info import (
    DEFAULT_SIM_PROFILE,
    MODEL_NAME,
    InvalidModel,
    ModelInfo,
    RepositoryError,
    read_model_info,
)
from clockwork_async.models.profile_cache import ProfileCache, machine_key
from clockwork_async.wire.messages import TensorSpec

__all__ = [
    "MODEL_NAME",
    "BudgetExceeded",
    "InvalidModel",
    "InvalidModelName",
    "ModelEntry",
    "ModelNotFound",
    "ModelTooLarge",
    "ProfileCache",
    "Repository",
    "RepositoryError",
    "ScanProblem",
    "check_budget",
    "machine_key",
]

log = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
TOML_FILE = "model.toml"
VERSION_FILE = "version"
MAX_TOML_BYTES = 1 << 20
MAX_VERSION_BYTES = 32


class InvalidModelName(RepositoryError):
    """A name that is not a ``MODEL_NAME`` (could escape the root or clash with staging)."""


class ModelTooLarge(RepositoryError):
    """An upload over ``repository.max_model_bytes``."""


class ModelNotFound(RepositoryError):
    code = "unknown_model"


class BudgetExceeded(RepositoryError):
    """Registering would put host-side weights over ``repository.weights_budget_bytes``."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model folder, validated: what registration needs."""

    name: str
    onnx_path: Path
    sha256: str  # content hash of model.onnx (shares host weights and profiles)
    size_bytes: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]  # ascending; profiling may offer fewer
    batch_sizes_declared: bool  # from model.toml rather than inferred
    default_slo_ns: int
    copies: int
    group: str
    sim_profile: str = DEFAULT_SIM_PROFILE  # what simulated executors run it as
    axes: tuple[AxisDeclaration, ...] = ()  # declared dynamic input axes (model.toml)
    default_slo_declared: bool = False  # in model.toml; else derived from its speed if slow
    version: int = 1  # 1, then one more at each replace (the folder's ``version`` file)
    shapes: ShapePlan | None = None  # declared axes as dimensions and buckets (models/axes.py)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets it is served by (core/buckets.py), smallest first; () when it is served
        as one model (no declared axis, or one length and no padding)."""
        if self.shapes is None or not self.shapes.bucketed:
            return ()
        return all_buckets([dimension.lengths for dimension in self.shapes.dimensions])

    def at_bucket(self, bucket: Bucket) -> ModelEntry:
        """This entry with its inputs at ``bucket`` (its variant's own profile key)."""
        assert self.shapes is not None
        return replace(self, inputs=self.shapes.inputs_at(self.inputs, bucket))

    @property
    def profile_key(self) -> str:
        """What its profiles are cached by: the file's hash, mixed with the declared input
        shapes where model.toml declares axes (a profile at one length says nothing of another)."""
        if not self.axes:
            return self.sha256
        shapes = repr([(spec.name, spec.shape) for spec in self.inputs])
        return hashlib.sha256(f"{self.sha256} {shapes}".encode()).hexdigest()

    @property
    def instances(self) -> tuple[str, ...]:
        """The names it is served under: NAME, or NAME-0 .. NAME-{copies-1}."""
        if self.copies == 1:
            return (self.name,)
        return tuple(f"{self.name}-{i}" for i in range(self.copies))


@dataclass(frozen=True, slots=True)
class ScanProblem:
    folder: str
    reason: str


@dataclass(frozen=True, slots=True)
class ScanReport:
    entries: tuple[ModelEntry, ...]
    problems: tuple[ScanProblem, ...] = ()


@dataclass
class _CacheSlot:
    key: tuple[Any, ...]
    entry: ModelEntry


@dataclass
class Repository:
    """The folders under ``root`` (created if missing)."""

    root: Path
    max_model_bytes: int = 1 << 30
    _cache: dict[str, _CacheSlot] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.root = self.root.resolve(strict=True)
        self._recover()

    def scan(self) -> list[ModelEntry]:
        """Every valid model folder, sorted by name; broken folders are logged and skipped."""
        report = self.scan_report()
        for problem in report.problems:
            log.warning("model folder %r skipped: %s", problem.folder, problem.reason)
        return list(report.entries)

    def scan_report(self) -> ScanReport:
        """Every model folder: the valid entries and, for the others, why not."""
        entries: list[ModelEntry] = []
        problems: list[ScanProblem] = []
        for folder in sorted(os.listdir(self.root)):
            if folder.startswith("."):
                continue  # staging and trash
            try:
                entries.append(self._entry(folder))
            except RepositoryError as error:
                problems.append(ScanProblem(folder, str(error)))
        self._cache = {k: v for k, v in self._cache.items() if k in {e.name for e in entries}}
        kept, clashes = _without_clashes(entries)
        return ScanReport(tuple(kept), tuple(problems + clashes))

    def get(self, name: str) -> ModelEntry:
        """The entry of folder ``name``; raises ModelNotFound or InvalidModel."""
        _check_name(name)
        if not (self.root / name).exists():
            raise ModelNotFound(f"no model {name!r} in the repository")
        return self._entry(name)

    def has(self, name: str) -> bool:
        """Whether folder ``name`` exists (valid or not); raises InvalidModelName."""
        _check_name(name)
        target = self.root / name
        return target.exists() or target.is_symlink()

    def add(
        self, name: str, onnx_bytes: bytes, toml_text: str | None = None, *, version: int = 1
    ) -> ModelEntry:
        """Validate and store a model as ``version`` (replacing one of that name atomically);
        returns its entry. Raises InvalidModelName, ModelTooLarge, InvalidModel (also when one
        of its instance names is taken by another folder)."""
        _check_name(name)
        if len(onnx_bytes) > self.max_model_bytes:
            raise ModelTooLarge(
                f"model {name!r} is {len(onnx_bytes)} bytes, over the limit of "
                f"{self.max_model_bytes} (repository.max_model_bytes)"
            )
        toml_bytes = toml_text.encode() if toml_text is not None else None
        entry = _make_entry(name, self.root / name / ONNX_FILE, onnx_bytes, toml_bytes, version)
        self._check_instances_free(entry)
        self._commit(name, onnx_bytes, toml_bytes, version)
        return self._entry(name)

    def remove(self, name: str) -> None:
        """Delete folder ``name``; raises ModelNotFound."""
        _check_name(name)
        target = self.root / name
        if not target.exists() and not target.is_symlink():
            raise ModelNotFound(f"no model {name!r} in the repository")
        doomed = self.root / f".del-{name}-{secrets.token_hex(4)}"
        os.rename(target, doomed)
        _fsync_dir(self.root)
        _remove_tree(doomed)
        self._cache.pop(name, None)

    # --- internals ---------------------------------------------------------------------------

    def _entry(self, folder: str) -> ModelEntry:
        _check_name(folder)
        onnx_path = self._inside(self.root / folder / ONNX_FILE, required=True)
        toml_path = self._inside(self.root / folder / TOML_FILE, required=False)
        version_path = self._inside(self.root / folder / VERSION_FILE, required=False)
        assert onnx_path is not None
        key = tuple(
            _stat_key(path) if path else None for path in (onnx_path, toml_path, version_path)
        )
        slot = self._cache.get(folder)
        if slot is not None and slot.key == key:
            return slot.entry
        onnx_bytes = _read_file(onnx_path, self.max_model_bytes, ONNX_FILE)
        toml_bytes = _read_file(toml_path, MAX_TOML_BYTES, TOML_FILE) if toml_path else None
        version = _read_version(version_path) if version_path else 1
        entry = _make_entry(folder, self.root / folder / ONNX_FILE, onnx_bytes, toml_bytes, version)
        self._cache[folder] = _CacheSlot(key, entry)
        return entry

    def _inside(self, path: Path, *, required: bool) -> Path | None:
        """``path`` resolved, if it exists as a regular file inside the root."""
        if not path.exists():
            if path.is_symlink():
                raise InvalidModel(f"{path.relative_to(self.root)} is a dangling symlink")
            if required:
                raise InvalidModel(f"{path.parent.name}/ has no {path.name}")
            return None
        real = path.resolve(strict=True)
        if not real.is_relative_to(self.root):
            raise InvalidModel(f"{path.relative_to(self.root)} leads outside the repository")
        if not stat.S_ISREG(real.stat().st_mode):
            raise InvalidModel(f"{path.relative_to(self.root)} is not a regular file")
        return real

    def _check_instances_free(self, entry: ModelEntry) -> None:
        others = [e for e in self.scan_report().entries if e.name != entry.name]
        _, clashes = _without_clashes([*others, entry])
        for clash in clashes:
            if clash.folder == entry.name or entry.name in clash.reason:
                raise InvalidModel(clash.reason)

    def _commit(self, name: str, onnx_bytes: bytes, toml_bytes: bytes | None, version: int) -> None:
        staging = Path(tempfile.mkdtemp(prefix=f".new-{name}-", dir=self.root))
        try:
            _write_file(staging / ONNX_FILE, onnx_bytes)
            if toml_bytes is not None:
                _write_file(staging / TOML_FILE, toml_bytes)
            if version != 1:
                _write_file(staging / VERSION_FILE, f"{version}\n".encode())
            os.chmod(staging, 0o750)
            _fsync_dir(staging)
            self._swap_in(staging, self.root / name)
        finally:
            if staging.exists():
                _remove_tree(staging)
        _fsync_dir(self.root)

    def _swap_in(self, staging: Path, target: Path) -> None:
        """Put ``staging`` at ``target``; the old folder (if any) ends at ``staging``."""
        if not target.exists() and not target.is_symlink():
            os.rename(staging, target)
        elif not _exchange(staging, target):
            # Two renames; _recover() puts the old folder back after a crash in between.
            old = self.root / f".old-{target.name}-{secrets.token_hex(4)}"
            os.rename(target, old)
            os.rename(staging, target)
            os.rename(old, staging)

    def _recover(self) -> None:
        """Finish what a crash interrupted: restore replaced folders, drop staging/trash."""
        for name in os.listdir(self.root):
            path = self.root / name
            if name.startswith(".old-"):
                original = self.root / name[len(".old-") :].rsplit("-", 1)[0]
                if not original.exists() and MODEL_NAME.match(original.name):
                    os.rename(path, original)
                    continue
            if name.startswith((".old-", ".new-", ".del-")):
                _remove_tree(path)


def check_budget(entries: Iterable[ModelEntry], budget_bytes: int) -> int:
    """Host bytes the entries' weights need (one copy per content hash); raises
    BudgetExceeded naming the total, the budget and the largest files when over."""
    by_hash = {entry.sha256: entry for entry in entries}
    total_bytes = sum(entry.size_bytes for entry in by_hash.values())
    if total_bytes > budget_bytes:
        largest = sorted(by_hash.values(), key=lambda e: e.size_bytes, reverse=True)[:3]
        names = ", ".join(f"{e.name} ({e.size_bytes} bytes)" for e in largest)
        raise BudgetExceeded(
            f"model weights need {total_bytes} bytes of host memory, over the budget of "
            f"{budget_bytes} (repository.weights_budget_bytes); largest: {names}"
        )
    return total_bytes


# --- Reading and validating a model ---------------------------------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not MODEL_NAME.match(name):
        raise InvalidModelName(
            f"model name {name!r} must be 1-64 letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )


def _make_entry(
    name: str, onnx_path: Path, onnx_bytes: bytes, toml_bytes: bytes | None, version: int = 1
) -> ModelEntry:
    info = read_model_info(name, onnx_bytes, toml_bytes)
    return ModelEntry(
        name=name,
        onnx_path=onnx_path,
        sha256=hashlib.sha256(onnx_bytes).hexdigest(),
        size_bytes=len(onnx_bytes),
        version=version,
        **{f.name: getattr(info, f.name) for f in fields(ModelInfo)},
    )


def _read_version(path: Path) -> int:
    """The version a folder's ``version`` file holds; raises InvalidModel unless it is one
    decimal integer >= 1."""
    text = _read_file(path, MAX_VERSION_BYTES, VERSION_FILE).decode(errors="replace").strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise InvalidModel(f"{path.parent.name}/{VERSION_FILE} must hold an integer >= 1")
    return int(text)


def _without_clashes(
    entries: Iterable[ModelEntry],
) -> tuple[list[ModelEntry], list[ScanProblem]]:
    """Entries in name order, dropping any whose instance names another entry claimed first."""
    owner: dict[str, str] = {}
    kept: list[ModelEntry] = []
    problems: list[ScanProblem] = []
    for entry in sorted(entries, key=lambda e: e.name):
        taken = [(i, owner[i]) for i in (entry.name, *entry.instances) if i in owner]
        if taken:
            instance, other = taken[0]
            reason = f"instance name {instance!r} of {entry.name!r} is already used by {other!r}"
            problems.append(ScanProblem(entry.name, reason))
            continue
        owner.update({i: entry.name for i in (entry.name, *entry.instances)})
        kept.append(entry)
    return kept, problems


# --- Files ----------------------------------------------------------------------------------


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_file(path: Path, limit_bytes: int, what: str) -> bytes:
    """Read a regular file read-only, refusing symlinks, FIFOs and files over the limit."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise InvalidModel(
            f"{path.parent.name}/{what} cannot be opened: {error.strerror}"
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidModel(f"{path.parent.name}/{what} is not a regular file")
        if info.st_size > limit_bytes:
            raise ModelTooLarge(f"{path.parent.name}/{what} is over {limit_bytes} bytes")
        return file.read(limit_bytes + 1)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))
