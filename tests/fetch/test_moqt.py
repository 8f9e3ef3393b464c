"""KV blocks over MOQT, the fetching side: MoqtBlockFetcher, through a relay to a
BlockPublisher, yields verified layers, refuses what it cannot serve and joins live blocks."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.errors import DigestMismatch, LayersUnavailable, NotFound
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.store import BlockId
from kvsp_moq.naming import BlockTrack, moqt_record
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord
from tests.block_tracks import CERT, COMPAT, HTTP_HOLDER, SCOPE, STEP, container, key, same_layers, stored, system


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
