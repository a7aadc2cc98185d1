"""What a backend keeps of its registered models: the models themselves and their files.

Invariants:
- `ModelRegistry`: a model is known from `add` until `remove` or `clear`, by identity. `own`
  returns the very object that was added, of the backend's own model class, and otherwise
  raises BackendError(UNKNOWN_MODEL): a backend never loads, runs or forgets a model that
  another backend (or an earlier registration) made. Safe across threads: REGISTER runs in the
  register lane beside LOAD and INFER in others.
- `ModelFiles`: file stems are unique within the folder (a counter, then the name with
  anything but ``[A-Za-z0-9_.-]`` replaced, cut to 64 characters). ``close`` removes a folder
  it created and, in a folder it was given, only the files it made on creation.
Nothing here imports a runtime library, so every backend can use it.
"""

from __future__ import annotations

import itertools
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, TypeVar

from clockwork_async.wire.messages import ErrorCode

from .backend import BackendError, RegisteredModel

M = TypeVar("M")


class ModelRegistry(Generic[M]):
    """The models one backend registered, of class ``kind``, held by identity."""

    def __init__(self, kind: type[M]) -> None:
        self._kind = kind
        self._models: dict[int, M] = {}  # id() -> model
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    def add(self, model: M) -> None:
        with self._lock:
            self._models[id(model)] = model

    def own(self, model: RegisteredModel) -> M:
        """``model`` as this backend's own. Raises BackendError(UNKNOWN_MODEL)."""
        with self._lock:
            found = self._models.get(id(model))
        if found is not model or not isinstance(found, self._kind):
            raise BackendError(
                ErrorCode.UNKNOWN_MODEL, f"model {model.name!r} is not registered with this backend"
            )
        return found

    def remove(self, model: RegisteredModel) -> M:
        """Forget ``model``; returns it. Raises BackendError(UNKNOWN_MODEL)."""
        owned = self.own(model)
        with self._lock:
            del self._models[id(owned)]
        return owned

    def clear(self) -> list[M]:
        """Forget every model; returns them."""
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        return models


class ModelFiles:
    """The folder a backend writes its models' files to (a temporary one when none is given),
    holding ``placeholders`` (empty files that graphs refer to) from creation to ``close``."""

    def __init__(self, work_dir: str | None, *, prefix: str, placeholders: Sequence[str]) -> None:
        self._owns_dir = work_dir is None
        self.path = Path(work_dir or tempfile.mkdtemp(prefix=prefix))
        self.path.mkdir(parents=True, exist_ok=True)
        self._placeholders = tuple(self.path / name for name in placeholders)
        for placeholder in self._placeholders:
            placeholder.touch()
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def stem(self, name: str) -> str:
        """A file stem for model ``name``, unique in this folder."""
        with self._lock:
            number = next(self._numbers)
        return f"{number:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:64]}"

    def close(self) -> None:
        """Remove the folder if it was made here, else the placeholders."""
        if self._owns_dir:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for placeholder in self._placeholders:
            placeholder.unlink(missing_ok=True)
