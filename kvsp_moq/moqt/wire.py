"""The wire vocabulary every draft shares: the value types a session hands its callers
(locations, filters, tokens, namespaces, properties, object status), the field writer
and readers over a draft's integer codec, and control-message framing (type, 16-bit
length, payload). Each draft's package encodes its messages with these."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, Union

from .errors import BufferReadError, KeyValueFormattingError, MalformedAuthority, MalformedPath, ProtocolViolation
from .varint import U64_MAX, VI64, Buffer, IntegerCodec

MAX_MESSAGE_LENGTH = 0xFFFF

MAX_NAMESPACE_FIELDS = 32

MAX_FULL_TRACK_NAME = 4096

MAX_REASON_PHRASE = 1024

MAX_GOAWAY_URI = 8192

MAX_KVP_VALUE = 0xFFFF

TrackNamespace = tuple[bytes, ...]

Property = tuple[int, Union[int, bytes]]

Properties = tuple[Property, ...]

class Location(NamedTuple):
    """{Group, Object}; tuples order the way the draft orders Locations."""

    group: int
    object: int

class GroupOrder(IntEnum):
    ASCENDING = 0x1
    DESCENDING = 0x2

class FilterType(IntEnum):
    NEXT_GROUP_START = 0x1
    LARGEST_OBJECT = 0x2
    ABSOLUTE_START = 0x3
    ABSOLUTE_RANGE = 0x4

class FetchType(IntEnum):
    STANDALONE = 0x1
    RELATIVE_JOINING = 0x2
    ABSOLUTE_JOINING = 0x3


class FetchFields:
    """What a FETCH is in every draft: standalone (a track and a range) or joining (a request
    and a start), never both. Mixed into each draft's FETCH dataclass, which declares the fields."""

    __slots__ = ()
    fetch_type: FetchType
    namespace: TrackNamespace | None
    track_name: bytes | None
    start: Location | None
    end: Location | None
    joining_request_id: int | None
    joining_start: int | None

    def __post_init__(self) -> None:
        standalone = self.fetch_type == FetchType.STANDALONE
        parts = (self.namespace, self.track_name, self.start, self.end)
        joining = (self.joining_request_id, self.joining_start)
        if standalone and (any(p is None for p in parts) or any(j is not None for j in joining)):
            raise ValueError("a standalone FETCH has a track and a range, and no joining fields")
        if not standalone and (any(j is None for j in joining) or any(p is not None for p in parts)):
            raise ValueError("a joining FETCH has joining fields only")

    def track_and_range(self) -> tuple[TrackNamespace, bytes, Location, Location]:
        """A standalone FETCH's namespace, track name, start and end, which
        `__post_init__` ensures are all set."""
        namespace, track_name, start, end = self.namespace, self.track_name, self.start, self.end
        if namespace is None or track_name is None or start is None or end is None:
            raise ValueError("not a standalone FETCH")
        return namespace, track_name, start, end

    def joining(self) -> tuple[int, int]:
        """A joining FETCH's Joining Request ID and Joining Start, which
        `__post_init__` ensures are set."""
        joining_request_id, joining_start = self.joining_request_id, self.joining_start
        if joining_request_id is None or joining_start is None:
            raise ValueError("not a joining FETCH")
        return joining_request_id, joining_start


class TrackPropertyType(IntEnum):
    """Property types defined by draft-18 (section 12)."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    MAX_CACHE_DURATION = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    IMMUTABLE_PROPERTIES = 0x0B
    DEFAULT_PUBLISHER_PRIORITY = 0x0E
    DEFAULT_PUBLISHER_GROUP_ORDER = 0x22
    DYNAMIC_GROUPS = 0x30
    PRIOR_GROUP_ID_GAP = 0x3C
    PRIOR_OBJECT_ID_GAP = 0x3E

class AliasType(IntEnum):
    DELETE = 0x0
    REGISTER = 0x1
    USE_ALIAS = 0x2
    USE_VALUE = 0x3

class Writer:
    """Appends wire fields to a bytearray with the draft's integer codec."""

    __slots__ = ("data", "_encode")

    def __init__(self, codec: IntegerCodec = VI64) -> None:
        self.data = bytearray()
        self._encode = codec.encode

    def varint(self, value: int) -> None:
        self.data += self._encode(value)

    def uint8(self, value: int) -> None:
        if not 0 <= value <= 0xFF:
            raise ValueError(f"{value} does not fit in 8 bits")
        self.data.append(value)

    def uint16(self, value: int) -> None:
        self.data += value.to_bytes(2, "big")

    def raw(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data

    def length_prefixed(self, data: bytes | bytearray | memoryview) -> None:
        self.varint(len(data))
        self.data += data

    def location(self, location: Location) -> None:
        self.varint(location[0])
        self.varint(location[1])

    def namespace(self, namespace: TrackNamespace, *, allow_empty: bool = True) -> None:
        check_namespace(namespace, allow_empty=allow_empty)
        self.varint(len(namespace))
        for part in namespace:
            self.length_prefixed(part)

    def track_name(self, name: bytes) -> None:
        self.length_prefixed(name)

    def reason(self, reason: str) -> None:
        encoded = reason.encode("utf-8")
        if len(encoded) > MAX_REASON_PHRASE:
            raise ValueError(f"reason phrase of {len(encoded)} bytes (max {MAX_REASON_PHRASE})")
        self.length_prefixed(encoded)

def as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)

def namespace_of(value: Iterable[bytes | str] | bytes | str) -> TrackNamespace:
    """A Track Namespace from a tuple of fields (str fields are UTF-8 encoded)."""
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return (as_bytes(value),)
    return tuple(as_bytes(part) for part in value)

def check_namespace(namespace: TrackNamespace, *, allow_empty: bool = True) -> None:
    """Raise ValueError for a namespace this endpoint must not send."""
    if len(namespace) > MAX_NAMESPACE_FIELDS:
        raise ValueError(f"namespace of {len(namespace)} fields (max {MAX_NAMESPACE_FIELDS})")
    if not allow_empty and not namespace:
        raise ValueError("empty namespace")
    if any(len(part) == 0 for part in namespace):
        raise ValueError("empty namespace field")
    if sum(len(part) for part in namespace) > MAX_FULL_TRACK_NAME:
        raise ValueError(f"namespace over {MAX_FULL_TRACK_NAME} bytes")

def pull_namespace(buf: Buffer) -> TrackNamespace:
    count = buf.pull_varint()
    if count > MAX_NAMESPACE_FIELDS:
        raise ProtocolViolation(f"namespace of {count} fields (max {MAX_NAMESPACE_FIELDS})")
    parts = []
    total = 0
    for _ in range(count):
        length = buf.pull_varint()
        if length == 0:
            raise ProtocolViolation("empty namespace field")
        total += length
        if total > MAX_FULL_TRACK_NAME:
            raise ProtocolViolation(f"namespace over {MAX_FULL_TRACK_NAME} bytes")
        parts.append(buf.pull_bytes(length))
    return tuple(parts)

def pull_full_track_name(
    buf: Buffer, pull_namespace: Callable[[Buffer], TrackNamespace] = pull_namespace
) -> tuple[TrackNamespace, bytes]:
    """Namespace and track name; `pull_namespace` applies a draft's namespace rules."""
    namespace = pull_namespace(buf)
    length = buf.pull_varint()
    if sum(len(p) for p in namespace) + length > MAX_FULL_TRACK_NAME:
        raise ProtocolViolation(f"full track name over {MAX_FULL_TRACK_NAME} bytes")
    return namespace, buf.pull_bytes(length)

def pull_reason(buf: Buffer) -> str:
    length = buf.pull_varint()
    if length > MAX_REASON_PHRASE:
        raise ProtocolViolation(f"reason phrase of {length} bytes (max {MAX_REASON_PHRASE})")
    return buf.pull_bytes(length).decode("utf-8", errors="replace")

def pull_location(buf: Buffer) -> Location:
    group = buf.pull_varint()
    return Location(group, buf.pull_varint())

def check_full_track_name(namespace: TrackNamespace, name: bytes) -> None:
    check_namespace(namespace)
    if sum(len(p) for p in namespace) + len(name) > MAX_FULL_TRACK_NAME:
        raise ValueError(f"full track name over {MAX_FULL_TRACK_NAME} bytes")

def encode_properties(w: Writer, properties: Properties) -> None:
    """Key-Value-Pairs with delta-coded types; `properties` must be in type order."""
    previous = 0
    for ptype, value in properties:
        if ptype < previous:
            raise ValueError("properties must be in ascending type order")
        w.varint(ptype - previous)
        previous = ptype
        if ptype & 1:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ValueError(f"property 0x{ptype:x} (odd type) needs a bytes value")
            if len(value) > MAX_KVP_VALUE:
                raise ValueError(f"property 0x{ptype:x} value over {MAX_KVP_VALUE} bytes")
            w.length_prefixed(value)
        else:
            if not isinstance(value, int):
                raise ValueError(f"property 0x{ptype:x} (even type) needs an integer value")
            w.varint(value)

def decode_properties(buf: Buffer, end: int) -> Properties:
    """Key-Value-Pairs from the buffer position up to `end` (exclusive)."""
    if end < buf.tell():
        raise BufferReadError("properties end before they start")
    sub = buf.pull_buffer(end - buf.tell())
    items: list[Property] = []
    ptype = 0
    try:
        while not sub.eof():
            ptype += sub.pull_varint()
            if ptype > U64_MAX:
                raise ProtocolViolation("Key-Value-Pair type over 2^64-1")
            if ptype & 1:
                length = sub.pull_varint()
                if length > MAX_KVP_VALUE:
                    raise ProtocolViolation(f"Key-Value-Pair value of {length} bytes (max {MAX_KVP_VALUE})")
                items.append((ptype, sub.pull_bytes(length)))
            else:
                items.append((ptype, sub.pull_varint()))
    except BufferReadError:
        # The block itself is complete, so a pair crossing its end is malformed,
        # not a short read.
        raise ProtocolViolation("Key-Value-Pair crosses the end of its block") from None
    return tuple(items)

def property_value(properties: Properties, ptype: int, default: Any = None) -> Any:
    """The value of the first property of `ptype`, else `default`."""
    for key, value in properties:
        if key == ptype:
            return value
    return default

def mandatory_properties(properties: Properties, understood: Iterable[int] = ()) -> list[int]:
    """Mandatory Track Property types (0x4000-0x7FFF) present but not understood."""
    known = set(understood)
    return [t for t, _ in properties if 0x4000 <= t <= 0x7FFF and t not in known]

@dataclass(frozen=True, slots=True)
class AuthToken:
    """An AUTHORIZATION TOKEN structure (section 10.2.2).

    USE_VALUE carries a type and value; REGISTER an alias, type and value; USE_ALIAS
    and DELETE only an alias.
    """

    alias_type: AliasType = AliasType.USE_VALUE
    value: bytes | None = None
    token_type: int | None = 0
    alias: int | None = None

    @classmethod
    def use_value(cls, value: bytes | str, token_type: int = 0) -> "AuthToken":
        return cls(AliasType.USE_VALUE, as_bytes(value), token_type, None)

    @classmethod
    def register(cls, alias: int, value: bytes | str, token_type: int = 0) -> "AuthToken":
        return cls(AliasType.REGISTER, as_bytes(value), token_type, alias)

    @classmethod
    def use_alias(cls, alias: int) -> "AuthToken":
        return cls(AliasType.USE_ALIAS, None, None, alias)

    @classmethod
    def delete(cls, alias: int) -> "AuthToken":
        return cls(AliasType.DELETE, None, None, alias)

    def encode(self, codec: IntegerCodec = VI64) -> bytes:
        w = Writer(codec)
        w.varint(self.alias_type)
        if self.alias_type in (AliasType.DELETE, AliasType.REGISTER, AliasType.USE_ALIAS):
            if self.alias is None:
                raise ValueError(f"{self.alias_type.name} token needs an alias")
            w.varint(self.alias)
        if self.alias_type in (AliasType.REGISTER, AliasType.USE_VALUE):
            if self.value is None or self.token_type is None:
                raise ValueError(f"{self.alias_type.name} token needs a type and value")
            w.varint(self.token_type)
            w.raw(self.value)
        return bytes(w.data)

    @classmethod
    def decode(cls, data: bytes | memoryview, codec: IntegerCodec = VI64) -> "AuthToken":
        """Raises KeyValueFormattingError when the structure cannot be decoded."""
        buf = Buffer(data, codec=codec)
        try:
            raw_type = buf.pull_varint()
            if raw_type > AliasType.USE_VALUE:
                raise KeyValueFormattingError(f"unknown token alias type {raw_type}")
            alias_type = AliasType(raw_type)
            alias = None
            if alias_type != AliasType.USE_VALUE:
                alias = buf.pull_varint()
            if alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                if not buf.eof():
                    raise KeyValueFormattingError(f"{alias_type.name} token with trailing bytes")
                return cls(alias_type, None, None, alias)
            token_type = buf.pull_varint()
            return cls(alias_type, buf.pull_rest(), token_type, alias)
        except BufferReadError:
            raise KeyValueFormattingError("truncated authorization token") from None

@dataclass(frozen=True, slots=True)
class SubscriptionFilter:
    """A Subscription Filter (section 5.1.2); `end_group` is absolute and inclusive.
    `end_object` (inclusive) narrows the end group; only draft-20+ LOCATION_FILTERs carry
    it (a draft-18 filter ends with the whole end group)."""

    filter_type: FilterType
    start: Location | None = None
    end_group: int | None = None
    end_object: int | None = None

    def __post_init__(self) -> None:
        has_start = self.filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE)
        if has_start != (self.start is not None):
            raise ValueError(f"{self.filter_type.name} filter {'needs' if has_start else 'has no'} a start")
        has_end = self.filter_type == FilterType.ABSOLUTE_RANGE
        if has_end != (self.end_group is not None):
            raise ValueError(f"{self.filter_type.name} filter {'needs' if has_end else 'has no'} an end group")
        if self.end_group is not None and self.start is not None and self.end_group < self.start.group:
            raise ValueError("end group before the start group")
        if self.end_object is not None and not has_end:
            raise ValueError("an end object needs an end group")

    @classmethod
    def next_group_start(cls) -> "SubscriptionFilter":
        return cls(FilterType.NEXT_GROUP_START)

    @classmethod
    def largest_object(cls) -> "SubscriptionFilter":
        return cls(FilterType.LARGEST_OBJECT)

    @classmethod
    def absolute_start(cls, group: int, obj: int = 0) -> "SubscriptionFilter":
        return cls(FilterType.ABSOLUTE_START, Location(group, obj))

    @classmethod
    def absolute_range(cls, group: int, obj: int, end_group: int) -> "SubscriptionFilter":
        return cls(FilterType.ABSOLUTE_RANGE, Location(group, obj), end_group)

    def encode(self, codec: IntegerCodec = VI64) -> bytes:
        w = Writer(codec)
        w.varint(self.filter_type)
        if self.start is not None:
            w.location(self.start)
            if self.end_group is not None:  # an AbsoluteRange, which has a start
                w.varint(self.end_group - self.start.group)
        return bytes(w.data)

    @classmethod
    def decode(cls, data: bytes | memoryview, codec: IntegerCodec = VI64) -> "SubscriptionFilter":
        buf = Buffer(data, codec=codec)
        raw_type = buf.pull_varint()
        if raw_type not in (1, 2, 3, 4):
            raise ProtocolViolation(f"unknown subscription filter type {raw_type}")
        filter_type = FilterType(raw_type)
        start: Location | None = None
        end_group: int | None = None
        if filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE):
            start = pull_location(buf)
            if filter_type == FilterType.ABSOLUTE_RANGE:
                end_group = start.group + buf.pull_varint()
                if end_group > U64_MAX:
                    raise ProtocolViolation("subscription filter end group over 2^64-1")
        if not buf.eof():
            raise ProtocolViolation("subscription filter longer than its fields")
        return cls(filter_type, start, end_group)

def decode_checked(name: str, payload: Buffer, decode: Callable[[Buffer], Any]) -> Any:
    """Decode a whole message payload; whatever is malformed about it, in any
    draft, is a ProtocolViolation naming the message."""
    try:
        message = decode(payload)
    except BufferReadError:
        raise ProtocolViolation(f"{name} shorter than its fields") from None
    except (ValueError, TypeError) as exc:
        raise ProtocolViolation(f"{name}: {exc}") from None
    if not payload.eof():
        raise ProtocolViolation(f"{name} length exceeds its fields by {payload.remaining} bytes")
    return message

def frame_message(codec: IntegerCodec, mtype: int, name: str, payload: bytes | bytearray) -> bytes:
    """Type, 16-bit Length and payload: the control message framing of every draft."""
    if len(payload) > MAX_MESSAGE_LENGTH:
        raise ValueError(f"{name} payload of {len(payload)} bytes (max {MAX_MESSAGE_LENGTH})")
    return b"".join((codec.encode(mtype), len(payload).to_bytes(2, "big"), payload))

def decode_framed(
    data: bytes | bytearray | memoryview, codec: IntegerCodec, decode_payload: Callable[[int, Buffer], Any]
) -> Any:
    """Decode exactly one framed message; raises ProtocolViolation otherwise."""
    buf = Buffer(data, codec=codec)
    try:
        mtype = buf.pull_varint()
        length = buf.pull_uint16()
    except BufferReadError:
        raise ProtocolViolation("truncated message header") from None
    if buf.remaining != length:
        raise ProtocolViolation(f"message length {length} but {buf.remaining} bytes follow")
    return decode_payload(mtype, Buffer(data, buf.tell(), buf.tell() + length, codec))

class FramedMessageParser:
    """Splits a stream of framed control messages as bytes arrive, for any draft:
    a subclass gives its integer codec, which types it knows and how it decodes them.

    Holds at most one partial message (under 64 KiB by construction). An unknown
    type is reported once its payload is found incomplete, or, with
    EARLY_UNKNOWN, as soon as the type is read.
    """

    __slots__ = ("_pending",)
    CODEC: ClassVar[IntegerCodec] = VI64
    EARLY_UNKNOWN: ClassVar[bool] = False

    def __init__(self) -> None:
        self._pending = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete message waiting for more data."""
        return len(self._pending)

    def _known(self, mtype: int) -> bool:
        raise NotImplementedError

    def _decode(self, mtype: int, payload: Buffer) -> Any:
        raise NotImplementedError

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        self._pending += data
        pending = self._pending
        messages: list[Any] = []
        codec = self.CODEC
        pos = 0
        end = len(pending)
        while pos < end:
            try:
                mtype, header_end = codec.decode(pending, pos)
            except BufferReadError:
                break
            if self.EARLY_UNKNOWN and not self._known(mtype):
                raise ProtocolViolation(f"unknown message type 0x{mtype:x}")
            if header_end + 2 > end:
                break
            length = int.from_bytes(pending[header_end : header_end + 2], "big")
            payload_start = header_end + 2
            if payload_start + length > end:
                if not self._known(mtype):
                    raise ProtocolViolation(f"unknown message type 0x{mtype:x}")
                break
            payload = Buffer(bytes(pending[payload_start : payload_start + length]), codec=codec)
            messages.append(self._decode(mtype, payload))
            pos = payload_start + length
        if pos:
            del pending[:pos]
        return messages


DEFAULT_PUBLISHER_PRIORITY = 128

DEFAULT_MAX_OBJECT_SIZE = 64 * 1024 * 1024

DEFAULT_MAX_PROPERTIES_SIZE = 1024 * 1024

class ObjectStatus(IntEnum):
    """Object Status (section 11.2.1.1)."""

    NORMAL = 0x0
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


# --------------------------------------------------------------------------- shared by the drafts' codecs

def _text_option(value: bytes, error: type[Exception], what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} is not UTF-8") from None


def setup_value(name: str, value: int | bytes) -> Any:
    """A setup option's value as a Setup field (the text ones decoded); the same
    options exist in every draft."""
    if isinstance(value, bytes):  # PATH, AUTHORITY and MOQT_IMPLEMENTATION: odd types
        if name == "path":
            return _text_option(value, MalformedPath, "PATH")
        if name == "authority":
            return _text_option(value, MalformedAuthority, "AUTHORITY")
        if name == "implementation":
            return value.decode("utf-8", errors="replace")
    return value


def put_goaway_uri(w: Writer, uri: str) -> None:
    encoded = uri.encode("utf-8")
    if len(encoded) > MAX_GOAWAY_URI:
        raise ValueError(f"GOAWAY URI over {MAX_GOAWAY_URI} bytes")
    w.length_prefixed(encoded)


def pull_goaway_uri(buf: Buffer) -> str:
    length = buf.pull_varint()
    if length > MAX_GOAWAY_URI:
        raise ProtocolViolation(f"GOAWAY URI of {length} bytes (max {MAX_GOAWAY_URI})")
    return buf.pull_bytes(length).decode("utf-8", errors="replace")
