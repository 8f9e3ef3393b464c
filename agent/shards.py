"""Sequence-sharded contexts held here and their resharding (KVSP §6.9).

For long contexts a parallel group splits one context by token range across instances, as the
PC's Shard Map says. `ShardKeeper` holds this instance's ranges of each map (the K and V of every
layer for tokens [a, b)), seeds them by computing the context (`PUT {ii}shards/{map}`), serves
them to other instances (`GET {ii}kv?map=M&tokens=a-b`), and moves them between map versions by
the PC's reshard plan, commit and abort (`POST {ii}reshard`).

A map belongs to one scope (the seed's "scope_id", else the agent's default scope; a plan's for
a member new to the map): its ranges and status go only to principals of that scope, and a seed
or plan of another scope under the same name is refused (docs/authorization.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import torch

from agent.model import ModelAdapter
from agent.pool import block_container, tensor_from_octets
from kvsp_moq.auth import OPEN, Principal
from kvsp_moq.errors import (
    BadRecord,
    DigestMismatch,
    ForbiddenScope,
    KvspError,
    NotFound,
    StaleEpoch,
    TransportError,
)
from kvsp_moq.fetch.http import parse_repr_digest
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReshardDecision, ReshardPlan, parse_reshard

#: a half-open token range [start, end)
Range = tuple[int, int]


@dataclass
class _Shards:
    version: int
    held: dict[Range, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    pending: dict[Range, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    pending_to: int | None = None
    plan: ReshardPlan | None = None
    last: dict[str, Any] = field(default_factory=dict)
    scope_id: str | None = None


class ShardKeeper:
    """Token ranges of sequence-sharded contexts held here, and their moves between versions.

    A plan's "fetch" ranges are read from the named instance with
    `GET {ii}kv?map=M&tokens=a-b` (a KVB1 container of every layer of tokens [a, b), with
    Repr-Digest) and kept aside until commit; "retain" ranges stay where they are and are never
    transferred; commit installs the fetched ranges and drops the "release" ones; abort drops
    what was fetched. `PUT {ii}shards/{map}` seeds the ranges of a context by computing it.
    """

    def __init__(self, adapter: ModelAdapter, model: Callable[..., Any], client: httpx.AsyncClient,
                 *, token: str | None = None, default_scope_id: str | None = None) -> None:
        self.adapter = adapter
        self.model = model
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.default_scope_id = default_scope_id
        self.maps: dict[str, _Shards] = {}

    def shards_for(self, name: str, who: Principal) -> _Shards:
        """The map's shards here, once `who` is found to hold its scope."""
        shards = self.maps.get(name)
        if shards is None:
            raise NotFound(f"no shards of map {name!r} here")
        who.require_resource_scope(shards.scope_id)
        return shards

    def _claim(self, name: str, scope_id: str | None) -> None:
        """Refuse a seed or plan that would put a map of another scope under this name."""
        shards = self.maps.get(name)
        if shards is not None and scope_id is not None and shards.scope_id not in (None, scope_id):
            raise ForbiddenScope(f"map {name!r} here belongs to another scope", member="scope_id")

    async def seed(self, name: str, body: Any, who: Principal = OPEN) -> dict[str, Any]:
        """PUT {ii}shards/{map}: compute the given ranges of a context of `who`'s scope."""
        body = v.obj(body, "body")
        scope = body.get("scope_id")
        scope_id = v.hexn(scope, 16, "scope_id") if scope is not None else self.default_scope_id
        who.require_resource_scope(scope_id)
        self._claim(name, scope_id)
        version = v.integer(v.required(body, "version"), "version")
        tokens = v.tokens(v.required(body, "tokens"), "tokens")
        listed = v.array(v.required(body, "ranges"), "ranges", lambda x, m: x)
        ranges = [_range(r, f"ranges[{i}]") for i, r in enumerate(listed)]
        end = max((b for _, b in ranges), default=0)
        if not tokens or end > len(tokens):
            raise BadRecord("ranges must lie within the tokens", member="ranges")

        def compute() -> dict[Range, list]:
            if not ranges:
                return {}
            result = self.adapter.prefill(tokens[:end], return_kv=False)
            return {(a, b): self.adapter.kv_for_range(result.state, a, b) for a, b in ranges}

        held = await self.model(compute)
        self.maps[name] = _Shards(version, held, scope_id=scope_id)
        return self.status(name)

    def container(self, name: str, a: int, b: int, who: Principal) -> bytes:
        shards = self.shards_for(name, who)
        for (x, y), kv in shards.held.items():
            if x <= a and b <= y:
                return block_container([(k[a - x:b - x], vv[a - x:b - x]) for k, vv in kv])
        raise NotFound(f"tokens {a}-{b} of map {name!r} are not held here")

    async def handle(self, body: Any, who: Principal = OPEN) -> tuple[int, dict[str, Any]]:
        """POST {ii}reshard: a plan, commit or abort, from `who`, who must hold the map's scope."""
        msg = parse_reshard(body)
        known = self.maps.get(msg.map)
        who.require_resource_scope(known.scope_id if known is not None
                                   else getattr(msg, "scope_id", None))
        if isinstance(msg, ReshardDecision):
            return 200, self._decide(msg)
        return await self._plan(msg)

    async def _plan(self, plan: ReshardPlan) -> tuple[int, dict[str, Any]]:
        self._claim(plan.map, plan.scope_id)
        shards = self.maps.setdefault(plan.map, _Shards(plan.from_version, scope_id=plan.scope_id))
        if shards.version != plan.from_version:
            raise StaleEpoch(f"map {plan.map!r} is at version {shards.version} here, "
                             f"not {plan.from_version}", member="from")
        missing = [r for r in plan.retain if not self._covered(shards, r)]
        fetched: list[dict[str, Any]] = []

        async def one(fetch: Any) -> None:
            a, b = fetch.tokens
            kv, octets = await self._fetch(fetch.source, plan.map, a, b)
            shards.pending[(a, b)] = kv
            fetched.append({"tokens": [a, b], "from": fetch.source, "bytes": octets})

        shards.pending = {}
        shards.pending_to = plan.to_version
        shards.plan = plan
        started = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(f) for f in plan.fetch)),
                                   plan.deadline_ms / 1000)
            state, status = "acknowledged", 200
        except (asyncio.TimeoutError, TimeoutError):
            state, status = "timed-out", 504
        except KvspError as e:
            state, status = f"failed: {e.detail}", 502
        shards.last = {"from": plan.from_version, "to": plan.to_version, "state": state,
                       "fetched": sorted(fetched, key=lambda f: f["tokens"]),
                       "retained": [list(r) for r in plan.retain],
                       "retained_missing": [list(r) for r in missing],
                       "release": [list(r) for r in plan.release],
                       "transferred_bytes": sum(f["bytes"] for f in fetched),
                       "seconds": round(time.perf_counter() - started, 6)}
        return status, self.status(plan.map)

    def _covered(self, shards: _Shards, r: Range) -> bool:
        return any(x <= r[0] and r[1] <= y for x, y in shards.held)

    def _decide(self, d: ReshardDecision) -> dict[str, Any]:
        shards = self.maps.get(d.map)
        if shards is None:
            raise NotFound(f"no shards of map {d.map!r} here")
        if d.kind == "commit":
            if shards.version == d.version:
                return self.status(d.map)  # delivered twice
            if shards.pending_to != d.version or shards.plan is None:
                raise StaleEpoch(f"no plan towards version {d.version} here", member="commit")
            for r in shards.plan.release:
                _drop_range(shards.held, r)
            shards.held.update(shards.pending)
            shards.version = d.version
            shards.last["state"] = "committed"
        else:
            if shards.pending_to == d.version:
                shards.last["state"] = "aborted"
        shards.pending = {}
        shards.pending_to = None
        shards.plan = None
        return self.status(d.map)

    async def _fetch(self, source: str, name: str, a: int, b: int) -> tuple[list, int]:
        url = f"{source.rstrip('/')}/kv"
        try:
            r = await self.client.get(url, params={"map": name, "tokens": f"{a}-{b}"},
                                      headers=self.headers)
        except httpx.HTTPError as e:
            raise TransportError(f"{url}: {type(e).__name__} {e}") from None
        raise_for_problem(r)
        body = r.content
        expected = parse_repr_digest(r.headers.get("repr-digest"))
        if expected is None or hashlib.sha256(body).digest() != expected:
            raise DigestMismatch(f"tokens {a}-{b} from {source}: Repr-Digest missing or wrong")
        c = Container(body)
        ad = self.adapter
        if c.token_count != b - a or c.layer_count != ad.num_layers or c.first_layer != 0:
            raise BadRecord(f"tokens {a}-{b} from {source}: wrong geometry", member="body")
        shape = (b - a, ad.num_kv_heads, ad.head_dim)
        kv = []
        for layer in c.layers():
            k = tensor_from_octets(layer.k, ad.dtype).view(shape).clone()
            vv = tensor_from_octets(layer.v, ad.dtype).view(shape).clone()
            kv.append((k, vv))
        return kv, len(body)

    def status(self, name: str, who: Principal | None = None) -> dict[str, Any]:
        """GET {ii}reshard/{map}; `who` is checked against the map's scope (None: the agent's
        own answer to a request already authorized)."""
        shards = self.maps.get(name)
        if shards is None:
            raise NotFound(f"no shards of map {name!r} here")
        if who is not None:
            who.require_resource_scope(shards.scope_id)
        return {"map": name, "version": shards.version,
                "ranges": sorted([list(r) for r in shards.held]),
                "pending": sorted([list(r) for r in shards.pending]),
                "pending_to": shards.pending_to, "last": shards.last}


def _range(value: Any, member: str) -> Range:
    a, b = v.pair(value, member)
    if a >= b:
        raise BadRecord("a half-open token range needs start < end", member=member)
    return a, b


def _drop_range(held: dict[Range, list], r: Range) -> None:
    """Remove tokens [r) from the held ranges, keeping what lies outside it."""
    for (x, y) in list(held):
        if y <= r[0] or x >= r[1]:
            continue
        kv = held.pop((x, y))
        if x < r[0]:
            held[(x, r[0])] = [(k[:r[0] - x].clone(), vv[:r[0] - x].clone()) for k, vv in kv]
        if r[1] < y:
            held[(r[1], y)] = [(k[r[1] - x:].clone(), vv[r[1] - x:].clone()) for k, vv in kv]



__all__ = ["Range", "ShardKeeper"]
