"""Resharding of sequence-sharded caches, PC side (KVSP §6.9).

`plan_reshard` is pure: two Shard Maps in, one plan per member out. A range that stays on the
same instance is retained and never fetched, which is the point of §6.9: a change of
parallelism costs no transfer for it. `Resharder` does the two phases over HTTP: plans to every
member of either version, then commit when all acknowledged within the deadline, else abort.

Bodies of `POST {ii}reshard`: the plan of §6.9 (`{"map", "from", "to", "deadline_ms",
"retain", "fetch", "release"}`), then `{"map": ..., "commit": v+1}` or
`{"map": ..., "abort": v+1}`. Only a 200 to the plan counts as an acknowledgement.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Protocol, Sequence

from kvsp_moq.errors import BadRecord, KvspError
from kvsp_moq.protocol.records import RangeFetch, ReshardDecision, ReshardPlan, ShardMap
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.pc.reshard")

Range = tuple[int, int]


# --------------------------------------------------------------------------- half-open ranges


def merge(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, with touching or overlapping ranges joined."""
    out: list[Range] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: Iterable[Range], ys: Iterable[Range]) -> list[Range]:
    out = []
    ys = merge(ys)
    for a, b in merge(xs):
        for c, d in ys:
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append((lo, hi))
    return merge(out)


def subtract(xs: Iterable[Range], ys: Iterable[Range]) -> list[Range]:
    out = []
    ys = merge(ys)
    for a, b in merge(xs):
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


# --------------------------------------------------------------------------- plans (pure)


def members(*maps: ShardMap) -> list[str]:
    """Every instance of the given versions, in order of first appearance."""
    return list(dict.fromkeys(base_url(s.instance) for m in maps for s in m.shards))


def _ranges(m: ShardMap, instance: str) -> list[Range]:
    return merge(s.tokens for s in m.shards if base_url(s.instance) == instance)


def plan_reshard(current: ShardMap, target: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """One plan per member of either version (§6.9).

    retain  = ranges the instance holds in both versions;
    fetch   = ranges it gains, split by the instance holding them in `current` (tokens that no
              one holds yet, e.g. a grown context, are computed, not fetched);
    release = ranges it holds in `current` and not in `target`.
    """
    if target.map != current.map:
        raise BadRecord(f"reshards map {current.map!r}, not {target.map!r}", member="map")
    if current.scope_id is not None and target.scope_id not in (None, current.scope_id):
        raise BadRecord("a shard map keeps the scope it was installed with", member="scope_id")
    if target.version != current.version + 1:
        raise BadRecord(f"must be {current.version + 1} (the current version is "
                        f"{current.version})", member="version")
    if deadline_ms < 1:
        raise BadRecord("must be positive", member="deadline_ms")
    owners = [(s.tokens, base_url(s.instance)) for s in current.shards]
    plans: dict[str, ReshardPlan] = {}
    for inst in members(current, target):
        old, new = _ranges(current, inst), _ranges(target, inst)
        fetch: list[RangeFetch] = []
        for seg in subtract(new, old):
            pieces = [(r, src) for tokens, src in owners if src != inst
                      for r in intersect([seg], [tokens])]
            for r, src in sorted(pieces):
                if fetch and fetch[-1].source == src and fetch[-1].tokens[1] == r[0]:
                    fetch[-1] = RangeFetch((fetch[-1].tokens[0], r[1]), src)
                else:
                    fetch.append(RangeFetch(r, src))
        plans[inst] = ReshardPlan(current.map, current.version, target.version, deadline_ms,
                                  retain=tuple(intersect(old, new)), fetch=tuple(fetch),
                                  release=tuple(subtract(old, new)),
                                  scope_id=target.scope_id or current.scope_id)
    return plans


# --------------------------------------------------------------------------- storage


class ShardMapStore:
    """The authoritative version of each Shard Map; in SQLite when given a connection."""

    def __init__(self, db: sqlite3.Connection | None = None) -> None:
        self.db = db
        self._lock = threading.Lock()
        self._maps: dict[str, ShardMap] = {}
        self._pending: dict[str, PendingReshard] = {}
        if db is not None:
            db.execute("CREATE TABLE IF NOT EXISTS shardmaps (map TEXT PRIMARY KEY, "
                       "version INTEGER NOT NULL, body TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS reshards (map TEXT PRIMARY KEY, "
                       "body TEXT NOT NULL)")
            for (body,) in db.execute("SELECT body FROM reshards").fetchall():
                p = PendingReshard.from_json(json.loads(body))
                self._pending[p.map] = p
            for (body,) in db.execute("SELECT body FROM shardmaps").fetchall():
                m = ShardMap.from_json(json.loads(body))
                self._maps[m.map] = m

    def get(self, name: str) -> ShardMap | None:
        with self._lock:
            return self._maps.get(name)

    def put(self, m: ShardMap) -> None:
        with self._lock:
            if self.db is not None:
                self.db.execute(
                    "INSERT INTO shardmaps (map, version, body) VALUES (?, ?, ?) "
                    "ON CONFLICT (map) DO UPDATE SET version = excluded.version, "
                    "body = excluded.body",
                    (m.map, m.version, json.dumps(m.to_json(), separators=(",", ":"))))
            self._maps[m.map] = m

    def begin(self, pending: PendingReshard) -> None:
        with self._lock:
            if self.db is not None:
                self.db.execute("INSERT INTO reshards (map, body) VALUES (?, ?) ON CONFLICT (map) "
                                "DO UPDATE SET body = excluded.body",
                                (pending.map, json.dumps(pending.to_json())))
            self._pending[pending.map] = pending

    def end(self, name: str) -> None:
        with self._lock:
            if self.db is not None:
                self.db.execute("DELETE FROM reshards WHERE map = ?", (name,))
            self._pending.pop(name, None)

    def abandoned(self, now: float) -> list[PendingReshard]:
        with self._lock:
            return [p for p in self._pending.values() if p.decide_by < now]


@dataclass(frozen=True)
class PendingReshard:
    """A reshard between its plans and its decision, kept in the store: if the PC running it
    dies, the PC doing the duties finishes it once `decide_by` (wall clock) has passed, with
    commit when v+1 was installed already, else abort (`Resharder.finish_abandoned`)."""

    map: str
    to_version: int
    members: tuple[str, ...]
    decide_by: float

    def to_json(self) -> dict:
        return {"map": self.map, "to": self.to_version, "members": list(self.members),
                "decide_by": self.decide_by}

    @classmethod
    def from_json(cls, data: dict) -> "PendingReshard":
        return cls(str(data["map"]), int(data["to"]), tuple(data["members"]),
                   float(data["decide_by"]))


class ShardMaps(Protocol):
    """Where the PC keeps Shard Maps: `ShardMapStore` or `pc.redis_state`'s (Redis)."""

    def get(self, name: str) -> ShardMap | None: ...

    def put(self, m: ShardMap) -> None: ...

    def begin(self, pending: PendingReshard) -> None: ...

    def end(self, name: str) -> None: ...

    def abandoned(self, now: float) -> list[PendingReshard]: ...


# --------------------------------------------------------------------------- two phases (I/O)

#: POST {ii}reshard with a body and a timeout in seconds; returns the HTTP status, raises
#: KvspError when the instance cannot be reached.
ReshardSender = Callable[[str, dict, float], Awaitable[int]]


@dataclass(frozen=True)
class ReshardSettings:
    deadline_ms: int = 200
    """How long members have to load their fetch ranges and answer 200 (§6.9)."""
    decision_attempts: int = 3
    """Tries to deliver commit or abort to each member."""
    decision_timeout_s: float = 2.0
    abandoned_after_s: float = 30.0
    """After its deadline, how long a reshard may wait for its decision before the PC doing
    the duties takes it for abandoned (its PC died) and finishes it."""


@dataclass(frozen=True)
class ReshardOutcome:
    map: str
    from_version: int
    to_version: int
    committed: bool
    plans: dict[str, ReshardPlan]
    acks: dict[str, str]
    """Per member: "ok", "status N", "timeout" or the error."""
    delivered: dict[str, bool] = field(default_factory=dict)
    """Per member: whether the commit or abort reached it."""

    def to_json(self) -> dict:
        return {"map": self.map, "from": self.from_version, "to": self.to_version,
                "committed": self.committed,
                "version": self.to_version if self.committed else self.from_version,
                "plans": {i: p.to_json() for i, p in self.plans.items()},
                "acks": dict(self.acks), "decision_delivered": dict(self.delivered)}


class Resharder:
    """Moves a Shard Map from version v to v+1, or leaves it at v."""

    def __init__(self, maps: ShardMaps, send: ReshardSender,
                 settings: ReshardSettings | None = None) -> None:
        self.maps = maps
        self.send = send
        self.settings = settings or ReshardSettings()
        self._locks: dict[str, asyncio.Lock] = {}

    async def reshard(self, target: ShardMap, *, deadline_ms: int | None = None
                      ) -> ReshardOutcome | None:
        """Run §6.9 towards `target`; None when the map did not exist and was installed."""
        lock = self._locks.setdefault(target.map, asyncio.Lock())
        async with lock:
            current = self.maps.get(target.map)
            if current is None:
                self.maps.put(target)
                return None
            if target.scope_id is None and current.scope_id is not None:
                target = dataclasses.replace(target, scope_id=current.scope_id)
            deadline = deadline_ms or self.settings.deadline_ms
            plans = plan_reshard(current, target, deadline)
            self.maps.begin(PendingReshard(target.map, target.version, tuple(plans),
                                           time.time() + deadline / 1000.0
                                           + self.settings.abandoned_after_s))
            acks = await self._propose(plans, deadline / 1000.0)
            committed = all(a == "ok" for a in acks.values())
            decision = ReshardDecision(target.map, "commit" if committed else "abort",
                                       target.version)
            if committed:
                self.maps.put(target)  # v+1 is authoritative once every member acknowledged
            delivered = await self._decide(list(plans), decision)
            self.maps.end(target.map)
            log.info("reshard %s v%d->v%d %s (%s)", target.map, current.version, target.version,
                     decision.kind, acks)
            return ReshardOutcome(target.map, current.version, target.version, committed,
                                  plans, acks, delivered)

    async def finish_abandoned(self) -> list[ReshardDecision]:
        """Finish the reshards whose PC died between plans and decision: commit where v+1 was
        installed (every member had acknowledged), else abort, so members stop holding plans."""
        out = []
        for p in self.maps.abandoned(time.time()):
            self.maps.end(p.map)  # taken: the next sweep does not send it again
            current = self.maps.get(p.map)
            kind = "commit" if current is not None and current.version == p.to_version else "abort"
            decision = ReshardDecision(p.map, kind, p.to_version)  # type: ignore[arg-type]
            delivered = await self._decide(list(p.members), decision)
            log.warning("reshard %s to v%d was left by its PC; sent %s (%s)", p.map,
                        p.to_version, kind, delivered)
            out.append(decision)
        return out

    async def _propose(self, plans: dict[str, ReshardPlan], timeout: float) -> dict[str, str]:
        async def one(inst: str, plan: ReshardPlan) -> str:
            try:
                status = await asyncio.wait_for(self.send(inst, plan.to_json(), timeout), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                return "timeout"
            except KvspError as e:
                return f"error: {e.detail}"
            return "ok" if status == 200 else f"status {status}"

        results = await asyncio.gather(*(one(i, p) for i, p in plans.items()))
        return dict(zip(plans, results))

    async def _decide(self, insts: Sequence[str], decision: ReshardDecision) -> dict[str, bool]:
        body = decision.to_json()
        t = self.settings.decision_timeout_s

        async def one(inst: str) -> bool:
            for attempt in range(self.settings.decision_attempts):
                try:
                    status = await asyncio.wait_for(self.send(inst, body, t), t)
                    if 200 <= status < 300:
                        return True
                    if 400 <= status < 500:
                        return False
                except (asyncio.TimeoutError, TimeoutError, KvspError):
                    pass
                await asyncio.sleep(0.05 * (2 ** attempt))
            return False

        results = await asyncio.gather(*(one(i) for i in insts))
        return dict(zip(insts, results))


__all__ = ["PendingReshard", "ReshardOutcome", "ReshardSettings", "Resharder", "ShardMapStore", "intersect",
           "members", "merge", "plan_reshard", "subtract"]
