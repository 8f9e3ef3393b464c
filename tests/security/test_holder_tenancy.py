"""Holders serve their own scopes (issue 35, attacks 4 and 5): B's token can neither store at
A's holder, push A's blocks out of a holder both use, pin that holder with leases, nor stop A's
records from reaching the index; A's own flows keep working throughout."""

from __future__ import annotations

import socket
from typing import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from kvsp_moq.holder.service import Holder, HolderSettings
from tests.polling import wait_until
from tests.security.conftest import (
    COMPAT,
    HOLDER_A,
    SCOPE_A,
    SCOPE_B,
    TOKEN_A,
    TOKEN_AGENT,
    TOKEN_B,
    TOKEN_METRICS,
    auth,
    authenticator,
    bkey,
    container,
)

PUT = {"If-None-Match": "*"}
SIZE = len(container(0))


def block_url(base: str, scope: str, key: str) -> str:
    return f"{base}blocks/{COMPAT}/{scope}/{key}"


def problem(r: httpx.Response) -> str:
    return r.json()["type"].rsplit(":", 1)[-1]


@pytest.fixture
def start() -> Iterator:
    started: list[Holder] = []

    def run(**settings) -> Holder:
        holder = Holder(HolderSettings(listen="127.0.0.1:0", auth=authenticator(), **settings))
        started.append(holder.start())
        return holder

    yield run
    for holder in started:
        holder.stop()


def served_url(holder: Holder) -> str:
    """Where the holder listens (its records may name another, advertised URL)."""
    assert holder._server is not None
    return holder._server.url


def test_a_foreign_scope_put_is_refused_before_its_body(start) -> None:
    """A's holder (publishing with A's token) refuses B's block with 403 as soon as the
    headers arrive: a 64 MiB Content-Length is never waited for, nor reserved."""
    holder = start(index_token=TOKEN_A)
    base = served_url(holder)
    host = urlsplit(base)
    path = urlsplit(block_url(base, SCOPE_B, bkey(1))).path
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        s.sendall((f"PUT {path} HTTP/1.1\r\nHost: {host.netloc}\r\nIf-None-Match: *\r\n"
                   f"Authorization: Bearer {TOKEN_B}\r\nContent-Length: {64 << 20}\r\n"
                   f"Content-Type: application/octet-stream\r\n\r\n").encode())
        answer = b""
        for _ in range(64):  # bounded: a short response arrives in a few reads
            piece = s.recv(65536)
            answer += piece
            head, _, body = answer.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if not piece or (length and len(body) >= length[0]):
                break
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"does not store blocks of this scope" in answer
    with httpx.Client(trust_env=False, timeout=10) as c:
        # A principal of both tenants (a confused deputy) is refused the same way.
        r = c.put(block_url(base, SCOPE_B, bkey(2)), content=container(2),
                  headers=PUT | auth(TOKEN_AGENT))
        assert r.status_code == 403 and problem(r) == "kvsp-forbidden-scope"
        assert len(holder.store) == 0
        # A's own blocks: stored, read, leased, as before.
        url = block_url(base, SCOPE_A, bkey(3, "a"))
        assert c.put(url, content=container(3), headers=PUT | auth(TOKEN_A)).status_code == 201
        assert c.put(block_url(base, SCOPE_A, bkey(4, "a")), content=container(4),
                     headers=PUT | auth(TOKEN_AGENT)).status_code == 201
        assert c.get(url, headers=auth(TOKEN_A)).content == container(3)
        r = c.post(base + "leases", json={"block_keys": [bkey(3, "a")], "ttl_ms": 5000},
                   headers=auth(TOKEN_A))
        assert r.status_code == 201
        assert c.delete(f"{base}leases/{r.json()['lease']}", headers=auth(TOKEN_A)).status_code == 204


def test_b_cannot_evict_a_from_a_holder_both_use(start) -> None:
    """A holder serving both tenants gives each an equal share: B writing far past its share
    evicts only B's own blocks, and once those are leased B gets 507, never A's room."""
    holder = start(serve_scopes=(SCOPE_A, SCOPE_B), host_bytes=4 * SIZE, disk_bytes=0)
    base = served_url(holder)
    with httpx.Client(trust_env=False, timeout=10) as c:
        a_urls = [block_url(base, SCOPE_A, bkey(i, "a")) for i in range(2)]
        for i, url in enumerate(a_urls):
            assert c.put(url, content=container(10 + i), headers=PUT | auth(TOKEN_A)).status_code == 201
        b_keys = [bkey(20 + i) for i in range(8)]
        for i, key in enumerate(b_keys):
            r = c.put(block_url(base, SCOPE_B, key), content=container(20 + i),
                      headers=PUT | auth(TOKEN_B))
            assert r.status_code == 201, r.text
        for i, url in enumerate(a_urls):
            assert c.get(url, headers=auth(TOKEN_A)).content == container(10 + i)
        assert holder.store.scope_bytes == {SCOPE_A: 2 * SIZE, SCOPE_B: 2 * SIZE}
        # B pins what it holds and keeps writing: 507 for B, A's blocks stay.
        r = c.post(base + "leases", json={"block_keys": b_keys[-2:], "ttl_ms": 600_000},
                   headers=auth(TOKEN_B))
        assert r.status_code == 201
        r = c.put(block_url(base, SCOPE_B, bkey(40)), content=container(40),
                  headers=PUT | auth(TOKEN_B))
        assert r.status_code == 507 and problem(r) == "kvsp-store-full"
        for url in a_urls:
            assert c.head(url, headers=auth(TOKEN_A)).status_code == 200
        # A still stores (within its share, making room from its own oldest block).
        r = c.put(block_url(base, SCOPE_A, bkey(5, "a")), content=container(5),
                  headers=PUT | auth(TOKEN_A))
        assert r.status_code == 201


def test_a_scope_quota_is_enforced_for_the_holders_own_tenant(start) -> None:
    holder = start(index_token=TOKEN_A, scope_quota=2 * SIZE, host_bytes=64 * SIZE)
    base = served_url(holder)
    with httpx.Client(trust_env=False, timeout=10) as c:
        keys = [bkey(50 + i, "a") for i in range(3)]
        for i, key in enumerate(keys[:2]):
            assert c.put(block_url(base, SCOPE_A, key), content=container(50 + i),
                         headers=PUT | auth(TOKEN_A)).status_code == 201
        r = c.post(base + "leases", json={"block_keys": keys[:2], "ttl_ms": 60_000},
                   headers=auth(TOKEN_A))
        assert r.status_code == 201
        r = c.put(block_url(base, SCOPE_A, keys[2]), content=container(52),
                  headers=PUT | auth(TOKEN_A))
        assert r.status_code == 507 and problem(r) == "kvsp-store-full"
        assert "quota" in r.json()["detail"]


def test_lease_quotas_answer_429(start) -> None:
    """Leases per principal and in all are capped; B's leases never use up A's."""
    holder = start(serve_scopes=(SCOPE_A, SCOPE_B), max_leases=3, max_leases_total=5)
    base = served_url(holder)
    with httpx.Client(trust_env=False, timeout=10) as c:
        assert c.put(block_url(base, SCOPE_B, bkey(60)), content=container(60),
                     headers=PUT | auth(TOKEN_B)).status_code == 201
        assert c.put(block_url(base, SCOPE_A, bkey(61, "a")), content=container(61),
                     headers=PUT | auth(TOKEN_A)).status_code == 201

        def lease(token: str, key: str) -> httpx.Response:
            return c.post(base + "leases", json={"block_keys": [key], "ttl_ms": 60_000},
                          headers=auth(token))

        b_leases = [lease(TOKEN_B, bkey(60)) for _ in range(3)]
        assert [r.status_code for r in b_leases] == [201] * 3
        r = lease(TOKEN_B, bkey(60))
        assert r.status_code == 429 and problem(r) == "kvsp-lease-quota"
        assert [lease(TOKEN_A, bkey(61, "a")).status_code for _ in range(2)] == [201, 201]
        r = lease(TOKEN_A, bkey(61, "a"))  # the holder's total of 5 is reached
        assert r.status_code == 429 and problem(r) == "kvsp-lease-quota"
        lease_id = b_leases[0].json()["lease"]
        assert c.delete(f"{base}leases/{lease_id}", headers=auth(TOKEN_B)).status_code == 204
        assert lease(TOKEN_A, bkey(61, "a")).status_code == 201


def test_one_foreign_record_does_not_stop_a_publishing(start, index_url: str) -> None:
    """A holder publishing with A's token also holds one block of B (configured to serve B):
    the IS refuses that record, and every A record, older and newer, is still published."""
    holder = start(index_token=TOKEN_A, index_url=index_url, public_url=HOLDER_A,
                   serve_scopes=(SCOPE_A, SCOPE_B), record_ttl_ms=60_000)
    base = served_url(holder)
    a_keys = [bkey(70 + i, "a") for i in range(5)]
    with httpx.Client(trust_env=False, timeout=10) as c:
        for i, key in enumerate(a_keys[:3]):
            assert c.put(block_url(base, SCOPE_A, key), content=container(70 + i),
                         headers=PUT | auth(TOKEN_A)).status_code == 201
        assert c.put(block_url(base, SCOPE_B, bkey(79)), content=container(79),
                     headers=PUT | auth(TOKEN_B)).status_code == 201
        for i, key in enumerate(a_keys[3:]):
            assert c.put(block_url(base, SCOPE_A, key), content=container(73 + i),
                         headers=PUT | auth(TOKEN_A)).status_code == 201

        def matched() -> int:
            r = c.post(index_url + "lookup", headers=auth(TOKEN_A),
                       json={"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": a_keys})
            assert r.status_code == 200, r.text
            return int(r.json()["matched"])

        wait_until(lambda: matched() == len(a_keys), timeout=20.0, what="A's records published")
        assert holder.publisher.refused == 1
        metrics = c.get(base + "metrics", headers=auth(TOKEN_METRICS)).text
        assert "kvsp_holder_index_refused_records 1" in metrics
