"""The Index Service on Redis: expiry over HTTP with real TTLs, `kvsp index --store`, two IS
processes on one Redis, and restarts of either."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from index import service
from index.redis_store import RedisReplicaStore
from kvsp_moq.errors import KvspError
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.records import ReplicaRecord
from tests.index.conftest import H1, H2, assert_problem, auth, key, lookup_body, path, record
from tests.index_redis.redis_server import RedisServer, free_port
from tests.polling import eventually


async def lookup(http, base: str, keys: list[str], token: str = "t-pc") -> dict:
    r = await http.post(base + "lookup", json=lookup_body(keys), headers=auth(token))
    assert r.status_code == 200, r.text
    return r.json()


async def count(http, base: str, keys: list[str], token: str = "t-pc") -> int:
    return (await lookup(http, base, keys, token))["matched"]


# ------------------------------------------------------------------ expiry over HTTP


async def test_ttl_is_capped_and_the_record_expires(serve, http):
    ix = serve(max_ttl_ms=300)
    rec = record(key(0), ttl_ms=60_000)
    start = time.monotonic()
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r.status_code == 201 and r.json()["ttl_ms"] == 300
    doc = await lookup(http, ix.url, [key(0)])
    assert doc["blocks"][0]["replicas"][0]["ttl_ms"] == 300
    await eventually(lambda: _is(count(http, ix.url, [key(0)]), 0), timeout=3.0, what="the record expired")
    assert time.monotonic() - start >= 0.29
    assert "kvsp_index_ttl_capped_total 1" in (await http.get(ix.url + "metrics", headers=auth("t-metrics"))).text


async def test_ttl_below_the_cap_is_kept(serve, http):
    ix = serve(max_ttl_ms=2_000)
    rec = record(key(0), ttl_ms=200)
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert r.json()["ttl_ms"] == 200
    await eventually(lambda: _is(count(http, ix.url, [key(0)]), 0), timeout=3.0, what="the record expired")


async def test_refresh_extends_expiry_and_a_lapsed_record_is_created_anew(serve, http):
    ix = serve()
    rec = record(key(0), ttl_ms=1_000)
    start = time.monotonic()
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 201
    await asyncio.sleep(0.5)
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 200
    await asyncio.sleep(max(0.0, 1.2 - (time.monotonic() - start)))
    assert await count(http, ix.url, [key(0)]) == 1  # past the first expiry, not the second
    await eventually(lambda: _is(count(http, ix.url, [key(0)]), 0), timeout=3.0, what="the record expired")
    assert (await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))).status_code == 201


async def test_a_key_whose_replicas_all_expired_ends_the_match(serve, http):
    ix = serve()
    recs = [record(key(0)), record(key(1), ttl_ms=200), record(key(2))]
    r = await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert r.status_code == 200
    r = await http.post(ix.url + "replicas:batch",
                        json={"records": [record(key(1), holder=H2, ttl_ms=500)]},
                        headers=auth("t-h2"))
    assert r.status_code == 200

    async def only_h2() -> bool:
        doc = await lookup(http, ix.url, [key(0), key(1), key(2)])
        return [r["holder"] for r in doc["blocks"][1]["replicas"]] == [H2]

    await eventually(only_h2, timeout=3.0, what="only H2's replicas")
    assert await count(http, ix.url, [key(0), key(1), key(2)]) == 3
    await eventually(lambda: _is(count(http, ix.url, [key(0), key(1), key(2)]), 1), timeout=3.0,
                     what="one block matched")


async def test_delete_of_an_expired_record_is_not_found(serve, http):
    ix = serve()
    rec = record(key(0), ttl_ms=150)
    await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    await eventually(lambda: _is(count(http, ix.url, [key(0)]), 0), timeout=3.0, what="the record expired")
    assert_problem(await http.delete(ix.url + path(rec), headers=auth("t-h1")), 404,
                   "kvsp-not-found")


async def test_the_background_sweeper_keeps_the_gauge(serve, http, redis_url):
    ix = serve(store=RedisReplicaStore(redis_url, count_interval_s=0.05),
               sweep_interval_s=0.05, clock=time.monotonic)
    recs = [record(key(i), ttl_ms=200, layers=1) for i in range(3)]
    await http.post(ix.url + "replicas:batch", json={"records": recs}, headers=auth("t-h1"))
    assert ix.store.records == 3
    assert "kvsp_index_replica_records 3" in (await http.get(ix.url + "metrics", headers=auth("t-metrics"))).text

    async def gauge_zero() -> bool:
        return "kvsp_index_replica_records 0" in (await http.get(ix.url + "metrics", headers=auth("t-metrics"))).text

    await eventually(gauge_zero, timeout=4.0, what="the gauge at zero", step=0.05)


async def test_an_unreachable_store_answers_503(serve, http):
    store = RedisReplicaStore(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5,
                              retry=None)
    ix = serve(store=store)
    rec = record(key(0))
    r = await http.put(ix.url + path(rec), json=rec, headers=auth("t-h1"))
    assert_problem(r, 503, "kvsp-transport")
    r = await http.post(ix.url + "lookup", json=lookup_body([key(0)]), headers=auth("t-pc"))
    assert_problem(r, 503, "kvsp-transport")


async def _is(awaitable, value) -> bool:
    return await awaitable == value


# ------------------------------------------------------------------ kvsp index --store


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvsp index")
    service.configure_parser(p)
    return p.parse_args(argv)


def test_store_option():
    assert parse().store == "memory"
    assert type(service.settings_from_args(parse()).store).__name__ == "MemoryReplicaStore"
    store = service.settings_from_args(parse("--store", "redis://127.0.0.1:6399/2")).store
    assert isinstance(store, RedisReplicaStore) and store.url == "redis://127.0.0.1:6399/2"


@pytest.mark.parametrize("value", ["redis://127.0.0.1:x/0", "postgres://db/", "mem"])
def test_bad_store_is_refused_with_one_line(value, capsys):
    assert service.run(parse("--store", value)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvsp index:"), err


class IndexProcess:
    """`kvsp index --role is --store URL` in its own process, on a fixed port."""

    CODE = ("import argparse, sys; from index import service; p = argparse.ArgumentParser(); "
            "service.configure_parser(p); sys.exit(service.run(p.parse_args(sys.argv[1:])))")

    def __init__(self, store_url: str, log: Path) -> None:
        self.store_url = store_url
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self, timeout: float = 20.0) -> "IndexProcess":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", self.CODE, "--role", "is", "--store", self.store_url,
                 "--listen", f"127.0.0.1:{self.port}"], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "index process did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def index_process(tmp_path: Path) -> Iterator[Callable[[str], IndexProcess]]:
    procs: list[IndexProcess] = []

    def start(store_url: str) -> IndexProcess:
        proc = IndexProcess(store_url, tmp_path / f"index{len(procs)}.log")
        procs.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()


def records(n: int, holder: str = H1, ttl_ms: int = 60_000) -> list[ReplicaRecord]:
    return [ReplicaRecord.from_json(record(key(i), holder=holder, ttl_ms=ttl_ms, layers=2))
            for i in range(n)]


async def test_two_processes_share_one_index(redis_url, index_process, http):
    a, b = index_process(redis_url), index_process(redis_url)
    recs = records(100)
    async with IndexClient(a.url) as client:
        await client.put_many(recs)
    keys = [key(i) for i in range(100)]
    assert await count(http, b.url, keys) == 100
    async with IndexClient(b.url) as client:
        await client.delete(recs[50])
    assert await count(http, a.url, keys) == 50
    r = await http.put(b.url + path(record(key(50))), json=record(key(50)))
    assert r.status_code == 201  # withdrawn through one, published anew through the other
    r = await http.put(a.url + path(record(key(50))), json=record(key(50)))
    assert r.status_code == 200  # and a refresh through the first
    assert await count(http, a.url, keys) == 100


async def test_an_index_process_killed_and_restarted_loses_nothing(redis_url, index_process,
                                                                   http):
    a, b = index_process(redis_url), index_process(redis_url)
    async with IndexClient(a.url) as client:
        await client.put_many(records(300))
    keys = [key(i) for i in range(300)]
    a.kill()
    assert await count(http, b.url, keys) == 300
    a.start()
    assert await count(http, a.url, keys) == 300


async def test_redis_restarted_with_persistence_loses_nothing(own_redis, index_process, http):
    server = own_redis(persistent=True)
    a, b = index_process(server.url), index_process(server.url)
    async with IndexClient(a.url) as client:
        await client.put_many(records(500))
        await client.put_many(records(200, holder=H2))
    keys = [key(i) for i in range(500)]
    server.restart()  # SIGTERM: Redis writes out its append-only file, then starts from it
    for ix in (a, b):
        doc = await lookup(http, ix.url, keys)
        assert doc["matched"] == 500
        assert sum(len(blk["replicas"]) for blk in doc["blocks"]) == 700


async def test_without_persistence_refreshes_rebuild_the_index_within_one_interval(
        own_redis, index_process, http):
    server: RedisServer = own_redis(persistent=False)
    a, b = index_process(server.url), index_process(server.url)
    interval = 0.5
    recs = records(400, ttl_ms=3_000)
    keys = [key(i) for i in range(400)]
    failures = 0

    async def refresh_forever() -> None:  # a holder's publisher, reduced to its refresh loop
        nonlocal failures
        async with IndexClient(a.url, timeout=2.0) as client:
            while True:
                try:
                    await client.put_many(recs)
                except KvspError:
                    failures += 1  # Redis is restarting: the next round publishes again
                await asyncio.sleep(interval)

    task = asyncio.create_task(refresh_forever())
    try:
        await eventually(lambda: _is(count(http, b.url, keys), 400), timeout=5.0, what="all 400 blocks matched")
        server.restart()  # everything is gone
        ready = time.monotonic()
        await eventually(lambda: _is(_matched_or_none(http, b.url, keys), 400), timeout=interval + 3.0,
                         what="all 400 blocks matched after the restart")
        rebuilt = time.monotonic() - ready
        assert rebuilt <= interval + 1.0, rebuilt
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _matched_or_none(http, base: str, keys: list[str]) -> int | None:
    r = await http.post(base + "lookup", json=lookup_body(keys), headers=auth("t-pc"))
    return r.json()["matched"] if r.status_code == 200 else None

