"""A standard-protocol request's SLO, from what the Open Inference Protocol front ends are
given: its parameters (Triton's ``timeout``, ``slo_ms``), a transport deadline (gRPC's time
remaining) and an HTTP header (``clockwork-slo-ms``). Pure: values in, nanoseconds out.

Invariants: every bad value is a V2Error (``bad_input``; a deadline already passed
``infeasible``); an SLO over the longest the daemon takes is the longest (`MAX_SLO_MS`); the
earliest of the SLOs a request gives wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from clockwork_async.api.session import MAX_SLO_MS, slo_ms_to_ns
from clockwork_async.api.v2_status import V2Error
from clockwork_async.core.outcomes import Outcome


def slo_ns_of(parameters: Mapping[str, Any], deadline_left_s: float | None = None) -> int | None:
    """A request's SLO from its parameters (Triton's ``timeout`` in microseconds, ``slo_ms``)
    and a transport deadline (gRPC's time remaining), the earliest of those given; None when
    none is (the model's default SLO). Checks ``priority`` (accepted, not used: the deadline
    orders requests). Raises V2Error (``bad_input``)."""
    candidates = []
    timeout_us = parameters.get("timeout")
    if timeout_us is not None:
        if not _is_int(timeout_us) or timeout_us <= 0:
            raise V2Error(
                Outcome.BAD_INPUT, f"timeout must be microseconds > 0, not {timeout_us!r}"
            )
        candidates.append(_slo_ns(timeout_us / 1000.0, "timeout"))
    slo_ms = parameters.get("slo_ms")
    if slo_ms is not None:
        if not isinstance(slo_ms, int | float) or isinstance(slo_ms, bool):
            raise V2Error(Outcome.BAD_INPUT, f"slo_ms must be a number, not {slo_ms!r}")
        candidates.append(_slo_ns(float(slo_ms), "slo_ms"))
    if deadline_left_s is not None:
        if deadline_left_s <= 0:
            raise V2Error(Outcome.INFEASIBLE, "the request's deadline has passed")
        candidates.append(_slo_ns(deadline_left_s * 1000.0, "the deadline"))
    priority = parameters.get("priority")
    if priority is not None and (not _is_int(priority) or priority < 0):
        raise V2Error(Outcome.BAD_INPUT, f"priority must be an integer >= 0, not {priority!r}")
    return min(candidates) if candidates else None


def header_slo_ns(value: str | None, name: str) -> int | None:
    """The SLO of an HTTP header ``name`` (milliseconds, a number > 0), or None when it is
    absent. Raises V2Error (``bad_input``)."""
    if value is None:
        return None
    try:
        slo_ms = float(value)
    except ValueError:
        raise V2Error(Outcome.BAD_INPUT, f"{name} must be milliseconds, not {value!r}") from None
    return _slo_ns(slo_ms, name)


def earliest(*slos_ns: int | None) -> int | None:
    """The earliest of the SLOs given (None: not given), or None when none is."""
    given = [slo_ns for slo_ns in slos_ns if slo_ns is not None]
    return min(given) if given else None


def _slo_ns(slo_ms: float, what: str) -> int:
    try:
        return slo_ms_to_ns(min(slo_ms, MAX_SLO_MS) if math.isfinite(slo_ms) else slo_ms)
    except ValueError as error:
        raise V2Error(Outcome.BAD_INPUT, f"{what}: {error}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
