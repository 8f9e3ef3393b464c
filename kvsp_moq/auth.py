"""Principals and bearer tokens (DESIGN §3), shared by every server.

A principals file (TOML) lists, per principal, the SHA-256 of its bearer token, the scopes it
may use, the holder URIs it may publish for, and its roles. Tokens themselves are never stored.
Without a file, servers run open on loopback and say so; anywhere else they refuse to start
unless given --insecure-open (kvsp_moq.serving).
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from kvsp_moq.errors import BadRecord, ForbiddenScope, Unauthorized

ROLES = frozenset({"holder", "pc", "instance", "admin"})
ANY = "*"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for, and what it may do."""

    name: str
    scopes: frozenset[str] = field(default_factory=frozenset)
    holders: frozenset[str] = field(default_factory=frozenset)
    roles: frozenset[str] = field(default_factory=frozenset)

    def may_use_scope(self, scope_id: str) -> bool:
        return ANY in self.scopes or scope_id.lower() in self.scopes

    def require_scope(self, scope_id: str) -> None:
        if not self.may_use_scope(scope_id):
            raise ForbiddenScope(f"principal {self.name!r} is not authorized for this scope")

    def may_publish_for(self, holder: str) -> bool:
        return ANY in self.holders or "admin" in self.roles or _norm(holder) in self.holders

    def require_holder(self, holder: str) -> None:
        if not self.may_publish_for(holder):
            raise ForbiddenScope(f"principal {self.name!r} may not publish for holder {holder}")

    def has_role(self, role: str) -> bool:
        return role in self.roles or "admin" in self.roles

    def require_role(self, role: str) -> None:
        if not self.has_role(role):
            raise ForbiddenScope(f"principal {self.name!r} lacks the {role} role")


def _norm(url: str) -> str:
    return url if url.endswith("/") else url + "/"


#: The principal of an open server: everything is allowed.
OPEN = Principal("anonymous", frozenset({ANY}), frozenset({ANY}), ROLES)


class Authenticator:
    """Maps a bearer token to its principal."""

    def __init__(self, principals: dict[str, Principal] | None = None) -> None:
        # token digest -> principal; None means the server runs open.
        self._by_digest = principals

    @property
    def is_open(self) -> bool:
        return self._by_digest is None

    @classmethod
    def open(cls) -> "Authenticator":
        return cls(None)

    @classmethod
    def from_file(cls, path: str | Path | None) -> "Authenticator":
        if path is None:
            return cls.open()
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise BadRecord(f"cannot read principals file {path}: {e}", member="principals") from None
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: dict) -> "Authenticator":
        table: dict[str, Principal] = {}
        for i, entry in enumerate(data.get("principal", [])):
            where = f"principal[{i}]"
            digest = entry.get("token_sha256")
            if digest is None and "token" in entry:
                digest = token_digest(str(entry["token"]))
            if not isinstance(digest, str) or len(digest) != 64:
                raise BadRecord("needs token_sha256 (64 hex digits) or token", member=where)
            roles = frozenset(entry.get("roles", []))
            if not roles <= ROLES:
                raise BadRecord(f"unknown roles {sorted(roles - ROLES)}", member=where + ".roles")
            table[digest.lower()] = Principal(
                name=str(entry.get("name", f"principal-{i}")),
                scopes=frozenset(s.lower() for s in entry.get("scopes", [])),
                holders=frozenset(_norm(h) if h != ANY else h for h in entry.get("holders", [])),
                roles=roles,
            )
        return cls(table)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an Authorization header value (or a bare token, as MOQT carries)."""
        if self._by_digest is None:
            return OPEN
        if not authorization:
            raise Unauthorized("a bearer token is required")
        scheme, _, token = authorization.partition(" ")
        if not token:
            token, scheme = scheme, "bearer"
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("use the Bearer authorization scheme")
        # Keyed by a digest of the secret, so a dict lookup reveals nothing useful by timing.
        principal = self._by_digest.get(token_digest(token.strip()))
        if principal is None:
            raise Unauthorized("unknown bearer token")
        return principal

    def principals(self) -> Iterable[Principal]:
        return [] if self._by_digest is None else self._by_digest.values()
