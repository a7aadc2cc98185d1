"""What an HTTP infer with JSON tensors costs the daemon's loop when the door refuses it
``overloaded``: `api.v2_routes.route` timed in process, over a stub host whose screen refuses
every request (no sockets, no daemon), for the JSON bodies of `benchmarks.peer_ray`'s row
(3x32x32 float32, about 62 KB) and of a 3x224x224 image (about 3 MB).

    python -m benchmarks.v2_refusal [--repeats 5]

Run it with another install's interpreter from this folder (``/other/.venv/bin/python -m
benchmarks.v2_refusal``) to time that build's front end with the same bodies: before the door
screened JSON requests ahead of their parse (issue 32), a refusal paid the parse of the whole
body. Reported: the best of ``--repeats`` blocks, µs per request, including the copy of the
body into the request (as the front end reads it) and the refusal's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from clockwork_async.api.auth import TokenAuth
from clockwork_async.api.server import ServerLimits
from clockwork_async.api.service import InferOutcome
from clockwork_async.api.v2_door import Door
from clockwork_async.api.v2_routes import HttpRequest, route
from clockwork_async.core.outcomes import Outcome

SHAPES = {"62 KB row": (1, 3, 32, 32), "3 MB image": (1, 3, 224, 224)}
BLOCK = {"62 KB row": 200, "3 MB image": 10}


class RefusingRequests:
    """The dispatcher's request path as far as the door uses it: every screen refuses."""

    def screen(
        self,
        model: str,
        slo_ns: int | None,
        deadline_unix_ns: int | None,
        nbytes: int,
        waited_ns: int = 0,
    ) -> str | None:
        return "the stub refuses everything"

    def refuse(
        self, model: str, reason: str, nbytes: int, on_reply: Callable[[InferOutcome], None]
    ) -> int:
        on_reply(InferOutcome(0, Outcome.OVERLOADED, reason, {}, {}, None, 0))
        return 0


class StubHost:
    """A `v2_door.DoorHost` with no models to list, no tokens and no IO arena."""

    auth = TokenAuth()
    io_arena = None
    accepting_requests = True
    outstanding = 0
    limits = ServerLimits()
    routes: Mapping[str, Any] = {}
    requests = RefusingRequests()
    service = None

    def request_started(self) -> None:
        pass

    def request_ended(self) -> None:
        pass

    def count_answer(self, protocol: str, status: str) -> None:
        pass


def json_body(shape: tuple[int, ...]) -> bytes:
    row = np.random.default_rng(1).random(shape, dtype=np.float32)
    tensor = {"name": "x", "shape": list(shape), "datatype": "FP32", "data": row.ravel().tolist()}
    return json.dumps({"parameters": {"timeout": 100_000}, "inputs": [tensor]}).encode()


async def refusal_us(door: Door, body: bytes, count: int, repeats: int) -> float:
    """The best of ``repeats`` blocks of ``count`` refused requests, µs per request."""
    url = b"/v2/models/m/infer"
    best_ns = float("inf")
    for _ in range(repeats):
        start_ns = time.perf_counter_ns()
        for _ in range(count):
            request = HttpRequest(method="POST", url=bytearray(url), body=bytearray(body))
            response = await route(door, request)
            assert response.status == 429, response.status
        best_ns = min(best_ns, (time.perf_counter_ns() - start_ns) / count)
    return best_ns / 1000


async def run(repeats: int) -> dict[str, Any]:
    door = Door(StubHost(), "http", server_version="stub")  # type: ignore[arg-type]
    found = {}
    for name, shape in SHAPES.items():
        body = json_body(shape)
        us = await refusal_us(door, body, BLOCK[name], repeats)
        found[name] = {"body_bytes": len(body), "refusal_us": round(us, 1)}
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.v2_refusal", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--repeats", type=int, default=5, help="blocks; the best is reported")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import clockwork_async

    print(f"clockwork_async from {clockwork_async.__file__}")
    for name, row in asyncio.run(run(args.repeats)).items():
        print(f"{name} ({row['body_bytes']} B of JSON): refused in {row['refusal_us']} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
