"""MoqtSession14 (draft-14) over in-memory QUIC connections: same events as draft-18."""

from __future__ import annotations

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d14 import data as d14data
from kvsp_moq.moqt.d14 import messages as d14
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode, SessionCloseCode
from kvsp_moq.moqt.wire import ObjectStatus

from .pair import SessionPair

NS = (b"kvsp", b"c" * 32, b"s" * 16)

pytestmark = pytest.mark.usefixtures("pair_engine")


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of(events, kind)
    assert len(found) == 1, events
    return found[0]


def closed_with(events, code):
    """The one SessionTerminated among `events`, checked for its code."""
    terminated = one(events, ev.SessionTerminated)
    assert terminated.error_code == code, terminated
    return terminated


@pytest.fixture
def pair() -> SessionPair:
    p = SessionPair(draft=14, client_kwargs={"setup": m.Setup(path="/relay", authority="localhost:4433")})
    assert one(p.take("server"), ev.SetupCompleted).setup.path == "/relay"
    assert one(p.take("client"), ev.SetupCompleted).setup.implementation
    return p


def subscribed(pair: SessionPair, **ok) -> tuple[int, int]:
    rid = pair.client.subscribe(NS, b"t", m.Parameters(forward=True))
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived).request_id == rid
    alias = pair.server.subscribe_ok(rid, **ok)
    pair.exchange()
    assert one(pair.take("client"), ev.SubscribeAccepted).track_alias == alias
    return rid, alias


# -- setup ----------------------------------------------------------------


def test_setup_negotiates_the_first_common_version():
    later = d14.draft_version(15)
    p = SessionPair(
        draft=14, client_kwargs={"versions": (later, d14.VERSION)},
        server_kwargs={"versions": (d14.VERSION,)},
    )
    assert one(p.take("client"), ev.SetupCompleted)
    assert one(p.take("server"), ev.SetupCompleted)
    assert p.client.version == p.server.version == d14.VERSION
    # The control stream is the client's first bidirectional stream.
    assert p.client._control_stream_id == p.server._control_stream_id == 0


def test_server_without_the_offered_version_closes_with_version_negotiation_failed():
    p = SessionPair(draft=14, server_kwargs={"versions": (d14.draft_version(15),)})
    terminated = closed_with(p.take("server"), SessionCloseCode.VERSION_NEGOTIATION_FAILED)
    assert terminated.local and "0xff00000e" in terminated.reason
    p.advance(1.0)
    assert not closed_with(p.take("client"), SessionCloseCode.VERSION_NEGOTIATION_FAILED).local
    assert p.client.peer_setup is None


def test_requests_before_setup_are_sent_once_setup_is_done():
    early: list[int] = []
    p = SessionPair(draft=14, on_client=lambda session: early.append(session.subscribe(NS, b"early")))
    assert early == [0]
    assert one(p.take("client"), ev.SetupCompleted)
    assert one(p.take("server"), ev.SubscribeReceived).request_id == 0


# -- subscriptions --------------------------------------------------------


def test_subscribe_objects_on_subgroup_streams_and_publish_done(pair):
    rid, alias = subscribed(pair, largest=wire.Location(0, 2), track_properties=((0x0E, 7),))
    sid = pair.server.open_subgroup(rid, 0, 0, publisher_priority=None)
    for object_id in range(3):
        pair.server.write_object(sid, object_id, bytes([object_id]) * 5000)
    pair.server.write_object_status(sid, 3, ObjectStatus.END_OF_GROUP)
    sid2 = pair.server.open_subgroup(rid, 1, 5, has_properties=True)
    pair.server.write_object(sid2, 0, b"x", properties=((0x3C, 1),))
    pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED, "bye")
    pair.exchange()
    events = pair.take("client")
    opened = of(events, ev.SubgroupStreamOpened)
    assert sorted((o.header.group_id, o.header.subgroup_id) for o in opened) == [(0, 0), (1, 5)]
    objects = sorted(of(events, ev.ObjectReceived), key=lambda o: (o.group_id, o.object_id))
    assert [(o.group_id, o.object_id, o.status) for o in objects] == [
        (0, 0, ObjectStatus.NORMAL), (0, 1, ObjectStatus.NORMAL), (0, 2, ObjectStatus.NORMAL),
        (0, 3, ObjectStatus.END_OF_GROUP), (1, 0, ObjectStatus.NORMAL),
    ]
    assert objects[1].payload == b"\x01" * 5000 and objects[1].track_alias == alias
    assert objects[0].publisher_priority == 7  # the track's default, carried in the header
    assert objects[4].properties == ((0x3C, 1),) and objects[4].subgroup_id == 5
    done = one(events, ev.PublishDoneReceived)
    assert (done.request_id, done.status_code, done.stream_count, done.reason) == (
        rid, PublishDoneCode.TRACK_ENDED, 2, "bye")
    assert len(of(events, ev.DataStreamEnded)) == 2
    assert rid not in pair.client._requests and rid not in pair.server._requests


def test_objects_arriving_before_subscribe_ok_are_held_for_their_alias(pair):
    rid = pair.client.subscribe(NS, b"t")
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived)
    writer = d14data.SubgroupWriter(d14data.SubgroupHeader(0, 3))
    sid = pair.server_quic.get_next_available_stream_id(is_unidirectional=True)
    pair.server_quic.send_stream_data(sid, writer.header_bytes() + writer.object_header(0, 2) + b"hi", end_stream=True)
    pair.exchange()
    assert pair.take("client") == []
    pair.server.subscribe_ok(rid, track_alias=0)
    pair.exchange()
    events = pair.take("client")
    assert [type(e) for e in events] == [
        ev.SubscribeAccepted, ev.SubgroupStreamOpened, ev.ObjectReceived, ev.DataStreamEnded]
    assert (events[2].group_id, events[2].payload) == (3, b"hi")


def test_subscribe_error_is_a_request_rejected_with_the_draft18_code(pair):
    rid = pair.client.subscribe(NS, b"missing")
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived)
    pair.server.request_error(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code, rejected.reason) == (
        rid, RequestErrorCode.DOES_NOT_EXIST, "no such track")


def test_subscribe_fields_travel_as_draft14_fixed_fields(pair):
    flt = wire.SubscriptionFilter.absolute_range(3, 1, 9)
    pair.client.subscribe(NS, b"t", m.Parameters(subscriber_priority=9, forward=False, subscription_filter=flt,
                                                 group_order=wire.GroupOrder.DESCENDING))
    pair.exchange()
    p = one(pair.take("server"), ev.SubscribeReceived).parameters
    assert (p.subscriber_priority, p.forward, p.subscription_filter, p.group_order) == (
        9, False, flt, wire.GroupOrder.DESCENDING)


def test_unsubscribe_cancels_the_publisher_side(pair):
    rid, _ = subscribed(pair)
    sid = pair.server.open_subgroup(rid, 0)
    pair.server.write_object(sid, 0, b"a")
    pair.exchange()
    assert one(pair.take("client"), ev.ObjectReceived)
    pair.client.cancel_request(rid)
    pair.exchange()
    cancelled = one(pair.take("server"), ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (rid, False)
    assert pair.server.data_stream_request(sid) is None
    assert rid not in pair.server._requests


def test_subscribe_update_is_reported_accepted_and_received(pair):
    rid, _ = subscribed(pair)
    update_id = pair.client.request_update(rid, m.Parameters(forward=False, subscriber_priority=3))
    assert one(pair.client.take_events(), ev.RequestAccepted).request_id == update_id
    pair.exchange()
    received = one(pair.take("server"), ev.RequestUpdateReceived)
    assert (received.request_id, received.existing_request_id) == (update_id, rid)
    assert (received.parameters.forward, received.parameters.subscriber_priority) == (False, 3)
    pair.server.request_ok(update_id)  # nothing on the wire in draft-14


def test_objects_as_datagrams(pair):
    rid, alias = subscribed(pair)
    pair.server.send_datagram(rid, 4, 0, b"dgram", end_of_group=True)
    pair.server.send_datagram(rid, 4, 1, status=ObjectStatus.END_OF_TRACK)
    pair.exchange()
    objects = of(pair.take("client"), ev.ObjectReceived)
    assert [(o.group_id, o.object_id, o.payload, o.status, o.stream_id) for o in objects] == [
        (4, 0, b"dgram", ObjectStatus.NORMAL, None), (4, 1, b"", ObjectStatus.END_OF_TRACK, None)]
    assert objects[0].end_of_group


def test_publish_and_publish_ok(pair):
    rid = pair.server.publish(NS, b"pushed", parameters=m.Parameters(largest_object=wire.Location(1, 0)))
    pair.exchange()
    received = one(pair.take("client"), ev.PublishReceived)
    assert (received.request_id, received.track_name, received.parameters.largest_object) == (
        rid, b"pushed", wire.Location(1, 0))
    pair.client.request_ok(rid, m.Parameters(forward=True))
    pair.exchange()
    assert one(pair.take("server"), ev.RequestAccepted).request_id == rid
    sid = pair.server.open_subgroup(rid, 1)
    pair.server.write_object(sid, 0, b"p", end_stream=True)
    pair.exchange()
    assert one(pair.take("client"), ev.ObjectReceived).payload == b"p"


def test_subscriber_unsubscribes_from_a_publish(pair):
    rid = pair.server.publish(NS, b"pushed")
    pair.exchange()
    assert one(pair.take("client"), ev.PublishReceived)
    pair.client.request_ok(rid)
    pair.exchange()
    assert one(pair.take("server"), ev.RequestAccepted)
    pair.client.cancel_request(rid)
    pair.exchange()
    cancelled = one(pair.take("server"), ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (rid, True)


# -- fetch ------------------------------------------------------------------


def test_standalone_fetch(pair):
    rid = pair.client.fetch(NS, b"t", wire.Location(1, 0), wire.Location(2, 0))
    pair.exchange()
    received = one(pair.take("server"), ev.FetchReceived)
    assert (received.start, received.end, received.joining_request_id) == (
        wire.Location(1, 0), wire.Location(2, 0), None)
    pair.server.fetch_ok(rid, wire.Location(1, 3))
    sid = pair.server.open_fetch_stream(rid)
    for object_id in range(3):
        pair.server.write_fetch_object(sid, 1, object_id, b"f" * (object_id + 1), publisher_priority=5)
    pair.server.close_data_stream(sid)
    pair.exchange()
    events = pair.take("client")
    accepted = one(events, ev.FetchAccepted)
    assert (accepted.end_location, accepted.end_of_track) == (wire.Location(1, 3), False)
    objects = of(events, ev.FetchObjectReceived)
    assert [(o.group_id, o.object_id, o.payload, o.publisher_priority) for o in objects] == [
        (1, 0, b"f", 5), (1, 1, b"ff", 5), (1, 2, b"fff", 5)]
    assert one(events, ev.DataStreamEnded).fetch
    assert rid not in pair.client._requests and rid not in pair.server._requests


def test_fetch_with_end_before_start_is_rejected(pair):
    rid = pair.client.fetch(NS, b"t", wire.Location(5, 0), wire.Location(2, 1))
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, RequestErrorCode.INVALID_RANGE)
    assert pair.take("server") == []


def test_joining_fetch(pair):
    sub, _ = subscribed(pair, largest=wire.Location(5, 3))
    rid = pair.client.joining_fetch(sub, 2)
    pair.exchange()
    received = one(pair.take("server"), ev.FetchReceived)
    assert (received.fetch_type, received.namespace, received.joining_request_id) == (
        wire.FetchType.RELATIVE_JOINING, NS, sub)
    assert (received.start, received.end) == (wire.Location(3, 0), wire.Location(5, 4))
    pair.server.fetch_ok(rid, received.end)
    pair.exchange()
    assert one(pair.take("client"), ev.FetchAccepted).request_id == rid


def test_joining_fetch_waits_for_its_subscribe_ok(pair):
    sub = pair.client.subscribe(NS, b"t")
    rid = pair.client.joining_fetch(sub, 1, relative=False)
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived)
    pair.server.subscribe_ok(sub, largest=wire.Location(4, 0))
    received = one(pair.server.take_events(), ev.FetchReceived)
    assert (received.request_id, received.start, received.end) == (rid, wire.Location(1, 0), wire.Location(4, 1))


def test_joining_fetch_of_an_unknown_subscription_is_rejected(pair):
    rid = pair.client.joining_fetch(40, 1)
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, RequestErrorCode.INVALID_JOINING_REQUEST_ID)


def test_fetch_cancel(pair):
    rid = pair.client.fetch(NS, b"t", wire.Location(0, 0), wire.Location(9, 0))
    pair.exchange()
    assert one(pair.take("server"), ev.FetchReceived)
    pair.server.fetch_ok(rid, wire.Location(9, 0))
    sid = pair.server.open_fetch_stream(rid)
    pair.server.write_fetch_object(sid, 0, 0, b"first")
    pair.exchange()
    assert one(pair.take("client"), ev.FetchObjectReceived)
    pair.client.cancel_request(rid)
    pair.exchange()
    cancelled = one(pair.take("server"), ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (rid, False)
    assert pair.server.data_stream_request(sid) is None


# -- namespaces ---------------------------------------------------------------


def test_publish_namespace_ok_and_done(pair):
    rid = pair.client.publish_namespace(NS)
    pair.exchange()
    received = one(pair.take("server"), ev.PublishNamespaceReceived)
    assert (received.request_id, received.namespace) == (rid, NS)
    pair.server.request_ok(rid)
    pair.exchange()
    assert one(pair.take("client"), ev.RequestAccepted).request_id == rid
    pair.client.cancel_request(rid)  # PUBLISH_NAMESPACE_DONE
    pair.exchange()
    cancelled = one(pair.take("server"), ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (rid, False)


def test_publish_namespace_cancel_reaches_the_publisher(pair):
    rid = pair.client.publish_namespace(NS)
    pair.exchange()
    pair.take("server")
    pair.server.request_ok(rid)
    pair.server.cancel_request(rid)  # PUBLISH_NAMESPACE_CANCEL
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.RequestAccepted)
    cancelled = one(events, ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (rid, True)


def test_publish_namespace_error(pair):
    rid = pair.client.publish_namespace(NS)
    pair.exchange()
    pair.take("server")
    pair.server.request_error(rid, RequestErrorCode.UNINTERESTED, "no")
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, RequestErrorCode.UNINTERESTED)


def test_subscribe_namespace_announces_namespaces(pair):
    prefix = NS[:1]
    rid = pair.client.subscribe_namespace(prefix)
    pair.exchange()
    events = pair.take("server")
    received = one(events, ev.SubscribeNamespaceReceived)
    assert (received.request_id, received.namespace_prefix) == (rid, prefix)
    tracks = one(events, ev.SubscribeTracksReceived)  # the PUBLISH half of draft-14's request
    pair.server.request_ok(tracks.request_id)
    pair.server.request_ok(rid)
    pair.server.namespace(rid, NS[1:])
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.RequestAccepted).request_id == rid
    announced = one(events, ev.NamespaceReceived)
    assert (announced.request_id, announced.namespace_suffix, announced.namespace) == (rid, NS[1:], NS)
    assert pair.take("server") == []  # PUBLISH_NAMESPACE_OK was sent by the session itself
    pair.server.namespace_done(rid, NS[1:])
    pair.exchange()
    done = one(pair.take("client"), ev.NamespaceDoneReceived)
    assert (done.request_id, done.namespace) == (rid, NS)
    pair.client.cancel_request(rid)  # UNSUBSCRIBE_NAMESPACE
    pair.exchange()
    cancelled = of(pair.take("server"), ev.RequestCancelled)
    assert [(c.request_id, c.local_request) for c in cancelled] == [(rid, False), (tracks.request_id, False)]
    assert not pair.server._requests and not pair.client._requests


def test_subscribe_namespace_also_asks_for_matching_tracks(pair):
    """Draft-14's SUBSCRIBE_NAMESPACE is draft-18's SUBSCRIBE_NAMESPACE plus SUBSCRIBE_TRACKS:
    the TRACKS half has an ID that is never on the wire, its answer sends nothing, and the
    PUBLISHes made for it reach the subscriber."""
    rid = pair.client.subscribe_namespace(NS[:1])
    pair.exchange()
    events = pair.take("server")
    tracks = one(events, ev.SubscribeTracksReceived)
    assert tracks.namespace_prefix == NS[:1] and tracks.request_id >= 1 << 62
    pair.server.request_ok(tracks.request_id)
    pair.server.request_ok(rid)
    pair.server.publish(NS, b"t")
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.RequestAccepted).request_id == rid
    published = one(events, ev.PublishReceived)
    assert (published.namespace, published.track_name) == (NS, b"t")
    # The application may end the TRACKS half alone; nothing goes on the wire for it.
    pair.server.cancel_request(tracks.request_id)
    pair.exchange()
    assert pair.take("client") == []


def test_refused_subscribe_namespace_ends_its_tracks_half(pair):
    rid = pair.client.subscribe_namespace(NS[:1])
    pair.exchange()
    tracks = one(pair.take("server"), ev.SubscribeTracksReceived)
    pair.server.request_error(tracks.request_id, RequestErrorCode.UNAUTHORIZED)  # sends nothing
    pair.exchange()
    assert pair.take("client") == []
    pair.server.request_error(rid, RequestErrorCode.UNAUTHORIZED)
    pair.exchange()
    assert one(pair.take("client"), ev.RequestRejected).error_code == RequestErrorCode.UNAUTHORIZED
    assert not pair.server._requests

    rid = pair.client.subscribe_namespace(NS[:2])
    pair.exchange()
    tracks = one(pair.take("server"), ev.SubscribeTracksReceived)
    pair.server.request_error(rid, RequestErrorCode.PREFIX_OVERLAP)
    cancelled = one(pair.server.take_events(), ev.RequestCancelled)
    assert cancelled.request_id == tracks.request_id and not pair.server._requests


def test_subscribe_namespace_error(pair):
    rid = pair.client.subscribe_namespace(NS[:1])
    pair.exchange()
    pair.take("server")
    pair.server.request_error(rid, RequestErrorCode.PREFIX_OVERLAP)
    pair.exchange()
    assert one(pair.take("client"), ev.RequestRejected).error_code == RequestErrorCode.PREFIX_OVERLAP


def test_track_status(pair):
    rid = pair.client.track_status(NS, b"t")
    pair.exchange()
    assert one(pair.take("server"), ev.TrackStatusReceived).request_id == rid
    pair.server.request_ok(rid, m.Parameters(largest_object=wire.Location(7, 2)))
    pair.exchange()
    accepted = one(pair.take("client"), ev.RequestAccepted)
    assert accepted.parameters.largest_object == wire.Location(7, 2)


def test_goaway(pair):
    pair.server.goaway("https://elsewhere.example/moq")
    pair.exchange()
    goaway = one(pair.take("client"), ev.GoawayReceived)
    assert (goaway.new_session_uri, goaway.timeout_ms) == ("https://elsewhere.example/moq", 0)
    pair.client.subscribe(NS, b"late")
    pair.exchange()
    assert one(pair.take("client"), ev.RequestRejected)  # refused after our GOAWAY


# -- request ID credit ------------------------------------------------------


def test_requests_beyond_the_peer_grant_wait_for_max_request_id():
    p = SessionPair(draft=14, server_kwargs={"max_requests": 2})
    p.take("client"), p.take("server")
    ids = [p.client.subscribe(NS, bytes([i])) for i in range(3)]
    assert ids == [0, 2, 4]
    p.exchange()
    assert [e.request_id for e in of(p.take("server"), ev.SubscribeReceived)] == [0, 2]
    assert p.client._credit.blocked_reported == 4  # REQUESTS_BLOCKED was sent for Maximum Request ID 4
    p.server.request_error(0, RequestErrorCode.DOES_NOT_EXIST)  # frees one request
    p.exchange()
    assert one(p.take("server"), ev.SubscribeReceived).request_id == 4
    assert one(p.take("client"), ev.RequestRejected).request_id == 0


def test_cancelling_a_queued_request_sends_it_then_its_cancellation():
    p = SessionPair(draft=14, server_kwargs={"max_requests": 1})
    p.take("client"), p.take("server")
    first = p.client.subscribe(NS, b"1")
    second = p.client.subscribe(NS, b"2")
    p.client.cancel_request(second)
    p.exchange()
    assert one(p.take("server"), ev.SubscribeReceived).request_id == first
    p.server.request_error(first, RequestErrorCode.DOES_NOT_EXIST)
    p.exchange()
    events = p.take("server")
    assert [type(e) for e in events] == [ev.SubscribeReceived, ev.RequestCancelled]
    assert events[0].request_id == events[1].request_id == second


def test_a_peer_ignoring_the_grant_is_closed_with_too_many_requests():
    p = SessionPair(draft=14, server_kwargs={"max_requests": 2})
    p.take("client"), p.take("server")
    p.raw_control(*(d14.Subscribe(rid, NS, b"t") for rid in (0, 2, 4)))
    events = p.take("server")
    assert len(of(events, ev.SubscribeReceived)) == 2
    closed_with(events, 0x7)  # TOO_MANY_REQUESTS
    p.advance(1.0)
    closed_with(p.take("client"), 0x7)


def test_an_unexpected_request_id_closes_with_invalid_request_id(pair):
    pair.raw_control(d14.Subscribe(6, NS, b"t"))
    closed_with(pair.take("server"), SessionCloseCode.INVALID_REQUEST_ID)


# -- malformed input --------------------------------------------------------


def test_malformed_control_message_closes_with_protocol_violation(pair):
    assert d14.Unsubscribe(0).encode() == b"\x0a\x00\x01\x00"
    bad = b"\x0a\x00\x02\x00\x00"  # UNSUBSCRIBE whose Length exceeds its one field
    pair.client_quic.send_stream_data(pair.client._control_stream_id, bad)
    pair.exchange()
    terminated = closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)
    assert terminated.local and "UNSUBSCRIBE" in terminated.reason
    pair.advance(1.0)
    assert not closed_with(pair.take("client"), SessionCloseCode.PROTOCOL_VIOLATION).local


def test_unknown_control_message_closes_with_protocol_violation(pair):
    pair.client_quic.send_stream_data(pair.client._control_stream_id, b"\x3f\x00\x00")
    pair.exchange()
    assert "unknown message type" in closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION).reason


def test_second_bidirectional_stream_closes_with_protocol_violation(pair):
    sid = pair.client_quic.get_next_available_stream_id(is_unidirectional=False)
    pair.client_quic.send_stream_data(sid, d14.Unsubscribe(0).encode())
    pair.exchange()
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_client_setup_twice_is_a_protocol_violation(pair):
    pair.raw_control(d14.ClientSetup())
    assert "CLIENT_SETUP" in closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION).reason


def test_a_request_draft_14_cannot_encode_is_refused_without_spending_its_request_id(pair):
    """Draft-14 carries Locations as QUIC varints (up to 2^62-1); a FETCH ending at 2^62 is
    refused locally. Its Request ID must not be spent: the peer would see the next request
    skip one and close the session (INVALID_REQUEST_ID)."""
    with pytest.raises(ValueError):
        pair.client.fetch(NS, b"t", wire.Location(0, 0), wire.Location(0, 1 << 62))
    rid = pair.client.subscribe(NS, b"t")
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived).request_id == rid
    assert not pair.server.closed and not pair.client.closed
