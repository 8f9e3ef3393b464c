"""MOQT drafts 20 and 22 as differences from draft-18: the codec against byte vectors
serialized by aiomoqt 0.13.3 (LOCATION_FILTER, FETCH, FETCH_OK, GOAWAY, FILL_PARAMETERS,
TRACK_NAMESPACE_PREFIX, PUBLISH_STATE_NOTIFY), the End of Timed-Out Range marker on fetch
streams, and the session: fills served as joining FETCHes, PUBLISH_OK split into
REQUEST_OK + REQUEST_UPDATE, FIN on SUBSCRIBE_NAMESPACE, no joining FETCH.

The session tests pair one of our sessions with a bare QUIC endpoint that writes and
reads raw MOQT bytes, so what our session puts on the wire is checked byte for byte.
"""

from __future__ import annotations

import pytest

from kvsp_moq.moqt import events as ev
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.d18.data import (
    DataStreamParser,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
)
from kvsp_moq.moqt.d18.profiles import profile
from kvsp_moq.moqt.errors import NotSupported, ProtocolViolation, RequestErrorCode, SessionCloseCode
from kvsp_moq.moqt.varint import Buffer, encode_vi64
from kvsp_moq.moqt.wire import (
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    SubscriptionFilter,
    Writer,
)

from .pair import SessionPair

pytestmark = pytest.mark.usefixtures("pair_engine")

LF = m.LocationFilterType
NS = (b"kvsp", b"x")
NEW_DRAFTS = (20, 22)
ALL_DRAFTS = (18, 20, 22)


def h(text: str) -> bytes:
    """Bytes from spaced hex, as the wire notes write them."""
    return bytes.fromhex(text.replace(" ", ""))


def frame(mtype: int, payload: bytes) -> bytes:
    return encode_vi64(mtype) + len(payload).to_bytes(2, "big") + payload


def of(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def one(events: list, kind: type):
    found = of(events, kind)
    assert len(found) == 1, events
    return found[0]


# ---------------------------------------------------------------------------
# Byte vectors serialized by aiomoqt 0.13.3 (wire notes, sections 4, 6 and 13)
# ---------------------------------------------------------------------------

FETCH_D18 = h("16 00 11 00 01 02 04 6b 76 73 70 01 78 01 74 00 02 00 06 00")
FETCH_D20 = h("16 00 12 00 02 04 6b 76 73 70 01 78 01 74 01 21 04 00 02 00 05")
FETCH_OK_D20 = h("18 00 04 00 00 05 00")
GOAWAY_D20 = h("10 00 02 00 05")
SUBSCRIBE_RANGE_FILL = h("03 00 15 00 02 04 6b 76 73 70 01 78 01 74 02 21 04 00 02 00 05 02 01 00")
SUBSCRIBE_NEXT_OBJECT_FILL = {
    20: h("03 00 16 00 02 04 6b 76 73 70 01 78 01 74 02 21 02 00 00 02 04 01 21 01 01"),
    22: h("03 00 14 00 02 04 6b 76 73 70 01 78 01 74 02 21 05 02 04 01 21 01 01"),
}
PUBLISH_STATE_NOTIFY = h("22 00 06 02 09 01 02 07 00")
REQUEST_UPDATE_FILL = h("02 00 08 02 01 23 04 01 21 01 01")
PUBLISH_OK_EXPIRES = h("07 00 04 01 08 83 e8")
# FETCH_HEADER 0, objects 0/2 "A" and 0/3 "B", End of Timed-Out Range up to 0/5.
TIMED_OUT_FETCH_STREAM = h("05 00 1c 00 02 80 01 41 00 01 42 82 0c 00 05")


def test_standalone_fetch_draft18_form() -> None:
    """Draft-18 keeps Fetch Type and an exclusive End Location in fixed fields."""
    fetch = m.Fetch(0, FetchType.STANDALONE, NS, b"t", Location(0, 2), Location(0, 6))
    assert fetch.encode(18) == FETCH_D18
    assert m.decode_message(FETCH_D18, 18) == fetch


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_standalone_fetch_carries_its_range_in_an_inclusive_location_filter(draft: int) -> None:
    """Objects 2..5 of group 0: our exclusive end (0, 6) is the inclusive ABSOLUTE_RANGE
    (0,2)-(0,5) on 20 and 22; the bytes agree because every field is below 128."""
    fetch = m.Fetch(0, FetchType.STANDALONE, NS, b"t", Location(0, 2), Location(0, 6))
    assert fetch.encode(draft) == FETCH_D20
    assert m.decode_message(FETCH_D20, draft) == fetch


def test_draft18_fetch_bytes_are_not_a_draft20_fetch() -> None:
    """Draft-20 has no Fetch Type: the draft-18 bytes do not parse as a draft-20 FETCH."""
    with pytest.raises(ProtocolViolation):
        m.decode_message(FETCH_D18, 20)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_fetch_ok_end_is_inclusive(draft: int) -> None:
    """FETCH_OK (0,5) on the wire is our exclusive End Location (0,6)."""
    ok = m.decode_message(FETCH_OK_D20, draft)
    assert ok == m.FetchOk(False, Location(0, 6))
    assert ok.encode(draft) == FETCH_OK_D20


def test_fetch_ok_end_is_exclusive_on_draft18() -> None:
    """The same bytes mean one Object less on draft-18, where End is last + 1."""
    assert m.decode_message(FETCH_OK_D20, 18) == m.FetchOk(False, Location(0, 5))


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_goaway_has_no_request_id(draft: int) -> None:
    """GOAWAY is URI + Timeout only; a Request ID given to the encoder is dropped."""
    assert m.decode_message(GOAWAY_D20, draft) == m.Goaway("", 5, None)
    assert m.Goaway("", 5, 3).encode(draft) == GOAWAY_D20
    assert m.Goaway("", 5).encode(draft) == GOAWAY_D20


def test_goaway_request_id_round_trips_on_draft18() -> None:
    """Draft-18's control-stream GOAWAY still ends with its Request ID."""
    goaway = m.Goaway("", 5, 3)
    encoded = goaway.encode(18)
    assert encoded == h("10 00 03 00 05 03")
    assert m.decode_message(encoded, 18) == goaway


# -- LOCATION_FILTER (0x21): the byte table of section 6 --------------------

LOCATION_FILTER_TABLE = [
    # (form, d20 bytes, d22 bytes)
    ((LF.NONE, ()), "00", "00"),
    ((LF.NEXT_OBJECT, ()), "02 00 00", "05"),
    ((LF.RELATIVE_START, (0,)), "01 00", "01 00"),
    ((LF.RELATIVE_START, (1,)), "01 01", "01 01"),
    ((LF.ABSOLUTE_START, (3, 4)), "02 03 04", "02 03 04"),
    ((LF.ABSOLUTE_START, (0, 0)), "00", "02 00 00"),
    ((LF.ABSOLUTE_GROUP_END, (3, 4, 4)), "03 03 04 04", "03 03 04 04"),
    ((LF.ABSOLUTE_RANGE, (3, 4, 4, 9)), "04 03 04 04 09", "04 03 04 04 09"),
    # Fields of 128 and over take two bytes: the d20 Length grows, the d22 type does not.
    ((LF.ABSOLUTE_RANGE, (200, 130, 100, 149)), "07 80 c8 80 82 64 80 95", "04 80 c8 80 82 64 80 95"),
    ((LF.ABSOLUTE_START, (300, 0)), "03 81 2c 00", "02 81 2c 00"),
]


def _put_lf(flt: m.LocationFilter, draft: int) -> bytes:
    w = Writer()
    m.put_location_filter(w, flt, profile(draft))
    return bytes(w.data)


def _pull_lf(data: bytes, draft: int) -> m.LocationFilter:
    buf = Buffer(data)
    flt = m.pull_location_filter(buf, profile(draft))
    assert buf.eof(), "location filter left bytes unread"
    return flt


@pytest.mark.parametrize(("flt", "d20", "d22"), LOCATION_FILTER_TABLE)
def test_location_filter_bytes(flt: m.LocationFilter, d20: str, d22: str) -> None:
    """Each form encodes as aiomoqt writes it: length-coded on 20, typed on 22."""
    assert _put_lf(flt, 20) == h(d20)
    assert _put_lf(flt, 22) == h(d22)


@pytest.mark.parametrize(("flt", "d20", "d22"), LOCATION_FILTER_TABLE)
def test_location_filter_decodes_to_its_form(flt: m.LocationFilter, d20: str, d22: str) -> None:
    """Decoding gives the form back; only draft-20's absolute start at {0,0} reads as
    NONE, which is what it means there."""
    assert _pull_lf(h(d22), 22) == flt
    expected20 = (LF.NONE, ()) if flt == (LF.ABSOLUTE_START, (0, 0)) else flt
    assert _pull_lf(h(d20), 20) == expected20


@pytest.mark.parametrize("raw", [6, 7, 0x40])
def test_draft22_location_filter_type_over_5_is_a_protocol_violation(raw: int) -> None:
    """Draft-22 defines types 0x00-0x05 only."""
    with pytest.raises(ProtocolViolation):
        _pull_lf(encode_vi64(raw), 22)
    payload = h("00 02 04 6b 76 73 70 01 78 01 74 01 21") + encode_vi64(raw)
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x16, payload), 22)
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x3, payload), 22)


def test_draft20_location_filter_of_five_fields_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation):
        _pull_lf(h("05 01 02 03 04 05"), 20)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_fetch_with_two_byte_fields(draft: int) -> None:
    """A range whose fields pass 127 gives different d20 and d22 bytes and decodes back."""
    fetch = m.Fetch(4, FetchType.STANDALONE, NS, b"t", Location(200, 130), Location(300, 150),
                    parameters=m.Parameters(subscriber_priority=9, group_order=GroupOrder.DESCENDING))
    lf = "07" if draft == 20 else "04"
    expected = h(f"16 00 19 04 02 04 6b 76 73 70 01 78 01 74 03 20 09 01 {lf} 80 c8 80 82 64 80 95 01 02")
    assert fetch.encode(draft) == expected
    assert m.decode_message(expected, draft) == fetch


# -- TRACK_NAMESPACE_PREFIX (0x34) --------------------------------------------


@pytest.mark.parametrize(("draft", "value"), [
    (18, "05 02 01 61 01 62"),
    (20, "05 02 01 61 01 62"),
    (22, "02 01 61 01 62"),
])
def test_track_namespace_prefix_is_bare_on_draft22(draft: int, value: str) -> None:
    """("a","b") is length-prefixed up to draft-20 and a bare namespace on 22."""
    update = m.RequestUpdate(2, m.Parameters(track_namespace_prefix=(b"a", b"b")))
    expected = frame(0x2, h("02 01 34") + h(value))
    assert update.encode(draft) == expected
    assert m.decode_message(expected, draft) == update


# -- FILL_PARAMETERS (0x23) in SUBSCRIBE and REQUEST_UPDATE -----------------------


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_subscribe_with_range_filter_and_empty_fill_decodes(draft: int) -> None:
    """Section 13's SUBSCRIBE: LOCATION_FILTER (0,2)-(0,5) and FILL{} (`23 01 00`)."""
    subscribe = m.decode_message(SUBSCRIBE_RANGE_FILL, draft)
    assert isinstance(subscribe, m.Subscribe)
    assert (subscribe.request_id, subscribe.namespace, subscribe.track_name) == (0, NS, b"t")
    assert subscribe.parameters.fill == m.Fill()
    flt = subscribe.parameters.subscription_filter
    assert flt is not None
    assert (flt.filter_type, flt.start, flt.end_group) == (FilterType.ABSOLUTE_RANGE, Location(0, 2), 0)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_subscribe_with_range_filter_keeps_its_end_object(draft: int) -> None:
    """Decoding and re-encoding section 13's SUBSCRIBE must not change its meaning: the
    inclusive end Object 5 of its LOCATION_FILTER bounds what the subscription gets."""
    subscribe = m.decode_message(SUBSCRIBE_RANGE_FILL, draft)
    assert subscribe.encode(draft) == SUBSCRIBE_RANGE_FILL


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_subscribe_next_object_with_relative_fill(draft: int) -> None:
    """The exactly-once variant: NEXT_OBJECT subscription, FILL{RELATIVE_START(1)}."""
    subscribe = m.Subscribe(0, NS, b"t", m.Parameters(
        subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT),
        fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    assert subscribe.encode(draft) == SUBSCRIBE_NEXT_OBJECT_FILL[draft]
    assert m.decode_message(SUBSCRIBE_NEXT_OBJECT_FILL[draft], draft) == subscribe


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_request_update_with_fill(draft: int) -> None:
    update = m.RequestUpdate(2, m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    assert update.encode(draft) == REQUEST_UPDATE_FILL
    assert m.decode_message(REQUEST_UPDATE_FILL, draft) == update


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_fill_with_every_parameter_round_trips(draft: int) -> None:
    """FILL_TIMEOUT, SUBSCRIBER_PRIORITY (uint8, 200 is one byte), LOCATION_FILTER and
    GROUP_ORDER inside FILL, beside INCLUDE_PROPERTIES and the outer parameters."""
    fill = m.Fill(location_filter=(LF.ABSOLUTE_RANGE, (200, 0, 5, 149)), fill_timeout=500,
                  subscriber_priority=200, group_order=GroupOrder.DESCENDING)
    subscribe = m.Subscribe(6, NS, b"t", m.Parameters(
        subscriber_priority=7, forward=True, include_properties=False,
        subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(200, 0)), fill=fill))
    assert m.decode_message(subscribe.encode(draft), draft) == subscribe


@pytest.mark.parametrize("draft", NEW_DRAFTS)
@pytest.mark.parametrize(("fill", "value"), [
    (m.Fill(), "01 00"),
    (m.Fill(subscriber_priority=200), "03 01 20 c8"),  # uint8, not vi64 `80 c8`
    (m.Fill(group_order=GroupOrder.DESCENDING), "03 01 22 02"),
    (m.Fill(fill_timeout=1000, location_filter=(LF.RELATIVE_START, (1,))), "07 02 0a 83 e8 17 01 01"),
])
def test_fill_value_is_a_length_and_a_counted_parameter_block(draft: int, fill: m.Fill, value: str) -> None:
    """aiomoqt's form: Length, Number of Parameters, delta-coded parameters."""
    w = Writer()
    fill.encode(w, profile(draft))
    assert bytes(w.data) == h(value)
    assert m.Fill.decode(Buffer(h(value)), profile(draft)) == fill


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_fill_with_an_unknown_inner_parameter_is_a_protocol_violation(draft: int) -> None:
    """Only 0x0A, 0x20, 0x21 and 0x22 may appear inside FILL (FORWARD 0x10 may not)."""
    payload = h("00 02 04 6b 76 73 70 01 78 01 74 01 23 03 01 10 01")
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x3, payload), draft)


@pytest.mark.parametrize(("param", "value"), [(0x23, "01 00"), (0x35, "01")])
def test_parameters_new_in_draft20_are_a_protocol_violation_on_draft18(param: int, value: str) -> None:
    """FILL_PARAMETERS and INCLUDE_PROPERTIES do not exist in draft-18; on 20 and 22 the
    same SUBSCRIBE decodes."""
    payload = h("00 02 04 6b 76 73 70 01 78 01 74 01") + encode_vi64(param) + h(value)
    data = frame(0x3, payload)
    with pytest.raises(ProtocolViolation):
        m.decode_message(data, 18)
    for draft in NEW_DRAFTS:
        parameters = m.decode_message(data, draft).parameters
        if param == 0x23:
            assert parameters.fill == m.Fill()
        else:
            assert parameters.include_properties is True


@pytest.mark.parametrize("parameters", [m.Parameters(fill=m.Fill()), m.Parameters(include_properties=True)])
def test_parameters_new_in_draft20_cannot_be_encoded_on_draft18(parameters: m.Parameters) -> None:
    with pytest.raises(ValueError):
        m.Subscribe(0, NS, b"t", parameters).encode(18)


# -- PUBLISH_STATE_NOTIFY (0x22), PUBLISH_OK, joining FETCH -------------------------


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_publish_state_notify(draft: int) -> None:
    """Largest (1,2) and FORWARD 0, no Request ID and no Track Properties."""
    notify = m.PublishStateNotify(m.Parameters(largest_object=Location(1, 2), forward=False))
    assert notify.encode(draft) == PUBLISH_STATE_NOTIFY
    assert m.decode_message(PUBLISH_STATE_NOTIFY, draft) == notify


def test_publish_state_notify_does_not_exist_on_draft18() -> None:
    with pytest.raises(ProtocolViolation):
        m.decode_message(PUBLISH_STATE_NOTIFY, 18)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_publish_state_notify_refuses_parameters_outside_its_scope(draft: int) -> None:
    """Only LARGEST_OBJECT, FORWARD and LOCATION_FILTER may be in it (EXPIRES may not)."""
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x22, h("01 08 05")), draft)
    with pytest.raises(ValueError):
        m.PublishStateNotify(m.Parameters(expires=5)).encode(draft)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_publish_ok_with_expires(draft: int) -> None:
    ok = m.RequestOk(m.Parameters(expires=1000))
    assert ok.encode(draft) == PUBLISH_OK_EXPIRES
    assert m.decode_message(PUBLISH_OK_EXPIRES, draft) == ok


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_joining_fetch_cannot_be_encoded(draft: int) -> None:
    """Draft-20 has no joining FETCH (FILL_PARAMETERS replaces it); 18 still has one."""
    joining = m.Fetch(2, FetchType.RELATIVE_JOINING, joining_request_id=0, joining_start=1)
    with pytest.raises(ValueError):
        joining.encode(draft)
    assert m.decode_message(joining.encode(18), 18) == joining


# -- decode(encode(x)) == x --------------------------------------------------------

ROUND_TRIPS: list[m.Message] = [
    m.Fetch(0, FetchType.STANDALONE, NS, b"t", Location(0, 2), Location(0, 6)),
    m.Fetch(2, FetchType.STANDALONE, NS, b"t", Location(5, 0), Location(7, 0)),  # whole end group
    m.Fetch(4, FetchType.STANDALONE, NS, b"t", Location(3, 1), m.OPEN_END),  # to Largest
    m.Fetch(6, FetchType.STANDALONE, NS, b"t", Location(1 << 40, 7), Location((1 << 40) + 2, 1 << 20),
            parameters=m.Parameters(fill_timeout=250, include_properties=False)),
    m.FetchOk(True, Location(3, 0)),  # whole group: the last Object is written as 2^64-1
    m.FetchOk(False, Location(300, 200)),
    m.Goaway("moqt://relay.example/next", 1000),
    m.Subscribe(0, NS, b"t", m.Parameters(subscription_filter=SubscriptionFilter(FilterType.NEXT_GROUP_START))),
    m.Subscribe(0, NS, b"t", m.Parameters(
        subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(3, 4), 7),
        fill=m.Fill(location_filter=(LF.NONE, ())))),
    m.Publish(1, NS, b"t", 9, m.Parameters(
        forward=False, subscriber_priority=3, group_order=GroupOrder.ASCENDING, largest_object=Location(4, 4),
        subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(2, 0)))),
    m.PublishStateNotify(m.Parameters(
        largest_object=Location(300, 7), forward=True,
        subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT))),
    m.RequestOk(m.Parameters(expires=5, largest_object=Location(3, 4))),
    m.RequestUpdate(4, m.Parameters(forward=True, fill=m.Fill(subscriber_priority=1, fill_timeout=0))),
    m.TrackStatus(8, NS, b"t", m.Parameters(include_properties=False)),
]


@pytest.mark.parametrize("draft", NEW_DRAFTS)
@pytest.mark.parametrize("message", ROUND_TRIPS, ids=lambda msg: type(msg).__name__)
def test_round_trip(draft: int, message: m.Message) -> None:
    assert m.decode_message(message.encode(draft), draft) == message


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_control_stream_parser_splits_draft20_messages(draft: int) -> None:
    """The stream parser knows 0x22 on 20 and 22 and decodes with the draft's forms."""
    data = b"".join(message.encode(draft) for message in ROUND_TRIPS[:8]) + PUBLISH_STATE_NOTIFY
    parser = m.ControlStreamParser(draft)
    out = []
    for i in range(0, len(data), 5):
        out += parser.feed(data[i : i + 5])
    assert out == [*ROUND_TRIPS[:8], m.decode_message(PUBLISH_STATE_NOTIFY, draft)]


# ---------------------------------------------------------------------------
# Data plane: End of Timed-Out Range (0x20C)
# ---------------------------------------------------------------------------


def test_timed_out_range_marker_parses_when_enabled() -> None:
    items = DataStreamParser(timed_out_range=True).feed(TIMED_OUT_FETCH_STREAM, end_stream=True)
    assert items == [
        FetchHeader(0),
        FetchObject(0, 0, 2, 128, b"A"),
        FetchObject(0, 0, 3, 128, b"B"),
        FetchEndOfRange(Location(0, 5), True),
    ]


def test_timed_out_range_marker_is_a_protocol_violation_on_draft18() -> None:
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(TIMED_OUT_FETCH_STREAM, end_stream=True)


def test_objects_after_a_timed_out_range_are_delta_coded_from_the_marker() -> None:
    """The marker stands as the prior Location: an object with only an Object delta
    after it continues from 0/5."""
    data = TIMED_OUT_FETCH_STREAM + h("04 02 01 43")  # object delta 2 → 0/7 "C"
    items = DataStreamParser(timed_out_range=True).feed(data, end_stream=True)
    assert items[-1] == FetchObject(0, 0, 7, 128, b"C")


# ---------------------------------------------------------------------------
# Session: one of our sessions against a bare QUIC endpoint
# ---------------------------------------------------------------------------


def raw_peer(draft: int) -> SessionPair:
    """Our server session of `draft` and a bare client that has sent its SETUP."""
    peer = SessionPair(draft=draft, client_session=False)
    peer.send(m.Setup().encode(draft), bidi=False)
    assert peer.server is not None
    assert isinstance(peer.server_events[0], ev.SetupCompleted), peer.server_events
    peer.take("server")
    return peer


@pytest.fixture(params=NEW_DRAFTS, ids=lambda d: f"d{d}")
def peer(request: pytest.FixtureRequest) -> SessionPair:
    return raw_peer(request.param)


def data_streams(peer: SessionPair) -> list[int]:
    """Unidirectional streams our side opened, its control stream (the first) aside."""
    ours = sorted(sid for sid in peer.raw if sid & 3 == 3)
    return ours[1:]


def fill_subscribe(peer: SessionPair, request_id: int, parameters: m.Parameters) -> int:
    """A peer SUBSCRIBE carrying FILL_PARAMETERS; returns its request stream."""
    return peer.send(m.Subscribe(request_id, NS, b"t", parameters).encode(peer.draft))


def test_session_speaks_the_negotiated_draft(peer: SessionPair) -> None:
    """The server's control stream opens with SETUP, and its GOAWAY has no Request ID."""
    peer.server.goaway("moqt://next", 7)
    peer.exchange()
    control = [sid for sid in peer.raw if sid & 2 and sid & 1]
    assert len(control) == 1
    messages = m.ControlStreamParser(peer.draft).feed(bytes(peer.raw[control[0]]))
    assert isinstance(messages[0], m.Setup)
    assert messages[1:] == [m.Goaway("moqt://next", 7, None)]
    assert bytes(peer.raw[control[0]]).endswith(h("10 00 0d 0b") + b"moqt://next" + h("07"))


def test_fill_with_relative_start_is_served_as_a_fetch_under_the_subscribe_id(peer: SessionPair) -> None:
    """SUBSCRIBE {NEXT_OBJECT, FILL{RELATIVE_START(1)}}: after SUBSCRIBE_OK with Largest
    (0,5) the layer above fetches group 0 up to (0,5); FETCH_OK sends nothing, and the
    fetch stream is `05 <SUBSCRIBE's Request ID>` followed by the objects."""
    other = peer.send(m.Subscribe(0, NS, b"other").encode(peer.draft))
    one(peer.take("server"), ev.SubscribeReceived)
    sid = fill_subscribe(peer, 2, m.Parameters(
        subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT),
        fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    received = one(peer.take("server"), ev.SubscribeReceived)
    assert received.request_id == 2
    assert received.parameters.fill == m.Fill(location_filter=(LF.RELATIVE_START, (1,)))
    assert peer.server.take_events() == []  # the fill waits for SUBSCRIBE_OK

    alias = peer.server.subscribe_ok(2, largest=Location(0, 5))
    fetch = one(peer.server.take_events(), ev.FetchReceived)
    assert (fetch.namespace, fetch.track_name, fetch.joining_request_id) == (NS, b"t", 2)
    assert (fetch.start, fetch.end) == (Location(0, 0), Location(0, 6))
    assert fetch.request_id not in (0, 2)  # kept apart from every peer Request ID

    peer.server.fetch_ok(fetch.request_id, fetch.end)
    fetch_sid = peer.server.open_fetch_stream(fetch.request_id)
    peer.server.write_fetch_object(fetch_sid, 0, 0, b"layer0")
    peer.server.write_fetch_object(fetch_sid, 0, 5, b"layer5")
    peer.exchange()
    assert peer.messages_on(sid) == [m.SubscribeOk(alias, m.Parameters(largest_object=Location(0, 5)))]
    assert peer.messages_on(other) == []
    stream = bytes(peer.raw[fetch_sid])
    assert stream[:2] == h("05 02")
    assert DataStreamParser(timed_out_range=True).feed(stream) == [
        FetchHeader(2),
        FetchObject(0, 0, 0, 128, b"layer0"),
        FetchObject(0, 0, 5, 128, b"layer5"),
    ]
    assert of(peer.take("server"), ev.SessionTerminated) == []


def test_empty_fill_takes_the_subscription_filter(peer: SessionPair) -> None:
    """FILL{} with an ABSOLUTE_START (1,0) subscription: the fill is (1,0) to Largest."""
    fill_subscribe(peer, 0, m.Parameters(
        subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(1, 0)), fill=m.Fill()))
    one(peer.take("server"), ev.SubscribeReceived)
    peer.server.subscribe_ok(0, largest=Location(1, 5))
    fetch = one(peer.server.take_events(), ev.FetchReceived)
    assert (fetch.start, fetch.end, fetch.joining_request_id) == (Location(1, 0), Location(1, 6), 0)


def test_fill_range_is_the_filter_evaluated_as_a_fetch(peer: SessionPair) -> None:
    """FILL{LOCATION_FILTER (0,2)-(0,5)} with Largest (0,9): the fill carries exactly
    objects 2..5 of group 0 (inclusive end, clamped to Largest), not the whole group
    up to Largest."""
    fill_subscribe(peer, 0, m.Parameters(fill=m.Fill(location_filter=(LF.ABSOLUTE_RANGE, (0, 2, 0, 5)))))
    one(peer.take("server"), ev.SubscribeReceived)
    peer.server.subscribe_ok(0, largest=Location(0, 9))
    fetch = one(peer.server.take_events(), ev.FetchReceived)
    assert (fetch.start, fetch.end) == (Location(0, 2), Location(0, 6))


@pytest.mark.parametrize(("parameters", "largest"), [
    (m.Parameters(fill=m.Fill(location_filter=(LF.NEXT_OBJECT, ()))), Location(1, 5)),
    (m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (0,)))), Location(1, 5)),
    (m.Parameters(subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT), fill=m.Fill()), Location(1, 5)),
    (m.Parameters(forward=False, fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))), Location(1, 5)),
    (m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))), None),
], ids=["next-object", "next-group", "empty-after-largest", "forward-0", "nothing-published"])
def test_fill_with_an_empty_range_opens_nothing(peer: SessionPair, parameters: m.Parameters,
                                                largest: Location | None) -> None:
    """No FetchReceived and nothing but SUBSCRIBE_OK on the wire: the range starts after
    Largest, Forward is 0, or nothing was published."""
    sid = fill_subscribe(peer, 0, parameters)
    one(peer.take("server"), ev.SubscribeReceived)
    alias = peer.server.subscribe_ok(0, largest=largest)
    assert of(peer.server.take_events(), ev.FetchReceived) == []
    peer.exchange()
    assert peer.messages_on(sid) == [m.SubscribeOk(alias, m.Parameters(largest_object=largest))]
    assert data_streams(peer) == []
    assert peer.resets == {}


def test_fill_in_a_request_update_uses_the_update_request_id(peer: SessionPair) -> None:
    """REQUEST_UPDATE{FILL{RELATIVE_START(2)}} on an established subscription with
    Largest (3,5): the fill covers groups 2..3 and its stream carries the update's ID."""
    sid = fill_subscribe(peer, 0, m.Parameters(subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT)))
    peer.take("server")
    peer.server.subscribe_ok(0, largest=Location(3, 5))
    assert peer.server.take_events() == []
    update = m.RequestUpdate(2, m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (2,)))))
    peer.send(update.encode(peer.draft), stream_id=sid)
    events = peer.take("server")
    assert one(events, ev.RequestUpdateReceived).request_id == 2
    fetch = one(events, ev.FetchReceived)
    assert (fetch.start, fetch.end, fetch.joining_request_id) == (Location(2, 0), Location(3, 6), 0)
    fetch_sid = peer.server.open_fetch_stream(fetch.request_id)
    peer.server.write_fetch_object(fetch_sid, 2, 0, b"g2")
    peer.server.request_ok(2, m.Parameters(largest_object=Location(3, 5)))
    peer.exchange()
    assert bytes(peer.raw[fetch_sid])[:2] == h("05 02")
    assert peer.messages_on(sid)[1:] == [m.RequestOk(m.Parameters(largest_object=Location(3, 5)))]


def test_closing_a_fill_stream_ends_it_with_a_fin(peer: SessionPair) -> None:
    """Once the range is delivered the fill stream FINs, and the session goes on."""
    fill_subscribe(peer, 0, m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    peer.take("server")
    peer.server.subscribe_ok(0, largest=Location(0, 1))
    fetch = one(peer.server.take_events(), ev.FetchReceived)
    fetch_sid = peer.server.open_fetch_stream(fetch.request_id)
    peer.server.write_fetch_object(fetch_sid, 0, 0, b"a")
    peer.server.write_fetch_object(fetch_sid, 0, 1, b"b")
    peer.server.close_data_stream(fetch_sid)
    peer.exchange()
    assert fetch_sid in peer.fins
    assert [o.object_id for o in DataStreamParser().feed(bytes(peer.raw[fetch_sid]), end_stream=True)[1:]] == [0, 1]
    assert peer.server.data_stream_request(fetch_sid) is None


def test_cancelling_a_subscription_resets_its_fill_stream(peer: SessionPair) -> None:
    """STOP_SENDING + RESET_STREAM on the subscription's stream: the publisher resets
    the open fill streams of that subscription."""
    sid = fill_subscribe(peer, 0, m.Parameters(fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    peer.take("server")
    peer.server.subscribe_ok(0, largest=Location(0, 3))
    fetch = one(peer.server.take_events(), ev.FetchReceived)
    fetch_sid = peer.server.open_fetch_stream(fetch.request_id)
    peer.server.write_fetch_object(fetch_sid, 0, 0, b"a")
    peer.exchange()
    peer.client_quic.stop_stream(sid, 1)
    peer.client_quic.reset_stream(sid, 1)
    peer.exchange()
    assert one(peer.take("server"), ev.RequestCancelled).request_id == 0
    assert fetch_sid in peer.resets


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_our_subscriber_receives_the_fill_it_asked_for(draft: int) -> None:
    """Two of our sessions: a SUBSCRIBE with FILL_PARAMETERS is answered with a fetch
    stream under the SUBSCRIBE's Request ID, which the subscriber must accept (draft-20:
    a FETCH_HEADER may name a SUBSCRIBE) rather than close the session: its objects are the
    subscription's, and its end is one of the subscription's streams ending."""
    pair = SessionPair(draft=draft)
    pair.take("client"), pair.take("server")  # the SETUPs
    sub = pair.client.subscribe(NS, b"t", m.Parameters(
        subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT),
        fill=m.Fill(location_filter=(LF.RELATIVE_START, (1,)))))
    pair.exchange()
    one(pair.take("server"), ev.SubscribeReceived)
    pair.server.subscribe_ok(sub, largest=Location(0, 1))
    fetch = one(pair.server.take_events(), ev.FetchReceived)
    fetch_sid = pair.server.open_fetch_stream(fetch.request_id)
    pair.server.write_fetch_object(fetch_sid, 0, 0, b"a")
    pair.server.write_fetch_object(fetch_sid, 0, 1, b"b")
    pair.exchange()
    events = pair.client_events
    assert of(events, ev.SessionTerminated) == []
    assert one(events, ev.SubscribeAccepted).request_id == sub
    assert of(events, ev.FetchObjectReceived) == []
    assert [(o.request_id, o.group_id, o.object_id, o.payload) for o in of(events, ev.ObjectReceived)] == [
        (sub, 0, 0, b"a"), (sub, 0, 1, b"b")]
    assert one(events, ev.SubgroupStreamOpened).request_id == sub
    pair.server.close_data_stream(fetch_sid)
    pair.exchange()
    ended = one(pair.client_events, ev.DataStreamEnded)
    assert (ended.request_id, ended.fetch, ended.reset) == (sub, False, False)


@pytest.mark.parametrize("draft", ALL_DRAFTS)
def test_publish_ok_carries_only_expires_from_draft20(draft: int) -> None:
    """request_ok to a peer PUBLISH with EXPIRES, FORWARD, priority and GROUP_ORDER: on
    18 one REQUEST_OK carries them all; on 20 and 22 REQUEST_OK carries EXPIRES and a
    REQUEST_UPDATE (our Request ID) carries FORWARD and priority (it has no GROUP_ORDER)."""
    peer = raw_peer(draft)
    sid = peer.send(m.Publish(0, NS, b"t", 7, m.Parameters(forward=False)).encode(draft))
    assert one(peer.take("server"), ev.PublishReceived).track_alias == 7
    peer.server.request_ok(0, m.Parameters(expires=1000, forward=True, subscriber_priority=5,
                                           group_order=GroupOrder.DESCENDING))
    peer.exchange()
    sent = peer.messages_on(sid)
    if draft == 18:
        assert sent == [m.RequestOk(m.Parameters(expires=1000, forward=True, subscriber_priority=5,
                                                 group_order=GroupOrder.DESCENDING))]
        return
    assert sent == [
        m.RequestOk(m.Parameters(expires=1000)),
        m.RequestUpdate(1, m.Parameters(forward=True, subscriber_priority=5)),
    ]
    assert bytes(peer.raw[sid]).startswith(PUBLISH_OK_EXPIRES)


def test_publish_ok_with_expires_only_sends_no_update(peer: SessionPair) -> None:
    sid = peer.send(m.Publish(0, NS, b"t", 7).encode(peer.draft))
    peer.take("server")
    peer.server.request_ok(0, m.Parameters(expires=1000))
    peer.exchange()
    assert peer.messages_on(sid) == [m.RequestOk(m.Parameters(expires=1000))]


@pytest.mark.parametrize("draft", ALL_DRAFTS)
def test_fin_on_subscribe_namespace_cancels_only_on_draft18(draft: int) -> None:
    """A requester FIN on SUBSCRIBE_NAMESPACE: draft-18 cancels it; from draft-20 a FIN
    only ends what the requester sends, and NAMESPACE still flows."""
    peer = raw_peer(draft)
    sid = peer.send(m.SubscribeNamespace(0, (b"kvsp",)).encode(draft))
    assert one(peer.take("server"), ev.SubscribeNamespaceReceived).request_id == 0
    peer.server.request_ok(0)
    peer.exchange()
    peer.send(b"", end_stream=True, stream_id=sid)
    events = peer.take("server")
    if draft == 18:
        cancelled = one(events, ev.RequestCancelled)
        assert (cancelled.request_id, cancelled.local_request) == (0, False)
        return
    assert of(events, ev.RequestCancelled) == []
    peer.server.namespace(0, (b"x",))
    peer.exchange()
    assert peer.messages_on(sid) == [m.RequestOk(), m.Namespace((b"x",))]
    assert sid not in peer.fins


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_joining_fetch_is_not_supported(draft: int) -> None:
    peer = raw_peer(draft)
    rid = peer.server.subscribe(NS, b"t")
    with pytest.raises(NotSupported):
        peer.server.joining_fetch(rid, 1)


def test_joining_fetch_is_still_sent_on_draft18() -> None:
    peer = raw_peer(18)
    rid = peer.server.subscribe(NS, b"t")
    fetch = peer.server.joining_fetch(rid, 1)
    peer.exchange()
    fetch_sid = [sid for sid in peer.raw if not sid & 2][-1]
    assert peer.messages_on(fetch_sid) == [
        m.Fetch(fetch, FetchType.RELATIVE_JOINING, joining_request_id=rid, joining_start=1)]


@pytest.mark.parametrize("draft", ALL_DRAFTS)
def test_our_fetch_and_a_timed_out_range_on_its_stream(draft: int) -> None:
    """Our FETCH goes out in the draft's form; the peer's FETCH_OK `18 00 04 00 00 05 00`
    and a fetch stream ending with 0x20C are read as End (0,6) and an unknown range on
    20 and 22, while draft-18 closes the session on the marker."""
    peer = raw_peer(draft)
    rid = peer.server.fetch(NS, b"t", Location(0, 2), Location(0, 6))
    peer.exchange()
    request_sid = next(sid for sid in peer.raw if not sid & 2)
    track = h("02 04 6b 76 73 70 01 78 01 74")
    if draft == 18:  # Request ID 1, Fetch Type 1, track, Start (0,2), End (0,6), no parameters
        wire = frame(0x16, h("01 01") + track + h("00 02 00 06 00"))
    else:  # Request ID 1, track, LOCATION_FILTER ABSOLUTE_RANGE (0,2)-(0,5)
        wire = frame(0x16, h("01") + track + h("01 21 04 00 02 00 05"))
    assert bytes(peer.raw[request_sid]) == wire
    peer.send(FETCH_OK_D20 if draft != 18 else m.FetchOk(False, Location(0, 6)).encode(18), stream_id=request_sid)
    assert one(peer.take("server"), ev.FetchAccepted).end_location == Location(0, 6)
    peer.send(h("05 01") + TIMED_OUT_FETCH_STREAM[2:], bidi=False, end_stream=True)
    events = peer.take("server")
    if draft == 18:
        assert one(events, ev.SessionTerminated).error_code == SessionCloseCode.PROTOCOL_VIOLATION
        return
    assert of(events, ev.SessionTerminated) == []
    assert [(o.object_id, o.payload) for o in of(events, ev.FetchObjectReceived)] == [(2, b"A"), (3, b"B")]
    marker = one(events, ev.FetchRangeReceived)
    assert (marker.request_id, marker.location, marker.unknown) == (rid, Location(0, 5), True)
    assert one(events, ev.DataStreamEnded).reset is False


def test_a_request_with_range_filters_is_refused_with_invalid_filter(peer: SessionPair) -> None:
    """This endpoint advertises no MAX_FILTER_RANGES, so range filters (0x25-0x29) are refused
    with REQUEST_ERROR INVALID_FILTER (0x36), the session kept; the layer above never sees it."""
    # SUBSCRIBE, request 0, ("kvsp", "x") / "t", 1 parameter: OBJECTID_FILTER (0x26) of one
    # range, length 3: SetID 0, start delta 3, end delta 2.
    body = h("00 02 04 6b 76 73 70 01 78 01 74 01 26 03 00 03 02")
    sid = peer.send(frame(0x3, body))
    assert of(peer.take("server"), ev.SubscribeReceived) == []
    (answer,) = peer.messages_on(sid)
    assert isinstance(answer, m.RequestErrorMessage) and answer.error_code == RequestErrorCode.INVALID_FILTER == 0x36
    assert not peer.server.closed


def test_range_filters_do_not_exist_on_draft18() -> None:
    body = h("00 02 04 6b 76 73 70 01 78 01 74 01 26 03 00 03 02")
    with pytest.raises(ProtocolViolation, match="unknown parameter 0x26"):
        m.decode_message(frame(0x3, body), 18)


@pytest.mark.parametrize("draft", NEW_DRAFTS)
def test_publish_state_notify_from_the_publisher_is_accepted(draft: int) -> None:
    """Our subscription's publisher may report its own change of Forward or Largest Object;
    the session takes it and stays open. From the subscriber it is a PROTOCOL_VIOLATION."""
    pair = SessionPair(draft=draft)
    pair.take("client"), pair.take("server")  # the SETUPs
    sub = pair.client.subscribe(NS, b"t")
    pair.exchange()
    one(pair.take("server"), ev.SubscribeReceived)
    pair.server.subscribe_ok(sub, largest=Location(0, 1))
    pair.exchange()
    notify = m.PublishStateNotify(m.Parameters(largest_object=Location(0, 4), forward=False))
    pair.server_quic.send_stream_data(pair.server.request_stream_id(sub), notify.encode(draft))
    pair.exchange()
    assert of(pair.client_events, ev.SessionTerminated) == []
    assert not pair.client.closed


def test_publish_state_notify_from_the_subscriber_closes_the_session(peer: SessionPair) -> None:
    sid = peer.send(m.Subscribe(0, NS, b"t").encode(peer.draft))
    one(peer.take("server"), ev.SubscribeReceived)
    peer.server.subscribe_ok(0, largest=Location(0, 1))
    peer.exchange()
    peer.send(m.PublishStateNotify(m.Parameters(forward=False)).encode(peer.draft), stream_id=sid)
    closed = one(peer.take("server"), ev.SessionTerminated)
    assert closed.error_code == SessionCloseCode.PROTOCOL_VIOLATION


@pytest.mark.parametrize(("message", "why"), [
    # SUBSCRIBE, request 0, ("kvsp", "x") / "t": LOCATION_FILTER Relative Start, 2 groups back.
    ("03", "00 02 04 6b 76 73 70 01 78 01 74 01 21 {rel2}"),
    # FETCH, request 0, same track: LOCATION_FILTER Next Object.
    ("16", "00 02 04 6b 76 73 70 01 78 01 74 01 21 {next}"),
], ids=["subscribe-relative-start", "fetch-next-object"])
def test_a_filter_relative_to_largest_is_refused_not_fatal(peer: SessionPair, message: str, why: str) -> None:
    """Forms this endpoint cannot express in Locations are refused with NOT_SUPPORTED; the
    session stays open."""
    typed = peer.draft >= 22
    body = why.format(rel2="01 02" if typed else "01 02", next="05" if typed else "02 00 00")
    sid = peer.send(frame(int(message, 16), h(body)))
    events = peer.take("server")
    assert of(events, ev.SubscribeReceived) == of(events, ev.FetchReceived) == []
    (answer,) = peer.messages_on(sid)
    assert isinstance(answer, m.RequestErrorMessage) and answer.error_code == RequestErrorCode.NOT_SUPPORTED
    assert not peer.server.closed
