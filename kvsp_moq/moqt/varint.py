"""Integer encodings used on the MOQT wire, and a bounds-checked reader.

Draft-18 replaced the RFC 9000 varint with its own "vi64" encoding (section 1.3.1):
the count of leading 1 bits in the first byte gives the length, 1 to 9 bytes, so
that all 64-bit values fit and 0-127 take one byte. Every variable-length integer in
draft-18 control messages, stream headers, objects and datagrams is a vi64; only the
control-message Length (16 bits), priorities and a few uint8 parameters are fixed
width. Non-minimal encodings are valid and must be accepted.

The RFC 9000 varint is kept here for the earlier drafts (draft-14 used it everywhere);
`IntegerCodec` bundles one encoding so a message codec for another draft can swap it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from .errors import BufferReadError

__all__ = [
    "U64_MAX",
    "VI64_MAX",
    "QUIC_VARINT_MAX",
    "BufferReadError",
    "Buffer",
    "IntegerCodec",
    "VI64",
    "QUIC_VARINT",
    "encode_vi64",
    "vi64_size",
    "decode_vi64",
    "encode_quic_varint",
    "quic_varint_size",
    "decode_quic_varint",
]

U64_MAX = (1 << 64) - 1
VI64_MAX = U64_MAX
QUIC_VARINT_MAX = (1 << 62) - 1

BytesLike = Union[bytes, bytearray, memoryview]

# ---------------------------------------------------------------------------
# vi64 (draft-18 section 1.3.1)
# ---------------------------------------------------------------------------

# Length of a vi64 from its first byte: leading 1 bits + 1, capped at 9.
_VI64_LEN = bytes(
    min(9, 1 + (8 - (b ^ 0xFF).bit_length())) if b != 0xFF else 9 for b in range(256)
)
# Mask of the value bits for an n-byte vi64 (n <= 8): 7n usable bits.
_VI64_MASK = [0] + [(1 << (7 * n)) - 1 for n in range(1, 9)]
# Length prefix (n-1 leading ones, then a zero) for an n-byte vi64, as an integer
# aligned to the top of the n-byte field.
_VI64_PREFIX = [0] + [((1 << (n - 1)) - 1) << (8 * n - n + 1) for n in range(1, 9)]
_VI64_SMALL = [bytes((i,)) for i in range(128)]


def vi64_size(value: int) -> int:
    """Bytes of the minimal vi64 encoding of `value`."""
    if value < 0x80:
        if value < 0:
            raise ValueError(f"vi64 cannot encode negative value {value}")
        return 1
    if value < 1 << 14:
        return 2
    if value < 1 << 21:
        return 3
    if value < 1 << 28:
        return 4
    if value < 1 << 35:
        return 5
    if value < 1 << 42:
        return 6
    if value < 1 << 49:
        return 7
    if value < 1 << 56:
        return 8
    if value <= U64_MAX:
        return 9
    raise ValueError(f"vi64 cannot encode {value} (over 2^64-1)")


def encode_vi64(value: int, size: int | None = None) -> bytes:
    """Encode `value` as a vi64, minimal unless `size` asks for a longer form."""
    if size is None:
        if 0 <= value < 0x80:
            return _VI64_SMALL[value]
        size = vi64_size(value)
    elif size < vi64_size(value) or not 1 <= size <= 9:
        raise ValueError(f"vi64 of {size} bytes cannot hold {value}")
    if size == 9:
        return b"\xff" + value.to_bytes(8, "big")
    return (_VI64_PREFIX[size] | value).to_bytes(size, "big")


def decode_vi64(data: BytesLike, pos: int = 0) -> tuple[int, int]:
    """Decode one vi64 at `pos`; returns (value, position after it)."""
    try:
        first = data[pos]
    except IndexError:
        raise BufferReadError("truncated vi64") from None
    if first < 0x80:
        return first, pos + 1
    size = _VI64_LEN[first]
    end = pos + size
    if end > len(data):
        raise BufferReadError("truncated vi64")
    if size == 9:
        return int.from_bytes(data[pos + 1 : end], "big"), end
    return int.from_bytes(data[pos:end], "big") & _VI64_MASK[size], end


# ---------------------------------------------------------------------------
# RFC 9000 section 16 varint (drafts before 18)
# ---------------------------------------------------------------------------


def quic_varint_size(value: int) -> int:
    """Bytes of the minimal RFC 9000 varint encoding of `value`."""
    if value < 0:
        raise ValueError(f"varint cannot encode negative value {value}")
    if value < 1 << 6:
        return 1
    if value < 1 << 14:
        return 2
    if value < 1 << 30:
        return 4
    if value <= QUIC_VARINT_MAX:
        return 8
    raise ValueError(f"varint cannot encode {value} (over 2^62-1)")


def encode_quic_varint(value: int) -> bytes:
    """Encode `value` as a minimal RFC 9000 varint."""
    size = quic_varint_size(value)
    prefix = {1: 0, 2: 0x4000, 4: 0x8000_0000, 8: 0xC000_0000_0000_0000}[size]
    return (prefix | value).to_bytes(size, "big")


def decode_quic_varint(data: BytesLike, pos: int = 0) -> tuple[int, int]:
    """Decode one RFC 9000 varint at `pos`; returns (value, position after it)."""
    try:
        first = data[pos]
    except IndexError:
        raise BufferReadError("truncated varint") from None
    size = 1 << (first >> 6)
    end = pos + size
    if end > len(data):
        raise BufferReadError("truncated varint")
    if size == 1:
        return first & 0x3F, end
    return int.from_bytes(data[pos:end], "big") & ((1 << (8 * size - 2)) - 1), end


@dataclass(frozen=True)
class IntegerCodec:
    """One variable-length integer encoding, so a draft's codec can be chosen at once."""

    name: str
    max_value: int
    encode: Callable[[int], bytes]
    decode: Callable[[BytesLike, int], tuple[int, int]]
    size: Callable[[int], int]


VI64 = IntegerCodec("vi64", VI64_MAX, encode_vi64, decode_vi64, vi64_size)
QUIC_VARINT = IntegerCodec(
    "quic-varint", QUIC_VARINT_MAX, encode_quic_varint, decode_quic_varint, quic_varint_size
)


class Buffer:
    """A read cursor over bytes that raises BufferReadError instead of reading short.

    Slices are taken from a memoryview, so a large field can be handed on without a
    copy (`pull_view`); `pull_bytes` copies.
    """

    __slots__ = ("_data", "_pos", "_end", "_decode", "_codec")

    def __init__(
        self,
        data: BytesLike,
        start: int = 0,
        end: int | None = None,
        codec: IntegerCodec = VI64,
    ) -> None:
        self._data = data if isinstance(data, memoryview) else memoryview(data)
        self._pos = start
        self._end = len(self._data) if end is None else end
        if not 0 <= start <= self._end <= len(self._data):
            raise ValueError("buffer bounds outside the data")
        self._decode = codec.decode
        self._codec = codec

    def tell(self) -> int:
        """Current absolute position in the underlying data."""
        return self._pos

    @property
    def end(self) -> int:
        return self._end

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    def eof(self) -> bool:
        return self._pos >= self._end

    def seek(self, pos: int) -> None:
        if not 0 <= pos <= self._end:
            raise BufferReadError("seek outside the buffer")
        self._pos = pos

    def pull_varint(self) -> int:
        """The draft's variable-length integer (vi64 for draft-18)."""
        data = self._data
        pos = self._pos
        if pos < self._end and data[pos] < 0x80 and self._decode is decode_vi64:
            self._pos = pos + 1
            return data[pos]
        value, new = self._decode(data, pos)
        if new > self._end:
            raise BufferReadError("truncated integer")
        self._pos = new
        return value

    def pull_uint8(self) -> int:
        if self._pos >= self._end:
            raise BufferReadError("truncated uint8")
        value = self._data[self._pos]
        self._pos += 1
        return value

    def pull_uint16(self) -> int:
        if self._pos + 2 > self._end:
            raise BufferReadError("truncated uint16")
        value = int.from_bytes(self._data[self._pos : self._pos + 2], "big")
        self._pos += 2
        return value

    def pull_view(self, length: int) -> memoryview:
        """The next `length` bytes without copying them."""
        if length < 0 or self._pos + length > self._end:
            raise BufferReadError(f"truncated field: {length} bytes wanted, {self.remaining} left")
        view = self._data[self._pos : self._pos + length]
        self._pos += length
        return view

    def pull_buffer(self, length: int) -> "Buffer":
        """The next `length` bytes as a Buffer of their own, bounded to them."""
        if length < 0 or self._pos + length > self._end:
            raise BufferReadError(f"truncated field: {length} bytes wanted, {self.remaining} left")
        sub = Buffer(self._data, self._pos, self._pos + length, self._codec)
        self._pos += length
        return sub

    def pull_bytes(self, length: int) -> bytes:
        return bytes(self.pull_view(length))

    def pull_rest(self) -> bytes:
        return self.pull_bytes(self.remaining)
