"""Read-only views of the runtime's state for stats, metrics and health (built on demand).

Invariant: every snapshot is a frozen value; nothing in it refers back to live state; building
one never runs the core (`snapshot.build` in runtime/driver.py reads the dispatcher, the book,
the core's counters and the executor pool).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from clockwork_async.runtime.timers import LagStats, PollStats, TimerStats


@dataclass(frozen=True, slots=True)
class ExecutorSnapshot:
    executor_id: str
    address: str
    up: bool
    kind: str
    pages_used: int
    pages_total: int
    loaded: tuple[str, ...]
    restarts: int  # process restarts (local executors)
    reconnects: int  # links brought up after the first
    outstanding_actions: int
    clock_offset_ns: int  # executor clock minus controller clock
    clock_error_ns: int  # half the best round trip: the offset's error bound
    rtt_ns: int  # last ping round trip
    last_error: str


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    name: str
    group: str
    batch_sizes: tuple[int, ...]
    weights_pages: int
    loaded_on: tuple[str, ...]
    queued: int = 0  # its requests waiting in the core's queue (not sent to an executor)


@dataclass(frozen=True, slots=True)
class PredictionErrorStats:
    """Measured minus predicted execute time over finished INFERs (positive: slower than
    predicted). Percentiles over the most recent ``window`` samples."""

    count: int
    mean_ns: float
    p50_ns: int
    p99_ns: int
    min_ns: int
    max_ns: int
    underpredicted: int  # samples that ran longer than predicted


@dataclass(frozen=True, slots=True)
class DriverSnapshot:
    state: str
    executors: tuple[ExecutorSnapshot, ...]
    models: tuple[ModelSnapshot, ...]
    outstanding: int  # requests accepted and not answered yet
    queued: int  # waiting in the core's queues: not in a batch sent to an executor yet
    running: int  # in a batch sent to an executor, not answered yet
    submitted: int  # requests handed to the core
    outcomes: Mapping[str, int]  # outcome value -> count, rejections included
    core_counters: Mapping[str, int]  # the core's counts: infers, loads, cold_starts, ...
    prediction_errors: PredictionErrorStats
    loop_lag: LagStats
    timer: TimerStats
    busy_poll: PollStats
    core_ns_per_request: float  # time in Controller.handle, per request
    driver_ns_per_request: float  # all event handling (core and sends included), per request
    send_ns_per_request: float  # encoding and writing actions to executor sockets, per request
    loop_delay_ns: int = 0  # the loop's booked work ahead of now (the door, LoopLane)
    loop_cost_ns: Mapping[str, float] = field(default_factory=dict)  # request, byte, refusal
