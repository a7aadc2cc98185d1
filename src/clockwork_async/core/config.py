"""One frozen configuration for the controller core, with every default in one place.

Invariant: a ControllerConfig that exists is valid (``__post_init__`` checks every field and
raises ConfigError naming it). Times are nanoseconds, fractions are in [0, 1]. The rationale of
each default is in docs/controller.md.

`ConfigError` is the project's one configuration error: the core raises it for its own section,
the daemon's loader (`config_fields`) for every key of every section, and every other config
dataclass's own checks raise it too. It lives here, in the lowest layer, so the core needs
nothing from above it.
"""

from __future__ import annotations

from dataclasses import dataclass

MS_NS = 1_000_000
POLICIES = ("clockwork", "fifo", "timeout")


class ConfigError(ValueError):
    """A configuration value that cannot be used: names the key, the value, where it came from
    (a file, a variable, a flag; "" when built in code) and what was expected."""

    def __init__(self, key: str, value: object, expected: str, source: str = "") -> None:
        where = f" (from {source})" if source else ""
        super().__init__(f"config {key} = {value!r}{where}: expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected
        self.source = source


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """How the controller schedules; see docs/controller.md for each key."""

    policy: str = "clockwork"  # "clockwork" | "fifo" | "timeout"
    # Predictions: a sliding window of measured durations, predicting a percentile of it.
    window_size: int = 10
    percentile: float = 99.0
    # > 0: per (model, kind) one window of this many execute measurements of any batch size,
    # as ratios to their batch size's profile, predicting every batch size (docs/controller.md,
    # "Predictions under contention"); 0: a window per batch size (window_size).
    pooled_window_size: int = 0
    # A prediction that refused a request and saw no measurement for this long forgets its
    # largest sample when that is over outlier_factor x the window's median (docs/controller.md).
    prediction_stale_ns: int = 1_000 * MS_NS
    outlier_factor: float = 2.0
    # Cold starts: an INFER that follows more than this much idle time on its execute lane
    # teaches the executor how much longer than its back-to-back prediction it ran, and new
    # INFERs on an idle lane are planned that much later; 0: off (one window for both).
    warm_gap_ns: int = 0
    # Warm-ups (with warm_gap_ns): a request refused because its model's lane is cold, while
    # its model's arrivals are dense enough that the next should find the lane warm, sends this
    # many INFERs of no request there to warm it (docs/controller.md); 0: off.
    warm_up_infers: int = 0
    # Keep each execute lane filled only this far into the future.
    schedule_ahead_ns: int = 3 * MS_NS
    # Safety margin between predicted completion and deadline: clamp(fraction * SLO, min, max).
    margin_fraction: float = 0.05
    margin_min_ns: int = 200_000
    margin_max_ns: int = 5 * MS_NS
    # Queue caps (admission): over them a request is rejected `overloaded`.
    max_queued_total: int = 1_000_000
    max_queued_per_model: int = 100_000
    # Placement.
    max_loads_in_flight: int = 2  # per executor
    load_window_ns: int = 100 * MS_NS  # a LOAD not started this long after its earliest is void
    utilisation_window_ns: int = 1_000 * MS_NS  # time constant of the execute-lane busy average
    copy_max_utilisation: float = 0.8  # an extra copy only goes where the lane is less busy
    # `timeout` policy (Triton-like dynamic batching).
    max_queue_delay_ns: int = 1 * MS_NS  # wait at most this for a fuller batch
    queue_timeout_ns: int = 0  # drop after this long queued; 0: at the request's deadline

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", self.policy, f"one of {', '.join(POLICIES)}")
        _positive(self, "window_size", "schedule_ahead_ns", "max_loads_in_flight")
        _positive(self, "prediction_stale_ns")
        if not self.outlier_factor > 1.0:
            raise ConfigError("outlier_factor", self.outlier_factor, "> 1")
        _positive(self, "load_window_ns", "utilisation_window_ns")
        _positive(self, "max_queued_total", "max_queued_per_model")
        _non_negative(self, "margin_min_ns", "max_queue_delay_ns", "queue_timeout_ns")
        _non_negative(self, "warm_gap_ns", "warm_up_infers", "pooled_window_size")
        if self.warm_up_infers and not self.warm_gap_ns:
            expected = "0 unless warm_gap_ns > 0 (it says when a lane is cold)"
            raise ConfigError("warm_up_infers", self.warm_up_infers, expected)
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError("percentile", self.percentile, "in (0, 100]")
        if not 0.0 <= self.margin_fraction < 1.0:
            raise ConfigError("margin_fraction", self.margin_fraction, "in [0, 1)")
        if self.margin_max_ns < self.margin_min_ns:
            expected = f">= margin_min_ns ({self.margin_min_ns})"
            raise ConfigError("margin_max_ns", self.margin_max_ns, expected)
        if not 0.0 < self.copy_max_utilisation <= 1.0:
            raise ConfigError("copy_max_utilisation", self.copy_max_utilisation, "in (0, 1]")

    def margin_ns(self, slo_ns: int) -> int:
        """Return the safety margin for a request with this SLO (deadline minus arrival)."""
        scaled_ns = int(slo_ns * self.margin_fraction)
        return min(self.margin_max_ns, max(self.margin_min_ns, scaled_ns))


def _positive(config: ControllerConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(name, getattr(config, name), "> 0")


def _non_negative(config: ControllerConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 0:
            raise ConfigError(name, getattr(config, name), ">= 0")
