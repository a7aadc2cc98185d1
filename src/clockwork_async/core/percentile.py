"""The one percentile of the house: nearest rank.

Definition: of ``n`` values sorted ascending, the ``p``-th percentile is the value at 1-based
rank ``ceil(p / 100 * n)`` (at least 1): the smallest value such that at least ``p`` percent
of the values are less than or equal to it. It is always one of the values (never an
interpolation), ``p = 100`` is the maximum and ``p = 0`` the minimum. Core predictions, hop
estimates, snapshots, the simulator's statistics and every benchmark use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T", int, float)


def nearest_rank_index(count: int, percent: float) -> int:
    """The 0-based index of the ``percent``-th percentile among ``count`` sorted values.

    Raises ValueError for ``count`` < 1 or ``percent`` outside [0, 100].
    """
    if count < 1:
        raise ValueError("a percentile needs at least one value")
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"percent must be in [0, 100], got {percent}")
    return max(0, math.ceil(percent / 100.0 * count) - 1)


def percentile(ordered: Sequence[T], percent: float) -> T:
    """The ``percent``-th percentile (nearest rank) of ``ordered``, which must be sorted
    ascending. Raises ValueError when it is empty or ``percent`` is outside [0, 100]."""
    return ordered[nearest_rank_index(len(ordered), percent)]


def percentile_of(values: Sequence[T], percent: float) -> T:
    """`percentile` of ``values`` in any order (sorts a copy)."""
    return percentile(sorted(values), percent)
