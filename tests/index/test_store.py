"""MemoryReplicaStore semantics, byte by byte and against a plain model."""

from __future__ import annotations

import gc
import json
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from index.store import KeyIndex, MemoryReplicaStore, ReplicaSummary, block_json, record_json
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from tests.index.conftest import COMPAT, H1, H2, OTHER, RELAY, SCOPE, key, record


def rec(i: int, holder: str = H1, ttl_ms: int = 1000, scope: str = SCOPE, **kw) -> ReplicaRecord:
    return ReplicaRecord.from_json(record(key(i), holder=holder, ttl_ms=ttl_ms, scope=scope,
                                          layers=1, **kw))


def replicas(hits) -> list[list[dict]]:
    return [json.loads(b)["replicas"] for b in hits.blocks]


async def test_block_json_is_the_lookup_element():
    a, b = rec(0), rec(0, holder=H2)
    element = json.loads(block_json(key(0), [record_json(a), record_json(b)]))
    assert element == {"block_key": key(0), "replicas": [a.to_json(), b.to_json()]}


async def test_put_get_delete_and_identity():
    s = MemoryReplicaStore()
    assert await s.put(rec(0), 0.0) is True
    assert await s.put(rec(0), 0.1) is False  # refresh
    assert await s.put(rec(0, holder=H2), 0.1) is True  # another holder: another replica
    ns_a = rec(0, holder=RELAY, moqt_namespace="AAAA", http_holder=H1)
    ns_b = rec(0, holder=RELAY, moqt_namespace="BBBB", http_holder=H2)
    assert await s.put(ns_a, 0.1) and await s.put(ns_b, 0.1)  # two holders behind one relay
    assert s.records == 4
    got = await s.get(COMPAT, SCOPE, key(0), replica_id(RELAY, "AAAA"), 0.2)
    assert got is not None and got.json == record_json(ns_a)
    assert got.summary == ReplicaSummary.of(ns_a) and got.expires == 1.1
    assert await s.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is True
    assert await s.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is False
    assert await s.get(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is None
    hits = await s.lookup(COMPAT, SCOPE, [key(0)], 0.2)
    assert [r["holder"] for r in replicas(hits)[0]] == [H2, RELAY, RELAY]
    assert await s.get(COMPAT, OTHER, key(0), replica_id(H2), 0.2) is None


async def test_expiry_is_exact_at_the_boundary():
    s = MemoryReplicaStore()
    await s.put(rec(0, ttl_ms=250), 10.0)
    assert (await s.lookup(COMPAT, SCOPE, [key(0)], 10.249)).matched == 1
    assert (await s.lookup(COMPAT, SCOPE, [key(0)], 10.25)).matched == 0
    assert await s.get(COMPAT, SCOPE, key(0), replica_id(H1), 10.25) is None


async def test_a_refresh_may_shorten_the_ttl():
    s = MemoryReplicaStore()
    await s.put(rec(0, ttl_ms=10_000), 0.0)
    await s.put(rec(0, ttl_ms=1_000), 0.5)
    assert (await s.lookup(COMPAT, SCOPE, [key(0)], 1.49)).matched == 1
    assert (await s.lookup(COMPAT, SCOPE, [key(0)], 1.5)).matched == 0


async def test_one_expired_replica_leaves_the_others():
    s = MemoryReplicaStore()
    await s.put(rec(0, ttl_ms=1000), 0.0)
    await s.put(rec(0, holder=H2, ttl_ms=5000), 0.0)
    hits = await s.lookup(COMPAT, SCOPE, [key(0)], 2.0, summaries=True)
    assert [r["holder"] for r in replicas(hits)[0]] == [H2]
    assert [x.holder for x in hits.summaries[0]] == [H2]
    assert s.records == 1


async def test_a_burst_beyond_the_read_budget_is_still_exact():
    s = MemoryReplicaStore(read_budget=8)
    for i in range(100):
        await s.put(rec(i, ttl_ms=1000 if i % 10 == 5 else 9000), 0.0)
    await s.put(rec(3, holder=H2, ttl_ms=1000), 0.0)
    # 10 keys and one second replica are due at once: more than a lookup may sweep.
    hits = await s.lookup(COMPAT, SCOPE, [key(i) for i in range(100)], 1.5, summaries=True)
    assert hits.matched == 5
    assert [len(r) for r in replicas(hits)] == [1] * 5
    assert len(hits.summaries) == 5
    while await s.sweep(1.5, budget=3):
        pass
    assert s.records == 90


async def test_lookup_reads_only_its_space():
    s = MemoryReplicaStore()
    await s.put(rec(0, scope=OTHER, holder=H2), 0.0)
    assert (await s.lookup(COMPAT, SCOPE, [key(0)], 0.1)).matched == 0
    assert (await s.lookup("c1" * 32, OTHER, [key(0)], 0.1)).matched == 0
    assert (await s.lookup(COMPAT, OTHER, [key(0)], 0.1)).matched == 1


async def test_sweeping_returns_memory():
    s = MemoryReplicaStore()
    records = [rec(i, ttl_ms=1000) for i in range(2000)]
    # Only what the index package allocates counts: threads other tests left behind allocate
    # too, and tracemalloc sees every thread.
    only_index = [tracemalloc.Filter(True, "*/index/*")]

    def traced() -> int:
        return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(only_index).traces)

    gc.collect()
    tracemalloc.start()
    try:
        before = traced()
        for r in records:
            await s.put(r, 0.0)
        held = traced() - before
        assert s.records == 2000
        removed = 0
        for _ in range(100):  # bounded steps, as the background sweeper takes them
            removed += await s.sweep(2.0, budget=100)
        assert removed == 2000 and s.records == 0
        gc.collect()
        left = traced() - before
    finally:
        tracemalloc.stop()
    assert held > 2000 * 500
    assert left < held / 20, (held, left)


async def test_memory_of_a_refreshed_record_does_not_grow():
    s = MemoryReplicaStore(bucket_s=1.0)
    r = rec(0, ttl_ms=1000)
    for t in range(50):  # refreshed every second for 50 s
        await s.put(r, float(t))
        await s.sweep(float(t))
    assert s.records == 1
    assert sum(len(v) for v in s._buckets.values()) <= 4  # filings of the live expiry only


# ------------------------------------------------------------------ against a model

HOLDERS = [H1, H2, "http://h3.test/"]
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 5), st.integers(0, 2), st.integers(1, 3000)),
    st.tuples(st.just("delete"), st.integers(0, 5), st.integers(0, 2)),
    st.tuples(st.just("advance"), st.integers(1, 1500)),
    st.tuples(st.just("sweep"), st.integers(1, 5)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, budget=st.integers(1, 20))
async def test_store_matches_a_plain_model(ops, budget):
    s = MemoryReplicaStore(bucket_s=0.25, read_budget=budget)
    model: dict[tuple[int, str], tuple[float, dict]] = {}  # (key, holder) -> (expiry, json)
    now = 0.0
    for op in ops:
        if op[0] == "put":
            _, k, h, ttl = op
            r = rec(k, holder=HOLDERS[h], ttl_ms=ttl)
            live = (k, HOLDERS[h]) in model and model[(k, HOLDERS[h])][0] > now
            assert await s.put(r, now) is (not live)
            model[(k, HOLDERS[h])] = (now + ttl / 1000, r.to_json())
        elif op[0] == "delete":
            _, k, h = op
            held = model.pop((k, HOLDERS[h]), None)
            live = held is not None and held[0] > now
            assert await s.delete(COMPAT, SCOPE, key(k), replica_id(HOLDERS[h]), now) is live
        elif op[0] == "advance":
            now += op[1] / 1000
        else:
            await s.sweep(now, budget=op[1])
        keys = [key(i) for i in range(6)]
        hits = await s.lookup(COMPAT, SCOPE, keys, now)
        expected = []
        for i in range(6):
            live = sorted((json.dumps(j, sort_keys=True) for (k, _), (exp, j) in model.items()
                           if k == i and exp > now))
            if not live:
                break
            expected.append(live)
        assert hits.matched == len(expected)
        got = [sorted(json.dumps(r, sort_keys=True) for r in b) for b in replicas(hits)]
        assert got == expected


# ------------------------------------------------------------------ the key index

index_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 199)), max_size=400)


@settings(max_examples=80, deadline=None)
@given(ops=index_ops, seed=st.integers(0, 3))
def test_key_index_matches_a_dict(ops, seed):
    ix = KeyIndex(16, seed=seed)
    model: dict[bytes, int] = {}
    keys = [bytes.fromhex(key(i)) for i in range(200)]
    for add, n in ops:
        k = keys[n]
        if add:
            i = ix.add(k)
            assert model.setdefault(k, i) == i
        elif k in model:
            ix.remove(model.pop(k))
        assert ix.count == len(model)
    assert len(set(model.values())) == len(model)
    for k in keys:
        assert ix.find1(k) == model.get(k, -1)
    found = ix.find(b"".join(keys)).tolist()
    assert found == [model.get(k, -1) for k in keys]
    for k, i in model.items():
        assert ix.key_hex(i) == k.hex()


def test_key_index_grows_shrinks_and_finds_batches():
    ix = KeyIndex(16, seed=1)
    keys = [bytes.fromhex(key(i)) for i in range(5000)]
    ids = [ix.add(k) for k in keys]
    assert ix.count == 5000 and sorted(ids) == list(range(5000))
    assert ix.find(b"".join(keys[::-1])).tolist() == ids[::-1]
    for i in ids[:4900]:
        ix.remove(i)
    assert ix.find(b"".join(keys)).tolist() == [-1] * 4900 + ids[4900:]
    assert ix.find(b"").tolist() == []
    assert ix.add(keys[0]) in ids[:4900]  # a freed id is reused
