"""KV blocks as MOQT tracks (DESIGN §4).

A replica is one track. Its namespace has five fields, ("kvsp", compat_id, scope_id,
publisher_id, block_key), each ID written as lowercase hex in ASCII; the track name is the
codec number in ASCII. The Replica Record carries the namespace as base64url (no padding) of
the fields, each preceded by its length in one octet (KVSP §4.4).

The IDs are text, not their raw octets, so that every field is valid UTF-8: MOQT lets a field
be any octets, but moq-rs, the most used stack, names tracks by UTF-8 paths and closes its
session on a NAMESPACE whose field is not UTF-8, which a relay carrying KV blocks would send
to every moq-rs client that discovers namespaces.

Group 0 holds the block and Object ID = layer number. The payload of a raw object is exactly
the K section followed by the V section of its layer, so SHA-256 of the payload is the layer
digest of §4.3. Every object also carries two application properties (draft-18 Key-Value-Pairs
with even types, so their values are varints):

    0x3800  KVSP Token Count  the block's token count (a container header field)
    0x3802  KVSP K Length     octets of the K section; the V section is the rest

so a receiver can split K from V and rebuild a container for codecs whose halves differ.
A layer of a block still being computed (a live block, whose record has no layer digests yet)
carries a third, odd-typed (octets) property:

    0x3803  KVSP Layer Digest  SHA-256 of the payload (the §4.3 layer digest)

which the receiver checks before the layer is used; the complete record that replaces the
in-production one lists the same digests, so the publisher stays accountable for them.

The blocks one forward pass computes are also the slots of a pass track (DESIGN §9.6): track
name "pass-<codec>" in the namespace of the pass's first block, object l = layer l of every
slot, each slot's K and V sections as its block's object has them, and two more odd-typed
properties in place of the layer digest:

    0x3805  KVSP Layer Digests  the slots' layer digests, 32 octets each, in slot order
    0x3807  KVSP Slot Keys      the slots' Block Keys, 32 octets each, in slot order

The keys let a reader that was told the pass's layout by someone else (a front end carrying
the producer's answer) check that slot j is the block it expects: a layer digest proves
what the producer sent, not which block it is.

Publisher (`kvsp_moq.holder.moqt_publisher`) and fetcher (`kvsp_moq.fetch.moqt`) both build on
this module, which imports neither.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from kvsp_moq.errors import BadRecord
from kvsp_moq.moqt.wire import Properties, property_value
from kvsp_moq.protocol.container import Layer
from kvsp_moq.protocol.records import ReplicaRecord

ROOT = b"kvsp"
GROUP = 0  # a block is group 0; object id = layer number


def id_field(raw: bytes) -> bytes:
    """An ID as a namespace field: its lowercase hex, in ASCII."""
    return raw.hex().encode("ascii")


def id_of_field(field: bytes, size: int, member: str) -> bytes:
    """The ID a namespace field writes (`size` octets); BadRecord unless it is exactly
    lowercase hex of that many octets."""
    text = bytes(field)
    if len(text) != 2 * size or text.lower() != text:
        raise BadRecord(f"must be {2 * size} lowercase hex digits", member=member)
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise BadRecord(f"must be {2 * size} lowercase hex digits", member=member) from None


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
        return (ROOT, id_field(self.compat_id), id_field(self.scope_id), id_field(self.publisher_id),
                id_field(self.block_key))

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
        return cls(id_of_field(fields[1], 32, "compat_id"), id_of_field(fields[2], 16, "scope_id"),
                   id_of_field(fields[3], 16, "publisher_id"), id_of_field(fields[4], 32, "block_key"), codec)

    @classmethod
    def from_record_namespace(cls, text: str, codec: int = 1) -> "BlockTrack":
        return cls.from_namespace(decode_namespace(text), str(codec).encode())


def scope_of_namespace(fields: tuple[bytes, ...] | list[bytes]) -> str | None:
    """The Scope ID (hex) a "kvsp" namespace names in its third field, for authorization;
    a field that is not text names no scope a token can hold."""
    if len(fields) >= 3 and fields[0] == ROOT:
        return bytes(fields[2]).decode("ascii", errors="replace")
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


# --------------------------------------------------------------------------- layer objects

#: Object property: the block's Token Count (even type: a varint value).
TOKEN_COUNT_PROPERTY = 0x3800
#: Object property: octets of the layer's K section (even type: a varint value).
K_LENGTH_PROPERTY = 0x3802
#: Object property: the layer digest, SHA-256 of the payload (odd type: 32 octets); sent with
#: the layers of a live block, whose record cannot list their digests yet.
LAYER_DIGEST_PROPERTY = 0x3803


def layer_properties(token_count: int, k_length: int, digest: bytes | None = None) -> Properties:
    """The application properties of one layer object (in ascending type order)."""
    if digest is None:
        return ((TOKEN_COUNT_PROPERTY, token_count), (K_LENGTH_PROPERTY, k_length))
    return ((TOKEN_COUNT_PROPERTY, token_count), (K_LENGTH_PROPERTY, k_length), (LAYER_DIGEST_PROPERTY, digest))


def carried_digest(properties: Properties) -> bytes | None:
    """The layer digest an object carries (live blocks), None when it carries none."""
    value = property_value(properties, LAYER_DIGEST_PROPERTY)
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def split_layer(index: int, payload: bytes | memoryview, properties: Properties) -> tuple[Layer, int | None]:
    """A layer object as (Layer, token count); without a K Length the halves are equal."""
    view = memoryview(payload)
    k_length = property_value(properties, K_LENGTH_PROPERTY)
    if k_length is None:
        if len(view) % 2:
            raise BadRecord(f"layer {index}: no K length and an odd payload", member="payload")
        k_length = len(view) // 2
    if not 0 <= k_length <= len(view):
        raise BadRecord(f"layer {index}: K length {k_length} exceeds the payload", member="payload")
    return Layer(index, view[:k_length], view[k_length:]), property_value(properties, TOKEN_COUNT_PROPERTY)


# --------------------------------------------------------------------------- pass tracks

#: Object property of a pass track's object: the layer digests of its slices, 32 octets each
#: in slot order (odd type: octets); their count is the pass's block count.
PASS_DIGESTS_PROPERTY = 0x3805
#: Object property of a pass track's object: the Block Keys of its slots, 32 octets each in
#: slot order (odd type: octets).
PASS_KEYS_PROPERTY = 0x3807
_PASS = b"pass-"


class PassSlot(NamedTuple):
    """One slot of a pass track's object: its block's layer, views into the payload."""

    k: memoryview
    v: memoryview
    digest: bytes  # the layer digest it carries
    block_key: str  # lowercase hex


def pass_track_name(codec: int = 1) -> bytes:
    """The track name of a pass track (DESIGN §9.6), in the namespace of its first block."""
    return _PASS + str(codec).encode("ascii")


def pass_first_block(namespace: tuple[bytes, ...] | list[bytes], track_name: bytes) -> BlockTrack | None:
    """The track of a pass's first block when (namespace, track_name) is a pass track, else
    None; BadRecord when it is one but malformed."""
    name = bytes(track_name)
    if not name.startswith(_PASS):
        return None
    return BlockTrack.from_namespace(namespace, name[len(_PASS):])


def pass_properties(token_count: int, k_length: int, digests: bytes, keys: bytes) -> Properties:
    """The application properties of a pass track's object (ascending type order)."""
    return ((TOKEN_COUNT_PROPERTY, token_count), (K_LENGTH_PROPERTY, k_length),
            (PASS_DIGESTS_PROPERTY, digests), (PASS_KEYS_PROPERTY, keys))


def split_pass(index: int, payload: bytes | memoryview, properties: Properties) -> list[PassSlot]:
    """A pass track's object as its slots, in slot order, without copying; BadRecord when its
    properties do not describe its payload."""
    digests = property_value(properties, PASS_DIGESTS_PROPERTY)
    if not isinstance(digests, (bytes, bytearray, memoryview)) or not digests or len(digests) % 32:
        raise BadRecord(f"layer {index}: the pass object lists no slot digests", member="payload")
    keys = property_value(properties, PASS_KEYS_PROPERTY)
    if not isinstance(keys, (bytes, bytearray, memoryview)) or len(keys) != len(digests):
        raise BadRecord(f"layer {index}: the pass object lists no Block Key for each slot", member="payload")
    view = memoryview(payload)
    n = len(digests) // 32
    if len(view) % n:
        raise BadRecord(f"layer {index}: {len(view)} octets do not split into {n} slots", member="payload")
    size = len(view) // n
    k_length = property_value(properties, K_LENGTH_PROPERTY)
    if k_length is None:
        k_length = size // 2
    if not isinstance(k_length, int) or not 0 <= k_length <= size:
        raise BadRecord(f"layer {index}: K length {k_length} exceeds a slot", member="payload")
    digests, hexkeys = bytes(digests), bytes(keys).hex()
    return [PassSlot(view[j * size:j * size + k_length], view[j * size + k_length:(j + 1) * size],
                     digests[32 * j:32 * (j + 1)], hexkeys[64 * j:64 * (j + 1)]) for j in range(n)]


def moqt_record(http_record: ReplicaRecord, relay_url: str) -> ReplicaRecord:
    """The Replica Record of the MOQT replica behind `relay_url` of a holder's HTTP replica:
    holder = the relay's moqt:// URI, moqt_namespace = the track's five fields, http_holder =
    the holder's HTTP base (where leases are taken and where a client falls back)."""
    if not relay_url.lower().startswith("moqt://"):
        raise BadRecord("must be a moqt:// URI", member="holder")
    if http_record.is_moqt:
        raise BadRecord("the record is already a MOQT replica's", member="holder")
    track = BlockTrack.for_holder(http_record.compat_id, http_record.scope_id, http_record.block_key,
                                  http_record.holder, http_record.codec)
    return dataclasses.replace(http_record, holder=relay_url, moqt_namespace=track.moqt_namespace,
                               http_holder=http_record.holder)
