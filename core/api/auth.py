"""Bearer API keys: who is calling, which tenant they belong to, and whether a bind is safe.

Keys come from the stack's ``[api] api_keys`` and from the comma-separated environment variable named
by ``api_keys_env``. An entry is ``"KEY"`` or ``"KEY:tenant"``; a key without a tenant is its own
tenant. With no keys at all, auth is off: every caller is `ANONYMOUS`, and `check_bind` refuses any
host but loopback unless ``allow_public_bind`` says otherwise.

Only SHA-256 digests of the keys are kept in memory, and no message ever contains a key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from loopstack.stack.schema import ApiConfig

__all__ = [
    "ANONYMOUS", "AuthError", "KeyRing", "KeyRingError", "KeyRingStatistics", "Principal", "UnsafeBindError",
    "check_bind", "is_loopback_host", "key_fingerprint", "tenant_salt",
]  # fmt: skip

# RFC 6750 b64token: the characters a bearer token may carry (no ':' so "KEY:tenant" is unambiguous).
_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
_TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")
_BEARER = re.compile(r"^[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+) *$")


class AuthError(Exception):
    """A request is not authenticated; the message suits a 401 body and never contains the key.

    ``code`` is the OpenAI-style error code: ``"missing_api_key"`` or ``"invalid_api_key"``.
    """

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class KeyRingError(ValueError):
    """A configured key or tenant is malformed; the message names the entry, never the key."""


class UnsafeBindError(ValueError):
    """Auth is off and the server was asked to listen beyond loopback."""


@dataclass(frozen=True)
class Principal:
    """Who made a request: ``key_id`` is a non-secret fingerprint of the key, ``tenant`` owns its data."""

    key_id: str
    tenant: str


ANONYMOUS = Principal("anonymous", "default")


class KeyRingStatistics(NamedTuple):
    """How many keys and tenants a `KeyRing` holds."""

    num_keys: int
    num_tenants: int


def key_fingerprint(key: str) -> str:
    """The short, non-secret id of a key: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    """The accepted API keys, each mapped to its `Principal`. Immutable once built.

    Build it with `KeyRing.from_config`; ``KeyRing([])`` is a ring with auth off.
    """

    def __init__(
        self, entries: Iterable[tuple[str, str | None]], *, api_keys_env: str = "LOOPSTACK_API_KEYS"
    ) -> None:
        """``entries`` are ``(key, tenant or None)`` pairs; the same key twice must name the same tenant.

        ``api_keys_env`` is only named in error messages.
        """
        self.api_keys_env = api_keys_env
        by_digest: dict[bytes, Principal] = {}
        for key, tenant in entries:
            digest = hashlib.sha256(key.encode()).digest()
            principal = Principal(key_fingerprint(key), tenant or key_fingerprint(key))
            if by_digest.setdefault(digest, principal) != principal:
                raise KeyRingError(f"key {principal.key_id} is configured twice with different tenants")
        self._principals = tuple(by_digest.items())

    @classmethod
    def from_config(cls, api_config: ApiConfig, environ: Mapping[str, str] = os.environ) -> KeyRing:
        """Keys from ``api_config.api_keys`` plus the comma-separated ``environ[api_config.api_keys_env]``.

        Blank entries of the environment variable are skipped (a trailing comma is fine).

        Raises:
            KeyRingError: an entry has a malformed key or tenant; names its source and position.
        """
        entries = [_parse_entry(entry, f"[api] api_keys[{index}]") for index, entry in enumerate(api_config.api_keys)]
        raw = environ.get(api_config.api_keys_env, "")
        for index, entry in enumerate(raw.split(",")):
            if entry.strip():
                entries.append(_parse_entry(entry.strip(), f"${api_config.api_keys_env} entry {index}"))
        return cls(entries, api_keys_env=api_config.api_keys_env)

    @property
    def enabled(self) -> bool:
        """Whether auth is on (at least one key is configured)."""
        return bool(self._principals)

    def authenticate(self, authorization_header: str | None) -> Principal:
        """The principal of an ``Authorization: Bearer <key>`` header; `ANONYMOUS` when auth is off.

        Raises:
            AuthError: the header is missing or malformed, or the key is unknown.
        """
        if not self.enabled:
            return ANONYMOUS
        if not authorization_header:
            raise AuthError(
                "missing API key: send an 'Authorization: Bearer <api key>' header", code="missing_api_key"
            )
        match = _BEARER.match(authorization_header)
        if match is None:
            raise AuthError(
                "malformed Authorization header: expected 'Bearer <api key>'", code="invalid_api_key"
            )
        digest = hashlib.sha256(match.group(1).encode()).digest()
        found: Principal | None = None
        for known, principal in self._principals:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(digest, known):
                found = principal
        if found is None:
            raise AuthError("invalid API key", code="invalid_api_key")
        return found

    def statistics(self) -> KeyRingStatistics:
        """Keys and distinct tenants configured."""
        tenants = {principal.tenant for _, principal in self._principals}
        return KeyRingStatistics(len(self._principals), len(tenants))

    def __repr__(self) -> str:
        key_ids = [principal.key_id for _, principal in self._principals]
        return f"KeyRing(key_ids={key_ids})"


def _parse_entry(entry: str, where: str) -> tuple[str, str | None]:
    key, separator, tenant = entry.partition(":")
    if not _TOKEN.match(key):
        raise KeyRingError(
            f"{where}: malformed API key (allowed: letters, digits and -._~+/ with trailing '='; "
            "write 'KEY' or 'KEY:tenant')"
        )
    if separator and not _TENANT.match(tenant):
        raise KeyRingError(f"{where}: tenant name must be 1-128 of letters, digits and _.@- (key {key_fingerprint(key)})")
    return key, tenant if separator else None


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names a loopback address: localhost, 127.0.0.0/8 or ::1 (brackets allowed).

    Only the string is inspected; nothing is resolved or opened.
    """
    name = host.strip().rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, keyring: KeyRing, *, allow_public_bind: bool) -> None:
    """Refuse to listen beyond loopback with auth off, unless ``allow_public_bind``.

    Raises:
        UnsafeBindError: auth is off, ``host`` is not loopback (``0.0.0.0`` and ``::`` are not), and
            public binds are not allowed.
    """
    if keyring.enabled or allow_public_bind or is_loopback_host(host):
        return
    raise UnsafeBindError(
        f"refusing to listen on {host!r} with auth off: anyone who can reach it could use the server. "
        f"Configure API keys ([api] api_keys or ${keyring.api_keys_env}), listen on 127.0.0.1, "
        "or set [api] allow_public_bind = true"
    )


def tenant_salt(principal: Principal) -> str:
    """The string the engine mixes into its prefix-cache hashes for this principal's requests.

    Tenants never share cached prefixes (no timing probe of another tenant's prompts). The salt is a
    digest of the tenant, so tenant names stay out of engine logs and KV events. `ANONYMOUS` (auth
    off) gets ``""``: hashes are then the same as an unsalted engine's.
    """
    if principal == ANONYMOUS:
        return ""
    return hashlib.sha256(f"loopstack-tenant\0{principal.tenant}".encode()).hexdigest()[:32]
