"""KV blocks over MOQT, the publishing side: BlockPublisher serves stored and in-production
blocks through a relay, announces again after a relay restart, and serves the bytes a
holder's HTTP side serves."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.moqt.quic import connect
from kvsp_moq.moqt.wire import property_value
from kvsp_moq.naming import K_LENGTH_PROPERTY, BlockTrack, moqt_record
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord
from relay.relay import Relay, RelaySettings
from tests.block_tracks import (
    CERT,
    COMPAT,
    HTTP_HOLDER,
    OTHER_SCOPE,
    SCOPE,
    STEP,
    container,
    key,
    same_layers,
    stored,
    system,
)


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
