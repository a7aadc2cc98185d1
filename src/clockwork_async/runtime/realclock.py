"""The real clock behind the core's ``Clock`` contract: the process's monotonic time.

Invariant: the controller core (core/) never imports this module; it takes ``now_ns`` from
its driver. ``MonotonicClock`` keeps ``core.clock.Clock``, as ``VirtualClock`` (tests, the
simulator) does, so a driver can be handed either.
"""

from __future__ import annotations

import time


class MonotonicClock:
    """The process's monotonic clock (``time.monotonic_ns``), for the daemon."""

    def now_ns(self) -> int:
        return time.monotonic_ns()
