"""SUBSCRIBE_TRACKS through the asyncio API: the peer's PUBLISHes under the prefix, and
PUBLISH_BLOCKED, come to the subscription; others go to the "publish" handler."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt.errors import NotSupported, SessionClosed, Uninterested
from kvsp_moq.moqt.quic import BlockedTrack as PublishBlocked
from kvsp_moq.moqt.quic import IncomingPublish, MoqtConnection, NamespacePublisher, TrackSubscriptions

from .test_quic import STEP, collect, dial, start

PREFIX = (b"kvsp", b"c" * 32)
INSIDE = PREFIX + (b"s" * 16,)
OUTSIDE = (b"kvsp", b"d" * 32, b"s" * 16)


async def next_item(subscription: TrackSubscriptions):
    return await asyncio.wait_for(subscription.__anext__(), STEP)


async def test_publishes_under_the_prefix_come_to_the_subscription():
    served: list[MoqtConnection] = []
    requests = []
    other_publishes = []

    async def on_subscribe_tracks(request):
        requests.append(request)
        publisher = request.accept()
        await asyncio.sleep(3600)  # keep the request open
        assert publisher

    async def on_publish(request):
        other_publishes.append(request.namespace)
        raise Uninterested("not wanted")

    server = await start({"subscribe_tracks": on_subscribe_tracks}, on_connection=served.append)
    client = await dial(server, handlers={"publish": on_publish})
    try:
        subscription = await asyncio.wait_for(client.subscribe_tracks(PREFIX), STEP)
        assert requests[0].namespace_prefix == PREFIX
        peer = served[0]
        # The server offers a track under the prefix: it reaches the subscription.
        offered = asyncio.ensure_future(peer.publish(INSIDE, b"t1", largest=(0, 0), timeout=STEP))
        item = await next_item(subscription)
        assert isinstance(item, IncomingPublish)
        assert (item.namespace, item.track_name) == (INSIDE, b"t1")
        track = item.accept(forward=True)
        outgoing = await asyncio.wait_for(offered, STEP)
        subgroup = outgoing.open_subgroup(1)
        await subgroup.send(0, b"a")
        await subgroup.send(1, b"b")
        subgroup.close()
        await outgoing.finish()
        assert [o.payload for o in await collect(track)] == [b"a", b"b"]
        # One outside it goes to the handler, which refuses it.
        with pytest.raises(Uninterested):
            await asyncio.wait_for(peer.publish(OUTSIDE, b"t2", timeout=STEP), STEP)
        assert other_publishes == [OUTSIDE]
        # PUBLISH_BLOCKED names a track that will not come.
        publisher = peer.request_handle(requests[0].request_id)
        assert isinstance(publisher, NamespacePublisher)
        publisher.publish_blocked(INSIDE, "t3")
        assert await next_item(subscription) == PublishBlocked(INSIDE, b"t3")
        with pytest.raises(ValueError):
            publisher.publish_blocked(OUTSIDE, "t4")  # not under the prefix
        # A PUBLISH queued when the subscriber cancels is refused, not left hanging.
        refused = asyncio.ensure_future(peer.publish(INSIDE, b"t5", timeout=STEP))
        for _ in range(200):
            if not subscription._items.empty():
                break
            await asyncio.sleep(0.01)
        await subscription.cancel()
        with pytest.raises(Uninterested):
            await asyncio.wait_for(refused, STEP)
        with pytest.raises(StopAsyncIteration):
            await next_item(subscription)
    finally:
        await client.aclose()
        await server.aclose()


async def test_the_subscription_ends_with_the_session():
    server = await start({"subscribe_tracks": lambda request: request.accept()})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe_tracks(PREFIX), STEP)
        client.close()
        with pytest.raises(SessionClosed):
            await next_item(subscription)
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_refused_subscribe_tracks_raises():
    server = await start()
    client = await dial(server)
    try:
        with pytest.raises(NotSupported):
            await asyncio.wait_for(client.subscribe_tracks(PREFIX), STEP)
    finally:
        await client.aclose()
        await server.aclose()
