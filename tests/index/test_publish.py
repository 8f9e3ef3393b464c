"""Publishing and withdrawing replicas (KVSP §6.1) over HTTP against a real server."""

from __future__ import annotations

import asyncio

import pytest

from index.store import record_json
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from tests.index.conftest import (
    COMPAT,
    H1,
    H2,
    OTHER,
    RELAY,
    SCOPE,
    assert_problem,
    auth,
    key,
    lookup_body,
    path,
    record,
)


async def lookup(http, ix, keys, token="t-pc", **extra):
    r = await http.post(ix.url + "lookup", json=lookup_body(keys, **extra), headers=auth(token))
    assert r.status_code == 200, r.text
    return r.json()


async def test_put_creates_then_refreshes_idempotently(serve, http):
    ix = serve()
    rec = record(key(0))
    r1 = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r1.status_code == 201
    assert r1.json() == {"replica_id": replica_id(H1), "ttl_ms": 60_000}
    assert r1.headers["content-type"] == "application/kvsp+json"
    r2 = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r2.status_code == 200 and r2.json() == r1.json()
    doc = await lookup(http, ix, [key(0)])
    assert doc["matched"] == 1
    assert doc["blocks"] == [{"block_key": key(0), "replicas": [rec]}]
    assert ix.store.records == 1


async def test_stored_record_drops_unknown_members(serve, http):
    ix = serve()
    rec = record(key(0), residency=[{"tier": "device", "layers": [0, 3], "x": 1}],
                 future_member={"a": 1})
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r.status_code == 201
    (got,) = (await lookup(http, ix, [key(0)]))["blocks"][0]["replicas"]
    assert got == ReplicaRecord.from_json(rec).to_json()
    assert "future_member" not in got and "x" not in got["residency"][0]


async def test_publisher_must_be_the_holder_or_act_for_it(serve, http):
    ix = serve()
    rec = record(key(0), holder=H2)
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert_problem(r, 403, "kvsp-forbidden-scope")
    assert ix.store.records == 0
    # A principal allowed to publish for H1 without being it, and an admin, may.
    for token, i in (("t-proxy", 1), ("t-admin", 2)):
        rec = record(key(i), holder=H1)
        r = await http.put(ix.url + path(rec), json=rec, headers=auth(token))
        assert r.status_code == 201, r.text
    assert ix.store.records == 2


async def test_moqt_record_is_published_by_its_http_holder(serve, http):
    ix = serve()
    ns = "AAECAwQ"
    moqt = record(key(0), holder=RELAY, moqt_namespace=ns, http_holder=H1)
    r = await http.put(ix.url + path(moqt), json=moqt, headers=auth("t-h1"))
    assert r.status_code == 201, r.text
    assert r.json()["replica_id"] == replica_id(RELAY, ns)
    # The relay's record behind another holder is not h1's to publish.
    other = record(key(0), holder=RELAY, moqt_namespace="BBBB", http_holder=H2)
    r = await http.put(ix.url + path(other), json=other, headers=auth("t-h1"))
    assert_problem(r, 403, "kvsp-forbidden-scope")
    # One holder's HTTP and MOQT records of one block are two replicas.
    plain = record(key(0))
    r = await http.put(ix.url + path(plain), json=plain, headers=auth("t-h1"))
    assert r.status_code == 201
    doc = await lookup(http, ix, [key(0)])
    assert sorted(r["holder"] for r in doc["blocks"][0]["replicas"]) == [H1, RELAY]


async def test_publisher_must_be_authorized_for_the_scope(serve, http):
    ix = serve()
    rec = record(key(0), scope=OTHER)  # h1 may publish for H1, but not in OTHER
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert_problem(r, 403, "kvsp-forbidden-scope")
    assert ix.store.records == 0


@pytest.mark.parametrize("headers, status", [({}, 401), (auth("t-nobody"), 401),
                                             ({"Authorization": "Basic eDp5"}, 401)])
async def test_unauthenticated_requests_are_refused(serve, http, headers, status):
    ix = serve()
    rec = record(key(0))
    r = await http.put(ix.url + path(rec), json=rec, headers=headers)
    assert_problem(r, status, "kvsp-unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    r = await http.post(ix.url + "lookup", json=lookup_body([key(0)]), headers=headers)
    assert_problem(r, status, "kvsp-unauthorized")
    assert ix.store.records == 0


@pytest.mark.memory_store
async def test_ttl_is_capped_and_the_record_expires(serve, http):
    ix = serve(max_ttl_ms=2_000)
    rec = record(key(0), ttl_ms=60_000)
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r.status_code == 201 and r.json()["ttl_ms"] == 2_000
    doc = await lookup(http, ix, [key(0)])
    assert doc["blocks"][0]["replicas"][0]["ttl_ms"] == 2_000
    ix.clock.advance(1.999)
    assert (await lookup(http, ix, [key(0)]))["matched"] == 1
    ix.clock.advance(0.001)  # now == publication + granted ttl: expired
    assert (await lookup(http, ix, [key(0)]))["matched"] == 0
    text = (await http.get(ix.url + "metrics", headers=auth("t-metrics"))).text
    assert "kvsp_index_ttl_capped_total 1" in text


@pytest.mark.memory_store
async def test_ttl_below_the_cap_is_kept(serve, http):
    ix = serve(max_ttl_ms=2_000)
    rec = record(key(0), ttl_ms=500)
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r.json()["ttl_ms"] == 500
    ix.clock.advance(0.5)
    assert (await lookup(http, ix, [key(0)]))["matched"] == 0


@pytest.mark.memory_store
async def test_refresh_extends_expiry_and_a_lapsed_record_is_created_anew(serve, http):
    ix = serve()
    rec = record(key(0), ttl_ms=1_000)
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 201
    ix.clock.advance(0.9)
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 200
    ix.clock.advance(0.9)  # 1.8 s after the first PUT, 0.9 s after the refresh
    assert (await lookup(http, ix, [key(0)]))["matched"] == 1
    ix.clock.advance(0.1)
    assert (await lookup(http, ix, [key(0)]))["matched"] == 0
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 201


@pytest.mark.memory_store
async def test_expired_records_are_swept_from_memory(serve, http):
    ix = serve()
    recs = [record(key(i), ttl_ms=1_000, layers=1) for i in range(50)]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert r.status_code == 200
    assert ix.store.records == 50
    ix.clock.advance(5)
    assert await ix.store.sweep(ix.clock()) == 50
    assert ix.store.records == 0
    assert "kvsp_index_replica_records 0" in (await http.get(ix.url + "metrics", headers=auth("t-metrics"))).text


@pytest.mark.memory_store
async def test_background_sweeper_runs(serve, http):
    ix = serve(sweep_interval_s=0.02)
    rec = record(key(0), ttl_ms=1_000)
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    ix.clock.advance(2)
    for _ in range(200):  # at most ~2 s
        if ix.store.records == 0:
            break
        await asyncio.sleep(0.01)
    assert ix.store.records == 0


async def test_delete_withdraws(serve, http):
    ix = serve()
    rec = record(key(0))
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    r = await http.delete(ix.url + path(rec), headers=auth("t-h1"))
    assert r.status_code == 204
    assert (await lookup(http, ix, [key(0)]))["matched"] == 0
    assert ix.store.records == 0
    assert_problem(await http.delete(ix.url + path(rec), headers=auth("t-h1")), 404,
                   "kvsp-not-found")


async def test_delete_by_another_holder_is_refused(serve, http):
    ix = serve()
    rec = record(key(0))
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert_problem(await http.delete(ix.url + path(rec), headers=auth("t-h2")), 403,
                   "kvsp-forbidden-scope")
    assert (await lookup(http, ix, [key(0)]))["matched"] == 1
    # The publisher acting for H1 may withdraw it.
    assert (await http.delete(ix.url + path(rec), headers=auth("t-proxy"))).status_code == 204


async def test_delete_outside_the_scope_reveals_nothing(serve, http):
    ix = serve()
    rec = record(key(0))
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    absent = record(key(1))
    present = await http.delete(ix.url + path(rec), headers=auth("t-out"))
    missing = await http.delete(ix.url + path(absent), headers=auth("t-out"))
    a = assert_problem(present, 403, "kvsp-forbidden-scope")
    b = assert_problem(missing, 403, "kvsp-forbidden-scope")
    a.pop("instance"), b.pop("instance")
    assert a == b
    assert ix.store.records == 1


@pytest.mark.memory_store
async def test_delete_of_an_expired_record_is_not_found(serve, http):
    ix = serve()
    rec = record(key(0), ttl_ms=100)
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    ix.clock.advance(0.1)
    assert_problem(await http.delete(ix.url + path(rec), headers=auth("t-h1")), 404,
                   "kvsp-not-found")


# ------------------------------------------------------------------ malformed input


@pytest.mark.parametrize("mutate, member", [
    (lambda r: r.pop("digest"), "digest"),
    (lambda r: r.update(size=-1), "size"),
    (lambda r: r.update(ttl_ms=0), "ttl_ms"),
    (lambda r: r.update(holder="ftp://x/"), "holder"),
    (lambda r: r.update(digest="sha-256:" + "00" * 32), "digest"),
    (lambda r: r.update(layer_digests=["zz"]), "layer_digests[0]"),
    (lambda r: r.update(residency=[{"tier": "host", "layers": [0, 1]},
                                   {"tier": "disk", "layers": [1, 2]}]), "residency"),
    (lambda r: r.update(residency=[{"tier": "host", "layers": [0, 9]}]), "residency[0].layers"),
])
async def test_malformed_record_is_refused_naming_the_member(serve, http, mutate, member):
    ix = serve()
    rec = record(key(0))
    url = ix.url + path(rec)
    mutate(rec)
    r = await http.put(url, json=rec, headers=auth("t-h1"))
    doc = assert_problem(r, 400, "kvsp-bad-record", member)
    assert member in doc["detail"]
    assert ix.store.records == 0


async def test_body_that_is_not_json_is_refused(serve, http):
    ix = serve()
    rec = record(key(0))
    r = await http.put(ix.url + path(rec), content=b"{not json", headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", "body")
    r = await http.put(ix.url + path(rec), json=[rec], headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", "record")
    assert ix.store.records == 0


@pytest.mark.parametrize("member", ["compat_id", "scope_id", "block_key", "replica_id"])
async def test_path_must_name_the_record(serve, http, member):
    ix = serve()
    rec = record(key(0))
    compat, scope, block, rid = COMPAT, SCOPE, key(0), replica_id(H1)
    if member == "compat_id":
        compat = "c1" * 32
    elif member == "scope_id":
        scope = OTHER
    elif member == "block_key":
        block = key(1)
    else:
        rid = replica_id(H2)
    r = await http.put(ix.url + f"replicas/{compat}/{scope}/{block}/{rid}", json=rec,
                       headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", member)
    assert ix.store.records == 0


@pytest.mark.parametrize("segment, member", [(0, "compat_id"), (1, "scope_id"),
                                             (2, "block_key"), (3, "replica_id")])
async def test_malformed_path_segments_are_refused(serve, http, segment, member):
    ix = serve()
    rec = record(key(0))
    parts = path(rec).split("/")
    parts[1 + segment] = "xyz"
    r = await http.put(ix.url + "/".join(parts), json=rec, headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", member)
    r = await http.delete(ix.url + "/".join(parts), headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", member)
    assert ix.store.records == 0


async def test_upper_case_path_is_the_same_resource(serve, http):
    ix = serve()
    rec = record(key(0))
    r = await http.put(ix.url + path(rec).upper().replace("REPLICAS", "replicas"), json=rec,
                       headers=auth("t-h1"))
    assert r.status_code == 201, r.text
    assert (await http.delete(ix.url + path(rec), headers=auth("t-h1"))).status_code == 204


async def test_oversized_record_is_refused(serve, http):
    ix = serve(max_record_bytes=4096)
    rec = record(key(0), layers=64)
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert_problem(r, 413, "kvsp-too-large", "body")


# ------------------------------------------------------------------ batches


async def test_batch_publishes_and_refreshes_with_counts(serve, http):
    ix = serve(max_ttl_ms=30_000)
    recs = [record(key(i), ttl_ms=10_000 * (i + 1)) for i in range(5)]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert r.status_code == 200
    assert r.json() == {"created": 5, "refreshed": 0, "ttl_capped": 2, "max_ttl_ms": 30_000}
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert r.json()["created"] == 0 and r.json()["refreshed"] == 5
    doc = await lookup(http, ix, [key(i) for i in range(5)])
    assert doc["matched"] == 5
    assert [b["replicas"][0]["ttl_ms"] for b in doc["blocks"]] == [10_000, 20_000, 30_000,
                                                                   30_000, 30_000]


async def test_batch_is_all_or_nothing(serve, http):
    ix = serve()
    recs = [record(key(i)) for i in range(3)]
    del recs[1]["digest"]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    doc = assert_problem(r, 400, "kvsp-bad-record", "records[1].digest")
    assert "records[1].digest" in doc["detail"]
    recs = [record(key(0)), record(key(1), holder=H2)]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert_problem(r, 403, "kvsp-forbidden-scope", "records[1]")
    recs = [record(key(0)), record(key(1), scope=OTHER)]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert_problem(r, 403, "kvsp-forbidden-scope", "records[1].scope_id")
    assert ix.store.records == 0


async def test_batch_limits(serve, http):
    ix = serve()
    recs = [record(key(i), layers=1) for i in range(1001)]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert_problem(r, 400, "kvsp-bad-record", "records")
    assert ix.store.records == 0
    r = await http.post(ix.url + "replicas:batch", json={"records": recs[:1000]},
                        headers=auth("t-h1"))
    assert r.status_code == 200 and r.json()["created"] == 1000
    for body, member in (({}, "records"), ({"records": {}}, "records"), ([], "body"),
                         ({"records": [1]}, "records[0]")):
        r = await http.post(ix.url + "replicas:batch", json=body, headers=auth("t-h1"))
        assert_problem(r, 400, "kvsp-bad-record", member)


async def test_index_client_round_trip(serve):
    ix = serve()
    recs = [ReplicaRecord.from_json(record(key(i))) for i in range(3)]
    async with IndexClient(ix.url, token="t-h1") as client:
        await client.put(recs[0])
        await client.put_many(recs[1:])
        async with IndexClient(ix.url, token="t-pc") as pc:
            result = await pc.lookup(SCOPE, COMPAT, [key(0), key(1), key(2), key(3)])
        assert result.matched == 3
        assert [b.replicas for b in result.blocks] == [(r,) for r in recs]
        await client.delete(recs[1])
        await client.delete(recs[1])  # already gone: a 404 the client ignores
    assert ix.store.records == 2
    assert record_json(recs[0]) in (await ix.store.lookup(COMPAT, SCOPE, [key(0)], 0)).blocks[0]
