"""Lookup (KVSP §6.2) and its §6.4 estimates, over HTTP against a real server."""

from __future__ import annotations

import json

import pytest

from index.app import plan_fetch_us
from index.store import ReplicaSummary
from kvsp_moq.protocol import cost
from kvsp_moq.protocol.records import InstanceStatus, ReplicaRecord
from tests.index.conftest import (
    COMPAT,
    H1,
    H2,
    OTHER,
    SCOPE,
    assert_problem,
    auth,
    key,
    lookup_body,
    path,
    record,
)

II = "http://ii.test/kvsp/"


async def publish(http, ix, recs, token="t-h1"):
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth(token))
    assert r.status_code == 200, r.text


async def lookup(http, ix, keys, token="t-pc", **extra):
    r = await http.post(ix.url + "lookup", json=lookup_body(keys, **extra), headers=auth(token))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/kvsp+json"
    return r.json()


async def test_matched_counts_leading_keys_and_lists_their_replicas(serve, http):
    ix = serve()
    recs = [record(key(i)) for i in range(3)]
    await publish(http, ix, recs)
    await publish(http, ix, [record(key(1), holder=H2)], token="t-h2")
    doc = await lookup(http, ix, [key(0), key(1), key(2)])
    assert doc == {
        "matched": 3,
        "blocks": [
            {"block_key": key(0), "replicas": [recs[0]]},
            {"block_key": key(1), "replicas": [recs[1], record(key(1), holder=H2)]},
            {"block_key": key(2), "replicas": [recs[2]]},
        ],
    }


async def test_matched_stops_at_the_first_key_without_a_replica(serve, http):
    ix = serve()
    await publish(http, ix, [record(key(i)) for i in (0, 1, 3, 4)])
    doc = await lookup(http, ix, [key(i) for i in range(5)])
    assert doc["matched"] == 2
    assert [b["block_key"] for b in doc["blocks"]] == [key(0), key(1)]
    doc = await lookup(http, ix, [key(2), key(3), key(4)])
    assert doc == {"matched": 0, "blocks": []}
    assert await lookup(http, ix, []) == {"matched": 0, "blocks": []}


@pytest.mark.memory_store
async def test_a_key_whose_replicas_all_expired_ends_the_match(serve, http):
    ix = serve()
    await publish(http, ix, [record(key(0)), record(key(1), ttl_ms=500), record(key(2))])
    await publish(http, ix, [record(key(1), holder=H2, ttl_ms=800)], token="t-h2")
    ix.clock.advance(0.5)
    doc = await lookup(http, ix, [key(0), key(1), key(2)])
    assert doc["matched"] == 3
    assert [r["holder"] for r in doc["blocks"][1]["replicas"]] == [H2]
    ix.clock.advance(0.3)
    doc = await lookup(http, ix, [key(0), key(1), key(2)])
    assert doc["matched"] == 1


async def test_lookup_for_a_scope_the_client_may_not_use_is_refused_alike(serve, http):
    ix = serve()
    await publish(http, ix, [record(key(0))])
    stored = await http.post(ix.url + "lookup", json=lookup_body([key(0)]), headers=auth("t-out"))
    absent = await http.post(ix.url + "lookup", json=lookup_body([key(9)]), headers=auth("t-out"))
    a = assert_problem(stored, 403, "kvsp-forbidden-scope")
    b = assert_problem(absent, 403, "kvsp-forbidden-scope")
    assert a == b and stored.content == absent.content
    assert key(0) not in stored.text


async def test_replicas_of_another_scope_are_never_returned(serve, http):
    ix = serve()
    await publish(http, ix, [record(key(0))])  # SCOPE, by h1
    other = record(key(0), holder=H2, scope=OTHER)  # the same key in OTHER, by h2
    await publish(http, ix, [other], token="t-h2")
    doc = await lookup(http, ix, [key(0)], token="t-h2", scope=OTHER)
    assert doc["blocks"] == [{"block_key": key(0), "replicas": [other]}]
    doc = await lookup(http, ix, [key(0)], token="t-pc")
    assert [r["scope_id"] for r in doc["blocks"][0]["replicas"]] == [SCOPE]


async def test_lookup_keys_are_case_insensitive_and_answered_in_lower_case(serve, http):
    ix = serve()
    await publish(http, ix, [record(key(0)), record(key(1))])
    doc = await lookup(http, ix, [key(0).upper(), key(1)])
    assert doc["matched"] == 2 and doc["blocks"][0]["block_key"] == key(0)


@pytest.mark.parametrize("body, member", [
    ({"compat_id": COMPAT, "block_keys": []}, "scope_id"),
    ({"scope_id": SCOPE, "block_keys": []}, "compat_id"),
    ({"scope_id": SCOPE, "compat_id": COMPAT}, "block_keys"),
    ({"scope_id": "zz", "compat_id": COMPAT, "block_keys": []}, "scope_id"),
    ({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": "ab"}, "block_keys"),
    ({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [key(0), "ab"]}, "block_keys[1]"),
    ({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [key(0), 7]}, "block_keys[1]"),
    ({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [key(0)[:62] + " 0"]},
     "block_keys[0]"),
    ({"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [], "targets": ["x"]},
     "targets[0]"),
    ([], "record"),
])
async def test_malformed_lookup_is_refused_naming_the_member(serve, http, body, member):
    ix = serve()
    r = await http.post(ix.url + "lookup", json=body, headers=auth("t-pc"))
    assert_problem(r, 400, "kvsp-bad-record", member)


async def test_lookup_key_limit(serve, http):
    ix = serve(max_lookup_keys=10)
    r = await http.post(ix.url + "lookup", json=lookup_body([key(i) for i in range(11)]),
                        headers=auth("t-pc"))
    assert_problem(r, 400, "kvsp-bad-record", "block_keys")


# ------------------------------------------------------------------ targets (§6.4)

SLOW_TIERS = [{"tier": "device", "layers": [0, 1]},
              {"tier": "host", "layers": [2, 3], "read_mbit_per_s": 1000}]


def status(instance: str, prefill: float, links: list[dict], **extra) -> InstanceStatus:
    return InstanceStatus.from_json({"instance": instance, "epoch": 1, "state": "active",
                                     "ttl_ms": 3000, "prefill_tokens_per_s": prefill,
                                     "links": links, **extra})


async def targets_fixture(serve, http, **settings):
    ix = serve(block_tokens={COMPAT: 16}, **settings)
    # k0 only at H1 (half its layers on a slow host tier); k1 at H1 and at H2.
    await publish(http, ix, [record(key(0), residency=SLOW_TIERS),
                             record(key(1), residency=SLOW_TIERS)])
    await publish(http, ix, [record(key(1), holder=H2)], token="t-h2")
    ix.instances.put(status(II, 16_000, [
        {"holder": H1, "mbit_per_s": 8000, "rtt_us": 10},
        {"holder": H2, "mbit_per_s": 80_000, "rtt_us": 50}]))
    # An instance that is itself holder H2, so k1 is already resident there.
    ix.instances.put(status(H2, 32_000, [{"holder": H1, "mbit_per_s": 8000, "rtt_us": 10}]))
    ix.instances.put(status("http://idle.test/", 0, []))  # no measured prefill rate
    return ix


async def test_targets_carry_the_section_6_4_estimates(serve, http):
    ix = await targets_fixture(serve, http)
    doc = await lookup(http, ix, [key(0), key(1), key(2)],
                       targets=[II, H2, "http://unknown.test/", "http://idle.test/"])
    assert doc["matched"] == 2
    # Per block from H1: layers 0-1 (2e6 octets) at the 8000 Mbit/s link = 2000 us, layers 2-3
    # at the host tier's 1000 Mbit/s = 16000 us. k1 comes faster from H2:
    # 8 * 4e6 / 80000 = 400 us. fetch_us = max(10 + 18000, 50 + 400) = 18010.
    # recompute_us = 1e6 * 2 blocks * 16 tokens / 16000 = 2000.
    # At H2, k1 is resident: only k0 loads, from H1: 18010; recompute 1e6 * 32 / 32000 = 1000.
    # Unknown instances and those without a prefill rate cannot be estimated: left out.
    assert doc["targets"] == [
        {"instance": II, "fetch_us": 18010.0, "recompute_us": 2000.0},
        {"instance": H2, "fetch_us": 18010.0, "recompute_us": 1000.0},
    ]


async def test_targets_estimate_equals_cost_fetch_us_of_the_chosen_plan(serve, http):
    ix = await targets_fixture(serve, http)
    hits = await ix.store.lookup(COMPAT, SCOPE, [key(0), key(1)], ix.clock(), summaries=True)
    st = ix.instances.get(II)
    plan = [ReplicaRecord.from_json(record(key(0), residency=SLOW_TIERS)),
            ReplicaRecord.from_json(record(key(1), holder=H2))]
    assert plan_fetch_us(st, II, hits.summaries) == pytest.approx(cost.fetch_us(st, plan))
    # Many blocks from one source add up, as cost.fetch_us adds them.
    many = [[ReplicaSummary.of(plan[0])]] * 100
    assert plan_fetch_us(st, II, many) == pytest.approx(cost.fetch_us(st, [plan[0]] * 100))


async def test_targets_need_a_block_size(serve, http):
    ix = await targets_fixture(serve, http)
    ix.settings.block_tokens = {}
    doc = await lookup(http, ix, [key(0)], targets=[II])
    assert doc["targets"] == []
    ix.settings.default_block_tokens = 32
    doc = await lookup(http, ix, [key(0)], targets=[II])
    assert doc["targets"][0]["recompute_us"] == 2000.0


async def test_expired_instance_status_is_not_used(serve, http):
    ix = await targets_fixture(serve, http)
    ix.clock.advance(3.0)  # the statuses' ttl_ms
    doc = await lookup(http, ix, [key(0)], targets=[II])
    assert doc["targets"] == []


async def test_targets_with_nothing_matched_cost_nothing(serve, http):
    ix = await targets_fixture(serve, http)
    doc = await lookup(http, ix, [key(5)], targets=[II])
    assert doc == {"matched": 0, "blocks": [],
                   "targets": [{"instance": II, "fetch_us": 0.0, "recompute_us": 0.0}]}


async def test_stale_epoch_status_is_discarded(clock):
    from index.store import MemoryInstanceDirectory

    d = MemoryInstanceDirectory(clock)
    assert d.put(status(II, 1000, [], epoch=5)) is True
    assert d.put(status(II, 2000, [], epoch=4)) is False
    assert d.get(II.rstrip("/")).prefill_tokens_per_s == 1000


# ------------------------------------------------------------------ service routes


async def test_healthz_and_metrics(serve, http):
    ix = serve()
    r = await http.get(ix.url + "healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    await publish(http, ix, [record(key(i)) for i in range(3)])
    await lookup(http, ix, [key(0), key(1), key(7)])
    for token in (None, "t-h1", "t-pc"):  # counters over every tenant: the scraper's only
        refused = await http.get(ix.url + "metrics", headers=auth(token) if token else {})
        assert refused.status_code == (401 if token is None else 403)
    r = await http.get(ix.url + "metrics", headers=auth("t-metrics"))
    assert r.status_code == 200
    text = r.text
    for line in ("kvsp_index_lookups_total 1", "kvsp_index_lookup_keys_total 3",
                 "kvsp_index_lookup_matched_total 2", "kvsp_index_replicas_put_total 3",
                 "kvsp_index_replica_records 3"):
        assert line in text.splitlines(), text
    assert 'route="/lookup",status="200"' in text


async def test_unknown_route_and_method_are_problems(serve, http):
    ix = serve()
    r = await http.get(ix.url + "lookup", headers=auth("t-pc"))
    assert r.status_code == 405
    assert r.headers["content-type"].startswith("application/problem+json")
    r = await http.get(ix.url + "nothing", headers=auth("t-pc"))
    assert r.status_code == 404


async def test_open_server_allows_everything(serve, http):
    from kvsp_moq.auth import Authenticator

    ix = serve(auth=Authenticator.open())
    rec = record(key(0), holder=H2, scope=OTHER)
    assert (await http.put(ix.url + path(rec), json=rec)).status_code == 201
    r = await http.post(ix.url + "lookup", json=lookup_body([key(0)], scope=OTHER))
    assert r.json()["matched"] == 1


@pytest.mark.parametrize("n, piece_bytes", [(0, 1 << 20), (1, 1 << 20), (5, 1), (5, 300),
                                            (40, 1 << 20)])
@pytest.mark.parametrize("targets", [None, [], [{"instance": II, "fetch_us": 1.0,
                                                  "recompute_us": 2.0}]])
def test_response_pieces_make_one_document_of_the_announced_length(n, piece_bytes, targets):
    from index.app import lookup_pieces
    from index.store import LookupHits, block_json, record_json

    recs = [ReplicaRecord.from_json(record(key(i), layers=1)) for i in range(n)]
    hits = LookupHits(n, [block_json(r.block_key, [record_json(r), record_json(r)])
                          for r in recs])
    length, pieces = lookup_pieces(hits, targets, piece_bytes)
    pieces = list(pieces)
    body = b"".join(pieces)
    assert len(body) == length
    if n > 1 and piece_bytes == 1:
        assert len(pieces) == n
    doc = json.loads(body)
    assert doc["matched"] == n
    assert doc["blocks"] == [{"block_key": r.block_key, "replicas": [r.to_json()] * 2}
                             for r in recs]
    assert doc.get("targets") == targets
