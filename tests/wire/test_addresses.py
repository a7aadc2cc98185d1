"""`wire.addresses`: the one address type and the forms a connection accepts."""

from __future__ import annotations

import pytest

from clockwork_async.wire.addresses import TcpAddress, UnixAddress, parse_address


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("unix:/run/x.sock", UnixAddress("/run/x.sock")),
        ("tcp:127.0.0.1:7000", TcpAddress("127.0.0.1", 7000)),
        ("localhost:0", TcpAddress("localhost", 0)),
        ("tcp:[::1]:65535", TcpAddress("::1", 65535)),
    ],
)
def test_parse_address(text: str, address: UnixAddress | TcpAddress) -> None:
    assert parse_address(text) == address
    assert parse_address(str(address)) == address


@pytest.mark.parametrize(
    "text",
    ["unix:", "tcp:host", "host:", ":80", "h:65536", "h:-1", "h:8x", "::1:80", "h:٣", "a b:1"],
)
def test_parse_address_rejects_bad_addresses_clearly(text: str) -> None:
    with pytest.raises(ValueError, match="bad address"):
        parse_address(text)


def test_tcp_addresses_are_the_configs_addresses_and_print_as_clients_write_them() -> None:
    """One address type: what a connection parses is what the config holds (`TcpAddress`),
    printed as ``host:port``, which both parse back."""
    address = parse_address("tcp:[::1]:7470")
    assert address == TcpAddress.parse("[::1]:7470") == TcpAddress("::1", 7470)
    assert str(address) == "[::1]:7470" and parse_address(str(address)) == address
    assert isinstance(address, TcpAddress) and address.is_loopback
    with pytest.raises(ValueError, match=r"1\.\.65535"):
        TcpAddress.parse("gpu-box:0", allow_port_zero=False)
