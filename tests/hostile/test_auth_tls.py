"""Tokens and TLS on the real daemon's client API: one daemon with both tokens and a
self-signed certificate (made with openssl by the ``certificate`` fixture; skipped without it).

The HTTP and gRPC front ends (docs/protocol-v2.md) serve TLS with the same certificate and
tokens. No token or a wrong one gets ``unauthorized`` and a closed connection; the ``infer`` token
serves inference but not model changes (``forbidden``, the connection stays open); the
``admin`` token may add and remove models. A client that does not speak TLS fails cleanly (a
named connect error, not a hang) and the daemon keeps serving TLS clients.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from clockwork_async.api.auth import client_ssl_context
from clockwork_async.client import ApiError, Client, ConnectError
from clockwork_async.models.demo import build_tiny

from .support import SLO_MS, DaemonProcess, GoodClient, RawClient, start_daemon

INFER_TOKEN = "infer-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
ROW = {"input": np.ones((1, 4), np.float32)}


@pytest.fixture(scope="module")
def tls(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    return client_ssl_context(certificate[0])


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, certificate: tuple[Path, Path]
) -> Iterator[DaemonProcess]:
    cert, key = certificate
    server = "\n".join(
        [
            f'infer_token = "{INFER_TOKEN}"',
            f'admin_token = "{ADMIN_TOKEN}"',
            f'tls_cert_path = "{cert}"',
            f'tls_key_path = "{key}"',
        ]
    )
    process = start_daemon(tmp_path_factory.mktemp("auth-daemon"), server=server)
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture
def good(daemon: DaemonProcess, tls: ssl.SSLContext) -> Iterator[GoodClient]:
    client = GoodClient(daemon.api, token=INFER_TOKEN, ssl=tls)
    yield client
    client.check()
    assert daemon.process.poll() is None, "the daemon died"


def connect(daemon: DaemonProcess, tls: ssl.SSLContext | None, token: str = "") -> Client:
    return Client(daemon.api, token=token, ssl=tls, timeout_s=30.0, connect_timeout_s=10.0)


@pytest.mark.parametrize(
    "token", ["", "wrong-token-0123456789abcdef", INFER_TOKEN[:-1], INFER_TOKEN + "x", "é" * 20]
)
def test_a_missing_or_wrong_token_is_unauthorized_and_closed(
    daemon: DaemonProcess, tls: ssl.SSLContext, good: GoodClient, token: str
) -> None:
    with pytest.raises(ConnectError) as refused:
        connect(daemon, tls, token)
    assert refused.value.code == "unauthorized"
    with RawClient(daemon.api, tls=tls) as raw:
        answer = raw.hello(token)
        ending = raw.read_until_closed(10.0)
    assert (answer["t"], answer["code"]) == ("error", "unauthorized")
    assert ending.how == "eof" and ending.headers == []
    assert token not in answer["message"] or not token


def test_the_infer_token_serves_inference_but_cannot_change_models(
    daemon: DaemonProcess, tls: ssl.SSLContext, good: GoodClient
) -> None:
    with connect(daemon, tls, INFER_TOKEN) as client:
        assert client.infer("tiny", ROW, slo_ms=SLO_MS).ok
        assert "tiny" in {model.name for model in client.models()}
        assert client.stats()["api"]["connections"] >= 2
        with pytest.raises(ApiError) as added:
            client.add_model("intruder", build_tiny(3).SerializeToString())
        with pytest.raises(ApiError) as removed:
            client.remove_model("tiny")
        assert (added.value.code, removed.value.code) == ("forbidden", "forbidden")
        assert client.infer("tiny", ROW, slo_ms=SLO_MS).ok  # the connection stays open
        assert {model.name for model in client.models()} == {"tiny"}
    assert not (daemon.log_path.parent / "models" / "intruder").exists()


def test_the_admin_token_adds_and_removes_models(
    daemon: DaemonProcess, tls: ssl.SSLContext, good: GoodClient
) -> None:
    with connect(daemon, tls, ADMIN_TOKEN) as client:
        status = client.add_model("admitted", build_tiny(4).SerializeToString())
        assert status.name == "admitted"
        assert client.infer("admitted", ROW, slo_ms=SLO_MS).ok
        client.remove_model("admitted")
        assert {model.name for model in client.models()} == {"tiny"}


def test_a_plain_client_fails_cleanly_and_tls_clients_are_still_served(
    daemon: DaemonProcess, tls: ssl.SSLContext, good: GoodClient
) -> None:
    with pytest.raises(ConnectError) as plain:
        connect(daemon, None, INFER_TOKEN)
    assert plain.value.code in {"protocol_error", "unreachable"}, plain.value
    with RawClient(daemon.api) as raw:  # plain bytes into a TLS listener
        raw.send(b"\x00" * 64)
        assert raw.read_until_closed(10.0).how in {"eof", "reset"}
    with connect(daemon, tls, INFER_TOKEN) as client:
        assert client.infer("tiny", ROW, slo_ms=SLO_MS).ok


def test_a_client_that_does_not_trust_the_certificate_fails_cleanly(
    daemon: DaemonProcess, good: GoodClient
) -> None:
    untrusting = ssl.create_default_context()  # the system's CAs: not our self-signed one
    with pytest.raises(ConnectError) as refused:
        connect(daemon, untrusting, INFER_TOKEN)
    assert refused.value.code == "unreachable" and "CERTIFICATE" in refused.value.message.upper()


def test_the_v2_front_ends_serve_tls_with_the_same_tokens(
    daemon: DaemonProcess, tls: ssl.SSLContext, certificate: tuple[Path, Path], good: GoodClient
) -> None:
    tensor = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}
    body = json.dumps({"inputs": [tensor]}).encode()

    def post(token: str) -> int:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(
            f"https://{daemon.http}/v2/models/tiny/infer", body, headers
        )
        try:
            with urllib.request.urlopen(request, context=tls, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    assert (post(""), post("wrong-token-0123456789abcdef"), post(INFER_TOKEN)) == (401, 401, 200)
    client = triton_grpc.InferenceServerClient(
        daemon.grpc, ssl=True, root_certificates=str(certificate[0])
    )
    try:
        row = triton_grpc.InferInput("input", [1, 4], "FP32")
        row.set_data_from_numpy(ROW["input"])
        with pytest.raises(InferenceServerException) as refused:
            client.infer("tiny", [row])
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
        answered = client.infer("tiny", [row], headers={"authorization": f"Bearer {INFER_TOKEN}"})
        assert answered.as_numpy("output").shape == (1, 1000)
    finally:
        client.close()
