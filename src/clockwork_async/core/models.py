"""Model specs the core can schedule: the checks a ``ModelSpec`` must pass at registration.

Invariant: a spec that passes ``validate_spec`` has ascending, unique, positive batch sizes, a
profile for at least one executor kind, and positive durations for every size in each.
"""

from __future__ import annotations

from .errors import InvalidEvent
from .events import ModelSpec


def validate_spec(spec: ModelSpec) -> None:
    """Raise InvalidEvent unless ``spec`` can be scheduled (sizes, pages, profiles)."""
    sizes = spec.batch_sizes
    if not spec.name:
        raise InvalidEvent("a model needs a name")
    if not sizes or any(b <= 0 for b in sizes) or list(sizes) != sorted(set(sizes)):
        raise InvalidEvent(f"model {spec.name!r}: batch_sizes must be ascending, unique, > 0")
    if spec.weights_pages < 0:
        raise InvalidEvent(f"model {spec.name!r}: weights_pages must be >= 0")
    if not spec.profiles:
        raise InvalidEvent(f"model {spec.name!r}: needs a profile for at least one kind")
    for kind, profile in spec.profiles.items():
        missing = [b for b in sizes if profile.execute_ns.get(b, 0) <= 0]
        if missing or profile.load_ns < 0:
            raise InvalidEvent(
                f"model {spec.name!r}, kind {kind!r}: profile lacks positive durations for "
                f"batch sizes {missing} or has a negative load_ns"
            )
