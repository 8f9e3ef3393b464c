"""Cold FETCHes of one range that arrive together share one upstream FETCH: N agents loading
the same prefix through a relay cost the publisher one copy, and each still gets every
object, at its own pace; the upstream FETCH stops when the last of them leaves."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import DataStreamReset
from kvsp_moq.moqt.quic import QuicSettings

from .conftest import STEP, TrackPublisher, collect, dial, make_objects, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK_NS = NS + (b"k" * 32,)
NAME = b"1"


def triples(objects) -> list[tuple[int, int, bytes]]:
    return sorted((o.group_id, o.object_id, o.payload) for o in objects)


class SlowFetchPublisher(TrackPublisher):
    """Answers a FETCH only once `gate` opens, so that every FETCH of the test arrives at the
    relay while the first is still in flight."""

    def __init__(self, objects, gate: asyncio.Event) -> None:
        super().__init__(objects)
        self.fetch_gate = gate

    async def on_fetch(self, req) -> None:
        await self.fetch_gate.wait()
        await super().on_fetch(req)


async def test_concurrent_cold_fetches_of_a_range_share_one_upstream_fetch():
    objects = make_objects(1, 32, 64 * 1024, seed=3)  # 2 MiB: one KV block of 32 layers
    gate = asyncio.Event()
    publisher = SlowFetchPublisher(objects, gate)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        clients = [await dial(relay.url) for _ in range(4)]
        try:
            fetches = [asyncio.ensure_future(c.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP))
                       for c in clients]
            for _ in range(200):  # every FETCH has reached the relay
                if relay.stats.fetches == len(clients):
                    break
                await asyncio.sleep(0.01)
            gate.set()
            results = [await asyncio.wait_for(f, STEP) for f in fetches]
            received = await asyncio.gather(*(collect(r) for r in results))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        assert len(publisher.fetches) == 1  # one upstream FETCH for the four
        assert relay.stats.fetches_shared == len(clients) - 1
        assert relay.stats.bytes_in == sum(len(p) for _, _, p in objects)
        for got in received:
            assert triples(got) == objects
        # and a FETCH after it is served from the cache (all but the group's unknown end)
        client = await dial(relay.url)
        try:
            again = await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP))
        finally:
            await client.aclose()
        assert triples(again) == objects
        assert relay.stats.bytes_in == sum(len(p) for _, _, p in objects)


async def test_a_slow_reader_of_a_shared_fetch_bounds_what_the_relay_takes_and_a_fast_one_still_finishes():
    kib = 1024
    objects = make_objects(1, 96, 64 * kib, seed=5)  # 6 MiB
    gate = asyncio.Event()
    publisher = SlowFetchPublisher(objects, gate)
    quic = QuicSettings(stream_send_buffer=256 * kib, write_chunk_size=64 * kib,
                        max_stream_data=512 * kib, max_data=1024 * kib)
    async with running_relay(quic=quic) as relay, publishing(relay.url, NS, publisher):
        fast = await dial(relay.url)
        slow = await dial(relay.url, settings=QuicSettings(max_stream_data=64 * kib, max_data=128 * kib))
        try:
            pending = [asyncio.ensure_future(c.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP))
                       for c in (fast, slow)]
            for _ in range(200):
                if relay.stats.fetches == 2:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            fast_fetch, slow_fetch = [await asyncio.wait_for(f, STEP) for f in pending]
            first = await slow_fetch.next_object(STEP)  # the slow one reads one object, then stalls

            async def stalled() -> None:
                seen = -1
                while seen != relay.stats.bytes_in:  # no progress for 0.3 s
                    seen = relay.stats.bytes_in
                    await asyncio.sleep(0.3)

            await asyncio.wait_for(stalled(), STEP)
            # read ahead of the slow reader: receive windows (reader, relay held + engine), the
            # relay's send buffer and one stream window of read-ahead, not the response
            assert relay.stats.bytes_in <= 4 * 1024 * kib < len(objects) * 64 * kib
            fast_task = asyncio.ensure_future(collect(fast_fetch))
            rest = await collect(slow_fetch)  # the slow reader resumes; both finish
            got_fast = await fast_task
        finally:
            await asyncio.gather(fast.aclose(), slow.aclose())
        assert triples(got_fast) == objects
        assert triples([first, *rest]) == objects
        assert len(publisher.fetches) == 1


async def test_the_upstream_fetch_stops_when_every_reader_left():
    kib = 1024
    objects = make_objects(1, 128, 64 * kib, seed=7)  # 8 MiB
    gate = asyncio.Event()
    publisher = SlowFetchPublisher(objects, gate)
    # every window and send buffer on the way is far below the response, so what the publisher
    # has written when the readers leave is bounded by them, not by how fast the cancel travels
    small = QuicSettings(stream_send_buffer=256 * kib, write_chunk_size=64 * kib,
                         max_stream_data=512 * kib, max_data=1024 * kib)
    async with running_relay(quic=small) as relay, publishing(relay.url, NS, publisher, settings=small):
        clients = [await dial(relay.url, settings=QuicSettings(max_stream_data=64 * kib, max_data=128 * kib))
                   for _ in range(2)]
        try:
            pending = [asyncio.ensure_future(c.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP))
                       for c in clients]
            for _ in range(200):
                if relay.stats.fetches == 2:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            for f in pending:
                fetch = await asyncio.wait_for(f, STEP)
                await fetch.next_object(STEP)
                await fetch.cancel()
            for _ in range(300):  # the relay forgets the shared response once nobody reads it
                if not relay.fetches.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert not relay.fetches.in_flight
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        assert publisher.fetch_sent < len(objects)  # the publisher was stopped early


async def test_a_reader_that_stalls_a_shared_fetch_is_dropped_and_the_others_finish():
    kib = 1024
    objects = make_objects(1, 96, 64 * kib, seed=9)  # 6 MiB
    gate = asyncio.Event()
    publisher = SlowFetchPublisher(objects, gate)
    quic = QuicSettings(stream_send_buffer=256 * kib, write_chunk_size=64 * kib,
                        max_stream_data=512 * kib, max_data=1024 * kib)
    async with running_relay(quic=quic, fetch_stall_timeout=0.5) as relay, \
            publishing(relay.url, NS, publisher):
        fast = await dial(relay.url)
        stalled = await dial(relay.url, settings=QuicSettings(max_stream_data=64 * kib, max_data=128 * kib))
        try:
            pending = [asyncio.ensure_future(c.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP))
                       for c in (fast, stalled)]
            for _ in range(200):
                if relay.stats.fetches == 2:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            fast_fetch, stalled_fetch = [await asyncio.wait_for(f, STEP) for f in pending]
            got = await collect(fast_fetch)  # the stalled one never reads
            assert triples(got) == objects
            assert relay.stats.fetch_readers_dropped == 1
            with pytest.raises(DataStreamReset):  # its response was reset, not ended
                await collect(stalled_fetch)
            for _ in range(300):
                if not relay.fetches.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert not relay.fetches.in_flight
        finally:
            await asyncio.gather(fast.aclose(), stalled.aclose())
        assert len(publisher.fetches) == 1
