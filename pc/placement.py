"""Routing and prefetch (KVSP §6.4, §6.5): which active instance serves a prompt, and what it
should load before the request reaches it.

`rank` is pure: a lookup answer and the candidates' status records in, candidates ordered by
the §6.4 cost out. `Router` adds the I/O: the Index Service lookup (an injected async function,
so an in-process index and a remote one both work), the prefetch directive sent before the
answer, and the start hook for when no active instance is good enough.

`POST {pc}route` (our extension, DESIGN §3) body:

    {"tokens": [...]            prompt tokens; or "block_keys": [hex32, ...] already computed
     "scope": "name"            scope name from the keys file; or "scope_id": hex16
     "compat_id": hex32,
     "block_tokens": 16,        optional; else configured per compat_id, else the default
     "token_count": n,          optional with block_keys: prompt length (default: keys * B)
     "request_ref": "..."}      optional; the PC makes one when absent

Answer:

    {"instance": url, "directive": uuid | null, "request_ref": str, "matched": n,
     "matched_tokens": t, "token_count": n, "scope_id": hex16, "compat_id": hex32,
     "prefetch": "accepted" | "failed" | "none",
     "estimates": [{"instance", "fetch_us", "recompute_us", "wait_us", "recompute_all_us",
                    "cost_us", "resident_blocks", "uses_cache"}, ...]   (best first)
     "reason": "lowest-cost" | "started" | "over-threshold"}

"directive" is null (and "prefetch" "none") when no block matched, when the chosen instance's
estimate says recomputing the prefix beats loading it (nothing worth loading), and, by the
default policy (`PlacementSettings.prefetch`, `kvsp index --prefetch`), when no request is queued
ahead of this one there: a request that starts at once loads the prefix layer by layer while
it computes, which a directive sent just before it would turn into whole blocks to wait for.
"reason" is "started" when the start hook supplied a new instance (no active one, or none
under `max_cost_us`), and "over-threshold" when the best active instance was chosen although
its cost exceeds the threshold because no instance could be started.

A started instance is registered with the lifecycle registry before its directive goes out
(it is active from then on, provisionally until its first status record), and every chosen
instance has the request counted in its queue until its status records account for it, so
that the next route already sees it (`InstanceRegistry.note_routed`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from kvsp_moq.errors import BadRecord, KvspError, NoActiveInstance
from kvsp_moq.index_client import IndexClient, LookupBlock, LookupResult
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.cost import (
    Estimate,
    LinkTable,
    Profile,
    assumed_link,
    bytes_us,
    estimate,
    link_table,
    mean_service_us,
    replica_link,
    resides_at,
    tier_octets,
)
from kvsp_moq.protocol.keys import block_keys
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import InstanceStatus, LookupRequest, PrefetchBlock, PrefetchDirective, ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.scope_keys import parse_scope_keys, read_scope_keys
from pc.lifecycle import InstanceRegistry

log = logging.getLogger("kvsp.pc.placement")

#: The Index Service's lookup (§6.2), in-process or remote.
LookupFn = Callable[[LookupRequest], Awaitable[LookupResult]]
#: Sends POST {ii}prefetch; raises on anything but 202 (or 2xx).
PrefetchSender = Callable[[str, PrefetchDirective], Awaitable[None]]
#: Starts an instance for a request and returns its base URL, or a record of what is known of
#: it (rates, links) to rank it by until it reports; None when it cannot. The PC registers it.
StartHook = Callable[["RouteRequest"], Awaitable["str | InstanceStatus | None"]]



# --------------------------------------------------------------------------- settings, keys


PREFETCH_POLICIES = ("queued", "always")


@dataclass(frozen=True)
class PlacementSettings:
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Block size B for compat IDs not listed in `block_tokens_by_compat`."""
    block_tokens_by_compat: Mapping[str, int] = field(default_factory=dict)
    max_cost_us: float | None = None
    """A cost above this is not acceptable: the start hook is asked for a new instance."""
    prefetch: str = "queued"
    """When the chosen instance gets a prefetch directive: "queued", only when requests are
    queued ahead of this one there (the directive loads while it waits); "always". A request
    that starts at once loads its own prefix layer by layer while it computes, which a
    directive sent just before it would replace by whole blocks it must wait for."""
    prefetch_deadline_ms: int = 50
    lease_ms: int = 2000
    mean_service_tokens: float = 512.0
    """Tokens per request assumed for wait_us = queued * mean service time (§6.4)."""

    def __post_init__(self) -> None:
        if self.prefetch not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch must be one of {', '.join(PREFETCH_POLICIES)}, not {self.prefetch!r}")


@dataclass(frozen=True)
class ScopeKeys:
    """Scope keys from the keys file (DESIGN §3), by name and by Scope ID."""

    by_name: Mapping[str, bytes] = field(default_factory=dict)

    @functools.cached_property
    def by_id(self) -> dict[str, bytes]:
        return {scope_id_of(k).hex(): k for k in self.by_name.values()}

    @classmethod
    def from_file(cls, path: str | Path | None) -> "ScopeKeys":
        """A keys file (kvsp_moq.scope_keys); None: no keys."""
        return cls() if path is None else cls(read_scope_keys(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ScopeKeys":
        return cls(parse_scope_keys(data))

    def key_for(self, *, name: str | None = None, scope_id: str | None = None) -> bytes | None:
        if name is not None:
            return self.by_name.get(name)
        if scope_id is not None:
            return self.by_id.get(scope_id.lower())
        return None


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RouteRequest:
    """A prompt to place, reduced to what placement needs: its Block Keys and its length."""

    scope_id: str
    compat_id: str
    block_keys: tuple[str, ...]
    token_count: int
    block_tokens: int
    request_ref: str | None = None
    #: instances not to place it on (a front end that found them busy or unreachable)
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any, *, keys: ScopeKeys,
                  settings: PlacementSettings) -> "RouteRequest":
        data = v.obj(data)
        compat = v.hexn(v.required(data, "compat_id"), 32, "compat_id")
        name = data.get("scope")
        if name is not None:
            name = v.string(name, "scope", max_len=256)
            key = keys.key_for(name=name)
            if key is None:
                raise BadRecord(f"no scope key named {name!r} is configured", member="scope")
            sid = scope_id_of(key).hex()
        else:
            sid = v.hexn(v.required(data, "scope_id"), 16, "scope_id")
            key = None
        b = data.get("block_tokens")
        b = (v.integer(b, "block_tokens", low=1, high=1 << 20) if b is not None
             else settings.block_tokens_by_compat.get(compat, settings.block_tokens))
        ref = data.get("request_ref")
        ref = None if ref is None else v.string(ref, "request_ref", max_len=1024)
        if "tokens" in data:
            tokens = v.tokens(data["tokens"], "tokens")
            key = key or keys.key_for(scope_id=sid)
            if key is None:
                raise BadRecord("no scope key is configured for this scope; send block_keys",
                                member="scope_id")
            keys_hex = tuple(k.hex() for k in block_keys(key, bytes.fromhex(compat), tokens, b))
            count = len(tokens)
        elif "block_keys" in data:
            keys_hex = tuple(v.array(data["block_keys"], "block_keys",
                                     lambda x, m: v.hexn(x, 32, m), max_len=1 << 20))
            count = data.get("token_count")
            count = (len(keys_hex) * b if count is None
                     else v.integer(count, "token_count", low=len(keys_hex) * b))
        else:
            raise BadRecord("either tokens or block_keys is required", member="tokens")
        exclude = tuple(v.array(data.get("exclude", []), "exclude",
                                lambda x, m: v.url(x, m, schemes=("http", "https")), max_len=1024))
        return cls(sid, compat, keys_hex, count, b, ref, exclude)


# --------------------------------------------------------------------------- ranking (pure)


def holds(instance: str, record: ReplicaRecord) -> bool:
    """Whether the replica sits at the instance itself (§6.4's rule, `cost.resides_at`)."""
    return resides_at(instance, record)


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


@dataclass(frozen=True)
class Candidate:
    status: InstanceStatus
    estimate: Estimate
    resident_blocks: int
    """Matched blocks the instance holds itself (nothing to load for them)."""

    @property
    def instance(self) -> str:
        return self.status.instance

    @property
    def cost_us(self) -> float:
        return self.estimate.cost_us

    def to_json(self) -> dict:
        e = self.estimate
        return {"instance": self.instance, "fetch_us": _finite(e.fetch_us),
                "recompute_us": _finite(e.recompute_us), "wait_us": _finite(e.wait_us),
                "recompute_all_us": _finite(e.recompute_all_us), "cost_us": _finite(e.cost_us),
                "resident_blocks": self.resident_blocks, "uses_cache": e.uses_cache}


@dataclass(frozen=True)
class ReplicaGroup:
    """Matched blocks whose replica sets look alike (same holders, sizes, layer counts and
    residency) cost alike, and are loaded from one source together."""

    count: int
    replicas: tuple[ReplicaRecord, ...]
    """The replicas of the group's first block."""
    scaled: tuple[ReplicaRecord, ...]
    """The same replicas with the size of the whole group, for fetch_us (linear in size)."""
    profiles: tuple[Profile, ...]
    """Per replica, the group's octets by tier read rate: what choosing a source needs."""


@dataclass(frozen=True)
class Grouping:
    """The matched blocks of a lookup, grouped so that ranking costs O(groups) per candidate
    instead of O(blocks)."""

    groups: tuple[ReplicaGroup, ...]
    of_block: tuple[int, ...]
    """Group index of each matched block, in prefix order."""

    @classmethod
    def of(cls, result: LookupResult) -> "Grouping":
        index: dict[tuple, int] = {}
        members: list[list] = []
        of_block = []
        for block in result.blocks[:result.matched]:
            reps = block.replicas
            sig = tuple([(r.holder, r.http_holder, r.size,
                          None if r.layer_digests is None else len(r.layer_digests), r.residency)
                         for r in reps])
            g = index.get(sig)
            if g is None:
                g = index[sig] = len(members)
                members.append([0, reps])
            members[g][0] += 1
            of_block.append(g)
        groups = tuple(
            ReplicaGroup(n, reps, reps if n == 1 else
                         tuple(dataclasses.replace(r, size=r.size * n) for r in reps),
                         tuple(tier_octets(r, n) for r in reps))
            for n, reps in members)
        return cls(groups, tuple(of_block))


#: An instance's reported links by holder, and the link assumed for any other holder.
_Links = tuple[LinkTable, tuple[float, float]]


def _links(status: InstanceStatus) -> _Links:
    return link_table(status.links), assumed_link(tuple(status.links))


def _load_us(links: _Links, record: ReplicaRecord, profile: Profile) -> float:
    """rtt + 8 * octets / rate from one source, each tier at min(link, tier read rate): the
    fetch_us of §6.4 for a single source, used to pick the source of a group."""
    known, assumed = links
    rate, rtt = replica_link(known, record) or assumed
    return rtt + bytes_us(profile, rate)


def rank(result: LookupResult, candidates: Iterable[InstanceStatus], *, token_count: int,
         block_tokens: int, mean_service_tokens: float = 512.0,
         grouping: Grouping | None = None) -> list[Candidate]:
    """Candidates by ascending §6.4 cost; ties go to the one holding more, then by URL.

    Blocks resident at an instance cost nothing there; each other group of alike blocks is
    charged to the replica holder that loads the whole group fastest for that instance; bytes
    from one source add up and sources load in parallel (fetch_us is a max over sources).
    """
    matched_tokens = min(result.matched * block_tokens, token_count)
    groups = (grouping or Grouping.of(result)).groups
    out = []
    for status in candidates:
        url = status.instance
        links = _links(status)
        plan: list[ReplicaRecord] = []
        resident = 0
        for g in groups:
            if any(holds(url, r) for r in g.replicas):
                resident += g.count
            elif len(g.scaled) == 1:
                plan.append(g.scaled[0])
            elif g.scaled:
                j = min(range(len(g.replicas)),
                        key=lambda j: _load_us(links, g.replicas[j], g.profiles[j]))
                plan.append(g.scaled[j])
        est = estimate(status, matched_tokens=matched_tokens, total_tokens=token_count, plan=plan,
                       service_us=mean_service_us(status, mean_service_tokens))
        out.append(Candidate(status, est, resident))
    out.sort(key=lambda c: (c.cost_us, -c.resident_blocks, c.instance))
    return out


def directive_for(result: LookupResult, request: RouteRequest, instance: InstanceStatus | None,
                  settings: PlacementSettings, *, directive: str | None = None,
                  request_ref: str | None = None,
                  grouping: Grouping | None = None) -> PrefetchDirective | None:
    """The prefetch directive for the matched blocks, sources fastest first for the instance
    (in listed order when the PC has no status for it yet); None when nothing matched."""
    grouping = grouping or Grouping.of(result)
    if not grouping.of_block:
        return None
    sources = []
    links = _links(instance) if instance is not None else None
    for g in grouping.groups:
        ranked = (sorted(range(len(g.replicas)),
                         key=lambda j: _load_us(links, g.replicas[j], g.profiles[j]))
                  if links is not None else range(len(g.replicas)))
        sources.append(tuple(dict.fromkeys(g.replicas[j].holder for j in ranked)))
    blocks = tuple(PrefetchBlock(b.block_key, sources[gi])
                   for b, gi in zip(result.blocks, grouping.of_block) if sources[gi])
    if not blocks:
        return None
    return PrefetchDirective(
        directive=directive or str(uuid.uuid4()), scope_id=request.scope_id,
        compat_id=request.compat_id, blocks=blocks,
        deadline_ms=settings.prefetch_deadline_ms, lease_ms=settings.lease_ms,
        request_ref=request_ref or request.request_ref)


# --------------------------------------------------------------------------- routing (I/O)


@dataclass(frozen=True)
class RouteDecision:
    instance: str
    request_ref: str
    directive: PrefetchDirective | None
    matched: int
    matched_tokens: int
    request: RouteRequest
    candidates: tuple[Candidate, ...]
    reason: str
    prefetch: str

    def to_json(self) -> dict:
        return {
            "instance": self.instance,
            "directive": self.directive.directive if self.directive else None,
            "request_ref": self.request_ref,
            "matched": self.matched,
            "matched_tokens": self.matched_tokens,
            "token_count": self.request.token_count,
            "scope_id": self.request.scope_id,
            "compat_id": self.request.compat_id,
            "prefetch": self.prefetch,
            "estimates": [c.to_json() for c in self.candidates],
            "reason": self.reason,
        }


def index_client_lookup(client: IndexClient) -> LookupFn:
    """A LookupFn over a remote Index Service."""

    async def lookup(req: LookupRequest) -> LookupResult:
        return await client.lookup(req.scope_id, req.compat_id, req.block_keys, req.targets)

    return lookup


def replica_store_lookup(store: Any, clock: Callable[[], float]) -> LookupFn:
    """A LookupFn over the Index Service's `ReplicaStore` in the same process (no HTTP).

    The store answers with the stored JSON octets of each replica; parsed records are kept by
    those octets (bounded), since the same replicas come back on every lookup of a prefix.
    """
    cache: dict[bytes, LookupBlock] = {}
    limit = 200_000

    def parse(octets: bytes) -> LookupBlock:
        block = cache.get(octets)
        if block is None:
            if len(cache) >= limit:
                cache.clear()
            data = json.loads(octets)
            block = cache[octets] = LookupBlock(
                data["block_key"], tuple(ReplicaRecord.from_json(r) for r in data["replicas"]))
        return block

    async def lookup(req: LookupRequest) -> LookupResult:
        hits = await store.lookup(req.compat_id, req.scope_id, req.block_keys, clock())
        return LookupResult(hits.matched, tuple(parse(b) for b in hits.blocks[:hits.matched]))

    return lookup


class MemoryIndex:
    """An in-process replica table with the lookup semantics of §6.2 (for running the PC on
    its own, tests and benchmarks): matched stops at the first key without a replica."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str, str], list[ReplicaRecord]] = {}

    def add(self, record: ReplicaRecord) -> None:
        self._by_key.setdefault((record.compat_id, record.scope_id, record.block_key),
                                []).append(record)

    async def lookup(self, req: LookupRequest) -> LookupResult:
        blocks = []
        table = self._by_key
        for key in req.block_keys:
            reps = table.get((req.compat_id, req.scope_id, key))
            if not reps:
                break
            blocks.append(LookupBlock(key, tuple(reps)))
        return LookupResult(len(blocks), tuple(blocks))


class Router:
    """Places requests on active instances and tells them what to prefetch first."""

    def __init__(self, registry: InstanceRegistry, lookup: LookupFn, send_prefetch: PrefetchSender,
                 settings: PlacementSettings | None = None, *, keys: ScopeKeys | None = None,
                 start_hook: StartHook | None = None) -> None:
        self.registry = registry
        self.lookup = lookup
        self.send_prefetch = send_prefetch
        self.settings = settings or PlacementSettings()
        self.keys = keys or ScopeKeys()
        self.start_hook = start_hook

    def parse(self, data: Any) -> RouteRequest:
        return RouteRequest.from_json(data, keys=self.keys, settings=self.settings)

    async def _ranked(self, request: RouteRequest, exclude: Iterable[str] = ()
                      ) -> tuple[LookupResult, Grouping, list[Candidate]]:
        actives = self.registry.active(exclude=exclude, scope_id=request.scope_id)
        targets = tuple(s.instance for s in actives) or None
        result = await self.lookup(LookupRequest(request.scope_id, request.compat_id,
                                                 request.block_keys, targets))
        # Statuses are read again after the await: an instance may have left "active".
        actives = self.registry.active(exclude=exclude, scope_id=request.scope_id)
        grouping = Grouping.of(result)
        ranked = rank(result, actives, token_count=request.token_count,
                      block_tokens=request.block_tokens,
                      mean_service_tokens=self.settings.mean_service_tokens, grouping=grouping)
        return result, grouping, ranked

    def _acceptable(self, best: Candidate | None) -> bool:
        limit = self.settings.max_cost_us
        return best is not None and (limit is None or best.cost_us <= limit)

    async def route(self, request: RouteRequest) -> RouteDecision:
        """Choose, send the prefetch directive, then answer (§6.4, §6.5)."""
        result, grouping, ranked = await self._ranked(request, request.exclude)
        ref = request.request_ref or uuid.uuid4().hex
        matched_tokens = min(result.matched * request.block_tokens, request.token_count)
        best = ranked[0] if ranked else None
        reason = "lowest-cost"
        target: str | None = None
        status: InstanceStatus | None = None
        if not self._acceptable(best):
            started = await self._start(request)
            if started is not None:
                target, reason = started, "started"
            elif best is None:
                raise NoActiveInstance(f"no active instance serves scope {request.scope_id}, "
                                       "and none could be started")
            else:
                reason = "over-threshold"
        if target is None:
            # Never a prefetch to an instance that is not active: check again, right before.
            for cand in ranked:
                if (self.registry.is_active(cand.instance)
                        and self.registry.serves(cand.instance, request.scope_id)):
                    target = cand.instance
                    break
            if target is None:
                raise NoActiveInstance("every candidate left the active state")
        # No await between the ranking and this: concurrent routes each see the ones before.
        self.registry.note_routed(target, request.scope_id)
        status = self.registry.get(target)
        directive = None
        if self._prefetches(reason, next((c for c in ranked if c.instance == target), None)):
            directive = directive_for(result, request, status, self.settings, request_ref=ref,
                                      grouping=grouping)
        prefetch = "none"
        if directive is not None:
            try:
                await self.send_prefetch(target, directive)
                prefetch = "accepted"
            except KvspError as e:
                log.warning("prefetch %s to %s failed: %s", directive.directive, target, e.detail)
                prefetch = "failed"
        return RouteDecision(target, ref, directive, result.matched, matched_tokens, request,
                             tuple(ranked), reason, prefetch)

    def _prefetches(self, reason: str, chosen: Candidate | None) -> bool:
        """Whether the chosen instance gets a directive. A started instance has measured
        nothing and waits to come up: it does. Otherwise not where §6.4 says recomputing
        beats loading (the directive would make it load over the slow link it would not use),
        and, by the "queued" policy, not where the request starts at once."""
        if reason == "started" or chosen is None:
            return True
        if not chosen.estimate.uses_cache:
            return False
        return self.settings.prefetch == "always" or chosen.estimate.wait_us > 0

    async def _start(self, request: RouteRequest) -> str | None:
        """Ask the start hook for an instance and register it, so that it is active for its
        directive and known to the next routes; None when none was started or it may not
        take requests (e.g. the hook named an instance that is draining)."""
        if self.start_hook is None:
            return None
        try:
            started = await self.start_hook(request)
        except Exception as e:  # a failing hook must not fail the request
            log.warning("start hook failed: %s", e)
            return None
        if not started:
            return None
        if not isinstance(started, (str, InstanceStatus)):
            log.warning("start hook returned %r, not a URL or a status record", started)
            return None
        try:
            usable = self.registry.register_started(started, request.scope_id)
        except (KvspError, ValueError) as e:
            log.warning("start hook returned an unusable instance: %s", e)
            return None
        url = base_url(started if isinstance(started, str) else started.instance)
        if not usable:
            log.warning("start hook named %s, which may not take requests now", url)
            return None
        return url

    async def choose(self, scope_id: str, compat_id: str, keys: Sequence[str], *,
                     token_count: int, block_tokens: int | None = None,
                     exclude: Iterable[str] = ()) -> str | None:
        """The lowest-cost active instance outside `exclude` (or a started one), without a
        prefetch: failover hands the instance the checkpoint, which lists the blocks."""
        b = block_tokens or self.settings.block_tokens_by_compat.get(compat_id,
                                                                    self.settings.block_tokens)
        request = RouteRequest(scope_id, compat_id, tuple(keys), token_count, b)
        _, _, ranked = await self._ranked(request, exclude)
        chosen: str | None
        if ranked and self._acceptable(ranked[0]):
            chosen = ranked[0].instance
        else:
            chosen = await self._start(request)
            if chosen is None and ranked:
                chosen = ranked[0].instance
        if chosen is not None:
            self.registry.note_routed(chosen, scope_id)  # the resumed session: work not reported yet
        return chosen
