"""KV blocks as MOQT tracks (DESIGN §4).

A replica is one track. Its namespace has five fields, ("kvsp", compat_id, scope_id,
publisher_id, block_key); the track name is the codec number in ASCII. The Replica Record
carries the namespace as base64url (no padding) of the fields, each preceded by its length in
one octet (KVSP §4.4).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from kvsp_moq.errors import BadRecord

ROOT = b"kvsp"
GROUP = 0  # a block is group 0; object id = layer number


def publisher_id(http_holder: str) -> bytes:
    """First 16 octets of SHA-256 of the publishing holder's HTTP base URL."""
    return hashlib.sha256(http_holder.encode()).digest()[:16]


@dataclass(frozen=True)
class BlockTrack:
    """The full track name of one replica of one block."""

    compat_id: bytes
    scope_id: bytes
    publisher_id: bytes
    block_key: bytes
    codec: int = 1

    def __post_init__(self) -> None:
        for name, size in (("compat_id", 32), ("scope_id", 16), ("publisher_id", 16),
                           ("block_key", 32)):
            if len(getattr(self, name)) != size:
                raise BadRecord(f"must be {size} octets", member=name)

    @classmethod
    def for_holder(cls, compat_id: str, scope_id: str, block_key: str, http_holder: str,
                   codec: int = 1) -> "BlockTrack":
        return cls(bytes.fromhex(compat_id), bytes.fromhex(scope_id), publisher_id(http_holder),
                   bytes.fromhex(block_key), codec)

    @property
    def namespace(self) -> tuple[bytes, ...]:
        return (ROOT, self.compat_id, self.scope_id, self.publisher_id, self.block_key)

    @property
    def announce_prefix(self) -> tuple[bytes, ...]:
        """What a holder announces once per compat and scope (PUBLISH_NAMESPACE)."""
        return self.namespace[:4]

    @property
    def track_name(self) -> bytes:
        return str(self.codec).encode("ascii")

    @property
    def moqt_namespace(self) -> str:
        return encode_namespace(self.namespace)

    @classmethod
    def from_namespace(cls, fields: tuple[bytes, ...] | list[bytes], track_name: bytes = b"1"
                       ) -> "BlockTrack":
        if len(fields) != 5 or fields[0] != ROOT:
            raise BadRecord('a block namespace has five fields starting with "kvsp"',
                            member="moqt_namespace")
        try:
            codec = int(track_name.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise BadRecord("track name must be a codec number", member="track") from None
        return cls(fields[1], fields[2], fields[3], fields[4], codec)

    @classmethod
    def from_record_namespace(cls, text: str, codec: int = 1) -> "BlockTrack":
        return cls.from_namespace(decode_namespace(text), str(codec).encode())


def scope_of_namespace(fields: tuple[bytes, ...] | list[bytes]) -> bytes | None:
    """The Scope ID of a "kvsp" namespace (its third field), for authorization."""
    if len(fields) >= 3 and fields[0] == ROOT:
        return fields[2]
    return None


def encode_namespace(fields: tuple[bytes, ...] | list[bytes]) -> str:
    out = bytearray()
    for f in fields:
        if len(f) > 255:
            raise BadRecord("a namespace field exceeds 255 octets", member="moqt_namespace")
        out.append(len(f))
        out += f
    return base64.urlsafe_b64encode(bytes(out)).rstrip(b"=").decode("ascii")


def decode_namespace(text: str) -> tuple[bytes, ...]:
    if not isinstance(text, str) or "=" in text:
        raise BadRecord("must be base64url without padding", member="moqt_namespace")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise BadRecord("must be base64url without padding", member="moqt_namespace") from None
    fields = []
    pos = 0
    while pos < len(raw):
        n = raw[pos]
        if pos + 1 + n > len(raw):
            raise BadRecord("a field length runs past the end", member="moqt_namespace")
        fields.append(raw[pos + 1:pos + 1 + n])
        pos += 1 + n
    return tuple(fields)
