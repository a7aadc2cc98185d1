"""Addresses of peers: `TcpAddress` (``host:port``, IPv6 in brackets) is the project's one
address type, also what the daemon's config holds (listen addresses, remote executors);
`parse_address` adds Unix sockets (``unix:/path``) for connections. Pure: no socket is opened
here, and every bad address is a ValueError that says which forms are accepted.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UnixAddress:
    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


@dataclass(frozen=True, slots=True)
class TcpAddress:
    """A TCP ``host:port``; an IPv6 host is written in brackets (``[::1]:7470``)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, allow_port_zero: bool = True) -> TcpAddress:
        """Parse ``host:port`` (host: a hostname, an IPv4 address or a bracketed IPv6 one);
        raises ValueError with the reason."""
        host, sep, port_text = text.rpartition(":")
        if not sep or not port_text.isascii() or not port_text.isdigit():
            raise ValueError("host:port with a numeric port")
        port = int(port_text)
        if not (0 if allow_port_zero else 1) <= port <= 0xFFFF:
            raise ValueError("a port in 1..65535" + (" (or 0 for any)" if allow_port_zero else ""))
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            if not _is_ip(host) or ipaddress.ip_address(host).version != 6:
                raise ValueError("a valid IPv6 address in brackets")
        elif ":" in host or (not _is_ip(host) and not _HOSTNAME.match(host)):
            raise ValueError("a hostname, an IPv4 address or a bracketed IPv6 address")
        return cls(host, port)

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        return _is_ip(self.host) and ipaddress.ip_address(self.host).is_loopback

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


Address = UnixAddress | TcpAddress
_ADDRESS_FORMS = "unix:/path/to.sock, tcp:HOST:PORT or HOST:PORT ([::1]:PORT for IPv6)"
_HOSTNAME = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*\Z")


def parse_address(text: str) -> Address:
    """``unix:/path``, ``tcp:HOST:PORT`` or ``HOST:PORT`` as an Address; ValueError otherwise."""
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path:
            raise ValueError(f"bad address {text!r}: empty socket path; expected {_ADDRESS_FORMS}")
        return UnixAddress(path)
    try:
        return TcpAddress.parse(text.removeprefix("tcp:"))
    except ValueError as error:
        raise ValueError(f"bad address {text!r}: {error}; expected {_ADDRESS_FORMS}") from None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
