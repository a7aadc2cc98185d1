"""Client batches as rows, for every front end (the msgpack session, the Open Inference
Protocol door): a request whose inputs all lead with the same N > 1, for a model whose inputs
all have a batch axis, is N requests of one row each (what the daemon serves,
docs/protocol.md), and their N outcomes are one answer. Pure: numpy only.

Invariants: rows are views of the request's tensors (no copy); a request that is not such a
batch (N = 1, an empty or scalar input, leading sizes that differ, a model whose inputs have
no batch axis) is one row as it is, left for the request path to accept or refuse; a batch
has at most the model's largest batch size of rows (more: ``bad_input``) and no more rows
than there is room for under the server's cap on requests in flight (more: ``overloaded``);
the joined answer is ``ok`` only if every row is (or ``late`` if one was late and none
failed), with each output's rows stacked in order, and otherwise the refusal of the first row
in order that is neither ``ok``/``late`` nor ``cancelled`` (a cancellation only when every
failed row was cancelled).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.messages import ModelStatus, TensorSpec

ANSWERED = (Outcome.OK, Outcome.LATE)
Rows = list[Mapping[str, np.ndarray]]


class RowsRefused(Exception):
    """A client batch refused whole, before any row is submitted: ``outcome`` and why."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


def leading_rows(inputs: Mapping[str, np.ndarray]) -> int:
    """N when every input leads with the same N > 1 (a client batch, if the model's inputs
    have a batch axis), else 1."""
    leading = {array.shape[0] if array.ndim else -1 for array in inputs.values()}
    return max(1, *leading) if len(leading) == 1 else 1


def split_rows(inputs: Mapping[str, np.ndarray], rows: int) -> Rows:
    """The request's ``rows`` rows (`leading_rows`), views of its tensors."""
    if rows <= 1:
        return [inputs]
    return [{name: array[i : i + 1] for name, array in inputs.items()} for i in range(rows)]


def has_batch_axis(specs: Sequence[TensorSpec]) -> bool:
    """Whether a model's inputs all have a dynamic axis 0 (their batch): only then is a
    leading N a client batch (a fixed-shape input is sent whole, docs/protocol.md)."""
    return bool(specs) and all(spec.shape and spec.shape[0] == -1 for spec in specs)


def max_rows(status: ModelStatus) -> int:
    """The most rows one request for the model may carry: its largest batch size."""
    return max(status.batch_sizes, default=1)


def plan_rows(
    inputs: Mapping[str, np.ndarray],
    status_of: Callable[[], ModelStatus | None],
    room: int,
) -> Rows:
    """The request as rows (see the module's invariants); ``status_of`` (the model's status,
    None if unknown) is asked only for a request that leads with N > 1, so one row costs no
    lookup; ``room``: how many more requests the server takes now. Raises RowsRefused."""
    rows = leading_rows(inputs)
    if rows == 1:
        return [inputs]
    status = status_of()
    if status is None or not has_batch_axis(status.inputs):
        return [inputs]
    limit = max_rows(status)
    if rows > limit:
        why = (
            f"a client batch of {rows} rows is over model {status.name!r}'s limit of {limit} "
            "rows per request (its largest batch size)"
        )
        raise RowsRefused(Outcome.BAD_INPUT, why)
    if rows > room:
        why = f"a client batch of {rows} rows, and the server has room for {room} more now"
        raise RowsRefused(Outcome.OVERLOADED, why)
    return split_rows(inputs, rows)


def status_in(models: Sequence[ModelStatus], name: str) -> ModelStatus | None:
    """The status of ``name`` among ``models``, or None."""
    for status in models:
        if status.name == name:
            return status
    return None


def join_outcomes(outcomes: Sequence[InferOutcome]) -> InferOutcome:
    """One answer for a request's rows (see the module's invariants)."""
    if len(outcomes) == 1:
        return outcomes[0]
    failed = [outcome for outcome in outcomes if outcome.outcome not in ANSWERED]
    if failed:
        causes = [outcome for outcome in failed if outcome.outcome is not Outcome.CANCELLED]
        return (causes or failed)[0]
    first = outcomes[0]
    late = any(outcome.outcome is Outcome.LATE for outcome in outcomes)
    outputs = {name: _stacked([row.outputs[name] for row in outcomes]) for name in first.outputs}
    return InferOutcome(
        first.request_id,
        Outcome.LATE if late else Outcome.OK,
        first.message,
        outputs,
        first.timing_ns,
        first.executor_id,
        max(outcome.batch_size for outcome in outcomes),
    )


def _stacked(rows: Sequence[np.ndarray]) -> np.ndarray:
    """Rows one after the other (an output without a batch axis: one per row, stacked)."""
    return np.concatenate(rows) if all(row.ndim for row in rows) else np.stack(rows)


class RowsJoin:
    """Collects the outcomes of a request's ``rows`` rows, in any order, and calls
    ``on_joined`` once with their joined answer when the last comes; the first row that
    fails calls ``on_failed`` once (its siblings need not run: the answer is refused)."""

    def __init__(
        self,
        rows: int,
        on_joined: Callable[[InferOutcome], None],
        on_failed: Callable[[], None] = lambda: None,
    ) -> None:
        self._outcomes: list[InferOutcome | None] = [None] * rows
        self._left = rows
        self._on_joined = on_joined
        self._on_failed = on_failed
        self._failed = False

    def on_row(self, index: int) -> Callable[[InferOutcome], None]:
        """The ``on_reply`` of row ``index``."""

        def on_reply(outcome: InferOutcome) -> None:
            if self._outcomes[index] is not None:
                return  # answered twice: the request path's bug, the first answer stands
            self._outcomes[index] = outcome
            self._left -= 1
            if not self._left:
                self._on_joined(join_outcomes([o for o in self._outcomes if o is not None]))
            elif outcome.outcome not in ANSWERED and not self._failed:
                self._failed = True
                self._on_failed()  # may answer the other rows, and join them, before it returns

        return on_reply
