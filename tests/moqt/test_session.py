"""MoqtSession over in-memory QUIC connections (no sockets, no event loop)."""

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.d18.data import FetchStreamWriter, SubgroupHeader, SubgroupWriter
from kvsp_moq.moqt.errors import (
    PublishDoneCode,
    RequestErrorCode,
    SessionCloseCode,
    StreamClosed,
)
from kvsp_moq.moqt.varint import encode_vi64
from kvsp_moq.moqt.wire import ObjectStatus

from .pair import SessionPair

pytestmark = pytest.mark.usefixtures("pair_engine")

NS = (b"kvsp", b"c" * 32, b"s" * 16)


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def one(events, kind):
    found = of(events, kind)
    assert len(found) == 1, events
    return found[0]


@pytest.fixture
def pair() -> SessionPair:
    p = SessionPair(client_setup=m.Setup(path="/relay", authority="localhost:4433"))
    assert one(p.take("server"), ev.SetupCompleted).setup.path == "/relay"
    assert one(p.take("client"), ev.SetupCompleted).setup.implementation
    return p


def closed_with(events, code):
    terminated = one(events, ev.SessionTerminated)
    assert terminated.error_code == code, terminated
    return terminated


def test_request_ids_are_even_from_the_client_and_odd_from_the_server(pair):
    assert [pair.client.subscribe(NS, b"1") for _ in range(3)] == [0, 2, 4]
    assert [pair.server.subscribe(NS, b"1") for _ in range(2)] == [1, 3]
    pair.exchange()
    assert [e.request_id for e in of(pair.take("server"), ev.SubscribeReceived)] == [0, 2, 4]
    assert [e.request_id for e in of(pair.take("client"), ev.SubscribeReceived)] == [1, 3]


def test_subscribe_objects_and_publish_done(pair):
    rid = pair.client.subscribe(NS, b"1", m.Parameters(forward=True))
    pair.exchange()
    request = one(pair.take("server"), ev.SubscribeReceived)
    assert (request.request_id, request.namespace, request.parameters.forward) == (rid, NS, True)
    alias = pair.server.subscribe_ok(rid, largest=wire.Location(0, 2), track_properties=((0x0E, 7),))
    sid = pair.server.open_subgroup(rid, 0, 0, publisher_priority=None)
    for object_id in range(3):
        pair.server.write_object(sid, object_id, bytes([object_id]) * 5000)
    pair.server.write_object_status(sid, 3, ObjectStatus.END_OF_GROUP)
    pair.server.publish_done(rid, PublishDoneCode.TRACK_ENDED)
    pair.exchange()
    events = pair.take("client")
    accepted = one(events, ev.SubscribeAccepted)
    assert (accepted.track_alias, accepted.parameters.largest_object) == (alias, wire.Location(0, 2))
    objects = of(events, ev.ObjectReceived)
    assert [(o.object_id, o.payload[:1], o.status) for o in objects] == [
        (0, b"\x00", ObjectStatus.NORMAL),
        (1, b"\x01", ObjectStatus.NORMAL),
        (2, b"\x02", ObjectStatus.NORMAL),
        (3, b"", ObjectStatus.END_OF_GROUP),
    ]
    assert all(o.publisher_priority == 7 for o in objects)  # inherited from the track property
    done = one(events, ev.PublishDoneReceived)
    assert (done.status_code, done.stream_count) == (PublishDoneCode.TRACK_ENDED, 1)
    assert one(events, ev.DataStreamEnded).reset is False
    assert pair.client._requests == {} and pair.server._requests == {}


@pytest.mark.parametrize(("draft", "sent"), [(18, PublishDoneCode.SUBSCRIPTION_ENDED),
                                             (20, PublishDoneCode.TRACK_ENDED),
                                             (22, PublishDoneCode.TRACK_ENDED)])
def test_subscription_ended_is_track_ended_from_draft_20(draft, sent):
    """Draft-20 removed PUBLISH_DONE SUBSCRIPTION_ENDED; TRACK_ENDED goes in its place."""
    pair = SessionPair(draft=draft)
    pair.take("client")
    pair.take("server")
    rid = pair.client.subscribe(NS, b"1", m.Parameters(forward=True))
    pair.exchange()
    one(pair.take("server"), ev.SubscribeReceived)
    pair.server.subscribe_ok(rid)
    pair.server.publish_done(rid, PublishDoneCode.SUBSCRIPTION_ENDED)
    pair.exchange()
    assert one(pair.take("client"), ev.PublishDoneReceived).status_code == sent


def test_objects_arriving_before_subscribe_ok_are_held_until_the_alias_is_known(pair):
    rid = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    # Deliver the data stream first: write SUBSCRIBE_OK bytes only after the objects.
    alias = pair.server._allocate_alias(None)
    request = pair.server._requests[rid]
    request.answered = request.accepted = True
    request.track_alias = alias
    pair.server._aliases_out[alias] = request
    sid = pair.server.open_subgroup(rid, 0)
    pair.server.write_object(sid, 0, b"early", end_stream=True)
    pair.exchange()
    assert of(pair.take("client"), ev.ObjectReceived) == []
    pair.server._quic.send_stream_data(request.stream_id, m.SubscribeOk(alias).encode())
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.SubscribeAccepted)
    assert one(events, ev.ObjectReceived).payload == b"early"
    assert one(events, ev.DataStreamEnded).request_id == rid


def test_request_error_closes_the_request(pair):
    rid = pair.client.subscribe(NS, b"missing")
    pair.exchange()
    pair.take("server")
    pair.server.request_error(rid, RequestErrorCode.DOES_NOT_EXIST, "no such track", retry_interval=1)
    pair.exchange()
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code, rejected.reason, rejected.retry_interval) == (
        rid,
        RequestErrorCode.DOES_NOT_EXIST,
        "no such track",
        1,
    )
    assert pair.client._requests == {} and pair.server._requests == {}


def test_standalone_fetch(pair):
    rid = pair.client.fetch(NS, b"1", wire.Location(0, 2), wire.Location(0, 5),
                            m.Parameters(group_order=wire.GroupOrder.DESCENDING))
    pair.exchange()
    request = one(pair.take("server"), ev.FetchReceived)
    assert (request.start, request.end, request.parameters.group_order) == (
        wire.Location(0, 2),
        wire.Location(0, 5),
        wire.GroupOrder.DESCENDING,
    )
    sid = pair.server.open_fetch_stream(rid)
    for object_id in (2, 3, 4):
        pair.server.write_fetch_object(sid, 0, object_id, b"o%d" % object_id)
    pair.server.close_data_stream(sid)
    pair.server.fetch_ok(rid, wire.Location(0, 5))
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.FetchAccepted).end_location == wire.Location(0, 5)
    assert [(o.object_id, o.payload) for o in of(events, ev.FetchObjectReceived)] == [
        (2, b"o2"), (3, b"o3"), (4, b"o4")]
    assert one(events, ev.DataStreamEnded).fetch
    assert pair.client._requests == {} and pair.server._requests == {}


def test_joining_fetch_is_resolved_from_the_subscription(pair):
    sub = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    pair.server.subscribe_ok(sub, largest=wire.Location(7, 3))
    pair.exchange()
    pair.take("client")
    fetch = pair.client.joining_fetch(sub, 2)
    pair.exchange()
    request = one(pair.take("server"), ev.FetchReceived)
    assert (request.fetch_type, request.namespace, request.start, request.end, request.joining_request_id) == (
        wire.FetchType.RELATIVE_JOINING,
        NS,
        wire.Location(5, 0),
        wire.Location(7, 4),
        sub,
    )
    assert request.request_id == fetch


def test_joining_fetch_for_an_unknown_subscription_is_refused(pair):
    pair.client.joining_fetch(40, 1)
    pair.exchange()
    assert of(pair.take("server"), ev.FetchReceived) == []
    assert one(pair.take("client"), ev.RequestRejected).error_code == RequestErrorCode.INVALID_JOINING_REQUEST_ID


def test_publish_namespace_and_namespace_subscription(pair):
    announce = pair.client.publish_namespace(NS[:2])
    watch = pair.client.subscribe_namespace(NS[:1])
    pair.exchange()
    events = pair.take("server")
    assert one(events, ev.PublishNamespaceReceived).namespace == NS[:2]
    assert one(events, ev.SubscribeNamespaceReceived).namespace_prefix == NS[:1]
    pair.server.request_ok(announce)
    pair.server.request_ok(watch)
    pair.server.namespace(watch, NS[1:2])
    pair.server.namespace_done(watch, NS[1:2])
    pair.exchange()
    events = pair.take("client")
    assert [e.request_id for e in of(events, ev.RequestAccepted)] == [announce, watch]
    assert one(events, ev.NamespaceReceived).namespace == NS[:2]
    assert one(events, ev.NamespaceDoneReceived).namespace_suffix == NS[1:2]
    # Withdrawing the namespace cancels its request stream.
    pair.client.cancel_request(announce)
    pair.exchange()
    cancelled = one(pair.take("server"), ev.RequestCancelled)
    assert (cancelled.request_id, cancelled.local_request) == (announce, False)


def test_track_status(pair):
    rid = pair.client.track_status(NS, b"1", m.Parameters(authorization_tokens=(wire.AuthToken.use_value(b"t"),)))
    pair.exchange()
    request = one(pair.take("server"), ev.TrackStatusReceived)
    assert request.authorization_tokens == (wire.AuthToken.use_value(b"t"),)
    pair.server.request_ok(rid, m.Parameters(largest_object=wire.Location(3, 9)), ((0x0E, 4),))
    pair.exchange()
    accepted = one(pair.take("client"), ev.RequestAccepted)
    assert accepted.parameters.largest_object == wire.Location(3, 9)
    assert accepted.track_properties == ((0x0E, 4),)


def test_request_update_answers_in_order(pair):
    rid = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    pair.server.subscribe_ok(rid)
    pair.exchange()
    pair.take("client")
    first = pair.client.request_update(rid, m.Parameters(subscriber_priority=1))
    second = pair.client.request_update(rid, m.Parameters(forward=False))
    pair.exchange()
    updates = of(pair.take("server"), ev.RequestUpdateReceived)
    assert [(u.request_id, u.existing_request_id) for u in updates] == [(first, rid), (second, rid)]
    with pytest.raises(ValueError):
        pair.server.request_ok(second)  # answers go in order
    pair.server.request_ok(first)
    pair.server.request_error(second, RequestErrorCode.NOT_SUPPORTED)
    pair.exchange()
    events = pair.take("client")
    assert one(events, ev.RequestAccepted).request_id == first
    assert one(events, ev.RequestRejected).request_id == second
    # A failed update ends the subscription (section 10.9.1).
    assert one(events, ev.PublishDoneReceived).status_code == PublishDoneCode.UPDATE_FAILED


def test_publish_flow(pair):
    rid = pair.client.publish(NS, b"live", parameters=m.Parameters(forward=True))
    alias = pair.client.track_alias_of(rid)
    sid = pair.client.open_subgroup(rid, 0)  # objects may precede PUBLISH_OK
    pair.client.write_object(sid, 0, b"first", end_stream=True)
    pair.exchange()
    events = pair.take("server")
    offer = one(events, ev.PublishReceived)
    assert (offer.track_alias, offer.track_name) == (alias, b"live")
    assert one(events, ev.ObjectReceived).payload == b"first"
    pair.server.request_ok(rid, m.Parameters(subscriber_priority=3))
    pair.exchange()
    assert one(pair.take("client"), ev.RequestAccepted).parameters.subscriber_priority == 3
    pair.client.publish_done(rid)
    pair.exchange()
    assert one(pair.take("server"), ev.PublishDoneReceived).stream_count == 1


def test_unsubscribe_resets_the_publishers_streams(pair):
    rid = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    pair.server.subscribe_ok(rid)
    sid = pair.server.open_subgroup(rid, 0)
    pair.server.write_object(sid, 0, b"x")
    pair.exchange()
    pair.take("client")
    pair.client.cancel_request(rid)
    pair.exchange()
    assert one(pair.take("server"), ev.RequestCancelled).request_id == rid
    with pytest.raises(StreamClosed):
        pair.server.write_object(sid, 1, b"y")


def test_authorization_token_aliases():
    pair = SessionPair(server_kwargs={"max_auth_token_cache_size": 1000})
    pair.client.subscribe(NS, b"1", m.Parameters(authorization_tokens=(wire.AuthToken.register(5, b"secret"),)))
    pair.client.subscribe(NS, b"2", m.Parameters(authorization_tokens=(wire.AuthToken.use_alias(5),)))
    pair.exchange()
    tokens = [e.authorization_tokens for e in of(pair.take("server"), ev.SubscribeReceived)]
    assert tokens == [(wire.AuthToken.use_value(b"secret"),)] * 2


def test_token_registration_over_the_cache_size_closes_the_session(pair):
    pair.client.subscribe(NS, b"1", m.Parameters(authorization_tokens=(wire.AuthToken.register(1, b"x"),)))
    pair.exchange()
    closed_with(pair.take("server"), SessionCloseCode.AUTH_TOKEN_CACHE_OVERFLOW)


def test_unknown_token_alias_closes_the_session(pair):
    pair.client.subscribe(NS, b"1", m.Parameters(authorization_tokens=(wire.AuthToken.use_alias(9),)))
    pair.exchange()
    closed_with(pair.take("server"), SessionCloseCode.UNKNOWN_AUTH_TOKEN_ALIAS)


def test_goaway(pair):
    pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    pair.server.goaway("moqt://elsewhere:1/x", 500)
    pair.exchange()
    goaway = one(pair.take("client"), ev.GoawayReceived)
    assert (goaway.new_session_uri, goaway.timeout_ms, goaway.last_request_id) == ("moqt://elsewhere:1/x", 500, 2)
    # Requests at or after the GOAWAY's Request ID are refused.
    rid = pair.client.subscribe(NS, b"2")
    pair.exchange()
    assert of(pair.take("server"), ev.SubscribeReceived) == []
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, RequestErrorCode.GOING_AWAY)


# ---------------------------------------------------------------------------
# Malformed input from the peer closes the session.
# ---------------------------------------------------------------------------


def inject_bidi(pair, data: bytes, end_stream: bool = False) -> None:
    sid = pair.client_quic.get_next_available_stream_id(is_unidirectional=False)
    pair.client_quic.send_stream_data(sid, data, end_stream=end_stream)
    pair.exchange()


def inject_uni(pair, data: bytes, end_stream: bool = False) -> None:
    sid = pair.client_quic.get_next_available_stream_id(is_unidirectional=True)
    pair.client_quic.send_stream_data(sid, data, end_stream=end_stream)
    pair.exchange()


def test_garbage_on_a_request_stream_is_a_protocol_violation(pair):
    inject_bidi(pair, b"\x03\x00\x05\xff\xff\xff\xff\xff")
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)
    assert pair.server.closed
    # The client learns it from CONNECTION_CLOSE, reported once draining ends.
    pair.advance(5.0)
    terminated = one(pair.take("client"), ev.SessionTerminated)
    assert terminated.error_code == SessionCloseCode.PROTOCOL_VIOLATION and not terminated.local


def test_request_stream_must_begin_with_a_request(pair):
    inject_bidi(pair, m.SubscribeOk(1).encode())
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_wrong_request_id_parity(pair):
    inject_bidi(pair, m.Subscribe(1, NS, b"1").encode())
    closed_with(pair.take("server"), SessionCloseCode.INVALID_REQUEST_ID)


def test_repeated_request_id(pair):
    inject_bidi(pair, m.Subscribe(0, NS, b"1").encode())
    inject_bidi(pair, m.Subscribe(0, NS, b"2").encode())
    closed_with(pair.take("server"), SessionCloseCode.INVALID_REQUEST_ID)


def test_unknown_unidirectional_stream_type(pair):
    inject_uni(pair, encode_vi64(0x7F00) + b"x")
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_second_control_stream(pair):
    inject_uni(pair, m.Setup().encode())
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_message_other_than_goaway_on_the_control_stream(pair):
    pair.client_quic.send_stream_data(pair.client._control_stream_id, m.Subscribe(0, NS, b"1").encode())
    pair.exchange()
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_closing_the_control_stream_is_a_protocol_violation(pair):
    pair.client_quic.send_stream_data(pair.client._control_stream_id, b"", end_stream=True)
    pair.exchange()
    closed_with(pair.take("server"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_fin_inside_an_object_closes_the_session(pair):
    rid = pair.client.subscribe(NS, b"1")
    pair.exchange()
    pair.take("server")
    alias = pair.server.subscribe_ok(rid)
    sid = pair.server._quic.get_next_available_stream_id(is_unidirectional=True)
    writer = SubgroupWriter(SubgroupHeader(alias, 0))
    pair.server._quic.send_stream_data(sid, writer.header_bytes() + writer.object_header(0, 10) + b"short",
                                       end_stream=True)
    pair.exchange()
    closed_with(pair.take("client"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_fetch_stream_for_an_unknown_request_is_a_protocol_violation(pair):
    sid = pair.server._quic.get_next_available_stream_id(is_unidirectional=True)
    pair.server._quic.send_stream_data(sid, FetchStreamWriter(77).header_bytes())
    pair.exchange()
    closed_with(pair.take("client"), SessionCloseCode.PROTOCOL_VIOLATION)


def test_duplicate_track_alias(pair):
    first = pair.client.subscribe(NS, b"1")
    second = pair.client.subscribe(NS, b"2")
    pair.exchange()
    pair.take("server")
    alias = pair.server.subscribe_ok(first)
    request = pair.server._requests[second]
    pair.server._quic.send_stream_data(request.stream_id, m.SubscribeOk(alias).encode())
    pair.exchange()
    closed_with(pair.take("client"), SessionCloseCode.DUPLICATE_TRACK_ALIAS)


def test_server_refuses_an_unserved_path():
    p = SessionPair(client_setup=m.Setup(path="/other"), server_kwargs={"accept_path": ["/relay"]})
    closed_with(p.take("server"), SessionCloseCode.INVALID_PATH)


def test_path_from_a_server_is_invalid():
    p = SessionPair(server_kwargs={"setup": m.Setup(path="/x")})
    closed_with(p.take("client"), SessionCloseCode.INVALID_PATH)


@pytest.mark.parametrize("first", [b".", b".session"])
def test_reserved_namespaces_are_refused_by_the_session(pair, first):
    rid = pair.client.subscribe((first, b"x"), b"t")
    pair.exchange()
    assert of(pair.take("server"), ev.SubscribeReceived) == []
    rejected = one(pair.take("client"), ev.RequestRejected)
    assert (rejected.request_id, rejected.error_code) == (rid, RequestErrorCode.DOES_NOT_EXIST)


def test_other_period_namespaces_reach_the_application(pair):
    pair.client.subscribe((b".future-extension",), b"t")
    pair.exchange()
    assert one(pair.take("server"), ev.SubscribeReceived).namespace == (b".future-extension",)


def test_requests_and_data_before_setup_are_held_until_setup_arrives():
    p = SessionPair(client_session=False)  # the client speaks raw bytes
    quic = p.client_quic
    request_stream = quic.get_next_available_stream_id(is_unidirectional=False)
    quic.send_stream_data(request_stream, m.Subscribe(0, NS, b"1").encode())
    p.exchange()
    assert of(p.take("server"), ev.SubscribeReceived) == []
    control = quic.get_next_available_stream_id(is_unidirectional=True)
    setup = m.Setup(path="/late").encode()
    quic.send_stream_data(control, setup[:3])  # SETUP split across packets
    p.exchange()
    assert p.take("server") == []
    quic.send_stream_data(control, setup[3:])
    p.exchange()
    events = p.take("server")
    assert [type(e) for e in events] == [ev.SetupCompleted, ev.SubscribeReceived]
    assert events[0].setup.path == "/late"


@pytest.mark.parametrize("start, end, violation", [
    ((7, 1), (7, 1), False),  # End equal to Start: an empty range, allowed ("same or larger")
    ((7, 1), (7, 0), False),  # the whole of group 7, which the range starts in
    ((7, 1), (8, 3), False),
    ((7, 1), (6, 0), True),   # the whole of an earlier group
    ((7, 3), (7, 2), True),   # ends at object 1, before the start
])
def test_fetch_ok_end_location_is_checked_against_the_start_as_the_draft_says(pair, start, end, violation):
    """FETCH_OK: "If End Location is smaller than the Start Location in the corresponding FETCH
    the receiver MUST close the session with a PROTOCOL_VIOLATION", End Location encoded as in
    the FETCH (last object + 1, or object 0 for the whole group): the rule a FETCH's own range
    is checked by."""
    rid = pair.client.fetch(NS, b"t", wire.Location(*start), wire.Location(*start))
    pair.exchange()
    one(pair.take("server"), ev.FetchReceived)
    pair.server.fetch_ok(rid, wire.Location(*end))
    pair.exchange()
    events = pair.take("client")
    if violation:
        closed_with(events, SessionCloseCode.PROTOCOL_VIOLATION)
    else:
        assert of(events, ev.SessionTerminated) == [], events
        assert one(events, ev.FetchAccepted).end_location == wire.Location(*end)
