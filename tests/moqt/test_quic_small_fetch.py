"""Per-request costs of small exchanges: ACKs ride along with answers, consuming objects
only transmits when it frees credit worth announcing, and a FETCH's objects are awaited
with a timeout that needs no task per object."""

from __future__ import annotations

import asyncio
import os

import pytest
from aioquic import tls
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import QuicSettings, connect, serve
from kvsp_moq.moqt.quic.aioquic_engine import _prepare_quic

CERT = generate_self_signed()
NS = ("kvsp", "c" * 32, "s" * 16, "p" * 16, "k" * 32)
CLIENT_ADDR = ("127.0.0.1", 1234)
SERVER_ADDR = ("127.0.0.1", 4433)
STEP = 10.0


def _exchange(a: QuicConnection, b: QuicConnection, now: float) -> None:
    """Move datagrams both ways until neither side has any to send."""
    while True:
        moved = False
        for sender, receiver, addr in ((a, b, CLIENT_ADDR), (b, a, SERVER_ADDR)):
            for data, _ in sender.datagrams_to_send(now=now):
                receiver.receive_datagram(data, addr, now=now)
                moved = True
        if not moved:
            return


def _pair(settings: QuicSettings) -> tuple[QuicConnection, QuicConnection]:
    client_config = settings.quic_configuration(is_client=True)
    client_config.verify_mode = 0  # ssl.CERT_NONE
    server_config = settings.quic_configuration(is_client=False)
    server_config.certificate = CERT.certificate
    server_config.private_key = CERT.private_key
    client = _prepare_quic(QuicConnection(configuration=client_config), settings)
    server = _prepare_quic(QuicConnection(configuration=server_config,
                                          original_destination_connection_id=client.original_destination_connection_id),
                           settings)
    client.connect(SERVER_ADDR, now=0.0)
    for now in (0.0, 0.1, 0.2):  # the handshake and the ACKs that follow it
        _exchange(client, server, now)
    while client.next_event() is not None or server.next_event() is not None:
        pass
    return client, server


def _in_flight(quic: QuicConnection) -> int:
    return len(quic._spaces[tls.Epoch.ONE_RTT].sent_packets)


def test_an_answer_carries_the_ack_of_its_request():
    client, server = _pair(QuicSettings(engine="aioquic", max_datagram_size=1350))
    now = 1.0
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request")
    for data, _ in client.datagrams_to_send(now=now):
        server.receive_datagram(data, CLIENT_ADDR, now=now)
    assert _in_flight(client) == 1
    assert any(isinstance(e, StreamDataReceived) for e in iter(server.next_event, None))
    server.send_stream_data(stream_id, b"answer", end_stream=True)
    answer = server.datagrams_to_send(now=now)
    assert len(answer) == 1
    client.receive_datagram(answer[0][0], SERVER_ADDR, now=now)
    assert _in_flight(client) == 0  # acknowledged by the answer itself
    assert server.datagrams_to_send(now=now + 0.01) == []  # and no ACK of its own follows


def test_without_anything_to_send_the_ack_waits_for_its_delay():
    client, server = _pair(QuicSettings(engine="aioquic", max_datagram_size=1350))
    now = 1.0
    client.send_stream_data(client.get_next_available_stream_id(), b"request")
    for data, _ in client.datagrams_to_send(now=now):
        server.receive_datagram(data, CLIENT_ADDR, now=now)
    assert server.datagrams_to_send(now=now) == []
    assert len(server.datagrams_to_send(now=now + 0.01)) == 1


def test_consuming_only_asks_for_a_transmit_when_credit_is_due():
    settings = QuicSettings(engine="aioquic", max_datagram_size=1350, max_stream_data=16 * 1024, max_data=1024 * 1024)
    client, server = _pair(settings)
    now = 1.0
    stream_id = client.get_next_available_stream_id()

    def deliver(size: int) -> None:
        """Bytes from the client that the server's application holds (delivered, unconsumed)."""
        client.send_stream_data(stream_id, os.urandom(size))
        for data, _ in client.datagrams_to_send(now=now):
            server.receive_datagram(data, CLIENT_ADDR, now=now)
        got = sum(len(e.data) for e in iter(server.next_event, None) if isinstance(e, StreamDataReceived))
        assert got == size
        server.hold(stream_id, size)

    deliver(1000)
    assert server.release(stream_id, 1000) is False  # less than an eighth of the window
    deliver(1200)
    assert server.release(stream_id, 1200) is True
    assert server.credit_due(stream_id)


async def test_next_object_times_out_without_objects_and_ends_with_none():
    release = asyncio.Event()

    async def on_fetch(request):
        sender = request.accept()
        await sender.send(0, 0, b"first")
        await release.wait()
        await sender.send(0, 1, b"second")
        sender.close()

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch})
    client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
    try:
        fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (0, 1)), STEP)
        first = await fetched.next_object(STEP)
        assert first is not None and first.payload == b"first"
        with pytest.raises(asyncio.TimeoutError):
            await fetched.next_object(0.05)
        release.set()
        second = await fetched.next_object(STEP)
        assert second is not None and second.object_id == 1
        assert await fetched.next_object(STEP) is None
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_subscriptions_next_object_times_out_skips_subgroup_ends_and_ends_with_none():
    release = asyncio.Event()

    async def on_subscribe(request):
        subscription = request.accept()
        sender = subscription.open_subgroup(0, 0)
        await sender.send(0, b"first")
        sender.close()  # a SubgroupEnd on the subscriber's queue, not an object
        await release.wait()
        sender = subscription.open_subgroup(1, 0)
        await sender.send(0, b"second")
        sender.close()
        await subscription.finish()

    server = await serve(certificate=CERT, handlers={"subscribe": on_subscribe})
    client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
    try:
        subscription = await client.subscribe(NS, "1", timeout=STEP)
        first = await subscription.next_object(STEP)
        assert first is not None and first.payload == b"first"
        with pytest.raises(asyncio.TimeoutError):
            await subscription.next_object(0.05)
        release.set()
        second = await subscription.next_object(STEP)
        assert second is not None and (second.group_id, second.payload) == (1, b"second")
        assert await subscription.next_object(STEP) is None
    finally:
        await client.aclose()
        await server.aclose()


async def test_send_now_writes_only_while_the_stream_has_room():
    kib = 1024
    settings = QuicSettings(stream_send_buffer=32 * kib, write_chunk_size=16 * kib)
    written: list[int] = []

    async def on_fetch(request):
        sender = request.accept()
        # Too big for one write chunk: left to send(), nothing written.
        assert not sender.send_now(0, 0, bytes(17 * kib))
        object_id = 0
        while sender.send_now(0, object_id, bytes([object_id]) * (8 * kib)):
            object_id += 1  # no await in between: nothing is acknowledged meanwhile
        written.append(object_id)
        for later in range(object_id, object_id + 8):
            await sender.send(0, later, bytes([later]) * (8 * kib))
        sender.close()

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch}, settings=settings)
    client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
    try:
        fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (1, 0)), STEP)
        got = [obj async for obj in fetched]
        # The stream stops taking objects once its buffer is full, not before.
        assert written == [4]
        assert [obj.object_id for obj in got] == list(range(12))
        assert all(obj.payload == bytes([obj.object_id]) * (8 * kib) for obj in got)
    finally:
        await client.aclose()
        await server.aclose()


async def test_ready_object_takes_what_arrived_without_waiting():
    async def on_fetch(request):
        sender = request.accept()
        for object_id in range(6):
            await sender.send(0, object_id, b"x%d" % object_id)
        sender.close()

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch})
    client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
    try:
        fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (1, 0)), STEP)
        got = []
        while True:
            obj = fetched.ready_object()
            if obj is None:
                obj = await fetched.next_object(STEP)
                if obj is None:
                    break
            got.append(obj.payload)
        assert got == [b"x%d" % i for i in range(6)]
        assert fetched.ready_object() is None  # the end is for next_object() to report
    finally:
        await client.aclose()
        await server.aclose()


async def test_close_of_an_unfinished_fetch_cancels_it_without_awaiting():
    cancelled: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_fetch(request):
        sender = request.accept()
        await sender.send(0, 0, b"first")
        cancelled.set_result(await sender.cancelled)

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch})
    client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
    try:
        fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (1, 0)), STEP)
        assert (await fetched.next_object(STEP)).payload == b"first"
        fetched.close()
        await asyncio.wait_for(cancelled, STEP)
        with pytest.raises(StopAsyncIteration):
            await fetched.__anext__()
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_served_fetch_leaves_nothing_behind():
    """A session that answers FETCHes for days must not keep one sender per FETCH."""
    from .test_quic import NS, start
    from .test_quic import dial as dial_server

    served = []

    async def on_fetch(request):
        sender = request.accept(end=(0, 2))
        await sender.send(0, 0, b"a")
        await sender.send(0, 1, b"b")
        sender.close()

    server = await start({"fetch": on_fetch}, on_connection=served.append)
    client = await dial_server(server)
    try:
        for _ in range(20):
            result = await asyncio.wait_for(client.fetch(NS, "t", (0, 0), (0, 1)), 10)
            assert [o.payload async for o in result] == [b"a", b"b"]
        assert served[0].request_handles() == []
        assert client.request_handles() == []
    finally:
        await client.aclose()
        await server.aclose()
