"""Delivery timeouts (draft-18 "Delivery Timeouts and Data Reliability") over real aioquic
sessions on 127.0.0.1: a publisher gives up on objects a blocked subscriber would get too
late, and the subscription goes on."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from kvsp_moq.moqt.quic import OutgoingSubscription, QuicSettings
from kvsp_moq.moqt.wire import TrackPropertyType

from .test_quic import NS, STEP, collect, dial, start

KIB = 1024
OBJECT = 32 * KIB
# The subscriber grants little credit, so a publisher facing a reader that does not read
# blocks after a few objects.
BLOCKING = QuicSettings(max_stream_data=64 * KIB, max_data=256 * KIB)
# A publisher that keeps little in QUIC's send buffer, so that objects wait in its hands
# (where their timeout is checked) rather than in QUIC's.
SMALL_BUFFERS = QuicSettings(stream_send_buffer=64 * KIB, connection_send_buffer=128 * KIB)


async def test_object_past_its_delivery_timeout_resets_the_subgroup_and_the_track_goes_on():
    reading = asyncio.Event()
    result: dict[str, object] = {}

    async def on_subscribe(request):
        outgoing = request.accept()
        result["timeout"] = outgoing.object_delivery_timeout
        sender = outgoing.open_subgroup(0)
        sent = 0
        for object_id in range(64):  # far more than the subscriber's credit
            if not await sender.send(object_id, os.urandom(OBJECT)):
                break
            sent += 1
        # The timeout, not the reader, ended the wait.
        result["gave_up_unread"] = not reading.is_set()
        result["sent_in_group_0"] = sent
        result["later_send"] = await sender.send(99, b"late")  # the subgroup sends nothing more
        await reading.wait()
        second = outgoing.open_subgroup(1)
        assert await second.send(0, b"after")
        second.close()
        result["timed_out"] = outgoing.objects_timed_out
        await outgoing.finish()

    server = await start({"subscribe": on_subscribe}, settings=SMALL_BUFFERS)
    client = await dial(server, settings=BLOCKING)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1", object_delivery_timeout=150), STEP)
        await asyncio.sleep(0.8)  # blocked: the publisher waits past the timeout
        reading.set()
        objects = await collect(subscription)
        assert result["timeout"] == 150
        assert result["gave_up_unread"] is True
        assert 0 < result["sent_in_group_0"] < 64
        assert result["later_send"] is False
        assert result["timed_out"] == 1
        group_0 = [o for o in objects if o.group_id == 0]
        assert [o.object_id for o in group_0] == list(range(len(group_0)))
        assert len(group_0) <= result["sent_in_group_0"]
        assert [(o.group_id, o.payload) for o in objects if o.group_id == 1] == [(1, b"after")]
        assert subscription.streams_timed_out == 1  # a reset, not an error for the subscription
        assert client.quic.held_total == 0
    finally:
        await client.aclose()
        await server.aclose()


async def test_smaller_of_track_property_and_subscriber_parameter_applies():
    accepted = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        accepted.set_result(request.accept(track_properties=((TrackPropertyType.OBJECT_DELIVERY_TIMEOUT, 400),)))
        await asyncio.sleep(3600)

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(
            client.subscribe(NS, "1", object_delivery_timeout=1000, subgroup_delivery_timeout=0), STEP)
        outgoing: OutgoingSubscription = await asyncio.wait_for(accepted, STEP)
        assert outgoing.object_delivery_timeout == 400
        assert outgoing.subgroup_delivery_timeout is None  # 0: no timeout
        await subscription.update(object_delivery_timeout=100, subgroup_delivery_timeout=250, timeout=STEP)
        assert outgoing.object_delivery_timeout == 100
        assert outgoing.subgroup_delivery_timeout == 250
        # Datagrams past the timeout are dropped rather than sent.
        loop = asyncio.get_running_loop()
        assert not outgoing.send_datagram(0, 0, b"x", received_at=loop.time() - 1.0)
        assert outgoing.send_datagram(0, 1, b"y", received_at=loop.time())
    finally:
        await client.aclose()
        await server.aclose()


async def test_subgroup_not_delivered_within_its_timeout_after_fin_is_reset():
    # The subscriber withholds stream credit, so the FIN waits: that takes an engine that
    # grants credit on consumption (aioquic). qh3 grants it on arrival and delivers all.
    result: dict[str, object] = {}
    done = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        outgoing = request.accept()
        sender = outgoing.open_subgroup(0)
        for object_id in range(3):  # 96 KiB: more than the stream credit, so the FIN waits
            await sender.send(object_id, os.urandom(OBJECT))
        sender.close()
        await asyncio.sleep(0.6)
        result["timed_out"] = sender.timed_out
        done.set_result(None)
        await outgoing.finish()

    server = await start({"subscribe": on_subscribe}, settings=QuicSettings(engine="aioquic"))
    client = await dial(server, settings=replace(BLOCKING, engine="aioquic"))
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1", subgroup_delivery_timeout=150), STEP)
        await asyncio.wait_for(done, STEP)  # not reading until the publisher gave up
        objects = await collect(subscription)
        assert result["timed_out"] is True
        assert len(objects) < 3
        assert subscription.streams_timed_out == 1
    finally:
        await client.aclose()
        await server.aclose()
