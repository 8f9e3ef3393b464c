"""Joining FETCH sent before its SUBSCRIBE was answered (draft-18 section 10.12.2):
the publisher holds it until SUBSCRIBE_OK, or refuses it when the SUBSCRIBE fails."""

import asyncio

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt import wire
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode, StreamResetCode
from kvsp_moq.moqt.quic import QuicSettings, connect, serve

from .pair import SessionPair

NS = (b"kvsp", b"c" * 32, b"s" * 16)


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of(events, kind)
    assert len(found) == 1, events
    return found[0]


@pytest.fixture
def pair(pair_engine: str) -> SessionPair:
    p = SessionPair(engine=pair_engine, client_setup=m.Setup(path="/relay"))
    p.take("server")
    p.take("client")
    return p


def subscribe_and_join(pair: SessionPair, joining_start: int = 2, *, relative: bool = True,
                       forward: bool | None = None) -> tuple[int, int]:
    """SUBSCRIBE and its joining FETCH back to back, both delivered before any answer."""
    sub = pair.client.subscribe(NS, b"1", m.Parameters(forward=forward))
    fetch = pair.client.joining_fetch(sub, joining_start, relative=relative)
    pair.exchange()
    events = pair.take("server")
    assert one(events, ev.SubscribeReceived).request_id == sub
    assert of(events, ev.FetchReceived) == []  # held, not refused
    assert of(pair.take("client"), ev.RequestRejected) == []
    assert pair.server.take_events() == []
    return sub, fetch


def test_held_joining_fetch_is_released_by_subscribe_ok_and_served(pair):
    sub, fetch = subscribe_and_join(pair, 2)
    pair.server.subscribe_ok(sub, largest=wire.Location(7, 3))
    released = pair.server.take_events()
    request = one(released, ev.FetchReceived)
    assert (request.request_id, request.fetch_type, request.namespace, request.track_name) == (
        fetch, wire.FetchType.RELATIVE_JOINING, NS, b"1")
    assert (request.start, request.end, request.joining_request_id) == (wire.Location(5, 0), wire.Location(7, 4), sub)
    assert pair.server.take_events() == []  # taken once

    sid = pair.server.open_fetch_stream(fetch)
    pair.server.write_fetch_object(sid, 5, 0, b"five")
    pair.server.write_fetch_object(sid, 7, 3, b"seven")
    pair.server.close_data_stream(sid)
    pair.server.fetch_ok(fetch, request.end)
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.SubscribeAccepted).request_id == sub
    assert one(events, ev.FetchAccepted).end_location == wire.Location(7, 4)
    assert [(o.group_id, o.object_id, o.payload) for o in of(events, ev.FetchObjectReceived)] == [
        (5, 0, b"five"), (7, 3, b"seven")]
    assert of(events, ev.RequestRejected) == []
    assert fetch not in pair.server._requests and fetch not in pair.client._requests


def test_absolute_joining_fetch_is_released_too(pair):
    sub, fetch = subscribe_and_join(pair, 4, relative=False)
    pair.server.subscribe_ok(sub, largest=wire.Location(9, 0))
    request = one(pair.server.take_events(), ev.FetchReceived)
    assert (request.fetch_type, request.start, request.end) == (
        wire.FetchType.ABSOLUTE_JOINING, wire.Location(4, 0), wire.Location(9, 1))


def test_released_events_not_taken_come_with_the_next_quic_event(pair):
    sub, fetch = subscribe_and_join(pair)
    pair.server.subscribe_ok(sub, largest=wire.Location(3, 0))
    other = pair.client.subscribe(NS, b"2")
    pair.exchange()
    events = pair.take("server")
    assert [type(e) for e in events] == [ev.FetchReceived, ev.SubscribeReceived]
    assert (events[0].request_id, events[1].request_id) == (fetch, other)
    assert pair.server.take_events() == []


def test_refused_subscribe_refuses_its_held_fetch(pair):
    sub, fetch = subscribe_and_join(pair)
    pair.server.request_error(sub, RequestErrorCode.DOES_NOT_EXIST, "no such track")
    assert pair.server.take_events() == []
    pair.exchange()
    rejected = {e.request_id: e for e in of(pair.take("client"), ev.RequestRejected)}
    assert rejected[sub].error_code == RequestErrorCode.DOES_NOT_EXIST
    assert rejected[fetch].error_code == RequestErrorCode.INVALID_JOINING_REQUEST_ID
    assert of(pair.take("server"), ev.FetchReceived) == []
    assert pair.client._requests == {} and pair.server._requests == {}


def test_subscribe_cancelled_while_pending_refuses_its_held_fetch(pair):
    sub, fetch = subscribe_and_join(pair)
    pair.client.cancel_request(sub)
    pair.exchange()
    assert one(pair.take("server"), ev.RequestCancelled).request_id == sub
    assert pair.server.take_events() == []
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (fetch, RequestErrorCode.INVALID_JOINING_REQUEST_ID)


def test_held_fetch_cancelled_by_its_requester_is_dropped_quietly(pair):
    sub, fetch = subscribe_and_join(pair)
    pair.client.cancel_request(fetch, StreamResetCode.CANCELLED)
    pair.exchange()
    assert of(pair.take("server"), ev.RequestCancelled) == []  # the application never saw it
    pair.server.subscribe_ok(sub, largest=wire.Location(1, 0))
    assert pair.server.take_events() == []
    pair.exchange()
    assert of(pair.take("server"), ev.FetchReceived) == []
    assert one(pair.take("client"), ev.SubscribeAccepted).request_id == sub


def test_released_fetch_of_an_empty_track_is_refused_with_invalid_range(pair):
    sub, fetch = subscribe_and_join(pair)
    pair.server.subscribe_ok(sub)  # no Largest Object: nothing published
    assert pair.server.take_events() == []
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (fetch, RequestErrorCode.INVALID_RANGE)


def test_released_fetch_of_a_forward_0_subscription_is_refused_with_invalid_range(pair):
    sub, fetch = subscribe_and_join(pair, forward=False)
    pair.server.subscribe_ok(sub, largest=wire.Location(2, 0))
    assert pair.server.take_events() == []
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (fetch, RequestErrorCode.INVALID_RANGE)


def test_several_fetches_held_for_one_subscribe_are_released_in_order(pair):
    sub = pair.client.subscribe(NS, b"1")
    fetches = [pair.client.joining_fetch(sub, n) for n in (0, 1, 2)]
    pair.exchange()
    assert of(pair.take("server"), ev.FetchReceived) == []
    pair.server.subscribe_ok(sub, largest=wire.Location(5, 1))
    released = of(pair.server.take_events(), ev.FetchReceived)
    assert [(r.request_id, r.start) for r in released] == [
        (fetches[0], wire.Location(5, 0)), (fetches[1], wire.Location(4, 0)), (fetches[2], wire.Location(3, 0))]


def test_joining_fetch_of_a_refused_subscription_is_refused_at_once(pair):
    sub = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    pair.server.request_error(sub, RequestErrorCode.DOES_NOT_EXIST)
    pair.client.joining_fetch(sub, 1)  # sent before the REQUEST_ERROR arrived
    pair.exchange()
    assert of(pair.take("server"), ev.FetchReceived) == []
    rejected = [e for e in pair.take("client") if isinstance(e, ev.RequestRejected)]
    assert [e.error_code for e in rejected] == [RequestErrorCode.DOES_NOT_EXIST,
                                                 RequestErrorCode.INVALID_JOINING_REQUEST_ID]


# --------------------------------------------------------------------------- over aioquic


async def test_a_held_joining_fetch_reaches_the_fetch_handler_after_accept():
    """SUBSCRIBE and its joining FETCH sent back to back to a server whose SUBSCRIBE handler
    takes its time: the FETCH handler runs once the SUBSCRIBE is accepted."""
    cert = generate_self_signed()
    order: list[str] = []
    fetches = []

    async def on_subscribe(request):
        await asyncio.sleep(0.2)  # the FETCH has arrived by now
        order.append("subscribe")
        request.accept(largest=(3, 1))

    async def on_fetch(request):
        order.append("fetch")
        fetches.append((request.start, request.end, request.joining_request_id))
        sender = request.accept()
        await sender.send(2, 0, b"two")
        await sender.send(3, 1, b"three")
        sender.close()

    server = await serve(certificate=cert, handlers={"subscribe": on_subscribe, "fetch": on_fetch})
    client = await asyncio.wait_for(connect(server.url, cadata=cert.certificate_pem), 10)
    try:
        session = client.session
        sub = session.subscribe(NS, b"1")
        fetch_id = session.joining_fetch(sub, 1)
        result = await client._start_fetch(fetch_id, 10)  # sends both at once

        async def read():
            return [(o.group_id, o.object_id, o.payload) async for o in result]

        assert await asyncio.wait_for(read(), 10) == [(2, 0, b"two"), (3, 1, b"three")]
        assert order == ["subscribe", "fetch"]
        assert fetches == [(wire.Location(2, 0), wire.Location(3, 2), sub)]
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_track_that_ended_waits_for_the_joining_fetch_sent_on_subscribe_ok():
    """A subscriber that sends its joining FETCH only once SUBSCRIBE_OK is in (moq-rs) to
    a track that ends before any object is sent on the subscription: the FETCH is answered
    in full, and PUBLISH_DONE follows its response instead of refusing or overtaking it."""
    cert = generate_self_signed()
    order: list[str] = []

    async def on_subscribe(request):
        subscription = request.accept(largest=(0, 2))  # nothing after the Largest Object
        await subscription.finish(PublishDoneCode.TRACK_ENDED, "track ended")
        order.append("publish done")

    async def on_fetch(request):
        sender = request.accept()
        for o in range(3):
            await sender.send(0, o, bytes([o]) * 1000)
        sender.close()
        order.append("fetch answered")

    server = await serve(certificate=cert, handlers={"subscribe": on_subscribe, "fetch": on_fetch})
    client = await asyncio.wait_for(connect(server.url, cadata=cert.certificate_pem), 10)
    try:
        sub = await client.subscribe(NS, b"1", subscription_filter=wire.SubscriptionFilter.largest_object(),
                                     timeout=10)
        fetch = await client.joining_fetch(sub, 0, timeout=10)

        async def read(objects):
            return [(o.group_id, o.object_id, bytes(o.payload)) async for o in objects]

        assert await asyncio.wait_for(read(fetch), 10) == [(0, o, bytes([o]) * 1000) for o in range(3)]
        assert await asyncio.wait_for(read(sub), 10) == []  # ended by PUBLISH_DONE TRACK_ENDED
        assert sub.done is not None and sub.done.status_code == PublishDoneCode.TRACK_ENDED
        assert order == ["fetch answered", "publish done"]
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_subscription_nobody_joins_ends_after_the_joining_window():
    """The wait is bounded: with no joining FETCH, PUBLISH_DONE goes out once
    `joining_fetch_wait` has passed since SUBSCRIBE_OK, and the subscriber's iteration ends."""
    cert = generate_self_signed()
    settings = QuicSettings(joining_fetch_wait=0.3)
    ended: list[float] = []

    async def on_subscribe(request):
        subscription = request.accept(largest=(0, 2))
        started = asyncio.get_running_loop().time()
        await subscription.finish(PublishDoneCode.TRACK_ENDED)
        ended.append(asyncio.get_running_loop().time() - started)

    server = await serve(certificate=cert, handlers={"subscribe": on_subscribe}, settings=settings)
    client = await asyncio.wait_for(connect(server.url, cadata=cert.certificate_pem), 10)
    try:
        sub = await client.subscribe(NS, b"1", subscription_filter=wire.SubscriptionFilter.largest_object(),
                                     timeout=10)
        assert [o async for o in sub] == []
        assert sub.done is not None and sub.done.status_code == PublishDoneCode.TRACK_ENDED
        assert len(ended) == 1 and 0.2 <= ended[0] < 0.3 + settings.publish_done_grace
    finally:
        await client.aclose()
        await server.aclose()
