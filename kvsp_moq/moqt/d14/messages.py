"""MOQT draft-14 control messages, sans I/O (data streams and datagrams: `data`).

Draft-14 is the fallback for peers that do not speak draft-18. It differs from
draft-18 in ways that reach every byte, so it has a codec of its own rather than a
flag in the draft-18 codec (it reuses `wire`'s helpers and types where the two
wire formats agree: framing, reason phrases, locations, GOAWAY URIs, setup values):

* every variable-length integer is an RFC 9000 varint (at most 2^62-1), not a vi64;
* all control messages share the one bidirectional control stream, so most of them
  carry a Request ID, and requests have explicit OK / ERROR / CANCEL messages;
* the version is negotiated in CLIENT_SETUP / SERVER_SETUP (versions 0xff0000NN),
  and the ALPN is always "moq-00" (section 3.1.2), whatever the version;
* Key-Value-Pair types are absolute, not delta-coded, and a Parameters list is
  prefixed by its count;
* subscription fields (priority, group order, forward, filter) are fixed fields of
  SUBSCRIBE, not parameters;
* object headers always carry a Publisher Priority; fetch objects repeat every
  field; there is an Object Status "Does Not Exist" (0x1).

Decoding follows the draft's rules for what closes the session: an unknown message,
stream or datagram type, a length that does not match the payload, a namespace of 0
or more than 32 fields, a Full Track Name over 4096 bytes, a Reason Phrase over 1024
bytes, a GOAWAY URI over 8192 bytes, a Key-Value-Pair value over 2^16-1 bytes, a
repeated parameter that may not repeat, an out-of-range Forward / Group Order /
Content Exists / End Of Track / Filter Type / Fetch Type, and extensions on an
object that does not exist all raise ProtocolViolation. An Authorization Token that
cannot be decoded raises KeyValueFormattingError. Unknown parameters are kept in
`unknown` (the draft says to ignore them, and to allow duplicates); a known
parameter in a message where it may not appear is ignored the same way. Unknown
Setup Parameters are kept too.

Wire details the text leaves open:

* MOQT_IMPLEMENTATION is sent as Setup Parameter 0x07: the draft-14 text gives it
  0x05, which is AUTHORITY; draft-15 corrected it, and deployed peers use 0x07.
* PUBLISH, PUBLISH_OK and PUBLISH_ERROR show "Length (i)" in the text; the control
  message framing of section 9 (16-bit Length) applies to them like to all others.

Conversion to the draft-18 dataclasses (`to_draft18` / `from_draft18`) exists for
SUBSCRIBE, SUBSCRIBE_OK, FETCH, FETCH_OK, PUBLISH_DONE, TRACK_STATUS(_OK), the
*_ERROR messages (as REQUEST_ERROR), subgroup headers, objects and datagrams, so a
session adapter can emit the same events for both drafts. What does not map:

* Request IDs of responses: draft-18 answers on the request's own stream, so the
  draft-18 SUBSCRIBE_OK / FETCH_OK / REQUEST_ERROR carry none; `from_draft18` takes
  it as an argument.
* SUBSCRIBE Group Order 0 (publisher's order) becomes an absent GROUP_ORDER; a
  draft-18 SUBSCRIBE without SUBSCRIPTION_FILTER (unfiltered) becomes AbsoluteStart
  {0, 0}, the closest draft-14 filter. Absent SUBSCRIBER_PRIORITY / FORWARD become
  the draft-18 defaults 128 / 1.
* DELIVERY TIMEOUT (0x02) maps to OBJECT_DELIVERY_TIMEOUT; MAX_CACHE_DURATION maps
  to the MAX_CACHE_DURATION Track Property. Unknown parameters are dropped.
* Error codes are renumbered between the drafts (TRACK_DOES_NOT_EXIST 0x4 is
  DOES_NOT_EXIST 0x10, ...); codes without a counterpart become INTERNAL_ERROR.
  Draft-14 error messages carry no Retry Interval (0 = do not retry).
* Objects: status "Does Not Exist" has no draft-18 form (`to_draft18` returns None,
  the object is simply absent); a fetch object with any status other than Normal
  has no draft-18 form either. Draft-14 has no FIRST_OBJECT bit, so converted
  subgroup headers leave it clear. Extension headers become Properties in type
  order; an Immutable Extensions (0xB) value is re-encoded between the two
  Key-Value-Pair encodings. A fetch object sent with Forwarding Preference Datagram
  is not marked in draft-14 (its Subgroup ID is the Object ID), so it converts as a
  subgroup object.
* TRACK_STATUS converts to draft-18 TRACK_STATUS and TRACK_STATUS_OK to REQUEST_OK;
  the subscription fields of TRACK_STATUS and the Expires of TRACK_STATUS_OK are
  lost. PUBLISH / PUBLISH_OK, the namespace messages, UNSUBSCRIBE, FETCH_CANCEL,
  SUBSCRIBE_UPDATE, MAX_REQUEST_ID and REQUESTS_BLOCKED have no conversion here:
  draft-18 replaced them by stream operations (closing or resetting the request
  stream), REQUEST_UPDATE or NAMESPACE / SUBSCRIBE_TRACKS, or dropped them (request
  flow control moved to QUIC stream limits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, ClassVar, Iterable, Union

from .. import wire
from ..d18 import data as data18
from ..d18 import messages as m18
from ..errors import (
    BufferReadError,
    ProtocolViolation,
    RequestErrorCode,
)
from ..errors import PublishDoneCode as PublishDoneCode18
from ..varint import QUIC_VARINT, QUIC_VARINT_MAX, Buffer
from ..wire import (
    MAX_FULL_TRACK_NAME,
    MAX_GOAWAY_URI,
    MAX_KVP_VALUE,
    MAX_MESSAGE_LENGTH,
    MAX_NAMESPACE_FIELDS,
    MAX_REASON_PHRASE,
    AuthToken,
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    SubscriptionFilter,
    TrackNamespace,
    pull_goaway_uri,
    pull_location,
    pull_reason,
    put_goaway_uri,
    setup_value,
)

__all__ = [
    "DRAFT",
    "VERSION",
    "ALPN",
    "MAX_MESSAGE_LENGTH",
    "MAX_NAMESPACE_FIELDS",
    "MAX_FULL_TRACK_NAME",
    "MAX_REASON_PHRASE",
    "MAX_GOAWAY_URI",
    "MAX_KVP_VALUE",
    "draft_version",
    "SessionCloseCode",
    "SubscribeErrorCode",
    "PublishDoneCode",
    "PublishErrorCode",
    "FetchErrorCode",
    "PublishNamespaceErrorCode",
    "SubscribeNamespaceErrorCode",
    "StreamResetCode",
    "MessageType",
    "SetupParameterType",
    "ParameterType",
    "ExtensionType",
    "ObjectStatus",
    "SubgroupIdMode",
    "KeyValuePair",
    "SetupParameters",
    "Parameters",
    "Message",
    "ClientSetup",
    "ServerSetup",
    "Goaway",
    "MaxRequestId",
    "RequestsBlocked",
    "Subscribe",
    "SubscribeOk",
    "SubscribeError",
    "SubscribeUpdate",
    "Unsubscribe",
    "PublishDone",
    "Publish",
    "PublishOk",
    "PublishError",
    "Fetch",
    "FetchOk",
    "FetchError",
    "FetchCancel",
    "TrackStatus",
    "TrackStatusOk",
    "TrackStatusError",
    "PublishNamespace",
    "PublishNamespaceOk",
    "PublishNamespaceError",
    "PublishNamespaceDone",
    "PublishNamespaceCancel",
    "SubscribeNamespace",
    "SubscribeNamespaceOk",
    "SubscribeNamespaceError",
    "UnsubscribeNamespace",
    "MESSAGE_TYPES",
    "decode_message",
    "ControlStreamParser",
    "encode_extensions",
]

DRAFT = 14
VERSION = 0xFF00000E
ALPN = "moq-00"

_U32_MAX = 0xFFFF_FFFF

STREAM_TYPE_FETCH_HEADER = 0x05
DEFAULT_MAX_OBJECT_SIZE = wire.DEFAULT_MAX_OBJECT_SIZE
DEFAULT_MAX_EXTENSIONS_SIZE = wire.DEFAULT_MAX_PROPERTIES_SIZE

KeyValuePair = tuple[int, Union[int, bytes]]


def draft_version(draft: int) -> int:
    """The SETUP version number of draft-ietf-moq-transport-NN (0xff000000 + NN)."""
    return 0xFF000000 + draft


# ---------------------------------------------------------------------------
# Code points (section 3.4, section 9, IANA section)
# ---------------------------------------------------------------------------


class SessionCloseCode(IntEnum):
    """Session termination codes; draft-14 adds TOO_MANY_REQUESTS to draft-18's set."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    TOO_MANY_REQUESTS = 0x7
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A


class SubscribeErrorCode(IntEnum):
    """SUBSCRIBE_ERROR codes, also used by TRACK_STATUS_ERROR."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    TRACK_DOES_NOT_EXIST = 0x4
    INVALID_RANGE = 0x5
    MALFORMED_AUTH_TOKEN = 0x10
    EXPIRED_AUTH_TOKEN = 0x12


class PublishDoneCode(IntEnum):
    """PUBLISH_DONE status codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    EXPIRED = 0x5
    TOO_FAR_BEHIND = 0x6
    MALFORMED_TRACK = 0x7


class PublishErrorCode(IntEnum):
    """PUBLISH_ERROR codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    UNINTERESTED = 0x4


class FetchErrorCode(IntEnum):
    """FETCH_ERROR codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    TRACK_DOES_NOT_EXIST = 0x4
    INVALID_RANGE = 0x5
    NO_OBJECTS = 0x6
    INVALID_JOINING_REQUEST_ID = 0x7
    UNKNOWN_STATUS_IN_RANGE = 0x8
    MALFORMED_TRACK = 0x9
    MALFORMED_AUTH_TOKEN = 0x10
    EXPIRED_AUTH_TOKEN = 0x12


class PublishNamespaceErrorCode(IntEnum):
    """PUBLISH_NAMESPACE_ERROR and PUBLISH_NAMESPACE_CANCEL codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    UNINTERESTED = 0x4
    MALFORMED_AUTH_TOKEN = 0x10
    EXPIRED_AUTH_TOKEN = 0x12


class SubscribeNamespaceErrorCode(IntEnum):
    """SUBSCRIBE_NAMESPACE_ERROR codes."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    NAMESPACE_PREFIX_UNKNOWN = 0x4
    NAMESPACE_PREFIX_OVERLAP = 0x5
    MALFORMED_AUTH_TOKEN = 0x10
    EXPIRED_AUTH_TOKEN = 0x12


class StreamResetCode(IntEnum):
    """RESET_STREAM / STOP_SENDING codes of data streams."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3


class MessageType(IntEnum):
    """Control message types."""

    CLIENT_SETUP = 0x20
    SERVER_SETUP = 0x21
    GOAWAY = 0x10
    MAX_REQUEST_ID = 0x15
    REQUESTS_BLOCKED = 0x1A
    SUBSCRIBE = 0x3
    SUBSCRIBE_OK = 0x4
    SUBSCRIBE_ERROR = 0x5
    SUBSCRIBE_UPDATE = 0x2
    UNSUBSCRIBE = 0xA
    PUBLISH_DONE = 0xB
    PUBLISH = 0x1D
    PUBLISH_OK = 0x1E
    PUBLISH_ERROR = 0x1F
    FETCH = 0x16
    FETCH_OK = 0x18
    FETCH_ERROR = 0x19
    FETCH_CANCEL = 0x17
    TRACK_STATUS = 0xD
    TRACK_STATUS_OK = 0xE
    TRACK_STATUS_ERROR = 0xF
    PUBLISH_NAMESPACE = 0x6
    PUBLISH_NAMESPACE_OK = 0x7
    PUBLISH_NAMESPACE_ERROR = 0x8
    PUBLISH_NAMESPACE_DONE = 0x9
    PUBLISH_NAMESPACE_CANCEL = 0xC
    SUBSCRIBE_NAMESPACE = 0x11
    SUBSCRIBE_NAMESPACE_OK = 0x12
    SUBSCRIBE_NAMESPACE_ERROR = 0x13
    UNSUBSCRIBE_NAMESPACE = 0x14


class SetupParameterType(IntEnum):
    """Setup Parameters (section 9.3.2); their namespace is shared by all versions."""

    PATH = 0x01
    MAX_REQUEST_ID = 0x02
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MOQT_IMPLEMENTATION = 0x07


class ParameterType(IntEnum):
    """Version-specific parameters (section 9.2.1)."""

    DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    MAX_CACHE_DURATION = 0x04


class ExtensionType(IntEnum):
    """Object Extension Headers defined by draft-14."""

    IMMUTABLE_EXTENSIONS = 0x0B
    PRIOR_GROUP_ID_GAP = 0x3C
    PRIOR_OBJECT_ID_GAP = 0x3E


class ObjectStatus(IntEnum):
    """Object Status (section 10.2.1.1)."""

    NORMAL = 0x0
    DOES_NOT_EXIST = 0x1
    END_OF_GROUP = 0x3
    END_OF_TRACK = 0x4


_STATUSES = frozenset(int(s) for s in ObjectStatus)


#: How a SUBGROUP_HEADER carries the Subgroup ID (type bits 1-2): as in draft-18.
SubgroupIdMode = data18.SubgroupIdMode


# ---------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------


def _writer() -> wire.Writer:
    return wire.Writer(QUIC_VARINT)


def _check_varint(value: int, what: str) -> None:
    if not 0 <= value <= QUIC_VARINT_MAX:
        raise ValueError(f"{what} {value} does not fit a varint")


def _check_uint8(value: int, what: str) -> None:
    if not 0 <= value <= 0xFF:
        raise ValueError(f"{what} {value} does not fit in 8 bits")


def _check_namespace(namespace: TrackNamespace, track_name: bytes = b"") -> None:
    if not 1 <= len(namespace) <= MAX_NAMESPACE_FIELDS:
        raise ValueError(f"namespace of {len(namespace)} fields (1 to {MAX_NAMESPACE_FIELDS})")
    if sum(len(p) for p in namespace) + len(track_name) > MAX_FULL_TRACK_NAME:
        raise ValueError(f"full track name over {MAX_FULL_TRACK_NAME} bytes")


def _put_namespace(w: wire.Writer, namespace: TrackNamespace) -> None:
    w.varint(len(namespace))
    for part in namespace:
        w.length_prefixed(part)


def _put_full_track_name(w: wire.Writer, namespace: TrackNamespace, name: bytes) -> None:
    _check_namespace(namespace, name)
    _put_namespace(w, namespace)
    w.length_prefixed(name)


def _pull_namespace(buf: Buffer, budget: int = MAX_FULL_TRACK_NAME, *, least: int = 1) -> TrackNamespace:
    count = buf.pull_varint()
    if not least <= count <= MAX_NAMESPACE_FIELDS:
        raise ProtocolViolation(f"namespace of {count} fields ({least} to {MAX_NAMESPACE_FIELDS})")
    parts = []
    total = 0
    for _ in range(count):
        length = buf.pull_varint()
        total += length
        if total > budget:
            raise ProtocolViolation(f"full track name over {MAX_FULL_TRACK_NAME} bytes")
        parts.append(buf.pull_bytes(length))
    return tuple(parts)


def _pull_full_track_name(buf: Buffer) -> tuple[TrackNamespace, bytes]:
    return wire.pull_full_track_name(buf, _pull_namespace)


def _pull_flag(buf: Buffer, what: str) -> bool:
    raw = buf.pull_uint8()
    if raw > 1:
        raise ProtocolViolation(f"{what} value {raw}")
    return bool(raw)


def _pull_group_order(buf: Buffer, *, allow_default: bool) -> GroupOrder | None:
    """Group Order (8): 1 or 2; 0 (the publisher's order) only where the draft allows."""
    raw = buf.pull_uint8()
    if raw == 0 and allow_default:
        return None
    if raw not in (1, 2):
        raise ProtocolViolation(f"group order value {raw}")
    return GroupOrder(raw)


def _put_group_order(w: wire.Writer, order: GroupOrder | None, *, allow_default: bool) -> None:
    if order is None and not allow_default:
        raise ValueError("this message needs an explicit group order")
    w.uint8(0 if order is None else int(order))


def _put_filter(w: wire.Writer, flt: SubscriptionFilter) -> None:
    w.varint(flt.filter_type)
    if flt.start is not None:
        w.location(flt.start)
    if flt.end_group is not None:
        w.varint(flt.end_group)


def _pull_filter(buf: Buffer) -> SubscriptionFilter:
    raw = buf.pull_varint()
    if raw not in (1, 2, 3, 4):
        raise ProtocolViolation(f"unknown filter type {raw}")
    filter_type = FilterType(raw)
    start = end_group = None
    if filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE):
        start = pull_location(buf)
    if filter_type == FilterType.ABSOLUTE_RANGE:
        end_group = buf.pull_varint()
    return SubscriptionFilter(filter_type, start, end_group)


def _put_largest(w: wire.Writer, largest: Location | None) -> None:
    """Content Exists (8) and, when 1, the Largest Location."""
    w.uint8(0 if largest is None else 1)
    if largest is not None:
        w.location(largest)


def _pull_largest(buf: Buffer) -> Location | None:
    return pull_location(buf) if _pull_flag(buf, "Content Exists") else None


# ---------------------------------------------------------------------------
# Key-Value-Pairs (section 1.4.2): absolute types, even = varint, odd = bytes
# ---------------------------------------------------------------------------


def _put_kvp(w: wire.Writer, ktype: int, value: int | bytes) -> None:
    _check_varint(ktype, "Key-Value-Pair type")
    w.varint(ktype)
    if ktype & 1:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"Key-Value-Pair 0x{ktype:x} (odd type) needs a bytes value")
        if len(value) > MAX_KVP_VALUE:
            raise ValueError(f"Key-Value-Pair 0x{ktype:x} value over {MAX_KVP_VALUE} bytes")
        w.length_prefixed(value)
    else:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"Key-Value-Pair 0x{ktype:x} (even type) needs an integer value")
        _check_varint(value, f"Key-Value-Pair 0x{ktype:x} value")
        w.varint(value)


def _pull_kvp(buf: Buffer) -> KeyValuePair:
    ktype = buf.pull_varint()
    if ktype & 1:
        length = buf.pull_varint()
        if length > MAX_KVP_VALUE:
            raise ProtocolViolation(f"Key-Value-Pair value of {length} bytes (max {MAX_KVP_VALUE})")
        return ktype, buf.pull_bytes(length)
    return ktype, buf.pull_varint()


def _pull_kvp_count(buf: Buffer, what: str) -> int:
    count = buf.pull_varint()
    # Each pair takes at least two bytes.
    if count > buf.remaining // 2:
        raise ProtocolViolation(f"{what}: {count} parameters cannot fit in the message")
    return count


def encode_extensions(extensions: Iterable[KeyValuePair]) -> bytes:
    """An Extension Headers block (no length prefix), pairs in the given order."""
    w = _writer()
    for ktype, value in extensions:
        _put_kvp(w, ktype, value)
    return bytes(w.data)


def _decode_extensions(data: bytes | memoryview) -> tuple[KeyValuePair, ...]:
    """A complete Extension Headers block; a pair crossing its end is malformed."""
    buf = Buffer(data, codec=QUIC_VARINT)
    items = []
    try:
        while not buf.eof():
            items.append(_pull_kvp(buf))
    except BufferReadError:
        raise ProtocolViolation("extension header crosses the end of its block") from None
    return tuple(items)


def _decode_token(value: bytes) -> AuthToken:
    return AuthToken.decode(value, QUIC_VARINT)


def _encode_token(token: AuthToken) -> bytes:
    return token.encode(QUIC_VARINT)


# ---------------------------------------------------------------------------
# Setup Parameters and version-specific Parameters
# ---------------------------------------------------------------------------

_SETUP_KNOWN = frozenset(int(t) for t in SetupParameterType)


@dataclass(frozen=True, slots=True)
class SetupParameters:
    """Setup Parameters of CLIENT_SETUP / SERVER_SETUP; None means absent.

    `unknown` keeps parameters this endpoint does not know, in wire order, so a
    caller can see them; the draft says to ignore them.
    """

    path: str | None = None
    max_request_id: int | None = None
    authorization_tokens: tuple[AuthToken, ...] = ()
    max_auth_token_cache_size: int | None = None
    authority: str | None = None
    implementation: str | None = None
    unknown: tuple[KeyValuePair, ...] = ()

    def _pairs(self) -> list[KeyValuePair]:
        t = SetupParameterType
        pairs: list[KeyValuePair] = []
        if self.path is not None:
            pairs.append((t.PATH, self.path.encode("utf-8")))
        if self.max_request_id is not None:
            pairs.append((t.MAX_REQUEST_ID, self.max_request_id))
        pairs.extend((t.AUTHORIZATION_TOKEN, _encode_token(token)) for token in self.authorization_tokens)
        if self.max_auth_token_cache_size is not None:
            pairs.append((t.MAX_AUTH_TOKEN_CACHE_SIZE, self.max_auth_token_cache_size))
        if self.authority is not None:
            pairs.append((t.AUTHORITY, self.authority.encode("utf-8")))
        if self.implementation is not None:
            pairs.append((t.MOQT_IMPLEMENTATION, self.implementation.encode("utf-8")))
        for ktype, value in self.unknown:
            if ktype in _SETUP_KNOWN:
                raise ValueError(f"setup parameter 0x{ktype:x} is known; use its field")
            pairs.append((ktype, value))
        return pairs

    def encode(self, w: wire.Writer) -> None:
        pairs = self._pairs()
        w.varint(len(pairs))
        for ktype, value in pairs:
            _put_kvp(w, ktype, value)

    @classmethod
    def decode(cls, buf: Buffer) -> "SetupParameters":
        count = _pull_kvp_count(buf, "SETUP")
        values: dict[str, Any] = {}
        tokens: list[AuthToken] = []
        unknown: list[KeyValuePair] = []
        names: dict[int, str] = {
            SetupParameterType.PATH: "path",
            SetupParameterType.MAX_REQUEST_ID: "max_request_id",
            SetupParameterType.MAX_AUTH_TOKEN_CACHE_SIZE: "max_auth_token_cache_size",
            SetupParameterType.AUTHORITY: "authority",
            SetupParameterType.MOQT_IMPLEMENTATION: "implementation",
        }
        for _ in range(count):
            ktype, value = _pull_kvp(buf)
            if ktype == SetupParameterType.AUTHORIZATION_TOKEN:
                tokens.append(_decode_token(value))  # type: ignore[arg-type]  # an odd key type carries bytes
                continue
            name = names.get(ktype)
            if name is None:
                unknown.append((ktype, value))
                continue
            if name in values:
                raise ProtocolViolation(f"setup parameter 0x{ktype:x} repeated")
            values[name] = setup_value(name, value)
        return cls(authorization_tokens=tuple(tokens), unknown=tuple(unknown), **values)


_P = ParameterType
_SCOPE_AUTH = frozenset({int(_P.AUTHORIZATION_TOKEN)})
_SCOPE_SUBSCRIBE = frozenset({int(_P.AUTHORIZATION_TOKEN), int(_P.DELIVERY_TIMEOUT)})
_SCOPE_SUBSCRIBE_OK = frozenset({int(_P.DELIVERY_TIMEOUT), int(_P.MAX_CACHE_DURATION)})
_SCOPE_PUBLISH = frozenset(int(t) for t in _P)
_SCOPE_PUBLISH_OK = frozenset({int(_P.DELIVERY_TIMEOUT)})
_SCOPE_FETCH_OK = frozenset({int(_P.MAX_CACHE_DURATION)})
_SCOPE_NONE: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Parameters:
    """The version-specific Parameters of one message; None means absent.

    A parameter the draft does not define, or one it defines for other messages
    only, is kept in `unknown` in wire order; receivers ignore it.
    """

    authorization_tokens: tuple[AuthToken, ...] = ()
    delivery_timeout: int | None = None
    max_cache_duration: int | None = None
    unknown: tuple[KeyValuePair, ...] = ()

    def encode(self, w: wire.Writer, scope: frozenset[int], message: str) -> None:
        pairs: list[KeyValuePair] = []
        if self.delivery_timeout is not None:
            pairs.append((_P.DELIVERY_TIMEOUT, self.delivery_timeout))
        pairs.extend((_P.AUTHORIZATION_TOKEN, _encode_token(token)) for token in self.authorization_tokens)
        if self.max_cache_duration is not None:
            pairs.append((_P.MAX_CACHE_DURATION, self.max_cache_duration))
        for ktype, _ in pairs:
            if ktype not in scope:
                raise ValueError(f"{message} may not carry parameter 0x{ktype:x}")
        for ktype, value in self.unknown:
            if ktype in scope:
                raise ValueError(f"parameter 0x{ktype:x} of {message} is known; use its field")
            pairs.append((ktype, value))
        w.varint(len(pairs))
        for ktype, value in pairs:
            _put_kvp(w, ktype, value)

    @classmethod
    def decode(cls, buf: Buffer, scope: frozenset[int], message: str) -> "Parameters":
        count = _pull_kvp_count(buf, message)
        values: dict[str, Any] = {}
        tokens: list[AuthToken] = []
        unknown: list[KeyValuePair] = []
        for _ in range(count):
            ktype, value = _pull_kvp(buf)
            if ktype not in scope:
                unknown.append((ktype, value))
            elif ktype == _P.AUTHORIZATION_TOKEN:
                tokens.append(_decode_token(value))  # type: ignore[arg-type]  # an odd key type carries bytes
            else:
                name = "delivery_timeout" if ktype == _P.DELIVERY_TIMEOUT else "max_cache_duration"
                if name in values:
                    raise ProtocolViolation(f"{message}: parameter 0x{ktype:x} repeated")
                values[name] = value
        if not (values or tokens or unknown):
            return _NO_PARAMETERS
        return cls(tuple(tokens), unknown=tuple(unknown), **values)


_NO_PARAMETERS = Parameters()
_NO_SETUP_PARAMETERS = SetupParameters()


# ---------------------------------------------------------------------------
# Control messages
# ---------------------------------------------------------------------------

# A field codec: (put, pull) of one field, or of adjacent fields read together.
# Both get the message class, whose SCOPE and NAME a Parameters field needs.
_Codec = tuple[Callable[[wire.Writer, Any, "type[Message]"], None], Callable[[Buffer, "type[Message]"], Any]]


def _put_priority(w: wire.Writer, value: int, cls: type) -> None:
    _check_uint8(value, "subscriber priority")
    w.uint8(value)


def _put_checked_namespace(w: wire.Writer, namespace: TrackNamespace, cls: type) -> None:
    _check_namespace(namespace)
    _put_namespace(w, namespace)


def _put_version(w: wire.Writer, version: int, cls: type) -> None:
    if not 0 <= version <= _U32_MAX:
        raise ValueError(f"version {version:#x} is not 32-bit")
    w.varint(version)


def _flag(what: str) -> _Codec:
    """A 0 / 1 byte; another value is a ProtocolViolation naming `what`."""
    return (lambda w, v, c: w.uint8(1 if v else 0), lambda b, c: _pull_flag(b, what))


def _group_order_codec(allow_default: bool) -> _Codec:
    return (
        lambda w, v, c: _put_group_order(w, v, allow_default=allow_default),
        lambda b, c: _pull_group_order(b, allow_default=allow_default),
    )


_VARINT: _Codec = (lambda w, v, c: w.varint(v), lambda b, c: b.pull_varint())
_PRIORITY: _Codec = (_put_priority, lambda b, c: b.pull_uint8())
_NAMESPACE: _Codec = (_put_checked_namespace, lambda b, c: _pull_namespace(b))
# A namespace prefix of no fields (every namespace) is accepted, not refused as the text's
# 1-32 bound would have it: moq-rs subscribes to every namespace that way right after SETUP
# (on every draft it speaks), and later drafts allow it. It is never sent.
_PREFIX: _Codec = (_put_checked_namespace, lambda b, c: _pull_namespace(b, least=0))
_FULL_TRACK_NAME: _Codec = (lambda w, v, c: _put_full_track_name(w, *v), lambda b, c: _pull_full_track_name(b))
_REASON: _Codec = (lambda w, v, c: w.reason(v), lambda b, c: pull_reason(b))
_LOCATION: _Codec = (lambda w, v, c: w.location(v), lambda b, c: pull_location(b))
_LARGEST: _Codec = (lambda w, v, c: _put_largest(w, v), lambda b, c: _pull_largest(b))
_FILTER: _Codec = (lambda w, v, c: _put_filter(w, v), lambda b, c: _pull_filter(b))
_FORWARD = _flag("Forward")
_GROUP_ORDER = _group_order_codec(allow_default=False)
_GROUP_ORDER_OR_DEFAULT = _group_order_codec(allow_default=True)
_PARAMETERS: _Codec = (
    lambda w, v, c: v.encode(w, c.SCOPE, c.NAME),
    lambda b, c: Parameters.decode(b, c.SCOPE, c.NAME),
)
_SETUP: _Codec = (lambda w, v, c: v.encode(w), lambda b, c: SetupParameters.decode(b))
_VERSION: _Codec = (_put_version, lambda b, c: _pull_version(b))
_GOAWAY_URI: _Codec = (lambda w, v, c: put_goaway_uri(w, v), lambda b, c: pull_goaway_uri(b))
_TRACK = ("namespace", "track_name")


class Message:
    """Base of the draft-14 control messages; subclasses are frozen dataclasses.

    Most messages are a fixed sequence of fields: FIELDS lists them in wire order
    as (attribute name, or names read together, codec), and encoding and decoding
    follow it. A message whose layout depends on its values has its own
    `_encode` / `_decode`.
    """

    __slots__ = ()
    NAME: ClassVar[str] = ""  # the MessageType name of TYPE
    TYPE: ClassVar[int] = -1
    FIELDS: ClassVar[tuple[tuple[str | tuple[str, ...], _Codec], ...]] = ()
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_NONE  # parameters it may carry

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TYPE" in cls.__dict__:
            cls.NAME = MessageType(cls.TYPE).name

    def encode(self) -> bytes:
        """The framed message: Type (varint), Length (16), payload."""
        w = _writer()
        self._encode(w)
        return wire.frame_message(QUIC_VARINT, self.TYPE, self.NAME, w.data)

    def _encode(self, w: wire.Writer) -> None:
        for names, (put, _) in self.FIELDS:
            if isinstance(names, str):
                put(w, getattr(self, names), type(self))
            else:
                put(w, tuple(getattr(self, name) for name in names), type(self))

    @classmethod
    def _decode(cls, buf: Buffer) -> "Message":
        values: dict[str, Any] = {}
        for names, (_, pull) in cls.FIELDS:
            value = pull(buf, cls)
            if isinstance(names, str):
                values[names] = value
            else:
                values.update(zip(names, value))
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ClientSetup(Message):
    """CLIENT_SETUP (0x20): the versions the client offers, most preferred first."""

    TYPE: ClassVar[int] = MessageType.CLIENT_SETUP
    versions: tuple[int, ...] = (VERSION,)
    parameters: SetupParameters = _NO_SETUP_PARAMETERS

    def _encode(self, w: wire.Writer) -> None:
        if not self.versions:
            raise ValueError("CLIENT_SETUP offers no version")
        w.varint(len(self.versions))
        for version in self.versions:
            _put_version(w, version, ClientSetup)
        self.parameters.encode(w)

    @classmethod
    def _decode(cls, buf: Buffer) -> "ClientSetup":
        count = buf.pull_varint()
        if count == 0 or count > buf.remaining:
            raise ProtocolViolation(f"CLIENT_SETUP with {count} versions")
        versions = tuple(_pull_version(buf) for _ in range(count))
        return cls(versions, SetupParameters.decode(buf))


def _pull_version(buf: Buffer) -> int:
    version = buf.pull_varint()
    if version > _U32_MAX:
        raise ProtocolViolation(f"version {version:#x} is not 32-bit")
    return version


@dataclass(frozen=True, slots=True)
class ServerSetup(Message):
    """SERVER_SETUP (0x21): the version the server chose among the client's."""

    TYPE: ClassVar[int] = MessageType.SERVER_SETUP
    FIELDS = (("selected_version", _VERSION), ("parameters", _SETUP))
    selected_version: int = VERSION
    parameters: SetupParameters = _NO_SETUP_PARAMETERS


@dataclass(frozen=True, slots=True)
class Goaway(Message):
    """GOAWAY (0x10): the sender will close the session; an empty URI reuses the current one."""

    TYPE: ClassVar[int] = MessageType.GOAWAY
    FIELDS = (("new_session_uri", _GOAWAY_URI),)
    new_session_uri: str = ""


@dataclass(frozen=True, slots=True)
class _RequestIdOnly(Message):
    """The shape of the messages that carry only a Request ID."""

    FIELDS = (("request_id", _VARINT),)
    request_id: int


@dataclass(frozen=True, slots=True)
class MaxRequestId(_RequestIdOnly):
    """MAX_REQUEST_ID (0x15): `request_id` is the new maximum plus one."""

    TYPE: ClassVar[int] = MessageType.MAX_REQUEST_ID


@dataclass(frozen=True, slots=True)
class RequestsBlocked(Message):
    """REQUESTS_BLOCKED (0x1A): the sender is blocked at this Maximum Request ID."""

    TYPE: ClassVar[int] = MessageType.REQUESTS_BLOCKED
    FIELDS = (("maximum_request_id", _VARINT),)
    maximum_request_id: int


# Draft-14 error codes of SUBSCRIBE_ERROR / FETCH_ERROR / ... and their draft-18
# REQUEST_ERROR counterparts (both directions; codes shared by all families first).
_ERRORS_TO_18: dict[int, int] = {
    0x0: RequestErrorCode.INTERNAL_ERROR,
    0x1: RequestErrorCode.UNAUTHORIZED,
    0x2: RequestErrorCode.TIMEOUT,
    0x3: RequestErrorCode.NOT_SUPPORTED,
    0x10: RequestErrorCode.MALFORMED_AUTH_TOKEN,
    0x12: RequestErrorCode.EXPIRED_AUTH_TOKEN,
}
_FAMILY_TO_18: dict[str, dict[int, int]] = {
    "SUBSCRIBE": {0x4: RequestErrorCode.DOES_NOT_EXIST, 0x5: RequestErrorCode.INVALID_RANGE},
    "FETCH": {
        0x4: RequestErrorCode.DOES_NOT_EXIST,
        0x5: RequestErrorCode.INVALID_RANGE,
        0x6: RequestErrorCode.DOES_NOT_EXIST,
        0x7: RequestErrorCode.INVALID_JOINING_REQUEST_ID,
        0x9: RequestErrorCode.MALFORMED_TRACK,
    },
    "PUBLISH": {0x4: RequestErrorCode.UNINTERESTED},
    "PUBLISH_NAMESPACE": {0x4: RequestErrorCode.UNINTERESTED},
    "SUBSCRIBE_NAMESPACE": {0x4: RequestErrorCode.DOES_NOT_EXIST, 0x5: RequestErrorCode.PREFIX_OVERLAP},
}


@dataclass(frozen=True, slots=True)
class _RequestError(Message):
    """Request ID, Error Code, Reason Phrase: the shape of every *_ERROR message."""

    FAMILY: ClassVar[str] = ""
    FIELDS = (("request_id", _VARINT), ("error_code", _VARINT), ("reason", _REASON))
    request_id: int
    error_code: int
    reason: str = ""

    def to_draft18(self) -> m18.RequestErrorMessage:
        """The draft-18 REQUEST_ERROR; a code without a counterpart is INTERNAL_ERROR."""
        code = _FAMILY_TO_18[self.FAMILY].get(self.error_code, _ERRORS_TO_18.get(self.error_code, 0))
        return m18.RequestErrorMessage(int(code), 0, self.reason)

    @classmethod
    def from_draft18(cls, message: m18.RequestErrorMessage, request_id: int) -> "_RequestError":
        """This error for a draft-18 REQUEST_ERROR answering `request_id`."""
        back = {v: k for k, v in _ERRORS_TO_18.items()}
        back.update({v: k for k, v in sorted(_FAMILY_TO_18[cls.FAMILY].items(), reverse=True)})
        return cls(request_id, back.get(message.error_code, 0), message.reason)


@dataclass(frozen=True, slots=True)
class Subscribe(Message):
    """SUBSCRIBE (0x3). `group_order` None is 0: the original publisher's order."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_SUBSCRIBE
    FIELDS = (
        ("request_id", _VARINT),
        (_TRACK, _FULL_TRACK_NAME),
        ("subscriber_priority", _PRIORITY),
        ("group_order", _GROUP_ORDER_OR_DEFAULT),
        ("forward", _FORWARD),
        ("filter", _FILTER),
        ("parameters", _PARAMETERS),
    )
    request_id: int
    namespace: TrackNamespace
    track_name: bytes
    subscriber_priority: int = 128
    group_order: GroupOrder | None = None
    forward: bool = True
    filter: SubscriptionFilter = field(default_factory=SubscriptionFilter.largest_object)
    parameters: Parameters = _NO_PARAMETERS

    def to_draft18(self) -> m18.Subscribe:
        """The draft-18 SUBSCRIBE: the fixed fields become parameters."""
        p = self.parameters
        parameters = m18.Parameters(
            authorization_tokens=p.authorization_tokens,
            object_delivery_timeout=p.delivery_timeout,
            subscriber_priority=self.subscriber_priority,
            group_order=self.group_order,
            subscription_filter=self.filter,
            forward=self.forward,
        )
        return m18.Subscribe(self.request_id, self.namespace, self.track_name, parameters)

    @classmethod
    def from_draft18(cls, message: m18.Subscribe) -> "Subscribe":
        """This SUBSCRIBE for a draft-18 one; see the module docstring for defaults."""
        p = message.parameters
        flt = p.subscription_filter or SubscriptionFilter.absolute_start(0, 0)
        return cls(
            message.request_id,
            message.namespace,
            message.track_name,
            128 if p.subscriber_priority is None else p.subscriber_priority,
            p.group_order,
            True if p.forward is None else bool(p.forward),
            flt,
            Parameters(p.authorization_tokens, p.object_delivery_timeout),
        )


@dataclass(frozen=True, slots=True)
class SubscribeOk(Message):
    """SUBSCRIBE_OK (0x4). `largest_location` None is Content Exists 0."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_OK
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_SUBSCRIBE_OK
    FIELDS = (
        ("request_id", _VARINT),
        ("track_alias", _VARINT),
        ("expires", _VARINT),
        ("group_order", _GROUP_ORDER),
        ("largest_location", _LARGEST),
        ("parameters", _PARAMETERS),
    )
    request_id: int
    track_alias: int
    expires: int = 0
    group_order: GroupOrder = GroupOrder.ASCENDING
    largest_location: Location | None = None
    parameters: Parameters = _NO_PARAMETERS

    def to_draft18(self) -> m18.SubscribeOk:
        """The draft-18 SUBSCRIBE_OK; group order and cache duration become Track Properties."""
        p = self.parameters
        properties: list[wire.Property] = []
        if p.max_cache_duration is not None:
            properties.append((wire.TrackPropertyType.MAX_CACHE_DURATION, p.max_cache_duration))
        properties.append((wire.TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, int(self.group_order)))
        parameters = m18.Parameters(
            expires=self.expires or None,
            largest_object=self.largest_location,
        )
        return m18.SubscribeOk(self.track_alias, parameters, tuple(properties))

    @classmethod
    def from_draft18(cls, message: m18.SubscribeOk, request_id: int) -> "SubscribeOk":
        """This SUBSCRIBE_OK for a draft-18 one answering `request_id`."""
        order, cache = _ok_properties(message.track_properties)
        return cls(
            request_id,
            message.track_alias,
            message.parameters.expires or 0,
            order,
            message.parameters.largest_object,
            Parameters(max_cache_duration=cache),
        )


def _ok_properties(properties: wire.Properties) -> tuple[GroupOrder, int | None]:
    """Group order (default Ascending) and cache duration from draft-18 Track Properties."""
    order = wire.property_value(properties, wire.TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, 1)
    return GroupOrder(order), wire.property_value(properties, wire.TrackPropertyType.MAX_CACHE_DURATION)


@dataclass(frozen=True, slots=True)
class SubscribeError(_RequestError):
    """SUBSCRIBE_ERROR (0x5); codes in SubscribeErrorCode."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_ERROR
    FAMILY: ClassVar[str] = "SUBSCRIBE"


@dataclass(frozen=True, slots=True)
class SubscribeUpdate(Message):
    """SUBSCRIBE_UPDATE (0x2). `end_group` None is open-ended (wire End Group 0;
    otherwise the wire carries end_group + 1)."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_UPDATE
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_SUBSCRIBE
    request_id: int
    subscription_request_id: int
    start: Location
    end_group: int | None = None
    subscriber_priority: int = 128
    forward: bool = True
    parameters: Parameters = _NO_PARAMETERS

    def _encode(self, w: wire.Writer) -> None:
        _check_uint8(self.subscriber_priority, "subscriber priority")
        if self.end_group is not None and self.end_group < self.start.group:
            raise ValueError("end group before the start group")
        w.varint(self.request_id)
        w.varint(self.subscription_request_id)
        w.location(self.start)
        w.varint(0 if self.end_group is None else self.end_group + 1)
        w.uint8(self.subscriber_priority)
        w.uint8(1 if self.forward else 0)
        self.parameters.encode(w, self.SCOPE, self.NAME)

    @classmethod
    def _decode(cls, buf: Buffer) -> "SubscribeUpdate":
        request_id = buf.pull_varint()
        subscription = buf.pull_varint()
        start = pull_location(buf)
        raw_end = buf.pull_varint()
        end_group = None if raw_end == 0 else raw_end - 1
        if end_group is not None and end_group < start.group:
            raise ProtocolViolation("SUBSCRIBE_UPDATE end group before the start group")
        priority = buf.pull_uint8()
        forward = _pull_flag(buf, "Forward")
        parameters = Parameters.decode(buf, cls.SCOPE, cls.NAME)
        return cls(request_id, subscription, start, end_group, priority, forward, parameters)


@dataclass(frozen=True, slots=True)
class Unsubscribe(_RequestIdOnly):
    """UNSUBSCRIBE (0xA)."""

    TYPE: ClassVar[int] = MessageType.UNSUBSCRIBE


@dataclass(frozen=True, slots=True)
class PublishDone(Message):
    """PUBLISH_DONE (0xB), SUBSCRIBE_DONE before draft-14; codes in PublishDoneCode."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_DONE
    FIELDS = (
        ("request_id", _VARINT),
        ("status_code", _VARINT),
        ("stream_count", _VARINT),
        ("reason", _REASON),
    )
    request_id: int
    status_code: int
    stream_count: int
    reason: str = ""

    def to_draft18(self) -> m18.PublishDone:
        """The draft-18 PUBLISH_DONE; the status codes are renumbered by name."""
        code = _PUBLISH_DONE_TO_18.get(self.status_code, 0)
        return m18.PublishDone(code, self.stream_count, self.reason)

    @classmethod
    def from_draft18(cls, message: m18.PublishDone, request_id: int) -> "PublishDone":
        back = {v: k for k, v in _PUBLISH_DONE_TO_18.items()}
        return cls(request_id, back.get(message.status_code, 0), message.stream_count, message.reason)


def _by_name(source: type[IntEnum], target: type[IntEnum]) -> dict[int, int]:
    return {int(code): int(target[code.name]) for code in source if code.name in target.__members__}


_PUBLISH_DONE_TO_18 = _by_name(PublishDoneCode, PublishDoneCode18)


@dataclass(frozen=True, slots=True)
class Publish(Message):
    """PUBLISH (0x1D): a publisher-initiated subscription."""

    TYPE: ClassVar[int] = MessageType.PUBLISH
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_PUBLISH
    FIELDS = (
        ("request_id", _VARINT),
        (_TRACK, _FULL_TRACK_NAME),
        ("track_alias", _VARINT),
        ("group_order", _GROUP_ORDER),
        ("largest_location", _LARGEST),
        ("forward", _FORWARD),
        ("parameters", _PARAMETERS),
    )
    request_id: int
    namespace: TrackNamespace
    track_name: bytes
    track_alias: int
    group_order: GroupOrder = GroupOrder.ASCENDING
    largest_location: Location | None = None
    forward: bool = True
    parameters: Parameters = _NO_PARAMETERS


@dataclass(frozen=True, slots=True)
class PublishOk(Message):
    """PUBLISH_OK (0x1E): the subscriber accepts a PUBLISH."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_OK
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_PUBLISH_OK
    FIELDS = (
        ("request_id", _VARINT),
        ("forward", _FORWARD),
        ("subscriber_priority", _PRIORITY),
        ("group_order", _GROUP_ORDER),
        ("filter", _FILTER),
        ("parameters", _PARAMETERS),
    )
    request_id: int
    forward: bool = True
    subscriber_priority: int = 128
    group_order: GroupOrder = GroupOrder.ASCENDING
    filter: SubscriptionFilter = field(default_factory=SubscriptionFilter.largest_object)
    parameters: Parameters = _NO_PARAMETERS


@dataclass(frozen=True, slots=True)
class PublishError(_RequestError):
    """PUBLISH_ERROR (0x1F); codes in PublishErrorCode."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_ERROR
    FAMILY: ClassVar[str] = "PUBLISH"


@dataclass(frozen=True, slots=True)
class Fetch(wire.FetchFields, Message):
    """FETCH (0x16). Standalone: namespace, track_name, start, end (end is the wire
    End Location: the last Object plus one, Object 0 meaning the whole group).
    Joining: joining_request_id and joining_start. `group_order` None is 0."""

    TYPE: ClassVar[int] = MessageType.FETCH
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_AUTH
    request_id: int
    fetch_type: FetchType = FetchType.STANDALONE
    namespace: TrackNamespace | None = None
    track_name: bytes | None = None
    start: Location | None = None
    end: Location | None = None
    joining_request_id: int | None = None
    joining_start: int | None = None
    subscriber_priority: int = 128
    group_order: GroupOrder | None = None
    parameters: Parameters = _NO_PARAMETERS


    def _encode(self, w: wire.Writer) -> None:
        _check_uint8(self.subscriber_priority, "subscriber priority")
        w.varint(self.request_id)
        w.uint8(self.subscriber_priority)
        _put_group_order(w, self.group_order, allow_default=True)
        w.varint(self.fetch_type)
        if self.fetch_type == FetchType.STANDALONE:
            namespace, track_name, start, end = self.track_and_range()
            _put_full_track_name(w, namespace, track_name)
            w.location(start)
            w.location(end)
        else:
            joining_request_id, joining_start = self.joining()
            w.varint(joining_request_id)
            w.varint(joining_start)
        self.parameters.encode(w, self.SCOPE, self.NAME)

    @classmethod
    def _decode(cls, buf: Buffer) -> "Fetch":
        request_id = buf.pull_varint()
        priority = buf.pull_uint8()
        order = _pull_group_order(buf, allow_default=True)
        raw_type = buf.pull_varint()
        if raw_type not in (1, 2, 3):
            raise ProtocolViolation(f"unknown fetch type {raw_type}")
        fetch_type = FetchType(raw_type)
        if fetch_type == FetchType.STANDALONE:
            namespace, name = _pull_full_track_name(buf)
            start = pull_location(buf)
            end = pull_location(buf)
            parameters = Parameters.decode(buf, cls.SCOPE, cls.NAME)
            return cls(
                request_id, fetch_type, namespace, name, start, end,
                subscriber_priority=priority, group_order=order, parameters=parameters,
            )
        joining_id = buf.pull_varint()
        joining_start = buf.pull_varint()
        parameters = Parameters.decode(buf, cls.SCOPE, cls.NAME)
        return cls(
            request_id, fetch_type,
            joining_request_id=joining_id, joining_start=joining_start,
            subscriber_priority=priority, group_order=order, parameters=parameters,
        )

    def to_draft18(self) -> m18.Fetch:
        """The draft-18 FETCH: priority and group order become parameters."""
        parameters = m18.Parameters(
            authorization_tokens=self.parameters.authorization_tokens,
            subscriber_priority=self.subscriber_priority,
            group_order=self.group_order,
        )
        return m18.Fetch(
            self.request_id, self.fetch_type, self.namespace, self.track_name, self.start, self.end,
            self.joining_request_id, self.joining_start, parameters,
        )

    @classmethod
    def from_draft18(cls, message: m18.Fetch) -> "Fetch":
        p = message.parameters
        return cls(
            message.request_id, message.fetch_type, message.namespace, message.track_name,
            message.start, message.end, message.joining_request_id, message.joining_start,
            128 if p.subscriber_priority is None else p.subscriber_priority,
            p.group_order,
            Parameters(p.authorization_tokens),
        )


@dataclass(frozen=True, slots=True)
class FetchOk(Message):
    """FETCH_OK (0x18). `end_location` uses the FETCH End Location encoding."""

    TYPE: ClassVar[int] = MessageType.FETCH_OK
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_FETCH_OK
    FIELDS = (
        ("request_id", _VARINT),
        ("group_order", _GROUP_ORDER),
        ("end_of_track", _flag("End Of Track")),
        ("end_location", _LOCATION),
        ("parameters", _PARAMETERS),
    )
    request_id: int
    group_order: GroupOrder
    end_of_track: bool
    end_location: Location
    parameters: Parameters = _NO_PARAMETERS

    def to_draft18(self) -> m18.FetchOk:
        """The draft-18 FETCH_OK; the group order is known to the FETCH's sender."""
        properties: tuple[wire.Property, ...] = ()
        if self.parameters.max_cache_duration is not None:
            properties = ((wire.TrackPropertyType.MAX_CACHE_DURATION, self.parameters.max_cache_duration),)
        return m18.FetchOk(self.end_of_track, self.end_location, track_properties=properties)

    @classmethod
    def from_draft18(
        cls, message: m18.FetchOk, request_id: int, group_order: GroupOrder = GroupOrder.ASCENDING
    ) -> "FetchOk":
        cache = wire.property_value(message.track_properties, wire.TrackPropertyType.MAX_CACHE_DURATION)
        return cls(
            request_id, group_order, message.end_of_track, message.end_location, Parameters(max_cache_duration=cache)
        )


@dataclass(frozen=True, slots=True)
class FetchError(_RequestError):
    """FETCH_ERROR (0x19); codes in FetchErrorCode."""

    TYPE: ClassVar[int] = MessageType.FETCH_ERROR
    FAMILY: ClassVar[str] = "FETCH"


@dataclass(frozen=True, slots=True)
class FetchCancel(_RequestIdOnly):
    """FETCH_CANCEL (0x17)."""

    TYPE: ClassVar[int] = MessageType.FETCH_CANCEL


@dataclass(frozen=True, slots=True)
class TrackStatus(Subscribe):
    """TRACK_STATUS (0xD): SUBSCRIBE's format, without subscription state."""

    TYPE: ClassVar[int] = MessageType.TRACK_STATUS

    # SUBSCRIBE's format, but a different draft-18 message: to_draft18() and
    # from_draft18() convert to and from TRACK_STATUS, not SUBSCRIBE.
    def to_draft18(self) -> m18.TrackStatus:  # type: ignore[override]
        """The draft-18 TRACK_STATUS, which carries only the track and its tokens."""
        return m18.TrackStatus(
            self.request_id, self.namespace, self.track_name,
            m18.Parameters(authorization_tokens=self.parameters.authorization_tokens),
        )

    @classmethod
    def from_draft18(cls, message: m18.TrackStatus) -> "TrackStatus":  # type: ignore[override]  # see to_draft18
        """The subscription fields get their defaults: a publisher ignores them."""
        return cls(
            message.request_id, message.namespace, message.track_name,
            parameters=Parameters(message.parameters.authorization_tokens),
        )


@dataclass(frozen=True, slots=True)
class TrackStatusOk(SubscribeOk):
    """TRACK_STATUS_OK (0xE): SUBSCRIBE_OK's format, Track Alias 0."""

    TYPE: ClassVar[int] = MessageType.TRACK_STATUS_OK

    # SUBSCRIBE_OK's format, but draft-18 answers TRACK_STATUS with REQUEST_OK: to_draft18()
    # and from_draft18() convert to and from REQUEST_OK, not SUBSCRIBE_OK.
    def to_draft18(self) -> m18.RequestOk:  # type: ignore[override]
        """The draft-18 REQUEST_OK answering TRACK_STATUS; expires has no place there."""
        ok = SubscribeOk.to_draft18(self)
        return m18.RequestOk(m18.Parameters(largest_object=self.largest_location), ok.track_properties)

    @classmethod
    def from_draft18(  # type: ignore[override]  # see to_draft18
        cls, message: m18.RequestOk, request_id: int
    ) -> "TrackStatusOk":
        """This TRACK_STATUS_OK (Track Alias 0) for a draft-18 REQUEST_OK answering `request_id`."""
        order, cache = _ok_properties(message.track_properties)
        return cls(request_id, 0, 0, order, message.parameters.largest_object, Parameters(max_cache_duration=cache))


@dataclass(frozen=True, slots=True)
class TrackStatusError(_RequestError):
    """TRACK_STATUS_ERROR (0xF): SUBSCRIBE_ERROR's format and codes."""

    TYPE: ClassVar[int] = MessageType.TRACK_STATUS_ERROR
    FAMILY: ClassVar[str] = "SUBSCRIBE"


@dataclass(frozen=True, slots=True)
class PublishNamespace(Message):
    """PUBLISH_NAMESPACE (0x6), ANNOUNCE before draft-14."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_NAMESPACE
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_AUTH
    FIELDS = (("request_id", _VARINT), ("namespace", _NAMESPACE), ("parameters", _PARAMETERS))
    request_id: int
    namespace: TrackNamespace
    parameters: Parameters = _NO_PARAMETERS


@dataclass(frozen=True, slots=True)
class PublishNamespaceOk(_RequestIdOnly):
    """PUBLISH_NAMESPACE_OK (0x7)."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_NAMESPACE_OK


@dataclass(frozen=True, slots=True)
class PublishNamespaceError(_RequestError):
    """PUBLISH_NAMESPACE_ERROR (0x8); codes in PublishNamespaceErrorCode."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_NAMESPACE_ERROR
    FAMILY: ClassVar[str] = "PUBLISH_NAMESPACE"


@dataclass(frozen=True, slots=True)
class PublishNamespaceDone(Message):
    """PUBLISH_NAMESPACE_DONE (0x9): the publisher withdraws a namespace."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_NAMESPACE_DONE
    FIELDS = (("namespace", _NAMESPACE),)
    namespace: TrackNamespace


@dataclass(frozen=True, slots=True)
class PublishNamespaceCancel(Message):
    """PUBLISH_NAMESPACE_CANCEL (0xC): the subscriber stops routing a namespace."""

    TYPE: ClassVar[int] = MessageType.PUBLISH_NAMESPACE_CANCEL
    FIELDS = (("namespace", _NAMESPACE), ("error_code", _VARINT), ("reason", _REASON))
    namespace: TrackNamespace
    error_code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SubscribeNamespace(Message):
    """SUBSCRIBE_NAMESPACE (0x11)."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_NAMESPACE
    SCOPE: ClassVar[frozenset[int]] = _SCOPE_AUTH
    FIELDS = (("request_id", _VARINT), ("namespace_prefix", _PREFIX), ("parameters", _PARAMETERS))
    request_id: int
    namespace_prefix: TrackNamespace
    parameters: Parameters = _NO_PARAMETERS


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceOk(_RequestIdOnly):
    """SUBSCRIBE_NAMESPACE_OK (0x12)."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_NAMESPACE_OK


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceError(_RequestError):
    """SUBSCRIBE_NAMESPACE_ERROR (0x13); codes in SubscribeNamespaceErrorCode."""

    TYPE: ClassVar[int] = MessageType.SUBSCRIBE_NAMESPACE_ERROR
    FAMILY: ClassVar[str] = "SUBSCRIBE_NAMESPACE"


@dataclass(frozen=True, slots=True)
class UnsubscribeNamespace(Message):
    """UNSUBSCRIBE_NAMESPACE (0x14)."""

    TYPE: ClassVar[int] = MessageType.UNSUBSCRIBE_NAMESPACE
    FIELDS = (("namespace_prefix", _PREFIX),)
    namespace_prefix: TrackNamespace


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        ClientSetup,
        ServerSetup,
        Goaway,
        MaxRequestId,
        RequestsBlocked,
        Subscribe,
        SubscribeOk,
        SubscribeError,
        SubscribeUpdate,
        Unsubscribe,
        PublishDone,
        Publish,
        PublishOk,
        PublishError,
        Fetch,
        FetchOk,
        FetchError,
        FetchCancel,
        TrackStatus,
        TrackStatusOk,
        TrackStatusError,
        PublishNamespace,
        PublishNamespaceOk,
        PublishNamespaceError,
        PublishNamespaceDone,
        PublishNamespaceCancel,
        SubscribeNamespace,
        SubscribeNamespaceOk,
        SubscribeNamespaceError,
        UnsubscribeNamespace,
    )
}


def _decode_payload(mtype: int, payload: Buffer) -> Message:
    cls = MESSAGE_TYPES.get(mtype)
    if cls is None:
        raise ProtocolViolation(f"unknown message type 0x{mtype:x}")
    return wire.decode_checked(cls.NAME, payload, cls._decode)


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """Decode exactly one framed message; raises ProtocolViolation otherwise."""
    return wire.decode_framed(data, QUIC_VARINT, _decode_payload)


class ControlStreamParser(wire.FramedMessageParser):
    """Splits the control stream into messages as bytes arrive.

    Holds at most one partial message (under 64 KiB by construction). An unknown
    message type is reported as soon as its type is read, not after its payload.
    """

    __slots__ = ()
    CODEC = QUIC_VARINT
    EARLY_UNKNOWN = True

    def _known(self, mtype: int) -> bool:
        return mtype in MESSAGE_TYPES

    def _decode(self, mtype: int, payload: Buffer) -> Message:
        return _decode_payload(mtype, payload)
