"""Principals and bearer tokens (DESIGN §3), shared by every server.

A principals file (TOML) lists, per principal, the SHA-256 of its bearer token, the scopes it
may use, the holder URIs it may publish for, and its roles. Tokens themselves are never stored.
Without a file, servers run open on loopback and say so; anywhere else they refuse to start
unless given --insecure-open (kvsp_moq.serving).

What a principal may do is the conjunction of three checks, each made where the request is
served: its roles must include one that may take the action (`PERMISSIONS`, the one table of
who may do what, for every HTTP resource and every MOQT request at a relay); its scopes must
include the Scope ID the request touches; and publishing (replica records, MOQT announcements)
must be for a holder it may publish for. Roles add to the scope and holder checks; they never
replace them.
"""

from __future__ import annotations

import argparse
import hashlib
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping

from kvsp_moq.errors import BadRecord, ForbiddenRole, ForbiddenScope, SettingError, Unauthorized
from kvsp_moq.protocol.urls import base_url

#: holder: a block store (kvsp holder); pc: the Placement Controller; instance: an inference
#: instance (kvsp agent), which is also the holder of its own pool; relay: a MOQT relay, as its
#: downstream relays present themselves upstream; client: an end user's front end, which asks
#: the PC for an instance, generates there and reads its sessions; metrics: a metrics scraper
#: (Prometheus), which may read /metrics and nothing else; admin: may do everything.
ROLES = frozenset({"holder", "pc", "instance", "relay", "client", "metrics", "admin"})
ANY = "*"


class Action(str, Enum):
    """What a request does, as the role table knows it. The value completes "may ..."."""

    # Index Service (§6.1, §6.2)
    PUBLISH_REPLICAS = "publish replica records"  #: PUT|DELETE replicas/..., POST replicas:batch
    LOOKUP = "look up replicas"  #: POST lookup
    # holders, and an agent's own holder (§6.6, §6.7)
    STORE_BLOCKS = "store blocks"  #: PUT blocks/...
    READ_BLOCKS = "read blocks"  #: GET|HEAD blocks/..., POST leases, PUT|DELETE leases/{id}
    # Placement Controller (§6.3, §6.8)
    REPORT = "report instance status"  #: PUT instances/{id}/status, PUT|DELETE sessions/...
    ROUTE = "route requests"  #: POST route
    RESHARD = "reshard"  #: POST reshard/{map} at the PC
    # an inference instance (§6.5, §6.8, §6.9), and PUT {pc}instances/{id}/state
    DIRECT = "direct instances"  #: POST prefetch, PUT state, POST sessions/{id}/resume,
    #: POST reshard, PUT shards/{map}
    GENERATE = "generate"  #: POST generate
    READ_SESSIONS = "read sessions"  #: GET sessions/{id}[/stream] at an instance or the PC
    TRANSFER_SHARDS = "transfer shard ranges"  #: GET kv?map=&tokens= (instance to instance)
    OBSERVE = "observe the cluster"  #: GET {pc}instances, {pc}shardmaps/{map}, {ii}status,
    #: {ii}prefetch/{directive}, {ii}reshard/{map}
    # MOQT at a relay
    ANNOUNCE = "announce or publish tracks"  #: PUBLISH_NAMESPACE, PUBLISH
    SUBSCRIBE = "subscribe to or fetch tracks"  #: SUBSCRIBE, FETCH, TRACK_STATUS
    DISCOVER = "discover namespaces"  #: SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS
    # every HTTP server, and the relay's --metrics address
    SCRAPE = "read metrics"  #: GET /metrics


#: Stands for "any authenticated principal, with or without roles" in `PERMISSIONS`.
EVERYONE = "*"

#: Who may do what. "admin" may do everything and is not listed. Why each row is what it is:
#:
#: - Replica records are published by whoever holds the replica: a holder, and an instance for
#:   the blocks of its own pool (§6.1: the IS checks the holder named in the record as well).
#:   A relay forwards the announcements of the publishers behind it to its upstream relay, so it
#:   may announce too, bounded like anyone else by its scopes and the holders it may publish for.
#: - Lookups are made by instances (what to load), the PC (where to route, when it runs apart
#:   from the IS) and holders (a holder that replicates finds its sources the same way).
#: - Blocks are stored by instances (their computed blocks at a shared holder) and holders
#:   (replication); read, with leases to protect what is being read (§6.5, §6.6), by instances,
#:   holders and relays (a relay moves blocks; its scopes bound which). The PC never touches
#:   block bytes: a prefetch directive makes the instance take the lease and load.
#: - Instance status, session checkpoints and the end of a session come from instances (§6.3,
#:   §6.8).
#: - Routing is asked by clients (an end user's front end, before generating) and by the PC
#:   itself; generating is what clients do. There was no role for them before: a principal
#:   with a scope and no roles could generate, route and read blocks. Now it needs "client".
#: - Prefetch directives, state changes, resumes and resharding at an instance come from the PC
#:   (§6.3, §6.5, §6.8, §6.9); resharding at the PC is an operator's act: admin only.
#: - A session's progress is read by its client's front end, by the PC and by instances.
#: - Shard ranges move between the instances of a parallel group (§6.9).
#: - The cluster's operational state (instances, shard maps, directive progress) is read by
#:   the PC and instances.
#: - At a relay, subscribing and fetching is what instances, holders and downstream relays do;
#:   discovering namespaces needs only a valid token (what it reveals is filtered by scope).
#: - Metrics are aggregates over every tenant (sessions running at a shared instance, lookups
#:   and hits at the IS): read over time they tell one tenant of another's activity, so with
#:   principals on they are for the operator's scraper ("metrics") only. /healthz stays open.
PERMISSIONS: Mapping[Action, frozenset[str]] = MappingProxyType({
    Action.PUBLISH_REPLICAS: frozenset({"holder", "instance"}),
    Action.LOOKUP: frozenset({"instance", "pc", "holder"}),
    Action.STORE_BLOCKS: frozenset({"instance", "holder"}),
    Action.READ_BLOCKS: frozenset({"instance", "holder", "relay"}),
    Action.REPORT: frozenset({"instance"}),
    Action.ROUTE: frozenset({"client", "pc"}),
    Action.RESHARD: frozenset({"admin"}),
    Action.DIRECT: frozenset({"pc"}),
    Action.GENERATE: frozenset({"client"}),
    Action.READ_SESSIONS: frozenset({"client", "pc", "instance"}),
    Action.TRANSFER_SHARDS: frozenset({"instance"}),
    Action.OBSERVE: frozenset({"pc", "instance"}),
    Action.ANNOUNCE: frozenset({"holder", "instance", "relay"}),
    Action.SUBSCRIBE: frozenset({"instance", "holder", "relay"}),
    Action.DISCOVER: frozenset({EVERYONE}),
    Action.SCRAPE: frozenset({"metrics"}),
})
assert set(PERMISSIONS) == set(Action)


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

    def require_resource_scope(self, scope_id: str | None) -> None:
        """Like `require_scope`; a resource that names no scope needs every scope ("*")."""
        if scope_id is None:
            if ANY not in self.scopes:
                raise ForbiddenScope(f"principal {self.name!r} is not authorized for a "
                                     f"resource of no scope")
        else:
            self.require_scope(scope_id)

    def require_every_scope(self, scopes: Iterable[str], what: str) -> None:
        """ForbiddenScope unless the principal holds each of `scopes` ("*" among them: needs
        "*"): for an act on something every one of those scopes shares."""
        if ANY in self.scopes:
            return
        if ANY in scopes or not {s.lower() for s in scopes} <= self.scopes:
            raise ForbiddenScope(f"principal {self.name!r} does not hold every scope {what} "
                                 f"serves")

    def may_publish_for(self, holder: str) -> bool:
        return (ANY in self.holders or "admin" in self.roles
                or base_url(holder) in self.holders)

    def require_holder(self, holder: str) -> None:
        if not self.may_publish_for(holder):
            raise ForbiddenScope(f"principal {self.name!r} may not publish for holder {holder}")

    def has_role(self, role: str) -> bool:
        return role in self.roles or "admin" in self.roles

    def may(self, action: Action) -> bool:
        """Whether one of this principal's roles may take `action` (`PERMISSIONS`)."""
        allowed = PERMISSIONS[action]
        return EVERYONE in allowed or "admin" in self.roles or not allowed.isdisjoint(self.roles)

    def require(self, action: Action) -> "Principal":
        """Raise ForbiddenRole (403) unless one of this principal's roles may take `action`."""
        if not self.may(action):
            raise ForbiddenRole(f"principal {self.name!r} lacks a role that may {action.value} "
                                f"(one of: {', '.join(sorted(PERMISSIONS[action] | {'admin'}))})")
        return self


def principal_entry(name: str, digest: str, scopes: Iterable[str], holders: Iterable[str],
                    roles: Iterable[str]) -> str:
    """One `[[principal]]` table of a principals file, as `Authenticator.from_mapping` reads it.

    Written here, beside the reader, so the two cannot drift apart; the caller validates.
    """
    from kvsp_moq.scope_keys import toml_string

    def array(items: Iterable[str]) -> str:
        return "[" + ", ".join(toml_string(x) for x in items) + "]"

    return (f"[[principal]]\nname = {toml_string(name)}\ntoken_sha256 = {toml_string(digest)}\n"
            f"scopes = {array(scopes)}\nholders = {array(holders)}\nroles = {array(sorted(roles))}\n")


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
        if not data.get("principal"):  # a server with no principal would refuse every request
            hint = "; is this a --scope-keys file?" if data else ""
            raise BadRecord(f"principals file {path} names no principal (no [[principal]] "
                            f"table){hint}", member="principals")
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
                holders=frozenset(base_url(h) if h != ANY else h
                                  for h in entry.get("holders", [])),
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


def add_token_options(p: "argparse.ArgumentParser", name: str = "token", *, what: str) -> None:
    """--NAME TOKEN or --NAME-file FILE: the same bearer token, given directly (seen by anyone
    who lists processes) or read from a file (`kvsp keys token --out FILE` writes one)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(f"--{name}", metavar="TOKEN", help=f"{what} (visible in the process list: "
                                                           f"prefer --{name}-file)")
    group.add_argument(f"--{name}-file", metavar="FILE", help=f"file holding the {what}")


def token_from_args(args: "argparse.Namespace", name: str = "token") -> str | None:
    """The token of `add_token_options`: --NAME, else the text of --NAME-file (SettingError, one
    line, when that file cannot be read or is empty)."""
    attr = name.replace("-", "_")
    token = getattr(args, attr, None)
    path = getattr(args, attr + "_file", None)
    if token or not path:
        return token or None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingError(f"cannot read --{name}-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text:
        raise SettingError(f"--{name}-file {path} is empty")
    return text
