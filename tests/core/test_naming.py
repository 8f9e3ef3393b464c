import base64
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadRecord
from kvsp_moq.moqt.wire import property_value
from kvsp_moq.naming import (
    K_LENGTH_PROPERTY,
    TOKEN_COUNT_PROPERTY,
    BlockTrack,
    decode_namespace,
    encode_namespace,
    layer_properties,
    moqt_record,
    pass_first_block,
    pass_properties,
    pass_track_name,
    publisher_id,
    scope_of_namespace,
    split_layer,
    split_pass,
)
from kvsp_moq.protocol.container import Container
from kvsp_moq.protocol.records import ReplicaRecord, replica_id
from tests.block_tracks import COMPAT, HTTP_HOLDER, SCOPE, container, key


def test_block_track_namespace_known_answer():
    t = BlockTrack.for_holder("aa" * 32, "bb" * 16, "cc" * 32, "http://127.0.0.1:8801/")
    pid = hashlib.sha256(b"http://127.0.0.1:8801/").digest()[:16]
    assert t.publisher_id == pid == publisher_id("http://127.0.0.1:8801/")
    # Every ID is its lowercase hex in ASCII: 64, 32, 32 and 64 octets.
    raw = (b"\x04kvsp" + b"\x40" + b"aa" * 32 + b"\x20" + b"bb" * 16 + b"\x20" + pid.hex().encode()
           + b"\x40" + b"cc" * 32)
    assert t.moqt_namespace == base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert t.track_name == b"1" and t.announce_prefix == t.namespace[:4]
    assert BlockTrack.from_record_namespace(t.moqt_namespace) == t
    assert BlockTrack.from_namespace(t.namespace) == t
    assert scope_of_namespace(t.namespace) == "bb" * 16
    assert scope_of_namespace((b"other", b"x", b"y")) is None


def test_every_namespace_field_is_text():
    """moq-rs closes its session on a namespace field that is not UTF-8."""
    t = BlockTrack.for_holder("ff" * 32, "80" * 16, "00" * 32, "http://h/")
    for field in t.namespace:
        field.decode("ascii")


@pytest.mark.parametrize("field", [b"\xaa" * 32, b"AA" * 32, b"aa" * 31, b"aa" * 33, b"zz" * 32])
def test_a_compat_field_that_is_not_lowercase_hex_is_refused(field):
    t = BlockTrack.for_holder("aa" * 32, "bb" * 16, "cc" * 32, "http://h/")
    with pytest.raises(BadRecord, match="compat_id"):
        BlockTrack.from_namespace((b"kvsp", field) + t.namespace[2:])


def test_two_holders_give_two_tracks():
    a = BlockTrack.for_holder("aa" * 32, "bb" * 16, "cc" * 32, "http://h1/")
    b = BlockTrack.for_holder("aa" * 32, "bb" * 16, "cc" * 32, "http://h2/")
    assert a.namespace != b.namespace


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_namespace_round_trip(fields):
    assert decode_namespace(encode_namespace(fields)) == tuple(fields)


@pytest.mark.parametrize("text", ["AAA=", "!!!", "BGt2c3A"])
def test_bad_namespace_text(text):
    with pytest.raises(BadRecord):
        BlockTrack.from_record_namespace(text)


def test_layer_properties_split_k_from_v():
    props = layer_properties(16, 3)
    assert property_value(props, TOKEN_COUNT_PROPERTY) == 16 and property_value(props, K_LENGTH_PROPERTY) == 3
    layer, tokens = split_layer(4, b"kkkvv", props)
    assert (bytes(layer.k), bytes(layer.v), layer.index, tokens) == (b"kkk", b"vv", 4, 16)
    layer, tokens = split_layer(0, b"kkvv", ())
    assert (bytes(layer.k), bytes(layer.v), tokens) == (b"kk", b"vv", None)
    with pytest.raises(BadRecord):
        split_layer(0, b"odd", ())
    with pytest.raises(BadRecord):
        split_layer(0, b"ab", layer_properties(1, 9))

def test_a_pass_object_splits_into_its_slots_and_its_track_names_its_first_block():
    digests = bytes(range(32)) + bytes(range(32, 64))
    keys = bytes.fromhex(key(1) + key(2))
    slots = split_pass(3, b"kkvvKKVV", pass_properties(16, 2, digests, keys))
    assert [(bytes(k), bytes(v), d, b) for k, v, d, b in slots] == [(b"kk", b"vv", digests[:32], key(1)),
                                                                    (b"KK", b"VV", digests[32:], key(2))]
    without_keys = pass_properties(16, 2, digests, keys)[:3]
    for payload, props in ((b"kkvvKKV", pass_properties(16, 2, digests, keys)),  # slots of unequal size
                           (b"kkvv", pass_properties(16, 3, digests, keys)),  # K longer than a slot
                           (b"kkvv", pass_properties(16, 2, digests[:31], keys)),  # not whole digests
                           (b"kkvvKKVV", pass_properties(16, 2, digests, keys[:32])),  # a key short
                           (b"kkvvKKVV", without_keys),  # slots that do not say which blocks they are
                           (b"kkvv", layer_properties(16, 2))):  # a block's layer, not a pass's
        with pytest.raises(BadRecord):
            split_pass(0, payload, props)
    first = BlockTrack.for_holder(COMPAT, SCOPE, key(5), HTTP_HOLDER)
    assert pass_track_name() == b"pass-1"
    assert pass_first_block(first.namespace, pass_track_name()) == first
    assert pass_first_block(first.namespace, first.track_name) is None  # the block's own track
    with pytest.raises(BadRecord):
        pass_first_block(first.namespace, b"pass-x")


def test_moqt_record_names_relay_namespace_and_http_holder():
    data = container(1, layers=4, section=10)
    whole = Container(data)
    http = ReplicaRecord(block_key=key(1), compat_id=COMPAT, scope_id=SCOPE, holder=HTTP_HOLDER, codec=1,
                         size=len(data), digest="sha-256:" + whole.digest().hex(), ttl_ms=60_000,
                         layer_digests=tuple(d.hex() for d in whole.layer_digests()))
    record = moqt_record(http, "moqt://127.0.0.1:4443")
    assert record.holder == "moqt://127.0.0.1:4443" and record.http_holder == HTTP_HOLDER
    fields = decode_namespace(record.moqt_namespace)
    assert fields == (b"kvsp", COMPAT.encode(), SCOPE.encode(), publisher_id(HTTP_HOLDER).hex().encode(),
                      key(1).encode())
    assert ReplicaRecord.from_json(record.to_json()) == record
    assert replica_id(record.holder, record.moqt_namespace) != replica_id(http.holder)
    with pytest.raises(BadRecord):
        moqt_record(http, "http://not-moqt/")
    with pytest.raises(BadRecord):
        moqt_record(record, "moqt://127.0.0.1:1")
