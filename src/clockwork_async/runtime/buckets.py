"""The door of a model served by shape buckets (core/buckets.py): the variant a request's
tensor shapes run at, its inputs padded up to that bucket where the model pads, and its outputs
cut back to its own lengths. Pure: numpy only.

Invariants: a request reaches the core only as the variant of a bucket that holds it: each
dimension's length equals the bucket's (padding off) or is at most it and at least the declared
``min`` (padding on: zeros after the request's own values); the places of one dimension (inputs
with an axis of one name) agree.
Otherwise it is answered ``bad_input`` naming the input, the axis, its length and the lengths
declared. A request whose lengths equal its bucket's keeps its arrays (no copy; they may still
travel by IO arena reference); a padded one travels as bytes. Outputs declared to share a
dimension are cut to the request's own length: views, no copy. The dispatcher calls `route`
only for a name in its ``buckets`` (a plain model's request never enters this file).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from clockwork_async.api.service import InferOutcome
from clockwork_async.core.buckets import Bucket, bucket_for
from clockwork_async.models.axes import ShapePlan
from clockwork_async.runtime.batching import BadInput

Reply = Callable[[InferOutcome], None]


@dataclass(frozen=True, slots=True)
class BucketedModel:
    """A name requests use, served as one core model (variant) per bucket."""

    name: str
    plan: ShapePlan
    variants: Mapping[Bucket, str]  # bucket -> the variant's core model name

    @property
    def largest(self) -> str:
        """The variant of the largest bucket (its settings speak for the model)."""
        return self.variants[max(self.variants, key=lambda b: (np.prod(b), b))]


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request goes: its variant, its inputs at that bucket, and its reply callback
    (cutting outputs back when it was padded); or, with ``bad_input`` set, why no bucket
    holds it (``model`` is then the name it asked for)."""

    model: str
    inputs: Mapping[str, np.ndarray]
    on_reply: Reply
    bad_input: str = ""


def route(bucketed: BucketedModel, inputs: Mapping[str, np.ndarray], on_reply: Reply) -> Routed:
    """Where a request for ``bucketed`` goes. Inputs it cannot read (missing, not arrays, of
    too few axes) go to the largest variant, whose check names the problem."""
    try:
        lengths = _lengths(bucketed.plan, inputs)
    except BadInput as error:
        return Routed(bucketed.name, inputs, on_reply, str(error))
    if lengths is None:
        return Routed(bucketed.largest, inputs, on_reply)
    declared = [dimension.lengths for dimension in bucketed.plan.dimensions]
    bucket = bucket_for(declared, lengths, bucketed.plan.pad)
    short = any(n < d.min_length for n, d in zip(lengths, bucketed.plan.dimensions, strict=True))
    if bucket is None or short:
        return Routed(bucketed.name, inputs, on_reply, _no_bucket(bucketed.plan, lengths))
    variant = bucketed.variants[bucket]
    if tuple(lengths) == bucket:
        return Routed(variant, inputs, on_reply)
    padded = _padded(bucketed.plan, inputs, bucket)
    return Routed(variant, padded, _cutting(bucketed.plan, lengths, on_reply))


def _lengths(plan: ShapePlan, inputs: Mapping[str, np.ndarray]) -> list[int] | None:
    """Each dimension's length in ``inputs``; None where an input is not there to read.
    Raises BadInput when two places of one dimension disagree."""
    lengths: list[int] = []
    for dimension in plan.dimensions:
        seen: dict[str, int] = {}
        for input_name, axis in dimension.places:
            value = inputs.get(input_name)
            if not isinstance(value, np.ndarray) or value.ndim <= axis:
                return None
            seen[input_name] = value.shape[axis]
        if len(set(seen.values())) > 1:
            raise BadInput(
                f"inputs {sorted(seen)} have lengths {seen} along axis {dimension.name!r}: an "
                "axis of one name takes one length per request"
            )
        lengths.append(next(iter(seen.values())))
    return lengths


def _no_bucket(plan: ShapePlan, lengths: list[int]) -> str:
    """Why no bucket holds a request: its first dimension without one."""
    for dimension, length in zip(plan.dimensions, lengths, strict=True):
        input_name, axis = dimension.places[0]
        where = f"input {input_name!r} axis {axis} ({dimension.name!r}) has length {length}"
        if length < dimension.min_length:
            return f"{where}, under its declared min {dimension.min_length}"
        fits = max(dimension.lengths) >= length if plan.pad else length in dimension.lengths
        if not fits:
            if plan.pad:
                return f"{where}, over its largest bucket: it takes up to {max(dimension.lengths)}"
            return f"{where}; it takes only {list(dimension.lengths)} (this model does not pad)"
    return "no bucket holds its lengths"  # unreachable: bucket_for found none


def _padded(
    plan: ShapePlan, inputs: Mapping[str, np.ndarray], bucket: Bucket
) -> dict[str, np.ndarray]:
    """``inputs`` with each declared axis zero-padded up to ``bucket``'s length."""
    want: dict[str, dict[int, int]] = {}
    for dimension, length in zip(plan.dimensions, bucket, strict=True):
        for input_name, axis in dimension.places:
            want.setdefault(input_name, {})[axis] = length
    padded = dict(inputs)
    for input_name, axes in want.items():
        value = inputs[input_name]
        shape = tuple(axes.get(axis, n) for axis, n in enumerate(value.shape))
        if shape != value.shape:
            grown = np.zeros(shape, dtype=value.dtype)
            grown[tuple(slice(0, n) for n in value.shape)] = value
            padded[input_name] = grown
    return padded


def _cutting(plan: ShapePlan, lengths: list[int], on_reply: Reply) -> Reply:
    """``on_reply``, with the outputs that share a dimension cut back to ``lengths``."""
    if not plan.output_axes:
        return on_reply

    def cut(outcome: InferOutcome) -> None:
        outputs = dict(outcome.outputs)
        for tied in plan.output_axes:
            array = outputs.get(tied.output)
            if array is not None and array.ndim > tied.axis:
                index = [slice(None)] * array.ndim
                index[tied.axis] = slice(0, lengths[tied.dimension])
                outputs[tied.output] = array[tuple(index)]
        on_reply(replace(outcome, outputs=outputs))

    return cut
