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
        magic, version, flags, codec, first, count, tokens = HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise BadContainer(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise BadContainer(f"unknown version {version}")
        if first + count > LAYER_SPACE:
            raise BadContainer("first layer + layer count exceeds 2^32")
        table_end = HEADER_SIZE + count * ENTRY_SIZE
        if table_end > size:
            raise BadContainer(
                f"truncated: layer table of {count} entries needs {table_end} octets, have {size}"
            )
        offsets: list[int] = []
        pos = table_end
        for i in range(count):
            k_len, v_len = ENTRY.unpack_from(view, HEADER_SIZE + i * ENTRY_SIZE)
            if k_len > size - pos or v_len > size - pos - k_len:
                raise BadContainer(
                    f"layer {first + i}: lengths {k_len}+{v_len} run past the end of "
                    f"the {size}-octet container"
                )
            offsets.append(pos)
            offsets.append(pos + k_len)
            pos += k_len + v_len
        offsets.append(pos)
        if pos != size:
            raise BadContainer(f"{size - pos} trailing octets after the last layer")
        self.buffer = view
        self.version = version
        self.flags = flags
        self.codec = codec
        self.first_layer = first
        self.layer_count = count
        self.token_count = tokens
        self.data_offset = table_end
        self._offsets = offsets

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
