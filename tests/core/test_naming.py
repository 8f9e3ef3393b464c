import base64
import hashlib

import pytest
from hypothesis import given, strategies as st

from kvsp_moq.errors import BadRecord
from kvsp_moq.naming import BlockTrack, decode_namespace, encode_namespace, publisher_id, scope_of_namespace


def test_block_track_namespace_known_answer():
    t = BlockTrack.for_holder("aa" * 32, "bb" * 16, "cc" * 32, "http://127.0.0.1:8801/")
    pid = hashlib.sha256(b"http://127.0.0.1:8801/").digest()[:16]
    assert t.publisher_id == pid == publisher_id("http://127.0.0.1:8801/")
    raw = (b"\x04kvsp" + b"\x20" + b"\xaa" * 32 + b"\x10" + b"\xbb" * 16 + b"\x10" + pid
           + b"\x20" + b"\xcc" * 32)
    assert t.moqt_namespace == base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert t.track_name == b"1" and t.announce_prefix == t.namespace[:4]
    assert BlockTrack.from_record_namespace(t.moqt_namespace) == t
    assert scope_of_namespace(t.namespace) == b"\xbb" * 16
    assert scope_of_namespace((b"other", b"x", b"y")) is None


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
