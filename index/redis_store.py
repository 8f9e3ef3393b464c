"""Replica Records in Redis (KVSP §6.1, §6.2), shared by every Index Service process on it.

`RedisReplicaStore` keeps the semantics of `index.store` (identity, idempotent refresh,
withdrawal, the §6.2 stop at the first key without a replica, scope isolation, answers spliced
from stored JSON) with one difference: time. A record expires by its Redis TTL, on the Redis
server's clock, `ttl_ms` after its PUT reached Redis; callers' `now` only turns a remaining TTL
into their clock (`get`). Nothing of ours sweeps records: Redis removes expired keys itself.
Needs Redis >= 7.0 (PEXPIRETIME, SORT_RO) or Valkey. docs/redis.md says more.

Key layout
----------
``P`` = ``{prefix}:{<compat_id>:<scope_id>}:`` (prefix ``kvsp``; ids in lowercase hex): every
key of one (compat_id, scope_id) space carries one hash tag.

- ``P r:<block_key>:<replica_id>``, string: the record's JSON (`record_json`), expiring after
  its ``ttl_ms`` (``SET ... PXAT``). Whether a replica exists depends on this key alone.
- ``P b:<block_key>``, sorted set: the key's replica_ids scored in publication order; expires
  with its longest-lived record (``PEXPIREAT``, only ever extended). Members whose record is
  gone are skipped by lookups and dropped by the next PUT that adds a replica.
- ``P n``, hash: expiry second -> records expiring then; ``{prefix}:spaces``, set: the spaces
  holding records. Both serve the ``replica_records`` gauge only.

PUT, refresh and DELETE are Lua scripts (each applied, replicated and logged as a whole); a
batch runs as scripts of `_PUT_CHUNK` records in one pipeline, one round trip.

A lookup of N keys is one round trip: N commands ``SORT_RO P b:<key> BY nosort GET
P r:<key>:*`` written at once, each returning a key's records in publication order (nil for
one expired since). The answer stops at the first reply without a record (§6.2). Every name it
builds starts with ``P`` of the asked space, so it reads no other scope's records. No record
passes through Lua: a script doing the same walk spent about 7x the Redis time on 2.6 kB
records, copying each into the VM and out.

Memory (Redis 7.0.15, ``MEMORY USAGE``): an ``r:`` key costs its JSON rounded up to a
jemalloc size class plus about 300 octets (1,032 for a 647-octet 4-layer record, 3,336 for the
benchmark's 2,644-octet 32-layer one); a ``b:`` key 280 octets with one replica, 312 with two.
``INFO memory`` over the benchmark's 1,000,000 records: 3,634 octets per record, 990 above
the JSON (the in-memory store: 267 above).

Redis Cluster: the tag puts a space in one slot, so a lookup or a PUT touches one shard; a
space cannot outgrow a shard. ``SORT ... GET`` patterns run in cluster mode when their tag maps
to the key's slot, from Redis 7.4 and Valkey 8.0. The store speaks to one server.

Failover: replication is asynchronous; writes lost with a failed primary come back with their
holders' next refresh, and a lost DELETE leaves a record visible until its TTL (the index is
advisory, §6.1). While Redis cannot be reached the service answers 503 (`StoreUnavailable`).
Without persistence a restarted Redis is whole again after one refresh interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import math
import weakref
from collections import defaultdict
from typing import Any, Iterator, Sequence

from index.store import LookupHits, ReplicaStore, ReplicaSummary, StoredReplica, block_json, record_json
from kvsp_moq.errors import StoreUnavailable
from kvsp_moq.protocol.records import ReplicaRecord, Residency, replica_id

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.asyncio.connection import parse_url
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
except ImportError:  # the `redis` extra is not installed
    aioredis = None  # type: ignore[assignment]  # optional extra: None marks it absent
    redis_errors = None  # type: ignore[assignment]  # optional extra: None marks it absent

#: Records per PUT script call: a holder's batch of 1,000 runs as several calls in one
#: pipeline, so that lookups of other clients run between them rather than waiting.
_PUT_CHUNK = 128

#: Prunes the gauge's histogram inside a PUT once it holds more buckets than this.
_HISTOGRAM_PRUNE = 1024

# Shared by the scripts: removes the past buckets of the gauge's histogram and returns the
# records of the others.
_LIVE = """
local function live(hist, now)
  local now_s = math.floor(now / 1000)
  local h = redis.call('HGETALL', hist)
  local n = 0
  for j = 1, #h, 2 do
    if tonumber(h[j]) < now_s then
      redis.call('HDEL', hist, h[j])
    else
      n = n + tonumber(h[j + 1])
    end
  end
  return n
end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS[1] = P n; ARGV = P, then (block_key, replica_id, ttl_ms, json) per record.
# Returns the number of records created.
_PUT = _LIVE + """
local P, hist = ARGV[1], KEYS[1]
local now = clock()
local created, longest, moved = 0, 0, {}
for i = 2, #ARGV, 4 do
  local block, rid = ARGV[i], ARGV[i + 1]
  local exp = now + tonumber(ARGV[i + 2])
  local rpre, bkey = P .. 'r:' .. block .. ':', P .. 'b:' .. block
  local rkey = rpre .. rid
  local old = redis.call('PEXPIRETIME', rkey)
  local fresh = false
  if not redis.call('ZSCORE', bkey, rid) then
    -- Drop members whose records are gone, and file this replica after the last one.
    local members = redis.call('ZRANGE', bkey, 0, -1, 'WITHSCORES')
    local last = 0
    for j = 1, #members, 2 do
      if redis.call('EXISTS', rpre .. members[j]) == 0 then
        redis.call('ZREM', bkey, members[j])
      else
        last = tonumber(members[j + 1])
      end
    end
    fresh = last == 0
    redis.call('ZADD', bkey, last + 1, rid)
  end
  redis.call('SET', rkey, ARGV[i + 3], 'PXAT', exp)
  -- The index lives as long as its longest-lived record (GT: only ever extended).
  if fresh then
    redis.call('PEXPIREAT', bkey, exp)
  else
    redis.call('PEXPIREAT', bkey, exp, 'GT')
  end
  local s = math.floor(exp / 1000)
  if old < 0 then
    created = created + 1
    moved[s] = (moved[s] or 0) + 1
  elseif math.floor(old / 1000) ~= s then
    moved[math.floor(old / 1000)] = (moved[math.floor(old / 1000)] or 0) - 1
    moved[s] = (moved[s] or 0) + 1
  end
  if exp > longest then longest = exp end
end
for s, n in pairs(moved) do
  if n ~= 0 then redis.call('HINCRBY', hist, s, n) end
end
if redis.call('PEXPIRETIME', hist) < longest then redis.call('PEXPIREAT', hist, longest) end
if redis.call('HLEN', hist) > %d then live(hist, now) end
return created
""" % _HISTOGRAM_PRUNE

# KEYS[1] = P n; ARGV = P, block_key, replica_id. Returns 1 when an unexpired record went.
_DELETE = """
local P, hist, block, rid = ARGV[1], KEYS[1], ARGV[2], ARGV[3]
local rkey = P .. 'r:' .. block .. ':' .. rid
local old = redis.call('PEXPIRETIME', rkey)
redis.call('ZREM', P .. 'b:' .. block, rid)
if old < 0 then return 0 end
redis.call('DEL', rkey)
redis.call('HINCRBY', hist, math.floor(old / 1000), -1)
return 1
"""

# KEYS[1] = P n. Returns the records of the space, counting those expired in this second.
_COUNT = _LIVE + """
return live(KEYS[1], clock())
"""


#: Answers of Redis that say "not now" rather than "wrong": the client may retry. redis-py
#: turns some codes into classes (OOM, READONLY; LOADING is a ConnectionError) and leaves the
#: others in the message.
_UNAVAILABLE_CODES = ("MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "OOM", "READONLY")
_UNAVAILABLE_CLASSES = () if redis_errors is None else (
    redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError)


@contextlib.contextmanager
def _unavailable(where: str) -> Iterator[None]:
    """Redis failures that a retry can mend become `StoreUnavailable` (HTTP 503)."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, TimeoutError) as e:
        raise StoreUnavailable(f"replica store {where}: {e}") from None
    except redis_errors.ResponseError as e:
        if isinstance(e, _UNAVAILABLE_CLASSES) or str(e).startswith(_UNAVAILABLE_CODES):
            raise StoreUnavailable(f"replica store {where}: {e}") from None
        raise


class _Script:
    """A Lua script run by its SHA-1, loaded again when the server lost it (a restart)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: Any, key: str, args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, 1, key, *args)
        except redis_errors.NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, 1, key, *args)


def _pool_args() -> tuple[str, ...]:
    """redis-py before 5.3 wants a command name to hand out a connection; later ones warn."""
    if aioredis is None:
        return ()
    param = inspect.signature(aioredis.ConnectionPool.get_connection).parameters.get(
        "command_name")
    return ("SORT_RO",) if param is not None and param.default is param.empty else ()


_POOL_ARGS = _pool_args()
_put = _Script(_PUT)
_delete = _Script(_DELETE)
_count = _Script(_COUNT)


class RedisReplicaStore(ReplicaStore):
    """Replica Records in Redis, for one or many Index Service processes (module docstring).

    A redis-py asyncio client belongs to the event loop that made it, so the store keeps one
    per loop: a service's loop and a test's own loop can share one store object.
    """

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, prefix: str = "kvsp",
                 count_interval_s: float = 5.0, summary_cache: int = 65_536,
                 **client_options: Any) -> None:
        if aioredis is None:
            raise RuntimeError("the Redis store needs redis-py: pip install 'kvsp-moq[redis]'")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError("the key prefix must be non-empty and free of '{' and '}'")
        parse_url(url)  # a malformed URL is refused now, not at the first request
        self.url = url
        self.prefix = prefix
        self.count_interval_s = count_interval_s
        # redis-py retries nothing unless told; every command here may run twice (PUT and
        # DELETE are idempotent), so a connection that a restart or failover broke is
        # replaced without the caller seeing an error.
        self._options: dict[str, Any] = {
            "socket_timeout": 5.0, "socket_connect_timeout": 2.0, "health_check_interval": 30,
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), **client_options}
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = \
            weakref.WeakKeyDictionary()
        self._where = url.rpartition("@")[2]  # never a password in a message
        self._total = 0  # records as last counted, plus this process's writes since
        self._counted_at: float | None = None
        self._summary_cache = summary_cache
        self._summaries: dict[Any, ReplicaSummary] = {}  # see `summary`
        self._shared: dict[ReplicaSummary, ReplicaSummary] = {}

    def __repr__(self) -> str:
        return f"RedisReplicaStore({self._where!r}, prefix={self.prefix!r})"

    # ------------------------------------------------------------------ plumbing

    def client(self) -> Any:
        """The redis-py client of the running event loop."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._clients[loop] = aioredis.Redis.from_url(self.url, **self._options)
        return client

    async def aclose(self) -> None:
        """Close the running loop's connections."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def space(self, compat_id: str, scope_id: str) -> str:
        """``P``: the prefix of every key of one (compat_id, scope_id) space."""
        return f"{self.prefix}:{{{compat_id}:{scope_id}}}:"

    @property
    def spaces_key(self) -> str:
        return f"{self.prefix}:spaces"

    async def _run(self, script: _Script, space: str, args: Sequence[Any]) -> Any:
        with _unavailable(self._where):
            return await script(self.client(), space + "n", (space, *args))

    @property
    def records(self) -> int:
        """Records in Redis as last counted, plus this process's writes since (for metrics)."""
        return max(0, self._total)

    # ------------------------------------------------------------------ writes

    async def put_prepared(self, compat_id: str, scope_id: str,
                           items: Sequence[tuple[str, str, int, bytes]]) -> int:
        """Store records of one space given as (block_key, replica_id, ttl_ms, JSON octets).

        One round trip for the whole sequence, which also files the space for the gauge;
        `put_many` and bulk loaders come here.
        """
        if not items:
            return 0
        space = self.space(compat_id, scope_id)
        calls = []
        for start in range(0, len(items), _PUT_CHUNK):
            args: list[Any] = [space]
            for item in items[start:start + _PUT_CHUNK]:
                args.extend(item)
            calls.append(args)
        client = self.client()
        with _unavailable(self._where):
            async with client.pipeline(transaction=False) as pipe:
                # The script goes first on every pipeline. Retrying after NOSCRIPT could run the
                # calls out of order: when another client loads the script while this pipeline
                # runs, its first calls fail and its later ones succeed, and a key whose
                # replicas straddle two calls would be filed in the wrong publication order.
                pipe.script_load(_put.source)
                for args in calls:
                    pipe.evalsha(_put.sha, 1, space + "n", *args)
                pipe.sadd(self.spaces_key, f"{compat_id}:{scope_id}")
                replies = (await pipe.execute(raise_on_error=False))[1:-1]
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        created = sum(replies)
        self._total += created
        return created

    @staticmethod
    def _item(record: ReplicaRecord) -> tuple[str, str, int, bytes]:
        return (record.block_key, replica_id(record.holder, record.moqt_namespace),
                record.ttl_ms, record_json(record))

    async def put(self, record: ReplicaRecord, now: float) -> bool:
        return bool(await self.put_prepared(record.compat_id, record.scope_id,
                                            [self._item(record)]))

    async def put_many(self, records: Sequence[ReplicaRecord], now: float) -> int:
        by_space: dict[tuple[str, str], list] = defaultdict(list)
        for record in records:
            by_space[record.compat_id, record.scope_id].append(self._item(record))
        created = 0
        for (compat, scope), items in by_space.items():
            created += await self.put_prepared(compat, scope, items)
        return created

    async def delete(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                     now: float) -> bool:
        removed = await self._run(_delete, self.space(compat_id, scope_id), (block_key, rid))
        self._total -= removed
        return bool(removed)

    # ------------------------------------------------------------------ reads

    def summary(self, octets: bytes) -> ReplicaSummary:
        """The summary of a stored record, one object per distinct value.

        Placement reads a summary of every replica a lookup with targets returns. Parsing
        whole records would cost more than the lookup itself, so the layer digests (most of
        a record's octets) are counted rather than parsed, and the rest is looked up among
        the summaries already made; both rely on `record_json`'s member order and fall back to
        parsing the whole record when the octets are laid out otherwise.
        """
        h = octets.find(b'"holder":')
        d = octets.find(b',"digest":', h)
        lo = octets.find(b',"layer_digests":[', d)
        hi = octets.find(b"]", lo)
        if 0 < h < d < lo < hi:
            key: Any = (octets[h:d], octets.count(b",", lo + 18, hi) + 1, octets[hi + 1:])
        else:
            key = octets
        held = self._summaries.get(key)
        if held is None:
            if key is octets:
                d = json.loads(octets)
                digests = d.get("layer_digests")
                layers = None if digests is None else len(digests)
            else:
                d = json.loads(b"{" + key[0] + key[2])
                layers = key[1]
            s = ReplicaSummary(
                d["holder"], d.get("http_holder"), d["codec"], d["size"], layers,
                tuple(Residency(r["tier"], (r["layers"][0], r["layers"][1]),
                                r.get("read_mbit_per_s")) for r in d.get("residency", ())))
            if len(self._summaries) >= self._summary_cache:
                self._summaries.clear()
                self._shared.clear()
            held = self._summaries[key] = self._shared.setdefault(s, s)
        return held

    async def get(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                  now: float) -> StoredReplica | None:
        key = f"{self.space(compat_id, scope_id)}r:{block_key}:{rid}"
        with _unavailable(self._where):
            async with self.client().pipeline(transaction=False) as pipe:
                octets, pttl = await pipe.get(key).pttl(key).execute()
        if octets is None or pttl < 0:
            return None
        return StoredReplica(octets, self.summary(octets), now + pttl / 1000.0)

    async def lookup(self, compat_id: str, scope_id: str, block_keys: Sequence[str],
                     now: float, *, summaries: bool = False) -> LookupHits:
        n = len(block_keys)
        if not n:
            return LookupHits(0, [], [] if summaries else None)
        joined = "".join(block_keys).lower()
        if len(bytes.fromhex(joined)) != 32 * n or set(map(len, block_keys)) != {64}:
            raise ValueError("block keys must be 64 hex digits each")
        replies = await self._pipeline(self._sort_commands(compat_id, scope_id, joined), n)
        keys = [joined[64 * i:64 * i + 64] for i in range(n)]
        blocks: list[bytes] = []
        sums: list[list[ReplicaSummary]] | None = [] if summaries else None
        summary = self.summary
        for key, reps in zip(keys, replies):
            if None in reps:  # records expired after their index entry was read
                reps = [r for r in reps if r is not None]
            if not reps:
                break  # §6.2: the match ends at the first key without a replica
            blocks.append(block_json(key, reps))
            if sums is not None:
                sums.append([summary(r) for r in reps])
        return LookupHits(len(blocks), blocks, sums)

    def _sort_commands(self, compat_id: str, scope_id: str, joined: str) -> bytes:
        """``SORT_RO P b:<key> BY nosort GET P r:<key>:*`` for each key, as RESP octets.

        One command per key reads the key's replica_ids in publication order and, in the same
        step, the record each names (nil for one that expired): no record passes through a
        script, and the index and records are read in one pass.
        """
        space = self.space(compat_id, scope_id).encode()
        head = b"*6\r\n$7\r\nSORT_RO\r\n$%d\r\n%sb:" % (len(space) + 66, space)
        mid = b"\r\n$2\r\nBY\r\n$6\r\nnosort\r\n$3\r\nGET\r\n$%d\r\n%sr:" % (
            len(space) + 68, space)
        raw = joined.encode()
        parts: list[bytes] = []
        for i in range(0, len(raw), 64):
            key = raw[i:i + 64]
            parts += (head, key, mid, key, b":*\r\n")
        return b"".join(parts)

    async def _pipeline(self, commands: bytes, n: int) -> list[Any]:
        """Send `n` commands packed beforehand and read their `n` replies: one round trip.

        redis-py's own pipeline spends tens of microseconds of Python per command, as much as
        Redis spends running it; commands of a lookup are packed in one pass instead. A broken
        connection is replaced under the client's retry policy, as for any other command.
        """
        pool = self.client().connection_pool
        with _unavailable(self._where):
            conn = await pool.get_connection(*_POOL_ARGS)

            async def attempt() -> list[Any]:
                await conn.send_packed_command(commands, check_health=False)
                # One deadline for the batch, not one timer per reply.
                async with asyncio.timeout(self._timeout(n)):
                    return [await conn.read_response(timeout=math.inf) for _ in range(n)]

            async def failed(error: Exception) -> None:
                await conn.disconnect()
                # Redis went away (a restart, a failover): its idle connections are as dead.
                await pool.disconnect(inuse_connections=False)

            try:
                return await conn.retry.call_with_retry(attempt, failed)
            except BaseException:
                await conn.disconnect()  # replies left unread: the connection is unusable
                raise
            finally:
                await pool.release(conn)

    def _timeout(self, n: int) -> float:
        base = self._options.get("socket_timeout") or 5.0
        return base + n * 1e-4

    # ------------------------------------------------------------------ the gauge

    async def count(self) -> int:
        """Records of every space, counted in Redis now (those expired this second included).

        A space without records leaves the set of spaces; should a PUT race this, it files
        the space again, and the next PUT of that space does so at the latest.
        """
        client = self.client()
        total = 0
        gone = []
        with _unavailable(self._where):
            for name in sorted(m.decode() for m in await client.smembers(self.spaces_key)):
                compat, _, scope = name.partition(":")
                n = await _count(client, self.space(compat, scope) + "n", ())
                total += n
                if not n:
                    gone.append(name)
            if gone:
                await client.srem(self.spaces_key, *gone)
        self._total = total
        return total

    async def sweep(self, now: float, *, budget: int = 10_000) -> int:
        """Always 0: Redis expires records by itself; this only recounts them for the gauge,
        every `count_interval_s` of the caller's clock."""
        if self._counted_at is None or now - self._counted_at >= self.count_interval_s:
            self._counted_at = now
            await self.count()
        return 0
