"""Which scope a request's prompt is keyed in: the caller's, as everywhere else (DESIGN §3.8).

The gateway holds the scope keys (`--scope-keys`; without a file, the open scope "default",
whose key is public, as agents have it) and derives the Block Keys itself. A request names its
scope by name in the `X-KVSP-Scope` header; without the header it is the one scope of the
gateway's keys that the caller's principal holds (an OpenAI client sends no header: a tenant's
token usually holds one scope). The principal must hold the scope (403 `kvsp-forbidden-scope`);
no header and several candidate scopes is a 400 asking for the header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvsp_moq.auth import Principal
from kvsp_moq.errors import ForbiddenScope
from kvsp_moq.gateway.errors import ApiError
from kvsp_moq.protocol.keys import scope_id

__all__ = ["SCOPE_HEADER", "Scope", "ScopeChooser"]

SCOPE_HEADER = "X-KVSP-Scope"


@dataclass(frozen=True)
class Scope:
    name: str
    key: bytes
    id: str
    """Scope ID, hex."""


class ScopeChooser:
    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self.scopes = {name: Scope(name, key, scope_id(key).hex()) for name, key in keys.items()}

    def choose(self, who: Principal, header: str | None) -> Scope:
        if header is not None:
            scope = self.scopes.get(header.strip())
            if scope is None:
                raise ApiError(400, f"this gateway has no scope named {header.strip()!r}",
                               param=SCOPE_HEADER, code="kvsp-bad-record")
            who.require_scope(scope.id)
            return scope
        held = [s for s in self.scopes.values() if who.may_use_scope(s.id)]
        if not held:
            raise ForbiddenScope(f"principal {who.name!r} holds no scope this gateway serves")
        if len(held) > 1:
            raise ApiError(400, f"principal {who.name!r} holds several scopes here "
                                f"({', '.join(sorted(s.name for s in held))}): name one in the "
                                f"{SCOPE_HEADER} header", param=SCOPE_HEADER,
                           code="kvsp-bad-record")
        return held[0]
