"""What moq-rs, the most used MOQT stack, does through a relay, reproduced with our own
endpoints so that it is tested on every run, without the peer: SUBSCRIBE_NAMESPACE with an
empty prefix right after SETUP, SUBSCRIBE in descending group order with a Largest Object
filter followed at once by a joining FETCH (offset 0), a timestamp property (0x10) on every
object, objects of 1 MiB, and PUBLISH_DONE status 2 (track ended)."""

from __future__ import annotations

import asyncio

from kvsp_moq.moqt.errors import PublishDoneCode
from kvsp_moq.moqt.quic import IncomingFetch, IncomingSubscribe
from kvsp_moq.moqt.wire import GroupOrder, SubscriptionFilter

from .conftest import STEP, collect, dial, publishing, running_relay

NS = (b"kvsp", b"c" * 32, b"s" * 16, b"p" * 16)
TRACK_NS = NS + (b"k" * 32,)
NAME = b"t"
TIMESTAMP = 0x10
SIZES = (16, 1 << 20, 64 << 10)


def payload(group: int, obj: int) -> bytes:
    return bytes([(group * 7 + obj) % 251]) * SIZES[obj % len(SIZES)]


class TimestampedPublisher:
    """Groups of 3 objects, each with a timestamp property; groups 0-1 are sent at once, the
    rest once `more` is set; FETCH answers from what was sent."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.more = asyncio.Event()
        self.sent: list[tuple[int, int]] = []

    def attach(self, connection) -> None:
        connection.on_subscribe(self.on_subscribe)
        connection.on_fetch(self.on_fetch)

    async def on_subscribe(self, req: IncomingSubscribe) -> None:
        sub = req.accept()
        for g in range(self.groups):
            if g == 2:
                await self.more.wait()
            sender = sub.open_subgroup(g, has_properties=True)
            for o in range(3):
                await sender.send(o, payload(g, o), properties=((TIMESTAMP, 1000 * (3 * g + o)),))
                self.sent.append((g, o))
            sender.close()
        await sub.finish(PublishDoneCode.TRACK_ENDED, "track ended")

    async def on_fetch(self, req: IncomingFetch) -> None:
        wanted = [(g, o) for g, o in self.sent if req.includes((g, o))]
        last = wanted[-1]
        sender = req.accept(end=(last[0], last[1] + 1))
        for g, o in wanted:
            await sender.send(g, o, payload(g, o), properties=((TIMESTAMP, 1000 * (3 * g + o)),))
        sender.close()


async def test_a_moqrs_style_late_subscriber_gets_every_object_with_its_properties():
    publisher = TimestampedPublisher(groups=4)
    async with running_relay() as relay, publishing(relay.url, NS, publisher):
        early, client = await dial(relay.url), await dial(relay.url)
        try:
            first = await asyncio.wait_for(early.subscribe(TRACK_NS, NAME), STEP)
            for _ in range(6):  # groups 0 and 1 are at the relay
                await asyncio.wait_for(first.__anext__(), STEP)
            watch = await asyncio.wait_for(client.subscribe_namespace((), timeout=STEP), STEP)
            sub = await asyncio.wait_for(client.subscribe(
                TRACK_NS, NAME, group_order=GroupOrder.DESCENDING,
                subscription_filter=SubscriptionFilter.largest_object()), STEP)
            fetch = await client.joining_fetch(sub, 0, timeout=STEP)  # right after SUBSCRIBE_OK
            fetched = await collect(fetch)
            publisher.more.set()
            live = await collect(sub)
            await collect(first)
            del watch
        finally:
            await asyncio.gather(early.aclose(), client.aclose())
    # the joining FETCH brought the group being published when the subscription began, the
    # subscription everything after: together every object of groups 1-3, each exact
    got = {(o.group_id, o.object_id): o for o in [*fetched, *live]}
    assert {(g, o) for g in (1, 2, 3) for o in range(3)} <= set(got), sorted(got)
    assert {(g, o) for g in (2, 3) for o in range(3)} <= {(o.group_id, o.object_id) for o in live}
    for (g, o), obj in got.items():
        assert obj.payload == payload(g, o)
        assert obj.properties == ((TIMESTAMP, 1000 * (3 * g + o)),), (g, o, obj.properties)
    assert relay.stats.unauthorized == 0
