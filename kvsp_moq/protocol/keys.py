"""Scope keys, Scope IDs and Block Keys (KVSP §4.2).

Block Keys form an HMAC chain, so a key names its whole prefix. Deriving keys for a long
prompt is on the request path, so the HMAC is keyed once per scope: the inner and outer
SHA-256 states (RFC 2104) are prepared once, the chain's constant prefix is absorbed into the
inner state, and each block only copies those states.
"""

from __future__ import annotations

import array
import hashlib
import sys
from typing import Iterable, Sequence

import numpy as np

from kvsp_moq.errors import BadRecord

SCOPE_LABEL = b"KVSP-SCOPE-1\x00"
BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
MIN_SCOPE_KEY_OCTETS = 32
ZERO_KEY = bytes(32)
_SHA256_BLOCK = 64


def check_scope_key(scope_key: bytes) -> bytes:
    if not isinstance(scope_key, (bytes, bytearray)) or len(scope_key) < MIN_SCOPE_KEY_OCTETS:
        raise BadRecord(
            f"a scope key must have at least {MIN_SCOPE_KEY_OCTETS} octets", member="scope_key"
        )
    return bytes(scope_key)


def scope_id(scope_key: bytes) -> bytes:
    """First 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key)."""
    return hashlib.sha256(SCOPE_LABEL + check_scope_key(scope_key)).digest()[:16]


def parse_scope_key_hex(text: str) -> bytes:
    """A scope key written as hex text (a key file), whitespace ignored."""
    cleaned = "".join(text.split())
    try:
        key = bytes.fromhex(cleaned)
    except ValueError:
        raise BadRecord("scope key file must hold hex text", member="scope_key") from None
    return check_scope_key(key)


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as uint32 in network byte order, refusing values outside [0, 2^32)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise BadRecord("tokens must be a flat array", member="tokens")
        if tokens.dtype.kind not in "iu":
            raise BadRecord("tokens must be integers", member="tokens")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
            raise BadRecord("token out of range [0, 2^32)", member="tokens")
        return tokens.astype(">u4").tobytes()
    try:
        packed = array.array("I", tokens)  # C-speed range and type check
    except OverflowError:
        raise BadRecord("token out of range [0, 2^32)", member="tokens") from None
    except TypeError:
        raise BadRecord("tokens must be integers", member="tokens") from None
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


class BlockKeyChain:
    """The Block Key chain of one token sequence, extendable as tokens are appended.

    Generated tokens extend the chain without recomputing the prefix; tokens after the last
    complete block wait in `tail` until the block completes.
    """

    def __init__(
        self,
        scope_key: bytes,
        compat_id: bytes,
        block_tokens: int,
        *,
        keys: Iterable[bytes] = (),
    ) -> None:
        key = check_scope_key(scope_key)
        if len(compat_id) != 32:
            raise BadRecord("compat_id must be 32 octets", member="compat_id")
        if block_tokens < 1:
            raise BadRecord("block_tokens must be positive", member="block_tokens")
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_SHA256_BLOCK, b"\x00")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._inner.update(BLOCK_LABEL + bytes(compat_id))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        self.block_tokens = block_tokens
        self.keys: list[bytes] = list(keys)
        self.tail: list[int] = []

    @property
    def last(self) -> bytes:
        return self.keys[-1] if self.keys else ZERO_KEY

    @property
    def token_count(self) -> int:
        """Tokens covered by complete blocks plus the pending tail."""
        return len(self.keys) * self.block_tokens + len(self.tail)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Append tokens; returns the keys of the blocks they complete."""
        b = self.block_tokens
        if self.tail:
            tokens = self.tail + (tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens))
        data = tokens_to_bytes(tokens)
        complete = len(tokens) // b * b
        rest = tokens[complete:]
        self.tail = rest.tolist() if isinstance(rest, np.ndarray) else list(rest)
        step = 4 * b
        inner, outer = self._inner, self._outer
        prev = self.last
        new: list[bytes] = []
        view = memoryview(data)
        for off in range(0, 4 * complete, step):
            i = inner.copy()
            i.update(prev)
            i.update(view[off : off + step])
            o = outer.copy()
            o.update(i.digest())
            prev = o.digest()
            new.append(prev)
        self.keys.extend(new)
        return new


def block_keys(
    scope_key: bytes, compat_id: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int
) -> list[bytes]:
    """Block Keys of every complete block of `tokens`, in prefix order."""
    return BlockKeyChain(scope_key, compat_id, block_tokens).extend(tokens)
