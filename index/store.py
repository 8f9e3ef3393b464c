"""Where the Index Service keeps Replica Records (KVSP §6.1, §6.2) and reads instance status.

`ReplicaStore` is the interface a backend keeps; `MemoryReplicaStore` is the in-process one.
The semantics every backend keeps:

- A replica's identity is (compat_id, scope_id, block_key, replica_id), all lowercase hex;
  `replica_id` is `kvsp_moq.protocol.records.replica_id(holder, moqt_namespace)` (DESIGN §3).
- `put` stores the record as given (the caller has already capped its ttl_ms) and replaces any
  record of the same identity; the record expires at `now + ttl_ms / 1000`. It reports whether
  the identity was new (no unexpired record held it), so a refresh is told from a create.
- Time is the caller's: every method takes `now` in seconds on one monotonic clock, and a store
  never reads a clock itself, so tests move time instead of sleeping.
- A record is invisible to `get`, `lookup` and `delete` from the instant `now >= expiry`, swept
  or not; `sweep` reclaims memory in bounded steps.
- `lookup` reads one (compat_id, scope_id) space and nothing else, so a client authorized for
  that scope can never receive a replica of another. `matched` counts leading keys with at least
  one unexpired replica and stops at the first key without one (§6.2).
- A lookup answers with JSON octets, one `{"block_key": ..., "replicas": [...]}` object per
  matched key, made at `put` time from the records' own members, so a response is spliced
  together without decoding or re-encoding any record.
"""

from __future__ import annotations

import abc
import heapq
import json
import math
import random
import struct
import time
from array import array
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import Callable, Protocol, Sequence, cast

import numpy as np

from kvsp_moq.protocol.records import InstanceStatus, ReplicaRecord, Residency, replica_id
from kvsp_moq.protocol.urls import base_url

_fromhex = bytes.fromhex
_STRIDE = 4  # per replica in a key's metadata: replica_id, expiry, JSON length, summary
_HEAD = b'{"block_key":"'
_MID = b'","replicas":['
_TAIL = b"]}"
_HEAD_LEN = len(_HEAD) + 64 + len(_MID)


@dataclass(frozen=True)
class ReplicaSummary:
    """What placement estimates and withdrawal checks need from a replica.

    Many records share one summary (same holder, size and tiers), so stores keep one per
    distinct value instead of a parsed record per replica.
    """

    holder: str
    http_holder: str | None
    codec: int
    size: int
    layer_count: int | None
    residency: tuple[Residency, ...]

    @classmethod
    def of(cls, record: ReplicaRecord) -> "ReplicaSummary":
        return cls(record.holder, record.http_holder, record.codec, record.size,
                   record.layer_count, record.residency)

    def as_tuple(self) -> tuple:
        """The same values as nested plain tuples of str, int, float and None.

        The cycle collector stops tracking such tuples, so millions of stored references
        to them add nothing to its pauses, unlike references to dataclass instances.
        """
        return (self.holder, self.http_holder, self.codec, self.size, self.layer_count,
                tuple((r.tier, r.layers[0], r.layers[1], r.read_mbit_per_s)
                      for r in self.residency))

    @classmethod
    def from_tuple(cls, t: tuple) -> "ReplicaSummary":
        return cls(t[0], t[1], t[2], t[3], t[4],
                   tuple(Residency(r[0], (r[1], r[2]), r[3]) for r in t[5]))

    @cached_property
    def cost_record(self) -> ReplicaRecord:
        """The replica as `kvsp_moq.protocol.cost` reads it: source, size and tiers only.

        Digests do not enter the estimates, so the layer digests are placeholders that only
        carry the layer count.
        """
        digests = None if self.layer_count is None else ("",) * self.layer_count
        return ReplicaRecord(block_key="", compat_id="", scope_id="", holder=self.holder,
                             codec=self.codec, size=self.size, digest="", ttl_ms=1,
                             layer_digests=digests, residency=self.residency,
                             http_holder=self.http_holder)


@dataclass(frozen=True, slots=True)
class StoredReplica:
    """One unexpired record as a store holds it."""

    json: bytes
    summary: ReplicaSummary
    expires: float


@dataclass(frozen=True, slots=True)
class LookupHits:
    """The answer of `ReplicaStore.lookup`, in prefix order."""

    matched: int
    #: per matched key, the JSON object {"block_key": ..., "replicas": [...]} of the lookup
    #: response (DESIGN §6) with the key's unexpired replicas
    blocks: list[bytes]
    #: per matched key, the summaries of the same replicas in the same order; None unless asked
    summaries: list[list[ReplicaSummary]] | None = None


def record_json(record: ReplicaRecord) -> bytes:
    """The octets a store returns for a record: its members, unknown ones gone."""
    return json.dumps(record.to_json(), separators=(",", ":")).encode()


def block_json(block_key: str, replicas: Sequence[bytes]) -> bytes:
    """One element of a lookup response's "blocks" (DESIGN §6), from records' JSON octets."""
    parts = [_HEAD, block_key.encode(), _MID]
    for i, r in enumerate(replicas):
        if i:
            parts.append(b",")
        parts.append(r)
    parts.append(_TAIL)
    return b"".join(parts)


class ReplicaStore(abc.ABC):
    """Storage of Replica Records; see the module docstring for the semantics to keep."""

    @abc.abstractmethod
    async def put(self, record: ReplicaRecord, now: float) -> bool:
        """Store or refresh `record`; True when its identity held no unexpired record."""

    async def put_many(self, records: Sequence[ReplicaRecord], now: float) -> int:
        """Store all of `records` (validated beforehand); the number that were new."""
        created = 0
        for record in records:
            created += await self.put(record, now)
        return created

    @abc.abstractmethod
    async def get(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                  now: float) -> StoredReplica | None:
        """The unexpired record of that identity, if any."""

    @abc.abstractmethod
    async def delete(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                     now: float) -> bool:
        """Withdraw a record; True when an unexpired one was removed."""

    @abc.abstractmethod
    async def lookup(self, compat_id: str, scope_id: str, block_keys: Sequence[str],
                     now: float, *, summaries: bool = False) -> LookupHits:
        """The leading keys of `block_keys` that have unexpired replicas, and those replicas.

        `block_keys` are 64 hex digits each (validated by the caller), in prefix order.
        """

    @abc.abstractmethod
    async def sweep(self, now: float, *, budget: int = 10_000) -> int:
        """Reclaim up to about `budget` expired entries; the number of records removed."""

    @property
    @abc.abstractmethod
    def records(self) -> int:
        """Records held, counting expired ones not yet swept (for metrics)."""


class KeyIndex:
    """Open-addressing hash index from 32-octet block keys to small integer ids, in numpy.

    A lookup of thousands of keys among millions is bound by memory latency. With a dict every
    key costs a chain of dependent cache misses (index, entry, key object, value); here the
    probes of all keys of a request are vectorized gathers whose loads overlap.

    Linear probing without wrap-around over a table padded at its end, at most half full;
    deletion shifts later entries back, so probe runs never hold tombstones. A slot's position
    and tag come from a keyed multiply of all four words of the key, so publishers cannot aim
    keys at one run; a tag match is confirmed against the full key.
    """

    def __init__(self, capacity: int = 1024, *, seed: int | None = None) -> None:
        rng = random.SystemRandom() if seed is None else random.Random(seed)
        self._muls = [rng.getrandbits(64) | 1 for _ in range(4)]
        self._mul = np.array(self._muls, dtype=np.uint64)
        self.count = 0
        self._min_capacity = max(16, 1 << (capacity - 1).bit_length())
        self._keys = np.zeros((64, 4), np.uint64)  # the key of each id
        self._free: list[int] = []
        self._next_id = 0
        self._layout(self._min_capacity, np.zeros(0, np.uint64), np.zeros(0, np.int32))

    # ---------------------------------------------------------------- layout

    def _layout(self, capacity: int, tags: np.ndarray, ids: np.ndarray) -> None:
        """Place entries into a fresh table of `capacity` home slots (plus padding)."""
        while True:
            bits = capacity.bit_length() - 1
            shift = 64 - bits
            homes = (tags >> np.uint64(shift)).astype(np.int64)
            order = np.argsort(homes, kind="stable")
            homes = homes[order]
            n = len(homes)
            # Sorted by home, each entry takes max(home, previous slot + 1): a cumulative max.
            slots = np.arange(n) + np.maximum.accumulate(homes - np.arange(n)) if n else homes
            size = capacity + 64 + (capacity >> 4)
            if not n or slots[-1] < size - 1:  # the last slot stays empty: probes end there
                break
            capacity *= 2
        self._capacity, self._shift = capacity, shift
        self._tags = np.zeros(size, np.uint64)
        self._ids = np.zeros(size, np.int32)
        self._tags[slots] = tags[order]
        self._ids[slots] = ids[order]

    def _relayout(self, capacity: int) -> None:
        used = self._tags != 0
        self._layout(capacity, self._tags[used], self._ids[used])

    # ---------------------------------------------------------------- hashing

    def _hash1(self, words: tuple[int, ...]) -> int:
        m = self._muls
        return (words[0] * m[0] + words[1] * m[1] + words[2] * m[2] + words[3] * m[3]) \
            & 0xFFFF_FFFF_FFFF_FFFF

    def _hash(self, q: np.ndarray) -> np.ndarray:
        m = self._mul
        return q[:, 0] * m[0] + q[:, 1] * m[1] + q[:, 2] * m[2] + q[:, 3] * m[3]  # mod 2**64

    # ---------------------------------------------------------------- single keys

    def _slot_of(self, words: tuple[int, ...]) -> tuple[int, int]:
        """(slot holding the key or -1, first empty slot of its run)."""
        h = self._hash1(words)
        tag, p = h | 1, h >> self._shift
        tags, ids, keys = self._tags, self._ids, self._keys
        while True:
            t = int(tags[p])
            if t == 0:
                return -1, p
            if t == tag and tuple(keys[ids[p]].tolist()) == words:
                return p, p
            p += 1

    def find1(self, key: bytes) -> int:
        """The id of `key`, or -1."""
        p, _ = self._slot_of(struct.unpack("=4Q", key))
        return -1 if p < 0 else int(self._ids[p])

    def add(self, key: bytes) -> int:
        """The id of `key`, adding it when absent."""
        words = struct.unpack("=4Q", key)
        p, empty = self._slot_of(words)
        if p >= 0:
            return int(self._ids[p])
        while 2 * (self.count + 1) > self._capacity or empty >= len(self._tags) - 1:
            self._relayout(self._capacity * 2)
            _, empty = self._slot_of(words)
        if self._free:
            i = self._free.pop()
        else:
            i = self._next_id
            self._next_id += 1
            if i == len(self._keys):
                self._keys = np.concatenate([self._keys, np.zeros_like(self._keys)])
        self._keys[i] = words
        h = self._hash1(words)
        self._tags[empty] = h | 1
        self._ids[empty] = i
        self.count += 1
        return i

    def remove(self, i: int) -> None:
        """Remove the key of id `i` (which must be present); the id may be reused."""
        p, _ = self._slot_of(tuple(self._keys[i].tolist()))
        tags, ids, shift = self._tags, self._ids, self._shift
        hole, j = p, p
        while True:  # move back every later entry of the run that may sit in the hole
            j += 1
            t = int(tags[j])
            if t == 0:
                break
            if (t >> shift) <= hole:
                tags[hole] = t
                ids[hole] = ids[j]
                hole = j
        tags[hole] = 0
        self._keys[i] = 0
        self._free.append(i)
        self.count -= 1
        if self._capacity > self._min_capacity and 8 * self.count < self._capacity:
            self._relayout(max(self._min_capacity, self._capacity // 2))

    def key_hex(self, i: int) -> str:
        return self._keys[i].tobytes().hex()

    # ---------------------------------------------------------------- batches

    def find(self, keys: bytes) -> np.ndarray:
        """Ids of the 32-octet keys concatenated in `keys`, -1 for those absent."""
        q = np.frombuffer(keys, np.uint64).reshape(-1, 4)
        h = self._hash(q)
        tag = h | np.uint64(1)
        pos = (h >> np.uint64(self._shift)).astype(np.int64)
        found = np.full(len(q), -1, np.int64)
        todo = np.arange(len(q))
        tags, ids, stored = self._tags, self._ids, self._keys
        while todo.size:  # each pass probes one more slot of every unresolved key
            p = pos[todo]
            t = tags[p]
            match = t == tag[todo]
            done = t == 0
            if match.any():
                cand = ids[p[match]]
                same = (stored[cand] == q[todo[match]]).all(axis=1)
                found[todo[match][same]] = cand[same]
                done[np.flatnonzero(match)[same]] = True
            todo = todo[~done]
            pos[todo] += 1
        return found


class _Space:
    """The records of one (compat_id, scope_id), by block key.

    `index` gives each key an id; `blocks[id]` is the key's rendered lookup element
    (`block_json`), the only copy of its records' octets, and `metas[id]` is
    `(rid, expiry, json_length, summary tuple, rid, ...)`, in the same replica order, all
    plain values the cycle collector does not track.
    """

    __slots__ = ("key", "number", "index", "blocks", "metas")

    def __init__(self, key: bytes, number: int) -> None:
        self.key = key
        self.number = number
        self.index = KeyIndex(16)
        self.blocks: list[bytes | None] = []
        self.metas: list[tuple | None] = []

    def jsons(self, i: int) -> list[bytes]:
        """The records' octets of key id `i`, cut out of its rendered element."""
        block, meta = self.blocks[i], self.metas[i]
        assert block is not None and meta is not None
        out = []
        pos = _HEAD_LEN
        for j in range(2, len(meta), _STRIDE):
            n = meta[j]
            out.append(block[pos:pos + n])
            pos += n + 1
        return out

    def set(self, i: int, meta: tuple, jsons: list[bytes]) -> None:
        if i == len(self.metas):
            self.metas.append(None)
            self.blocks.append(None)
        self.metas[i] = meta
        self.blocks[i] = block_json(self.index.key_hex(i), jsons)

    def drop(self, i: int) -> None:
        self.index.remove(i)
        self.metas[i] = None
        self.blocks[i] = None


class MemoryReplicaStore(ReplicaStore):
    """Replica Records in process memory, with an exact expiry frontier.

    Every key is filed under the expiry bucket (`bucket_s` wide) of each of its replicas.
    Before answering, a lookup expires what is due: buckets wholly in the past are emptied, and
    the bucket holding `now` is checked entry by entry. When that finishes within
    `read_budget` filings, no expired replica is left, and the lookup reads rendered elements
    without checking any expiry; otherwise (a burst of expiries) it checks each key's replicas.
    `sweep` does the same work without a lookup, so memory is reclaimed when nobody reads.
    A refresh files a key again only when its expiry bucket changes; stale filings find
    nothing to remove.
    """

    def __init__(self, *, bucket_s: float = 0.01, read_budget: int = 1024,
                 intern_limit: int = 65_536) -> None:
        self._spaces: dict[bytes, _Space] = {}
        self._numbered: dict[int, _Space] = {}
        self._next_space = 0
        # bucket -> filings, each (space number << 32 | key id): no object per filing
        self._buckets: dict[int, array] = {}
        self._heap: list[int] = []  # bucket numbers present in _buckets
        self._bucket_s = bucket_s
        self._read_budget = read_budget
        self._records = 0
        self._intern_limit = intern_limit
        self._shared: dict[object, object] = {}  # summary tuples and JSON lengths
        self._summaries: dict[int, tuple[tuple, ReplicaSummary]] = {}
        self._rids: dict[str, bytes] = {}  # holder -> replica_id of its HTTP replicas

    @property
    def records(self) -> int:
        return self._records

    def _bucket(self, t: float) -> int:
        # floor of a correctly rounded division is monotonic: t1 <= t2 gives bucket order.
        return math.floor(t / self._bucket_s)

    # ------------------------------------------------------------------ writes

    def _share(self, value: object) -> object:
        """One object per distinct value, for values that repeat across many records."""
        shared = self._shared.get(value)
        if shared is None:
            if len(self._shared) >= self._intern_limit:
                self._shared.clear()  # sharing only saves memory; stay bounded
            self._shared[value] = shared = value
        return shared

    def _summary(self, t: tuple) -> ReplicaSummary:
        # Keyed by identity, since hashing a nested tuple costs more than the lookup it
        # serves; the entry holds the tuple, so its id cannot be reused while cached.
        held = self._summaries.get(id(t))
        if held is None or held[0] is not t:
            if len(self._summaries) >= self._intern_limit:
                self._summaries.clear()
            held = self._summaries[id(t)] = (t, ReplicaSummary.from_tuple(t))
        return held[1]

    def _rid(self, record: ReplicaRecord) -> bytes:
        if record.moqt_namespace is not None:
            return _fromhex(replica_id(record.holder, record.moqt_namespace))
        rid = self._rids.get(record.holder)
        if rid is None:
            if len(self._rids) >= self._intern_limit:
                self._rids.clear()
            rid = self._rids[record.holder] = _fromhex(replica_id(record.holder))
        return rid

    def _file(self, space: _Space, i: int, expires: float) -> None:
        bucket = self._bucket(expires)
        filed = self._buckets.get(bucket)
        if filed is None:
            filed = self._buckets[bucket] = array("q")
            heapq.heappush(self._heap, bucket)
        filed.append(space.number << 32 | i)

    def _space(self, compat_id: str, scope_id: str) -> _Space:
        space_key = _fromhex(compat_id + scope_id)
        space = self._spaces.get(space_key)
        if space is None:
            space = self._spaces[space_key] = _Space(space_key, self._next_space)
            self._numbered[self._next_space] = space
            self._next_space += 1
        return space

    def put_sync(self, record: ReplicaRecord, now: float) -> bool:
        """`put` without the coroutine, for bulk loading in process (benchmarks, restores)."""
        expires = now + record.ttl_ms / 1000.0
        data = record_json(record)
        rid = self._rid(record)
        replica = (rid, expires, self._share(len(data)),
                   self._share(ReplicaSummary.of(record).as_tuple()))
        space = self._space(record.compat_id, record.scope_id)
        i = space.index.add(_fromhex(record.block_key))
        meta = space.metas[i] if i < len(space.metas) else None
        if meta is None:
            space.set(i, replica, [data])
            self._records += 1
            self._file(space, i, expires)
            return True
        jsons = space.jsons(i)
        for j, k in enumerate(range(0, len(meta), _STRIDE)):
            if meta[k] == rid:
                old = meta[k + 1]
                jsons[j] = data
                space.set(i, meta[:k] + replica + meta[k + _STRIDE:], jsons)
                if self._bucket(expires) != self._bucket(old):
                    self._file(space, i, expires)
                return old <= now
        jsons.append(data)
        space.set(i, meta + replica, jsons)
        self._records += 1
        self._file(space, i, expires)
        return True

    async def put(self, record: ReplicaRecord, now: float) -> bool:
        return self.put_sync(record, now)

    async def put_many(self, records: Sequence[ReplicaRecord], now: float) -> int:
        return sum(self.put_sync(r, now) for r in records)

    def _find(self, compat_id: str, scope_id: str, block_key: str) -> tuple[_Space | None, int]:
        space = self._spaces.get(_fromhex(compat_id + scope_id))
        if space is None:
            return None, -1
        return space, space.index.find1(_fromhex(block_key))

    async def get(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                  now: float) -> StoredReplica | None:
        space, i = self._find(compat_id, scope_id, block_key)
        if space is None or i < 0:
            return None
        meta = space.metas[i]
        assert meta is not None
        raw = _fromhex(rid)
        for j, k in enumerate(range(0, len(meta), _STRIDE)):
            if meta[k] == raw and meta[k + 1] > now:
                return StoredReplica(space.jsons(i)[j], self._summary(meta[k + 3]), meta[k + 1])
        return None

    async def delete(self, compat_id: str, scope_id: str, block_key: str, rid: str,
                     now: float) -> bool:
        space, i = self._find(compat_id, scope_id, block_key)
        if space is None or i < 0:
            return False
        meta = space.metas[i]
        assert meta is not None
        raw = _fromhex(rid)
        for j, k in enumerate(range(0, len(meta), _STRIDE)):
            if meta[k] == raw:
                self._records -= 1
                if len(meta) == _STRIDE:
                    space.drop(i)
                    if not space.index.count:
                        self._forget(space)
                else:
                    jsons = space.jsons(i)
                    del jsons[j]
                    space.set(i, meta[:k] + meta[k + _STRIDE:], jsons)
                return meta[k + 1] > now
        return False

    # ------------------------------------------------------------------ expiry

    def _expire_key(self, filing: int, now: float) -> int:
        """Remove the expired replicas of a filed key; how many went."""
        space = self._numbered.get(filing >> 32)
        i = filing & 0xFFFF_FFFF
        if space is None or i >= len(space.metas):
            return 0
        meta = space.metas[i]
        if meta is None:
            return 0
        live = [j for j, k in enumerate(range(0, len(meta), _STRIDE)) if meta[k + 1] > now]
        gone = len(meta) // _STRIDE - len(live)
        if not gone:
            return 0
        if not live:
            space.drop(i)
        else:
            jsons = space.jsons(i)
            space.set(i, sum((meta[j * _STRIDE:(j + 1) * _STRIDE] for j in live), ()),
                      [jsons[j] for j in live])
        return gone

    def _expire(self, now: float, budget: int) -> tuple[int, bool]:
        """Remove what is due at `now`, visiting at most `budget` filings.

        Returns the number of records removed and whether none with expiry <= now is left.
        """
        heap, buckets = self._heap, self._buckets
        current = self._bucket(now)
        removed = visited = 0
        clear = True
        while heap and heap[0] <= current:
            bucket = heap[0]
            filed = buckets[bucket]
            if bucket < current:  # every expiry in it is < now: empty it for good
                while filed and visited < budget:
                    removed += self._expire_key(filed.pop(), now)
                    visited += 1
                if filed:
                    clear = False
                    break
                heapq.heappop(heap)
                del buckets[bucket]
                continue
            # The bucket holding `now`: some of it may expire later, so check without emptying.
            if len(filed) > budget - visited:
                clear = False
                break
            for filing in filed:
                removed += self._expire_key(filing, now)
            break
        self._records -= removed
        if removed:
            for space in [s for s in self._spaces.values() if not s.index.count]:
                self._forget(space)
        return removed, clear

    def _forget(self, space: _Space) -> None:
        """Drop an empty space; its stale filings then find nothing."""
        del self._spaces[space.key]
        del self._numbered[space.number]

    async def sweep(self, now: float, *, budget: int = 10_000) -> int:
        return self._expire(now, budget)[0]

    # ------------------------------------------------------------------ reads

    async def lookup(self, compat_id: str, scope_id: str, block_keys: Sequence[str],
                     now: float, *, summaries: bool = False) -> LookupHits:
        _, clear = self._expire(now, self._read_budget)
        space = self._spaces.get(_fromhex(compat_id + scope_id))
        found: list[bytes] = []
        if space is None or not block_keys:
            return LookupHits(0, found, [] if summaries else None)
        raw = _fromhex("".join(block_keys))
        if len(raw) != 32 * len(block_keys):
            raise ValueError("block keys must be 64 hex digits each")
        ids = space.index.find(raw)
        absent = np.flatnonzero(ids < 0)
        ids = ids[:absent[0]] if absent.size else ids
        blocks, metas = space.blocks, space.metas
        if clear:
            # Nothing expired is left: every stored element is the answer for its key.
            # itemgetter gathers in C, so the cache misses of the elements overlap.
            if len(ids) > 1:
                found = list(itemgetter(*ids.tolist())(blocks))
            elif len(ids) == 1:
                # cast: an id the index finds is a stored key, whose element is set (only
                # drop() clears one, and it removes the key from the index first).
                found = [cast(bytes, blocks[int(ids[0])])]
        else:
            for i in ids.tolist():
                meta = metas[i]
                live = [j for j, k in enumerate(range(0, len(meta), _STRIDE))
                        if meta[k + 1] > now]
                if not live:
                    break
                if len(live) * _STRIDE == len(meta):
                    found.append(blocks[i])
                else:
                    jsons = space.jsons(i)
                    found.append(block_json(space.index.key_hex(i), [jsons[j] for j in live]))
        sums = None
        if summaries:
            sums = []
            cache, summary = self._summaries, self._summary
            for i in ids[:len(found)].tolist():
                meta = metas[i]
                row = []
                for k in range(0, len(meta), _STRIDE):
                    if meta[k + 1] > now:
                        t = meta[k + 3]
                        held = cache.get(id(t))
                        row.append(held[1] if held is not None and held[0] is t else summary(t))
                sums.append(row)
        return LookupHits(len(found), found, sums)


# ---------------------------------------------------------------------- instance status


class InstanceDirectory(Protocol):
    """Current Instance Status Records (§6.3), as the Placement Controller knows them."""

    def get(self, instance: str) -> InstanceStatus | None:
        """The unexpired status of an instance base URL, or None when unknown or expired."""
        ...

    def serves(self, instance: str, scope_id: str) -> bool:
        """Whether the instance serves the scope: a lookup estimates only for those, so that
        one tenant's lookup cannot read another's instance status through its estimates."""
        ...


class MemoryInstanceDirectory:
    """An `InstanceDirectory` filled by calls to `put`; records expire after their ttl_ms."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._by_url: dict[str, tuple[InstanceStatus, float]] = {}

    def put(self, status: InstanceStatus) -> bool:
        """Record a status; False (and nothing kept) for an epoch lower than one seen (§6.3)."""
        url = base_url(status.instance)
        held = self._by_url.get(url)
        if held is not None and status.epoch < held[0].epoch:
            return False
        self._by_url[url] = (status, self._clock() + status.ttl_ms / 1000.0)
        return True

    def get(self, instance: str) -> InstanceStatus | None:
        held = self._by_url.get(base_url(instance))
        if held is None or held[1] <= self._clock():
            return None
        return held[0]

    def serves(self, instance: str, scope_id: str) -> bool:
        """Records put here carry no principal: every known instance serves every scope."""
        return self.get(instance) is not None

    def remove(self, instance: str) -> None:
        self._by_url.pop(base_url(instance), None)
