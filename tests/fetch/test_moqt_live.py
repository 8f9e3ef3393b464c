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


async def _pass_layers(fetcher: MoqtBlockFetcher, record, last: int) -> list:
    return [(index, [(bytes(k), bytes(v), d, block_key) for k, v, d, block_key in slots])
            async for index, slots in fetcher.pass_layers(record.holder, record.live_pass[0], record.codec, 0, last)]


async def test_a_pass_track_carries_layer_l_of_every_block_of_the_pass_and_a_late_joiner_gets_all():
    """The blocks of one forward pass are slots of its pass track (DESIGN §9.6): object l is
    layer l of each, with each slot's digest and Block Key; their in-production records name the track
    and the slot. A subscriber from the start and one that joins after two layers (those by
    FETCH) both get every slot's layers byte-exact; once every block is stored the track is
    gone and a new subscriber is told it does not exist."""
    async with system() as (relay, store, publisher, fetcher):
        wholes = [Container(container(20 + j, layers=4)) for j in range(3)]
        track = publisher.open_pass(BlockId(COMPAT, SCOPE, key(20)), layer_count=4, token_count=16)
        blocks = [track.produce(BlockId(COMPAT, SCOPE, key(20 + j))) for j in range(3)]
        records = [publisher.live_record(b) for b in blocks]
        assert [r.live_pass for r in records] == [(records[0].moqt_namespace, j) for j in range(3)]
        await _announced(publisher)

        def add(i: int) -> None:
            payloads = [bytes(w.layer(i).k) + bytes(w.layer(i).v) for w in wholes]
            for b, p in zip(blocks, payloads):
                b.add_layer(p[:len(p) // 2], p[len(p) // 2:])
            track.add_layer(b"".join(payloads), b"".join(w.layer(i).digest() for w in wholes),
                            len(payloads[0]) // 2)

        first = asyncio.ensure_future(_pass_layers(fetcher, records[1], 3))
        for i in range(2):
            await asyncio.sleep(0.05)
            add(i)
        late = MoqtBlockFetcher(cadata=CERT.certificate_pem, timeout=STEP, layer_timeout=STEP)
        try:
            second = asyncio.ensure_future(_pass_layers(late, records[2], 3))
            await asyncio.sleep(0.2)
            for i in range(2, 4):
                add(i)
            for got in (await asyncio.wait_for(first, STEP), await asyncio.wait_for(second, STEP)):
                assert [index for index, _ in got] == [0, 1, 2, 3]
                for index, slots in got:
                    assert slots == [(bytes(w.layer(index).k), bytes(w.layer(index).v), w.layer(index).digest(),
                                      key(20 + j)) for j, w in enumerate(wholes)]
        finally:
            await late.aclose()
        for b in blocks:
            assert await b.finish() is not None
        with pytest.raises(Exception, match="(?i)not exist|no such pass"):
            await _pass_layers(fetcher, records[0], 3)


async def test_a_pass_abandoned_mid_way_fails_its_subscribers():
    """A pass that stops (its producer gave way or failed) ends its track with an error: a
    subscriber fails after the layers it got, and its loader goes on block by block."""
    async with system() as (relay, store, publisher, fetcher):
        whole = Container(container(30, layers=4))
        track = publisher.open_pass(BlockId(COMPAT, SCOPE, key(30)), layer_count=4, token_count=16)
        block = track.produce(BlockId(COMPAT, SCOPE, key(30)))
        await _announced(publisher)
        got: list = []

        async def read() -> None:
            async for index, slots in fetcher.pass_layers(relay.url, track.moqt_namespace, 1, 0, 3):
                got.append(index)

        reader = asyncio.ensure_future(read())
        payload = bytes(whole.layer(0).k) + bytes(whole.layer(0).v)
        block.add_layer(whole.layer(0).k, whole.layer(0).v)
        track.add_layer(payload, whole.layer(0).digest(), len(whole.layer(0).k))
        await asyncio.sleep(0.2)
        block.abort("outpaced")
        track.abort("outpaced")
        with pytest.raises(Exception):
            await asyncio.wait_for(reader, STEP)
        assert got == [0]
