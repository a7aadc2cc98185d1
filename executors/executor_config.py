"""The executor's one frozen configuration, built by `flags.parse_config` and passed down.

Invariant: each field is the command-line flag of the same name (``page_bytes`` is
``--page-bytes``); nothing changes it after parsing. It imports nothing of the executor, so
the backend table and the controller link read it without reaching the flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """The executor's settings; each field is the flag of the same name (``--page-bytes``)."""

    backend: str
    device: str  # cpu, sim or cuda:N
    listen: str
    name: str
    page_bytes: int
    weights_bytes: int | None  # None: the backend's default
    cpus: tuple[int, ...]  # () leaves the affinity alone
    lane_scheduling: str  # auto (idle when pinned), idle or normal
    keep_warm_ms: float  # the execute lane polls this long after each action before it sleeps
    intra_op_threads: int
    seed: int
    noise: float
    slowdown: float
    profile_file: str | None
    token: str
    io_bytes: int
    workspace_bytes: int
    cuda_weights: str
    io_arena_fd: int | None  # an inherited IO arena descriptor to map (None: none)
