"""Leases, eviction and a full disk at a real holder process (issue #8, faults).

- A lease that expires during a slow fetch: the block being read is not evicted under the
  reader even though its lease is gone; the fetch completes verified; the lease is gone.
- Eviction racing lookups: a client that looked a block up just before it was evicted gets a
  clean miss (404) and moves to the next source; never a wrong or partial layer; the evicted
  replica's record is withdrawn.
- A full disk: a PUT answers 507 with a problem document, and nothing of the block is visible
  (no GET, no record, no leftover file, nothing after a restart). The disk is a real 4 MiB
  tmpfs when this process may mount one (root), otherwise (or with KVSP_FAULTS_NO_MOUNT=1) the
  holder runs under RLIMIT_FSIZE, which makes the same write fail with EFBIG; the test prints
  which.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.protocol.container import Container
from tests.faults.conftest import (
    COMPAT,
    SCOPE,
    Processes,
    block_key,
    lookup,
    make_container,
    put_block,
    small_window_client,
    stored_record,
)
from tests.polling import wait_until

MiB = 1 << 20


def layer_bytes(body: bytes) -> dict[int, bytes]:
    return {x.index: bytes(x.k) + bytes(x.v) for x in Container(body).layers()}


def head(url: str, bkey: str) -> int:
    return httpx.head(f"{url}blocks/{COMPAT}/{SCOPE}/{bkey}", timeout=5, trust_env=False).status_code


async def test_lease_expires_during_slow_fetch(procs: Processes) -> None:
    holder = procs.holder(host_bytes="40M")
    x, y, z = (make_container(30 + i, layers=16, layer_bytes=MiB) for i in range(3))
    kx, ky, kz = (block_key(30 + i) for i in range(3))
    record = stored_record(holder.url, kx, x)
    async with httpx.AsyncClient(base_url=holder.url, trust_env=False, timeout=5) as client:
        r = await client.post("leases", json={"block_keys": [kx], "ttl_ms": 300})
        assert r.status_code == 201, r.text
        lease = r.json()["lease"] if "lease" in r.json() else r.json()["lease_id"]

        got: dict[int, bytes] = {}
        async with small_window_client() as slow, HttpFetcher(client=slow) as fetcher:
            stream = fetcher.layers([holder.url], record)
            async for layer in stream:
                got[layer.index] = bytes(layer.k) + bytes(layer.v)
                if layer.index == 0:
                    await asyncio.sleep(0.6)  # the lease runs out while the body is mostly unsent
                    assert (await client.put(f"leases/{lease}")).status_code == 404, \
                        "an expired lease cannot be renewed"
                    assert put_block(holder.url, ky, y).status_code == 201
                    # Room for z must come from y: x is being read, lease or not.
                    assert (await asyncio.to_thread(put_block, holder.url, kz, z)).status_code == 201
                    assert head(holder.url, kx) == 200, "the block being read was evicted"
                    assert head(holder.url, ky) == 404, "the unread, unleased block is the one evicted"
                await asyncio.sleep(0.1)  # a slow consumer
    assert got == layer_bytes(x), "the slow fetch completed with every layer verified"
    assert stream.failures == []


def test_eviction_racing_lookups(procs: Processes) -> None:
    index = procs.index()
    small = procs.holder(index=index.url, host_bytes="3M", ttl_ms=3000)  # ~3 blocks fit
    backup = procs.holder(host_bytes="64M")
    n = 12
    bodies = {block_key(40 + i): make_container(40 + i, layers=4, layer_bytes=256 << 10) for i in range(n)}
    for key, body in bodies.items():
        stored_record(backup.url, key, body)
    keys = list(bodies)
    stop = threading.Event()
    errors: list[str] = []
    outcomes = {"verified": 0, "miss_then_next": 0, "not_listed": 0}

    def writer() -> None:
        for key in keys:
            r = put_block(small.url, key, bodies[key])
            if r.status_code != 201:
                errors.append(f"PUT {key[:8]}: {r.status_code} {r.text}")
            time.sleep(0.15)
        stop.set()

    async def reader() -> None:
        rnd = random.Random(7)
        async with HttpFetcher(timeout=5.0) as fetcher:
            while not stop.is_set():
                key = rnd.choice(keys)
                found = await asyncio.to_thread(lookup, index.url, [key])
                records = [r for r in found[key] if r.holder == small.url]
                if not records:
                    outcomes["not_listed"] += 1
                    continue
                stream = fetcher.layers([small.url, backup.url], records[0])
                try:
                    got = {x.index: bytes(x.k) + bytes(x.v) async for x in stream}
                except Exception as e:  # reported below
                    errors.append(f"fetch {key[:8]}: {e!r}")
                    continue
                if got != layer_bytes(bodies[key]):
                    errors.append(f"fetch {key[:8]}: wrong layers")
                if stream.failures:
                    reasons = [why for _, why in stream.failures]
                    if not all(why.startswith("HTTP 404") for why in reasons):
                        errors.append(f"fetch {key[:8]}: unexpected failures {reasons}")
                    outcomes["miss_then_next"] += 1
                else:
                    outcomes["verified"] += 1

    t = threading.Thread(target=writer)
    t.start()
    asyncio.run(asyncio.wait_for(reader(), 60))
    t.join(10)
    print(f"\neviction vs lookup: {outcomes}")
    assert not errors, errors
    assert outcomes["verified"] > 0

    # The race forced: a record looked up, then its replica evicted, then the fetch.
    held = [k for k in keys if head(small.url, k) == 200]
    stale = lookup(index.url, held[:1])[held[0]]
    stale = [r for r in stale if r.holder == small.url]
    assert stale, "a held block is listed"
    for i in range(3):
        key = block_key(80 + i)
        bodies[key] = make_container(80 + i, layers=4, layer_bytes=256 << 10)
        assert put_block(small.url, key, bodies[key]).status_code == 201
    assert head(small.url, held[0]) == 404, "three newer blocks must have evicted it"

    async def fetch_stale() -> tuple[dict[int, bytes], list[tuple[str, str]]]:
        async with HttpFetcher(timeout=5.0) as fetcher:
            stream = fetcher.layers([small.url, backup.url], stale[0])
            return {x.index: bytes(x.k) + bytes(x.v) async for x in stream}, stream.failures

    got, failures = asyncio.run(fetch_stale())
    assert got == layer_bytes(bodies[held[0]]), "the next source delivered the block"
    assert len(failures) == 1 and failures[0][0] == small.url and failures[0][1].startswith("HTTP 404"), \
        failures
    keys = list(bodies)

    def listed_and_held() -> tuple[set[str], set[str]]:
        found = lookup(index.url, keys)
        listed = {k[:8] for k, recs in found.items() if any(r.holder == small.url for r in recs)}
        held = {k[:8] for k in keys if head(small.url, k) == 200}
        return listed, held

    deadline = time.monotonic() + 5.0  # evicted replicas are withdrawn
    while (state := listed_and_held())[0] != state[1]:
        assert time.monotonic() < deadline, f"index lists {state[0]}, holder holds {state[1]}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, str, Callable[[], None] | None]]:
    """(data dir, how it is limited, preexec for the holder)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount") and not os.environ.get("KVSP_FAULTS_NO_MOUNT"):
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                            capture_output=True).returncode
        mounted = rc == 0
    try:
        if mounted:
            yield mnt, "tmpfs of 4 MiB (ENOSPC)", None
        else:
            limit = 2 * MiB  # per file: the 1.5 MiB blocks fit, the 3 MiB one does not

            def preexec() -> None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

            yield mnt, "RLIMIT_FSIZE of 2 MiB per file (EFBIG; the logs stay far below it)", preexec
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_put_fails_cleanly(procs: Processes, small_disk) -> None:
    data, how, preexec = small_disk
    index = procs.index()
    # No host tier to speak of: every block goes straight to the (too small) disk.
    holder = procs.holder(index=index.url, data=data, host_bytes="1K", disk_bytes="1G",
                          preexec=preexec)
    stored: dict[str, bytes] = {}
    refused: dict[str, httpx.Response] = {}
    for i in range(8):  # 1.5 MiB, 1.5 MiB, then 3 MiB blocks: the third cannot fit either way
        layers = 4 if i < 2 else 8
        key, body = block_key(60 + i), make_container(60 + i, layers=layers, layer_bytes=384 << 10)
        r = put_block(holder.url, key, body)
        if r.status_code == 201:
            stored[key] = body
        else:
            refused[key] = r
            break
    print(f"\nfull disk via {how}: {len(stored)} blocks stored, then the PUT was refused")
    assert stored, "some blocks fit"
    assert refused, "the disk never filled"
    (key, r), = refused.items()
    assert r.status_code == 507, f"a full disk must answer 507, not {r.status_code}: {r.text[:200]}"
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"] == "urn:kvsp:problem:kvsp-store-full", r.json()
    assert head(holder.url, key) == 404, "nothing of the refused block is served"
    leftovers = [p.name for p in data.rglob("*") if p.is_file() and not p.name.endswith(".kvb")]
    assert leftovers == [], f"partial files left behind: {leftovers}"
    wait_until(lambda: all(lookup(index.url, list(stored))[k] for k in stored), timeout=5,
               what="records of the stored blocks", step=0.05,
               ignoring=(httpx.HTTPError, OSError, AssertionError))
    assert lookup(index.url, [key])[key] == [], "no record for the refused block"
    for k, body in stored.items():
        got = httpx.get(f"{holder.url}blocks/{COMPAT}/{SCOPE}/{k}", timeout=5, trust_env=False)
        assert got.status_code == 200 and got.content == body

    holder.kill()
    holder.start()  # what survives on disk is whole: exactly the stored blocks
    assert {k for k in [*stored, key] if head(holder.url, k) == 200} == set(stored)
