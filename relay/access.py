"""Who may announce, subscribe and fetch what at a relay (DESIGN §3, §4).

A request is authorized by the AUTHORIZATION TOKENs it carries together with those of its
session's SETUP; any one of them that grants the action is enough. Tokens map to principals
through the same principals file as the HTTP services. The rules:

* "kvsp" namespaces carry the Scope ID in their third field. Announcing, publishing,
  subscribing and fetching need a principal holding that scope. Announcing and publishing
  also need the fourth field, the publisher_id, to name a holder the principal may publish
  for (publisher_id = first 16 octets of SHA-256 of the holder's HTTP base URL), unless the
  principal may publish for any holder ("*") or is an admin.
* A "kvsp" namespace too short to name a scope, and any other namespace, spans every scope:
  only a principal with scope "*" may use it.
* Namespace discovery (SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS) needs a valid token; what it
  reveals is filtered by the same scope rule.

Without a principals file the relay is open: everything is allowed.

Sans-I/O: decisions only; the relay turns a refusal into REQUEST_ERROR UNAUTHORIZED.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Sequence

from kvsp_moq.auth import ANY, Authenticator, Principal
from kvsp_moq.errors import KvspError
from kvsp_moq.moqt.errors import Unauthorized
from kvsp_moq.moqt.messages import TrackNamespace
from kvsp_moq.naming import ROOT, publisher_id


class Action(Enum):
    ANNOUNCE = "announce"  #: PUBLISH_NAMESPACE
    PUBLISH = "publish"  #: PUBLISH of one track
    SUBSCRIBE = "subscribe"  #: SUBSCRIBE, TRACK_STATUS
    FETCH = "fetch"
    DISCOVER = "discover"  #: SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS


_PUBLISHING = (Action.ANNOUNCE, Action.PUBLISH)


def scope_field(namespace: TrackNamespace) -> bytes | None:
    """The Scope ID of a "kvsp" namespace long enough to have one."""
    if len(namespace) >= 3 and namespace[0] == ROOT:
        return namespace[2]
    return None


def _may_publish_as(principal: Principal, pid: bytes) -> bool:
    if ANY in principal.holders or principal.has_role("admin"):
        return True
    return any(publisher_id(h) == pid or publisher_id(h.rstrip("/")) == pid
               for h in principal.holders)


class AccessPolicy:
    """Authorization decisions of one relay."""

    def __init__(self, authenticator: Authenticator | None = None) -> None:
        self.authenticator = authenticator or Authenticator.open()

    @property
    def is_open(self) -> bool:
        return self.authenticator.is_open

    def principals(self, tokens: Iterable[bytes]) -> list[Principal]:
        """The principals of the valid tokens among `tokens` (none may be valid)."""
        out = []
        for raw in tokens:
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                continue
            try:
                out.append(self.authenticator.authenticate(text))
            except KvspError:
                continue
        return out

    def permits(self, principal: Principal, action: Action, namespace: TrackNamespace) -> bool:
        scope = scope_field(namespace)
        if scope is None:
            return ANY in principal.scopes
        if not principal.may_use_scope(scope.hex()):
            return False
        if action in _PUBLISHING and len(namespace) >= 4:
            return _may_publish_as(principal, namespace[3])
        return True

    def check(self, action: Action, namespace: TrackNamespace, tokens: Sequence[bytes]) -> list[Principal]:
        """Raise MOQT Unauthorized unless a token grants `action` on `namespace`; returns the
        principals of the valid tokens (for filtering what discovery reveals)."""
        if self.is_open:
            return [self.authenticator.authenticate(None)]  # the open principal
        if not tokens:
            raise Unauthorized("an authorization token is required")
        principals = self.principals(tokens)
        if not principals:
            raise Unauthorized("unknown authorization token")
        if action is Action.DISCOVER:
            return principals
        namespace = tuple(namespace)
        if any(self.permits(p, action, namespace) for p in principals):
            return principals
        scope = scope_field(namespace)
        what = f"scope {scope.hex()}" if scope is not None else "this namespace"
        if scope is not None and action in _PUBLISHING and any(
                p.may_use_scope(scope.hex()) for p in principals):
            what = "this publisher_id"
        raise Unauthorized(f"not authorized to {action.value} in {what}")

    def may_see(self, principals: Sequence[Principal], namespace: TrackNamespace) -> bool:
        """Whether discovery may reveal `namespace` to these principals."""
        if self.is_open:
            return True
        return any(self.permits(p, Action.SUBSCRIBE, tuple(namespace)) for p in principals)
