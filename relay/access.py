"""Who may announce, subscribe and fetch what at a relay (DESIGN §3, §4).

A request is authorized by the AUTHORIZATION TOKENs it carries together with those of its
session's SETUP; any one of them that grants the action is enough. Tokens map to principals
through the same principals file as the HTTP services. The rules:

* "kvsp" namespaces carry the Scope ID in their third field. Announcing, publishing,
  subscribing and fetching need a principal holding that scope. Announcing and publishing
  also need the fourth field, the publisher_id, to name a holder the principal may publish
  for (publisher_id = first 16 octets of SHA-256 of the holder's HTTP base URL), unless the
  principal may publish for any holder ("*") or is an admin. A "kvsp" namespace of three
  fields ("kvsp", compat, scope) names no publisher: announcing it would draw the requests for
  every publisher of that scope, so it counts as "any publisher" and needs holders "*" or admin.
* A "kvsp" namespace too short to name a scope, and any other namespace, spans every scope:
  only a principal with scope "*" may use it.
* Namespace discovery (SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS) needs a valid token; what it
  reveals is filtered by the same scope rule.
* Besides, the principal needs a role that may take the action (kvsp_moq.auth.PERMISSIONS):
  announcing and publishing: holder, instance, relay; subscribing, fetching and TRACK_STATUS:
  instance, holder, relay; discovery: any valid token.
* Relay chains. A relay with an upstream presents its `--upstream-token` in its SETUP there, and
  only that: it speaks for itself upstream, so the upstream authorizes what it forwards against
  that principal (which needs the relay role and the scopes it serves), never against the
  downstream's clients' tokens (announcements also carry their publisher's tokens, since the
  publisher_id is the publisher's to vouch for). Whatever the upstream relay asks on the session
  this relay opened to it (a SUBSCRIBE or FETCH for a namespace announced here and forwarded
  up) is accepted as coming from `UPSTREAM`: the upstream authorized its own client before
  forwarding, and this relay chose to connect to it. A client of this relay is checked here,
  against this relay's principals, before anything is forwarded.

Without a principals file the relay is open: everything is allowed.

Sans-I/O: decisions only; the relay turns a refusal into REQUEST_ERROR UNAUTHORIZED.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Sequence

from kvsp_moq.auth import ANY, PERMISSIONS, Authenticator, Principal
from kvsp_moq.auth import Action as Doing
from kvsp_moq.errors import KvspError
from kvsp_moq.moqt.errors import UnauthorizedRequest
from kvsp_moq.moqt.wire import TrackNamespace
from kvsp_moq.naming import id_field, publisher_id, scope_of_namespace


class Action(Enum):
    ANNOUNCE = "announce"  #: PUBLISH_NAMESPACE
    PUBLISH = "publish"  #: PUBLISH of one track
    SUBSCRIBE = "subscribe"  #: SUBSCRIBE, TRACK_STATUS
    FETCH = "fetch"
    DISCOVER = "discover"  #: SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS


_PUBLISHING = (Action.ANNOUNCE, Action.PUBLISH)

#: The row of the role table (kvsp_moq.auth.PERMISSIONS) each MOQT request falls under.
ROLE_ACTION = {Action.ANNOUNCE: Doing.ANNOUNCE, Action.PUBLISH: Doing.ANNOUNCE,
               Action.SUBSCRIBE: Doing.SUBSCRIBE, Action.FETCH: Doing.SUBSCRIBE,
               Action.DISCOVER: Doing.DISCOVER}

#: Who asks on the session a relay opened to its upstream relay: that relay, trusted as such.
UPSTREAM = Principal("upstream relay", frozenset({ANY}), frozenset({ANY}), frozenset({"relay"}))


def _may_publish_as(principal: Principal, pid: bytes) -> bool:
    """Whether the publisher_id field `pid` names one of the principal's holders."""
    if ANY in principal.holders or principal.has_role("admin"):
        return True
    return any(id_field(publisher_id(h)) == pid or id_field(publisher_id(h.rstrip("/"))) == pid
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
        return principal.may(ROLE_ACTION[action]) and self.in_scope(principal, action, namespace)

    @staticmethod
    def in_scope(principal: Principal, action: Action, namespace: TrackNamespace) -> bool:
        """The scope (and, for publishing, publisher_id) half of `permits`, without roles."""
        scope = scope_of_namespace(namespace)
        if scope is None:
            return ANY in principal.scopes
        if not principal.may_use_scope(scope):
            return False
        if action in _PUBLISHING:
            if len(namespace) < 4:  # no publisher_id: every publisher of the scope
                return ANY in principal.holders or principal.has_role("admin")
            return _may_publish_as(principal, namespace[3])
        return True

    def check(self, action: Action, namespace: TrackNamespace, tokens: Sequence[bytes], *,
              upstream: bool = False) -> list[Principal]:
        """Raise UnauthorizedRequest unless a token grants `action` on `namespace`; returns the
        principals of the valid tokens (for filtering what discovery reveals). `upstream`: the
        request came on the session to this relay's upstream relay, which is trusted."""
        if self.is_open:
            return [self.authenticator.authenticate(None)]  # the open principal
        if upstream:
            return [UPSTREAM]
        if not tokens:
            raise UnauthorizedRequest("an authorization token is required")
        principals = self.principals(tokens)
        if not principals:
            raise UnauthorizedRequest("unknown authorization token")
        doing = ROLE_ACTION[action]
        if not any(p.may(doing) for p in principals):
            roles = ", ".join(sorted(PERMISSIONS[doing] | {"admin"}))
            names = ", ".join(repr(p.name) for p in principals)
            raise UnauthorizedRequest(f"not authorized to {action.value}: principal {names} lacks a role "
                               f"that may {doing.value} (one of: {roles})")
        if action is Action.DISCOVER:
            return principals
        namespace = tuple(namespace)
        if any(self.permits(p, action, namespace) for p in principals):
            return principals
        scope = scope_of_namespace(namespace)
        what = f"scope {scope}" if scope is not None else "this namespace"
        if scope is not None and action in _PUBLISHING and any(
                p.may_use_scope(scope) and p.may(doing) for p in principals):
            what = ("this publisher_id" if len(namespace) >= 4 else
                    'a namespace naming no publisher_id (that needs holders "*" or admin)')
        raise UnauthorizedRequest(f"not authorized to {action.value} in {what}")

    def may_see(self, principals: Sequence[Principal], namespace: TrackNamespace) -> bool:
        """Whether discovery may reveal `namespace` to these principals: by scope alone, as
        discovery needs no role."""
        if self.is_open:
            return True
        return any(self.in_scope(p, Action.SUBSCRIBE, tuple(namespace)) for p in principals)
