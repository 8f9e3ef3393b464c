import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt.d18.data import (
    DataStreamParser,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchStreamWriter,
    ObjectDatagram,
    PaddingDatagram,
    PaddingHeader,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    SubgroupWriter,
    decode_datagram,
    encode_padding_stream,
    is_subgroup_stream_type,
)
from kvsp_moq.moqt.errors import SESSION_ENDING, ObjectTooLarge, ProtocolViolation
from kvsp_moq.moqt.varint import encode_vi64
from kvsp_moq.moqt.wire import GroupOrder, Location, ObjectStatus

from .strategies import properties


def feed_in_pieces(data: bytes, piece: int, **kwargs) -> list:
    parser = DataStreamParser(**kwargs)
    items = []
    for i in range(0, len(data), piece):
        items += parser.feed(data[i : i + piece])
    items += parser.feed(b"", end_stream=True)
    return items


def subgroup_stream(header: SubgroupHeader, objects: list[tuple[int, bytes]]) -> bytes:
    writer = SubgroupWriter(header)
    out = [writer.header_bytes()]
    for object_id, payload in objects:
        out += [writer.object_header(object_id, len(payload)), payload]
    return b"".join(out)


def test_spec_example_subgroup_stream():
    # Section 11.5 example: type 0x14, alias 2, group 0, subgroup 0, priority 0.
    data = bytes.fromhex("14020000" "00") + b"\x00\x04abcd" + b"\x00\x04efgh"
    items = feed_in_pieces(data, 1000)
    header = items[0]
    assert header == SubgroupHeader(2, 0, 0, 0, False, False, False, SubgroupIdMode.EXPLICIT)
    assert [(o.object_id, o.payload) for o in items[1:]] == [(0, b"abcd"), (1, b"efgh")]


def test_spec_example_with_properties():
    # Section 11.5 second example: type 0x35 (properties, explicit subgroup, default priority).
    props = b"\x04" + encode_vi64(2186796243) + encode_vi64(77 - 4) + b"\x0e" + b"traceID:123456"
    assert len(props) == 22
    data = b"\x35\x02\x00\x00" + b"\x00" + encode_vi64(len(props)) + props + b"\x04abcd" + b"\x00\x00\x04efgh"
    items = feed_in_pieces(data, 3)
    assert items[0].publisher_priority is None and items[0].has_properties
    first, second = items[1:]
    assert first.properties == ((4, 2186796243), (77, b"traceID:123456"))
    assert (first.payload, second.object_id, second.payload, second.properties) == (b"abcd", 1, b"efgh", ())


@pytest.mark.parametrize(
    "header",
    [
        SubgroupHeader(1, 2, 0),
        SubgroupHeader(1, 2, 7, 3),
        SubgroupHeader(9, 300, 0, None, has_properties=True),
        SubgroupHeader(5, 0, 5, 1, end_of_group=True, first_object=False, subgroup_id_mode=SubgroupIdMode.FIRST_OBJECT),
    ],
)
@pytest.mark.parametrize("piece", [1, 5, 4096])
def test_subgroup_round_trip(header, piece):
    objects = [(5, os.urandom(3000)), (6, b""), (9, b"x"), (10, os.urandom(70000))]
    writer = SubgroupWriter(header)
    data = [writer.header_bytes()]
    for object_id, payload in objects:
        props = ((2, object_id),) if header.has_properties and payload else ()
        if payload:
            data += [writer.object_header(object_id, len(payload), properties=props), payload]
        else:
            data.append(writer.object_header(object_id, 0, status=ObjectStatus.NORMAL))
    data.append(writer.object_header(11, 0, status=ObjectStatus.END_OF_GROUP))
    items = feed_in_pieces(b"".join(data), piece)
    received = items[0]
    assert received.stream_type() == header.stream_type()
    assert (received.track_alias, received.group_id, received.publisher_priority) == (
        header.track_alias,
        header.group_id,
        header.publisher_priority,
    )
    got = [(o.object_id, o.payload) for o in items[1:-1]]
    assert got == objects
    expected_subgroup = 5 if header.subgroup_id_mode == SubgroupIdMode.FIRST_OBJECT else header.subgroup_id
    assert all(o.subgroup_id == expected_subgroup for o in items[1:])
    assert items[-1].status == ObjectStatus.END_OF_GROUP


def test_objects_are_yielded_before_the_stream_ends():
    payloads = [os.urandom(50_000) for _ in range(3)]
    data = subgroup_stream(SubgroupHeader(0, 0), list(enumerate(payloads)))
    parser = DataStreamParser()
    cut = len(data) - len(payloads[2]) // 2  # inside the last payload
    items = parser.feed(data[:cut])
    assert [o.payload for o in items[1:]] == payloads[:2]
    assert not parser.at_boundary
    items = parser.feed(data[cut:], end_stream=True)
    assert [o.payload for o in items] == payloads[2:]


def test_fin_inside_an_object_is_a_protocol_violation():
    data = subgroup_stream(SubgroupHeader(0, 0), [(0, b"abcdef")])
    parser = DataStreamParser()
    with pytest.raises(ProtocolViolation):
        parser.feed(data[:-2], end_stream=True)


def test_fin_inside_the_header_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x14\x02", end_stream=True)


@pytest.mark.parametrize("stream_type", [0x16, 0x17, 0x1E, 0x3F, 0x7E, 0x80, 0x0F, 0x00, 0x06])
def test_invalid_stream_types_are_protocol_violations(stream_type):
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(encode_vi64(stream_type) + b"\x00" * 8)


def test_valid_subgroup_types_are_exactly_the_drafts_set():
    valid = {t for t in range(0x200) if is_subgroup_stream_type(t)}
    expected = set()
    for base in (0x10, 0x30, 0x50, 0x70):
        expected |= set(range(base, base + 6)) | set(range(base + 8, base + 14))
    assert valid == expected


def test_unknown_object_status_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x10\x00\x00\x80" + b"\x00\x00\x02")


def test_properties_on_a_status_object_are_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x11\x00\x00\x80" + b"\x00" + b"\x02\x02\x05" + b"\x00\x03")


def test_declared_object_size_over_the_limit_raises_before_the_payload_arrives():
    parser = DataStreamParser(max_object_size=1000)
    with pytest.raises(ObjectTooLarge):
        parser.feed(b"\x10\x00\x00\x80" + b"\x00" + encode_vi64(1001))
    parser = DataStreamParser()
    with pytest.raises(ObjectTooLarge):
        parser.feed(b"\x10\x00\x00\x80" + b"\x00" + encode_vi64(2**60))


def test_properties_length_over_the_limit_is_rejected():
    parser = DataStreamParser(max_properties_size=100)
    with pytest.raises(ObjectTooLarge):
        parser.feed(b"\x11\x00\x00\x80" + b"\x00" + encode_vi64(101))


def test_property_crossing_its_block_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        # Block of 2 bytes holding an odd type that declares 5 value bytes.
        DataStreamParser().feed(b"\x11\x00\x00\x80" + b"\x00\x02\x01\x05" + b"\x01z")


def test_padding_stream_is_discarded():
    items = feed_in_pieces(encode_padding_stream(5000), 700)
    assert items == [PaddingHeader()]


@pytest.mark.parametrize("order", [GroupOrder.ASCENDING, GroupOrder.DESCENDING])
@pytest.mark.parametrize("piece", [1, 7, 100000])
def test_fetch_stream_round_trip(order, piece):
    if order == GroupOrder.ASCENDING:
        groups = [1, 1, 1, 4, 4, 9]
    else:
        groups = [9, 9, 4, 4, 1, 1]
    objects = []
    last_object = {}
    for i, group in enumerate(groups):
        object_id = last_object.get(group, -1) + (1 if i % 3 else 2)
        last_object[group] = object_id
        subgroup = [0, 0, 1, 2, None, 7][i]
        objects.append((group, object_id, subgroup, 100 + i % 2, os.urandom(i * 1000)))
    writer = FetchStreamWriter(42, order)
    data = [writer.header_bytes()]
    for group, object_id, subgroup, priority, payload in objects:
        data += [
            writer.object_header(group, object_id, len(payload), subgroup_id=subgroup, publisher_priority=priority),
            payload,
        ]
    data.append(writer.end_of_range(groups[-1], 99, unknown=True))
    items = feed_in_pieces(b"".join(data), piece, fetch_group_order=lambda rid: order if rid == 42 else None)
    assert items[0] == FetchHeader(42)
    got = [(o.group_id, o.object_id, o.subgroup_id, o.publisher_priority, o.payload) for o in items[1:-1]]
    assert got == objects
    assert items[-1] == FetchEndOfRange(Location(groups[-1], 99), True)


def test_fetch_object_after_end_of_range_uses_the_range_as_prior():
    writer = FetchStreamWriter(1)
    data = writer.header_bytes() + writer.end_of_range(3, 4)
    data += writer.object_header(3, 5, 1) + b"a"
    data += writer.object_header(6, 0, 1) + b"b"
    items = feed_in_pieces(data, 1)
    assert items[1] == FetchEndOfRange(Location(3, 4), False)
    assert [(o.group_id, o.object_id, o.payload) for o in items[2:]] == [(3, 5, b"a"), (6, 0, b"b")]


@pytest.mark.parametrize(
    "body",
    [
        b"\x04\x00\x00",  # first object without Group ID
        b"\x0c\x00\x00\x00",  # first object without Priority (flag 0x10 unset)
        b"\x1d\x00\x00\x80\x00",  # first object refers to the prior Subgroup
        b"\x80\x01",  # flags >= 0x80 that are not an End of Range
    ],
)
def test_malformed_fetch_objects(body):
    with pytest.raises(ProtocolViolation):
        DataStreamParser().feed(b"\x05\x00" + body)


def test_descending_fetch_below_group_zero_is_a_protocol_violation():
    writer = FetchStreamWriter(0, GroupOrder.DESCENDING)
    data = writer.header_bytes() + writer.object_header(1, 0, 0) + b"\x08\x05\x00"
    parser = DataStreamParser(fetch_group_order=lambda rid: GroupOrder.DESCENDING)
    with pytest.raises(ProtocolViolation):
        parser.feed(data)


def test_fetch_writer_enforces_order():
    writer = FetchStreamWriter(0)
    writer.object_header(5, 3, 0)
    with pytest.raises(ValueError):
        writer.object_header(4, 0, 0)
    with pytest.raises(ValueError):
        writer.object_header(5, 2, 0)


def test_subgroup_writer_enforces_ascending_objects():
    writer = SubgroupWriter(SubgroupHeader(0, 0))
    writer.object_header(3, 1)
    with pytest.raises(ValueError):
        writer.object_header(3, 1)


@pytest.mark.parametrize(
    "datagram",
    [
        ObjectDatagram(1, 2, 0, b"payload"),
        ObjectDatagram(1, 2, 3, b"payload", None, properties=((2, 9),), end_of_group=True),
        ObjectDatagram(7, 0, 4, b"", 5, status=ObjectStatus.END_OF_TRACK),
        ObjectDatagram(7, 0, 0, b"", None, status=ObjectStatus.NORMAL, properties=((0x3D, b"p"),)),
    ],
)
def test_datagram_round_trip(datagram):
    assert decode_datagram(datagram.encode()) == datagram


@pytest.mark.parametrize(
    "data",
    [
        b"\x22\x00\x00\x00\x00",  # STATUS with END_OF_GROUP
        b"\x10\x00\x00",  # outside 0b00X0XXXX
        b"\x30\x00\x00",
        b"\x01\x00\x00\x00\x80\x00x",  # PROPERTIES bit, empty properties
        b"\x21\x00\x00\x00\x80\x02\x02\x01\x03",  # status 3 with properties
        b"\x20\x00\x00\x00\x80\x07",  # unknown status
        b"\x20\x00\x00\x00\x80\x00\x00",  # trailing bytes after a status
        b"\x00\x00",  # truncated
    ],
)
def test_malformed_datagrams(data):
    with pytest.raises(ProtocolViolation):
        decode_datagram(data)


def test_padding_datagram():
    assert decode_datagram(encode_vi64(0x132B3E29) + bytes(10)) == PaddingDatagram()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=120), st.integers(1, 16))
def test_arbitrary_bytes_to_the_stream_parser_yield_items_or_a_session_error(data, piece):
    parser = DataStreamParser(max_object_size=10_000)
    try:
        for i in range(0, len(data), piece):
            for item in parser.feed(data[i : i + piece]):
                assert isinstance(item, (SubgroupHeader, SubgroupObject, FetchHeader, FetchObject,
                                         FetchEndOfRange, PaddingHeader))
        parser.feed(b"", end_stream=True)
    except SESSION_ENDING:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([0x10, 0x11, 0x15, 0x05, 0x39, 0x5D]), st.binary(max_size=100))
def test_arbitrary_bodies_after_valid_stream_types(stream_type, body):
    parser = DataStreamParser(max_object_size=10_000)
    try:
        parser.feed(encode_vi64(stream_type) + body, end_stream=True)
    except SESSION_ENDING:
        pass


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=80))
def test_arbitrary_datagrams_decode_or_raise_a_session_error(data):
    try:
        decode_datagram(data)
    except SESSION_ENDING:
        pass


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=300), properties(max_size=2)), min_size=1, max_size=8),
    st.integers(1, 64),
)
def test_random_subgroups_round_trip_in_random_pieces(objects, piece):
    header = SubgroupHeader(3, 1, 0, 9, has_properties=True)
    writer = SubgroupWriter(header)
    data = [writer.header_bytes()]
    object_id = -1
    expected = []
    for gap, payload, props in objects:
        object_id += gap + 1
        if not payload:
            props = ()
            data.append(writer.object_header(object_id, 0, properties=props, status=ObjectStatus.NORMAL))
        else:
            data += [writer.object_header(object_id, len(payload), properties=props), payload]
        expected.append((object_id, payload, props))
    items = feed_in_pieces(b"".join(data), piece)
    assert [(o.object_id, o.payload, o.properties) for o in items[1:]] == expected
