"""Our relay between sessions of different drafts (18, 20, 22), and KV block tracks to aiomoqt.

1. aiomoqt publisher at one draft -> our relay -> aiomoqt subscriber at another: the relay
   carries every object byte for byte between the two sessions.
2. aiomoqt publisher at draft 20 or 22 -> our relay -> our subscriber at draft 18, and an
   aiomoqt publisher at 18 -> our relay -> our subscriber at 20 or 22.
3. A KV block track (2 MiB, 32 layers) published by our holder into our relay, FETCHed whole
   by aiomoqt at drafts 18, 20 and 22 (from 20 on, the range travels as a LOCATION_FILTER):
   every layer object byte for byte (its SHA-256 is the layer digest of the block's record).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets

import numpy as np
import pytest

from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.naming import BlockTrack
from kvsp_moq.protocol.container import Container, encode

from .conftest import PEER_PYTHON, PEERS, our_relay, read_track, spawn

STEP = 20.0
HTTP_HOLDER = "http://127.0.0.1:8801/"


def payload(seed: str, group: int, obj: int, size: int) -> bytes:
    """What interop/peers/aiomoqt_pub.py sends as object (group, obj)."""
    return hashlib.shake_256(f"{seed}:{group}:{obj}".encode()).digest(size)


def aiomoqt_publisher(url: str, namespace: str, groups: int, objects: int, size: int, seed: str, draft: int,
                      log) -> object:
    return spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_pub.py"), url, namespace, "objects", str(groups),
                 str(objects), str(size), seed, "--draft", str(draft), name=f"aiomoqt publisher (draft {draft})",
                 stderr=log)


@pytest.mark.matrix("aiomoqt publisher -> aiomoqt subscriber (pub->sub draft)", "our relay")
@pytest.mark.parametrize("draft", ["20->18", "18->20", "22->20", "20->22", "18->22"])
async def test_objects_cross_between_drafts_through_our_relay(tmp_path, draft):
    pub_draft, sub_draft = (int(d) for d in draft.split("->"))
    seed, groups, objects, size = secrets.token_hex(8), 3, 4, 20_000
    namespace = f"interop/{seed}"
    out = tmp_path / "received.json"
    async with our_relay(tmp_path) as url, aiomoqt_publisher(
            url, namespace, groups, objects, size, seed, pub_draft, tmp_path / "aiomoqt-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        async with spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_sub.py"), url, namespace, "objects",
                         str(groups * objects), str(out), "--draft", str(sub_draft),
                         name=f"aiomoqt subscriber (draft {sub_draft})", stderr=tmp_path / "aiomoqt-sub.log") as sub:
            await sub.wait_for_line("DONE", 45)
    got = sorted((g, o, bytes.fromhex(p)) for g, o, p in json.loads(out.read_text()))
    assert got == [(g, o, payload(seed, g, o, size)) for g in range(groups) for o in range(objects)]


@pytest.mark.matrix("aiomoqt publisher -> our subscriber (pub->sub draft)", "our relay")
@pytest.mark.parametrize("draft", ["20->18", "22->18", "18->20", "18->22"])
async def test_our_subscriber_on_any_draft_gets_aiomoqt_objects(tmp_path, draft):
    pub_draft, sub_draft = (int(d) for d in draft.split("->"))
    seed, groups, objects, size = secrets.token_hex(8), 3, 5, 30_000
    namespace = f"interop/{seed}"
    async with our_relay(tmp_path) as url, aiomoqt_publisher(
            url, namespace, groups, objects, size, seed, pub_draft, tmp_path / "aiomoqt-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        got = await read_track(url, namespace, "objects", draft=sub_draft, timeout=STEP)
    assert sorted(got) == [(g, o, payload(seed, g, o, size)) for g in range(groups) for o in range(objects)]


def kv_block(layers: int = 32, size: int = 2 << 20) -> bytes:
    """A KVB1 block of `size` bytes of K and V in `layers` layers."""
    section = size // layers // 2
    rng = np.random.default_rng(7)
    return encode(0, 16, [(rng.bytes(section), rng.bytes(section)) for _ in range(layers)])


@pytest.mark.matrix("our holder -> aiomoqt FETCH (KV block, 2 MiB, 32 layers)", "our relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_kv_block_track_reaches_aiomoqt_byte_exact(tmp_path, draft):
    compat, scope = "ab" * 32, "cd" * 16
    data = kv_block()
    whole = Container(data)
    bid = BlockId(compat, scope, hashlib.sha256(b"kv-" + draft.encode()).hexdigest())
    track = BlockTrack.for_holder(compat, scope, bid.block_key, HTTP_HOLDER)
    out = tmp_path / "fetched.json"
    async with our_relay(tmp_path) as url:
        store = BlockStore(host_bytes=64 << 20)
        publisher = await BlockPublisher(store, url, HTTP_HOLDER, verify=False, rescan_interval=0.1).start()
        try:
            await store.put(bid, data)
            await publisher.wait_connected(STEP)
            for _ in range(200):
                if (compat, scope) in publisher.announced:
                    break
                await asyncio.sleep(0.05)
            assert (compat, scope) in publisher.announced
            namespace = "/".join(field.hex() for field in track.namespace)
            async with spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_fetch.py"), url, namespace,
                             track.track_name.decode(), "0", str(out), "--draft", draft,
                             name=f"aiomoqt fetcher (draft {draft})", stderr=tmp_path / "aiomoqt-fetch.log") as fetch:
                await fetch.wait_for_line("DONE", 45)
        finally:
            await publisher.aclose()
    got = json.loads(out.read_text())
    digests = [d.hex() for d in whole.layer_digests()]
    assert [(g, o) for g, o, _, _ in got] == [(0, i) for i in range(32)]
    assert [h for _, _, _, h in got] == digests
    assert sum(size for _, _, size, _ in got) == sum(len(whole.layer(i).k) + len(whole.layer(i).v) for i in range(32))
