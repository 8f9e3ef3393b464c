"""The relay over real aioquic sessions on 127.0.0.1: fan-out, slow subscribers, vanishing
publishers, rendezvous, caching, chaining and authorization."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from kvsp_moq.auth import Authenticator
from kvsp_moq.moqt.errors import (
    DataStreamReset,
    DoesNotExist,
    PublishDoneCode,
    PublishDoneError,
    RequestErrorCode,
    RequestTimeout,
    Unauthorized,
)
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.wire import Location
from kvsp_moq.naming import publisher_id

from .conftest import (
    CERT,
    STEP,
    TrackPublisher,
    collect,
    dial,
    make_objects,
    publishing,
    running_relay,
)

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK_NS = NS + (b"k" * 32,)
NAME = b"1"


def triples(objects) -> list[tuple[int, int, bytes]]:
    """(group, object, payload), in Location order: groups travel on separate streams, so
    their relative arrival order is not fixed (objects within one stream keep theirs)."""
    return sorted((o.group_id, o.object_id, o.payload) for o in objects)


async def test_one_publisher_eight_subscribers_get_identical_objects():
    objects = make_objects(3, 5, 20_000)
    gate = asyncio.Event()
    publisher = TrackPublisher(objects, gate=gate)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        clients = [await dial(relay.url) for _ in range(8)]
        try:
            subs = [await asyncio.wait_for(c.subscribe(TRACK_NS, NAME), STEP) for c in clients]
            gate.set()
            received = await asyncio.gather(*(collect(s) for s in subs))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        assert len(publisher.subscribes) == 1  # one upstream subscription, fanned out
        assert relay.stats.upstream_subscribes == 1
        for got in received:
            assert triples(got) == objects
        assert relay.stats.objects_in == len(objects)
        assert relay.stats.objects_out == 8 * len(objects)


async def test_slow_subscriber_is_dropped_without_stalling_the_others():
    objects = make_objects(1, 64, 64 * 1024)  # 4 MiB
    gate = asyncio.Event()
    publisher = TrackPublisher(objects, gate=gate)
    # A few objects of jitter between equally fast subscribers, each sent 60,000-byte
    # datagrams in turn; far below the 4 MiB the slow subscriber would need.
    limit = 1024 * 1024
    slow_settings = QuicSettings(max_stream_data=64 * 1024, max_data=128 * 1024)
    async with running_relay(subscriber_queue_bytes=limit) as relay, publishing(relay.url, NS, publisher):
        fast = [await dial(relay.url) for _ in range(3)]
        slow = await dial(relay.url, settings=slow_settings)
        try:
            slow_sub = await asyncio.wait_for(slow.subscribe(TRACK_NS, NAME), STEP)
            subs = [await asyncio.wait_for(c.subscribe(TRACK_NS, NAME), STEP) for c in fast]
            gate.set()
            received = await asyncio.gather(*(collect(s) for s in subs))  # the slow one is not read
            for got in received:
                assert triples(got) == objects
            assert relay.stats.subscribers_dropped == 1
            # Bounded: the queue never exceeded its limit by more than one object.
            assert relay.stats.subscriber_queue_peak_bytes <= limit + 64 * 1024 + 64
            with pytest.raises((PublishDoneError, DataStreamReset)) as e:
                await collect(slow_sub)
            if isinstance(e.value, PublishDoneError):
                assert e.value.error_code == PublishDoneCode.TOO_FAR_BEHIND
        finally:
            await asyncio.gather(*(c.aclose() for c in [*fast, slow]))


async def test_publisher_that_vanishes_ends_its_subscriptions_and_others_go_on():
    ns_a, ns_b = NS[:3] + (b"a" * 16,), NS[:3] + (b"b" * 16,)
    track_a, track_b = ns_a + (b"k" * 32,), ns_b + (b"k" * 32,)
    objects = make_objects(1, 40, 2000)
    pub_a = TrackPublisher(objects, pace=0.01, end=False)
    pub_b = TrackPublisher(objects, pace=0.02)
    async with running_relay() as relay:
        conn_a = await dial(relay.url)
        pub_a.attach(conn_a)
        await conn_a.publish_namespace(ns_a)
        async with publishing(relay.url, ns_b, pub_b):
            client = await dial(relay.url)
            try:
                sub_a = await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
                sub_b = await asyncio.wait_for(client.subscribe(track_b, NAME), STEP)
                got_a = []
                for _ in range(5):
                    got_a.append(await asyncio.wait_for(sub_a.__anext__(), STEP))
                conn_a.close()  # publisher A goes away mid-track
                with pytest.raises(PublishDoneError) as e:
                    got_a += await collect(sub_a)
                assert e.value.error_code == PublishDoneCode.INTERNAL_ERROR
                assert 5 <= len(got_a) < len(objects)
                assert triples(got_a) == objects[:len(got_a)]
                assert triples(await collect(sub_b)) == objects  # B was never disturbed
                assert relay.stats.publishers_lost == 1
                # The relay still serves: a new subscription to B, and A's track is gone.
                late = await asyncio.wait_for(client.subscribe(track_b, NAME), STEP)
                assert triples(await collect(late)) == objects
                with pytest.raises(DoesNotExist):
                    await asyncio.wait_for(client.subscribe(track_a, NAME), STEP)
            finally:
                await client.aclose()
                await conn_a.aclose()


async def test_last_subscriber_leaving_ends_the_upstream_subscription():
    objects = make_objects(1, 1000, 100)
    publisher = TrackPublisher(objects, pace=0.01)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        clients = [await dial(relay.url) for _ in range(2)]
        try:
            subs = [await asyncio.wait_for(c.subscribe(TRACK_NS, NAME), STEP) for c in clients]
            for sub in subs:
                await asyncio.wait_for(sub.__anext__(), STEP)
            await subs[0].unsubscribe()
            await asyncio.sleep(0.1)
            assert relay.snapshot()["subscribers"] == 1 and relay.snapshot()["feeds"] == 1
            await subs[1].unsubscribe()
            for _ in range(100):
                if relay.snapshot()["feeds"] == 0 and publisher.subscribes[0].answered:
                    break
                await asyncio.sleep(0.02)
            assert relay.snapshot()["feeds"] == 0
            sent = publisher.sent
            await asyncio.sleep(0.3)
            assert publisher.sent <= sent + 1  # the publisher was told to stop
            again = await asyncio.wait_for(clients[0].subscribe(TRACK_NS, NAME), STEP)  # a fresh feed
            await asyncio.wait_for(again.__anext__(), STEP)
            assert len(publisher.subscribes) == 2
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))


async def test_subscribe_before_announce_within_the_rendezvous_timeout():
    objects = make_objects(2, 3, 500)
    publisher = TrackPublisher(objects)
    async with running_relay() as relay:
        client = await dial(relay.url)
        try:
            pending = asyncio.ensure_future(client.subscribe(TRACK_NS, NAME, rendezvous_timeout=5000, timeout=STEP))
            await asyncio.sleep(0.3)
            assert not pending.done()
            async with publishing(relay.url, NS, publisher):
                sub = await asyncio.wait_for(pending, STEP)
                assert triples(await collect(sub)) == objects
            assert relay.stats.rendezvous_waits == 1
            with pytest.raises(RequestTimeout) as e:  # nobody comes: TIMEOUT
                await client.subscribe(NS + (b"z" * 32,), NAME, rendezvous_timeout=300, timeout=STEP)
            assert e.value.error_code == RequestErrorCode.TIMEOUT
            with pytest.raises(DoesNotExist):  # no rendezvous asked: at once
                await client.subscribe(NS + (b"z" * 32,), NAME, timeout=STEP)
        finally:
            await client.aclose()


async def test_repeated_fetch_is_served_from_the_cache():
    objects = make_objects(1, 20, 5000)
    publisher = TrackPublisher(objects)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url)
        try:
            first = await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 9), timeout=STEP))
            assert triples(first) == objects[:10]
            assert len(publisher.fetches) == 1 and relay.stats.cache_misses == 1
            again = await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 9), timeout=STEP))
            inner = await collect(await client.fetch(TRACK_NS, NAME, (0, 3), (0, 6), timeout=STEP))
            assert triples(again) == objects[:10] and triples(inner) == objects[3:7]
            assert len(publisher.fetches) == 1  # the publisher was not asked again
            assert relay.stats.cache_hits == 2 and relay.stats.upstream_fetches == 1
            # A longer range: the cached part from the cache, only the rest from upstream.
            longer = await collect(await client.fetch(TRACK_NS, NAME, (0, 5), (0, 14), timeout=STEP))
            assert triples(longer) == objects[5:15]
            assert publisher.fetches[1] == (Location(0, 10), Location(0, 15))
            assert relay.stats.cache_objects_served == 10 + 4 + 5
        finally:
            await client.aclose()


async def test_slow_fetcher_bounds_what_the_relay_buffers():
    """Objects are written without an await while the downstream stream has room; once it
    is full the relay waits, so a fetcher that stops reading holds the relay's buffer to
    about its stream send buffer, and every object is still cached and delivered in order."""
    kib = 1024
    objects = make_objects(1, 64, 32 * kib)
    publisher = TrackPublisher(objects)
    quic = QuicSettings(stream_send_buffer=256 * kib, write_chunk_size=64 * kib)
    async with running_relay(quic=quic) as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url, settings=QuicSettings(max_stream_data=64 * kib, max_data=128 * kib))
        try:
            fetched = await client.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP)
            first = await fetched.next_object(STEP)
            assert first is not None and first.object_id == 0

            async def relay_blocked() -> None:
                while not any(p.connection is not None and p.connection._drain_waiters for p in relay._peers):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(relay_blocked(), STEP)  # the fetcher reads nothing more
            buffered = sum(p.connection.buffered_total() for p in relay._peers if p.connection is not None)
            assert buffered < quic.stream_send_buffer + 33 * kib  # one object past the limit at most
            assert relay.stats.objects_out < len(objects)
            rest = await collect(fetched)
        finally:
            await client.aclose()
        assert triples([first, *rest]) == objects
        assert [o.object_id for o in rest] == list(range(1, 64))
        assert len(relay.cache) == len(objects)


async def test_stalled_fetcher_bounds_what_the_relay_takes_from_its_publisher():
    """While a fetcher reads nothing, the relay takes no more from the publisher than its
    receive window: what it forwards waits, what arrives is held (credited back only as
    the relay consumes it), and the publisher's writes wait in turn. Then every object
    arrives, in order, once the fetcher reads."""
    kib = 1024
    size = 64 * kib
    objects = make_objects(1, 192, size)  # 12 MiB
    publisher = TrackPublisher(objects)
    quic = QuicSettings(stream_send_buffer=256 * kib, write_chunk_size=64 * kib,
                        max_stream_data=512 * kib, max_data=1024 * kib)
    small_sender = QuicSettings(stream_send_buffer=256 * kib, connection_send_buffer=512 * kib)
    async with running_relay(quic=quic) as relay, publishing(relay.url, NS, publisher, settings=small_sender):
        client = await dial(relay.url, settings=QuicSettings(max_stream_data=64 * kib, max_data=128 * kib))
        try:
            fetched = await client.fetch(TRACK_NS, NAME, (0, 0), (1, 0), timeout=STEP)
            first = await fetched.next_object(STEP)
            assert first is not None and first.object_id == 0

            async def publisher_blocked() -> None:
                sent = -1
                while sent != publisher.fetch_sent:  # no progress for 0.3 s
                    sent = publisher.fetch_sent
                    await asyncio.sleep(0.3)

            await asyncio.wait_for(publisher_blocked(), STEP)
            held = max(p.connection.quic.held_total for p in relay._peers if p.connection is not None)
            # (past max_data, at most what one batch of received datagrams brought)
            assert held <= quic.max_data + quic.max_stream_data
            # receive windows (fetcher, relay held + engine) + send buffers (relay, publisher)
            assert publisher.fetch_sent * size <= 4 * 1024 * kib < len(objects) * size
            rest = await collect(fetched)
        finally:
            await client.aclose()
        assert triples([first, *rest]) == objects
        assert publisher.fetch_sent == len(objects)


async def test_subscribed_objects_feed_the_cache_for_fetch():
    objects = make_objects(2, 4, 3000)
    publisher = TrackPublisher(objects)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url)
        try:
            sub = await asyncio.wait_for(client.subscribe(TRACK_NS, NAME), STEP)
            await collect(sub)
            fetched = await collect(await client.fetch(TRACK_NS, NAME, (1, 0), (1, 3), timeout=STEP))
            assert triples(fetched) == objects[4:]
            assert publisher.fetches == [] and relay.stats.cache_hits == 1
        finally:
            await client.aclose()


async def test_lru_eviction_under_the_cache_budget():
    size = 10_000
    objects = make_objects(1, 12, size)
    publisher = TrackPublisher(objects)
    budget = 6 * (size + 11 + 64)  # room for six objects
    async with running_relay(cache_bytes=budget) as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url)
        try:
            await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 5), timeout=STEP))
            assert relay.cache.evictions == 0
            await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 2), timeout=STEP))  # touch 0-2
            await collect(await client.fetch(TRACK_NS, NAME, (0, 6), (0, 8), timeout=STEP))  # evicts 3-5
            assert relay.cache.evictions == 3 and relay.cache.bytes <= budget
            assert len(publisher.fetches) == 2
            await collect(await client.fetch(TRACK_NS, NAME, (0, 0), (0, 2), timeout=STEP))  # still cached
            assert len(publisher.fetches) == 2
            got = await collect(await client.fetch(TRACK_NS, NAME, (0, 3), (0, 5), timeout=STEP))
            assert triples(got) == objects[3:6] and len(publisher.fetches) == 3  # evicted: upstream again
            assert relay.snapshot()["cache_bytes"] <= budget
        finally:
            await client.aclose()


async def test_relay_chain_second_client_served_from_the_near_cache():
    objects = make_objects(1, 16, 8000)
    publisher = TrackPublisher(objects)
    async with running_relay() as relay_a, running_relay(
            upstream=relay_a.url, upstream_cadata=CERT.certificate_pem) as relay_b:
        await relay_b.wait_upstream()
        async with publishing(relay_a.url, NS, publisher):
            first = await dial(relay_b.url)
            try:
                got = await collect(await first.fetch(TRACK_NS, NAME, (0, 0), (0, 15), timeout=STEP))
                assert triples(got) == objects
                sub = await asyncio.wait_for(first.subscribe(TRACK_NS, NAME), STEP)  # B -> A -> publisher
                assert triples(await collect(sub)) == objects
            finally:
                await first.aclose()
            a_before = relay_a.snapshot()
            second = await dial(relay_b.url)
            try:
                got = await collect(await second.fetch(TRACK_NS, NAME, (0, 0), (0, 15), timeout=STEP))
                assert triples(got) == objects
            finally:
                await second.aclose()
            a_after = relay_a.snapshot()
            for counter in ("fetches", "subscribes", "objects_out", "upstream_requests", "cache_hits"):
                assert a_after[counter] == a_before[counter], counter
            assert relay_b.stats.cache_hits == 1
            assert len(publisher.fetches) == 1


async def test_relay_chain_forwards_announcements_upstream():
    objects = make_objects(1, 4, 1000)
    publisher = TrackPublisher(objects)
    async with running_relay() as relay_a, running_relay(
            upstream=relay_a.url, upstream_cadata=CERT.certificate_pem) as relay_b:
        await relay_b.wait_upstream()
        async with publishing(relay_b.url, NS, publisher):  # publisher at B, subscriber at A
            client = await dial(relay_a.url)
            try:
                for _ in range(50):
                    if relay_a.routes.lookup(TRACK_NS) is not None:
                        break
                    await asyncio.sleep(0.05)
                sub = await asyncio.wait_for(client.subscribe(TRACK_NS, NAME), STEP)
                assert triples(await collect(sub)) == objects
            finally:
                await client.aclose()


SCOPE_A, SCOPE_B = "a" * 32, "b" * 32
HOLDER = "http://127.0.0.1:8801/"


def kv_ns(scope: str) -> tuple[bytes, ...]:
    return (b"kvsp", b"c" * 32, scope.encode(), publisher_id(HOLDER).hex().encode())


async def test_token_of_scope_a_cannot_use_scope_b():
    auth = Authenticator.from_mapping({"principal": [
        {"name": "holder-a", "token": "tok-a", "scopes": [SCOPE_A], "holders": [HOLDER],
         "roles": ["holder"]},
        {"name": "holder-b", "token": "tok-b", "scopes": [SCOPE_B], "holders": [HOLDER],
         "roles": ["holder"]},
    ]})
    objects = make_objects(1, 3, 100)
    async with running_relay(authenticator=auth) as relay:
        pub = await dial(relay.url, authorization="tok-a")
        TrackPublisher(objects).attach(pub)
        pub_b = await dial(relay.url, authorization="tok-b")
        TrackPublisher(objects).attach(pub_b)
        sub = await dial(relay.url, authorization="tok-a")
        anonymous = await dial(relay.url)
        try:
            await pub.publish_namespace(kv_ns(SCOPE_A), timeout=STEP)
            with pytest.raises(Unauthorized) as e:
                await pub.publish_namespace(kv_ns(SCOPE_B), timeout=STEP)
            assert e.value.error_code == RequestErrorCode.UNAUTHORIZED
            await pub_b.publish_namespace(kv_ns(SCOPE_B), timeout=STEP)
            track_a, track_b = kv_ns(SCOPE_A) + (b"k" * 32,), kv_ns(SCOPE_B) + (b"k" * 32,)
            assert len(await collect(await sub.subscribe(track_a, NAME, timeout=STEP))) == 3
            assert len(await collect(await sub.fetch(track_a, NAME, (0, 0), (0, 2), timeout=STEP))) == 3
            with pytest.raises(Unauthorized):
                await sub.subscribe(track_b, NAME, timeout=STEP)
            with pytest.raises(Unauthorized):
                await sub.fetch(track_b, NAME, (0, 0), (0, 2), timeout=STEP)
            with pytest.raises(Unauthorized):
                await sub.track_status(track_b, NAME, timeout=STEP)
            # A per-request token adds to the session's.
            got = await collect(await sub.fetch(track_b, NAME, (0, 0), (0, 2), authorization="tok-b", timeout=STEP))
            assert len(got) == 3
            with pytest.raises(Unauthorized):
                await anonymous.subscribe(track_a, NAME, timeout=STEP)
            with pytest.raises(Unauthorized):
                await anonymous.publish_namespace(kv_ns(SCOPE_A), timeout=STEP)
            assert relay.stats.unauthorized == 6
        finally:
            await asyncio.gather(*(c.aclose() for c in (pub, pub_b, sub, anonymous)))


async def test_without_principals_the_relay_is_open():
    objects = make_objects(1, 2, 100)
    async with running_relay() as relay:
        assert relay.policy.is_open
        async with publishing(relay.url, kv_ns(SCOPE_B), TrackPublisher(objects)):
            client = await dial(relay.url)
            try:
                got = await collect(await client.fetch(kv_ns(SCOPE_B) + (b"k" * 32,), NAME, (0, 0), (0, 1),
                                                       timeout=STEP))
                assert triples(got) == objects
            finally:
                await client.aclose()


async def test_namespace_discovery_and_track_status():
    async with running_relay() as relay:
        watcher = await dial(relay.url)
        try:
            updates = await watcher.subscribe_namespace((b"kvsp",), timeout=STEP)
            async with publishing(relay.url, NS, TrackPublisher(make_objects(1, 1, 10))):
                update = await asyncio.wait_for(updates.__anext__(), STEP)
                assert update.active and update.namespace == NS
            update = await asyncio.wait_for(updates.__anext__(), STEP)
            assert not update.active
            with pytest.raises(DoesNotExist):
                await watcher.track_status(TRACK_NS, NAME, timeout=STEP)
        finally:
            await watcher.aclose()


async def test_relay_service_prints_its_url_fingerprint_and_open_mode(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0", "--cert-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 20)).decode() for _ in range(4)]
        assert lines[0].startswith("relay listening on moqt://127.0.0.1:")
        url = lines[0].split()[-1]
        assert "relay-cert.pem" in lines[1] and (tmp_path / "relay-cert.pem").exists()
        assert lines[2].startswith("certificate SHA-256 fingerprint ") and lines[2].count(":") == 31
        assert "running open" in lines[3]
        from kvsp_moq.moqt.quic import connect

        client = await asyncio.wait_for(
            connect(url, cadata=(tmp_path / "relay-cert.pem").read_bytes()), STEP)
        with pytest.raises(DoesNotExist):
            await client.subscribe(TRACK_NS, NAME, timeout=STEP)
        await client.aclose()
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
