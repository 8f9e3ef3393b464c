"""The holder's HTTP resources against a real uvicorn server (§6.6, §6.7)."""

from __future__ import annotations

import base64
import hashlib

import httpx
import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.holder.service import HolderSettings
from kvsp_moq.protocol.container import Container
from tests.holder.conftest import OTHER_SCOPE, SCOPE, FakeClock, block_key, make_block

PUT = {"If-None-Match": "*"}


def problem(r: httpx.Response) -> str:
    assert r.headers["content-type"].startswith("application/problem+json"), r.text
    return r.json()["type"].removeprefix("urn:kvsp:problem:")


def sha256_field(body: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"


@pytest.fixture
def holder(start_holder):
    return start_holder()


@pytest.fixture
def client(holder):
    with httpx.Client(base_url=holder.url, trust_env=False, timeout=10) as c:
        yield c


def test_get_returns_the_container_with_repr_digest_and_cache_control(client) -> None:
    block = make_block(1)
    r = client.put(block.path, content=block.data, headers=PUT)
    assert r.status_code == 201
    record = r.json()
    assert record["layer_digests"] == block.layer_digests and record["size"] == len(block.data)
    r = client.get(block.path)
    assert r.status_code == 200 and r.content == block.data
    assert r.headers["content-type"] == "application/kvsp-block"
    assert r.headers["repr-digest"] == sha256_field(block.data)
    cache = [p.strip() for p in r.headers["cache-control"].split(",")]
    assert cache[:2] == ["private", "immutable"]
    max_age = int(cache[2].removeprefix("max-age="))
    assert 0 <= max_age <= record["ttl_ms"] // 1000
    head = client.head(block.path)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["repr-digest"] == r.headers["repr-digest"]
    assert head.headers["content-length"] == str(len(block.data))


def test_layer_ranges(client) -> None:
    block = make_block(2, layers=6)
    client.put(block.path, content=block.data, headers=PUT)
    for a, b in [(0, 0), (2, 4), (5, 5), (0, 5)]:
        r = client.get(block.path, params={"layers": f"{a}-{b}"})
        assert r.status_code == 200
        expected = Container(block.data).slice(a, b)
        assert r.content == expected
        assert r.headers["repr-digest"] == sha256_field(expected)
        c = Container(r.content)
        assert (c.first_layer, c.last_layer) == (a, b)
    r = client.get(block.path, params={"layers": "4-6"})
    assert r.status_code == 404 and problem(r) == "kvsp-layers-unavailable"


def test_codec_other_than_the_held_one_is_a_miss(client) -> None:
    block = make_block(3)
    client.put(block.path, content=block.data, headers=PUT)
    assert client.get(block.path, params={"codec": "1"}).content == block.data
    r = client.get(block.path, params={"codec": "2"})
    assert r.status_code == 404 and problem(r) == "kvsp-codec-unavailable"


def test_unknown_block_is_a_plain_404(client) -> None:
    r = client.get(make_block(4).path)
    assert r.status_code == 404 and problem(r) == "kvsp-not-found"


@pytest.mark.parametrize("path, params, member", [
    (f"blocks/{'zz' * 32}/{SCOPE}/{block_key(1)}", {}, "compat"),
    (f"blocks/{'ab' * 32}/{SCOPE[:-2]}/{block_key(1)}", {}, "scope"),
    (f"blocks/{'ab' * 32}/{SCOPE}/{block_key(1)}0", {}, "block_key"),
    (f"blocks/{'ab' * 32}/{SCOPE}/{block_key(1)}", {"layers": "3"}, "layers"),
    (f"blocks/{'ab' * 32}/{SCOPE}/{block_key(1)}", {"layers": "3-1"}, "layers"),
    (f"blocks/{'ab' * 32}/{SCOPE}/{block_key(1)}", {"layers": "-1-2"}, "layers"),
    (f"blocks/{'ab' * 32}/{SCOPE}/{block_key(1)}", {"codec": "x"}, "codec"),
])
def test_malformed_path_and_query_name_the_member(client, path, params, member) -> None:
    r = client.get(path, params=params)
    assert r.status_code == 400 and problem(r) == "kvsp-bad-record"
    assert r.json()["member"] == member


def test_put_needs_if_none_match_and_keeps_the_first_copy(client) -> None:
    block = make_block(5)
    r = client.put(block.path, content=block.data)
    assert r.status_code == 428 and problem(r) == "kvsp-precondition-required"
    r = client.put(block.path, content=block.data, headers={"If-None-Match": '"x"'})
    assert r.status_code == 428
    assert client.put(block.path, content=block.data, headers=PUT).status_code == 201
    other = make_block(6)  # different octets under the same key
    r = client.put(block.path, content=other.data, headers=PUT)
    assert r.status_code == 412 and problem(r) == "kvsp-exists"
    assert client.get(block.path).content == block.data
    # The connection is still usable after a refused upload.
    assert client.get("healthz").status_code == 200


@pytest.mark.parametrize("body", [
    b"",
    b"not a container at all",
    b"KVB2" + bytes(16),
    make_block(7).data[:-1],
    make_block(7).data + b"\x00",
    Container(make_block(7).data).slice(1, 2),
])
def test_put_of_a_malformed_container_is_400(client, body) -> None:
    r = client.put(make_block(7).path, content=body, headers=PUT)
    assert r.status_code == 400 and problem(r) == "kvsp-bad-record"
    assert client.get(make_block(7).path).status_code == 404


def test_put_larger_than_the_limit_is_413(start_holder) -> None:
    holder = start_holder(max_block_bytes=1000)
    block = make_block(8)
    r = httpx.put(holder.url + block.path, content=block.data, headers=PUT, trust_env=False)
    assert r.status_code == 413


def test_scope_authorization(start_holder) -> None:
    auth = Authenticator.from_mapping({"principal": [
        {"name": "alice", "token": "tok-alice", "scopes": [SCOPE], "roles": ["instance"]},
        {"name": "bob", "token": "tok-bob", "scopes": [OTHER_SCOPE], "roles": ["instance"]},
    ]})
    holder = start_holder(auth=auth)
    block = make_block(9)
    alice = {"Authorization": "Bearer tok-alice"}
    bob = {"Authorization": "Bearer tok-bob"}
    with httpx.Client(base_url=holder.url, trust_env=False) as c:
        r = c.put(block.path, content=block.data, headers=PUT | bob)
        assert r.status_code == 403 and problem(r) == "kvsp-forbidden-scope"
        r = c.put(block.path, content=block.data, headers=PUT)
        assert r.status_code == 401 and problem(r) == "kvsp-unauthorized"
        assert c.put(block.path, content=block.data, headers=PUT | alice).status_code == 201
        r = c.get(block.path, headers=bob)
        assert r.status_code == 403 and problem(r) == "kvsp-forbidden-scope"
        assert c.get(block.path, headers=alice).content == block.data
        # A lease names only block keys; keys of a scope one may not use are not found.
        r = c.post("leases", json={"block_keys": [block.bid.block_key], "ttl_ms": 1000},
                   headers=bob)
        assert r.status_code == 404 and r.json()["member"] == "block_keys[0]"
        r = c.post("leases", json={"block_keys": [block.bid.block_key], "ttl_ms": 1000},
                   headers=alice)
        assert r.status_code == 201
        lease = r.json()["lease"]
        assert c.delete(f"leases/{lease}", headers=bob).status_code == 404
        assert c.delete(f"leases/{lease}", headers=alice).status_code == 204


def test_leases_create_renew_release(start_holder) -> None:
    clock = FakeClock()
    holder = start_holder(clock=clock, max_lease_ttl_ms=10_000)
    block = make_block(10)
    with httpx.Client(base_url=holder.url, trust_env=False) as c:
        c.put(block.path, content=block.data, headers=PUT)
        r = c.post("leases", json={"block_keys": [block.bid.block_key], "ttl_ms": 2000})
        assert r.status_code == 201
        grant = r.json()
        assert grant["ttl_ms"] == 2000 and r.headers["location"] == f"leases/{grant['lease']}"
        assert holder.leases.is_protected(block.bid.block_key)
        clock.advance(1.5)
        r = c.put(f"leases/{grant['lease']}", json={"ttl_ms": 5000})
        assert r.status_code == 200 and r.json()["ttl_ms"] == 5000
        clock.advance(4.0)
        assert holder.leases.is_protected(block.bid.block_key)
        assert c.put(f"leases/{grant['lease']}").json()["ttl_ms"] == 5000  # same TTL again
        assert c.delete(f"leases/{grant['lease']}").status_code == 204
        assert not holder.leases.is_protected(block.bid.block_key)
        r = c.put(f"leases/{grant['lease']}")
        assert r.status_code == 404
        r = c.delete("leases/not-an-id")
        assert r.status_code == 400 and r.json()["member"] == "lease"
        r = c.post("leases", json={"block_keys": [block_key(999)], "ttl_ms": 1000})
        assert r.status_code == 404
        r = c.post("leases", json={"block_keys": ["xyz"], "ttl_ms": 1000})
        assert r.status_code == 400 and problem(r) == "kvsp-bad-record"
        # An expired lease cannot be renewed.
        lease = c.post("leases", json={"block_keys": [block.bid.block_key],
                                       "ttl_ms": 1000}).json()["lease"]
        clock.advance(1.001)
        assert c.put(f"leases/{lease}").status_code == 404


def test_lease_quota(start_holder) -> None:
    block = make_block(11)
    holder = start_holder(max_lease_ttl_ms=5_000, max_lease_bytes=len(block.data) + 10)
    body = {"block_keys": [block.bid.block_key], "ttl_ms": 1000}
    with httpx.Client(base_url=holder.url, trust_env=False) as c:
        c.put(block.path, content=block.data, headers=PUT)
        r = c.post("leases", json=body | {"ttl_ms": 5_001})
        assert r.status_code == 429 and problem(r) == "kvsp-lease-quota"
        first = c.post("leases", json=body)
        assert first.status_code == 201
        r = c.post("leases", json=body)
        assert r.status_code == 429 and problem(r) == "kvsp-lease-quota"
        r = c.put(f"leases/{first.json()['lease']}", json={"ttl_ms": 6_000})
        assert r.status_code == 429 and problem(r) == "kvsp-lease-quota"
        c.delete(f"leases/{first.json()['lease']}")
        assert c.post("leases", json=body).status_code == 201


def test_health_and_metrics(client) -> None:
    block = make_block(12)
    client.put(block.path, content=block.data, headers=PUT)
    assert client.get("healthz").json() == {"status": "ok"}
    text = client.get("metrics").text
    assert f"kvsp_holder_store_host_bytes {len(block.data)}" in text
    assert "kvsp_holder_store_blocks 1" in text


def test_settings_are_a_plain_dataclass() -> None:
    s = HolderSettings(host_bytes=5)
    assert s.host_bytes == 5 and s.data_dir is None and s.record_ttl_ms == 60_000
