"""Client verbs of `clockwork-async`: ``infer``, ``models``, ``stats``, ``health``.

Each verb parses its flags, talks to a running daemon with the blocking `Client`, prints
people-readable text (or JSON with ``--json``) and returns an exit status: 0 done (``health``:
ready), 1 the daemon refused, failed or could not be reached, 2 a usage error. Errors are one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from clockwork_async.api.async_client import ApiError
from clockwork_async.api.auth import client_ssl_context
from clockwork_async.cli import stdout_closed
from clockwork_async.client import (
    DEFAULT_ADDRESS,
    Client,
    ClientError,
    InferResult,
    ModelStatus,
)
from clockwork_async.wire.codec import WIRE_DTYPES
from clockwork_async.wire.messages import TensorSpec

TOKEN_ENV = "CLOCKWORK_ASYNC_TOKEN"
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class UsageError(Exception):
    """Bad flags or arguments (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so verbs return their status."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().rstrip()}")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """--address, --token (default: $CLOCKWORK_ASYNC_TOKEN), TLS and timeout flags."""
    add = parser.add_argument
    add("--address", default=DEFAULT_ADDRESS, help=f"daemon HOST:PORT (default {DEFAULT_ADDRESS})")
    add("--token", default=os.environ.get(TOKEN_ENV, ""), help=f"API token (default ${TOKEN_ENV})")
    add("--tls", action="store_true", help="connect with TLS, verifying with the system CAs")
    add("--tls-ca", type=Path, help="connect with TLS, verifying with this PEM (implies --tls)")
    add("--timeout-s", type=float, default=60.0, help="give up on a reply after this long")


def connect(args: argparse.Namespace) -> Client:
    """A client for the connection flags. Raises ClientError (ConnectError)."""
    ssl = client_ssl_context(args.tls_ca) if args.tls or args.tls_ca else None
    return Client(args.address, token=args.token, ssl=ssl, timeout_s=args.timeout_s)


def run_verb(verb: str, parser: Parser, argv: list[str], body: Callable[[Any], int]) -> int:
    """Parse ``argv`` and run ``body(args)``; every expected failure becomes one line on
    stderr and an exit status (2 usage, 1 otherwise)."""
    try:
        args = parser.parse_args(argv)
        return body(args)
    except UsageError as error:
        print(f"clockwork-async {verb}: {error}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except (ClientError, TimeoutError, OSError) as error:
        if isinstance(error, BrokenPipeError) and stdout_closed():
            raise  # our reader went away, not the daemon: `cli.main` ends quietly
        print(f"clockwork-async {verb}: {error}", file=sys.stderr)
        return 1


# --- infer -------------------------------------------------------------------------------------


def infer_main(argv: list[str]) -> int:
    """``clockwork-async infer MODEL [--input NAME=FILE.npy ... | --random] ...``"""
    parser = Parser(prog="clockwork-async infer", description="Run one inference request.")
    parser.add_argument("model")
    sources = parser.add_mutually_exclusive_group(required=True)
    add = sources.add_argument
    add("--input", action="append", metavar="NAME=FILE.npy", help="one input (repeatable)")
    add("--random", action="store_true", help="random inputs shaped as the model declares")
    parser.add_argument("--slo-ms", type=float, help="deadline after arrival (default: model's)")
    parser.add_argument("--output-dir", type=Path, help="write each output as NAME.npy here")
    parser.add_argument("--seed", type=int, default=0, help="--random: generator seed")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    add_connection_flags(parser)
    return run_verb("infer", parser, argv, _infer)


def _infer(args: argparse.Namespace) -> int:
    inputs = None if args.random else load_inputs(args.input)
    with connect(args) as client:
        if inputs is None:
            model = find_model(client.models(), args.model)
            inputs = random_inputs(model.inputs, np.random.default_rng(args.seed))
        result = client.infer(args.model, inputs, slo_ms=args.slo_ms)
    written = write_outputs(result.outputs, args.output_dir) if args.output_dir else []
    print(json.dumps(_result_json(result)) if args.json else _result_text(result, written))
    return 0 if result.ok else 1


def load_inputs(pairs: list[str]) -> dict[str, np.ndarray]:
    """``NAME=FILE.npy`` pairs as arrays. Raises UsageError for a bad pair or file."""
    inputs: dict[str, np.ndarray] = {}
    for pair in pairs:
        name, equals, path = pair.partition("=")
        if not equals or not name or not path:
            raise UsageError(f"--input {pair!r}: expected NAME=FILE.npy")
        if name in inputs:
            raise UsageError(f"--input {name!r} given twice")
        try:
            inputs[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise UsageError(f"--input {name}: cannot read {path!r}: {error}") from None
    return inputs


def find_model(models: list[ModelStatus], name: str) -> ModelStatus:
    """The status of ``name``; raises ClientError if the daemon does not serve it."""
    for model in models:
        if model.name == name:
            return model
    raise ClientError(f"unknown_model: the daemon serves no model {name!r}")


def random_inputs(specs: tuple[TensorSpec, ...], rng: np.random.Generator) -> dict[str, Any]:
    """One random row per input: the declared shape with every dynamic axis (and the batch
    axis) set to 1. Raises ClientError for a dtype the wire cannot carry."""
    inputs: dict[str, np.ndarray] = {}
    for spec in specs:
        dtype = WIRE_DTYPES.get(spec.dtype)
        if dtype is None:
            raise ClientError(f"input {spec.name!r} has dtype {spec.dtype!r}; use --input")
        shape = tuple(1 if axis == 0 or dim < 0 else dim for axis, dim in enumerate(spec.shape))
        inputs[spec.name] = _random_array(rng, shape, dtype)
    return inputs


def _random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 10, shape).astype(dtype)


def write_outputs(outputs: Mapping[str, np.ndarray], directory: Path) -> list[Path]:
    """Save each output as ``directory/NAME.npy`` (unsafe characters of NAME become ``_``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, array in outputs.items():
        path = directory / f"{_UNSAFE_FILE_CHARS.sub('_', name) or '_'}.npy"
        np.save(path, array, allow_pickle=False)
        paths.append(path)
    return paths


def _result_json(result: InferResult) -> dict[str, Any]:
    return {
        "request_id": result.request_id,
        "status": result.status,
        "message": result.message,
        "timing_ns": result.timing_ns,
        "executor_id": result.executor_id,
        "batch_size": result.batch_size,
        "model_version": result.model_version,
        "outputs": {
            name: {"dtype": str(a.dtype), "shape": list(a.shape)}
            for name, a in result.outputs.items()
        },
    }


def _result_text(result: InferResult, written: list[Path]) -> str:
    lines = [f"status: {result.status} ({result.message})" if result.message else result.status]
    timing = ", ".join(f"{key} {value / 1e6:.3f} ms" for key, value in result.timing_ns.items())
    if timing:
        lines.append(f"timing: {timing}")
    if result.executor_id:
        lines.append(f"executor: {result.executor_id}, batch size {result.batch_size}")
    if result.model_version:
        lines.append(f"model version: {result.model_version}")
    for name, array in result.outputs.items():
        lines.append(f"output {name}: {array.dtype} {tuple(array.shape)}")
    lines += [f"wrote {path}" for path in written]
    return "\n".join(lines)


# --- models ------------------------------------------------------------------------------------


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
    said, shown_s = "", 0.0
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
        line = f"{row.name} version {row.version}: {row.state}"
        if line != said or time.monotonic() - shown_s > 5.0:
            print(f"{line} ({row.reason})", file=sys.stderr, flush=True)
            said, shown_s = line, time.monotonic()
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


# --- stats and health ----------------------------------------------------------------------------


def stats_main(argv: list[str]) -> int:
    """``clockwork-async stats [--json]``"""
    parser = Parser(prog="clockwork-async stats", description="Print the daemon's stats.")
    parser.add_argument("--json", action="store_true", help="print the JSON object")
    add_connection_flags(parser)
    return run_verb("stats", parser, argv, _stats)


def _stats(args: argparse.Namespace) -> int:
    with connect(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print("\n".join(f"{key}: {value}" for key, value in flatten(stats)))
    return 0


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, scalar or list of scalars) pairs of a JSON value, depth first; objects in
    lists are keyed by their index (``executors.0.up``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{index}" if prefix else str(index))
    else:
        yield prefix, json.dumps(value) if isinstance(value, list) else value


def health_main(argv: list[str]) -> int:
    """``clockwork-async health``: exit 0 when ready, 1 otherwise (or unreachable)."""
    parser = Parser(prog="clockwork-async health", description="Is the daemon ready?")
    parser.add_argument("--json", action="store_true")
    add_connection_flags(parser)
    return run_verb("health", parser, argv, _health)


def _health(args: argparse.Namespace) -> int:
    with connect(args) as client:
        health = client.health()
    if args.json:
        print(json.dumps({"live": health.live, "ready": health.ready, "reason": health.reason}))
    else:
        print("ready" if health.ready else f"not ready: {health.reason or 'no reason given'}")
    return 0 if health.ready else 1
