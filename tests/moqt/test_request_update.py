"""REQUEST_UPDATE: the session's checks (sans-I/O) and the asyncio API over real aioquic
sessions on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.errors import (
    InvalidRange,
    PublishDoneCode,
    PublishDoneError,
    RequestErrorCode,
    SessionCloseCode,
    StreamClosed,
    Unauthorized,
)
from kvsp_moq.moqt.quic import IncomingUpdate
from kvsp_moq.moqt.wire import Location, SubscriptionFilter

from .pair import SessionPair
from .test_quic import NS as TEXT_NS
from .test_quic import STEP, collect, dial, start

NS = wire.namespace_of(TEXT_NS)


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of(events, kind)
    assert len(found) == 1, events
    return found[0]


@pytest.fixture
def pair(pair_engine):
    return SessionPair(engine=pair_engine)


def _subscribed(pair: SessionPair, parameters: m.Parameters = m.Parameters()) -> int:
    rid = pair.client.subscribe(NS, b"1", parameters)
    pair.exchange()
    pair.take("server")
    pair.server.subscribe_ok(rid, largest=Location(3, 1))
    pair.exchange()
    pair.take("client")
    return rid


# -- sans-I/O ----------------------------------------------------------------


def test_a_subscription_parameter_on_a_fetch_update_is_a_protocol_violation(pair):
    rid = pair.client.fetch(NS, b"1", Location(0, 0), Location(1, 0), m.Parameters())
    pair.exchange()
    pair.take("server")
    # The API refuses to send it...
    with pytest.raises(ValueError):
        pair.client.request_update(rid, m.Parameters(forward=False))
    # ...and a peer that does closes the session with PROTOCOL_VIOLATION.
    stream_id = pair.client._requests[rid].stream_id
    raw = m.RequestUpdate(pair.client._next_request_id, m.Parameters(forward=False)).encode(18)
    pair.client_quic.send_stream_data(stream_id, raw)
    pair.exchange()
    terminated = one(pair.take("server"), ev.SessionTerminated)
    assert terminated.error_code == SessionCloseCode.PROTOCOL_VIOLATION


def test_a_namespace_prefix_on_a_subscription_update_is_a_protocol_violation(pair):
    rid = _subscribed(pair)
    stream_id = pair.client._requests[rid].stream_id
    raw = m.RequestUpdate(pair.client._next_request_id, m.Parameters(track_namespace_prefix=(b"x",))).encode(18)
    pair.client_quic.send_stream_data(stream_id, raw)
    pair.exchange()
    assert one(pair.take("server"), ev.SessionTerminated).error_code == SessionCloseCode.PROTOCOL_VIOLATION


def test_an_accepted_update_changes_the_request_and_resuming_sets_the_joining_location(pair):
    rid = _subscribed(pair, m.Parameters(forward=False))
    update = pair.client.request_update(rid, m.Parameters(forward=True, subscriber_priority=7))
    pair.exchange()
    received = one(pair.take("server"), ev.RequestUpdateReceived)
    assert (received.request_id, received.existing_request_id) == (update, rid)
    pair.server.request_ok(update, m.Parameters(largest_object=Location(5, 2)))
    pair.exchange()
    assert one(pair.take("client"), ev.RequestAccepted).request_id == update
    for side in (pair.server, pair.client):
        request = side._requests[rid]
        assert request.parameters.forward is True and request.parameters.subscriber_priority == 7
        assert request.largest_at_ok == Location(5, 2)  # the Joining Location
    assert not pair.server._streams.update_parameters and not pair.client._streams.update_parameters


def test_a_refused_update_leaves_the_request_unchanged(pair):
    rid = _subscribed(pair)
    update = pair.client.request_update(rid, m.Parameters(subscriber_priority=1))
    pair.exchange()
    pair.take("server")
    pair.server.request_error(update, RequestErrorCode.INVALID_RANGE, "no")
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.RequestRejected).error_code == RequestErrorCode.INVALID_RANGE
    assert one(events, ev.PublishDoneReceived).status_code == PublishDoneCode.UPDATE_FAILED
    assert not pair.server._streams.update_parameters and not pair.client._streams.update_parameters


# -- over QUIC ---------------------------------------------------------------


async def test_subscriber_pauses_and_resumes_a_subscription():
    published = asyncio.get_running_loop().create_future()
    resumed = asyncio.Event()

    async def on_subscribe(request):
        outgoing = request.accept()
        published.set_result(outgoing)
        sender = outgoing.open_subgroup(0)
        await sender.send(0, b"first")
        await resumed.wait()
        assert outgoing.forward
        await sender.send(1, b"second")
        sender.close()
        await outgoing.finish()

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        outgoing = await asyncio.wait_for(published, STEP)
        first = await asyncio.wait_for(subscription.__anext__(), STEP)
        assert first.payload == b"first"
        answer = await subscription.update(forward=False, subscriber_priority=3, timeout=STEP)
        assert answer.largest_object == Location(0, 0)  # the largest Location sent
        assert not outgoing.forward and outgoing.parameters.subscriber_priority == 3
        await subscription.update(forward=True, object_delivery_timeout=5000, timeout=STEP)
        assert outgoing.forward and outgoing.object_delivery_timeout == 5000
        assert subscription.parameters.subscriber_priority == 3
        resumed.set()
        rest = await collect(subscription)
        assert [o.payload for o in rest] == [b"second"]
    finally:
        await client.aclose()
        await server.aclose()


async def test_objects_are_held_back_while_the_forward_state_is_0():
    """draft-18 "Subscriptions": the publisher does not send objects while Forward is 0;
    SubgroupSender.send() waits, datagrams are dropped, and sending resumes at Forward 1."""
    published = asyncio.get_running_loop().create_future()
    sent: list[int] = []
    datagram_sent: list[bool] = []

    async def on_subscribe(request):
        outgoing = request.accept()
        published.set_result(outgoing)
        sender = outgoing.open_subgroup(0)
        datagram_sent.append(outgoing.send_datagram(1, 0, b"datagram"))
        for object_id in range(2):
            await sender.send(object_id, b"object %d" % object_id)
            sent.append(object_id)
        sender.close()
        await outgoing.finish()

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1", forward=False), STEP)
        outgoing = await asyncio.wait_for(published, STEP)
        await asyncio.sleep(0.2)
        assert not outgoing.forward and sent == [] and datagram_sent == [False]
        await subscription.update(forward=True, timeout=STEP)
        rest = await collect(subscription)
        assert [o.payload for o in rest] == [b"object 0", b"object 1"] and sent == [0, 1]
    finally:
        await client.aclose()
        await server.aclose()


async def test_a_held_back_send_ends_with_the_subscription():
    outcome = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        outgoing = request.accept()
        sender = outgoing.open_subgroup(0)
        try:
            await sender.send(0, b"never")
        except Exception as e:  # reported to the test
            outcome.set_result(e)
        else:
            outcome.set_result(None)

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1", forward=False), STEP)
        await asyncio.sleep(0.1)
        await subscription.aclose()
        error = await asyncio.wait_for(outcome, STEP)
        assert isinstance(error, StreamClosed)
    finally:
        await client.aclose()
        await server.aclose()


async def test_update_to_an_end_group_already_published_fails_the_subscription():
    async def on_subscribe(request):
        request.accept(largest=(4, 0))
        await asyncio.sleep(3600)  # keeps the subscription open until the update

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        with pytest.raises(InvalidRange):
            await subscription.update(subscription_filter=SubscriptionFilter.absolute_range(0, 0, 2), timeout=STEP)
        with pytest.raises(PublishDoneError) as e:
            await collect(subscription)
        assert e.value.error_code == PublishDoneCode.UPDATE_FAILED
    finally:
        await client.aclose()
        await server.aclose()


async def test_update_handler_sees_the_update_and_may_refuse_it():
    seen: list[IncomingUpdate] = []

    async def on_subscribe(request):
        outgoing = request.accept()

        def on_update(update: IncomingUpdate) -> None:
            seen.append(update)
            if update.authorization != [b"good"]:
                raise Unauthorized("bad token")
            update.accept(expires=60_000)

        outgoing.on_update = on_update
        await asyncio.sleep(3600)

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        subscription = await asyncio.wait_for(client.subscribe(NS, "1"), STEP)
        answer = await subscription.update(authorization=b"good", timeout=STEP)
        assert answer.expires == 60_000 and subscription.expires == 60_000
        with pytest.raises(Unauthorized):
            await subscription.update(authorization=b"bad", timeout=STEP)
        assert [u.authorization for u in seen] == [[b"good"], [b"bad"]]
        with pytest.raises(PublishDoneError):
            await collect(subscription)
    finally:
        await client.aclose()
        await server.aclose()


async def test_update_sent_while_the_subscribe_is_pending_is_answered_after_it():
    gate = asyncio.Event()
    accepted = asyncio.get_running_loop().create_future()

    async def on_subscribe(request):
        await gate.wait()
        accepted.set_result(request.accept())
        await asyncio.sleep(3600)

    server = await start({"subscribe": on_subscribe})
    client = await dial(server)
    try:
        session = client.live_session()
        rid = session.subscribe(wire.namespace_of(NS), b"1", m.Parameters())
        future = client.begin_request(rid)
        update_id = session.request_update(rid, m.Parameters(subscriber_priority=9))
        update_answer = client.begin_request(update_id)
        client.transmit()
        await asyncio.sleep(0.2)
        assert not future.done() and not update_answer.done()
        gate.set()
        assert isinstance(await asyncio.wait_for(future, STEP), ev.SubscribeAccepted)
        assert isinstance(await asyncio.wait_for(update_answer, STEP), ev.RequestAccepted)
        outgoing = await asyncio.wait_for(accepted, STEP)
        assert outgoing.parameters.subscriber_priority == 9
    finally:
        await client.aclose()
        await server.aclose()
