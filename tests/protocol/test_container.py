import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadContainer, DigestMismatch, LayersUnavailable
from kvsp_moq.protocol.container import Container, encode, iter_encoded, replica_digest


def plain_container(first, tokens, layers, codec=1):
    """§4.3 written out field by field."""
    out = b"KVB1" + bytes([1, 0]) + struct.pack(">H", codec)
    out += struct.pack(">III", first, len(layers), tokens)
    for k, v in layers:
        out += struct.pack(">QQ", len(k), len(v))
    for k, v in layers:
        out += k + v
    return out


LAYERS = [(bytes([i]) * (8 + i), bytes([100 + i]) * (8 + i)) for i in range(4)]


def test_encode_known_answer_and_parse():
    data = encode(2, 3, LAYERS)
    assert data == plain_container(2, 3, LAYERS)
    c = Container(data)
    assert (c.version, c.flags, c.codec, c.first_layer, c.layer_count, c.token_count) == (1, 0, 1, 2, 4, 3)
    assert bytes(c.layer(3).k) == LAYERS[1][0] and bytes(c.layer(3).v) == LAYERS[1][1]
    assert b"".join(iter_encoded(2, 3, LAYERS)) == data


def test_digests_known_answer():
    c = Container(encode(0, 1, LAYERS))
    digests = [hashlib.sha256(k + v).digest() for k, v in LAYERS]
    assert c.layer_digests() == digests
    assert c.digest() == hashlib.sha256(b"".join(digests)).digest() == replica_digest(digests)
    summary = c.describe()
    assert summary["digest"] == "sha-256:" + c.digest().hex()
    assert summary["layers"][1] == {"layer": 1, "k_len": 9, "v_len": 9,
                                    "digest": "sha-256:" + digests[1].hex()}


def test_sections_are_views_not_copies():
    buf = bytearray(encode(0, 1, LAYERS))
    c = Container(buf)
    k = c.layer(0).k
    buf[c.data_offset] = 0xEE
    assert k[0] == 0xEE


def test_numpy_views_shape_and_values():
    k = np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4)
    v = -k
    c = Container(encode(0, 2, [(k.tobytes(), v.tobytes())]))
    ka, va = c.layer(0).arrays(3, 4, "float32")
    assert ka.shape == (2, 3, 4) and np.array_equal(ka, k) and np.array_equal(va, v)
    with pytest.raises(BadContainer):
        c.layer(0).arrays(5, 4, "float32")


def test_slice_extracts_layer_range():
    c = Container(encode(0, 7, LAYERS))
    s = Container(c.slice(1, 2))
    assert (s.first_layer, s.layer_count, s.token_count) == (1, 2, 7)
    assert s.layer_digests() == c.layer_digests()[1:3]
    assert s.slice(1, 2) == c.slice(1, 2)
    with pytest.raises(LayersUnavailable):
        c.slice(2, 4)
    with pytest.raises(LayersUnavailable):
        c.layer(9)


def test_verify_against_record_digests():
    c = Container(encode(0, 1, LAYERS))
    digests = c.layer_digests()
    Container(c.slice(2, 3)).verify(digests)
    bad = list(digests)
    bad[2] = bytes(32)
    with pytest.raises(DigestMismatch):
        Container(c.slice(2, 3)).verify(bad)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d[:10], "truncated"),
        (lambda d: b"KVB2" + d[4:], "magic"),
        (lambda d: d[:4] + b"\x02" + d[5:], "version"),
        (lambda d: d + b"\x00", "trailing"),
        (lambda d: d[:-1], "past the end"),
        (lambda d: d[:12] + struct.pack(">I", 2**30) + d[16:], "layer table"),
        (lambda d: d[:20] + struct.pack(">Q", 2**63) + d[28:], "past the end"),
        (lambda d: d[:8] + struct.pack(">I", 0xFFFFFFFF) + d[12:], "2^32"),
    ],
)
def test_malformed_containers_are_refused(mutate, message):
    data = encode(0, 1, LAYERS)
    with pytest.raises(BadContainer) as e:
        Container(mutate(data))
    assert message in str(e.value)


def test_empty_container_is_valid():
    c = Container(encode(5, 0, []))
    assert c.layer_count == 0 and c.layer_digests() == []


@given(st.binary(max_size=300))
def test_any_bytes_give_a_container_or_a_clean_error(data):
    try:
        c = Container(data)
    except BadContainer:
        return
    assert c.layer_digests() is not None
    assert len(encode(c.first_layer, c.token_count,
                      [(bytes(layer.k), bytes(layer.v)) for layer in c.layers()], codec=c.codec)) == len(data)


@given(st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=40)), max_size=6),
       st.integers(0, 2**32 - 7), st.integers(0, 2**32 - 1), st.integers(0, 0xFFFF))
def test_round_trip(layers, first, tokens, codec):
    c = Container(encode(first, tokens, layers, codec=codec))
    assert [(bytes(layer.k), bytes(layer.v)) for layer in c.layers()] == layers
    assert (c.first_layer, c.token_count, c.codec) == (first, tokens, codec)


@given(st.binary(min_size=1, max_size=200), st.data())
def test_single_bit_flip_is_refused_or_changes_a_digest(payload, data):
    layers = [(payload, payload[::-1])]
    original = encode(0, 1, layers)
    pos = data.draw(st.integers(0, len(original) - 1))
    flipped = bytearray(original)
    flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        c = Container(bytes(flipped))
    except BadContainer:
        return
    changed_header = pos < c.data_offset
    assert changed_header or c.digest() != Container(original).digest()
