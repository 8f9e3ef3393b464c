"""Sessions over real aioquic connections on 127.0.0.1 (ephemeral ports)."""

import asyncio
import os
import socket

import pytest

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.errors import (
    DoesNotExist,
    PublishDoneCode,
    PublishDoneError,
    RequestErrorCode,
    SessionClosed,
    StreamClosed,
    Unauthorized,
    UnauthorizedRequest,
    Uninterested,
)
from kvsp_moq.moqt.quic import MoqtConnection, QuicSettings, connect, serve
from kvsp_moq.moqt.wire import GroupOrder, Location

CERT = generate_self_signed()
NS = ("kvsp", "c" * 32, "s" * 16, "p" * 16, "k" * 32)
KIB = 1024
MIB = 1024 * 1024
STEP = 10.0  # seconds any single awaited step may take


async def start(handlers=None, *, settings=None, on_connection=None, **kwargs):
    server = await serve(certificate=CERT, handlers=handlers, settings=settings, on_connection=on_connection, **kwargs)
    return server


async def dial(server, *, settings=None, **kwargs) -> MoqtConnection:
    return await asyncio.wait_for(
        connect(server.url + "/kv", cadata=CERT.certificate_pem, settings=settings, **kwargs), STEP)


async def collect(iterator, limit: int = 10_000):
    out = []
    async def run():
        async for item in iterator:
            out.append(item)
            assert len(out) <= limit
    await asyncio.wait_for(run(), STEP)
    return out


async def test_setup_binds_loopback_and_exchanges_options():
    seen = []
    server = await start(on_connection=seen.append)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        client = await dial(server, authorization=b"session-token")
        try:
            assert client.peer_setup.implementation.startswith("kvsp-moq")
            assert client._transport.get_extra_info("sockname")[0] == "127.0.0.1"
            assert client.quic.alpn_protocols == ["moqt-18"]
            await asyncio.wait_for(seen[0].wait_ready(), STEP)
            peer = seen[0].peer_setup
            assert peer.path == "/kv"
            assert peer.authority == f"127.0.0.1:{server.port}"
            assert [t.value for t in peer.authorization_tokens] == [b"session-token"]
        finally:
            await client.aclose()
    finally:
        await server.aclose()


async def test_connect_refuses_a_non_moqt_url():
    with pytest.raises(ValueError):
        await connect("https://127.0.0.1:1/")


async def test_publish_namespace_accepted_and_withdrawn():
    registrations = []

    async def on_publish_namespace(request):
        assert request.authorization == [b"tok"]
        registrations.append(request.accept())

    server = await start({"publish_namespace": on_publish_namespace})
    client = await dial(server)
    try:
        announced = await asyncio.wait_for(client.publish_namespace(NS[:2], authorization=b"tok"), STEP)
        assert registrations[0].namespace == tuple(f.encode() for f in NS[:2])
        await announced.withdraw()
        assert await asyncio.wait_for(registrations[0].closed, STEP) is not None
    finally:
        await client.aclose()
        await server.aclose()


async def test_requests_without_a_handler_are_rejected_with_specific_codes():
    server = await start()
    client = await dial(server)
    try:
        with pytest.raises(Uninterested):
            await asyncio.wait_for(client.publish_namespace(NS[:1]), STEP)
        with pytest.raises(DoesNotExist) as caught:
            await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        assert caught.value.error_code == RequestErrorCode.DOES_NOT_EXIST
        with pytest.raises(DoesNotExist):
            await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (0, 3)), STEP)
    finally:
        await client.aclose()
        await server.aclose()


async def test_handler_errors_become_request_errors():
    async def on_subscribe(request):
        if request.authorization != [b"good"]:
            raise UnauthorizedRequest("bad token", retry_interval=1)
        raise RuntimeError("boom")

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        with pytest.raises(Unauthorized) as caught:
            await asyncio.wait_for(client.subscribe(NS, "1", authorization=b"bad"), STEP)
        assert (caught.value.error_code, caught.value.reason, caught.value.retry_interval) == (
            RequestErrorCode.UNAUTHORIZED,
            "bad token",
            1,
        )
        with pytest.raises(Exception) as caught:
            await asyncio.wait_for(client.subscribe(NS, "1", authorization=b"good"), STEP)
        assert caught.value.error_code == RequestErrorCode.INTERNAL_ERROR
    finally:
        await client.aclose()
        await server.aclose()


def layer_payload(layer: int, size: int) -> bytes:
    return (layer.to_bytes(4, "big") * (size // 4 + 1))[:size]


async def test_subscribe_receives_large_objects_in_order():
    sizes = [64 * KIB, 3 * MIB, 1, 512 * KIB, 2 * MIB + 17]

    async def on_subscribe(request):
        subscription = request.accept(largest=(0, len(sizes) - 1))
        subgroup = subscription.open_subgroup(0, 0)
        for layer, size in enumerate(sizes):
            await subgroup.send(layer, layer_payload(layer, size))
        subgroup.close()
        await subscription.finish(PublishDoneCode.TRACK_ENDED)

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        assert subscription.largest == Location(0, len(sizes) - 1)
        objects = await collect(subscription)
        assert [o.object_id for o in objects] == list(range(len(sizes)))
        assert all(o.payload == layer_payload(o.object_id, sizes[o.object_id]) for o in objects)
        assert subscription.done.status_code == PublishDoneCode.TRACK_ENDED
        assert client.quic.held_total == 0  # every consumed byte was credited back
    finally:
        await client.aclose()
        await server.aclose()


async def test_fetch_of_a_range():
    layers = {i: os.urandom(100 * KIB + i) for i in range(40)}
    requests = []

    async def on_fetch(request):
        requests.append(request)
        sender = request.accept()
        for layer in range(request.start.object, request.end.object):
            await sender.send(0, layer, layers[layer])
        sender.close()

    server = await start({"fetch": on_fetch})
    client = await dial(server)
    try:
        fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 5), (0, 12)), STEP)
        objects = await collect(fetched)
        assert [o.object_id for o in objects] == list(range(5, 13))
        assert all(o.payload == layers[o.object_id] and o.group_id == 0 for o in objects)
        assert fetched.end_location == Location(0, 13)
        assert (requests[0].last == Location(0, 12) and requests[0].includes((0, 12))
                and not requests[0].includes((0, 13)))
    finally:
        await client.aclose()
        await server.aclose()


async def test_descending_fetch_across_groups():
    async def on_fetch(request):
        assert request.group_order == GroupOrder.DESCENDING
        sender = request.accept(end=(2, 2))
        for group in (2, 1, 0):
            for obj in range(2):
                await sender.send(group, obj, b"%d.%d" % (group, obj))
        sender.close()

    server = await start({"fetch": on_fetch})
    client = await dial(server)
    try:
        fetched = await asyncio.wait_for(
            client.fetch(NS, "1", (0, 0), (2, 1), group_order=GroupOrder.DESCENDING), STEP
        )
        objects = await collect(fetched)
        assert [(o.group_id, o.object_id, o.payload) for o in objects] == [
            (g, o, b"%d.%d" % (g, o)) for g in (2, 1, 0) for o in range(2)
        ]
    finally:
        await client.aclose()
        await server.aclose()


async def test_track_status_and_namespace_subscription():
    async def on_track_status(request):
        request.accept(largest=(0, 31), track_properties=((0x0E, 10),))

    async def on_subscribe_namespace(request):
        publisher = request.accept()
        publisher.announce(request.namespace_prefix + (b"holder-1",))
        publisher.withdraw(request.namespace_prefix + (b"holder-1",))

    server = await start({"track_status": on_track_status, "subscribe_namespace": on_subscribe_namespace})
    client = await dial(server)
    try:
        status = await asyncio.wait_for(client.track_status(NS, "1"), STEP)
        assert (status.largest, status.track_properties) == (Location(0, 31), ((0x0E, 10),))
        watch = await asyncio.wait_for(client.subscribe_namespace(("kvsp",)), STEP)
        first = await asyncio.wait_for(watch.__anext__(), STEP)
        second = await asyncio.wait_for(watch.__anext__(), STEP)
        assert (first.namespace, first.active, second.active) == ((b"kvsp", b"holder-1"), True, False)
        await watch.cancel()
    finally:
        await client.aclose()
        await server.aclose()


async def test_publisher_that_vanishes_mid_track_fails_the_iterator():
    started = asyncio.Event()

    async def on_subscribe(request):
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        await subgroup.send(0, b"layer-0" * 1000)
        started.set()
        await asyncio.sleep(STEP)  # never finishes the track

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        first = await asyncio.wait_for(subscription.__anext__(), STEP)
        assert first.object_id == 0
        await asyncio.wait_for(started.wait(), STEP)
        server.close()  # the publisher goes away: CONNECTION_CLOSE
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(subscription.__anext__(), STEP)
    finally:
        await client.aclose()
        await server.aclose()


class _BlackHole:
    """A datagram transport that sends nothing: a peer that vanished without a word."""

    def sendto(self, data, addr=None):
        pass

    def close(self):
        pass


async def test_silently_lost_publisher_fails_the_iterator_after_the_idle_timeout():
    connections = []

    async def on_subscribe(request):
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        await subgroup.send(0, b"x" * 1000)
        await asyncio.sleep(STEP)

    server = await start(
        {"subscribe": on_subscribe}, settings=QuicSettings(idle_timeout=1.0), on_connection=connections.append
    )
    client = await dial(server, settings=QuicSettings(idle_timeout=1.0))
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        await asyncio.wait_for(subscription.__anext__(), STEP)
        connections[0]._transport = _BlackHole()  # no CONNECTION_CLOSE, no ACKs: just gone
        with pytest.raises(SessionClosed):
            await asyncio.wait_for(subscription.__anext__(), STEP)
    finally:
        await client.aclose()
        await server.aclose()


async def test_abnormal_publish_done_raises():
    async def on_subscribe(request):
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        await subgroup.send(0, b"only")
        subgroup.close()
        await subscription.finish(PublishDoneCode.TOO_FAR_BEHIND, "slow")

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        assert (await asyncio.wait_for(subscription.__anext__(), STEP)).payload == b"only"
        with pytest.raises(PublishDoneError) as caught:
            await asyncio.wait_for(subscription.__anext__(), STEP)
        assert caught.value.error_code == PublishDoneCode.TOO_FAR_BEHIND
    finally:
        await client.aclose()
        await server.aclose()


async def test_unsubscribe_stops_the_publisher():
    stopped = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        try:
            for layer in range(1000):
                await subgroup.send(layer, b"z" * 64 * KIB)
        except StreamClosed:
            stopped.set_result(layer)
        assert subscription.cancelled.done()

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        await asyncio.wait_for(subscription.__anext__(), STEP)
        await subscription.unsubscribe()
        assert await asyncio.wait_for(stopped, STEP) < 999
    finally:
        await client.aclose()
        await server.aclose()


async def test_slow_subscriber_bounds_publisher_buffering():
    object_size = 256 * KIB
    count = 48
    publisher_settings = QuicSettings(stream_send_buffer=512 * KIB, connection_send_buffer=1 * MIB,
                                      write_chunk_size=64 * KIB)
    subscriber_settings = QuicSettings(max_stream_data=1 * MIB, max_data=4 * MIB)
    progress = {"sent": 0, "max_buffered": 0, "ahead": 0}
    consumed = 0

    async def on_subscribe(request):
        connection = request.connection
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        payload = os.urandom(object_size)
        for layer in range(count):
            await subgroup.send(layer, payload)
            progress["sent"] = layer + 1
            progress["ahead"] = max(progress["ahead"], progress["sent"] - consumed)
            progress["max_buffered"] = max(progress["max_buffered"], connection.buffered(subgroup.stream_id))
        subgroup.close()
        await subscription.finish()

    server = await start({"subscribe": on_subscribe}, settings=publisher_settings)
    client = await dial(server, settings=subscriber_settings)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        max_held = 0
        async def read_slowly():
            nonlocal consumed, max_held
            async for obj in subscription:
                max_held = max(max_held, client.quic.held_total)
                consumed += 1
                assert obj.object_id == consumed - 1
                await asyncio.sleep(0.01)
        await asyncio.wait_for(read_slowly(), 30)
        assert consumed == count
        # Unacknowledged bytes on the publisher never exceed one chunk over the limit.
        assert progress["max_buffered"] <= publisher_settings.stream_send_buffer + publisher_settings.write_chunk_size
        # The publisher stays a bounded number of objects ahead of the reader, not the
        # whole track: the credit the reader has not consumed + the send buffer + the
        # object in flight. aioquic credits each stream as it is consumed (its window
        # bounds what is held); qh3 leaves received data in its core while the reader
        # holds more than max_data, so the connection's window bounds it, twice over at
        # most (what the reader holds, and what the core keeps meanwhile).
        assert client.quic.credit_on_consumption
        held = 1 * MIB if client.quic.name == "aioquic" else subscriber_settings.max_data + 1 * MIB
        ahead = held if client.quic.name == "aioquic" else 2 * subscriber_settings.max_data
        assert progress["ahead"] <= (ahead + 512 * KIB) // object_size + 4
        assert max_held <= held + 2 * object_size
    finally:
        await client.aclose()
        await server.aclose()


async def test_publish_to_a_subscriber_endpoint():
    received = asyncio.get_running_loop().create_future()

    async def on_publish(request):
        subscription = request.accept(forward=True)
        received.set_result(await collect(subscription))

    server = await start({"publish": on_publish})
    client = await dial(server)
    try:
        outgoing = await asyncio.wait_for(client.publish(NS, "live", largest=(0, 1)), STEP)
        subgroup = outgoing.open_subgroup(0)
        await subgroup.send(0, b"a")
        await subgroup.send(1, b"b")
        subgroup.close()
        await outgoing.finish()
        objects = await asyncio.wait_for(received, STEP)
        assert [o.payload for o in objects] == [b"a", b"b"]
    finally:
        await client.aclose()
        await server.aclose()


async def test_goaway_reaches_the_client():
    connections = []
    server = await start(on_connection=connections.append)
    client = await dial(server)
    try:
        await asyncio.wait_for(connections[0].wait_ready(), STEP)
        got = asyncio.get_running_loop().create_future()
        client.on_goaway = got.set_result
        connections[0].send_goaway("moqt://127.0.0.1:1/next", 100)
        goaway = await asyncio.wait_for(got, STEP)
        assert (goaway.new_session_uri, goaway.timeout_ms) == ("moqt://127.0.0.1:1/next", 100)
    finally:
        await client.aclose()
        await server.aclose()


async def test_socket_buffers_are_set():
    server = await start()
    try:
        sock = server._quic_server._transport.get_extra_info("socket")
        # Linux doubles the requested size; at least the request must be granted or capped by the system.
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= min(4 * MIB, 200 * KIB)
    finally:
        await server.aclose()


async def test_stop_sending_on_a_subgroup_stream_releases_a_blocked_writer():
    outcome = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        subscription = request.accept()
        subgroup = subscription.open_subgroup(0)
        try:
            for layer in range(10_000):
                await subgroup.send(layer, b"w" * 256 * KIB)
        except StreamClosed:
            outcome.set_result(layer)

    server = await start(
        {"subscribe": on_subscribe}, settings=QuicSettings(stream_send_buffer=256 * KIB, write_chunk_size=64 * KIB)
    )
    client = await dial(server, settings=QuicSettings(max_stream_data=512 * KIB))
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        await asyncio.wait_for(subscription.__anext__(), STEP)  # the publisher is now blocked on flow control
        stream_id = next(iter(client.session._receiving.streams))
        client.session.stop_data_stream(stream_id)
        client.transmit()
        assert await asyncio.wait_for(outcome, STEP) < 10_000
        await subscription.aclose()
        assert client.quic.held_total == 0
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_ping_abandoned_by_its_caller_leaves_no_unretrieved_error_when_the_session_ends():
    """The relay's liveness probe gives up on a PING after a timeout; when that session then
    ends, the PING's pending waiter fails. Nothing may be left for asyncio to report as "Future
    exception was never retrieved" (an ERROR line in the relay's log per vanished peer)."""
    import gc
    import logging

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(logging.ERROR)
    logging.getLogger("asyncio").addHandler(handler)
    try:
        server = await start()
        try:
            client = await dial(server)
            ping = asyncio.ensure_future(client.ping())
            await asyncio.sleep(0)  # the PING is sent ...
            ping.cancel()  # ... and abandoned before its answer can arrive
            with pytest.raises(asyncio.CancelledError):
                await ping
            client.close()
            await asyncio.wait_for(client.wait_closed(), STEP)
            await asyncio.sleep(0.05)
        finally:
            server.close()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not [r for r in records if "never retrieved" in r.getMessage()], \
        [r.getMessage() for r in records]


async def test_a_ping_on_a_closing_or_closed_connection_is_a_connection_error():
    """The relay's probe treats ConnectionError as a dead peer; an engine's own exception for
    a connection that is closing (qh3 raises where aioquic ignores) must not escape it."""
    server = await start()
    try:
        client = await dial(server)
        client.close()
        with pytest.raises(ConnectionError):  # closing: fails when the connection ends
            await asyncio.wait_for(client.ping(), STEP)
        await asyncio.wait_for(client.wait_closed(), STEP)
        with pytest.raises(ConnectionError):  # closed: at once
            await asyncio.wait_for(client.ping(), STEP)
    finally:
        server.close()
