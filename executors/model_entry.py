"""A model's entry in the executor host's registry, and its one guarded state machine.

Invariant: a model moves only along ``REGISTERING -> REGISTERED -> LOADING -> LOADED ->
UNLOADING -> REGISTERED`` (plus ``LOADING -> REGISTERED`` when a load fails, ``UNLOADING ->
LOADED`` when the backend fails to release, and out of the registry from ``REGISTERING`` or
``REGISTERED``); `ModelEntry.move` raises `InvalidTransition` for any other move and then
changes nothing. `model_info` is the answer a registered model gives (ModelInfo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from clockwork_async.wire.messages import ModelInfo

from .backend import LoadedModel, PageRun, RegisteredModel


class ModelState(StrEnum):
    REGISTERING = "registering"
    REGISTERED = "registered"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


_S = ModelState
_ALLOWED_MOVES: frozenset[tuple[ModelState | None, ModelState | None]] = frozenset(
    {
        (None, _S.REGISTERING),
        (_S.REGISTERING, _S.REGISTERED),
        (_S.REGISTERING, None),
        (_S.REGISTERED, _S.LOADING),
        (_S.LOADING, _S.LOADED),
        (_S.LOADING, _S.REGISTERED),
        (_S.LOADED, _S.UNLOADING),
        (_S.UNLOADING, _S.REGISTERED),
        (_S.UNLOADING, _S.LOADED),  # the backend failed to release: keep the pages
        (_S.REGISTERED, None),
    }
)


class InvalidTransition(RuntimeError):
    """A model state move that the state machine forbids (a bug in the host)."""


@dataclass(slots=True)
class ModelEntry:
    """One model in the registry. ``runs`` are its pages while LOADING/LOADED/UNLOADING."""

    name: str
    state: ModelState | None = None
    registered: RegisteredModel | None = None
    loaded: LoadedModel | None = None
    runs: tuple[PageRun, ...] = field(default=())

    def move(self, to: ModelState | None) -> None:
        """Change state. Raises InvalidTransition for a move the state machine forbids."""
        if (self.state, to) not in _ALLOWED_MOVES:
            raise InvalidTransition(f"model {self.name!r}: {self.state} -> {to} is not allowed")
        self.state = to


def model_info(action_id: int, model: RegisteredModel) -> ModelInfo:
    """The answer to a successful RegisterModel of ``model``."""
    return ModelInfo(
        action_id=action_id,
        model=model.name,
        weights_bytes=model.weights_bytes,
        pages_needed=sum(model.run_pages),
        inputs=tuple(model.inputs),
        outputs=tuple(model.outputs),
        batch_sizes=tuple(model.batch_sizes),
    )
