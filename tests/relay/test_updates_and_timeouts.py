"""The relay and REQUEST_UPDATE (a subscriber's update, what goes upstream, a refused one)
and delivery timeouts towards a blocked subscriber, over real aioquic sessions."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import InvalidRange, PublishDoneCode, PublishDoneError
from kvsp_moq.moqt.quic import (
    IncomingSubscribe,
    MoqtConnection,
    OutgoingSubscription,
    QuicSettings,
)
from kvsp_moq.moqt.wire import Location, SubscriptionFilter, TrackPropertyType

from .conftest import (
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
KIB = 1024


class HeldPublisher:
    """Accepts SUBSCRIBE, sends one object, then holds the subscription open."""

    def __init__(self, track_properties=()) -> None:
        self.outgoing: asyncio.Future[OutgoingSubscription] = asyncio.get_running_loop().create_future()
        self.track_properties = track_properties
        self.updates: list = []

    def attach(self, connection: MoqtConnection) -> None:
        connection.on_subscribe(self.on_subscribe)

    async def on_subscribe(self, req: IncomingSubscribe) -> None:
        outgoing = req.accept(track_properties=self.track_properties)

        def on_update(update) -> None:
            self.updates.append(update.parameters)

        outgoing.on_update = on_update  # returns unanswered: the update is accepted
        sender = outgoing.open_subgroup(0)
        await sender.send(0, b"zero")
        self.outgoing.set_result(outgoing)
        await asyncio.sleep(3600)


async def _until(predicate, timeout: float = STEP) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


async def test_forward_and_priority_updates_reach_the_upstream_subscription():
    publisher = HeldPublisher()
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        first, second = await dial(relay.url), await dial(relay.url)
        try:
            sub_1 = await asyncio.wait_for(first.subscribe(TRACK_NS, NAME), STEP)
            sub_2 = await asyncio.wait_for(second.subscribe(TRACK_NS, NAME), STEP)
            upstream = await asyncio.wait_for(publisher.outgoing, STEP)
            answer = await sub_1.update(forward=False, subscriber_priority=9, timeout=STEP)
            assert answer.largest_object == Location(0, 0)  # the relay's Largest Object
            await _until(lambda: upstream.parameters.subscriber_priority == 9)
            assert upstream.forward  # the other subscriber still forwards
            await sub_2.update(forward=False, timeout=STEP)
            await _until(lambda: not upstream.forward)  # nobody forwards: paused upstream
            await sub_2.update(forward=True, subscriber_priority=2, timeout=STEP)
            await _until(lambda: upstream.forward and upstream.parameters.subscriber_priority == 2)
            assert relay.stats.updates == 3 and relay.stats.upstream_updates == 3
        finally:
            await first.aclose()
            await second.aclose()


async def test_paused_subscriber_gets_nothing_until_it_resumes():
    objects = make_objects(3, 2, 100)
    gates = [asyncio.Event(), asyncio.Event(), asyncio.Event()]

    class Stepped(TrackPublisher):
        async def on_subscribe(self, req: IncomingSubscribe) -> None:
            sub = req.accept()
            for group in range(3):
                await gates[group].wait()
                sender = sub.open_subgroup(group)
                for g, o, payload in self.objects:
                    if g == group:
                        await sender.send(o, payload)
                sender.close()
            await sub.finish()

    publisher = Stepped(objects)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        client, other = await dial(relay.url), await dial(relay.url)
        try:
            sub = await asyncio.wait_for(client.subscribe(TRACK_NS, NAME), STEP)
            keeps_feed = await asyncio.wait_for(other.subscribe(TRACK_NS, NAME), STEP)
            gates[0].set()
            await _until(lambda: relay.stats.objects_in >= 2)
            await sub.update(forward=False, timeout=STEP)
            gates[1].set()  # group 1 passes the relay while this subscriber is paused
            await _until(lambda: relay.stats.objects_in >= 4)
            await sub.update(forward=True, timeout=STEP)
            gates[2].set()
            got = await collect(sub)
            assert sorted({o.group_id for o in got}) == [0, 2]
            assert len(await collect(keeps_feed)) == len(objects)
        finally:
            await client.aclose()
            await other.aclose()


async def test_update_to_an_end_group_already_published_is_refused_by_the_relay():
    publisher = HeldPublisher()
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        client = await dial(relay.url)
        try:
            sub = await asyncio.wait_for(
                client.subscribe(TRACK_NS, NAME, subscription_filter=SubscriptionFilter.absolute_start(0)), STEP)
            upstream = await asyncio.wait_for(publisher.outgoing, STEP)
            upstream.open_subgroup(5)  # the relay learns of group 5 from its first object
            await (upstream.open_subgroup(5, 1)).send(0, b"five")
            await _until(lambda: relay.stats.objects_in >= 2)
            with pytest.raises(InvalidRange):
                await sub.update(subscription_filter=SubscriptionFilter.absolute_range(0, 0, 3), timeout=STEP)
            with pytest.raises(PublishDoneError) as e:
                await collect(sub)
            assert e.value.error_code == PublishDoneCode.UPDATE_FAILED
            assert relay.stats.updates_refused == 1
        finally:
            await client.aclose()


async def test_blocked_subscriber_loses_only_what_outlived_its_delivery_timeout():
    objects = make_objects(1, 40, 32 * KIB)  # 1.25 MiB in group 0
    begin, late = asyncio.Event(), asyncio.Event()

    class TwoGroups(TrackPublisher):
        async def on_subscribe(self, req: IncomingSubscribe) -> None:
            sub = req.accept()
            await begin.wait()
            sender = sub.open_subgroup(0)
            for _, o, payload in self.objects:
                await sender.send(o, payload)
            sender.close()
            await late.wait()
            sender = sub.open_subgroup(1)
            await sender.send(0, b"fresh")
            sender.close()
            await sub.finish()

    publisher = TwoGroups(objects)
    blocked = QuicSettings(max_stream_data=64 * KIB, max_data=256 * KIB)
    relay_quic = QuicSettings(stream_send_buffer=64 * KIB, connection_send_buffer=128 * KIB)
    async with running_relay(quic=relay_quic) as relay, publishing(relay.url, NS, publisher):
        slow, fast = await dial(relay.url, settings=blocked), await dial(relay.url)
        try:
            slow_sub = await asyncio.wait_for(slow.subscribe(TRACK_NS, NAME, object_delivery_timeout=200), STEP)
            fast_sub = await asyncio.wait_for(fast.subscribe(TRACK_NS, NAME), STEP)
            begin.set()
            await _until(lambda: relay.stats.objects_in >= len(objects))
            await asyncio.sleep(0.5)  # the slow subscriber's queued objects grow old
            late.set()
            got = await collect(slow_sub)
            fast_got = await collect(fast_sub)
        finally:
            await slow.aclose()
            await fast.aclose()
        assert len(fast_got) == len(objects) + 1  # the other subscriber lost nothing
        group_0 = [o.object_id for o in got if o.group_id == 0]
        assert group_0 == list(range(len(group_0))) and len(group_0) < len(objects)
        assert [o.payload for o in got if o.group_id == 1] == [b"fresh"]
        assert slow_sub.streams_timed_out == 1
        # Each object was either handed to the slow subscriber's QUIC stream or given up.
        slow_out = relay.stats.objects_out - len(fast_got)
        assert relay.stats.objects_expired + slow_out == len(objects) + 1
        assert relay.stats.subscribers_dropped == 0


async def test_new_group_request_goes_upstream_once_for_a_track_with_dynamic_groups():
    publisher = HeldPublisher(track_properties=((TrackPropertyType.DYNAMIC_GROUPS, 1),))
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        first, second = await dial(relay.url), await dial(relay.url)
        try:
            sub_1 = await asyncio.wait_for(first.subscribe(TRACK_NS, NAME), STEP)
            sub_2 = await asyncio.wait_for(second.subscribe(TRACK_NS, NAME), STEP)
            upstream = await asyncio.wait_for(publisher.outgoing, STEP)
            await _until(lambda: relay.stats.objects_in >= 1)  # Largest Group is 0
            await sub_1.update(new_group_request=5, timeout=STEP)
            await _until(lambda: upstream.parameters.new_group_request == 5)
            # An outstanding request with a greater value stands for this one.
            await sub_2.update(new_group_request=3, timeout=STEP)
            await asyncio.sleep(0.2)
            assert [p.new_group_request for p in publisher.updates] == [5]
            assert relay.stats.upstream_updates == 1
        finally:
            await first.aclose()
            await second.aclose()
