import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.moqt.errors import BufferReadError, ProtocolViolation
from kvsp_moq.moqt.varint import (
    QUIC_VARINT,
    U64_MAX,
    Buffer,
    decode_quic_varint,
    decode_vi64,
    encode_quic_varint,
    encode_vi64,
    vi64_size,
)

# Draft-18 section 1.3.1, "Example Integer Encodings".
SPEC_EXAMPLES = [
    ("25", 37),
    ("8025", 37),
    ("bbbd", 15293),
    ("ed7f3e7d", 226442877),
    ("faa1a0e403d8", 2893212287960),
    ("fc8998abc66bc0", 151288809941952),
    ("fefa318fa8e3ca11", 70423237261249041),
    ("ffffffffffffffffff", 18446744073709551615),
]


@pytest.mark.parametrize("hexed,value", SPEC_EXAMPLES)
def test_vi64_decodes_the_draft_examples(hexed, value):
    data = bytes.fromhex(hexed)
    assert decode_vi64(data) == (value, len(data))


@pytest.mark.parametrize("hexed,value", [e for e in SPEC_EXAMPLES if e[0] != "8025"])
def test_vi64_encodes_the_draft_examples_minimally(hexed, value):
    assert encode_vi64(value).hex() == hexed


@pytest.mark.parametrize(
    "value,size", [(0, 1), (127, 1), (128, 2), (16383, 2), (16384, 3), (2**56 - 1, 8), (2**56, 9), (U64_MAX, 9)]
)
def test_vi64_size_boundaries(value, size):
    assert vi64_size(value) == size
    assert len(encode_vi64(value)) == size


def test_vi64_rejects_out_of_range_values():
    with pytest.raises(ValueError):
        encode_vi64(-1)
    with pytest.raises(ValueError):
        encode_vi64(U64_MAX + 1)
    with pytest.raises(ValueError):
        encode_vi64(300, size=1)


@given(st.integers(0, U64_MAX), st.integers(1, 9))
def test_vi64_round_trip_in_any_valid_length(value, size):
    size = max(size, vi64_size(value))
    encoded = encode_vi64(value, size)
    assert len(encoded) == size
    assert decode_vi64(encoded + b"tail") == (value, size)


@given(st.integers(0, U64_MAX))
def test_vi64_truncated_raises_buffer_read_error(value):
    encoded = encode_vi64(value)
    for cut in range(len(encoded)):
        with pytest.raises(BufferReadError):
            decode_vi64(encoded[:cut])


def test_buffer_read_error_is_a_protocol_violation():
    assert issubclass(BufferReadError, ProtocolViolation)


@given(st.integers(0, 2**62 - 1))
def test_quic_varint_round_trip(value):
    encoded = encode_quic_varint(value)
    assert decode_quic_varint(encoded) == (value, len(encoded))


def test_quic_varint_rfc9000_example():
    assert decode_quic_varint(bytes.fromhex("c2197c5eff14e88c")) == (151288809941952652, 8)
    assert encode_quic_varint(15293) == bytes.fromhex("7bbd")


def test_buffer_bounds_and_views():
    buf = Buffer(b"\x05hello\x80\x25\x00\x01")
    assert buf.pull_varint() == 5
    view = buf.pull_view(5)
    assert isinstance(view, memoryview) and bytes(view) == b"hello"
    assert buf.pull_varint() == 37
    assert buf.pull_uint16() == 1
    assert buf.eof()
    with pytest.raises(BufferReadError):
        buf.pull_uint8()


def test_buffer_end_limits_reads():
    buf = Buffer(b"\x01\x02\x03\x04", 0, 2)
    assert buf.pull_uint16() == 0x0102
    with pytest.raises(BufferReadError):
        buf.pull_uint8()
    sub = Buffer(b"abcdef").pull_buffer(3)
    assert sub.pull_rest() == b"abc"


def test_buffer_with_quic_codec():
    buf = Buffer(encode_quic_varint(1000) + encode_quic_varint(7), codec=QUIC_VARINT)
    assert (buf.pull_varint(), buf.pull_varint()) == (1000, 7)
