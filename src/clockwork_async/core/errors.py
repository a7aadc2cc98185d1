"""Named errors of the controller core.

Invariant: ``Controller.handle`` raises only these (for events it cannot accept) and leaves its
state unchanged when it does; everything else that goes wrong is an answer (a Reply), not an
exception.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Base of the controller core's errors."""


class InvalidEvent(ControllerError, ValueError):
    """An event the core cannot accept (e.g. a model spec without profiles)."""


class TimeWentBackwards(ControllerError, ValueError):
    """``now_ns`` was smaller than at a previous event: the driver's clock is not monotonic."""
