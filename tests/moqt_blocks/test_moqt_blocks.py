"""KV blocks over MOQT: BlockPublisher -> relay -> MoqtBlockFetcher, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest

from kvsp_moq.errors import BadRecord, DigestMismatch, LayersUnavailable, NotFound
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import connect
from kvsp_moq.moqt.wire import property_value
from kvsp_moq.naming import (
    K_LENGTH_PROPERTY,
    TOKEN_COUNT_PROPERTY,
    BlockTrack,
    decode_namespace,
    layer_properties,
    moqt_record,
    publisher_id,
    split_layer,
)
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from relay.relay import Relay, RelaySettings

CERT = generate_self_signed()
COMPAT, SCOPE, OTHER_SCOPE = "ab" * 32, "cd" * 16, "ef" * 16
HTTP_HOLDER = "http://127.0.0.1:8801/"
STEP = 10.0


def key(n: int) -> str:
    return hashlib.sha256(f"block {n}".encode()).hexdigest()


def container(n: int, layers: int = 8, section: int = 20_000, tokens: int = 16, k_extra: int = 0) -> bytes:
    rng = np.random.default_rng(n)
    parts = []
    for _ in range(layers):
        parts.append((rng.bytes(section + k_extra), rng.bytes(section)))
    return encode(0, tokens, parts)


@asynccontextmanager
async def system(**relay_settings):
    """A relay, a store with a publisher attached to it, and a fetcher."""
    relay = await Relay(RelaySettings(certificate=CERT, **relay_settings)).start()
    store = BlockStore(host_bytes=256 << 20)
    publisher = await BlockPublisher(store, relay.url, HTTP_HOLDER, cadata=CERT.certificate_pem,
                                     rescan_interval=0.1).start()
    fetcher = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP)
    try:
        await publisher.wait_connected()
        yield relay, store, publisher, fetcher
    finally:
        await fetcher.aclose()
        await publisher.aclose()
        await relay.aclose()


async def stored(store: BlockStore, publisher: BlockPublisher, n: int, scope: str = SCOPE, **kw) -> tuple:
    bid = BlockId(COMPAT, scope, key(n))
    data = container(n, **kw)
    entry = await store.put(bid, data)
    publisher.announce(COMPAT, scope)
    for _ in range(100):
        if (COMPAT, scope) in publisher.announced:
            break
        await asyncio.sleep(0.02)
    return entry, Container(data), publisher.record(entry)


def same_layers(got, whole: Container, first: int, last: int) -> None:
    assert [layer.index for layer in got] == list(range(first, last + 1))
    for layer in got:
        ref = whole.layer(layer.index)
        assert bytes(layer.k) == bytes(ref.k) and bytes(layer.v) == bytes(ref.v)


# --------------------------------------------------------------------------- units


def test_layer_properties_split_k_from_v():
    props = layer_properties(16, 3)
    assert property_value(props, TOKEN_COUNT_PROPERTY) == 16 and property_value(props, K_LENGTH_PROPERTY) == 3
    layer, tokens = split_layer(4, b"kkkvv", props)
    assert (bytes(layer.k), bytes(layer.v), layer.index, tokens) == (b"kkk", b"vv", 4, 16)
    layer, tokens = split_layer(0, b"kkvv", ())
    assert (bytes(layer.k), bytes(layer.v), tokens) == (b"kk", b"vv", None)
    with pytest.raises(BadRecord):
        split_layer(0, b"odd", ())
    with pytest.raises(BadRecord):
        split_layer(0, b"ab", layer_properties(1, 9))


def test_moqt_record_names_relay_namespace_and_http_holder():
    data = container(1, layers=4, section=10)
    whole = Container(data)
    http = ReplicaRecord(block_key=key(1), compat_id=COMPAT, scope_id=SCOPE, holder=HTTP_HOLDER, codec=1,
                         size=len(data), digest="sha-256:" + whole.digest().hex(), ttl_ms=60_000,
                         layer_digests=tuple(d.hex() for d in whole.layer_digests()))
    record = moqt_record(http, "moqt://127.0.0.1:4443")
    assert record.holder == "moqt://127.0.0.1:4443" and record.http_holder == HTTP_HOLDER
    fields = decode_namespace(record.moqt_namespace)
    assert fields == (b"kvsp", COMPAT.encode(), SCOPE.encode(), publisher_id(HTTP_HOLDER).hex().encode(),
                      key(1).encode())
    assert ReplicaRecord.from_json(record.to_json()) == record
    assert replica_id(record.holder, record.moqt_namespace) != replica_id(http.holder)
    with pytest.raises(BadRecord):
        moqt_record(http, "http://not-moqt/")
    with pytest.raises(BadRecord):
        moqt_record(record, "moqt://127.0.0.1:1")


# --------------------------------------------------------------------------- through a relay


async def test_fetched_layers_are_byte_identical_to_the_stored_container():
    async with system() as (relay, store, publisher, fetcher):
        entry, whole, record = await stored(store, publisher, 1, k_extra=7)  # K and V of different sizes
        got = [layer async for layer in fetcher.layers([], record)]
        same_layers(got, whole, 0, 7)
        stream = fetcher.layers([relay.url], record, (2, 5))
        got = [layer async for layer in stream]
        same_layers(got, whole, 2, 5)
        assert stream.token_count == 16 and stream.served_by == [(relay.url, 2, 5)]
        assert stream.first_layer_seconds is not None and stream.failures == []
        result = await fetcher.fetch_block([], record, (3, 6))
        assert bytes(result.container.buffer) == whole.slice(3, 6)
        assert relay.stats.cache_hits >= 2  # the range and the slice came from the relay's cache
        assert publisher.stats.fetches == 1


async def test_a_corrupted_layer_raises_digest_mismatch_and_is_never_yielded():
    async with system() as (relay, store, publisher, fetcher):
        bid = BlockId(COMPAT, SCOPE, key(2))
        data = bytearray(container(2))
        entry = await store.put(bid, data)
        record = publisher.record(entry)
        publisher.announce(COMPAT, SCOPE)
        whole = Container(bytes(data))
        offset = whole.data_offset + 3 * 2 * 20_000 + 100  # inside layer 3
        data[offset] ^= 0xFF  # the stored copy rots after its record was made
        got = []
        with pytest.raises(DigestMismatch):
            async for layer in fetcher.layers([], record):
                got.append(layer)
        assert [layer.index for layer in got] == [0, 1, 2]
        same_layers(got, whole, 0, 2)


async def test_unknown_block_is_not_found_and_ranges_are_checked():
    async with system() as (relay, store, publisher, fetcher):
        entry, whole, record = await stored(store, publisher, 3)
        other = ReplicaRecord.from_json({**record.to_json(), "moqt_namespace":
                                         BlockTrack.for_holder(COMPAT, SCOPE, key(99), HTTP_HOLDER).moqt_namespace})
        with pytest.raises(NotFound):
            async for _ in fetcher.layers([], other):
                pass
        with pytest.raises(LayersUnavailable):
            fetcher.layers([], record, (5, 9))


async def test_block_in_production_is_served_layer_by_layer():
    async with system() as (relay, store, publisher, fetcher):
        bid = BlockId(COMPAT, OTHER_SCOPE, key(4))
        data = container(4, layers=6)
        whole = Container(data)
        live = publisher.produce(bid, layer_count=6, token_count=16)
        # The record a producer publishes once the digests are known (computed here ahead).
        record = moqt_record(ReplicaRecord(
            block_key=bid.block_key, compat_id=COMPAT, scope_id=OTHER_SCOPE, holder=HTTP_HOLDER, codec=1,
            size=len(data), digest="sha-256:" + whole.digest().hex(), ttl_ms=60_000,
            layer_digests=tuple(d.hex() for d in whole.layer_digests())), relay.url)
        for _ in range(100):
            if (COMPAT, OTHER_SCOPE) in publisher.announced:
                break
            await asyncio.sleep(0.02)
        live.add_layer(whole.layer(0).k, whole.layer(0).v)
        live.add_layer(whole.layer(1).k, whole.layer(1).v)
        got, times = [], []
        loop = asyncio.get_running_loop()

        async def consume(stream) -> None:
            async for layer in stream:
                got.append(layer)
                times.append(loop.time())

        stream = fetcher.layers([], record)
        task = asyncio.ensure_future(consume(stream))
        for i in range(2, 6):
            await asyncio.sleep(0.1)
            live.add_layer(whole.layer(i).k, whole.layer(i).v)
        await asyncio.wait_for(task, STEP)
        same_layers(got, whole, 0, 5)
        assert times[-1] - times[2] > 0.2  # layers came as they were produced
        assert any("subscribed" in n for n in stream.notes)
        await live.finish()
        assert store.get(bid) is not None
        again = [layer async for layer in fetcher.layers([], record)]  # now a plain FETCH
        same_layers(again, whole, 0, 5)


async def test_second_fetcher_joining_a_live_block_fills_the_gap():
    async with system() as (relay, store, publisher, fetcher):
        bid = BlockId(COMPAT, SCOPE, key(5))
        whole = Container(container(5, layers=6))
        live = publisher.produce(bid, layer_count=6, token_count=16)
        record = moqt_record(ReplicaRecord(
            block_key=bid.block_key, compat_id=COMPAT, scope_id=SCOPE, holder=HTTP_HOLDER, codec=1,
            size=len(whole), digest="sha-256:" + whole.digest().hex(), ttl_ms=60_000,
            layer_digests=tuple(d.hex() for d in whole.layer_digests())), relay.url)
        await asyncio.sleep(0.2)
        first = asyncio.ensure_future(_collect(fetcher.layers([], record, live=True)))
        await asyncio.sleep(0.2)
        for i in range(3):
            live.add_layer(whole.layer(i).k, whole.layer(i).v)
        await asyncio.sleep(0.2)
        other = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP)
        try:
            second = asyncio.ensure_future(_collect(other.layers([], record, live=True)))
            await asyncio.sleep(0.2)
            for i in range(3, 6):
                live.add_layer(whole.layer(i).k, whole.layer(i).v)
            same_layers(await asyncio.wait_for(first, STEP), whole, 0, 5)
            same_layers(await asyncio.wait_for(second, STEP), whole, 0, 5)
        finally:
            await other.aclose()
        assert publisher.stats.subscribes == 1  # the relay fanned one subscription out
        assert relay.stats.cache_hits >= 1  # the joiner's missing layers came from the relay's cache


async def _collect(stream) -> list:
    return [layer async for layer in stream]


async def test_publisher_reannounces_after_a_relay_restart():
    relay = await Relay(RelaySettings(certificate=CERT)).start()
    port = relay.port
    store = BlockStore(host_bytes=64 << 20)
    publisher = await BlockPublisher(store, relay.url, HTTP_HOLDER, cadata=CERT.certificate_pem,
                                     retry_initial=0.05, retry_max=0.2, rescan_interval=0.1).start()
    fetcher = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP)
    try:
        entry, whole, record = await stored(store, publisher, 6)
        same_layers([layer async for layer in fetcher.layers([], record)], whole, 0, 7)
        await relay.aclose()
        for _ in range(50):  # the same port, as a restarted relay would have
            try:
                relay = await Relay(RelaySettings(certificate=CERT, port=port)).start()
                break
            except OSError:
                await asyncio.sleep(0.05)
        for _ in range(200):
            if relay.routes.lookup(BlockTrack.from_record_namespace(record.moqt_namespace).namespace):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the publisher did not announce again")
        assert publisher.stats.connections >= 2  # a reconnect may need more than one try
        same_layers([layer async for layer in fetcher.layers([], record)], whole, 0, 7)
    finally:
        await fetcher.aclose()
        await publisher.aclose()
        await relay.aclose()


async def test_holder_http_and_moqt_replicas_deliver_the_same_bytes():
    """A real holder: the block PUT over HTTP, served by HTTP and by the publisher on the
    holder's own event loop through a relay; both fetchers yield identical layers."""
    holder = Holder(HolderSettings(listen="127.0.0.1:0")).start()
    relay = await Relay(RelaySettings(certificate=CERT)).start()
    try:
        bid = BlockId(COMPAT, SCOPE, key(7))
        data = container(7, layers=8, section=50_000)
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await client.put(f"{holder.url}blocks/{bid.path}", content=data, headers={"If-None-Match": "*"})
            assert r.status_code == 201, r.text
            http_record = ReplicaRecord.from_json(r.json())
        publisher = BlockPublisher(holder.store, relay.url, holder.url, cadata=CERT.certificate_pem)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(publisher.start(), holder.app.state.loop))
        record = moqt_record(http_record, relay.url)
        async with HttpFetcher() as http_fetcher:
            via_http = [layer async for layer in http_fetcher.layers([holder.url], http_record)]
        async with MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP) as fetcher:
            for _ in range(100):
                if relay.routes.lookup(BlockTrack.from_record_namespace(record.moqt_namespace).namespace):
                    break
                await asyncio.sleep(0.05)
            via_moqt = [layer async for layer in fetcher.layers([], record)]
        assert [(bytes(a.k), bytes(a.v)) for a in via_http] == [(bytes(b.k), bytes(b.v)) for b in via_moqt]
        same_layers(via_moqt, Container(data), 0, 7)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(publisher.aclose(), holder.app.state.loop))
    finally:
        await relay.aclose()
        holder.stop()


async def test_subscribe_to_a_stored_block_streams_all_layers_on_one_subgroup():
    async with system() as (relay, store, publisher, fetcher):
        entry, whole, record = await stored(store, publisher, 8)
        track = BlockTrack.from_record_namespace(record.moqt_namespace)
        client = await connect(relay.url, cadata=CERT.certificate_pem)
        try:
            sub = await client.subscribe(track.namespace, track.track_name, timeout=STEP)
            objects = []

            async def read() -> None:
                async for obj in sub:
                    objects.append(obj)

            await asyncio.wait_for(read(), STEP)
        finally:
            await client.aclose()
        assert [o.object_id for o in objects] == list(range(8))
        assert {o.group_id for o in objects} == {0} and {o.subgroup_id for o in objects} == {0}
        for o in objects:
            layer = whole.layer(o.object_id)
            assert o.payload == bytes(layer.k) + bytes(layer.v)
            assert property_value(o.properties, K_LENGTH_PROPERTY) == len(layer.k)
