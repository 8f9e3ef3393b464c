"""Interop with aiomoqt 0.13.3 over draft-18 raw QUIC, in both directions:

1. aiomoqt's conformance client against our relay, at drafts 18, 20 and 22: the 12 default
   cases, then `fetch` and `join`; every case must be `ok`, none skipped, none accepted only
   under a COMPAT tolerance.
2. KV blocks through aiomoqt's relay, at drafts 18, 20 and 22: our BlockPublisher announces,
   our MoqtBlockFetcher fetches a stored block and subscribes to one being produced.
3. Objects byte for byte: an aiomoqt publisher through our relay to our subscriber, and, at
   drafts 18, 20 and 22, our publisher through aiomoqt's relay to an aiomoqt subscriber and an
   aiomoqt publisher through aiomoqt's relay to our subscriber.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
from pathlib import Path

import numpy as np
import pytest

from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.quic import IncomingSubscribe, QuicSettings, connect
from kvsp_moq.naming import moqt_record
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.records import ReplicaRecord

from .conftest import (
    PEER_BIN,
    PEER_PYTHON,
    PEERS,
    aiomoqt_relay,
    our_relay,
    read_track,
    spawn,
)

STANDARD_CASES = [
    "setup-only", "announce-only", "publish-namespace-done", "subscribe-error", "rendezvous-timeout",
    "announce-subscribe", "subscribe-before-announce", "data-subgroup-basic", "subscribe-namespace-lifecycle",
    "namespace-discovery", "publish-track-only", "publish-track-subscribe",
]
_TAP_LINE = re.compile(r"^(ok|not ok) (\d+) - (\S+)(.*)$")
STEP = 20.0
JOIN_RUNS = 5


def parse_tap(text: str) -> tuple[int, list[tuple[bool, str, str]]]:
    """(planned count, [(ok, case, directive text), ...]) of a TAP 14 report."""
    plan = -1
    results = []
    for line in text.splitlines():
        if re.fullmatch(r"1\.\.\d+", line.strip()):
            plan = int(line.strip()[3:])
        m = _TAP_LINE.match(line)
        if m:
            results.append((m.group(1) == "ok", m.group(3), m.group(4).strip()))
    return plan, results


async def run_interop_client(url: str, case: str | None, log: Path, draft: str = "18") -> str:
    argv = [str(PEER_BIN / "moq-interop-client"), "--draft", draft, "--tls-disable-verify", "-r", url]
    if case:
        argv += ["-t", case]
    with open(log, "ab") as err:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=err)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 180)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"moq-interop-client {case or ''} did not finish in time") from None
    return out.decode(errors="replace")


def assert_all_ok(tap: str, expected: list[str]) -> None:
    plan, results = parse_tap(tap)
    report = "\n" + tap
    assert plan == len(expected) == len(results), report
    assert [name for _, name, _ in results] == expected, report
    for ok, name, directive in results:
        assert ok, f"{name} failed:{report}"
        assert "SKIP" not in directive.upper(), f"{name} was skipped:{report}"
        assert "COMPAT" not in directive.upper(), f"{name} passed only under a COMPAT tolerance:{report}"
    assert "compat: true" not in tap, report


# --------------------------------------------------------------------------- 1


@pytest.mark.matrix("aiomoqt interop client: 12 default cases, fetch", "our relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_aiomoqt_conformance_client_against_our_relay(tmp_path, draft):
    async with our_relay(tmp_path) as url:
        log = tmp_path / "interop-client.log"
        tap = await run_interop_client(url, None, log, draft)
        assert_all_ok(tap, STANDARD_CASES)
        assert tap.count(f'moqt_version: "moqt-{draft}"') >= len(STANDARD_CASES), tap
        assert_all_ok(await run_interop_client(url, "fetch", log, draft), ["fetch"])


@pytest.mark.matrix("aiomoqt interop client: join (from 20: FILL)", "our relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_aiomoqt_conformance_client_join_against_our_relay(tmp_path, draft):
    """aiomoqt sends SUBSCRIBE and its joining FETCH back to back; the relay answers the
    SUBSCRIBE from a handler task, which runs after the session has already seen the FETCH
    whenever both arrive in one batch of datagrams: the session holds the FETCH until
    SUBSCRIBE_OK goes out. Repeated, since the order in which the two arrive varies. From
    draft-20 the joining FETCH is FILL_PARAMETERS in the SUBSCRIBE, served the same way."""
    async with our_relay(tmp_path) as url:
        for _ in range(JOIN_RUNS):
            assert_all_ok(await run_interop_client(url, "join", tmp_path / "interop-client.log", draft), ["join"])


# --------------------------------------------------------------------------- 2

COMPAT, SCOPE = "ab" * 32, "cd" * 16
HTTP_HOLDER = "http://127.0.0.1:8801/"


def block(n: int, layers: int = 32, section: int = 8192) -> bytes:
    rng = np.random.default_rng(n)
    return encode(0, 16, [(rng.bytes(section), rng.bytes(section)) for _ in range(layers)])


def record_of(bid: BlockId, data: bytes, relay_url: str) -> ReplicaRecord:
    whole = Container(data)
    http = ReplicaRecord(block_key=bid.block_key, compat_id=bid.compat_id, scope_id=bid.scope_id,
                         holder=HTTP_HOLDER, codec=1, size=len(data), digest="sha-256:" + whole.digest().hex(),
                         ttl_ms=60_000, layer_digests=tuple(d.hex() for d in whole.layer_digests()))
    return moqt_record(http, relay_url)


def assert_layers(got, data: bytes, first: int, last: int) -> None:
    whole = Container(data)
    assert [layer.index for layer in got] == list(range(first, last + 1))
    for layer in got:
        ref = whole.layer(layer.index)
        assert bytes(layer.k) == bytes(ref.k) and bytes(layer.v) == bytes(ref.v)


@pytest.mark.matrix("our holder -> our fetcher (KV blocks: FETCH, SUBSCRIBE)", "aiomoqt relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_kv_blocks_through_the_aiomoqt_relay(tmp_path, draft):
    settings = QuicSettings(client_drafts=(int(draft),))
    async with aiomoqt_relay(tmp_path, int(draft)) as url:
        store = BlockStore(host_bytes=64 << 20)
        publisher = await BlockPublisher(store, url, HTTP_HOLDER, verify=False, rescan_interval=0.1,
                                         settings=settings).start()
        fetcher = MoqtBlockFetcher(verify=False, timeout=STEP, layer_timeout=STEP, settings=settings)
        try:
            stored_id = BlockId(COMPAT, SCOPE, hashlib.sha256(b"stored").hexdigest())
            stored = block(1)
            await store.put(stored_id, stored)
            await publisher.wait_connected(STEP)
            for _ in range(100):  # announced: PUBLISH_NAMESPACE accepted by aiomoqt's relay
                if (COMPAT, SCOPE) in publisher.announced:
                    break
                await asyncio.sleep(0.05)
            assert (COMPAT, SCOPE) in publisher.announced
            record = record_of(stored_id, stored, url)
            # FETCH through aiomoqt's relay (which asks our publisher), whole block and a range.
            assert_layers([layer async for layer in fetcher.layers([], record)], stored, 0, 31)
            assert_layers([layer async for layer in fetcher.layers([], record, (8, 15))], stored, 8, 15)

            # SUBSCRIBE to a block being produced, layer by layer.
            live_id = BlockId(COMPAT, SCOPE, hashlib.sha256(b"live").hexdigest())
            live_data = block(2, layers=8)
            whole = Container(live_data)
            live = publisher.produce(live_id, layer_count=8, token_count=16)
            stream = fetcher.layers([], record_of(live_id, live_data, url), live=True)
            consumer = asyncio.ensure_future(_collect(stream))
            await asyncio.sleep(0.3)
            for i in range(8):
                live.add_layer(whole.layer(i).k, whole.layer(i).v)
                await asyncio.sleep(0.05)
            assert_layers(await asyncio.wait_for(consumer, STEP), live_data, 0, 7)
            assert publisher.stats.subscribes >= 1 and publisher.stats.fetches >= 1
        finally:
            await fetcher.aclose()
            await publisher.aclose()


async def _collect(stream) -> list:
    return [layer async for layer in stream]


# --------------------------------------------------------------------------- 3


def payload(seed: str, group: int, obj: int, size: int) -> bytes:
    """What interop/peers/aiomoqt_pub.py sends as object (group, obj)."""
    return hashlib.shake_256(f"{seed}:{group}:{obj}".encode()).digest(size)


@pytest.mark.matrix("aiomoqt publisher -> our subscriber", "our relay")
async def test_aiomoqt_publisher_through_our_relay_to_our_subscriber(tmp_path):
    seed, groups, objects, size = secrets.token_hex(8), 3, 6, 30_000
    namespace = f"interop/{seed}"
    async with our_relay(tmp_path) as url, spawn(
            str(PEER_PYTHON), str(PEERS / "aiomoqt_pub.py"), url, namespace, "objects",
            str(groups), str(objects), str(size), seed, name="aiomoqt publisher",
            stderr=tmp_path / "aiomoqt-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        got = await read_track(url, namespace, "objects", timeout=STEP)
        expected = [(g, o, payload(seed, g, o, size)) for g in range(groups) for o in range(objects)]
        assert sorted(got) == expected


@pytest.mark.matrix("our publisher -> aiomoqt subscriber", "aiomoqt relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_our_publisher_through_aiomoqt_relay_to_aiomoqt_subscriber(tmp_path, draft):
    seed, groups, objects, size = secrets.token_hex(8), 3, 5, 20_000
    namespace = ("interop", seed)
    expected = [(g, o, payload(seed, g, o, size)) for g in range(groups) for o in range(objects)]
    out = tmp_path / "received.json"
    async with aiomoqt_relay(tmp_path, int(draft)) as url:
        publisher = await connect(url, verify=False, timeout=STEP, drafts=(int(draft),))
        subscribed = asyncio.Event()

        async def on_subscribe(req: IncomingSubscribe) -> None:
            subscription = req.accept()
            await subscribed.wait()
            for g in range(groups):
                sender = subscription.open_subgroup(g)
                for o in range(objects):
                    await sender.send(o, payload(seed, g, o, size))
                sender.close()
            await subscription.finish()

        publisher.on_subscribe(on_subscribe)
        try:
            await publisher.publish_namespace(namespace, timeout=STEP)
            async with spawn(str(PEER_PYTHON), str(PEERS / "aiomoqt_sub.py"), url, "/".join(namespace), "objects",
                             str(len(expected)), str(out), "--draft", draft, name="aiomoqt subscriber",
                             stderr=tmp_path / "aiomoqt-sub.log") as sub:
                await sub.wait_for_line("SUBSCRIBED", STEP)
                subscribed.set()
                await sub.wait_for_line("DONE", STEP)
        finally:
            await publisher.aclose()
    got = sorted((g, o, bytes.fromhex(p)) for g, o, p in json.loads(out.read_text()))
    assert got == expected


@pytest.mark.matrix("aiomoqt publisher -> our subscriber", "aiomoqt relay")
@pytest.mark.parametrize("draft", ["18", "20", "22"])
async def test_aiomoqt_publisher_through_aiomoqt_relay_to_our_subscriber(tmp_path, draft):
    seed, groups, objects, size = secrets.token_hex(8), 3, 4, 25_000
    namespace = f"interop/{seed}"
    async with aiomoqt_relay(tmp_path, int(draft)) as url, spawn(
            str(PEER_PYTHON), str(PEERS / "aiomoqt_pub.py"), url, namespace, "objects", str(groups), str(objects),
            str(size), seed, "--draft", draft, name="aiomoqt publisher", stderr=tmp_path / "aiomoqt-pub.log") as pub:
        await pub.wait_for_line("READY", STEP)
        got = await read_track(url, namespace, "objects", draft=int(draft), timeout=STEP)
    assert sorted(got) == [(g, o, payload(seed, g, o, size)) for g in range(groups) for o in range(objects)]
