"""Which scopes a holder stores blocks of, decided in one place (a holder's and an agent's).

A writer's token says which scopes it may use; that alone let any tenant fill a holder run by
another one, evict its blocks, and make its index publisher send records the IS refuses. So a
holder also has scopes of its own, and a block of any other scope is refused (403) before its
body is read:

- `--serve-scope HEX` (repeatable): exactly those scopes;
- else, with principals on and the holder's own token: the scopes of that token's principal
  (its publishing identity; a token the principals do not know is refused at start);
- else, with principals on and no token: the scopes of the principals that may store blocks
  (a holder with no identity of its own serves the tenants its principals file lists);
- else (an open holder): every scope.

With several scopes and no `--scope-quota`, each scope's share of the store is an equal part
of it, so one tenant cannot push the others out (`Tenancy.quota`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvsp_moq.auth import ANY, Action, Authenticator
from kvsp_moq.errors import ForbiddenScope, KvspError, SettingError
from kvsp_moq.protocol import validate as v


@dataclass(frozen=True)
class Tenancy:
    """The scopes a holder serves (`*` for any) and where that list came from."""

    scopes: frozenset[str]
    #: said in refusals and at start: "--serve-scope", "principal 'x'", ...
    source: str

    @classmethod
    def any(cls, source: str = "an open holder") -> "Tenancy":
        return cls(frozenset({ANY}), source)

    @property
    def serves_any(self) -> bool:
        return ANY in self.scopes

    def serves(self, scope_id: str) -> bool:
        return self.serves_any or scope_id.lower() in self.scopes

    def require(self, scope_id: str) -> None:
        """Raise ForbiddenScope (403) for a scope this holder does not serve."""
        if not self.serves(scope_id):
            raise ForbiddenScope(f"this holder does not store blocks of this scope (it serves "
                                 f"the scopes of {self.source})", member="scope")

    def quota(self, capacity: int, scope_quota: int | None) -> int | None:
        """Octets one scope may hold: `scope_quota`, else an equal share of `capacity` among
        several served scopes, else no limit (None) beyond the store's own."""
        if scope_quota is not None:
            return scope_quota
        if self.serves_any or len(self.scopes) < 2:
            return None
        return max(1, capacity // len(self.scopes))

    def describe(self) -> str:
        if self.serves_any:
            return f"every scope ({self.source})"
        return f"{len(self.scopes)} scope(s) of {self.source}: {', '.join(sorted(self.scopes))}"


def parse_scopes(values: Iterable[str]) -> list[str]:
    """Scope IDs as given to --serve-scope: 32 hex digits each (SettingError otherwise)."""
    out = []
    for value in values:
        try:
            out.append(v.hexn(value.strip().lower(), 16, "serve_scope"))
        except KvspError:
            raise SettingError(f"--serve-scope {value!r}: a Scope ID is 32 hex digits "
                               f"(kvsp keys scope-id prints it)") from None
    return out


def resolve(auth: Authenticator, token: str | None,
            serve_scopes: Iterable[str] | None = None) -> Tenancy:
    """The scopes a holder serves (see the module docstring); SettingError when its token is
    not one of its principals'."""
    configured = parse_scopes(serve_scopes or ())
    if configured:
        return Tenancy(frozenset(configured), "--serve-scope")
    if auth.is_open:
        return Tenancy.any()
    if token:
        try:
            who = auth.authenticate("Bearer " + token)
        except KvspError:
            raise SettingError("the holder's own token is not one of its principals': add it "
                               "to the principals file or name the scopes with --serve-scope") \
                from None
        return Tenancy(who.scopes, f"principal {who.name!r}")
    scopes = frozenset(s for p in auth.principals() if p.may(Action.STORE_BLOCKS)
                       for s in p.scopes)
    return Tenancy(scopes, "the principals that may store blocks")
