"""SUBSCRIBE_TRACKS at the relay: a subscriber is offered (PUBLISH) every track published
under its prefix, those already there and those that come later, and reads them."""

from __future__ import annotations

import asyncio

from kvsp_moq.moqt.quic import IncomingPublish

from .conftest import STEP, collect, dial, running_relay

PREFIX = (b"kvsp", b"c" * 32, b"s" * 16)
TRACK_NS = PREFIX + (b"p" * 16, b"k" * 32)


async def send(outgoing, group: int, payloads: list[bytes]) -> None:
    subgroup = outgoing.open_subgroup(group)
    for i, payload in enumerate(payloads):
        await subgroup.send(i, payload)
    subgroup.close()


async def test_tracks_published_at_the_relay_are_offered_to_a_subscribe_tracks():
    async with running_relay() as relay:
        publisher = await dial(relay.url)
        client = await dial(relay.url)
        try:
            early = await asyncio.wait_for(publisher.publish(TRACK_NS, b"early"), STEP)
            tracks = await asyncio.wait_for(client.subscribe_tracks(PREFIX), STEP)
            offered = await asyncio.wait_for(tracks.__anext__(), STEP)
            assert isinstance(offered, IncomingPublish)
            assert (offered.namespace, offered.track_name) == (TRACK_NS, b"early")
            early_objects = offered.accept(forward=True)

            late = await asyncio.wait_for(publisher.publish(TRACK_NS, b"late"), STEP)
            offered_late = await asyncio.wait_for(tracks.__anext__(), STEP)
            assert (offered_late.namespace, offered_late.track_name) == (TRACK_NS, b"late")
            late_objects = offered_late.accept(forward=True)
            for _ in range(200):  # the relay attaches each subscriber once its PUBLISH is accepted
                if sum(len(f.downstreams) for f in relay.subscriptions.feeds.values()) == 2:
                    break
                await asyncio.sleep(0.01)

            await send(early, 0, [b"e0", b"e1"])
            await send(late, 0, [b"l0"])
            await early.finish()
            await late.finish()
            assert [o.payload for o in await collect(early_objects)] == [b"e0", b"e1"]
            assert [o.payload for o in await collect(late_objects)] == [b"l0"]
            assert relay.stats.publishes == 2
        finally:
            await client.aclose()
            await publisher.aclose()
