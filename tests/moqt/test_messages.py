import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt import wire
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.errors import (
    SESSION_ENDING,
    KeyValueFormattingError,
    MalformedPath,
    ProtocolViolation,
)
from kvsp_moq.moqt.varint import encode_vi64

from .strategies import messages

NS = (b"kvsp", b"c" * 32)


def frame(mtype: int, payload: bytes) -> bytes:
    return encode_vi64(mtype) + len(payload).to_bytes(2, "big") + payload


@settings(max_examples=300, deadline=None)
@given(messages())
def test_every_message_round_trips(message):
    encoded = message.encode()
    assert m.decode_message(encoded) == message


@settings(max_examples=100, deadline=None)
@given(st.lists(messages(), min_size=1, max_size=4), st.integers(1, 9))
def test_control_stream_parser_splits_messages_fed_in_pieces(batch, piece):
    data = b"".join(message.encode() for message in batch)
    parser = m.ControlStreamParser()
    out = []
    for i in range(0, len(data), piece):
        out += parser.feed(data[i : i + piece])
    assert out == batch
    assert parser.buffered == 0


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_a_session_error(data):
    try:
        message = m.decode_message(data)
    except SESSION_ENDING:
        return
    assert isinstance(message, m.Message)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(m.MESSAGE_TYPES[18])), st.binary(max_size=48))
def test_arbitrary_payloads_of_each_type_decode_or_raise(mtype, payload):
    try:
        message = m.decode_message(frame(mtype, payload))
    except SESSION_ENDING:
        return
    assert m.decode_message(message.encode()) == message


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_control_stream_parser_on_garbage(data):
    parser = m.ControlStreamParser()
    try:
        parser.feed(data)
    except SESSION_ENDING:
        pass


def test_setup_uses_type_0x2f00_as_a_two_byte_vi64():
    encoded = m.Setup(path="/a").encode()
    assert encoded[:2] == b"\xaf\x00"
    # PATH option (type 1, odd: length-prefixed), then MOQT_IMPLEMENTATION absent.
    assert encoded[2:] == b"\x00\x04" + b"\x01\x02/a"


def test_subscribe_wire_format():
    message = m.Subscribe(2, (b"ns",), b"t", m.Parameters(forward=True, subscriber_priority=200))
    payload = b"\x02" + b"\x01\x02ns" + b"\x01t" + b"\x02" + b"\x10\x01" + b"\x10\xc8"
    assert message.encode() == frame(0x3, payload)


def test_subscribe_namespace_type_is_one_byte_vi64():
    assert m.SubscribeNamespace(0, (b"a",)).encode()[0] == 0x50


def test_parameters_are_delta_coded_in_ascending_order():
    params = m.Parameters(
        authorization_tokens=(wire.AuthToken.use_value(b"x"), wire.AuthToken.use_value(b"y")),
        largest_object=wire.Location(1, 2),
    )
    w = wire.Writer()
    params.encode(w)
    # count 3; AUTH 0x03 (token USE_VALUE type 0), again delta 0, LARGEST 0x09 delta 6
    assert bytes(w.data) == b"\x03" + b"\x03\x03\x03\x00x" + b"\x00\x03\x03\x00y" + b"\x06\x01\x02"


def test_unknown_message_type_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x3F, b""))


@pytest.mark.parametrize("extra", [b"\x00", b"\x00\x00\x00"])
def test_length_longer_than_fields_is_a_protocol_violation(extra):
    payload = m.PublishDone(2, 1, "x").encode()[3:]
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0xB, payload + extra))


def test_length_shorter_than_fields_is_a_protocol_violation():
    payload = m.PublishDone(2, 1, "xyz").encode()[3:]
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0xB, payload[:-1]))


def _subscribe_with_raw_parameters(raw: bytes, count: int) -> bytes:
    return frame(0x3, b"\x00" + b"\x01\x02ns" + b"\x01t" + bytes([count]) + raw)


@pytest.mark.parametrize(
    "raw,count,why",
    [
        (b"\x11\x00", 1, "unknown parameter 0x11"),
        (b"\x08\x05", 1, "EXPIRES is not allowed in SUBSCRIBE"),
        (b"\x10\x01\x00\x01", 2, "FORWARD repeated"),
        (b"\x10\x02", 1, "FORWARD of 2"),
        (b"\x22\x03", 1, "GROUP_ORDER of 3"),
        (b"\x21\x01\x07", 1, "filter type 7"),
        (b"\x21\x03\x04\x01\x02", 1, "absolute range cut short"),
        (b"\x21\x02\x01\x00", 1, "filter longer than its fields"),
        (b"\x20", 1, "truncated priority"),
    ],
)
def test_malformed_parameters_are_protocol_violations(raw, count, why):
    with pytest.raises(ProtocolViolation):
        m.decode_message(_subscribe_with_raw_parameters(raw, count))


def test_parameter_count_beyond_the_payload_is_rejected_before_looping():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x3, b"\x00\x01\x02ns\x01t" + encode_vi64(2**40)))


def test_undecodable_token_is_a_key_value_formatting_error():
    with pytest.raises(KeyValueFormattingError):
        m.decode_message(_subscribe_with_raw_parameters(b"\x03\x01\x07", 1))  # alias type 7
    with pytest.raises(KeyValueFormattingError):
        m.decode_message(_subscribe_with_raw_parameters(b"\x03\x03\x02\x05\x00", 1))  # USE_ALIAS + junk


def test_fetch_ok_carries_no_parameters():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x18, b"\x00\x01\x01\x01\x08\x05"))


def test_fetch_ok_end_of_track_must_be_0_or_1():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x18, b"\x02\x01\x01\x00"))


def test_fetch_type_4_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x16, b"\x00\x04\x00\x00\x00"))


def _namespace(count: int, size: int) -> bytes:
    return encode_vi64(count) + (encode_vi64(size) + b"a" * size) * count


@pytest.mark.parametrize(
    "namespace",
    [_namespace(33, 1), _namespace(1, 0), _namespace(2, 2049)],
    ids=["33 fields", "empty field", "over 4096 bytes"],
)
def test_bad_namespaces_are_protocol_violations(namespace):
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x6, b"\x00" + namespace + b"\x00"))


def test_full_track_name_over_4096_bytes_is_a_protocol_violation():
    payload = b"\x00" + _namespace(1, 4000) + encode_vi64(97) + b"t" * 97 + b"\x00"
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x3, payload))


def test_reason_phrase_over_1024_bytes_is_a_protocol_violation():
    payload = b"\x00\x00" + encode_vi64(1025) + b"r" * 1025
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0xB, payload))


def test_goaway_uri_over_8192_bytes_is_a_protocol_violation():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x10, encode_vi64(8193) + b"u" * 8193 + b"\x00"))


def test_key_value_value_over_65535_is_rejected():
    # A SUBSCRIBE_OK whose track property (odd type) declares 65536 bytes.
    payload = b"\x01\x00" + b"\x41" + encode_vi64(65536)
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x4, payload))


def test_track_property_value_ranges():
    with pytest.raises(ProtocolViolation):
        m.decode_message(m.SubscribeOk(1, track_properties=((0x22, 3),)).encode())
    with pytest.raises(ProtocolViolation):
        m.decode_message(m.SubscribeOk(1, track_properties=((0x30, 2),)).encode())


def test_unknown_properties_are_kept_in_order():
    props = ((0x38, 5), (0x3801, b"abc"), (0x4000, 1))
    decoded = m.decode_message(m.Publish(1, NS, b"1", 4, track_properties=props).encode())
    assert decoded.track_properties == props
    assert wire.mandatory_properties(decoded.track_properties) == [0x4000]


def test_setup_keeps_unknown_options_and_allows_their_duplicates():
    # 0x9D (odd, a grease value) twice, then 0x9E (even): delta-coded types.
    payload = encode_vi64(0x9D) + b"\x01a" + b"\x00\x01b" + b"\x01\x05"
    decoded = m.decode_message(frame(0x2F00, payload))
    assert decoded.unknown_options == ((0x9D, b"a"), (0x9D, b"b"), (0x9E, 5))
    assert decoded.path is None


def test_setup_rejects_a_repeated_known_option():
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x2F00, b"\x01\x01/" + b"\x00\x01/"))


def test_setup_path_must_be_utf8():
    with pytest.raises(MalformedPath):
        m.decode_message(frame(0x2F00, b"\x01\x01\xff"))


def test_request_error_redirect_only_with_redirect_code():
    with pytest.raises(ValueError):
        m.RequestErrorMessage(0x10, redirect=m.Redirect()).encode()
    with pytest.raises(ProtocolViolation):
        m.decode_message(frame(0x5, b"\x10\x00\x00" + b"\x00\x00\x00"))  # trailing redirect on DOES_NOT_EXIST
    decoded = m.decode_message(m.RequestErrorMessage(0x34, 5, "elsewhere", m.Redirect("moqt://b", NS, b"1")).encode())
    assert decoded.redirect == m.Redirect("moqt://b", NS, b"1")


def test_goaway_request_id_is_optional():
    assert m.decode_message(m.Goaway("", 10).encode()).request_id is None
    assert m.decode_message(m.Goaway("", 10, 6).encode()).request_id == 6


def test_encoders_refuse_what_the_receiver_would_reject():
    with pytest.raises(ValueError):
        m.Subscribe(0, (b"",), b"t").encode()
    with pytest.raises(ValueError):
        m.Subscribe(0, NS, b"t", m.Parameters(expires=5)).encode()
    with pytest.raises(ValueError):
        m.PublishDone(0, 0, "x" * 1025).encode()
    with pytest.raises(ValueError):
        m.Fetch(0, wire.FetchType.STANDALONE, NS, b"t")  # no range


def test_subscription_filter_end_group_is_delta_coded():
    f = wire.SubscriptionFilter.absolute_range(10, 2, 13)
    assert f.encode() == b"\x04\x0a\x02\x03"
    assert wire.SubscriptionFilter.decode(f.encode()) == f


def test_parameters_merge_keeps_absent_values():
    base = m.Parameters(forward=True, subscriber_priority=5)
    merged = base.merged(m.Parameters(subscriber_priority=9))
    assert merged == m.Parameters(forward=True, subscriber_priority=9)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_arbitrary_token_bytes_decode_or_raise_key_value_formatting_error(data):
    try:
        token = wire.AuthToken.decode(data)
    except KeyValueFormattingError:
        return
    assert wire.AuthToken.decode(token.encode()) == token


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_arbitrary_filter_bytes_decode_or_raise_a_protocol_violation(data):
    try:
        decoded = wire.SubscriptionFilter.decode(data)
    except ProtocolViolation:
        return
    assert wire.SubscriptionFilter.decode(decoded.encode()) == decoded
