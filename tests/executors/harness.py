"""Test harness for real executor processes: the product's own helpers from
`clockwork_async.demo` (`start_executor`, whose `ExecutorProcess.stop` always leaves no process
behind, and `ExecutorSession`, a controller side that matches replies to actions by
``action_id`` and keeps connection-level `Error`s), with the names the tests use."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from clockwork_async.demo import (
    NEVER_NS,
    ExecutorProcess,
    ExecutorSession,
    executor_command,
    random_inputs,
    say_hello,
    start_executor,
)
from clockwork_async.wire.messages import ModelInfo

Controller = ExecutorSession

__all__ = [
    "NEVER_NS",
    "Controller",
    "ExecutorProcess",
    "connect",
    "executor_command",
    "model_inputs",
    "say_hello",
    "start_executor",
]


async def connect(address: str, token: str = "") -> Controller:
    """A handshaken controller. Raises DemoError if the executor refuses."""
    return await ExecutorSession.open(address, token=token, name="test")


def model_inputs(info: ModelInfo, batch_size: int = 1) -> Mapping[str, np.ndarray]:
    """Seeded random inputs for ``info`` at ``batch_size``."""
    return random_inputs(info.inputs, batch_size)
