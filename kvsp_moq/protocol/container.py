"""The KV Block Container, KVB1 (KVSP §4.3).

Parsing never trusts a length: every count and length is checked against the bytes actually
present before it is used, and nothing is allocated from an unchecked length. Layer sections
are exposed as memoryviews into the caller's buffer, so parsing a 64 MiB block copies nothing.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from kvsp_moq.errors import BadContainer, DigestMismatch, LayersUnavailable

MAGIC = b"KVB1"
VERSION = 1
HEADER = struct.Struct(">4sBBHIII")  # magic, version, flags, codec, first, count, tokens
HEADER_SIZE = HEADER.size  # 20
ENTRY = struct.Struct(">QQ")
ENTRY_SIZE = ENTRY.size  # 16
MEDIA_TYPE = "application/kvsp-block"
_U32 = 0xFFFFFFFF
#: Layer numbers are 32-bit: First Layer + Layer Count may not exceed this.
LAYER_SPACE = _U32 + 1

#: numpy views of raw sections; bfloat16 and float8 have no numpy type and are viewed as bits.
NUMPY_DTYPES: dict[str, str] = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
}

Buffer = bytes | bytearray | memoryview


def layer_digest(k: Buffer, v: Buffer) -> bytes:
    """SHA-256 of a layer's K section followed by its V section."""
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Sequence[bytes]) -> bytes:
    """SHA-256 over the concatenated layer digests, in ascending layer order."""
    return hashlib.sha256(b"".join(layer_digests)).digest()


def format_digest(digest: bytes) -> str:
    return "sha-256:" + digest.hex()


@dataclass(frozen=True)
class Layer:
    """One layer of a container; `k` and `v` are views into the container's buffer."""

    index: int
    k: memoryview
    v: memoryview

    def digest(self) -> bytes:
        return layer_digest(self.k, self.v)

    @property
    def nbytes(self) -> int:
        return len(self.k) + len(self.v)

    def arrays(self, kv_heads: int, head_dim: int, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """K and V as read-only numpy views shaped [tokens, kv_heads, head_dim] (no copy)."""
        dtype = np.dtype(NUMPY_DTYPES[kv_dtype])
        out = []
        for section in (self.k, self.v):
            row = kv_heads * head_dim * dtype.itemsize
            if row == 0 or len(section) % row:
                raise BadContainer(
                    f"layer {self.index}: section of {len(section)} octets is not whole "
                    f"rows of {kv_heads}x{head_dim} {kv_dtype}"
                )
            out.append(np.frombuffer(section, dtype=dtype).reshape(-1, kv_heads, head_dim))
        return out[0], out[1]


def encode_header(
    first_layer: int,
    token_count: int,
    lengths: Sequence[tuple[int, int]],
    *,
    codec: int = 1,
    flags: int = 0,
) -> bytes:
    """Header and length table; the data sections follow it on the wire."""
    if not (0 <= first_layer <= _U32 and 0 <= token_count <= _U32 and 0 <= codec <= 0xFFFF):
        raise BadContainer("header field out of range")
    if first_layer + len(lengths) > LAYER_SPACE:
        raise BadContainer("layer range exceeds 2^32")
    head = HEADER.pack(MAGIC, VERSION, flags, codec, first_layer, len(lengths), token_count)
    table = b"".join(ENTRY.pack(k, v) for k, v in lengths)
    return head + table


def iter_encoded(
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[Buffer, Buffer]],
    *,
    codec: int = 1,
) -> Iterator[Buffer]:
    """The container as a sequence of chunks, without copying the sections (for streaming)."""
    yield encode_header(
        first_layer, token_count, [(len(k), len(v)) for k, v in layers], codec=codec
    )
    for k, v in layers:
        yield k
        yield v


def encode(
    first_layer: int,
    token_count: int,
    layers: Sequence[tuple[Buffer, Buffer]],
    *,
    codec: int = 1,
) -> bytes:
    """One contiguous container; each section is copied exactly once."""
    return b"".join(iter_encoded(first_layer, token_count, layers, codec=codec))


_FIRST_AND_COUNT = struct.Struct(">II")  # First Layer and Layer Count, octets 8..15


class HeaderReader:
    """The §4.3 rules on the header and the layer length table, checked on a container's
    leading octets as they become available: the one implementation of those rules, used by
    `Container` (all octets at once) and by `ContainerParser` (octets as they arrive).

    `read(head)` is given the container's first len(head) octets, a longer prefix at each call,
    and checks every rule whose octets have come in since the last one, so a refusal
    (BadContainer) comes with the octet that breaks the rule: the magic at its first wrong
    octet, the version at octet 4, First Layer + Layer Count and the table's size at octet 15,
    a layer's K length at the 8th octet of its table entry and its V length at the 16th.

    `limit` is the most octets the container may have; with `exact`, it is the container's
    size, so the table must account for exactly that many octets. Nothing is allocated from a
    length before it has been checked against `limit`.
    """

    __slots__ = (
        "limit", "exact", "version", "flags", "codec", "first_layer", "layer_count",
        "token_count", "table_end", "offsets", "total", "_entries", "_pos",
    )

    def __init__(self, limit: int, *, exact: bool = False) -> None:
        self.limit = limit
        self.exact = exact
        self.version = self.flags = self.codec = 0
        self.first_layer = self.layer_count = self.token_count = 0
        #: Octets of the header and the length table; None until the fixed header is in.
        self.table_end: int | None = None
        #: K start and V start of each layer read, then (once all are) the end of the last.
        self.offsets: list[int] = []
        #: The container's size, once the whole table is read.
        self.total: int | None = None
        self._entries = 0
        self._pos = 0

    @property
    def done(self) -> bool:
        """Whether the header and the whole length table have been read."""
        return self.total is not None

    def read(self, head: Buffer) -> bool:
        """Check what `head` adds to the octets seen so far; True once the table is complete."""
        if self.total is not None:
            return True
        n = len(head)
        if self.table_end is None:
            if n < HEADER_SIZE:
                self._check_fixed(head, n)
                return False
            magic, version, flags, codec, first, count, tokens = HEADER.unpack_from(head, 0)
            if magic != MAGIC or version != VERSION:
                self._check_fixed(head, HEADER_SIZE)  # raises
            self._check_counts(first, count)
            self.version, self.flags, self.codec = version, flags, codec
            self.first_layer, self.layer_count, self.token_count = first, count, tokens
            self.table_end = self._pos = HEADER_SIZE + count * ENTRY_SIZE
        count, limit = self.layer_count, self.limit
        i, pos, offsets = self._entries, self._pos, self.offsets
        at = HEADER_SIZE + i * ENTRY_SIZE
        while i < count and at + ENTRY_SIZE <= n:
            k_len, v_len = ENTRY.unpack_from(head, at)
            if k_len > limit - pos or v_len > limit - pos - k_len:
                raise self._past(i, k_len, v_len)
            offsets.append(pos)
            offsets.append(pos + k_len)
            pos += k_len + v_len
            i += 1
            at += ENTRY_SIZE
        self._entries, self._pos = i, pos
        if i < count:
            if at + 8 <= n:  # the next entry's K length is in
                k_len = int.from_bytes(head[at:at + 8], "big")
                if k_len > limit - pos:
                    raise self._past(i, k_len, None)
            return False
        if self.exact and pos != limit:
            raise BadContainer(f"{limit - pos} trailing octets after the last layer")
        offsets.append(pos)
        self.total = pos
        return True

    def _check_fixed(self, head: Buffer, n: int) -> None:
        """The rules on the 20-octet fixed header that its first n octets allow checking."""
        m = min(n, len(MAGIC))
        if bytes(head[:m]) != MAGIC[:m]:
            raise BadContainer(f"bad magic {bytes(head[:m])!r}, expected {MAGIC!r}")
        if n > 4 and head[4] != VERSION:
            raise BadContainer(f"unknown version {head[4]}")
        if n >= 16:
            self._check_counts(*_FIRST_AND_COUNT.unpack_from(head, 8))

    def _check_counts(self, first: int, count: int) -> None:
        """First Layer and Layer Count (octets 8..15): the layers fit the 32-bit layer
        numbers, and the length table fits the container."""
        if first + count > LAYER_SPACE:
            raise BadContainer("first layer + layer count exceeds 2^32")
        table_end = HEADER_SIZE + count * ENTRY_SIZE
        if table_end > self.limit:
            if self.exact:
                raise BadContainer(f"truncated: layer table of {count} entries needs "
                                   f"{table_end} octets, have {self.limit}")
            raise BadContainer(f"a layer table of {count} entries needs {table_end} "
                               f"octets, more than the {self.limit} the container may have")

    def _past(self, i: int, k_len: int, v_len: int | None) -> BadContainer:
        what = f"lengths {k_len}+{v_len} run" if v_len is not None else f"K length {k_len} runs"
        where = (f"past the end of the {self.limit}-octet container" if self.exact
                 else f"past the {self.limit} octets the container may have")
        return BadContainer(f"layer {self.first_layer + i}: {what} {where}")


class Container:
    """A parsed KVB1 container over a buffer it does not copy."""

    __slots__ = (
        "buffer", "version", "flags", "codec", "first_layer", "layer_count", "token_count",
        "_offsets", "data_offset",
    )

    def __init__(self, buffer: Buffer) -> None:
        view = memoryview(buffer)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = len(view)
        if size < HEADER_SIZE:
            raise BadContainer(f"truncated: {size} octets, the header alone needs {HEADER_SIZE}")
        reader = HeaderReader(size, exact=True)
        reader.read(view)  # all octets are in: the table is complete or refused
        self._take(view, reader)

    @classmethod
    def from_reader(cls, buffer: memoryview, reader: HeaderReader) -> "Container":
        """The container whose header and table `reader` has read, completely and exactly
        len(buffer) octets of them (as `ContainerParser` does), without reading them again."""
        if reader.total != len(buffer):
            raise BadContainer(f"truncated: {len(buffer)} octets, the header announced "
                               f"{reader.total if reader.total is not None else 'more'}")
        container = cls.__new__(cls)
        container._take(buffer, reader)
        return container

    def _take(self, view: memoryview, reader: HeaderReader) -> None:
        assert reader.table_end is not None
        self.buffer = view
        self.version = reader.version
        self.flags = reader.flags
        self.codec = reader.codec
        self.first_layer = reader.first_layer
        self.layer_count = reader.layer_count
        self.token_count = reader.token_count
        self.data_offset = reader.table_end
        self._offsets = reader.offsets

    @classmethod
    def parse(cls, buffer: Buffer) -> "Container":
        return cls(buffer)

    @property
    def last_layer(self) -> int:
        return self.first_layer + self.layer_count - 1

    @property
    def layer_numbers(self) -> range:
        return range(self.first_layer, self.first_layer + self.layer_count)

    def layer(self, number: int) -> Layer:
        i = number - self.first_layer
        if not 0 <= i < self.layer_count:
            raise LayersUnavailable(
                f"layer {number} is not in this container "
                f"(layers {self.first_layer}..{self.last_layer})"
            )
        o = self._offsets
        return Layer(number, self.buffer[o[2 * i] : o[2 * i + 1]], self.buffer[o[2 * i + 1] : o[2 * i + 2]])

    def layers(self) -> Iterator[Layer]:
        for number in self.layer_numbers:
            yield self.layer(number)

    def lengths(self) -> list[tuple[int, int]]:
        o = self._offsets
        return [
            (o[2 * i + 1] - o[2 * i], o[2 * i + 2] - o[2 * i + 1]) for i in range(self.layer_count)
        ]

    def layer_digests(self) -> list[bytes]:
        buf, o, sha = self.buffer, self._offsets, hashlib.sha256
        out = []
        for i in range(0, 2 * self.layer_count, 2):
            h = sha(buf[o[i] : o[i + 1]])
            h.update(buf[o[i + 1] : o[i + 2]])
            out.append(h.digest())
        return out

    def digest(self) -> bytes:
        """Replica digest over the layers present (the whole replica when all are)."""
        return replica_digest(self.layer_digests())

    def payload(self, first: int, last: int) -> memoryview:
        """The contiguous data of layers first..last (inclusive), without copying."""
        if first > last or first < self.first_layer or last > self.last_layer:
            raise LayersUnavailable(
                f"layers {first}-{last} are not all in this container "
                f"(layers {self.first_layer}..{self.last_layer})"
            )
        i, j = first - self.first_layer, last - self.first_layer
        return self.buffer[self._offsets[2 * i] : self._offsets[2 * j + 2]]

    def iter_slice(self, first: int, last: int) -> Iterator[Buffer]:
        """Chunks of a container of layers first..last, sharing this buffer."""
        lengths = self.lengths()[first - self.first_layer : last - self.first_layer + 1]
        payload = self.payload(first, last)
        yield encode_header(first, self.token_count, lengths, codec=self.codec, flags=self.flags)
        yield payload

    def slice(self, first: int, last: int) -> bytes:
        """A new container of layers first..last; the payload is copied once."""
        return b"".join(self.iter_slice(first, last))

    def verify(self, layer_digests: Sequence[bytes], *, first_of_record: int = 0) -> None:
        """Check each present layer against a record's digests (layer l at index l - first)."""
        for layer in self.layers():
            i = layer.index - first_of_record
            if not 0 <= i < len(layer_digests):
                raise DigestMismatch(f"layer {layer.index} is not listed in the record")
            if layer.digest() != layer_digests[i]:
                raise DigestMismatch(f"layer {layer.index} does not match its layer digest")

    def describe(self) -> dict:
        """The JSON summary printed by `kvsp inspect`."""
        layers = []
        digests = []
        for layer in self.layers():
            d = layer.digest()
            digests.append(d)
            layers.append(
                {"layer": layer.index, "k_len": len(layer.k), "v_len": len(layer.v),
                 "digest": format_digest(d)}
            )
        return {
            "version": self.version,
            "flags": self.flags,
            "codec": self.codec,
            "first_layer": self.first_layer,
            "layer_count": self.layer_count,
            "token_count": self.token_count,
            "layers": layers,
            "digest": format_digest(replica_digest(digests)),
        }

    def __len__(self) -> int:
        return len(self.buffer)


def parse(buffer: Buffer) -> Container:
    return Container(buffer)
