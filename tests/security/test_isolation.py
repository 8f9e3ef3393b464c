"""Tenant isolation: a token of scope A gets nothing of scope B, at any component.

Refusals must not be oracles either: where a component refuses on scope, the answer for a key
of B that exists must be byte-identical to the answer for one that does not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from index.app import IndexSettings
from kvsp_moq.holder.service import Holder
from kvsp_moq.moqt.errors import RequestErrorCode, Unauthorized
from kvsp_moq.naming import publisher_id
from kvsp_moq.protocol.keys import block_keys, scope_id
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from tests.relay.conftest import STEP, TrackPublisher, collect, dial, make_objects, running_relay

from .conftest import (
    COMPAT,
    HOLDER_A,
    HOLDER_B,
    KEY_A,
    KEY_B,
    SCOPE_A,
    SCOPE_B,
    TOKEN_A,
    TOKEN_B,
    auth,
    authenticator,
    bkey,
    container,
    replica,
)

PROBLEM = "application/problem+json"
FORBIDDEN = "urn:kvsp:problem:kvsp-forbidden-scope"


def assert_forbidden(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 403, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    doc = r.json()
    assert doc["type"] == FORBIDDEN, doc
    return doc


def assert_same(r1: httpx.Response, r2: httpx.Response) -> None:
    """Two answers that must not let a client tell them apart."""
    assert r1.status_code == r2.status_code
    strip = {"date", "content-length"}
    assert ({k: v for k, v in r1.headers.items() if k not in strip}
            == {k: v for k, v in r2.headers.items() if k not in strip})
    assert r1.content == r2.content


def rpath(rec: dict[str, Any]) -> str:
    rid = replica_id(rec["holder"], rec.get("moqt_namespace"))
    return f"replicas/{rec['compat_id']}/{rec['scope_id']}/{rec['block_key']}/{rid}"


# --------------------------------------------------------------------------- Index Service


@pytest.fixture(scope="module")
def b_published(index_url: str) -> list[str]:
    """Two of B's records at the IS, published with B's token."""
    keys = [bkey(0), bkey(1)]
    with httpx.Client(trust_env=False) as c:
        for k in keys:
            r = c.put(index_url + rpath(replica(k, SCOPE_B, HOLDER_B)), json=replica(
                k, SCOPE_B, HOLDER_B), headers=auth(TOKEN_B))
            assert r.status_code == 201, r.text
        # B itself sees them: the refusals below are about A, not about missing data.
        r = c.post(index_url + "lookup", headers=auth(TOKEN_B),
                   json={"scope_id": SCOPE_B, "compat_id": COMPAT, "block_keys": keys})
        assert r.status_code == 200 and r.json()["matched"] == 2
    return keys


def test_is_lookup_in_b_refused_without_revealing_existence(
        index_url: str, b_published: list[str], client: httpx.Client) -> None:
    def lookup(keys: list[str]) -> httpx.Response:
        return client.post(index_url + "lookup", headers=auth(TOKEN_A),
                           json={"scope_id": SCOPE_B, "compat_id": COMPAT, "block_keys": keys})

    existing, missing = lookup(b_published), lookup([bkey(90), bkey(91)])
    assert_forbidden(existing)
    assert_same(existing, missing)
    assert_same(lookup(b_published[:1]), lookup([]))
    # With targets too: the refusal comes before anything is estimated.
    r = client.post(index_url + "lookup", headers=auth(TOKEN_A),
                    json={"scope_id": SCOPE_B, "compat_id": COMPAT, "block_keys": b_published,
                          "targets": ["http://ii.test/"]})
    assert_same(r, existing)


def test_is_lookup_of_b_keys_under_a_scope_finds_nothing(
        index_url: str, b_published: list[str], client: httpx.Client) -> None:
    r = client.post(index_url + "lookup", headers=auth(TOKEN_A),
                    json={"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": b_published})
    assert r.status_code == 200, r.text
    assert r.json() == {"matched": 0, "blocks": []}


def test_is_publish_into_b_refused(index_url: str, b_published: list[str],
                                   client: httpx.Client) -> None:
    # A record of scope B naming A's own holder: the holder is A's, the scope is not.
    rec = replica(b_published[0], SCOPE_B, HOLDER_A)
    assert_forbidden(client.put(index_url + rpath(rec), json=rec, headers=auth(TOKEN_A)))
    r = client.post(index_url + "replicas:batch", headers=auth(TOKEN_A),
                    json={"records": [replica(bkey(5, "a"), SCOPE_A, HOLDER_A), rec]})
    assert_forbidden(r)
    # All or none: A's own record in that batch was not stored either.
    r = client.post(index_url + "lookup", headers=auth(TOKEN_A),
                    json={"scope_id": SCOPE_A, "compat_id": COMPAT,
                          "block_keys": [bkey(5, "a")]})
    assert r.json()["matched"] == 0
    # Withdrawing B's record: refused identically whether it exists or not.
    held = client.delete(index_url + rpath(replica(b_published[0], SCOPE_B, HOLDER_B)),
                         headers=auth(TOKEN_A))
    absent = client.delete(index_url + rpath(replica(bkey(92), SCOPE_B, HOLDER_B)),
                           headers=auth(TOKEN_A))
    assert_forbidden(held)
    assert held.status_code == absent.status_code
    assert held.json()["detail"] == absent.json()["detail"]
    r = client.post(index_url + "lookup", headers=auth(TOKEN_B),
                    json={"scope_id": SCOPE_B, "compat_id": COMPAT, "block_keys": b_published})
    assert r.json()["matched"] == 2
    assert {rep["holder"] for b in r.json()["blocks"] for rep in b["replicas"]} == {HOLDER_B}


# --------------------------------------------------------------------------- holder


@pytest.fixture(scope="module")
def b_blocks(holder: Holder) -> list[str]:
    """Two of B's blocks at the holder, stored with B's token."""
    keys = [bkey(10), bkey(11)]
    with httpx.Client(trust_env=False) as c:
        for i, k in enumerate(keys):
            r = c.put(f"{holder.url}blocks/{COMPAT}/{SCOPE_B}/{k}", content=container(i),
                      headers={**auth(TOKEN_B), "If-None-Match": "*"})
            assert r.status_code == 201, r.text
    return keys


def test_holder_get_and_head_of_b_refused_alike(holder: Holder, b_blocks: list[str],
                                                client: httpx.Client) -> None:
    for method in ("GET", "HEAD"):
        held = client.request(method, f"{holder.url}blocks/{COMPAT}/{SCOPE_B}/{b_blocks[0]}",
                              headers=auth(TOKEN_A))
        absent = client.request(method, f"{holder.url}blocks/{COMPAT}/{SCOPE_B}/{bkey(93)}",
                                headers=auth(TOKEN_A))
        assert held.status_code == 403
        if method == "GET":
            assert_forbidden(held)
        held_doc, absent_doc = held.content.replace(b_blocks[0].encode(), b""), \
            absent.content.replace(bkey(93).encode(), b"")
        assert held_doc == absent_doc and held.status_code == absent.status_code
        # With a layer range or codec, still nothing about the block.
        r = client.get(f"{holder.url}blocks/{COMPAT}/{SCOPE_B}/{b_blocks[0]}?layers=0-0&codec=2",
                       headers=auth(TOKEN_A))
        assert_forbidden(r)
    # B's key under A's scope: simply not held there.
    r = client.get(f"{holder.url}blocks/{COMPAT}/{SCOPE_A}/{b_blocks[0]}", headers=auth(TOKEN_A))
    assert r.status_code == 404


def test_holder_put_into_b_refused_and_b_block_kept(holder: Holder, b_blocks: list[str],
                                                    client: httpx.Client) -> None:
    url = f"{holder.url}blocks/{COMPAT}/{SCOPE_B}/"
    # Over an existing block of B (would answer 412 to B) and a fresh key: both 403.
    held = client.put(url + b_blocks[0], content=container(7),
                      headers={**auth(TOKEN_A), "If-None-Match": "*"})
    fresh = client.put(url + bkey(94), content=container(7),
                       headers={**auth(TOKEN_A), "If-None-Match": "*"})
    assert_forbidden(held)
    assert_forbidden(fresh)
    assert held.json()["detail"] == fresh.json()["detail"]
    r = client.get(url + b_blocks[0], headers=auth(TOKEN_B))
    assert r.status_code == 200 and r.content == container(0)
    assert client.get(url + bkey(94), headers=auth(TOKEN_B)).status_code == 404


def test_holder_leases_on_b_refused(holder: Holder, b_blocks: list[str],
                                    client: httpx.Client) -> None:
    def lease(keys: list[str], token: str) -> httpx.Response:
        return client.post(holder.url + "leases", json={"block_keys": keys, "ttl_ms": 5000},
                           headers=auth(token))

    held, absent = lease(b_blocks[:1], TOKEN_A), lease([bkey(95)], TOKEN_A)
    assert held.status_code == 404, held.text
    assert held.json()["type"] == "urn:kvsp:problem:kvsp-not-found"
    assert_same(held, absent)  # a lease does not reveal that B holds the block
    assert len(holder.leases) == 0
    # B's own lease cannot be renewed or released with A's token; it looks like no lease.
    granted = lease(b_blocks, TOKEN_B)
    assert granted.status_code == 201, granted.text
    lease_id = granted.json()["lease"]
    other = "0" * 32
    for method in ("PUT", "DELETE"):
        r = client.request(method, f"{holder.url}leases/{lease_id}", headers=auth(TOKEN_A))
        r_other = client.request(method, f"{holder.url}leases/{other}", headers=auth(TOKEN_A))
        assert r.status_code == 404, r.text
        assert r.json()["type"] == r_other.json()["type"]
        assert r.json()["detail"] == r_other.json()["detail"]
    assert client.delete(f"{holder.url}leases/{lease_id}", headers=auth(TOKEN_B)).status_code == 204


# --------------------------------------------------------------------------- relay


def kv_ns(scope: str, holder: str) -> tuple[bytes, ...]:
    return (b"kvsp", COMPAT.encode(), scope.encode(), publisher_id(holder).hex().encode())


async def test_relay_announce_subscribe_fetch_in_b_refused() -> None:
    objects = make_objects(1, 3, 100)
    async with running_relay(authenticator=authenticator()) as relay:
        pub_b = await dial(relay.url, authorization=TOKEN_B)
        TrackPublisher(objects).attach(pub_b)
        a = await dial(relay.url, authorization=TOKEN_A)
        TrackPublisher(objects).attach(a)
        try:
            await pub_b.publish_namespace(kv_ns(SCOPE_B, HOLDER_B), timeout=STEP)
            await a.publish_namespace(kv_ns(SCOPE_A, HOLDER_A), timeout=STEP)
            for ns in (kv_ns(SCOPE_B, HOLDER_B), kv_ns(SCOPE_B, HOLDER_A)):
                with pytest.raises(Unauthorized) as e:
                    await a.publish_namespace(ns, timeout=STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
            track_b = kv_ns(SCOPE_B, HOLDER_B) + (bytes.fromhex(bkey(20)),)
            nowhere = kv_ns(SCOPE_B, HOLDER_A) + (bytes.fromhex(bkey(96)),)
            for track in (track_b, nowhere):  # announced or not: the same refusal
                with pytest.raises(Unauthorized) as e:
                    await a.subscribe(track, b"1", timeout=STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                with pytest.raises(Unauthorized) as e:
                    await a.fetch(track, b"1", (0, 0), (0, 2), timeout=STEP)
                assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
                with pytest.raises(Unauthorized):
                    await a.track_status(track, b"1", timeout=STEP)
            # The same track is served to B: the refusals are about A's scope.
            b = await dial(relay.url, authorization=TOKEN_B)
            try:
                got = await collect(await b.fetch(track_b, b"1", (0, 0), (0, 2), timeout=STEP))
                assert len(got) == 3
            finally:
                await b.aclose()
            # A's own scope still works over the same session.
            track_a = kv_ns(SCOPE_A, HOLDER_A) + (bytes.fromhex(bkey(20, "a")),)
            assert len(await collect(await a.fetch(track_a, b"1", (0, 0), (0, 2),
                                                   timeout=STEP))) == 3
            assert relay.stats.unauthorized >= 8
        finally:
            await asyncio.gather(pub_b.aclose(), a.aclose())


# --------------------------------------------------------------------------- scope keys


def test_same_tokens_under_two_scope_keys_give_unrelated_block_keys() -> None:
    tokens = list(range(1000, 1000 + 16 * 8))
    compat = bytes.fromhex(COMPAT)
    ka, kb = block_keys(KEY_A, compat, tokens, 16), block_keys(KEY_B, compat, tokens, 16)
    assert len(ka) == len(kb) == 8
    assert not set(ka) & set(kb)
    assert scope_id(KEY_A) != scope_id(KEY_B)
    # Unrelated, not merely different: no byte position agrees more than chance would allow.
    same = sum(x == y for a, b in zip(ka, kb) for x, y in zip(a, b))
    assert same < 8 * 32 // 16
    # Deterministic within a scope, and a prefix names the same leading keys.
    assert block_keys(KEY_A, compat, tokens[:48], 16) == ka[:3]


# --------------------------------------------------------------------------- agent prefetch


def directive(agent: Any, scope: str, keys: list[str], sources: list[str]) -> dict[str, Any]:
    return {"directive": str(uuid.uuid4()), "scope_id": scope,
            "compat_id": agent.context.compat_id,
            "blocks": [{"block_key": k, "sources": sources} for k in keys],
            "layer_order": "ascending", "deadline_ms": 3000, "lease_ms": 2000}


def wait_done(client: httpx.Client, location: str, token: str) -> dict[str, Any]:
    for _ in range(300):
        body = client.get(location, headers=auth(token)).json()
        if body["state"] != "pending":
            return body
        time.sleep(0.02)
    raise AssertionError("the directive never finished")


def test_agent_refuses_prefetch_and_generate_in_b_with_a_token(
        agent: Any, holder: Holder, client: httpx.Client,
        agent_index: tuple[str, IndexSettings]) -> None:
    # B computes blocks at the agent, in its own scope.
    prompt = list(range(300, 300 + 64))
    r = client.post(agent.url + "generate", headers=auth(TOKEN_B), timeout=60,
                    json={"tokens": prompt, "max_new_tokens": 1, "scope": "b"})
    assert r.status_code == 200, r.text
    keys = [k.hex() for k in block_keys(KEY_B, bytes.fromhex(agent.context.compat_id),
                                        prompt, 16)]
    # A cannot generate in B's scope either.
    r = client.post(agent.url + "generate", headers=auth(TOKEN_A), timeout=60,
                    json={"tokens": prompt, "max_new_tokens": 1, "scope": "b"})
    assert_forbidden(r)

    # Copy B's blocks to the holder, under B's scope, with B's token.
    for k in keys:
        got = client.get(f"{agent.url}blocks/{agent.context.compat_id}/{SCOPE_B}/{k}",
                         headers=auth(TOKEN_B))
        assert got.status_code == 200, got.text
        put = client.put(f"{holder.url}blocks/{agent.context.compat_id}/{SCOPE_B}/{k}",
                         content=got.content, headers={**auth(TOKEN_B), "If-None-Match": "*"})
        assert put.status_code == 201, put.text

    # A directive in B's scope, with A's token: refused whether or not the blocks exist.
    held = client.post(agent.url + "prefetch", headers=auth(TOKEN_A),
                       json=directive(agent, SCOPE_B, keys, [holder.url]))
    absent = client.post(agent.url + "prefetch", headers=auth(TOKEN_A),
                         json=directive(agent, SCOPE_B, [bkey(97)], [holder.url]))
    assert_forbidden(held)
    assert held.json()["detail"] == absent.json()["detail"]

    # A confused deputy: A names B's keys under A's own scope. The agent (whose token holds both
    # scopes) must not load B's bytes into A's scope, from the holder or from its own store.
    # Worst case: the index has scope-A records for those keys at the shared holder (as if A
    # could publish for it), so the agent really goes to the holder with its own token.
    settings = agent_index[1]
    compat = agent.context.compat_id
    for k in keys:
        rec = replica(k, SCOPE_A, holder.url)
        rec["compat_id"] = compat
        asyncio.run(settings.store.put(ReplicaRecord.from_json(rec), settings.clock()))
    requests = holder.app.state.metrics.requests
    before = dict(requests)
    body = directive(agent, SCOPE_A, keys, [holder.url, agent.url])
    r = client.post(agent.url + "prefetch", headers=auth(TOKEN_A), json=body)
    assert r.status_code == 202, r.text
    done = wait_done(client, r.headers["location"], TOKEN_A)
    assert not done.get("loaded"), done
    assert done["state"] == "failed"
    # The holder was asked, and answered every block read under A's scope with 404.
    block_route = "/blocks/{compat}/{scope}/{key}"
    assert requests[("GET", block_route, 404)] - before.get(("GET", block_route, 404), 0) \
        == len(keys)
    assert requests[("GET", block_route, 200)] == before.get(("GET", block_route, 200), 0)
    for k in keys:
        r = client.get(f"{agent.url}blocks/{agent.context.compat_id}/{SCOPE_A}/{k}",
                       headers=auth(TOKEN_A))
        assert r.status_code == 404, r.text

    # The positive control: B's own directive for its blocks is accepted and completes.
    r = client.post(agent.url + "prefetch", headers=auth(TOKEN_B),
                    json=directive(agent, SCOPE_B, keys, [holder.url]))
    assert r.status_code == 202, r.text
    done = wait_done(client, r.headers["location"], TOKEN_B)
    assert done["state"] == "complete", done
