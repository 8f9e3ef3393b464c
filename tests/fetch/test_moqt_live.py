"""Blocks in production over MOQT (DESIGN §9): a consumer of an in-production record (no
digests) checks each layer against the digest it carries, joins late with the earlier layers
and the rest live, and a subscriber too slow for the relay's queue is dropped without slowing
the producer, then catches up by FETCH and subscribes again."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.errors import DigestMismatch
from kvsp_moq.fetch.moqt import MoqtBlockFetcher
from kvsp_moq.holder.moqt_publisher import LiveBlock
from kvsp_moq.holder.store import BlockId
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.wire import Properties
from kvsp_moq.naming import LAYER_DIGEST_PROPERTY
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import LIVE_DIGEST
from tests.block_tracks import CERT, COMPAT, SCOPE, STEP, container, key, same_layers, system


async def _collect(stream) -> list:
    return [layer async for layer in stream]


async def _announced(publisher) -> None:
    for _ in range(200):
        if (COMPAT, SCOPE) in publisher.announced:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the namespace was never announced")


async def test_an_in_production_record_is_read_live_and_verified_by_carried_digests():
    async with system() as (relay, store, publisher, fetcher):
        whole = Container(container(11, layers=6))
        live = publisher.produce(BlockId(COMPAT, SCOPE, key(11)), layer_count=6, token_count=16)
        record = publisher.live_record(live)
        assert record.live and record.digest == LIVE_DIGEST and record.layer_digests is None
        assert record.holder == relay.url
        await _announced(publisher)
        first = asyncio.ensure_future(_collect(fetcher.layers([], record, (0, 5))))
        for i in range(3):
            await asyncio.sleep(0.05)
            live.add_layer(whole.layer(i).k, whole.layer(i).v)
        # A late joiner: the first three layers by FETCH (from the relay), the rest live.
        late = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP)
        try:
            stream = late.layers([], record, (0, 5))
            second = asyncio.ensure_future(_collect(stream))
            await asyncio.sleep(0.2)
            for i in range(3, 6):
                live.add_layer(whole.layer(i).k, whole.layer(i).v)
            same_layers(await asyncio.wait_for(first, STEP), whole, 0, 5)
            same_layers(await asyncio.wait_for(second, STEP), whole, 0, 5)
            # Every layer's digest, as the complete record will list it.
            assert stream.carried == {i: d for i, d in enumerate(whole.layer_digests())}
        finally:
            await late.aclose()
        entry = await live.finish()
        assert entry is not None
        assert publisher.record(entry).layer_digests == tuple(d.hex() for d in whole.layer_digests())


async def test_a_live_layer_that_does_not_match_its_carried_digest_is_refused(monkeypatch):
    async with system() as (relay, store, publisher, fetcher):
        whole = Container(container(12, layers=4))
        live = publisher.produce(BlockId(COMPAT, SCOPE, key(12)), layer_count=4, token_count=16)
        original = LiveBlock.properties

        def wrong(self: LiveBlock, index: int) -> Properties:
            props = original(self, index)
            return tuple((t, bytes(32) if t == LAYER_DIGEST_PROPERTY and index == 2 else v) for t, v in props)

        monkeypatch.setattr(LiveBlock, "properties", wrong)
        await _announced(publisher)
        for i in range(4):
            live.add_layer(whole.layer(i).k, whole.layer(i).v)
        got = []
        with pytest.raises(DigestMismatch):
            async for layer in fetcher.layers([], publisher.live_record(live), (0, 3)):
                got.append(layer)
        same_layers(got, whole, 0, 1)  # the bad layer and those after it were never yielded


async def test_a_slow_subscriber_is_dropped_and_catches_up_without_slowing_the_producer():
    layers = 24
    async with system(subscriber_queue_objects=2, subscriber_queue_bytes=1 << 20) as (
            relay, store, publisher, fetcher):
        whole = Container(container(13, layers=layers, section=256 << 10))
        live = publisher.produce(BlockId(COMPAT, SCOPE, key(13)), layer_count=layers, token_count=16)
        record = publisher.live_record(live)
        await _announced(publisher)
        # Small receive windows: what it does not read backs up into the relay's queue for it.
        slow = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP,
                                settings=QuicSettings(max_stream_data=512 << 10, max_data=1 << 20))
        try:
            slow_stream = slow.layers([], record, (0, layers - 1))
            iterator = slow_stream.__aiter__()
            fast = asyncio.ensure_future(_collect(fetcher.layers([], record, (0, layers - 1))))
            slow_first = asyncio.ensure_future(iterator.__anext__())
            live.add_layer(whole.layer(0).k, whole.layer(0).v)
            first = await asyncio.wait_for(slow_first, STEP)
            # The producer adds everything at once; the slow subscriber reads nothing meanwhile.
            for i in range(1, layers):
                live.add_layer(whole.layer(i).k, whole.layer(i).v)
            same_layers(await asyncio.wait_for(fast, STEP), whole, 0, layers - 1)
            for _ in range(200):
                if relay.stats.subscribers_dropped:
                    break
                await asyncio.sleep(0.02)
            assert relay.stats.subscribers_dropped >= 1
            rest = [layer async for layer in iterator]
            same_layers([first, *rest], whole, 0, layers - 1)
            assert any("too far behind" in note for note in slow_stream.notes), slow_stream.notes
        finally:
            await slow.aclose()
