"""Draft-14 codec: round trips, byte-exact layouts from the draft, streaming, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d14 import data as d14data
from kvsp_moq.moqt.d14 import messages as d
from kvsp_moq.moqt.d18 import data as data18
from kvsp_moq.moqt.d18 import messages as m18
from kvsp_moq.moqt.errors import (
    KeyValueFormattingError,
    MalformedAuthority,
    MalformedPath,
    ObjectTooLarge,
    ProtocolViolation,
)
from kvsp_moq.moqt.varint import encode_quic_varint as qv
from kvsp_moq.moqt.wire import (
    AuthToken,
    FetchType,
    GroupOrder,
    Location,
    SubscriptionFilter,
)

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

u62 = st.integers(0, 2**62 - 1)
u8 = st.integers(0, 255)
small = st.integers(0, 2**20)
namespaces = st.lists(st.binary(max_size=8), min_size=1, max_size=4).map(tuple)
track_names = st.binary(max_size=16)
locations = st.builds(Location, u62, u62)
reasons = st.text(max_size=30)
orders = st.sampled_from(list(GroupOrder))
orders_or_default = st.one_of(st.none(), orders)
tokens = st.one_of(
    st.builds(AuthToken.use_value, st.binary(max_size=16), u62),
    st.builds(AuthToken.register, u62, st.binary(max_size=16), u62),
    st.builds(AuthToken.use_alias, u62),
    st.builds(AuthToken.delete, u62),
)
unknown_types = u62.filter(lambda t: t not in (2, 3, 4))


def _kvp(ktype: int) -> st.SearchStrategy:
    if ktype & 1:
        return st.binary(max_size=12).map(lambda v: (ktype, v))
    return u62.map(lambda v: (ktype, v))


kvps = st.lists(unknown_types.flatmap(_kvp), max_size=3).map(tuple)
extensions = st.lists(u62.flatmap(_kvp), max_size=4).map(tuple)


@st.composite
def filters(draw) -> SubscriptionFilter:
    kind = draw(st.sampled_from(list(wire.FilterType)))
    if kind == wire.FilterType.ABSOLUTE_START:
        return SubscriptionFilter.absolute_start(draw(u62), draw(u62))
    if kind == wire.FilterType.ABSOLUTE_RANGE:
        group = draw(st.integers(0, 2**40))
        return SubscriptionFilter.absolute_range(group, draw(u62), group + draw(small))
    return SubscriptionFilter(kind)


def parameters(scope: frozenset[int]) -> st.SearchStrategy[d.Parameters]:
    return st.builds(
        d.Parameters,
        st.lists(tokens, max_size=2).map(tuple) if 3 in scope else st.just(()),
        st.one_of(st.none(), u62) if 2 in scope else st.none(),
        st.one_of(st.none(), u62) if 4 in scope else st.none(),
        kvps.map(lambda items: tuple(kv for kv in items if kv[0] not in scope)),
    )


setup_parameters = st.builds(
    d.SetupParameters,
    st.one_of(st.none(), st.text(max_size=10)),
    st.one_of(st.none(), u62),
    st.lists(tokens, max_size=2).map(tuple),
    st.one_of(st.none(), u62),
    st.one_of(st.none(), st.text(max_size=10)),
    st.one_of(st.none(), st.text(max_size=10)),
    st.lists(u62.filter(lambda t: t not in d._SETUP_KNOWN).flatmap(_kvp), max_size=3).map(tuple),
)


@st.composite
def fetches(draw) -> d.Fetch:
    kind = draw(st.sampled_from(list(FetchType)))
    common = dict(
        subscriber_priority=draw(u8),
        group_order=draw(orders_or_default),
        parameters=draw(parameters(d.Fetch.SCOPE)),
    )
    if kind == FetchType.STANDALONE:
        return d.Fetch(draw(u62), kind, draw(namespaces), draw(track_names), draw(locations), draw(locations), **common)
    return d.Fetch(draw(u62), kind, joining_request_id=draw(u62), joining_start=draw(u62), **common)


@st.composite
def subscribe_updates(draw) -> d.SubscribeUpdate:
    start = draw(st.builds(Location, st.integers(0, 2**40), u62))
    end = draw(st.one_of(st.none(), st.integers(start.group, start.group + 2**20)))
    return d.SubscribeUpdate(draw(u62), draw(u62), start, end, draw(u8), draw(st.booleans()),
                             draw(parameters(d.SubscribeUpdate.SCOPE)))


def _subscribe_like(cls):
    return st.builds(cls, u62, namespaces, track_names, u8, orders_or_default, st.booleans(), filters(),
                     parameters(cls.SCOPE))


def _subscribe_ok_like(cls):
    return st.builds(cls, u62, u62, u62, orders, st.one_of(st.none(), locations), parameters(cls.SCOPE))


def _error_like(cls):
    return st.builds(cls, u62, u62, reasons)


MESSAGE_STRATEGIES: dict[type, st.SearchStrategy] = {
    d.ClientSetup: st.builds(d.ClientSetup, st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4).map(tuple),
                             setup_parameters),
    d.ServerSetup: st.builds(d.ServerSetup, st.integers(0, 2**32 - 1), setup_parameters),
    d.Goaway: st.builds(d.Goaway, st.text(max_size=30)),
    d.MaxRequestId: st.builds(d.MaxRequestId, u62),
    d.RequestsBlocked: st.builds(d.RequestsBlocked, u62),
    d.Subscribe: _subscribe_like(d.Subscribe),
    d.SubscribeOk: _subscribe_ok_like(d.SubscribeOk),
    d.SubscribeError: _error_like(d.SubscribeError),
    d.SubscribeUpdate: subscribe_updates(),
    d.Unsubscribe: st.builds(d.Unsubscribe, u62),
    d.PublishDone: st.builds(d.PublishDone, u62, u62, u62, reasons),
    d.Publish: st.builds(d.Publish, u62, namespaces, track_names, u62, orders, st.one_of(st.none(), locations),
                         st.booleans(), parameters(d.Publish.SCOPE)),
    d.PublishOk: st.builds(d.PublishOk, u62, st.booleans(), u8, orders, filters(), parameters(d.PublishOk.SCOPE)),
    d.PublishError: _error_like(d.PublishError),
    d.Fetch: fetches(),
    d.FetchOk: st.builds(d.FetchOk, u62, orders, st.booleans(), locations, parameters(d.FetchOk.SCOPE)),
    d.FetchError: _error_like(d.FetchError),
    d.FetchCancel: st.builds(d.FetchCancel, u62),
    d.TrackStatus: _subscribe_like(d.TrackStatus),
    d.TrackStatusOk: _subscribe_ok_like(d.TrackStatusOk),
    d.TrackStatusError: _error_like(d.TrackStatusError),
    d.PublishNamespace: st.builds(d.PublishNamespace, u62, namespaces, parameters(d._SCOPE_AUTH)),
    d.PublishNamespaceOk: st.builds(d.PublishNamespaceOk, u62),
    d.PublishNamespaceError: _error_like(d.PublishNamespaceError),
    d.PublishNamespaceDone: st.builds(d.PublishNamespaceDone, namespaces),
    d.PublishNamespaceCancel: st.builds(d.PublishNamespaceCancel, namespaces, u62, reasons),
    d.SubscribeNamespace: st.builds(d.SubscribeNamespace, u62, namespaces, parameters(d._SCOPE_AUTH)),
    d.SubscribeNamespaceOk: st.builds(d.SubscribeNamespaceOk, u62),
    d.SubscribeNamespaceError: _error_like(d.SubscribeNamespaceError),
    d.UnsubscribeNamespace: st.builds(d.UnsubscribeNamespace, namespaces),
}
any_message = st.one_of(*MESSAGE_STRATEGIES.values())


def frame(mtype: int, payload: bytes) -> bytes:
    return qv(mtype) + len(payload).to_bytes(2, "big") + payload


# ---------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------


def test_constants() -> None:
    assert d.VERSION == 0xFF00000E == d.draft_version(14)
    assert d.ALPN == "moq-00"
    assert d.SessionCloseCode.TOO_MANY_REQUESTS == 0x7
    assert d.FetchErrorCode.NO_OBJECTS == 0x6
    assert d.ObjectStatus.DOES_NOT_EXIST == 0x1


def test_every_message_type_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(d.MESSAGE_TYPES.values())
    assert len(d.MESSAGE_TYPES) == 30
    assert {cls.TYPE for cls in d.MESSAGE_TYPES.values()} == {int(t) for t in d.MessageType}


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(MESSAGE_STRATEGIES), ids=lambda c: c.NAME)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_message_round_trip(cls: type, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    encoded = message.encode()
    assert d.decode_message(encoded) == message
    assert d.ControlStreamParser().feed(encoded) == [message]


@settings(max_examples=60, deadline=None)
@given(st.lists(any_message, min_size=1, max_size=5), st.data())
def test_control_stream_any_split(messages: list, data: st.DataObject) -> None:
    stream = b"".join(msg.encode() for msg in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    parser = d.ControlStreamParser()
    out = []
    last = 0
    for cut in cuts + [len(stream)]:
        out += parser.feed(stream[last:cut])
        last = cut
    assert out == messages
    assert parser.buffered == 0


def test_control_stream_byte_by_byte_waits_for_the_last_byte() -> None:
    message = d.Subscribe(2, (b"kv", b"x"), b"track", filter=SubscriptionFilter.absolute_start(3, 4))
    encoded = message.encode()
    parser = d.ControlStreamParser()
    for i, byte in enumerate(encoded):
        got = parser.feed(bytes([byte]))
        assert got == ([] if i < len(encoded) - 1 else [message])


# ---------------------------------------------------------------------------
# Byte-exact layouts, written out from the draft's figures
# ---------------------------------------------------------------------------


def test_client_setup_bytes() -> None:
    msg = d.ClientSetup((d.VERSION,), d.SetupParameters(path="/x", max_request_id=100))
    payload = bytes.fromhex(
        "01"  # Number of Supported Versions
        "c0000000ff00000e"  # 0xff00000e as an 8-byte varint
        "02"  # Number of Parameters
        "01022f78"  # PATH (odd: length + bytes) "/x"
        "024064"  # MAX_REQUEST_ID (even: varint) 100
    )
    assert msg.encode() == b"\x20\x00\x11" + payload
    assert d.decode_message(b"\x20\x00\x11" + payload) == msg


def test_server_setup_bytes() -> None:
    msg = d.ServerSetup(d.VERSION, d.SetupParameters(max_request_id=0, implementation="k"))
    payload = bytes.fromhex("c0000000ff00000e" "02" "0200" "07016b")
    assert msg.encode() == frame(0x21, payload)


def test_subscribe_bytes() -> None:
    msg = d.Subscribe(
        0, (b"ns",), b"t", 0x80, None, True, SubscriptionFilter.absolute_range(5, 1, 7),
        d.Parameters(delivery_timeout=1000),
    )
    payload = bytes.fromhex(
        "00"  # Request ID
        "01026e73"  # Track Namespace tuple ("ns")
        "0174"  # Track Name "t"
        "80"  # Subscriber Priority
        "00"  # Group Order: publisher's
        "01"  # Forward
        "04"  # Filter Type AbsoluteRange
        "0501"  # Start Location {5, 1}
        "07"  # End Group (absolute)
        "01"  # Number of Parameters
        "0243e8"  # DELIVERY_TIMEOUT 1000
    )
    assert msg.encode() == frame(0x3, payload)
    assert d.decode_message(frame(0x3, payload)) == msg


def test_subscribe_ok_and_update_bytes() -> None:
    ok = d.SubscribeOk(0, 9, 0, GroupOrder.DESCENDING, Location(3, 2), d.Parameters(max_cache_duration=5))
    assert ok.encode() == frame(0x4, bytes.fromhex("00" "09" "00" "02" "01" "0302" "01" "0405"))
    update = d.SubscribeUpdate(2, 0, Location(4, 0), 9, 1, False)
    # End Group is sent plus one; 0 would be open-ended.
    assert update.encode() == frame(0x2, bytes.fromhex("02" "00" "0400" "0a" "01" "00" "00"))
    open_ended = d.SubscribeUpdate(2, 0, Location(4, 0), None, 1, False)
    assert open_ended.encode() == frame(0x2, bytes.fromhex("02" "00" "0400" "00" "01" "00" "00"))


def test_fetch_bytes() -> None:
    standalone = d.Fetch(4, FetchType.STANDALONE, (b"a", b"b"), b"t", Location(1, 0), Location(2, 0),
                         subscriber_priority=7, group_order=GroupOrder.ASCENDING)
    payload = bytes.fromhex("04" "07" "01" "01" "02016101620174" "0100" "0200" "00")
    assert standalone.encode() == frame(0x16, payload)
    joining = d.Fetch(6, FetchType.RELATIVE_JOINING, joining_request_id=4, joining_start=2,
                      parameters=d.Parameters((AuthToken.use_value(b"tk"),)))
    payload = bytes.fromhex("06" "80" "00" "02" "04" "02" "01" "03" "04" "03" "00" "746b")
    assert joining.encode() == frame(0x16, payload)
    assert d.decode_message(frame(0x16, payload)) == joining


def test_error_done_and_goaway_bytes() -> None:
    assert d.SubscribeError(2, 4, "no").encode() == frame(0x5, bytes.fromhex("02" "04" "026e6f"))
    assert d.FetchError(2, 6, "").encode() == frame(0x19, bytes.fromhex("020600"))
    assert d.PublishDone(2, 2, 3, "x").encode() == frame(0xB, bytes.fromhex("02020301" "78"))
    assert d.Goaway("").encode() == frame(0x10, b"\x00")
    assert d.MaxRequestId(64).encode() == frame(0x15, bytes.fromhex("4040"))
    assert d.PublishNamespaceDone((b"a",)).encode() == frame(0x9, bytes.fromhex("010161"))
    assert d.UnsubscribeNamespace((b"a",)).encode() == frame(0x14, bytes.fromhex("010161"))


def test_subgroup_stream_bytes_from_the_draft_example() -> None:
    # Section 10.5 (Examples): type 0x14, alias 2, group 0, subgroup 0, priority 0.
    header = d14data.SubgroupHeader(2, 0, 0, 0, subgroup_id_mode=d.SubgroupIdMode.EXPLICIT)
    writer = d14data.SubgroupWriter(header)
    stream = (
        writer.header_bytes()
        + writer.object_header(0, 4) + b"abcd"
        + writer.object_header(1, 4) + b"efgh"
    )
    assert stream == bytes.fromhex("1402000000") + b"\x00\x04abcd" + b"\x00\x04efgh"
    items = d14data.DataStreamParser().feed(stream, end_stream=True)
    assert items == [
        header,
        d14data.SubgroupObject(0, 0, d.ObjectStatus.NORMAL, b"abcd"),
        d14data.SubgroupObject(1, 0, d.ObjectStatus.NORMAL, b"efgh"),
    ]


def test_subgroup_stream_with_extensions_bytes() -> None:
    header = d14data.SubgroupHeader(2, 0, 0, 0, has_extensions=True, subgroup_id_mode=d.SubgroupIdMode.EXPLICIT)
    writer = d14data.SubgroupWriter(header)
    exts = ((4, 2186796243), (77, b"traceID:123456"))
    block = qv(4) + qv(2186796243) + qv(77) + qv(14) + b"traceID:123456"
    assert len(block) == 1 + 8 + 2 + 1 + 14  # type 77 takes a 2-byte varint
    first = writer.object_header(0, 4, extensions=exts)
    assert first == b"\x00" + qv(len(block)) + block + b"\x04"
    second = writer.object_header(1, 4)
    assert second == b"\x00\x00\x04"
    stream = writer.header_bytes() + first + b"abcd" + second + b"efgh"
    assert stream[:1] == b"\x15"
    items = d14data.DataStreamParser().feed(stream)
    assert items[1] == d14data.SubgroupObject(0, 0, d.ObjectStatus.NORMAL, b"abcd", exts)
    assert items[2] == d14data.SubgroupObject(1, 0, d.ObjectStatus.NORMAL, b"efgh")


def test_subgroup_types_and_status_objects() -> None:
    # 0x1A: subgroup ID is the first Object ID, end of group, no extensions.
    header = d14data.SubgroupHeader(1, 5, None, 3, end_of_group=True, subgroup_id_mode=d.SubgroupIdMode.FIRST_OBJECT)
    assert header.stream_type() == 0x1A
    writer = d14data.SubgroupWriter(header)
    stream = (
        header.encode()
        + writer.object_header(7, 1) + b"z"
        + writer.object_header(9, 0, status=d.ObjectStatus.END_OF_GROUP)
    )
    assert stream == bytes.fromhex("1a010503" "0701") + b"z" + bytes.fromhex("010003")
    items = d14data.DataStreamParser().feed(stream, end_stream=True)
    assert items[0] == d14data.SubgroupHeader(1, 5, None, 3, False, True, d.SubgroupIdMode.FIRST_OBJECT)
    assert items[1:] == [
        d14data.SubgroupObject(7, 7, d.ObjectStatus.NORMAL, b"z"),
        d14data.SubgroupObject(9, 7, d.ObjectStatus.END_OF_GROUP, b""),
    ]
    assert [t for t in range(0x100) if d14data.is_subgroup_stream_type(t)] == [
        0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x18, 0x19, 0x1A, 0x1B, 0x1C, 0x1D
    ]


def test_fetch_stream_bytes() -> None:
    obj = d14data.encode_fetch_object(3, 1, 4, 2, publisher_priority=9)
    assert obj == bytes.fromhex("03" "01" "04" "09" "00" "02")
    gone = d14data.encode_fetch_object(3, 1, 5, 0, status=d.ObjectStatus.END_OF_TRACK)
    assert gone == bytes.fromhex("030105" "80" "00" "00" "04")
    stream = d14data.FetchHeader(6).encode() + obj + b"hi" + gone
    assert stream[:2] == b"\x05\x06"
    items = d14data.DataStreamParser().feed(stream, end_stream=True)
    assert items == [
        d14data.FetchHeader(6),
        d14data.FetchObject(3, 1, 4, 9, d.ObjectStatus.NORMAL, b"hi"),
        d14data.FetchObject(3, 1, 5, 128, d.ObjectStatus.END_OF_TRACK, b""),
    ]


def test_datagram_bytes() -> None:
    assert d14data.ObjectDatagram(1, 2, 0, b"xy", 5).encode() == bytes.fromhex("04010205") + b"xy"
    assert d14data.ObjectDatagram(1, 2, 3, b"xy", 5, end_of_group=True).encode() == bytes.fromhex("0201020305") + b"xy"
    with_ext = d14data.ObjectDatagram(1, 2, 3, b"", 5, extensions=((2, 1),))
    assert with_ext.encode() == bytes.fromhex("010102030502" "0201")
    status = d14data.ObjectDatagram(1, 2, 0, b"", 5, status=d.ObjectStatus.END_OF_TRACK)
    assert status.encode() == bytes.fromhex("2001020005" "04")
    for datagram in (with_ext, status):
        assert d14data.decode_datagram(datagram.encode()) == datagram


# ---------------------------------------------------------------------------
# Data stream round trips
# ---------------------------------------------------------------------------


@st.composite
def subgroup_streams(draw):
    mode = draw(st.sampled_from(list(d.SubgroupIdMode)))
    has_ext = draw(st.booleans())
    subgroup = {d.SubgroupIdMode.ZERO: 0, d.SubgroupIdMode.FIRST_OBJECT: None}.get(mode, draw(u62))
    header = d14data.SubgroupHeader(draw(u62), draw(u62), subgroup, draw(u8), has_ext, draw(st.booleans()), mode)
    ids = sorted(set(draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=6))))
    objects = []
    for object_id in ids:
        status = draw(st.sampled_from(list(d.ObjectStatus)))
        payload = draw(st.binary(min_size=1, max_size=40)) if status == d.ObjectStatus.NORMAL else b""
        exts = draw(extensions) if has_ext and status != d.ObjectStatus.DOES_NOT_EXIST else ()
        objects.append((object_id, status, payload, exts))
    return header, objects


@settings(max_examples=100, deadline=None)
@given(subgroup_streams(), st.data())
def test_subgroup_stream_round_trip(stream_spec, data: st.DataObject) -> None:
    header, objects = stream_spec
    writer = d14data.SubgroupWriter(header)
    stream = writer.header_bytes()
    for object_id, status, payload, exts in objects:
        stream += writer.object_header(object_id, len(payload), extensions=exts, status=status) + payload
    first = objects[0][0]
    subgroup = first if header.subgroup_id is None else header.subgroup_id
    expected = [header] + [d14data.SubgroupObject(o, subgroup, s, p, e) for o, s, p, e in objects]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    parser = d14data.DataStreamParser()
    items = []
    last = 0
    for cut in cuts:
        items += parser.feed(stream[last:cut])
        last = cut
    items += parser.feed(stream[last:], end_stream=True)
    assert items == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(u62, u62, u62, u8, st.sampled_from(list(d.ObjectStatus)), st.binary(min_size=1, max_size=30),
                          extensions), max_size=5), u62)
def test_fetch_stream_round_trip(objects, request_id: int) -> None:
    stream = d14data.FetchHeader(request_id).encode()
    expected: list = [d14data.FetchHeader(request_id)]
    for group, subgroup, obj, priority, status, payload, exts in objects:
        if status != d.ObjectStatus.NORMAL:
            payload = b""
        if status == d.ObjectStatus.DOES_NOT_EXIST:
            exts = ()
        stream += d14data.encode_fetch_object(group, subgroup, obj, len(payload), publisher_priority=priority,
                                        extensions=exts, status=status) + payload
        expected.append(d14data.FetchObject(group, subgroup, obj, priority, status, payload, exts))
    parser = d14data.DataStreamParser()
    items = []
    for i in range(len(stream)):
        items += parser.feed(stream[i : i + 1])
    assert items == expected
    assert parser.at_boundary


datagrams = st.one_of(
    st.builds(d14data.ObjectDatagram, u62, u62, u62, st.binary(max_size=20), u8, st.none(), extensions, st.booleans()),
    st.builds(d14data.ObjectDatagram, u62, u62, u62, st.just(b""), u8,
              st.sampled_from([s for s in d.ObjectStatus if s != d.ObjectStatus.DOES_NOT_EXIST]), extensions),
    st.builds(d14data.ObjectDatagram, u62, u62, u62, st.just(b""), u8, st.just(d.ObjectStatus.DOES_NOT_EXIST)),
)


@settings(max_examples=100, deadline=None)
@given(datagrams)
def test_datagram_round_trip(datagram: d14data.ObjectDatagram) -> None:
    assert d14data.decode_datagram(datagram.encode()) == datagram


# ---------------------------------------------------------------------------
# Truncation waits; lengths and values that do not fit raise
# ---------------------------------------------------------------------------


def test_truncated_message_waits_but_decode_message_raises() -> None:
    encoded = d.Fetch(0, FetchType.ABSOLUTE_JOINING, joining_request_id=2, joining_start=1).encode()
    for cut in range(len(encoded)):
        parser = d.ControlStreamParser()
        assert parser.feed(encoded[:cut]) == []
        assert parser.buffered == cut
        with pytest.raises(ProtocolViolation):
            d.decode_message(encoded[:cut])


def test_truncated_data_stream_waits_and_fin_inside_raises() -> None:
    writer = d14data.SubgroupWriter(d14data.SubgroupHeader(1, 2, 3, 4, has_extensions=True))
    stream = writer.header_bytes() + writer.object_header(0, 3, extensions=((1, b"e" * 300),)) + b"abc"
    header_length = len(writer.header_bytes())
    for cut in range(1, len(stream)):
        parser = d14data.DataStreamParser()
        items = parser.feed(stream[:cut])
        assert all(not isinstance(i, d14data.SubgroupObject) for i in items)
        if cut == header_length:  # a subgroup stream with no objects may end here
            assert parser.feed(b"", end_stream=True) == []
            continue
        with pytest.raises(ProtocolViolation):
            parser.feed(b"", end_stream=True)
    with pytest.raises(ProtocolViolation):
        d14data.DataStreamParser().feed(b"", end_stream=True)


def test_data_stream_copies_what_the_caller_may_reuse() -> None:
    writer = d14data.SubgroupWriter(d14data.SubgroupHeader(1, 2, 3, 4, has_extensions=True))
    exts = ((1, b"e" * 300),)
    stream = writer.header_bytes() + writer.object_header(0, 5, extensions=exts) + b"hello"
    parser = d14data.DataStreamParser()
    items = []
    chunk = bytearray(1)
    for byte in stream:
        chunk[0] = byte
        items += parser.feed(chunk)
        chunk[0] = 0xFF  # the caller reuses its buffer
    items += parser.feed(memoryview(b""), end_stream=True)
    assert items[1:] == [d14data.SubgroupObject(0, 3, d.ObjectStatus.NORMAL, b"hello", exts)]


def test_length_longer_than_fields_raises() -> None:
    payload = d.Unsubscribe(1).encode()[3:] + b"\x00"
    with pytest.raises(ProtocolViolation, match="exceeds"):
        d.decode_message(frame(0xA, payload))
    with pytest.raises(ProtocolViolation, match="exceeds"):
        d.ControlStreamParser().feed(frame(0xA, payload))
    with pytest.raises(ProtocolViolation):
        d.decode_message(d.Unsubscribe(1).encode() + b"\x00")


def test_inner_length_over_the_message_raises() -> None:
    # Track Name Length says 50 bytes; the message ends first.
    payload = bytes.fromhex("00" "010161" "32") + b"t"
    with pytest.raises(ProtocolViolation, match="shorter"):
        d.ControlStreamParser().feed(frame(0x3, payload))


@pytest.mark.parametrize(
    "mtype, payload, match",
    [
        (0x3, "00 010161 0174 80 00 02 02 00", "Forward"),
        (0x3, "00 010161 0174 80 03 01 02 00", "group order"),
        (0x3, "00 010161 0174 80 00 01 05 00", "filter type"),
        (0x3, "00 00 0174 80 00 01 02 00", "namespace of 0"),
        (0x3, "00 010161 0174 80 00 01 04 0500 04 00", "end group"),
        (0x4, "00 01 00 00 00 00", "group order"),
        (0x4, "00 01 00 01 02 00", "Content Exists"),
        (0x18, "00 01 02 0000 00", "End Of Track"),
        (0x16, "00 80 00 04 00", "fetch type"),
        (0x2, "00 00 0500 03 80 01 00", "end group"),
        (0x20, "00 00", "versions"),
        (0x21, "c0000001ffffffff 00", "32-bit"),
        (0x5, "00 00 4401" + "61" * 0x401, "reason phrase"),
        (0x10, "6001" + "61" * 0x2001, "URI"),
        (0x3, "00 010161 0174 80 00 01 02 02 0201 0202", "repeated"),
        (0x3, "00 010161 0174 80 00 01 02 01 01 80010000" + "00" * 10, "Key-Value-Pair value"),
        (0x3, "00 010161 0174 80 00 01 02 40ff", "cannot fit"),
    ],
)
def test_bad_values_raise(mtype: int, payload: str, match: str) -> None:
    with pytest.raises(ProtocolViolation, match=match):
        d.decode_message(frame(mtype, bytes.fromhex(payload.replace(" ", ""))))


def test_namespace_limits() -> None:
    too_many = "21" + "0161" * 33
    with pytest.raises(ProtocolViolation, match="namespace of 33"):
        d.decode_message(frame(0x9, bytes.fromhex(too_many)))
    long_name = bytes.fromhex("00" "01" "4800") + b"a" * 2048 + bytes.fromhex("4801") + b"b" * 2049
    with pytest.raises(ProtocolViolation, match="4096"):
        d.decode_message(frame(0x3, long_name))
    # Empty fields are valid in draft-14.
    assert d.decode_message(d.PublishNamespaceDone((b"",)).encode()) == d.PublishNamespaceDone((b"",))
    with pytest.raises(ValueError):
        d.PublishNamespaceDone(()).encode()


def test_a_subscribe_namespace_prefix_of_no_fields_is_accepted() -> None:
    """moq-rs subscribes to every namespace with a prefix of no fields right after SETUP; a
    namespace of no fields anywhere else still closes the session."""
    # SUBSCRIBE_NAMESPACE (0x11): Request ID 2, prefix of 0 fields, 0 parameters
    assert d.decode_message(frame(0x11, bytes.fromhex("02" "00" "00"))) == d.SubscribeNamespace(2, ())
    assert d.decode_message(frame(0x14, bytes.fromhex("00"))) == d.UnsubscribeNamespace(())
    # PUBLISH_NAMESPACE (0x6): Request ID 2, namespace of 0 fields
    with pytest.raises(ProtocolViolation, match="namespace of 0 fields"):
        d.decode_message(frame(0x6, bytes.fromhex("02" "00" "00")))


def test_unknown_types_raise() -> None:
    with pytest.raises(ProtocolViolation, match="unknown message type"):
        d.decode_message(frame(0x50, b""))
    # The parser does not wait for the payload of a type it cannot decode.
    with pytest.raises(ProtocolViolation, match="unknown message type"):
        d.ControlStreamParser().feed(b"\x40\x41")
    for stream_type in (0x04, 0x16, 0x17, 0x1E):
        with pytest.raises(ProtocolViolation, match="stream type"):
            d14data.DataStreamParser().feed(qv(stream_type) + b"\x00" * 8)
    for dtype in (0x08, 0x22, 0x40):
        with pytest.raises(ProtocolViolation, match="datagram type"):
            d14data.decode_datagram(qv(dtype) + b"\x00" * 8)


def test_bad_objects_raise() -> None:
    with pytest.raises(ProtocolViolation, match="object status"):
        d14data.DataStreamParser().feed(bytes.fromhex("1001020300" "0002"))
    with pytest.raises(ProtocolViolation, match="does not exist"):
        d14data.DataStreamParser().feed(bytes.fromhex("1101020300" "02" "0201" "0001"))
    with pytest.raises(ProtocolViolation, match="crosses"):
        d14data.DataStreamParser().feed(bytes.fromhex("1101020300" "02" "0105" "05") + b"abcde")
    with pytest.raises(ObjectTooLarge):
        d14data.DataStreamParser(max_object_size=10).feed(bytes.fromhex("1001020300" "0b"))
    with pytest.raises(ObjectTooLarge):
        d14data.DataStreamParser(max_extensions_size=10).feed(bytes.fromhex("1101020300" "0b"))
    with pytest.raises(ProtocolViolation, match="no extensions"):
        d14data.decode_datagram(bytes.fromhex("0101020305" "00") + b"x")
    with pytest.raises(ProtocolViolation, match="trailing"):
        d14data.decode_datagram(bytes.fromhex("2001020305" "03" "00"))
    with pytest.raises(ProtocolViolation, match="does not exist"):
        d14data.decode_datagram(bytes.fromhex("2101020305" "02" "0201" "01"))
    with pytest.raises(ProtocolViolation, match="truncated"):
        d14data.decode_datagram(bytes.fromhex("000102"))
    with pytest.raises(ProtocolViolation, match="after the end"):
        parser = d14data.DataStreamParser()
        parser.feed(d14data.FetchHeader(1).encode(), end_stream=True)
        parser.feed(b"\x00")


def test_encoders_refuse_what_the_draft_forbids() -> None:
    with pytest.raises(ValueError):
        d14data.SubgroupWriter(d14data.SubgroupHeader(1, 2)).object_header(0, 1, extensions=((2, 1),))
    writer = d14data.SubgroupWriter(d14data.SubgroupHeader(1, 2))
    writer.object_header(5, 1)
    with pytest.raises(ValueError):
        writer.object_header(5, 1)
    with pytest.raises(ValueError):
        d14data.encode_fetch_object(0, 0, 0, 3, status=d.ObjectStatus.END_OF_GROUP)
    with pytest.raises(ValueError):
        d14data.ObjectDatagram(1, 2, 3, b"", status=d.ObjectStatus.NORMAL, end_of_group=True).encode()
    with pytest.raises(ValueError):
        d.Subscribe(0, (b"a",), b"t", parameters=d.Parameters(max_cache_duration=1)).encode()
    with pytest.raises(ValueError):
        d.Subscribe(0, (b"a",), b"t", parameters=d.Parameters(unknown=((2, 1),))).encode()
    with pytest.raises(ValueError):
        d.SubscribeOk(0, 1, group_order=None).encode()  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        d.ClientSetup(()).encode()
    with pytest.raises(ValueError):
        d.Goaway("u" * (d.MAX_GOAWAY_URI + 1)).encode()


# ---------------------------------------------------------------------------
# Parameters: unknown kept and ignored, tokens, setup parameters
# ---------------------------------------------------------------------------


def test_unknown_parameters_are_kept_and_may_repeat() -> None:
    payload = bytes.fromhex(
        "00" "010161" "0174" "80" "00" "01" "02"
        "05"  # five parameters
        "4021" "02" "6869"  # unknown odd 0x21, bytes "hi"
        "4021" "00"  # the same unknown type again
        "40a0" "05"  # unknown even 0xa0 = 5
        "04" "07"  # MAX_CACHE_DURATION: known, but not a SUBSCRIBE parameter: ignored
        "02" "09"  # DELIVERY_TIMEOUT
    )
    msg = d.decode_message(frame(0x3, payload))
    assert isinstance(msg, d.Subscribe)
    assert msg.parameters.delivery_timeout == 9
    assert msg.parameters.max_cache_duration is None
    assert msg.parameters.unknown == ((0x21, b"hi"), (0x21, b""), (0xA0, 5), (4, 7))
    assert d.decode_message(msg.encode()) == msg
    assert msg.to_draft18().parameters.object_delivery_timeout == 9


def test_authorization_tokens() -> None:
    tokens = (AuthToken.register(1, b"secret", 2), AuthToken.use_alias(1))
    msg = d.PublishNamespace(2, (b"a",), d.Parameters(tokens))
    assert d.decode_message(msg.encode()) == msg
    bad_token = bytes.fromhex("02" "010161" "01" "03" "01" "07")  # alias type 7
    with pytest.raises(KeyValueFormattingError):
        d.decode_message(frame(0x6, bad_token))


def test_setup_parameters() -> None:
    payload = bytes.fromhex(
        "01" "c0000000ff00000e" "04"
        "0103" "2f6b76"  # PATH "/kv"
        "0501" "68"  # AUTHORITY "h"
        "4077" "01" "00"  # unknown (grease) setup parameter: kept
        "0402"  # MAX_AUTH_TOKEN_CACHE_SIZE 2
    )
    msg = d.decode_message(frame(0x20, payload))
    assert msg == d.ClientSetup(
        (d.VERSION,),
        d.SetupParameters(path="/kv", authority="h", max_auth_token_cache_size=2, unknown=((0x77, b"\x00"),)),
    )
    with pytest.raises(ProtocolViolation, match="repeated"):
        d.decode_message(frame(0x21, bytes.fromhex("01" "02" "0201" "0202")))
    with pytest.raises(MalformedPath):
        d.decode_message(frame(0x21, bytes.fromhex("01" "01" "0101" "ff")))
    with pytest.raises(MalformedAuthority):
        d.decode_message(frame(0x21, bytes.fromhex("01" "01" "0501" "ff")))
    with pytest.raises(ValueError):
        d.ServerSetup(parameters=d.SetupParameters(unknown=((1, b"/"),))).encode()


# ---------------------------------------------------------------------------
# Conversion to and from the draft-18 dataclasses
# ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(_subscribe_like(d.Subscribe))
def test_subscribe_draft18_conversion(msg: d.Subscribe) -> None:
    converted = msg.to_draft18()
    assert isinstance(converted, m18.Subscribe)
    assert converted.parameters.subscription_filter == msg.filter
    back = d.Subscribe.from_draft18(converted)
    expected = d.Parameters(msg.parameters.authorization_tokens, msg.parameters.delivery_timeout)
    assert back == d.Subscribe(msg.request_id, msg.namespace, msg.track_name, msg.subscriber_priority,
                               msg.group_order, msg.forward, msg.filter, expected)


def test_subscribe_from_draft18_defaults() -> None:
    back = d.Subscribe.from_draft18(m18.Subscribe(4, (b"a",), b"t"))
    assert back == d.Subscribe(4, (b"a",), b"t", 128, None, True, SubscriptionFilter.absolute_start(0, 0))
    assert m18.decode_message(d.Subscribe(4, (b"a",), b"t").to_draft18().encode()) is not None


@settings(max_examples=100, deadline=None)
@given(fetches())
def test_fetch_draft18_conversion(msg: d.Fetch) -> None:
    converted = msg.to_draft18()
    assert (converted.fetch_type, converted.start, converted.end) == (msg.fetch_type, msg.start, msg.end)
    expected = d.Parameters(msg.parameters.authorization_tokens)
    back = d.Fetch.from_draft18(converted)
    assert back == d.Fetch(msg.request_id, msg.fetch_type, msg.namespace, msg.track_name, msg.start, msg.end,
                           msg.joining_request_id, msg.joining_start, msg.subscriber_priority, msg.group_order,
                           expected)


def test_response_conversions() -> None:
    ok = d.SubscribeOk(2, 7, 1000, GroupOrder.DESCENDING, Location(4, 1), d.Parameters(max_cache_duration=9))
    ok18 = ok.to_draft18()
    assert ok18.parameters.largest_object == Location(4, 1)
    assert d.SubscribeOk.from_draft18(ok18, 2) == ok
    fetch_ok = d.FetchOk(4, GroupOrder.ASCENDING, True, Location(9, 0), d.Parameters(max_cache_duration=3))
    assert d.FetchOk.from_draft18(fetch_ok.to_draft18(), 4) == fetch_ok
    status = d.TrackStatus(8, (b"a",), b"t", parameters=d.Parameters((AuthToken.use_alias(3),)))
    assert d.TrackStatus.from_draft18(status.to_draft18()) == status
    status_ok = d.TrackStatusOk(8, 0, 0, GroupOrder.DESCENDING, Location(2, 2))
    status_ok18 = status_ok.to_draft18()
    assert isinstance(status_ok18, m18.RequestOk)
    assert m18.decode_message(status_ok18.encode()) == status_ok18
    assert d.TrackStatusOk.from_draft18(status_ok18, 8) == status_ok
    err = d.SubscribeError(2, d.SubscribeErrorCode.TRACK_DOES_NOT_EXIST, "gone").to_draft18()
    assert (err.error_code, err.reason) == (m18.RequestErrorCode.DOES_NOT_EXIST, "gone")
    assert d.FetchError.from_draft18(err, 6) == d.FetchError(6, d.FetchErrorCode.TRACK_DOES_NOT_EXIST, "gone")
    assert d.FetchError(1, d.FetchErrorCode.UNKNOWN_STATUS_IN_RANGE).to_draft18().error_code == 0
    done = d.PublishDone(2, d.PublishDoneCode.EXPIRED, 3, "bye")
    assert done.to_draft18() == m18.PublishDone(0x6, 3, "bye")
    assert d.PublishDone.from_draft18(done.to_draft18(), 2) == done


def test_object_conversions() -> None:
    inner = ((0x3E, 2), (0x2C, 1))
    immutable = d.encode_extensions(inner)
    obj = d14data.SubgroupObject(3, 0, d.ObjectStatus.NORMAL, b"p", ((0x3C, 1), (0x0B, immutable), (0x02, 5)))
    obj18 = obj.to_draft18()
    assert obj18 is not None
    assert [t for t, _ in obj18.properties] == [0x02, 0x0B, 0x3C]
    assert d14data.SubgroupObject.from_draft18(obj18).extensions == ((0x02, 5), (0x0B, d.encode_extensions(
        sorted(inner))), (0x3C, 1))
    assert d14data.SubgroupObject(3, 0, d.ObjectStatus.DOES_NOT_EXIST, b"").to_draft18() is None

    header = d14data.SubgroupHeader(1, 2, None, 7, True, True, d.SubgroupIdMode.FIRST_OBJECT)
    header18 = header.to_draft18()
    assert header18.stream_type() & 0x0F == header.stream_type() & 0x0F
    assert d14data.SubgroupHeader.from_draft18(header18) == header

    fetched = d14data.FetchObject(1, 2, 3, 4, d.ObjectStatus.NORMAL, b"x")
    assert d14data.FetchObject.from_draft18(fetched.to_draft18()) == fetched  # type: ignore[arg-type]
    assert d14data.FetchObject(1, 2, 3, 4, d.ObjectStatus.END_OF_GROUP, b"").to_draft18() is None

    datagram = d14data.ObjectDatagram(1, 2, 3, b"x", 9, extensions=((4, 4),), end_of_group=True)
    datagram18 = datagram.to_draft18()
    assert datagram18 is not None
    assert data18.decode_datagram(datagram18.encode()) == datagram18
    assert d14data.ObjectDatagram.from_draft18(datagram18) == datagram
