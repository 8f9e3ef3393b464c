"""Routing and prefetch (KVSP §6.4, §6.5): which active instance serves a prompt, and what it
should load before the request reaches it.

`rank` (`pc.ranking`) is pure: a lookup answer and the candidates' status records in,
candidates ordered by the §6.4 cost out. `Router` adds the I/O: the Index Service lookup (an
injected async function, so an in-process index and a remote one both work), the prefetch
directive sent before the answer, and the start hook for when no active instance is good
enough. Between routes it keeps the candidates' links as arrays and the directive entries it
built (`LinkArrays`, `PrefetchBlocks`); `Router(reference=True)` keeps nothing and ranks with
the reference implementation, which decides the same.

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

import functools
import itertools
import json
import logging
import operator
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, cast

from kvsp_moq.errors import BadRecord, KvspError, NoActiveInstance
from kvsp_moq.index_client import IndexClient, LookupBlock, LookupResult
from kvsp_moq.model_descriptor import DEFAULT_BLOCK_TOKENS
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.keys import block_keys
from kvsp_moq.protocol.keys import scope_id as scope_id_of
from kvsp_moq.protocol.records import InstanceStatus, LookupRequest, PrefetchBlock, PrefetchDirective, ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.scope_keys import parse_scope_keys, read_scope_keys
from pc.lifecycle import InstanceRegistry
from pc.ranking import Candidate, Grouping, LinkArrays, ReplicaGroup, holds, links_of, load_us, rank

__all__ = [
    "Candidate", "Grouping", "LookupFn", "MemoryIndex", "PlacementSettings", "PrefetchBlocks",
    "PrefetchSender", "ReplicaGroup", "RouteDecision", "RouteRequest", "Router", "ScopeKeys",
    "StartHook", "directive_for", "holds", "index_client_lookup", "rank", "replica_store_lookup",
]

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
            keys_hex = v.hex_array(data["block_keys"], 32, "block_keys", max_len=1 << 20)
            count = data.get("token_count")
            count = (len(keys_hex) * b if count is None
                     else v.integer(count, "token_count", low=len(keys_hex) * b))
        else:
            raise BadRecord("either tokens or block_keys is required", member="tokens")
        exclude = tuple(v.array(data.get("exclude", []), "exclude",
                                lambda x, m: v.url(x, m, schemes=("http", "https")), max_len=1024))
        return cls(sid, compat, keys_hex, count, b, ref, exclude)


def directive_for(result: LookupResult, request: RouteRequest, instance: InstanceStatus | None,
                  settings: PlacementSettings, *, directive: str | None = None,
                  request_ref: str | None = None, grouping: Grouping | None = None,
                  reuse: "PrefetchBlocks | None" = None,
                  ranked: LinkArrays | None = None) -> PrefetchDirective | None:
    """The prefetch directive for the matched blocks, sources fastest first for the instance
    (in listed order when the PC has no status for it yet); None when nothing matched.
    `reuse` hands out block entries built for earlier directives, `ranked` has the load
    times of the ranking that chose the instance (a router keeps both)."""
    grouping = grouping or Grouping.of(result)
    if not grouping.of_block:
        return None
    sources = (ranked.sources(grouping.groups, instance)
               if ranked is not None and instance is not None else None)
    if sources is None:
        sources = []
        links = links_of(instance) if instance is not None else None
        for g in grouping.groups:
            order = (sorted(range(len(g.replicas)),
                            key=lambda j: load_us(links, g.replicas[j], g.profiles[j]))
                     if links is not None else range(len(g.replicas)))
            sources.append(tuple(dict.fromkeys(g.replicas[j].holder for j in order)))
    if reuse is not None:
        blocks = reuse.blocks(result, grouping.of_block, sources, grouping.runs)
    else:
        blocks = tuple(PrefetchBlock(b.block_key, sources[gi])
                       for b, gi in zip(result.blocks, grouping.of_block) if sources[gi])
    if not blocks:
        return None
    return PrefetchDirective(
        directive=directive or str(uuid.uuid4()), scope_id=request.scope_id,
        compat_id=request.compat_id, blocks=blocks,
        deadline_ms=settings.prefetch_deadline_ms, lease_ms=settings.lease_ms,
        request_ref=request_ref or request.request_ref)


class PrefetchBlocks:
    """Directive block entries by sources and block key, kept between routes. A prefix routed
    again with the same sources (a shared system prompt, a session's next turn) gets the same
    immutable entries back instead of one new record per block, which for a long prompt cost
    more than ranking it."""

    LIMIT = 1 << 18
    """Entries kept before they are all dropped."""

    def __init__(self) -> None:
        self._by_sources: dict[tuple[str, ...], dict[str, PrefetchBlock]] = {}
        self._count = 0

    def blocks(self, result: LookupResult, of_block: Sequence[int],
               sources: Sequence[tuple[str, ...]], runs: Sequence[int] | None = None
               ) -> tuple[PrefetchBlock, ...]:
        """The entries of the matched blocks (group `of_block[i]` loads from
        `sources[of_block[i]]`), blocks without a source left out. `runs`: where each run of
        blocks of one group starts (a prompt's blocks come in spans held alike)."""
        if self._count > self.LIMIT:
            self._by_sources.clear()
            self._count = 0
        tables = [self._by_sources.setdefault(s, {}) for s in sources]
        if all(sources):
            try:  # every entry built before: C-level lookups only
                n = len(of_block)
                if runs is not None and len(runs) * 16 <= n:
                    in_order = list(map(_block_key, result.blocks[:n]))
                    found: list[PrefetchBlock] = []
                    for a, b in zip(runs, (*runs[1:], n)):
                        found += map(tables[of_block[a]].__getitem__, in_order[a:b])
                    return tuple(found)
                return tuple(map(dict.__getitem__, map(tables.__getitem__, of_block),
                                 map(_block_key, result.blocks)))
            except KeyError:
                pass
        keys = map(_block_key, result.blocks)
        out = []
        for key, gi in zip(keys, of_block):
            src = sources[gi]
            if not src:
                continue
            table = tables[gi]
            entry = table.get(key)
            if entry is None:
                entry = table[key] = PrefetchBlock(key, src)
                self._count += 1
            out.append(entry)
        return tuple(out)


_block_key = operator.attrgetter("block_key")


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
    its own, tests and benchmarks): matched stops at the first key without a replica.

    Each key's answer is kept as a ready `LookupBlock` (rebuilt when a replica is added), so
    a lookup is a C-level pass over the keys, and hands out the same block objects each time:
    what ranking computes once per block (`LookupBlock.shape`) stays computed."""

    def __init__(self) -> None:
        self._spaces: dict[tuple[str, str], dict[str, LookupBlock]] = {}

    def add(self, record: ReplicaRecord) -> None:
        space = self._spaces.setdefault((record.compat_id, record.scope_id), {})
        old = space.get(record.block_key)
        space[record.block_key] = LookupBlock(
            record.block_key, (old.replicas if old is not None else ()) + (record,))

    async def lookup(self, req: LookupRequest) -> LookupResult:
        space = self._spaces.get((req.compat_id, req.scope_id))
        if space is None:
            return LookupResult(0, ())
        found = itertools.takewhile(_is_block, map(space.get, req.block_keys))
        blocks = cast("tuple[LookupBlock, ...]", tuple(found))  # None ends takewhile
        return LookupResult(len(blocks), blocks)


_is_block = functools.partial(operator.is_not, None)


class Router:
    """Places requests on active instances and tells them what to prefetch first."""

    def __init__(self, registry: InstanceRegistry, lookup: LookupFn, send_prefetch: PrefetchSender,
                 settings: PlacementSettings | None = None, *, keys: ScopeKeys | None = None,
                 start_hook: StartHook | None = None, reference: bool = False) -> None:
        """`reference` ranks and builds directives with the reference implementation (see
        `pc.ranking`), keeping nothing between routes: what benchmarks and tests compare to."""
        self.registry = registry
        self.lookup = lookup
        self.send_prefetch = send_prefetch
        self.settings = settings or PlacementSettings()
        self.keys = keys or ScopeKeys()
        self.start_hook = start_hook
        self.reference = reference
        self._links = LinkArrays()
        self._prefetch_blocks = None if reference else PrefetchBlocks()

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
        grouping = Grouping.by_signature(result) if self.reference else Grouping.of(result)
        ranked = rank(result, actives, token_count=request.token_count,
                      block_tokens=request.block_tokens,
                      mean_service_tokens=self.settings.mean_service_tokens, grouping=grouping,
                      links=self._links, reference=self.reference)
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
                                      grouping=grouping, reuse=self._prefetch_blocks,
                                      ranked=None if self.reference else self._links)
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
