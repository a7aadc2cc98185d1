"""Client verbs of `clockwork-async`: ``infer``, ``stats``, ``health`` (``models``: `cli_models`).

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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from clockwork_async.api.auth import client_ssl_context
from clockwork_async.api.rows import has_batch_axis
from clockwork_async.cli import stdout_closed
from clockwork_async.client import (
    DEFAULT_ADDRESS,
    Client,
    ClientError,
    InferResult,
    ModelStatus,
)
from clockwork_async.wire.dtypes import WIRE_DTYPES, random_values, request_shape
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
    """``clockwork-async infer MODEL [--input NAME=FILE.npy ... | --random [--rows N]] ...``
    (an input of N rows is a client batch, docs/protocol.md)"""
    parser = Parser(prog="clockwork-async infer", description="Run one inference request.")
    parser.add_argument("model")
    sources = parser.add_mutually_exclusive_group(required=True)
    add = sources.add_argument
    add("--input", action="append", metavar="NAME=FILE.npy", help="one input (repeatable)")
    add("--random", action="store_true", help="random inputs shaped as the model declares")
    parser.add_argument(
        "--rows", type=int, default=1, help="--random: rows per input (a client batch)"
    )
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
            inputs = random_inputs(model.inputs, np.random.default_rng(args.seed), args.rows)
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


def random_inputs(
    specs: tuple[TensorSpec, ...], rng: np.random.Generator, rows: int = 1
) -> dict[str, Any]:
    """One random request value per input (`wire.dtypes.request_shape`; an axis of any length
    is 1), with ``rows`` rows where the model's inputs have a batch axis. Raises ClientError
    for a dtype the wire cannot carry, or rows without a batch axis."""
    if rows < 1 or (rows > 1 and not has_batch_axis(specs)):
        why = "give 1, or more for a model whose inputs all have a batch axis"
        raise ClientError(f"--rows {rows}: {why}")
    inputs: dict[str, np.ndarray] = {}
    for spec in specs:
        if spec.dtype not in WIRE_DTYPES:
            raise ClientError(f"input {spec.name!r} has dtype {spec.dtype!r}; use --input")
        shape = tuple(max(dim, 1) for dim in request_shape(spec.shape))
        shape = (rows, *shape[1:]) if rows > 1 else shape
        inputs[spec.name] = random_values(rng, shape, spec.dtype)
    return inputs


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
