"""The ``models`` verb of `clockwork-async`: list, add (showing its registration's progress),
watch, cancel and remove models (exit status as every client verb: `cli_client`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from clockwork_async.api.async_client import ApiError
from clockwork_async.cli_client import (
    Parser,
    UsageError,
    add_connection_flags,
    connect,
    run_verb,
)
from clockwork_async.client import Client, ModelStatus
from clockwork_async.wire.messages import TensorSpec

WATCH_PERIOD_S = 0.5  # `models add` asks how its registration goes this often


def models_main(argv: list[str]) -> int:
    """``clockwork-async models [list | status NAME | add NAME PATH [--toml FILE] [--replace]
    [--no-wait] | cancel NAME | remove NAME]``"""
    parser = Parser(
        prog="clockwork-async models",
        description="List, add, watch, cancel or remove models.",
    )
    actions = parser.add_subparsers(dest="action", parser_class=Parser, required=True)
    listing = actions.add_parser("list", help="list the models (the default)")
    listing.add_argument("--json", action="store_true")
    adding = actions.add_parser("add", help="upload an ONNX file and register it")
    adding.add_argument("name")
    adding.add_argument("path", type=Path)
    adding.add_argument("--toml", type=Path, help="its model.toml")
    adding.add_argument(
        "--replace",
        action="store_true",
        help="take the name from the model serving under it (its requests finish on it)",
    )
    adding.add_argument(
        "--no-wait", action="store_true", help="return once its registration started"
    )
    adding.add_argument("--json", action="store_true")
    status = actions.add_parser("status", help="one model's state (registering ... ready)")
    status.add_argument("name")
    status.add_argument("--json", action="store_true")
    cancelling = actions.add_parser("cancel", help="cancel a registration that is running")
    cancelling.add_argument("name")
    removing = actions.add_parser("remove", help="unregister a model")
    removing.add_argument("name")
    for sub in (listing, adding, status, cancelling, removing):
        add_connection_flags(sub)
    verbs = {"list", "add", "status", "cancel", "remove", "-h", "--help"}
    if not argv or argv[0] not in verbs:
        argv = ["list", *argv]  # `models` and `models --address X` list
    return run_verb("models", parser, argv, _models)


def _models(args: argparse.Namespace) -> int:
    action = args.action
    toml = _read_toml(args.toml) if action == "add" else None
    with connect(args) as client:
        if action == "add":
            added = client.add_model(args.name, args.path, toml, replace=args.replace, wait=False)
            if args.no_wait:
                _print_models([added], args.json)
                return 0
            return _watch(client, added, args.json)
        if action == "status":
            found = [m for m in client.models() if m.name == args.name]
            if not found:
                raise ApiError("unknown_model", f"no model or registration {args.name!r}")
            _print_models(found, args.json)
            return 1 if any(m.state in FAILED_STATES for m in found) else 0
        if action == "cancel":
            _print_models([client.cancel_registration(args.name)], args.json)
        elif action == "remove":
            client.remove_model(args.name)
            print(f"removed {args.name}")
        else:
            _print_models(client.models(), args.json)
    return 0


FAILED_STATES = frozenset({"failed", "cancelled"})
SERVED_STATES = frozenset({"ready", "loaded"})


def _watch(client: Client, added: ModelStatus, as_json: bool) -> int:
    """Show a registration's progress on stderr until it is ready (its status on stdout, 0)
    or failed or cancelled (why on stderr, 1)."""
    said, shown_s = ("", ""), 0.0
    while True:
        rows = [m for m in client.models() if (m.name, m.version) == (added.name, added.version)]
        served = [m for m in rows if m.state in SERVED_STATES]
        if served:
            _print_models(served, as_json)
            return 0
        row = rows[0] if rows else added
        if row.state in FAILED_STATES:
            print(f"clockwork-async models: {row.name} {row.state}: {row.reason}", file=sys.stderr)
            return 1
        doing = row.reason.rsplit(", ", 1)[0] if ", " in row.reason else ""  # less the time
        if (row.state, doing) != said or time.monotonic() - shown_s > 5.0:
            line = f"{row.name} version {row.version}: {row.state} ({row.reason})"
            print(line, file=sys.stderr, flush=True)
            said, shown_s = (row.state, doing), time.monotonic()
        time.sleep(WATCH_PERIOD_S)


def _read_toml(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--toml: cannot read {str(path)!r}: {error}") from None


MODEL_COLUMNS = ("name", "version", "group", "state", "pages", "slo_ms", "batch sizes", "loaded on")
RIGHT_ALIGNED = frozenset({"version", "pages", "slo_ms"})


def _print_models(models: list[ModelStatus], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_model_json(m) for m in models], indent=2))
        return
    print("\n".join(table(MODEL_COLUMNS, [_model_row(m) for m in models], RIGHT_ALIGNED)))


def _model_row(m: ModelStatus) -> tuple[str, ...]:
    version = str(m.version) if m.version else "-"
    if m.state not in SERVED_STATES:  # a registration job: its state and why
        return (m.name, version, m.group, f"{m.state}: {m.reason}", "-", "-", "-", "-")
    batches = ",".join(map(str, m.batch_sizes)) or "-"
    slo_ms = f"{m.default_slo_ns / 1e6:g}"
    loaded_on = ",".join(m.loaded_on) or "-"
    return (m.name, version, m.group, m.state, str(m.pages), slo_ms, batches, loaded_on)


def table(
    header: tuple[str, ...], rows: list[tuple[str, ...]], right: frozenset[str] = frozenset()
) -> list[str]:
    """Lines of a text table: every column as wide as its widest cell, two spaces between
    columns (so long names never run into the next column), no trailing spaces."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = []
    for row in (header, *rows):
        cells = [
            cell.rjust(width) if name in right else cell.ljust(width)
            for name, cell, width in zip(header, row, widths, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _model_json(model: ModelStatus) -> dict[str, Any]:
    def specs(items: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
        return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in items]

    return {
        "name": model.name,
        "version": model.version,
        "group": model.group,
        "state": model.state,
        "loaded_on": list(model.loaded_on),
        "pages": model.pages,
        "batch_sizes": list(model.batch_sizes),
        "default_slo_ms": model.default_slo_ns / 1e6,
        "inputs": specs(model.inputs),
        "outputs": specs(model.outputs),
    }
