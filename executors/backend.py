"""The small interface every executor backend implements, and the errors it raises.

Invariant: backends are blocking and stateless about time. The host (`host.py`) owns windows,
lanes, page accounting and input validation; a backend only registers model files, places
weights into the arena pages the host hands it, runs inference, and releases what it made.
Every method is called from one thread at a time for a given model: a lane thread, or for a
short INFER on a host-memory backend (device ``cpu`` or ``sim``) the executor's event loop
thread (`inline.py`), so a backend keeps no per-thread state for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from clockwork_async.wire.messages import ErrorCode, TensorSpec


class BackendError(Exception):
    """A failure with a protocol error code (e.g. BAD_MODEL, BAD_INPUT, INTERNAL)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class PageRun:
    """``count`` contiguous pages of the arena starting at page ``first``."""

    first: int
    count: int


class Arena(Protocol):
    """Preallocated weight memory cut into fixed pages; never grown after start."""

    page_bytes: int
    pages_total: int

    def view(self, run: PageRun) -> np.ndarray:
        """A uint8 view (no copy) of the pages of ``run``."""
        ...

    def close(self) -> None: ...


class RegisteredModel(Protocol):
    """A model whose weights are held in host memory, ready to LOAD."""

    name: str
    weights_bytes: int
    run_pages: tuple[int, ...]  # page counts of the contiguous runs a LOAD needs
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch_sizes: tuple[int, ...]


class LoadedModel(Protocol):
    """A model whose weights live in arena pages and that can run."""

    model: RegisteredModel


class Backend(Protocol):
    name: str  # "onnxruntime", "simulated"
    device: str  # "cpu", "cuda:0", "sim"
    kind: str  # executors of one kind share duration profiles
    lanes: tuple[str, ...]
    arena: Arena

    def register(
        self,
        name: str,
        path: str,
        batch_sizes: Sequence[int],
        inputs: Sequence[TensorSpec] = (),
    ) -> RegisteredModel:
        """Read the model file into host memory; serve its inputs at ``inputs`` (declared
        shapes, `validation.serving_inputs`; empty: the file's). Raises BackendError(BAD_MODEL)."""
        ...

    def unregister(self, model: RegisteredModel) -> None: ...

    def load(
        self, model: RegisteredModel, runs: Sequence[PageRun]
    ) -> tuple[LoadedModel, dict[str, int]]:
        """Place the weights into ``runs`` (one per ``model.run_pages``) and make the model
        runnable. Returns it and the phase durations in ns (``load``)."""
        ...

    def infer(
        self, loaded: LoadedModel, batch_size: int, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Run one batch of validated inputs. Returns outputs and phase durations in ns
        (``copy_in``, ``execute``, ``copy_out``)."""
        ...

    def unload(self, loaded: LoadedModel) -> None:
        """Release everything that can read the model's pages (sessions) before the host
        frees them."""
        ...

    def close(self) -> None: ...
