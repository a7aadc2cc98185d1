"""The `clockwork-async` command: one verb per subsystem, each parsing its own flags.

Only this module ends the process (it returns an exit status to the console script); verbs
raise or return a status.
"""

from __future__ import annotations

import importlib
import os
import select
import sys
from collections.abc import Callable, Sequence

# verb -> (module, function, one-line help). Modules are imported only when their verb runs,
# so `clockwork-async simulate` never imports onnxruntime.
VERBS: dict[str, tuple[str, str, str]] = {
    "executor": (
        "clockwork_async.executors.main",
        "main",
        "run one executor process (one per device)",
    ),
    "simulate": (
        "clockwork_async.sim.cli",
        "main",
        "run the controller core on simulated executors in virtual time",
    ),
    "serve": (
        "clockwork_async.daemon.serve",
        "main",
        "run the daemon: serve the repository's models",
    ),
    "demo": ("clockwork_async.demo", "main", "run one executor by hand and time a few actions"),
    "demo-models": ("clockwork_async.models.demo", "main", "generate the demo ONNX models"),
    "infer": ("clockwork_async.cli_client", "infer_main", "send one inference request"),
    "models": ("clockwork_async.cli_models", "models_main", "list, add, cancel, remove models"),
    "stats": ("clockwork_async.cli_client", "stats_main", "print the daemon's stats"),
    "health": ("clockwork_async.cli_client", "health_main", "exit 0 if the daemon is ready"),
    "bench": ("clockwork_async.bench", "main", "load a running daemon; JSON summary"),
}


def _usage() -> str:
    lines = ["usage: clockwork-async VERB [options] | --version", "", "verbs:"]
    lines += [f"  {verb:<12} {help_}" for verb, (_, _, help_) in VERBS.items()]
    lines += ["", "`clockwork-async VERB --help` for a verb's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--version"]:
        from clockwork_async.build import describe

        print(describe())
        return 0
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"clockwork-async: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = VERBS[verb]
    run: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), function_name)
    try:
        status = run(rest)
        sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return _quiet_after_closed_stdout()


def stdout_closed() -> bool:
    """Whether our stdout's reader went away (``stats | head``): the kernel flags a pipe
    whose read end is closed with POLLERR."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _quiet_after_closed_stdout() -> int:
    """End as a shell pipeline expects when the reader stops early: no message, status 141
    (128 + SIGPIPE). Output still buffered goes to /dev/null, so the interpreter's last flush
    does not complain either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
