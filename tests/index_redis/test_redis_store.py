"""RedisReplicaStore against a real redis-server: the semantics of `index.store`, expiry by
Redis TTL with short real TTLs, the key layout, and one round trip per lookup."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio.connection as redis_connection

from index.redis_store import RedisReplicaStore, StoreUnavailable
from index.store import ReplicaSummary, record_json
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from tests.index.conftest import COMPAT, H1, H2, OTHER, RELAY, SCOPE, key, record
from tests.index_redis.redis_server import free_port
from tests.polling import eventually


def rec(i: int, holder: str = H1, ttl_ms: int = 60_000, scope: str = SCOPE,
        **kw) -> ReplicaRecord:
    return ReplicaRecord.from_json(record(key(i), holder=holder, ttl_ms=ttl_ms, scope=scope,
                                          layers=1, **kw))


def replicas(hits) -> list[list[dict]]:
    return [json.loads(b)["replicas"] for b in hits.blocks]


async def matched(store, keys, scope: str = SCOPE) -> int:
    return (await store.lookup(COMPAT, scope, keys, 0.0)).matched


async def test_put_get_delete_and_identity(store):
    s = store
    assert await s.put(rec(0), 0.0) is True
    assert await s.put(rec(0), 0.1) is False  # refresh
    assert await s.put(rec(0, holder=H2), 0.1) is True  # another holder: another replica
    ns_a = rec(0, holder=RELAY, moqt_namespace="AAAA", http_holder=H1)
    ns_b = rec(0, holder=RELAY, moqt_namespace="BBBB", http_holder=H2)
    assert await s.put(ns_a, 0.1) and await s.put(ns_b, 0.1)  # two holders behind one relay
    assert s.records == 4 and await s.count() == 4
    got = await s.get(COMPAT, SCOPE, key(0), replica_id(RELAY, "AAAA"), 100.0)
    assert got is not None and got.json == record_json(ns_a)
    assert got.summary == ReplicaSummary.of(ns_a)
    assert 159.0 < got.expires <= 160.0  # the caller's clock plus the remaining TTL
    assert await s.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is True
    assert await s.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is False
    assert await s.get(COMPAT, SCOPE, key(0), replica_id(H1), 0.2) is None
    hits = await s.lookup(COMPAT, SCOPE, [key(0)], 0.2)
    assert [r["holder"] for r in replicas(hits)[0]] == [H2, RELAY, RELAY]
    assert await s.get(COMPAT, OTHER, key(0), replica_id(H2), 0.2) is None
    assert s.records == 3 and await s.count() == 3


async def test_replicas_keep_publication_order_across_refreshes(store):
    for holder in (H1, H2, RELAY):
        kw = {"moqt_namespace": "AAAA", "http_holder": H1} if holder == RELAY else {}
        await store.put(rec(0, holder=holder, **kw), 0.0)
    await store.put(rec(0, holder=H1, ttl_ms=90_000), 0.0)  # a refresh keeps its place
    hits = await store.lookup(COMPAT, SCOPE, [key(0)], 0.0)
    assert [r["holder"] for r in replicas(hits)[0]] == [H1, H2, RELAY]
    assert replicas(hits)[0][0]["ttl_ms"] == 90_000
    await store.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.0)
    await store.put(rec(0, holder=H1), 0.0)  # withdrawn and published again: last
    hits = await store.lookup(COMPAT, SCOPE, [key(0)], 0.0)
    assert [r["holder"] for r in replicas(hits)[0]] == [H2, RELAY, H1]


async def test_lookup_stops_at_the_first_key_without_a_replica(store):
    assert await store.put_many([rec(i) for i in (0, 1, 3, 4)], 0.0) == 4
    hits = await store.lookup(COMPAT, SCOPE, [key(i) for i in range(5)], 0.0)
    assert hits.matched == 2 and len(hits.blocks) == 2
    assert [json.loads(b)["block_key"] for b in hits.blocks] == [key(0), key(1)]
    assert await matched(store, [key(2), key(3)]) == 0
    empty = await store.lookup(COMPAT, SCOPE, [], 0.0, summaries=True)
    assert (empty.matched, empty.blocks, empty.summaries) == (0, [], [])


async def test_lookup_keys_are_answered_in_lower_case(store):
    await store.put(rec(0), 0.0)
    hits = await store.lookup(COMPAT, SCOPE, [key(0).upper()], 0.0)
    assert json.loads(hits.blocks[0])["block_key"] == key(0)
    with pytest.raises(ValueError):
        await store.lookup(COMPAT, SCOPE, [key(0)[:62]], 0.0)
    with pytest.raises(ValueError):
        await store.lookup(COMPAT, SCOPE, [key(0)[:63] + "*"], 0.0)


async def test_elements_are_those_of_the_memory_store(store):
    """The spliced response is the same octets whichever store answers it."""
    from index.store import MemoryReplicaStore

    memory = MemoryReplicaStore()
    records = [rec(i % 7, holder=(H1, H2)[i % 2]) for i in range(20)]
    for r in records:
        await store.put(r, 0.0)
        await memory.put(r, 0.0)
    keys = [key(i) for i in range(8)]
    for summaries in (False, True):
        a = await store.lookup(COMPAT, SCOPE, keys, 0.0, summaries=summaries)
        b = await memory.lookup(COMPAT, SCOPE, keys, 0.0, summaries=summaries)
        assert a == b and a.matched == 7


async def test_scopes_never_mix_and_keys_follow_the_documented_layout(store):
    await store.put(rec(0), 0.0)
    await store.put(rec(0, holder=H2, scope=OTHER), 0.0)
    hits = await store.lookup(COMPAT, OTHER, [key(0)], 0.0)
    assert [r["holder"] for r in replicas(hits)[0]] == [H2]
    hits = await store.lookup(COMPAT, SCOPE, [key(0)], 0.0)
    assert [r["scope_id"] for r in replicas(hits)[0]] == [SCOPE]
    names = sorted(k.decode() for k in await store.client().keys("*"))
    assert names == sorted([
        f"kvsp:{{{COMPAT}:{OTHER}}}:b:{key(0)}", f"kvsp:{{{COMPAT}:{OTHER}}}:n",
        f"kvsp:{{{COMPAT}:{OTHER}}}:r:{key(0)}:{replica_id(H2)}",
        f"kvsp:{{{COMPAT}:{SCOPE}}}:b:{key(0)}", f"kvsp:{{{COMPAT}:{SCOPE}}}:n",
        f"kvsp:{{{COMPAT}:{SCOPE}}}:r:{key(0)}:{replica_id(H1)}", "kvsp:spaces",
    ])
    # Every key of a space carries its hash tag, so one Redis Cluster slot holds the space.
    tagged = [n for n in names if n != "kvsp:spaces"]
    assert all(n[n.index("{"):n.index("}") + 1] in (f"{{{COMPAT}:{SCOPE}}}",
                                                    f"{{{COMPAT}:{OTHER}}}") for n in tagged)


async def test_a_lookup_is_one_round_trip(store, monkeypatch):
    await store.put_many([rec(i) for i in range(300)], 0.0)
    await store.lookup(COMPAT, SCOPE, [key(0)], 0.0)  # connected beforehand
    sends = []
    real = redis_connection.AbstractConnection.send_packed_command

    async def counting(self, command, check_health=True):
        sends.append(command)
        return await real(self, command, check_health)

    monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command", counting)
    hits = await store.lookup(COMPAT, SCOPE, [key(i) for i in range(300)] + [key(999)], 0.0)
    assert hits.matched == 300 and len(sends) == 1


async def test_lookup_of_many_keys(store):
    records = [rec(i) for i in range(5000)]
    for start in range(0, 5000, 1000):
        await store.put_many(records[start:start + 1000], 0.0)
    assert store.records == 5000
    hits = await store.lookup(COMPAT, SCOPE, [key(i) for i in range(5000)], 0.0)
    assert hits.matched == 5000 and hits.blocks[4999].startswith(b'{"block_key":"%s"'
                                                                 % key(4999).encode())


async def test_summaries_match_the_records(store):
    tiers = [{"tier": "device", "layers": [0, 1]},
             {"tier": "host", "layers": [2, 3], "read_mbit_per_s": 1000}]
    plain = ReplicaRecord.from_json(record(key(0), residency=tiers))
    moqt = ReplicaRecord.from_json(record(key(0), holder=RELAY, moqt_namespace="AAAA",
                                          http_holder=H1, residency=tiers))
    bare = ReplicaRecord.from_json({k: v for k, v in record(key(0), holder=H2).items()
                                    if k != "layer_digests"})
    for r in (plain, moqt, bare):
        await store.put(r, 0.0)
    hits = await store.lookup(COMPAT, SCOPE, [key(0)], 0.0, summaries=True)
    assert hits.summaries == [[ReplicaSummary.of(plain), ReplicaSummary.of(moqt),
                               ReplicaSummary.of(bare)]]
    assert hits.summaries[0][2].layer_count is None
    # Records of one holder share one summary object, as placement's estimates expect.
    await store.put(ReplicaRecord.from_json(record(key(1), residency=tiers)), 0.0)
    hits = await store.lookup(COMPAT, SCOPE, [key(0), key(1)], 0.0, summaries=True)
    assert hits.summaries[0][0] is hits.summaries[1][0]


# ------------------------------------------------------------------ expiry by Redis TTL


async def test_a_record_expires_after_its_ttl(store):
    start = time.monotonic()
    await store.put(rec(0, ttl_ms=200), 0.0)
    assert await matched(store, [key(0)]) == 1
    await eventually(lambda: _is(matched(store, [key(0)]), 0), timeout=3.0, what="the record expired")
    assert time.monotonic() - start >= 0.19
    assert await store.get(COMPAT, SCOPE, key(0), replica_id(H1), 0.0) is None
    assert await store.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.0) is False
    assert await store.put(rec(0, ttl_ms=200), 0.0) is True  # a lapsed record is new again


async def test_a_refresh_may_shorten_the_ttl(store):
    await store.put(rec(0, ttl_ms=60_000), 0.0)
    await store.put(rec(0, ttl_ms=200), 0.0)
    await eventually(lambda: _is(matched(store, [key(0)]), 0), timeout=3.0, what="the record expired")


async def test_one_expired_replica_leaves_the_others(store):
    await store.put(rec(0, ttl_ms=200), 0.0)
    await store.put(rec(0, holder=H2), 0.0)
    await store.put(rec(1), 0.0)

    async def only_h2() -> bool:
        hits = await store.lookup(COMPAT, SCOPE, [key(0), key(1)], 0.0, summaries=True)
        return [r["holder"] for r in replicas(hits)[0]] == [H2]

    await eventually(only_h2, timeout=3.0, what="only H2's replicas")
    hits = await store.lookup(COMPAT, SCOPE, [key(0), key(1)], 0.0, summaries=True)
    assert hits.matched == 2 and [x.holder for x in hits.summaries[0]] == [H2]
    # A new replica of the key drops the dead entry from the key's index.
    await store.put(rec(0, holder=RELAY, moqt_namespace="AAAA", http_holder=H1), 0.0)
    members = await store.client().zrange(store.space(COMPAT, SCOPE) + f"b:{key(0)}", 0, -1)
    assert [m.decode() for m in members] == [replica_id(H2), replica_id(RELAY, "AAAA")]


async def test_a_key_whose_replicas_all_expired_ends_the_match(store):
    await store.put_many([rec(0), rec(1, ttl_ms=200), rec(2)], 0.0)
    await store.put(rec(1, holder=H2, ttl_ms=400), 0.0)
    assert await matched(store, [key(0), key(1), key(2)]) == 3
    await eventually(lambda: _is(matched(store, [key(0), key(1), key(2)]), 1), timeout=3.0,
                     what="one block matched")


async def test_the_gauge_counts_writes_and_expiry(store, redis_url):
    await store.put_many([rec(i, ttl_ms=200) for i in range(10)] + [rec(10)], 0.0)
    assert store.records == 11
    # Another process's store learns the count from Redis, on its first sweep.
    other = RedisReplicaStore(redis_url, count_interval_s=0.0)
    try:
        assert other.records == 0 and await other.sweep(0.0) == 0 and other.records == 11
        # Expired records leave the count once their expiry second has passed.
        await eventually(lambda: _is(other.count(), 1), timeout=3.0, what="one record in the other store")
        assert other.records == 1
        await store.delete(COMPAT, SCOPE, key(10), replica_id(H1), 0.0)
        assert await other.count() == 0
        assert await store.client().smembers(store.spaces_key) == set()
    finally:
        await other.aclose()


async def test_sweep_recounts_at_its_interval_and_reclaims_nothing(redis_url):
    s = RedisReplicaStore(redis_url, count_interval_s=10.0)
    try:
        await s.put(rec(0), 0.0)
        s._total = 99  # as if this process had missed writes of others
        assert await s.sweep(100.0) == 0 and s.records == 1
        s._total = 99
        assert await s.sweep(105.0) == 0 and s.records == 99  # within the interval
        assert await s.sweep(110.0) == 0 and s.records == 1
    finally:
        await s.aclose()


async def _is(awaitable, value) -> bool:
    return await awaitable == value


# ------------------------------------------------------------------ failures and restarts


async def test_an_unreachable_redis_is_store_unavailable():
    s = RedisReplicaStore(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5,
                          retry=None)
    try:
        for call in (s.put(rec(0), 0.0), s.lookup(COMPAT, SCOPE, [key(0)], 0.0),
                     s.get(COMPAT, SCOPE, key(0), replica_id(H1), 0.0),
                     s.delete(COMPAT, SCOPE, key(0), replica_id(H1), 0.0), s.count()):
            with pytest.raises(StoreUnavailable) as e:
                await call
            assert e.value.status == 503 and "127.0.0.1" in e.value.detail
    finally:
        await s.aclose()


async def test_a_full_redis_refuses_writes_as_store_unavailable(own_redis):
    s = RedisReplicaStore(own_redis().url)
    try:
        await s.put(rec(0), 0.0)
        client = s.client()
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)  # one octet: every write is refused
        with pytest.raises(StoreUnavailable) as e:
            await s.put(rec(1), 0.0)
        assert e.value.status == 503
        assert await matched(s, [key(0), key(1)]) == 1  # lookups go on
        await client.config_set("maxmemory", 0)
        assert await s.put(rec(1), 0.0) is True
    finally:
        await s.aclose()


async def test_scripts_lost_by_the_server_are_loaded_again(store):
    await store.put(rec(0), 0.0)
    await store.client().script_flush()
    assert await store.put(rec(1), 0.0) is True
    await store.client().script_flush()
    assert await store.delete(COMPAT, SCOPE, key(1), replica_id(H1), 0.0) is True
    await store.client().script_flush()
    assert await store.count() == 1


async def test_the_store_reconnects_after_a_redis_restart(own_redis):
    server = own_redis(persistent=True)
    s = RedisReplicaStore(server.url)
    try:
        await s.put_many([rec(i) for i in range(10)], 0.0)
        assert await matched(s, [key(i) for i in range(10)]) == 10
        server.restart()  # the pooled connections are now dead
        assert await matched(s, [key(i) for i in range(10)]) == 10
        assert await s.put(rec(10), 0.0) is True
        assert await s.delete(COMPAT, SCOPE, key(10), replica_id(H1), 0.0) is True
    finally:
        await s.aclose()


def test_bad_urls_and_prefixes_are_refused():
    with pytest.raises(ValueError):
        RedisReplicaStore("redis://127.0.0.1:notaport/0")
    with pytest.raises(ValueError):
        RedisReplicaStore("http://127.0.0.1/")
    with pytest.raises(ValueError):
        RedisReplicaStore("redis://127.0.0.1:6379/0", prefix="a{b}")
    assert "secret" not in repr(RedisReplicaStore("redis://:secret@127.0.0.1:6379/0"))


async def test_prefixes_keep_two_indexes_apart(redis_url):
    a, b = RedisReplicaStore(redis_url, prefix="a"), RedisReplicaStore(redis_url, prefix="b")
    try:
        await a.put(rec(0), 0.0)
        assert await matched(a, [key(0)]) == 1 and await matched(b, [key(0)]) == 0
    finally:
        await a.aclose()
        await b.aclose()


async def test_publication_order_holds_when_the_script_is_loaded_mid_pipeline(redis_url):
    """Batches that straddle several script calls, sent while the server has lost the PUT
    script and another client loads it: every key keeps its replicas in batch order."""
    from index.redis_store import _PUT_CHUNK, _put

    def big(i: int, holder: str) -> ReplicaRecord:  # 32 layer digests: calls of ~300 kB
        return ReplicaRecord.from_json(record(key(i), holder=holder, layers=32))

    stores = [RedisReplicaStore(redis_url) for _ in range(4)]
    admin = stores[3].client()
    try:
        for round_ in range(10):
            await admin.script_flush()
            batches = []
            for b in range(3):
                records = []
                # Two replicas per key, so that every call boundary splits one key's pair.
                for i in range(3 * _PUT_CHUNK + 1):
                    k = 100_000 * round_ + 10_000 * b + i
                    records += [big(k, H1), big(k, H2)]
                batches.append(records[1:])  # odd offset: pairs straddle the boundaries

            async def load_soon(delay: float) -> None:
                await asyncio.sleep(delay)
                await admin.script_load(_put.source)

            await asyncio.gather(*(s.put_many(batch, 0.0) for s, batch in zip(stores, batches)),
                                 load_soon(0.003 * round_))
            for batch in batches:
                keys = list(dict.fromkeys(r.block_key for r in batch))[1:]
                hits = await stores[0].lookup(COMPAT, SCOPE, keys, 0.0)
                assert hits.matched == len(keys)
                assert all([r["holder"] for r in reps] == [H1, H2] for reps in replicas(hits)), \
                    f"replicas out of publication order in round {round_}"
    finally:
        for s in stores:
            await s.aclose()
