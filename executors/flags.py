"""The executor's flags: parsed once, at the edge, into the frozen `ExecutorConfig`.

Invariants: every flag is a field of `ExecutorConfig` of the same name (``--page-bytes`` ->
``page_bytes``); a bad value is an argparse error naming the flag (SystemExit from argparse,
raised only by `parse_config`); ``--backend`` offers exactly the names of the backend table
(`backend_table.BACKENDS`). Nothing here opens a device, a socket or a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence

from .backend_table import BACKENDS
from .executor_config import ExecutorConfig

MIB = 1 << 20
DEFAULT_PAGE_BYTES = 16 * MIB
DEFAULT_IO_BYTES = 64 * MIB  # cuda: one INFER's inputs and outputs
DEFAULT_WORKSPACE_BYTES = 1 << 30  # cuda: ONNX Runtime's arena cap, per session
LANE_SCHEDULING = ("auto", "idle", "normal")
KEEP_WARM_MAX_MS = 60_000.0
_SIZE_PATTERN = re.compile(r"(\d+(?:\.\d*)?)\s*([kmg]i?b?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1 << 10, "mi": MIB}
_SIZE_UNITS["gi"] = 1 << 30
_DEVICE_PATTERN = re.compile(r"cpu|sim|cuda:[0-9]{1,2}")


def parse_bytes(text: str) -> int:
    """``"16MiB"``, ``"1.5GiB"``, ``"64k"``, ``"4096"`` -> bytes (k/M/G are powers of 1000,
    KiB/MiB/GiB of 1024). Raises argparse.ArgumentTypeError."""
    match = _SIZE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 4096)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower().removesuffix("b")])


def parse_device(text: str) -> str:
    """``cpu``, ``sim`` or ``cuda:N``. Raises argparse.ArgumentTypeError."""
    if _DEVICE_PATTERN.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu or cuda:N)")
    return text


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> (0, 2, 3). Raises argparse.ArgumentTypeError."""
    cpus: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0,2-3)") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0,2-3)")
    return tuple(sorted(cpus))


def parse_keep_warm_ms(text: str) -> float:
    """``"20"`` -> 20.0, in [0, KEEP_WARM_MAX_MS]. Raises argparse.ArgumentTypeError."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= KEEP_WARM_MAX_MS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"not milliseconds in 0..{KEEP_WARM_MAX_MS:g}: {text!r}")
    return value


def default_listen(name: str) -> str:
    """``unix:$XDG_RUNTIME_DIR/clockwork-async/executor-NAME.sock`` (``/tmp`` without it)."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"unix:{runtime_dir}/clockwork-async/executor-{name}.sock"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clockwork-async executor",
        description="Run one executor process (one per device) serving one controller.",
    )
    add = parser.add_argument
    add("--backend", choices=sorted(BACKENDS), default="onnxruntime")
    add("--device", type=parse_device, default="cpu", help="cpu, or cuda:N for onnxruntime")
    add("--listen", help="unix:PATH or tcp:HOST:PORT (default: a Unix socket named by --name)")
    add("--name", default="executor", help="this executor's name, for logs and the socket")
    add("--page-bytes", type=parse_bytes, default=DEFAULT_PAGE_BYTES, help="default 16MiB")
    add("--weights-bytes", type=parse_bytes, help="arena size; pages = this // page-bytes")
    add("--cpus", type=parse_cpus, default=(), help="pin the process to these CPUs, e.g. 0,1")
    lanes_help = "idle: lane threads yield the CPU to the event loop at once (auto: when pinned)"
    add("--lane-scheduling", choices=LANE_SCHEDULING, default="auto", help=lanes_help)
    warm_help = "keep the CPU awake this long after each action, yielding it to any thread (0: off)"
    add("--keep-warm-ms", type=parse_keep_warm_ms, default=0.0, help=warm_help)
    add("--intra-op-threads", type=int, default=1, help="onnxruntime threads per session")
    add("--seed", type=int, default=0, help="simulated: seed of the duration noise")
    add("--noise", type=float, default=0.0, help="simulated: relative stddev of durations")
    add("--slowdown", type=float, default=1.0, help="simulated: run X times the profile")
    add("--profile-file", help="simulated: a TOML file of extra duration profiles")
    token_help = "shared secret a controller must present (default: $CLOCKWORK_EXECUTOR_TOKEN)"
    add("--token", default=os.environ.get("CLOCKWORK_EXECUTOR_TOKEN", ""), help=token_help)
    add("--io-bytes", type=parse_bytes, default=DEFAULT_IO_BYTES, help="cuda: IO buffer")
    workspace_help = "cuda: ONNX Runtime's arena cap per session (default 1GiB)"
    add("--workspace-bytes", type=parse_bytes, default=DEFAULT_WORKSPACE_BYTES, help=workspace_help)
    weights_help = "cuda: weights bound as graph inputs, or as initializers of a session per LOAD"
    add("--cuda-weights", choices=("inputs", "initializers"), default="inputs", help=weights_help)
    arena_help = "an inherited descriptor of the daemon's IO arena (shared tensor memory) to map"
    add("--io-arena-fd", type=int, default=None, help=arena_help)
    add("--log-level", default="WARNING", help="logging level on stderr")
    return parser


def parse_config(argv: Sequence[str]) -> tuple[ExecutorConfig, str]:
    """The frozen config and the log level. Raises SystemExit (argparse) on bad flags."""
    args = build_parser().parse_args(list(argv))
    args.listen = args.listen or default_listen(args.name)
    config = ExecutorConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ExecutorConfig)}
    )
    return config, args.log_level
