"""The door screens an HTTP infer with JSON tensors before its body is parsed
(`api.v2_door.Door.refused_unread`): from the SLO its head gives (``clockwork-slo-ms``), else
the longest a body may ask for, with its body's size. A request the screen refuses is answered
``overloaded`` (429) without its JSON parsed; one it lets through is parsed and screened again
with the SLO its body gives, the earliest SLO winning, exactly as before. Binary-extension
requests (a small JSON header) are parsed first, as before. Over the fake service, whose screen
refuses the model ``door`` and records every call."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from clockwork_async.api import v2_routes
from clockwork_async.api.v2_door import UNREAD_SLO_NS
from clockwork_async.api.v2_tensors import RequestHeader

from .fakes import FakeService
from .test_v2_http import Front, connect, infer_body, request, start_front

INFER = "/v2/models/{}/infer"
MS_NS = 1_000_000


@pytest_asyncio.fixture
async def http(service: FakeService) -> AsyncIterator[Front]:
    service.models["door"] = service.models["echo"]
    started = await start_front(service)
    yield started
    await started.close()


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The JSON bytes of every request body parsed (`v2_tensors.parse_request`)."""
    seen: list[int] = []
    real = v2_routes.parse_request

    def spy(json_bytes: bytes | memoryview) -> RequestHeader:
        seen.append(len(json_bytes))
        return real(json_bytes)

    monkeypatch.setattr(v2_routes, "parse_request", spy)
    return seen


async def test_a_refused_json_request_is_answered_without_its_body_parsed(
    http: Front, parses: list[int]
) -> None:
    conn = await connect(http)
    not_json = b'{"inputs": [ this is never read'
    reply = await conn.ask(request("POST", INFER.format("door"), not_json))
    assert reply.status == 429 and reply.headers["retry-after"] == "1"
    assert reply.json() == {"error": "overloaded: the fake is overloaded"}
    assert parses == []  # a parse would have answered 400
    # Its head gives no SLO: the longest a body may ask for (only the loop's cap refuses).
    assert http.service.screens == [("door", UNREAD_SLO_NS, len(not_json))]
    assert http.service.screened == [("door", len(not_json))] and not http.service.submitted
    assert http.answers == [("http", "overloaded")]
    assert http.api.outstanding == 0


async def test_the_head_slo_is_the_screen_slo(http: Front, parses: list[int]) -> None:
    conn = await connect(http)
    body = infer_body([1, 2, 3, 4], parameters={"slo_ms": 5})
    reply = await conn.ask(request("POST", INFER.format("door"), body, clockwork_slo_ms="20"))
    assert reply.status == 429 and parses == []
    assert http.service.screens == [("door", 20 * MS_NS, len(body))]


@pytest.mark.parametrize(
    ("head_ms", "body", "slo_ns"),
    [
        (None, {}, None),  # neither: the model's default SLO
        (None, {"slo_ms": 30}, 30 * MS_NS),  # the body's, screened first with the longest
        ("50", {"timeout": 30_000}, 30 * MS_NS),  # the earliest: the body's
        ("10", {"slo_ms": 30}, 10 * MS_NS),  # the earliest: the head's
        ("12.5", {}, 12_500_000),
    ],
)
async def test_an_admitted_json_request_keeps_the_earliest_slo(
    http: Front, parses: list[int], head_ms: str | None, body: dict[str, int], slo_ns: int | None
) -> None:
    conn = await connect(http)
    data = infer_body([1, 2, 3, 4], id="r1", parameters=body)
    headers = {} if head_ms is None else {"clockwork_slo_ms": head_ms}
    reply = await conn.ask(request("POST", INFER.format("echo"), data, **headers))
    assert reply.status == 200
    document = reply.json()
    assert isinstance(document, dict) and document["id"] == "r1"
    assert document["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert parses == [len(data)]
    (submitted,) = http.service.submitted
    assert submitted.slo_ns == slo_ns
    head_slo_ns = UNREAD_SLO_NS if head_ms is None else round(float(head_ms) * MS_NS)
    # screened twice: before the parse (the head's SLO) and after it (the request's own)
    assert http.service.screens == [("echo", head_slo_ns, len(data)), ("echo", slo_ns, len(data))]


async def test_a_binary_request_is_parsed_before_it_is_screened(
    http: Front, parses: list[int]
) -> None:
    conn = await connect(http)
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]})
    body = header.encode() + bytes(16)
    headers = {"inference_header_content_length": str(len(header))}
    reply = await conn.ask(request("POST", INFER.format("door"), body, **headers))
    assert reply.status == 400  # no binary_data_size: the parse answers first
    assert parses == [len(header)] and http.service.screens == []


@pytest.mark.parametrize("value", ["x", "0", "-5", "nan", "inf"])
async def test_a_bad_head_slo_is_bad_input(http: Front, value: str) -> None:
    conn = await connect(http)
    data = infer_body([1, 2, 3, 4])
    reply = await conn.ask(request("POST", INFER.format("echo"), data, clockwork_slo_ms=value))
    assert reply.status == 400
    document = reply.json()
    assert isinstance(document, dict)
    assert document["error"].startswith("bad_input: clockwork-slo-ms")
    assert not http.service.submitted and http.answers == [("http", "bad_input")]


async def test_the_wait_since_its_turn_goes_to_both_screens(http: Front) -> None:
    body = infer_body([1, 2, 3, 4], parameters={"slo_ms": 30})
    url = bytearray(INFER.format("echo").encode())
    turn_ns = time.monotonic_ns() - 50 * MS_NS  # its task waited 50 ms for the loop
    request = v2_routes.HttpRequest("POST", url, body=bytearray(body), turn_ns=turn_ns)
    response = await v2_routes.route(http.http.door, request)
    assert response.status == 200
    service = http.service
    assert len(service.screens) == 2 and len(service.submitted) == 1
    before_parse, after_parse = service.waits_ns
    # both screens judge the loop by the wait too: the one before the parse (a refusal saves
    # the parse) only against the loop's cap, as its head gives no SLO; the one after it with
    # the SLO its body gives (a request admitted after its wait would answer late)
    assert 50 * MS_NS <= before_parse <= after_parse < 10_000 * MS_NS
    assert service.submitted[0].slo_ns == 30 * MS_NS  # an admitted one's SLO: from the door


async def test_a_request_read_from_a_socket_is_stamped_at_its_turn(http: Front) -> None:
    conn = await connect(http)
    reply = await conn.ask(request("POST", INFER.format("echo"), infer_body([1, 2, 3, 4])))
    assert reply.status == 200
    before_parse, after_parse = http.service.waits_ns
    assert 0 < before_parse <= after_parse  # stamped: a wait of some ns
