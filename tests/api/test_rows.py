"""`api.rows`, pure: which requests are client batches, the limit, and the one answer."""

from __future__ import annotations

import numpy as np
import pytest

from clockwork_async.api.rows import RowsJoin, RowsRefused, join_outcomes, plan_rows
from clockwork_async.api.service import InferOutcome
from clockwork_async.core.outcomes import Outcome
from clockwork_async.wire.messages import ModelStatus, TensorSpec

MODEL = ModelStatus(
    "m", "g", "ready", batch_sizes=(1, 2, 4), inputs=(TensorSpec("x", "float32", (-1, 2)),)
)
FIXED = ModelStatus("f", "g", "ready", inputs=(TensorSpec("x", "float32", (3, 2)),))


def _outcome(outcome: Outcome, value: float | None = None) -> InferOutcome:
    outputs = {} if value is None else {"y": np.full((1, 2), value), "s": np.array(value)}
    return InferOutcome(1, outcome, outcome.value, outputs, {"total": 1}, "e0", 2)


def test_one_row_asks_for_no_status_and_a_batch_is_views() -> None:
    one = {"x": np.zeros((1, 2), np.float32)}
    assert plan_rows(one, lambda: pytest.fail("looked up"), 10) == [one]
    batch = np.arange(8, dtype=np.float32).reshape(4, 2)
    rows = plan_rows({"x": batch}, lambda: MODEL, 10)
    assert [row["x"].tolist() for row in rows] == [[r] for r in batch.tolist()]
    assert all(np.shares_memory(row["x"], batch) for row in rows)
    fixed = {"x": np.zeros((3, 2), np.float32)}
    assert plan_rows(fixed, lambda: FIXED, 10) == [fixed]  # no batch axis: sent whole


def test_over_the_largest_batch_is_bad_input_and_over_the_room_overloaded() -> None:
    with pytest.raises(RowsRefused) as over:
        plan_rows({"x": np.zeros((5, 2), np.float32)}, lambda: MODEL, 10)
    assert over.value.outcome is Outcome.BAD_INPUT and "limit of 4 rows" in over.value.message
    with pytest.raises(RowsRefused) as full:
        plan_rows({"x": np.zeros((4, 2), np.float32)}, lambda: MODEL, 3)
    assert full.value.outcome is Outcome.OVERLOADED


def test_the_answer_is_ok_stacked_or_the_first_refusal_that_is_not_a_cancel() -> None:
    joined = join_outcomes([_outcome(Outcome.OK, 1.0), _outcome(Outcome.LATE, 2.0)])
    assert joined.outcome is Outcome.LATE
    assert joined.outputs["y"][:, 0].tolist() == [1.0, 2.0]
    assert joined.outputs["s"].tolist() == [1.0, 2.0]  # no batch axis: one per row
    rows = [_outcome(Outcome.CANCELLED), _outcome(Outcome.INFEASIBLE), _outcome(Outcome.OK, 0)]
    assert join_outcomes(rows).outcome is Outcome.INFEASIBLE
    assert join_outcomes(rows[:1] * 2).outcome is Outcome.CANCELLED


def test_the_join_answers_once_and_calls_on_failed_once() -> None:
    answers: list[InferOutcome] = []
    failed: list[int] = []
    join = RowsJoin(3, answers.append, lambda: failed.append(1))
    join.on_row(2)(_outcome(Outcome.DROPPED))
    join.on_row(0)(_outcome(Outcome.CANCELLED))
    join.on_row(0)(_outcome(Outcome.OK, 1.0))  # a second answer to a row is ignored
    assert not answers and failed == [1]
    join.on_row(1)(_outcome(Outcome.CANCELLED))
    assert [a.outcome for a in answers] == [Outcome.DROPPED] and failed == [1]
