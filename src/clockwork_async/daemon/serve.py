"""`clockwork-async serve [--config FILE] [--set SECTION.KEY=VALUE ...]`: run the daemon.

Reads and validates the config before importing anything heavy, so a bad one is reported in
one line on stderr (exit status 2) at once. Then it sets up logging and runs `daemon.Daemon`
on uvloop (asyncio, with a warning, where uvloop is missing). Without ``--config`` it is the
embedded default: built-in settings, and the demo models generated into the cache folder and
added to the repository on the first run. This is the one place that reads the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from clockwork_async.config.daemon import (
    ConfigError,
    DaemonConfig,
    LocalExecutorConfig,
    RemoteExecutorConfig,
    load_config,
)
from clockwork_async.logs import configure_logging

log = logging.getLogger("clockwork_async.daemon")

EXIT_CONFIG = 2


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """``section.key=value`` flags as a mapping; raises ConfigError for one without ``=``."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(pair, pair, "section.key=value", "flag --set")
        overrides[key.strip()] = value
    return overrides


def check_servable(config: DaemonConfig) -> None:
    """Refuse configs the daemon cannot serve. Raises ConfigError."""
    backends = {e.backend for e in _locals(config)}
    if "simulated" in backends and (len(backends) > 1 or _remotes(config)):
        raise ConfigError(
            "executors",
            sorted(backends),
            "simulated executors alone (they time models by profile, not by file)",
        )
    for index, executor in enumerate(config.executors):
        if isinstance(executor, RemoteExecutorConfig) and executor.tls_ca_path is not None:
            raise ConfigError(
                f"executors[{index}].tls_ca_path",
                str(executor.tls_ca_path),
                "unset: TLS to remote executors is not supported yet (use a private network)",
            )
        if isinstance(executor, LocalExecutorConfig) and executor.device.startswith("cuda"):
            raise ConfigError(
                f"executors[{index}].device", executor.device, "cpu or sim for local executors"
            )


def _locals(config: DaemonConfig) -> list[LocalExecutorConfig]:
    return [e for e in config.executors if isinstance(e, LocalExecutorConfig)]


def _remotes(config: DaemonConfig) -> list[RemoteExecutorConfig]:
    return [e for e in config.executors if isinstance(e, RemoteExecutorConfig)]


def demo_cache_directory(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/clockwork-async/demo-models`` (``~/.cache`` when unset)."""
    home = environ.get("HOME") or str(Path.home())
    cache_home = environ.get("XDG_CACHE_HOME") or str(Path(home) / ".cache")
    return Path(cache_home) / "clockwork-async" / "demo-models"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clockwork-async serve",
        description="Serve the models of the repository (docs/configuration.md, "
        "docs/operations.md). Without --config: built-in defaults and the demo models.",
    )
    parser.add_argument("--config", type=Path, help="the TOML config file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), e.g. --set server.listen=127.0.0.1:0",
    )
    return parser


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed; running on the slower asyncio loop")
        return asyncio.run
    runner: Callable[[Coroutine[Any, Any, int]], int] = uvloop.run
    return runner


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Returns 0 after a clean drain, 1 if the daemon could not start or a second signal
    forced it to stop, 2 for a bad configuration (one line on stderr)."""
    env = os.environ if environ is None else environ
    args = _parser().parse_args(list(argv))
    try:
        config = load_config(args.config, env, parse_overrides(args.set))
        check_servable(config)
    except ConfigError as error:
        print(f"clockwork-async serve: {error}", file=sys.stderr)
        return EXIT_CONFIG
    server = config.server
    restore_logging = configure_logging(server.log_format.value, server.log_level.value)
    try:
        demo_dir = demo_cache_directory(env) if args.config is None else None
        return _event_loop_runner()(_run_daemon(config, env, demo_dir))
    finally:
        restore_logging()


async def _run_daemon(
    config: DaemonConfig, environ: Mapping[str, str], demo_dir: Path | None
) -> int:
    from clockwork_async.daemon.lifecycle import Daemon
    from clockwork_async.daemon.systemd import Notifier

    return await Daemon(config, notifier=Notifier(environ), demo_cache_dir=demo_dir).run()
