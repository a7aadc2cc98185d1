"""Capacity of one executor for one model at an SLO, from its profile.

The rule (issue 3): the largest supported batch b with ``2 * exec(b) + margin <= SLO`` — a
request may wait for one batch to finish and then run in the next — gives ``b / exec(b)``
requests per second. ResNet50 v2 on a V100 at a 100 ms SLO: b16 (2 * 17.33 + 5 <= 100),
923 requests per second. Offered loads in benchmarks are fractions of this.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import ControllerConfig
from .events import ModelProfile

NS_PER_S = 1_000_000_000


def capacity_batch(
    profile: ModelProfile, batch_sizes: Sequence[int], slo_ns: int, margin_ns: int | None = None
) -> int:
    """Return the largest batch size b with 2 * exec(b) + margin <= slo, or 0 if none fits.

    ``margin_ns`` defaults to the default ControllerConfig's margin rule for ``slo_ns``.
    Raises KeyError if the profile lacks one of ``batch_sizes``.
    """
    margin = ControllerConfig().margin_ns(slo_ns) if margin_ns is None else margin_ns
    fitting = [b for b in batch_sizes if 2 * profile.execute_ns[b] + margin <= slo_ns]
    return max(fitting, default=0)


def capacity_rps(
    profile: ModelProfile, batch_sizes: Sequence[int], slo_ns: int, margin_ns: int | None = None
) -> float:
    """Return b / exec(b) in requests per second for ``capacity_batch``'s b (0.0 if none)."""
    batch = capacity_batch(profile, batch_sizes, slo_ns, margin_ns)
    if batch == 0:
        return 0.0
    return batch * NS_PER_S / profile.execute_ns[batch]
