"""The security edge of the client API: tokens grant scopes, and TLS contexts (stdlib `ssl`).

Invariants: a token is compared with every configured token in constant time
(`hmac.compare_digest` on UTF-8 bytes), whichever matches; with no token configured
authentication is off and every connection holds every scope; the ``admin`` scope includes
``infer``. Tokens never appear in a repr or a log line.
"""

from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Scope(StrEnum):
    INFER = "infer"  # infer, cancel, list models, stats, health
    ADMIN = "admin"  # also add and remove models


ALL_SCOPES: frozenset[Scope] = frozenset(Scope)
INFER_ONLY: frozenset[Scope] = frozenset({Scope.INFER})


@dataclass(frozen=True, slots=True)
class TokenAuth:
    """Shared-secret tokens: ``infer_token`` grants ``infer``, ``admin_token`` both scopes.
    Authentication is on when either is set."""

    infer_token: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.infer_token or self.admin_token)

    def scopes(self, token: str) -> frozenset[Scope] | None:
        """The scopes ``token`` grants; None when authentication is on and it matches none."""
        if not self.enabled:
            return ALL_SCOPES
        given = token.encode("utf-8", "surrogateescape")
        is_admin = _matches(given, self.admin_token)
        is_infer = _matches(given, self.infer_token)
        if is_admin:
            return ALL_SCOPES
        return INFER_ONLY if is_infer else None


def _matches(given: bytes, expected: str) -> bool:
    """Constant-time equality; an unset (empty) token never matches."""
    same = hmac.compare_digest(given, expected.encode("utf-8"))
    return same and bool(expected)


def server_ssl_context(
    cert_path: str | Path, key_path: str | Path, *, client_ca_path: str | Path | None = None
) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2+) from a PEM certificate chain and key; with
    ``client_ca_path`` clients must present a certificate it signed. Raises OSError or
    ssl.SSLError for unreadable or mismatched files."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_path), str(key_path))
    if client_ca_path is not None:
        context.load_verify_locations(str(client_ca_path))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(
    ca_path: str | Path | None = None, *, check_hostname: bool = True
) -> ssl.SSLContext:
    """A TLS client context that verifies the server against ``ca_path`` (a PEM bundle, e.g.
    a self-signed certificate), or the system's CAs when None."""
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=None if ca_path is None else str(ca_path)
    )
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = check_hostname
    return context
