"""The Index Service over HTTP (KVSP §6.1, §6.2; resources of DESIGN §3).

`create_app(settings)` serves:

- `PUT|DELETE /replicas/{compat}/{scope}/{block_key}/{replica_id}`: publish, refresh or
  withdraw one Replica Record;
- `POST /replicas:batch`: publish or refresh up to `batch_limit` records, all or none;
- `POST /lookup`: the leading matched keys, their replicas and, on request, per-target
  estimates (§6.4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Mapping, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from index.store import (
    InstanceDirectory,
    LookupHits,
    MemoryInstanceDirectory,
    MemoryReplicaStore,
    ReplicaStore,
    ReplicaSummary,
)
from kvsp_moq.auth import Action, Authenticator, Principal
from kvsp_moq.errors import BadRecord, ForbiddenScope, NotFound
from kvsp_moq.index_client import BATCH_LIMIT
from kvsp_moq.protocol import cost
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.records import InstanceStatus, ReplicaRecord, replica_id
from kvsp_moq.tasks import cancel_and_wait
from kvsp_moq.web import KVSP_JSON, build_app, json_response, principal, read_json

log = logging.getLogger("kvsp.index")


@dataclass
class IndexSettings:
    """Everything the Index Service depends on, passed in rather than read from globals."""

    store: ReplicaStore = field(default_factory=MemoryReplicaStore)
    auth: Authenticator = field(default_factory=Authenticator.open)
    #: instance status for lookup targets; the Placement Controller fills it
    instances: InstanceDirectory = field(default_factory=MemoryInstanceDirectory)
    #: compat_id -> block_tokens, to turn matched blocks into tokens for recompute_us
    block_tokens: Mapping[str, int] = field(default_factory=dict)
    #: block size assumed for a compat_id missing from `block_tokens`; None: no estimates
    default_block_tokens: int | None = None
    max_ttl_ms: int = 600_000
    #: seconds on a monotonic clock; tests inject their own to move time
    clock: Callable[[], float] = time.monotonic
    batch_limit: int = BATCH_LIMIT
    max_lookup_keys: int = 65_536
    max_record_bytes: int = 1 << 20
    #: the largest batch or lookup body; refused (413) from its Content-Length, or as it streams
    max_body_bytes: int = 16 << 20
    #: seconds between sweeps of expired records; None leaves sweeping to the caller
    sweep_interval_s: float | None = 1.0
    sweep_budget: int = 10_000


def may_publish(who: Principal, holder: str, http_holder: str | None) -> bool:
    """A MOQT replica's publisher is its HTTP holder behind the relay (§4.4, DESIGN §4)."""
    if who.may_publish_for(holder):
        return True
    return (holder.lower().startswith("moqt://") and http_holder is not None
            and who.may_publish_for(http_holder))


def require_publisher(who: Principal, holder: str, http_holder: str | None,
                      member: str | None = None) -> None:
    if not may_publish(who, holder, http_holder):
        raise ForbiddenScope(f"principal {who.name!r} may not publish for holder {holder}",
                             member=member)


def _prefixed(err: BadRecord, prefix: str) -> BadRecord:
    """The same refusal, naming the member inside a batch (`records[3].digest`)."""
    if err.member and err.member != "record":
        detail = err.detail if err.detail.startswith(err.member) else f"{err.member}: {err.detail}"
        return BadRecord(f"{prefix}.{detail}", member=f"{prefix}.{err.member}")
    return BadRecord(err.detail.removeprefix("record: "), member=prefix)


def _block_keys(value: Any, limit: int) -> list[str]:
    """Block keys as lowercase hex; checked in bulk first, since lookups carry thousands."""
    if not isinstance(value, list):
        raise BadRecord("must be an array", member="block_keys")
    if len(value) > limit:
        raise BadRecord(f"must have at most {limit} items", member="block_keys")
    try:
        joined = "".join(value)
        # Every item 64 characters and the whole valid hex (so no whitespace either).
        if (set(map(len, value)) <= {64} and len(bytes.fromhex(joined)) == 32 * len(value)
                and joined.lower() == joined):
            return value
    except (TypeError, ValueError):
        pass
    return [v.hexn(k, 32, f"block_keys[{i}]") for i, k in enumerate(value)]


def plan_fetch_us(status: InstanceStatus, instance: str,
                  blocks: Sequence[Sequence[ReplicaSummary]]) -> float:
    """§6.4 fetch_us for loading `blocks` into `instance`, each from its fastest replica.

    Blocks with a replica at the instance itself are resident and cost nothing. The result
    equals `cost.fetch_us(status, plan)` for the chosen plan; it is computed per distinct
    replica summary (records of one holder share one) so that thousands of blocks cost a few
    estimates, not thousands.
    """
    # Stores share one summary object per distinct value, so identity is a cheap key.
    alone: dict[int, tuple[float, float]] = {}  # id(summary) -> (fetch_us alone, rtt)
    load: dict[int, tuple[ReplicaSummary, int]] = {}
    for replicas in blocks:
        best: ReplicaSummary | None = None
        best_us = math.inf
        for s in replicas:
            t = alone.get(id(s))
            if t is None:
                if cost.resides_at(instance, s):
                    t = (-1.0, 0.0)
                else:
                    record = s.cost_record
                    rate, rtt = cost.source_rate(status, record)
                    t = (rtt + cost.bytes_us(cost.tier_octets(record), rate), rtt)
                alone[id(s)] = t
            if t[0] < 0:  # resident at the instance
                best = None
                break
            if t[0] < best_us:
                best, best_us = s, t[0]
        if best is not None:
            n = load.get(id(best), (best, 0))[1]
            load[id(best)] = (best, n + 1)
    # A replica's fetch_us alone less its rtt is its bytes' share; n of them add up.
    return cost.combine_sources((s.holder, n * (alone[key][0] - alone[key][1]), alone[key][1])
                                for key, (s, n) in load.items())


def estimate_targets(targets: Sequence[str], hits: LookupHits, block_tokens: int | None,
                     instances: InstanceDirectory, scope_id: str) -> list[dict]:
    """Estimates for the targets that serve the scope, whose status is known and whose
    prefill rate is measured."""
    if block_tokens is None or hits.summaries is None:
        return []
    tokens = hits.matched * block_tokens
    out = []
    for url in targets:
        status = instances.get(url)
        if (status is None or status.prefill_tokens_per_s <= 0
                or not instances.serves(url, scope_id)):
            continue
        recompute = cost.recompute_us(tokens, status.prefill_tokens_per_s)
        out.append(cost.Estimate(
            instance=url, fetch_us=plan_fetch_us(status, url, hits.summaries),
            recompute_us=recompute, wait_us=0.0, matched_tokens=tokens, total_tokens=tokens,
            recompute_all_us=recompute,
        ).to_json())
    return out


def lookup_pieces(hits: LookupHits, targets: list[dict] | None,
                  piece_bytes: int = 1 << 20) -> tuple[int, Iterator[bytes]]:
    """The lookup response (DESIGN §6): its length, and its octets in pieces of about
    `piece_bytes`, the stored elements spliced in as they are.

    Joining a piece is the only copy of the records' octets a response makes; handing each
    piece to the socket as soon as it is made lets the copy of the next overlap the
    transmission of the last.
    """
    head = b'{"matched":%d,"blocks":[' % hits.matched
    tail = b"]}"
    if targets is not None:
        tail = b'],"targets":' + json.dumps(targets, separators=(",", ":")).encode() + b"}"
    blocks = hits.blocks
    sizes = list(map(len, blocks))
    total = len(head) + sum(sizes) + max(0, len(blocks) - 1) + len(tail)

    def pieces() -> Iterator[bytes]:
        if not blocks:
            yield head + tail
            return
        start, n = 0, len(blocks)
        while start < n:
            end, size = start, 0
            while end < n and size < piece_bytes:
                size += sizes[end]
                end += 1
            parts = list(blocks[start:end])
            parts[0] = (head if start == 0 else b",") + parts[0]
            if end == n:
                parts[-1] = parts[-1] + tail
            yield b",".join(parts)
            start = end

    return total, pieces()


class LookupResponse(Response):
    """A lookup answer with a known length, sent piece by piece (see `lookup_pieces`)."""

    media_type = KVSP_JSON

    def __init__(self, hits: LookupHits, targets: list[dict] | None) -> None:
        length, self.pieces = lookup_pieces(hits, targets)
        super().__init__(None, headers={"content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for piece in self.pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class IndexService:
    """The request handlers, bound to one `IndexSettings`."""

    def __init__(self, settings: IndexSettings) -> None:
        self.settings = settings
        self.counters: dict[str, int] = defaultdict(int)
        self._sweeper: asyncio.Task | None = None

    # -------------------------------------------------------------- publishing (§6.1)

    def _grant(self, record: ReplicaRecord) -> tuple[ReplicaRecord, bool]:
        """The record with its ttl_ms capped at the configured maximum."""
        if record.ttl_ms <= self.settings.max_ttl_ms:
            return record, False
        return dataclasses.replace(record, ttl_ms=self.settings.max_ttl_ms), True

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    async def put_replica(self, request: Request) -> Response:
        who = principal(request, Action.PUBLISH_REPLICAS)
        compat, scope, key, rid = _path_ids(request.path_params)
        record = ReplicaRecord.from_json(
            await read_json(request, max_bytes=self.settings.max_record_bytes))
        for member, got, want in (("compat_id", record.compat_id, compat),
                                  ("scope_id", record.scope_id, scope),
                                  ("block_key", record.block_key, key)):
            if got != want:
                raise BadRecord(f"is {got} but the path names {want}", member=member)
        expected = replica_id(record.holder, record.moqt_namespace)
        if rid != expected:
            raise BadRecord(f"must be replica_id(holder, moqt_namespace) = {expected}",
                            member="replica_id")
        require_publisher(who, record.holder, record.http_holder)
        who.require_scope(record.scope_id)
        record, capped = self._grant(record)
        created = await self.settings.store.put(record, self.settings.clock())
        self._count("replicas_put_total")
        self._count("ttl_capped_total", capped)
        return json_response({"replica_id": rid, "ttl_ms": record.ttl_ms},
                             status=201 if created else 200)

    async def delete_replica(self, request: Request) -> Response:
        who = principal(request, Action.PUBLISH_REPLICAS)
        compat, scope, key, rid = _path_ids(request.path_params)
        # The scope first: a client outside it learns nothing about what the index holds.
        who.require_scope(scope)
        store, now = self.settings.store, self.settings.clock()
        held = await store.get(compat, scope, key, rid, now)
        if held is None:
            raise NotFound("no unexpired replica with this identity")
        require_publisher(who, held.summary.holder, held.summary.http_holder)
        await store.delete(compat, scope, key, rid, now)
        self._count("replicas_deleted_total")
        return Response(status_code=204)

    async def put_batch(self, request: Request) -> Response:
        who = principal(request, Action.PUBLISH_REPLICAS)
        data = v.obj(await read_json(request, max_bytes=self.settings.max_body_bytes), "body")
        items = v.required(data, "records")
        if not isinstance(items, list):
            raise BadRecord("must be an array", member="records")
        limit = self.settings.batch_limit
        if len(items) > limit:
            raise BadRecord(f"must have at most {limit} items", member="records")
        records = []
        capped = 0
        # Validate and authorize everything before storing anything: all or none.
        for i, item in enumerate(items):
            try:
                record = ReplicaRecord.from_json(item)
            except BadRecord as e:
                raise _prefixed(e, f"records[{i}]") from None
            require_publisher(who, record.holder, record.http_holder, member=f"records[{i}]")
            if not who.may_use_scope(record.scope_id):
                raise ForbiddenScope(f"principal {who.name!r} is not authorized for the scope "
                                     f"of records[{i}]", member=f"records[{i}].scope_id")
            record, was_capped = self._grant(record)
            capped += was_capped
            records.append(record)
        created = await self.settings.store.put_many(records, self.settings.clock())
        self._count("replicas_put_total", len(records))
        self._count("ttl_capped_total", capped)
        return json_response({"created": created, "refreshed": len(records) - created,
                              "ttl_capped": capped, "max_ttl_ms": self.settings.max_ttl_ms})

    # -------------------------------------------------------------- lookup (§6.2)

    async def lookup(self, request: Request) -> Response:
        who = principal(request, Action.LOOKUP)
        data = v.obj(await read_json(request, max_bytes=self.settings.max_body_bytes))
        scope = v.hexn(v.required(data, "scope_id"), 16, "scope_id")
        compat = v.hexn(v.required(data, "compat_id"), 32, "compat_id")
        keys = _block_keys(v.required(data, "block_keys"), self.settings.max_lookup_keys)
        targets = data.get("targets")
        if targets is not None:
            targets = v.array(targets, "targets", v.url, max_len=4096)
        # Refused before the store is read, so the answer cannot depend on what it holds.
        who.require_scope(scope)
        settings = self.settings
        hits = await settings.store.lookup(compat, scope, keys, settings.clock(),
                                           summaries=bool(targets))
        estimates = None
        if targets is not None:
            estimates = estimate_targets(
                targets, hits, settings.block_tokens.get(compat, settings.default_block_tokens),
                settings.instances, scope) if targets else []
        self._count("lookups_total")
        self._count("lookup_keys_total", len(keys))
        self._count("lookup_matched_total", hits.matched)
        return LookupResponse(hits, estimates)

    # -------------------------------------------------------------- expiry

    async def _sweep_forever(self, interval: float) -> None:
        store, clock, budget = self.settings.store, self.settings.clock, self.settings.sweep_budget
        while True:
            await asyncio.sleep(interval)
            try:
                # Bounded steps with a yield between them, so lookups never wait long.
                while await store.sweep(clock(), budget=budget):
                    await asyncio.sleep(0)
            except Exception:  # keep sweeping whatever one step did
                log.exception("sweeping expired replica records failed")

    async def start(self) -> None:
        if self.settings.sweep_interval_s is not None:
            self._sweeper = asyncio.create_task(self._sweep_forever(self.settings.sweep_interval_s))

    async def stop(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        await cancel_and_wait(sweeper)


def _path_ids(params: Mapping[str, str]) -> tuple[str, str, str, str]:
    return (v.hexn(params["compat"], 32, "compat_id"), v.hexn(params["scope"], 16, "scope_id"),
            v.hexn(params["block_key"], 32, "block_key"),
            v.hexn(params["replica_id"], 16, "replica_id"))


def create_app(settings: IndexSettings | None = None, *, extra_routes: Sequence[BaseRoute] = (),
               on_startup: Sequence[Callable[[], Awaitable[None]]] = (),
               on_shutdown: Sequence[Callable[[], Awaitable[None]]] = ()) -> Starlette:
    """The Index Service app; `app.state.index` is the `IndexService` behind it.

    `extra_routes` and the hooks let the Placement Controller share the process and port.
    """
    settings = settings or IndexSettings()
    service = IndexService(settings)
    routes = [
        Route("/replicas/{compat}/{scope}/{block_key}/{replica_id}", service.put_replica,
              methods=["PUT"]),
        Route("/replicas/{compat}/{scope}/{block_key}/{replica_id}", service.delete_replica,
              methods=["DELETE"]),
        Route("/replicas:batch", service.put_batch, methods=["POST"]),
        Route("/lookup", service.lookup, methods=["POST"]),
        *extra_routes,
    ]
    app = build_app(routes, name="kvsp_index", auth=settings.auth,
                    on_startup=[service.start, *on_startup],
                    on_shutdown=[*on_shutdown, service.stop],
                    state={"index": service, "settings": settings},
                    openapi="index+pc" if extra_routes else "index")
    metrics = app.state.metrics
    service.counters = metrics.counters
    for name in ("replicas_put_total", "replicas_deleted_total", "ttl_capped_total",
                 "lookups_total", "lookup_keys_total", "lookup_matched_total"):
        metrics.counters[name] += 0
    metrics.gauges["replica_records"] = lambda: settings.store.records
    return app
