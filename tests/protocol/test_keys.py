import hashlib
import hmac
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadRecord
from kvsp_moq.protocol.keys import (
    BlockKeyChain,
    block_keys,
    parse_scope_key_hex,
    scope_id,
    tokens_to_bytes,
)

KEY = bytes(range(32))
COMPAT = hashlib.sha256(b"compat").digest()


def plain_keys(key: bytes, compat: bytes, tokens: list[int], b: int) -> list[bytes]:
    """§4.2 written out literally."""
    prev = bytes(32)
    out = []
    for i in range(len(tokens) // b):
        msg = b"KVSP-BLOCK-1" + b"\x00" + compat + prev
        for t in tokens[i * b:(i + 1) * b]:
            msg += struct.pack(">I", t)
        prev = hmac.new(key, msg, hashlib.sha256).digest()
        out.append(prev)
    return out


def test_scope_id_known_answer():
    assert scope_id(KEY) == hashlib.sha256(b"KVSP-SCOPE-1\x00" + KEY).digest()[:16]
    assert len(scope_id(KEY)) == 16


def test_short_scope_key_refused():
    with pytest.raises(BadRecord):
        scope_id(bytes(31))
    with pytest.raises(BadRecord):
        parse_scope_key_hex("00" * 31)
    with pytest.raises(BadRecord):
        parse_scope_key_hex("zz" * 32)
    assert parse_scope_key_hex(" " + "0f" * 32 + "\n") == bytes([15]) * 32


def test_block_keys_match_plain_hmac():
    tokens = list(range(100, 100 + 16 * 5 + 7))
    assert block_keys(KEY, COMPAT, tokens, 16) == plain_keys(KEY, COMPAT, tokens, 16)


def test_long_scope_key_is_hashed_like_hmac():
    key = bytes(range(100))
    tokens = list(range(32))
    assert block_keys(key, COMPAT, tokens, 8) == plain_keys(key, COMPAT, tokens, 8)


def test_only_complete_blocks_have_keys():
    assert block_keys(KEY, COMPAT, list(range(15)), 16) == []
    assert len(block_keys(KEY, COMPAT, list(range(33)), 16)) == 2


def test_numpy_and_list_inputs_agree():
    tokens = np.arange(64, dtype=np.int64) * 1000
    assert block_keys(KEY, COMPAT, tokens, 16) == block_keys(KEY, COMPAT, tokens.tolist(), 16)


def test_out_of_range_tokens_refused():
    for bad in ([-1], [2**32], [1.5], ["1"]):
        with pytest.raises(BadRecord):
            block_keys(KEY, COMPAT, bad * 16, 16)
    with pytest.raises(BadRecord):
        tokens_to_bytes(np.array([1.0]))
    assert tokens_to_bytes([0xFFFFFFFF, 1]) == b"\xff\xff\xff\xff\x00\x00\x00\x01"


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(0, 200),
       st.integers(1, 20))
def test_incremental_extension_equals_one_shot(tokens, cut, b):
    cut = min(cut, len(tokens))
    chain = BlockKeyChain(KEY, COMPAT, b)
    first = chain.extend(tokens[:cut])
    second = chain.extend(tokens[cut:])
    assert first + second == block_keys(KEY, COMPAT, tokens, b) == chain.keys
    assert chain.token_count == len(tokens)
    assert len(chain.tail) == len(tokens) % b


@given(st.lists(st.integers(0, 2**32 - 1), min_size=32, max_size=64), st.integers(0, 15))
def test_a_key_names_its_whole_prefix(tokens, pos):
    # Changing any token of block 0 changes the key of every later block.
    keys = block_keys(KEY, COMPAT, tokens, 16)
    changed = list(tokens)
    changed[pos] = (changed[pos] + 1) % 2**32
    other = block_keys(KEY, COMPAT, changed, 16)
    assert all(a != b for a, b in zip(keys, other))


def test_scopes_and_compat_separate_keys():
    tokens = list(range(32))
    other_key = bytes(32 * [7])
    assert set(block_keys(KEY, COMPAT, tokens, 16)).isdisjoint(block_keys(other_key, COMPAT, tokens, 16))
    assert set(block_keys(KEY, COMPAT, tokens, 16)).isdisjoint(
        block_keys(KEY, hashlib.sha256(b"x").digest(), tokens, 16))
