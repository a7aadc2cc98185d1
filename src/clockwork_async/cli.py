"""The `clockwork-async` command: one verb per subsystem, each parsing its own flags.

Only this module ends the process (it returns an exit status to the console script); verbs
raise or return a status.
"""

from __future__ import annotations

import importlib
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
    "serve": ("clockwork_async.serve", "main", "run the daemon: serve the repository's models"),
    "demo": ("clockwork_async.demo", "main", "run one executor by hand and time a few actions"),
    "demo-models": ("clockwork_async.demo_models", "main", "generate the demo ONNX models"),
    "infer": ("clockwork_async.cli_client", "infer_main", "send one inference request"),
    "models": ("clockwork_async.cli_client", "models_main", "list, add or remove models"),
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
        return run(rest)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
