"""A small in-process `Service` for the client API tests (the real one is the daemon's).

Models: ``echo`` answers ``ok`` at once (outputs ``y = 2 * x``); ``hold`` keeps each request
until the test calls `release` (or it is cancelled); ``big`` answers ``ok`` with a 1 MiB output;
``odd`` answers with an output the wire cannot carry; ``boom`` raises in ``submit``; ``twice``
answers twice (a broken service). Any other
name is ``unknown_model``. Every answer goes through `_answer`, which counts answers per id so a
test can check each request was answered exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from clockwork_async.api.service import Health, InferOutcome, ServiceError
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.messages import ModelStatus, TensorSpec

X_SPEC = (TensorSpec("x", "float32", (-1, 4)),)
Y_SPEC = (TensorSpec("y", "float32", (-1, 4)),)
SLO_NS = 100_000_000


@dataclass
class Submitted:
    service_id: int
    model: str
    inputs: Mapping[str, np.ndarray]
    slo_ns: int | None
    deadline_unix_ns: int | None
    slot: object = None  # the IO arena slot its inputs came in (a server with an arena)


class FakeService:
    def __init__(self) -> None:
        self.submitted: list[Submitted] = []
        self.cancelled: list[int] = []
        self.answers: Counter[int] = Counter()
        self.held: dict[int, Callable[[InferOutcome], None]] = {}
        self.models: dict[str, ModelStatus] = {
            name: ModelStatus(
                name, "demo", "ready", ("e0",), 2, (1, 2, 4), 100_000_000, X_SPEC, Y_SPEC
            )
            for name in ("echo", "hold", "big", "odd")
        }
        self.health_now = Health(live=True, ready=True)
        self.add_gate: asyncio.Event | None = None  # add_model waits on it when set
        self._next_id = 100
        self.flushes: list[int] = []
        self.screened: list[tuple[str, int]] = []  # (model, frame bytes) refused by `screen`
        self.screens: list[tuple[str, int | None, int]] = []  # `screen` calls: model, SLO, bytes
        self.waits_ns: list[int] = []  # each `screen` call's ``waited_ns``

    # --- Service ---------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        on_reply: Callable[[InferOutcome], None],
        slot: object = None,
    ) -> int:
        if model == "boom":
            raise RuntimeError("the fake service broke")
        self._next_id += 1
        service_id = self._next_id
        submitted = Submitted(service_id, model, dict(inputs), slo_ns, deadline_unix_ns, slot)
        self.submitted.append(submitted)
        if model == "echo":
            self._answer(service_id, on_reply, Outcome.OK, {"y": inputs["x"] * 2})
        elif model == "big":
            self._answer(service_id, on_reply, Outcome.OK, {"y": np.zeros(1 << 18, np.float32)})
        elif model == "odd":
            self._answer(service_id, on_reply, Outcome.OK, {"y": np.zeros(2, np.complex64)})
        elif model == "twice":  # a broken service: the server must pass on one answer only
            self._answer(service_id, on_reply, Outcome.OK, {})
            self._answer(service_id, on_reply, Outcome.FAILED, {})
        elif model == "hold":
            self.held[service_id] = on_reply
        else:
            self._answer(service_id, on_reply, Outcome.UNKNOWN_MODEL, {}, f"no model {model!r}")
        return service_id

    def flush(self) -> None:
        self.flushes.append(len(self.submitted))  # how many it had been given by then

    def screen(
        self,
        model: str,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        nbytes: int,
        waited_ns: int = 0,
        unread_ns: int = 0,
    ) -> str | None:
        self.screens.append((model, slo_ns, nbytes))
        self.waits_ns.append(waited_ns)
        return "the fake is overloaded" if model == "door" else None

    def refuse(
        self, model: str, reason: str, nbytes: int, on_reply: Callable[[InferOutcome], None]
    ) -> int:
        self._next_id += 1
        self.screened.append((model, nbytes))
        self._answer(self._next_id, on_reply, Outcome.OVERLOADED, {}, reason)
        return self._next_id

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        on_reply = self.held.pop(request_id, None)
        if on_reply is not None:
            self._answer(request_id, on_reply, Outcome.CANCELLED, {}, "cancelled")

    def list_models(self) -> list[ModelStatus]:
        return list(self.models.values())

    async def add_model(
        self,
        name: str,
        onnx_bytes: bytes,
        model_toml: str | None,
        *,
        replace: bool = False,
        wait: bool = True,
    ) -> ModelStatus:
        if self.add_gate is not None:
            await self.add_gate.wait()
        old = self.models.get(name)
        if old is not None and not replace:
            raise ServiceError("model_exists", f"model {name!r} exists")
        if not onnx_bytes.startswith(b"ONNX"):
            raise ServiceError("bad_model", "not an ONNX file")
        version = old.version + 1 if old is not None else 1
        status = ModelStatus(name, model_toml or name, "ready", batch_sizes=(1,), version=version)
        self.models[name] = status
        return status

    async def cancel_registration(self, name: str) -> ModelStatus:
        raise ServiceError("unknown_model", f"no registration of {name!r} is running")

    async def remove_model(self, name: str) -> None:
        if self.models.pop(name, None) is None:
            raise ServiceError("unknown_model", f"no model {name!r}")

    async def load_model(self, name: str) -> ModelStatus:
        if self.add_gate is not None:
            await self.add_gate.wait()
        status = self.models.get(name)
        if status is None:
            raise ServiceError("unknown_model", f"no model {name!r} in the repository")
        self.models[name] = status = dataclasses.replace(status, state="ready", reason="")
        return status

    async def unload_model(self, name: str) -> None:
        status = self.models.get(name)
        if status is None:
            raise ServiceError("unknown_model", f"no model {name!r}")
        self.models[name] = dataclasses.replace(status, state="unloaded", reason="unloaded")

    def stats(self) -> dict[str, object]:
        return {"submitted": len(self.submitted), "models": sorted(self.models)}

    def health(self) -> Health:
        return self.health_now

    # --- test controls ---------------------------------------------------------------------

    def release(self, service_id: int, outcome: Outcome = Outcome.OK) -> None:
        """Answer a held request."""
        on_reply = self.held.pop(service_id)
        outputs = {"y": np.full((1, 4), service_id, np.float32)} if outcome is Outcome.OK else {}
        self._answer(service_id, on_reply, outcome, outputs)

    def _answer(
        self,
        service_id: int,
        on_reply: Callable[[InferOutcome], None],
        outcome: Outcome,
        outputs: dict[str, np.ndarray],
        message: str = "",
    ) -> None:
        self.answers[service_id] += 1
        timing = {"total": 5, "queue": 1, "execute": 3, "predicted_execute": 3}
        on_reply(InferOutcome(service_id, outcome, message, outputs, timing, "e0", 1))
