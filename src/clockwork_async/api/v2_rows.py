"""Client batches of the Open Inference Protocol as rows: a request whose inputs all lead with
the same N > 1 is N requests of one row each (what the daemon serves, docs/protocol.md), and
their N outcomes are one answer. Pure: numpy only.

Invariants: rows are views of the request's tensors (no copy); a request that is not such a
batch (N = 1, an empty or scalar input, leading sizes that differ, a model whose inputs have
no batch axis) is one row as it is, left for the request path to accept or refuse; the joined
answer is ``ok`` only if every row is (or ``late`` if one was late and none failed), with each
output's rows stacked in order, and otherwise the first row's refusal that is not
``ok``/``late``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.messages import TensorSpec

ANSWERED = (Outcome.OK, Outcome.LATE)


def leading_rows(inputs: Mapping[str, np.ndarray]) -> int:
    """N when every input leads with the same N > 1 (a client batch, if the model's inputs
    have a batch axis), else 1."""
    leading = {array.shape[0] if array.ndim else -1 for array in inputs.values()}
    return max(1, *leading) if len(leading) == 1 else 1


def split_rows(inputs: Mapping[str, np.ndarray], rows: int) -> list[Mapping[str, np.ndarray]]:
    """The request's ``rows`` rows (`leading_rows`), views of its tensors."""
    if rows <= 1:
        return [inputs]
    return [{name: array[i : i + 1] for name, array in inputs.items()} for i in range(rows)]


def has_batch_axis(specs: Sequence[TensorSpec]) -> bool:
    """Whether a model's inputs all have a dynamic axis 0 (their batch): only then is a
    leading N a client batch (a fixed-shape input is sent whole, docs/protocol.md)."""
    return bool(specs) and all(spec.shape and spec.shape[0] == -1 for spec in specs)


def join_outcomes(outcomes: Sequence[InferOutcome]) -> InferOutcome:
    """One answer for a request's rows (see the module's invariants)."""
    if len(outcomes) == 1:
        return outcomes[0]
    for outcome in outcomes:
        if outcome.outcome not in ANSWERED:
            return outcome
    first = outcomes[0]
    late = any(outcome.outcome is Outcome.LATE for outcome in outcomes)
    outputs = {
        name: np.concatenate([outcome.outputs[name] for outcome in outcomes])
        for name in first.outputs
    }
    return InferOutcome(
        first.request_id,
        Outcome.LATE if late else Outcome.OK,
        first.message,
        outputs,
        first.timing_ns,
        first.executor_id,
        max(outcome.batch_size for outcome in outcomes),
    )
