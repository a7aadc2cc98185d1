"""The runtime's own settings (the core's are `core.config.ControllerConfig`): executor links,
registration profiling, the wake timer and the loop-lag probe. Frozen; built at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from clockwork_async.runtime.executor_link import LinkConfig
from clockwork_async.runtime.profiler import ProfilerConfig
from clockwork_async.runtime.timers import MS_NS


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How the runtime (not the core) behaves: links, profiling, timers, probes."""

    link: LinkConfig = field(default_factory=LinkConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    timer_arm_early_ns: int = 1 * MS_NS  # uvloop timers are ms-grained: arm early, re-check
    timer_spin_below_ns: int = 2 * MS_NS  # closer than this to a wake: re-check every iteration
    lag_probe_interval_s: float = 0.1
    # The daemon as a lane: a request is refused `overloaded` at the door when the loop's own
    # booked work, with its own, would run further ahead of now than `loop_delay_share` of its
    # time to the deadline, or than `max_loop_delay_ns` (0: no door).
    loop_delay_share: float = 0.25
    max_loop_delay_ns: int = 50 * MS_NS

    def __post_init__(self) -> None:
        if self.timer_arm_early_ns < 0 or self.timer_spin_below_ns < 0:
            raise ValueError("timer_arm_early_ns and timer_spin_below_ns must be >= 0")
        if self.max_loop_delay_ns < 0 or not 0.0 < self.loop_delay_share <= 1.0:
            raise ValueError("max_loop_delay_ns must be >= 0 and loop_delay_share in (0, 1]")
        if self.lag_probe_interval_s <= 0:
            raise ValueError("lag_probe_interval_s must be > 0")
