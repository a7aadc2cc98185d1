"""Shape buckets: one model served at several lengths of its dynamic axes, as one *variant*
per bucket, the unit the core batches and predicts for (docs/controller.md, "Buckets"). Pure.

A bucket is one length per dynamic dimension of a model's inputs; with several dimensions the
buckets are every combination (the product). Each bucket is registered with the core as a model
of its own, `variant_name` (``NAME~128``, ``NAME~128x16``): its own queue, so requests of one
bucket are never batched with another's; its own prediction windows per batch size, seeded by
its profile and corrected by its own measurements. The controller needs nothing else: it
never sees shapes.

Invariants: `bucket_for` answers the bucket a request of given lengths runs at, or None (the
request is refused ``bad_input`` at the door); `neighbour_profiles` gives every bucket an
execute time for every batch size it is offered, from its own measurement where there is one,
else from its neighbours (the rule below), never below a measured neighbour's time for a
bucket at least as long in every dimension.

The neighbour rule, for a (bucket, batch size) that was not profiled:
1. the smallest profiled bucket at that batch size that is at least as long in every
   dimension: its time, as is (a longer input is no faster: conservative);
2. else the profiled bucket at that batch size with the most elements: its time scaled by
   the ratio of elements when that is over 1 (linear in length; a model slower than linear is
   underpredicted until its first measurement corrects the window);
3. else the batch size is not offered for that bucket.
LOAD: the slowest profiled bucket's (the weights are the same file).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from .events import ModelProfile

Bucket = tuple[int, ...]  # one length per dynamic dimension, in declaration order
VARIANT_MARK = "~"  # between a model's name and its bucket in a variant's name


def variant_name(model: str, bucket: Bucket) -> str:
    """The name the core knows bucket ``bucket`` of ``model`` by: ``NAME~128x16``."""
    return f"{model}{VARIANT_MARK}{'x'.join(str(length) for length in bucket)}"


def elements(bucket: Bucket) -> int:
    """The elements a row of ``bucket`` has per unit of the other axes (the product)."""
    return math.prod(bucket)


def all_buckets(lengths: Sequence[Sequence[int]]) -> tuple[Bucket, ...]:
    """Every bucket of dimensions that take ``lengths`` (each ascending), smallest first
    (by elements, then lengths)."""
    return tuple(sorted(itertools.product(*lengths), key=lambda b: (elements(b), b)))


def bucket_for(lengths: Sequence[Sequence[int]], got: Sequence[int], pad: bool) -> Bucket | None:
    """The bucket a request whose dimensions have lengths ``got`` runs at: per dimension the
    smallest declared length >= its own (``pad``), else its own if declared; None if none."""
    bucket: list[int] = []
    for declared, length in zip(lengths, got, strict=True):
        fits = [d for d in declared if d >= length] if pad else [d for d in declared if d == length]
        if not fits:
            return None
        bucket.append(fits[0])
    return tuple(bucket)


def neighbour_profiles(
    buckets: Sequence[Bucket], measured: Mapping[Bucket, ModelProfile]
) -> dict[Bucket, ModelProfile]:
    """A profile for every bucket: its own measured times, the rest by the neighbour rule
    (module header). Batch sizes no profiled bucket has are offered to none. Raises
    ValueError when nothing was measured."""
    if not measured:
        raise ValueError("no bucket was profiled")
    load_ns = max(profile.load_ns for profile in measured.values())
    sizes = sorted({b for profile in measured.values() for b in profile.execute_ns})
    profiles: dict[Bucket, ModelProfile] = {}
    for bucket in buckets:
        execute_ns = {}
        for batch_size in sizes:
            predicted_ns = _at(bucket, batch_size, measured)
            if predicted_ns is not None:
                execute_ns[batch_size] = predicted_ns
        own = measured.get(bucket)
        profiles[bucket] = ModelProfile(execute_ns, own.load_ns if own else load_ns)
    return profiles


def _at(bucket: Bucket, batch_size: int, measured: Mapping[Bucket, ModelProfile]) -> int | None:
    """The execute time of ``bucket`` at ``batch_size``: measured, else the neighbour rule."""
    own = measured.get(bucket)
    if own is not None and batch_size in own.execute_ns:
        return own.execute_ns[batch_size]
    profiled = [b for b, p in measured.items() if batch_size in p.execute_ns]
    longer = [b for b in profiled if all(o >= m for o, m in zip(b, bucket, strict=True))]
    if longer:
        nearest = min(longer, key=lambda b: (elements(b), b))
        return measured[nearest].execute_ns[batch_size]
    if not profiled:
        return None
    largest = max(profiled, key=lambda b: (elements(b), b))
    ratio = max(1.0, elements(bucket) / elements(largest))
    return math.ceil(measured[largest].execute_ns[batch_size] * ratio)
