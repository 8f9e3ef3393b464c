"""Draft-14 fallback over real aioquic connections on 127.0.0.1: ALPN "moq-00" selects
`MoqtSession14`, "moqt-18" stays preferred, and the same asyncio API works on both."""

import asyncio

import pytest

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.d14.session import MoqtSession14
from kvsp_moq.moqt.d18.session import MoqtSession
from kvsp_moq.moqt.errors import DoesNotExist, PublishDoneCode, SessionClosed
from kvsp_moq.moqt.quic import MoqtConnection, QuicSettings, alpn_of, connect, serve
from kvsp_moq.moqt.wire import Location

CERT = generate_self_signed()
NS = ("kvsp", "c" * 32, "s" * 16)
STEP = 10.0  # seconds any single awaited step may take


async def dial(server, **kwargs) -> MoqtConnection:
    return await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem, **kwargs), STEP)


async def collect(iterator) -> list:
    async def run() -> list:
        return [item async for item in iterator]

    return await asyncio.wait_for(run(), STEP)


def payload(group: int, obj: int) -> bytes:
    return b"%d.%d:" % (group, obj) + bytes([obj]) * (1000 * obj + 1)


def test_alpns_offered_by_default():
    settings = QuicSettings()
    assert settings.quic_configuration(is_client=False).alpn_protocols == ["moqt-18", "moqt-20", "moqt-22", "moq-00"]
    assert settings.quic_configuration(is_client=True).alpn_protocols == ["moqt-18"]
    assert QuicSettings(draft14_fallback=False).quic_configuration(is_client=False).alpn_protocols == [
        "moqt-18", "moqt-20", "moqt-22"]
    assert settings.quic_configuration(is_client=True, drafts=(14,)).alpn_protocols == ["moq-00"]
    assert (alpn_of(18), alpn_of(20), alpn_of(22), alpn_of(14)) == ("moqt-18", "moqt-20", "moqt-22", "moq-00")
    with pytest.raises(ValueError):
        alpn_of(16)
    with pytest.raises(ValueError):
        settings.quic_configuration(is_client=True, drafts=())


async def test_moq00_client_gets_a_draft14_session_and_the_whole_api():
    sessions: list[MoqtConnection] = []
    registrations = []
    updates = []

    async def on_publish_namespace(request):
        registrations.append(request.accept())

    async def on_subscribe(request):
        if request.track_name != b"1":
            raise DoesNotExist("no such track")
        updates.append(request.forward)
        subscription = request.accept(largest=(0, 2))
        # Nothing may be sent before the subscriber's SUBSCRIBE_UPDATE sets Forward to 1.
        await asyncio.wait_for(subscription.wait_forward(), STEP)
        updates.append(subscription.forward)
        sender = subscription.open_subgroup(1, 0)
        for obj in range(3):
            await sender.send(obj, payload(1, obj))
        sender.close()
        await subscription.finish(PublishDoneCode.TRACK_ENDED)

    async def on_fetch(request):
        sender = request.accept()
        for obj in range(request.start.object, request.end.object):  # end is exclusive
            await sender.send(0, obj, payload(0, obj))
        sender.close()

    async def on_track_status(request):
        request.accept(largest=(1, 2))

    async def on_subscribe_namespace(request):
        publisher = request.accept()
        publisher.announce(request.namespace_prefix + (b"holder-1",))
        publisher.withdraw(request.namespace_prefix + (b"holder-1",))

    server = await serve(
        certificate=CERT,
        on_connection=sessions.append,
        handlers={
            "publish_namespace": on_publish_namespace,
            "subscribe": on_subscribe,
            "fetch": on_fetch,
            "track_status": on_track_status,
            "subscribe_namespace": on_subscribe_namespace,
        },
    )
    try:
        client = await dial(server, drafts=(14,))
        try:
            assert client.draft == 14 and isinstance(client.session, MoqtSession14)
            assert client.quic.alpn_protocols == ["moq-00"]
            assert sessions[0].draft == 14 and isinstance(sessions[0].session, MoqtSession14)
            assert sessions[0].peer_setup.path == "/kv"

            announced = await asyncio.wait_for(client.publish_namespace(NS[:2]), STEP)
            assert registrations[0].namespace == tuple(f.encode() for f in NS[:2])
            await announced.withdraw()
            assert await asyncio.wait_for(registrations[0].closed, STEP) is not None

            subscription = await asyncio.wait_for(client.subscribe(NS, "1", forward=False), STEP)
            assert subscription.largest == Location(0, 2)
            # SUBSCRIBE_UPDATE has no answer in draft-14: update() returns without one.
            await asyncio.wait_for(subscription.update(forward=True, subscriber_priority=7), STEP)
            assert subscription.parameters.forward is True and subscription.parameters.subscriber_priority == 7
            objects = await collect(subscription)
            assert [(o.group_id, o.object_id, o.payload) for o in objects] == [
                (1, obj, payload(1, obj)) for obj in range(3)
            ]
            assert subscription.done.status_code == PublishDoneCode.TRACK_ENDED
            assert updates == [False, True]

            fetched = await asyncio.wait_for(client.fetch(NS, "1", (0, 1), (0, 4)), STEP)
            objects = await collect(fetched)
            assert [(o.group_id, o.object_id, o.payload) for o in objects] == [
                (0, obj, payload(0, obj)) for obj in range(1, 5)
            ]

            status = await asyncio.wait_for(client.track_status(NS, "1"), STEP)
            assert status.largest == Location(1, 2)
            # Matching namespaces travel as PUBLISH_NAMESPACE / PUBLISH_NAMESPACE_DONE.
            watch = await asyncio.wait_for(client.subscribe_namespace(("kvsp",)), STEP)
            first = await asyncio.wait_for(watch.__anext__(), STEP)
            second = await asyncio.wait_for(watch.__anext__(), STEP)
            assert (first.namespace, first.active, second.active) == ((b"kvsp", b"holder-1"), True, False)
            await watch.cancel()
            with pytest.raises(DoesNotExist):  # no publisher: rejected with a renumbered code
                await asyncio.wait_for(client.subscribe(NS, "2"), STEP)
        finally:
            await client.aclose()
    finally:
        await server.aclose()


async def test_client_offering_both_gets_draft18():
    sessions: list[MoqtConnection] = []
    server = await serve(certificate=CERT, on_connection=sessions.append)
    try:
        client = await dial(server, drafts=(18, 14))
        try:
            assert client.draft == 18 and isinstance(client.session, MoqtSession)
            assert sessions[0].draft == 18 and isinstance(sessions[0].session, MoqtSession)
        finally:
            await client.aclose()
        # And the default client offers draft-18 alone.
        client = await dial(server)
        try:
            assert client.draft == 18 and client.quic.alpn_protocols == ["moqt-18"]
        finally:
            await client.aclose()
    finally:
        await server.aclose()


async def test_client_offering_both_falls_back_to_a_draft14_only_server():
    server = await serve(certificate=CERT, drafts=(14,))
    try:
        client = await dial(server, drafts=(18, 14))
        try:
            assert client.draft == 14 and isinstance(client.session, MoqtSession14)
        finally:
            await client.aclose()
    finally:
        await server.aclose()


async def test_the_servers_order_decides():
    server = await serve(certificate=CERT)
    try:
        client = await dial(server, drafts=(14, 18))
        try:
            assert client.draft == 18
        finally:
            await client.aclose()
    finally:
        await server.aclose()


async def test_server_without_the_fallback_refuses_a_moq00_client():
    sessions: list[MoqtConnection] = []
    server = await serve(certificate=CERT, settings=QuicSettings(draft14_fallback=False), on_connection=sessions.append)
    try:
        with pytest.raises(SessionClosed):
            await dial(server, drafts=(14,))
        assert sessions == []
        client = await dial(server, drafts=(18, 14))
        try:
            assert client.draft == 18
        finally:
            await client.aclose()
    finally:
        await server.aclose()


@pytest.mark.parametrize("publisher_drafts, subscriber_drafts", [((14,), (18,)), ((18,), (14,))])
async def test_relay_carries_objects_between_drafts(publisher_drafts, subscriber_drafts):
    """Our relay serves draft-14 and draft-18 sessions side by side: objects published on
    one draft reach a subscriber on the other, by SUBSCRIBE and by FETCH from its cache."""
    from relay.relay import Relay, RelaySettings

    track = NS + ("k" * 32,)
    objects = [(g, o, payload(g, o)) for g in range(2) for o in range(3)]

    async def on_subscribe(request):
        subscription = request.accept()
        for group in range(2):
            sender = subscription.open_subgroup(group)
            for obj in range(3):
                await sender.send(obj, payload(group, obj))
            sender.close()
        await subscription.finish()

    relay = await Relay(RelaySettings(certificate=CERT)).start()
    try:
        publisher = await dial(relay.server, drafts=publisher_drafts)
        subscriber = await dial(relay.server, drafts=subscriber_drafts)
        try:
            assert (publisher.draft, subscriber.draft) == (publisher_drafts[0], subscriber_drafts[0])
            publisher.on_subscribe(on_subscribe)
            await asyncio.wait_for(publisher.publish_namespace(NS), STEP)
            subscription = await asyncio.wait_for(subscriber.subscribe(track, "1"), STEP)
            got = await collect(subscription)
            # Each group is a stream of its own: groups may interleave, objects of one may not.
            assert sorted((o.group_id, o.object_id, o.payload) for o in got) == objects
            for group in {o.group_id for o in got}:
                ids = [o.object_id for o in got if o.group_id == group]
                assert ids == sorted(ids)
            fetched = await asyncio.wait_for(subscriber.fetch(track, "1", (1, 0), (1, 2)), STEP)
            got = await collect(fetched)
            assert [(o.group_id, o.object_id, o.payload) for o in got] == objects[3:]
        finally:
            await subscriber.aclose()
            await publisher.aclose()
    finally:
        await relay.aclose()
