import hashlib
import json

import pytest

from kvsp_moq.errors import BadDescriptor
from kvsp_moq.protocol.compat import (
    CompatDescriptor,
    canonical_number,
    content_digest,
    format_positional,
    model_digest,
)
from tests.fixtures import DESCRIPTOR


def plain_jcs(d: dict) -> bytes:
    # For this descriptor (ASCII strings, small integers) JCS is sorted keys, no whitespace.
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def test_compat_id_known_answer():
    expected = hashlib.sha256(b"KVSP-COMPAT-1\x00" + plain_jcs(DESCRIPTOR)).hexdigest()
    assert CompatDescriptor.from_dict(DESCRIPTOR).compat_hex == expected


def test_compat_id_independent_of_member_order():
    reordered = dict(reversed(list(DESCRIPTOR.items())))
    assert CompatDescriptor.from_dict(reordered).compat_id == CompatDescriptor.from_dict(DESCRIPTOR).compat_id


def test_every_member_changes_the_id():
    base = CompatDescriptor.from_dict(DESCRIPTOR).compat_id
    changes = {"model": "x", "layers": 5, "kv_heads": 4, "head_dim": 16, "kv_dtype": "float16",
               "positional": "rope", "block_tokens": 32,
               "model_digest": "sha-256:" + "00" * 32}
    for name, value in changes.items():
        assert CompatDescriptor.from_dict({**DESCRIPTOR, name: value}).compat_id != base, name
    with_adapter = {**DESCRIPTOR, "adapters": ["sha-256:" + "11" * 32]}
    assert CompatDescriptor.from_dict(with_adapter).compat_id != base


def test_round_trip():
    d = CompatDescriptor.from_dict(DESCRIPTOR)
    assert d.to_dict() == DESCRIPTOR
    assert CompatDescriptor.from_dict(d.to_dict()) == d


@pytest.mark.parametrize(
    "change, member",
    [
        ({"layers": "4"}, "layers"),
        ({"layers": 0}, "layers"),
        ({"layers": True}, "layers"),
        ({"kv_dtype": "float64"}, "kv_dtype"),
        ({"positional": "rotary"}, "positional"),
        ({"positional": "rope;theta=500000.0"}, "positional"),
        ({"positional": "rope;scale=2;theta=1"}, None),
        ({"positional": "rope;theta=1;scale=2"}, "positional"),
        ({"model_digest": "sha-256:" + "AB" * 32}, "model_digest"),
        ({"model_digest": "sha256:" + "ab" * 32}, "model_digest"),
        ({"adapters": []}, "adapters"),
        ({"adapters": ["nope"]}, "adapters[0]"),
        ({"layout": "other"}, "layout"),
        ({"extra": 1}, "extra"),
        ({"model": ""}, "model"),
    ],
)
def test_invalid_descriptors_name_the_member(change, member):
    d = {**DESCRIPTOR, **change}
    if member is None:
        CompatDescriptor.from_dict(d)  # valid
        return
    with pytest.raises(BadDescriptor) as e:
        CompatDescriptor.from_dict(d)
    assert e.value.member == member


@pytest.mark.parametrize("name", list(DESCRIPTOR))
def test_missing_member_is_named(name):
    d = dict(DESCRIPTOR)
    del d[name]
    with pytest.raises(BadDescriptor) as e:
        CompatDescriptor.from_dict(d)
    assert e.value.member == name


def test_positional_formatting():
    assert format_positional("rope", {"theta": 500000.0}) == "rope;theta=500000"
    assert format_positional("rope", {"theta": 1e4, "factor": 0.25}) == "rope;factor=0.25;theta=10000"
    assert format_positional("none") == "none"
    assert canonical_number(1.5e-7) == "1.5e-07"


def test_model_digest_streams_files_in_name_byte_order(tmp_path):
    # "B" (0x42) sorts before "a" (0x61) in byte order.
    (tmp_path / "a.safetensors").write_bytes(b"second")
    (tmp_path / "B.safetensors").write_bytes(b"first")
    expected = "sha-256:" + hashlib.sha256(b"firstsecond").hexdigest()
    files = [tmp_path / "a.safetensors", tmp_path / "B.safetensors"]
    # the caller reads the files; compat only hashes what it is given, chunk by chunk
    assert model_digest((p.name, iter([p.read_bytes()[:3], p.read_bytes()[3:]]))
                        for p in files) == expected
    assert content_digest([(tmp_path / "a.safetensors").read_bytes()]) == (
        "sha-256:" + hashlib.sha256(b"second").hexdigest())
    with pytest.raises(BadDescriptor):
        model_digest([])
