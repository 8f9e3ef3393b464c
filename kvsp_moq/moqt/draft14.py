"""MOQT draft-14 wire format: control messages, data streams and datagrams, sans I/O.

Draft-14 is the fallback for peers that do not speak draft-18. It differs from
draft-18 in ways that reach every byte, so it has a codec of its own rather than a
flag in `messages.py` / `data.py` (it reuses their helpers and types where the two
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

from . import data as data18
from . import messages as m18
from .errors import (
    BufferReadError,
    ObjectTooLarge,
    ProtocolViolation,
    RequestErrorCode,
)
from .errors import PublishDoneCode as PublishDoneCode18
from .messages import (
    AuthToken,
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    SubscriptionFilter,
    _pull_location,
    _pull_reason,
)
from .varint import QUIC_VARINT, QUIC_VARINT_MAX, VI64, Buffer, encode_quic_varint

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
    "SubgroupHeader",
    "SubgroupObject",
    "FetchHeader",
    "FetchObject",
    "ObjectDatagram",
    "DataItem",
    "SubgroupWriter",
    "encode_fetch_object",
    "encode_extensions",
    "decode_datagram",
    "is_subgroup_stream_type",
    "DataStreamParser",
]

DRAFT = 14
VERSION = 0xFF00000E
ALPN = "moq-00"

MAX_MESSAGE_LENGTH = 0xFFFF
MAX_NAMESPACE_FIELDS = 32
MAX_FULL_TRACK_NAME = 4096
MAX_REASON_PHRASE = 1024
MAX_GOAWAY_URI = 8192
MAX_KVP_VALUE = 0xFFFF
_U32_MAX = 0xFFFF_FFFF

STREAM_TYPE_FETCH_HEADER = 0x05
DEFAULT_MAX_OBJECT_SIZE = data18.DEFAULT_MAX_OBJECT_SIZE
DEFAULT_MAX_EXTENSIONS_SIZE = data18.DEFAULT_MAX_PROPERTIES_SIZE

TrackNamespace = tuple[bytes, ...]
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


def _writer() -> m18.Writer:
    return m18.Writer(QUIC_VARINT)


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


def _put_namespace(w: m18.Writer, namespace: TrackNamespace) -> None:
    w.varint(len(namespace))
    for part in namespace:
        w.length_prefixed(part)


def _put_full_track_name(w: m18.Writer, namespace: TrackNamespace, name: bytes) -> None:
    _check_namespace(namespace, name)
    _put_namespace(w, namespace)
    w.length_prefixed(name)


def _pull_namespace(buf: Buffer, budget: int = MAX_FULL_TRACK_NAME) -> TrackNamespace:
    count = buf.pull_varint()
    if not 1 <= count <= MAX_NAMESPACE_FIELDS:
        raise ProtocolViolation(f"namespace of {count} fields (1 to {MAX_NAMESPACE_FIELDS})")
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
    return m18._pull_full_track_name(buf, _pull_namespace)


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


def _put_group_order(w: m18.Writer, order: GroupOrder | None, *, allow_default: bool) -> None:
    if order is None and not allow_default:
        raise ValueError("this message needs an explicit group order")
    w.uint8(0 if order is None else int(order))


def _put_filter(w: m18.Writer, flt: SubscriptionFilter) -> None:
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
        start = _pull_location(buf)
    if filter_type == FilterType.ABSOLUTE_RANGE:
        end_group = buf.pull_varint()
    return SubscriptionFilter(filter_type, start, end_group)


def _put_largest(w: m18.Writer, largest: Location | None) -> None:
    """Content Exists (8) and, when 1, the Largest Location."""
    w.uint8(0 if largest is None else 1)
    if largest is not None:
        w.location(largest)


def _pull_largest(buf: Buffer) -> Location | None:
    return _pull_location(buf) if _pull_flag(buf, "Content Exists") else None


# ---------------------------------------------------------------------------
# Key-Value-Pairs (section 1.4.2): absolute types, even = varint, odd = bytes
# ---------------------------------------------------------------------------


def _put_kvp(w: m18.Writer, ktype: int, value: int | bytes) -> None:
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

    def encode(self, w: m18.Writer) -> None:
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
        names = {
            SetupParameterType.PATH: "path",
            SetupParameterType.MAX_REQUEST_ID: "max_request_id",
            SetupParameterType.MAX_AUTH_TOKEN_CACHE_SIZE: "max_auth_token_cache_size",
            SetupParameterType.AUTHORITY: "authority",
            SetupParameterType.MOQT_IMPLEMENTATION: "implementation",
        }
        for _ in range(count):
            ktype, value = _pull_kvp(buf)
            if ktype == SetupParameterType.AUTHORIZATION_TOKEN:
                tokens.append(_decode_token(value))  # type: ignore[arg-type]
                continue
            name = names.get(ktype)  # type: ignore[call-overload]
            if name is None:
                unknown.append((ktype, value))
                continue
            if name in values:
                raise ProtocolViolation(f"setup parameter 0x{ktype:x} repeated")
            values[name] = m18._setup_value(name, value)  # type: ignore[arg-type]
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

    def encode(self, w: m18.Writer, scope: frozenset[int], message: str) -> None:
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
                tokens.append(_decode_token(value))  # type: ignore[arg-type]
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
_Codec = tuple[Callable[[m18.Writer, Any, type], None], Callable[[Buffer, type], Any]]


def _put_priority(w: m18.Writer, value: int, cls: type) -> None:
    _check_uint8(value, "subscriber priority")
    w.uint8(value)


def _put_checked_namespace(w: m18.Writer, namespace: TrackNamespace, cls: type) -> None:
    _check_namespace(namespace)
    _put_namespace(w, namespace)


def _put_version(w: m18.Writer, version: int, cls: type) -> None:
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
_FULL_TRACK_NAME: _Codec = (lambda w, v, c: _put_full_track_name(w, *v), lambda b, c: _pull_full_track_name(b))
_REASON: _Codec = (lambda w, v, c: w.reason(v), lambda b, c: _pull_reason(b))
_LOCATION: _Codec = (lambda w, v, c: w.location(v), lambda b, c: _pull_location(b))
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
_GOAWAY_URI: _Codec = (lambda w, v, c: m18._put_goaway_uri(w, v), lambda b, c: m18._pull_goaway_uri(b))
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
        return m18.frame_message(QUIC_VARINT, self.TYPE, self.NAME, w.data)

    def _encode(self, w: m18.Writer) -> None:
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

    def _encode(self, w: m18.Writer) -> None:
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
        properties: list[m18.Property] = []
        if p.max_cache_duration is not None:
            properties.append((m18.TrackPropertyType.MAX_CACHE_DURATION, p.max_cache_duration))
        properties.append((m18.TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, int(self.group_order)))
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


def _ok_properties(properties: m18.Properties) -> tuple[GroupOrder, int | None]:
    """Group order (default Ascending) and cache duration from draft-18 Track Properties."""
    order = m18.property_value(properties, m18.TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, 1)
    return GroupOrder(order), m18.property_value(properties, m18.TrackPropertyType.MAX_CACHE_DURATION)


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

    def _encode(self, w: m18.Writer) -> None:
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
        start = _pull_location(buf)
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
class Fetch(Message):
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

    __post_init__ = m18.Fetch.__post_init__  # the same standalone / joining fields as draft-18

    def _encode(self, w: m18.Writer) -> None:
        _check_uint8(self.subscriber_priority, "subscriber priority")
        w.varint(self.request_id)
        w.uint8(self.subscriber_priority)
        _put_group_order(w, self.group_order, allow_default=True)
        w.varint(self.fetch_type)
        if self.fetch_type == FetchType.STANDALONE:
            _put_full_track_name(w, self.namespace, self.track_name)  # type: ignore[arg-type]
            w.location(self.start)  # type: ignore[arg-type]
            w.location(self.end)  # type: ignore[arg-type]
        else:
            w.varint(self.joining_request_id)  # type: ignore[arg-type]
            w.varint(self.joining_start)  # type: ignore[arg-type]
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
            start = _pull_location(buf)
            end = _pull_location(buf)
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
        properties: tuple[m18.Property, ...] = ()
        if self.parameters.max_cache_duration is not None:
            properties = ((m18.TrackPropertyType.MAX_CACHE_DURATION, self.parameters.max_cache_duration),)
        return m18.FetchOk(self.end_of_track, self.end_location, track_properties=properties)

    @classmethod
    def from_draft18(
        cls, message: m18.FetchOk, request_id: int, group_order: GroupOrder = GroupOrder.ASCENDING
    ) -> "FetchOk":
        cache = m18.property_value(message.track_properties, m18.TrackPropertyType.MAX_CACHE_DURATION)
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

    def to_draft18(self) -> m18.TrackStatus:  # type: ignore[override]
        """The draft-18 TRACK_STATUS, which carries only the track and its tokens."""
        return m18.TrackStatus(
            self.request_id, self.namespace, self.track_name,
            m18.Parameters(authorization_tokens=self.parameters.authorization_tokens),
        )

    @classmethod
    def from_draft18(cls, message: m18.TrackStatus) -> "TrackStatus":  # type: ignore[override]
        """The subscription fields get their defaults: a publisher ignores them."""
        return cls(
            message.request_id, message.namespace, message.track_name,
            parameters=Parameters(message.parameters.authorization_tokens),
        )


@dataclass(frozen=True, slots=True)
class TrackStatusOk(SubscribeOk):
    """TRACK_STATUS_OK (0xE): SUBSCRIBE_OK's format, Track Alias 0."""

    TYPE: ClassVar[int] = MessageType.TRACK_STATUS_OK

    def to_draft18(self) -> m18.RequestOk:  # type: ignore[override]
        """The draft-18 REQUEST_OK answering TRACK_STATUS; expires has no place there."""
        ok = SubscribeOk.to_draft18(self)
        return m18.RequestOk(m18.Parameters(largest_object=self.largest_location), ok.track_properties)

    @classmethod
    def from_draft18(cls, message: m18.RequestOk, request_id: int) -> "TrackStatusOk":  # type: ignore[override]
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
    FIELDS = (("request_id", _VARINT), ("namespace_prefix", _NAMESPACE), ("parameters", _PARAMETERS))
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
    FIELDS = (("namespace_prefix", _NAMESPACE),)
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
    return m18.decode_checked(cls.NAME, payload, cls._decode)


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """Decode exactly one framed message; raises ProtocolViolation otherwise."""
    return m18.decode_framed(data, QUIC_VARINT, _decode_payload)


class ControlStreamParser(m18.FramedMessageParser):
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


# ---------------------------------------------------------------------------
# Data streams and datagrams (section 10)
# ---------------------------------------------------------------------------


def is_subgroup_stream_type(stream_type: int) -> bool:
    """True for a SUBGROUP_HEADER type: 0x10-0x15 and 0x18-0x1D."""
    return 0x10 <= stream_type <= 0x1D and stream_type & 0x06 != 0x06


def _status(raw: int) -> ObjectStatus:
    if raw not in _STATUSES:
        raise ProtocolViolation(f"unknown object status 0x{raw:x}")
    return ObjectStatus(raw)


def _properties_to_18(extensions: tuple[KeyValuePair, ...]) -> m18.Properties:
    """Extension headers as draft-18 Properties: type order, immutable block re-encoded."""
    out: list[m18.Property] = []
    for ktype, value in extensions:
        if ktype == ExtensionType.IMMUTABLE_EXTENSIONS and isinstance(value, bytes):
            inner = sorted(_decode_extensions(value), key=lambda kv: kv[0])
            w = m18.Writer(VI64)
            m18.encode_properties(w, tuple(inner))
            value = bytes(w.data)
        out.append((ktype, value))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _properties_from_18(properties: m18.Properties) -> tuple[KeyValuePair, ...]:
    out: list[KeyValuePair] = []
    for ktype, value in properties:
        if ktype == ExtensionType.IMMUTABLE_EXTENSIONS and isinstance(value, bytes):
            inner = m18.decode_properties(Buffer(value), len(value))
            value = encode_extensions(inner)
        out.append((ktype, value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SubgroupHeader:
    """SUBGROUP_HEADER. `subgroup_id` None means FIRST_OBJECT mode before the first
    object is seen; `subgroup_id_mode` None picks ZERO for subgroup 0, else EXPLICIT."""

    track_alias: int
    group_id: int
    subgroup_id: int | None = 0
    publisher_priority: int = data18.DEFAULT_PUBLISHER_PRIORITY
    has_extensions: bool = False
    end_of_group: bool = False
    subgroup_id_mode: SubgroupIdMode | None = None

    resolved_mode = data18.SubgroupHeader.resolved_mode

    def stream_type(self) -> int:
        value = 0x10 | (self.resolved_mode() << 1)
        if self.has_extensions:
            value |= 0x01
        if self.end_of_group:
            value |= 0x08
        return value

    def encode(self) -> bytes:
        mode = self.resolved_mode()
        if mode == SubgroupIdMode.ZERO and self.subgroup_id not in (0, None):
            raise ValueError("ZERO subgroup mode with a non-zero subgroup ID")
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is None:
            raise ValueError("EXPLICIT subgroup mode needs a subgroup ID")
        _check_uint8(self.publisher_priority, "publisher priority")
        parts = [
            encode_quic_varint(self.stream_type()),
            encode_quic_varint(self.track_alias),
            encode_quic_varint(self.group_id),
        ]
        if mode == SubgroupIdMode.EXPLICIT:
            parts.append(encode_quic_varint(self.subgroup_id))  # type: ignore[arg-type]
        parts.append(bytes((self.publisher_priority,)))
        return b"".join(parts)

    def to_draft18(self) -> data18.SubgroupHeader:
        """The draft-18 header; FIRST_OBJECT is left clear (draft-14 does not say)."""
        return data18.SubgroupHeader(
            self.track_alias, self.group_id, self.subgroup_id, self.publisher_priority,
            self.has_extensions, self.end_of_group, False, self.resolved_mode(),
        )

    @classmethod
    def from_draft18(
        cls, header: data18.SubgroupHeader, default_priority: int = data18.DEFAULT_PUBLISHER_PRIORITY
    ) -> "SubgroupHeader":
        """This header for a draft-18 one; an inherited priority becomes `default_priority`."""
        priority = default_priority if header.publisher_priority is None else header.publisher_priority
        return cls(
            header.track_alias, header.group_id, header.subgroup_id, priority,
            header.has_properties, header.end_of_group, header.resolved_mode(),
        )


@dataclass(frozen=True, slots=True)
class SubgroupObject:
    """An object read from a subgroup stream; `extensions` in wire order."""

    object_id: int
    subgroup_id: int
    status: ObjectStatus
    payload: bytes
    extensions: tuple[KeyValuePair, ...] = ()

    def to_draft18(self) -> data18.SubgroupObject | None:
        """The draft-18 object, or None for "Does Not Exist" (no draft-18 form)."""
        if self.status == ObjectStatus.DOES_NOT_EXIST:
            return None
        return data18.SubgroupObject(
            self.object_id, self.subgroup_id, data18.ObjectStatus(int(self.status)),
            self.payload, _properties_to_18(self.extensions),
        )

    @classmethod
    def from_draft18(cls, obj: data18.SubgroupObject) -> "SubgroupObject":
        return cls(obj.object_id, obj.subgroup_id, ObjectStatus(int(obj.status)), obj.payload,
                   _properties_from_18(obj.properties))


@dataclass(frozen=True, slots=True)
class FetchHeader(data18.FetchHeader):
    """FETCH_HEADER: the stream answers the FETCH with this Request ID (draft-18's
    header, written with draft-14 varints)."""

    def encode(self) -> bytes:
        return encode_quic_varint(STREAM_TYPE_FETCH_HEADER) + encode_quic_varint(self.request_id)


@dataclass(frozen=True, slots=True)
class FetchObject:
    """An object read from a fetch stream; every field is explicit in draft-14."""

    group_id: int
    subgroup_id: int
    object_id: int
    publisher_priority: int
    status: ObjectStatus
    payload: bytes
    extensions: tuple[KeyValuePair, ...] = ()

    @property
    def location(self) -> Location:
        return Location(self.group_id, self.object_id)

    def to_draft18(self) -> data18.FetchObject | None:
        """The draft-18 fetch object, or None when the status is not Normal."""
        if self.status != ObjectStatus.NORMAL:
            return None
        return data18.FetchObject(
            self.group_id, self.subgroup_id, self.object_id, self.publisher_priority,
            self.payload, _properties_to_18(self.extensions),
        )

    @classmethod
    def from_draft18(cls, obj: data18.FetchObject) -> "FetchObject":
        """A Datagram object (no Subgroup ID) gets its Object ID as Subgroup ID."""
        subgroup = obj.object_id if obj.subgroup_id is None else obj.subgroup_id
        return cls(obj.group_id, subgroup, obj.object_id, obj.publisher_priority, ObjectStatus.NORMAL,
                   obj.payload, _properties_from_18(obj.properties))


def _check_object(status: ObjectStatus, payload_length: int, extensions: tuple[KeyValuePair, ...]) -> None:
    if status != ObjectStatus.NORMAL and payload_length:
        raise ValueError("a status object has no payload")
    if status == ObjectStatus.DOES_NOT_EXIST and extensions:
        raise ValueError("an object that does not exist has no extensions")


def _object_tail(payload_length: int, status: ObjectStatus) -> bytes:
    """Object Payload Length and, for an empty object, the Object Status."""
    if payload_length == 0:
        return encode_quic_varint(0) + encode_quic_varint(status)
    return encode_quic_varint(payload_length)


def _length_prefixed_extensions(extensions: tuple[KeyValuePair, ...]) -> bytes:
    block = encode_extensions(extensions)
    return encode_quic_varint(len(block)) + block


class SubgroupWriter:
    """Frames the objects of one subgroup stream, in ascending Object ID.

    `object_header` returns the bytes before the payload, so a payload is never
    copied to be framed.
    """

    __slots__ = ("header", "_last_object_id")

    def __init__(self, header: SubgroupHeader) -> None:
        self.header = header
        self._last_object_id: int | None = None

    def header_bytes(self) -> bytes:
        return self.header.encode()

    def object_header(
        self,
        object_id: int,
        payload_length: int,
        *,
        extensions: tuple[KeyValuePair, ...] = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> bytes:
        last = self._last_object_id
        delta = object_id if last is None else object_id - last - 1
        if delta < 0:
            raise ValueError(f"object {object_id} after {last}: subgroup objects ascend")
        if extensions and not self.header.has_extensions:
            raise ValueError("extensions on a subgroup opened without extensions")
        _check_object(status, payload_length, extensions)
        _check_varint(object_id, "object ID")
        self._last_object_id = object_id
        parts = [encode_quic_varint(delta)]
        if self.header.has_extensions:
            parts.append(_length_prefixed_extensions(extensions))
        parts.append(_object_tail(payload_length, status))
        return b"".join(parts)


def encode_fetch_object(
    group_id: int,
    subgroup_id: int,
    object_id: int,
    payload_length: int,
    *,
    publisher_priority: int = data18.DEFAULT_PUBLISHER_PRIORITY,
    extensions: tuple[KeyValuePair, ...] = (),
    status: ObjectStatus = ObjectStatus.NORMAL,
) -> bytes:
    """The bytes before the payload of one object on a fetch stream."""
    _check_uint8(publisher_priority, "publisher priority")
    _check_object(status, payload_length, extensions)
    return b"".join(
        (
            encode_quic_varint(group_id),
            encode_quic_varint(subgroup_id),
            encode_quic_varint(object_id),
            bytes((publisher_priority,)),
            _length_prefixed_extensions(extensions),
            _object_tail(payload_length, status),
        )
    )


@dataclass(frozen=True, slots=True)
class ObjectDatagram:
    """OBJECT_DATAGRAM (types 0x00-0x07) or its status form (0x20-0x21, `status` set)."""

    track_alias: int
    group_id: int
    object_id: int
    payload: bytes = b""
    publisher_priority: int = data18.DEFAULT_PUBLISHER_PRIORITY
    status: ObjectStatus | None = None
    extensions: tuple[KeyValuePair, ...] = ()
    end_of_group: bool = False

    def datagram_type(self) -> int:
        if self.status is not None:
            return 0x20 | (0x01 if self.extensions else 0)
        dtype = 0x01 if self.extensions else 0
        if self.end_of_group:
            dtype |= 0x02
        if self.object_id == 0:
            dtype |= 0x04
        return dtype

    def encode(self) -> bytes:
        _check_uint8(self.publisher_priority, "publisher priority")
        if self.status is not None:
            if self.end_of_group:
                raise ValueError("a status datagram cannot carry End of Group")
            if self.payload:
                raise ValueError("a status datagram has no payload")
            _check_object(self.status, 0, self.extensions)
        dtype = self.datagram_type()
        parts = [encode_quic_varint(dtype), encode_quic_varint(self.track_alias), encode_quic_varint(self.group_id)]
        if not dtype & 0x04:
            parts.append(encode_quic_varint(self.object_id))
        parts.append(bytes((self.publisher_priority,)))
        if self.extensions:
            parts.append(_length_prefixed_extensions(self.extensions))
        parts.append(self.payload if self.status is None else encode_quic_varint(self.status))
        return b"".join(parts)

    def to_draft18(self) -> data18.ObjectDatagram | None:
        """The draft-18 datagram, or None for "Does Not Exist"."""
        if self.status == ObjectStatus.DOES_NOT_EXIST:
            return None
        status = None if self.status is None else data18.ObjectStatus(int(self.status))
        return data18.ObjectDatagram(
            self.track_alias, self.group_id, self.object_id, self.payload, self.publisher_priority,
            status, _properties_to_18(self.extensions), self.end_of_group,
        )

    @classmethod
    def from_draft18(
        cls, datagram: data18.ObjectDatagram, default_priority: int = data18.DEFAULT_PUBLISHER_PRIORITY
    ) -> "ObjectDatagram":
        priority = default_priority if datagram.publisher_priority is None else datagram.publisher_priority
        status = None if datagram.status is None else ObjectStatus(int(datagram.status))
        return cls(datagram.track_alias, datagram.group_id, datagram.object_id, datagram.payload, priority,
                   status, _properties_from_18(datagram.properties), datagram.end_of_group)


def decode_datagram(
    data: bytes | memoryview, *, max_extensions_size: int = DEFAULT_MAX_EXTENSIONS_SIZE
) -> ObjectDatagram:
    """Decode one QUIC DATAGRAM payload; raises ProtocolViolation when malformed."""
    buf = Buffer(data, codec=QUIC_VARINT)
    try:
        dtype = buf.pull_varint()
        if dtype > 0x07 and dtype not in (0x20, 0x21):
            raise ProtocolViolation(f"unknown datagram type 0x{dtype:x}")
        is_status = bool(dtype & 0x20)
        alias = buf.pull_varint()
        group = buf.pull_varint()
        obj = 0 if dtype & 0x04 else buf.pull_varint()
        priority = buf.pull_uint8()
        extensions: tuple[KeyValuePair, ...] = ()
        if dtype & 0x01:
            length = buf.pull_varint()
            if length == 0:
                raise ProtocolViolation("datagram with Extensions Present and no extensions")
            if length > max_extensions_size:
                raise ObjectTooLarge(f"datagram extensions of {length} bytes")
            extensions = _decode_extensions(buf.pull_view(length))
        if is_status:
            status: ObjectStatus | None = _status(buf.pull_varint())
            if status == ObjectStatus.DOES_NOT_EXIST and extensions:
                raise ProtocolViolation("extensions on an object that does not exist")
            if not buf.eof():
                raise ProtocolViolation("status datagram with trailing bytes")
            payload = b""
        else:
            status = None
            payload = buf.pull_rest()
    except BufferReadError:
        raise ProtocolViolation("truncated datagram") from None
    return ObjectDatagram(alias, group, obj, payload, priority, status, extensions, bool(dtype & 0x02))


DataItem = Union[SubgroupHeader, SubgroupObject, FetchHeader, FetchObject]


class _Incomplete(BufferReadError):
    """A header needs at least `need` bytes from its start before it can be parsed."""

    def __init__(self, need: int) -> None:
        super().__init__("incomplete header")
        self.need = need


_S_TYPE, _S_SUBGROUP_OBJECT, _S_FETCH_OBJECT, _S_PAYLOAD = range(4)


class DataStreamParser:
    """Parses one unidirectional data stream incrementally.

    `feed()` returns the items completed by the new bytes: the stream header
    (SubgroupHeader or FetchHeader) first, then SubgroupObject or FetchObject
    items, each as soon as its last payload byte arrives. Malformed input raises
    ProtocolViolation (ObjectTooLarge for a length over the configured maximum); a
    FIN inside an object or header raises ProtocolViolation too. A header split
    across reads is kept and parsed again only once enough bytes are there.
    """

    __slots__ = (
        "max_object_size",
        "max_extensions_size",
        "_state",
        "_pending",
        "_need",
        "_parts",
        "_remaining",
        "_header",
        "_subgroup_id",
        "_last_object_id",
        "_current",
        "stream_type",
        "finished",
    )

    def __init__(
        self,
        *,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        max_extensions_size: int = DEFAULT_MAX_EXTENSIONS_SIZE,
    ) -> None:
        self.max_object_size = max_object_size
        self.max_extensions_size = max_extensions_size
        self._state = _S_TYPE
        self._pending = bytearray()
        self._need = 0
        self._parts: list[bytes | memoryview] = []
        self._remaining = 0
        self._header: SubgroupHeader | FetchHeader | None = None
        self._subgroup_id: int | None = None
        self._last_object_id: int | None = None
        self._current: Callable[[bytes], DataItem] | None = None
        self.stream_type: int | None = None
        self.finished = False

    @property
    def header(self) -> SubgroupHeader | FetchHeader | None:
        return self._header

    @property
    def at_boundary(self) -> bool:
        """True when no object or header is partially received."""
        return self._state in (_S_SUBGROUP_OBJECT, _S_FETCH_OBJECT) and not self._pending

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> list[DataItem]:
        if self.finished:
            if data:
                raise ProtocolViolation("data after the end of the stream")
            return []
        items: list[DataItem] = []
        immutable = isinstance(data, bytes)
        view = memoryview(data) if immutable else memoryview(data).cast("B")
        pos = 0
        while True:
            if self._state == _S_PAYLOAD:
                take = min(self._remaining, len(view) - pos)
                if take:
                    chunk = view[pos : pos + take]
                    # A view into immutable input is kept as is (one copy, at the end);
                    # anything the caller may reuse is copied now.
                    self._parts.append(chunk if immutable else bytes(chunk))
                    pos += take
                    self._remaining -= take
                if self._remaining:
                    break
                items.append(self._finish_payload())
                continue
            if self._pending:
                self._pending += view[pos:]
                pos = len(view)
                if len(self._pending) < self._need:
                    break
                view = memoryview(bytes(self._pending))
                immutable = True
                self._pending = bytearray()
                pos = 0
            if pos >= len(view):
                break
            try:
                pos = self._parse_header(view, pos, items)
            except _Incomplete as short:
                self._pending = bytearray(view[pos:])
                self._need = short.need
                pos = len(view)
                break
            except BufferReadError:
                self._pending = bytearray(view[pos:])
                self._need = len(self._pending) + 1
                pos = len(view)
                break
        if end_stream:
            self.finished = True
            if not self.at_boundary:
                raise ProtocolViolation("stream ended inside an object or header")
        return items

    def _parse_header(self, view: memoryview, start: int, items: list[DataItem]) -> int:
        buf = Buffer(view, start, codec=QUIC_VARINT)
        if self._state == _S_TYPE:
            self._parse_stream_header(buf, items)
        elif self._state == _S_SUBGROUP_OBJECT:
            self._parse_subgroup_object(buf, start, items)
        else:
            self._parse_fetch_object(buf, start, items)
        return buf.tell()

    def _parse_stream_header(self, buf: Buffer, items: list[DataItem]) -> None:
        stream_type = buf.pull_varint()
        if stream_type == STREAM_TYPE_FETCH_HEADER:
            header: SubgroupHeader | FetchHeader = FetchHeader(buf.pull_varint())
            self._state = _S_FETCH_OBJECT
        elif is_subgroup_stream_type(stream_type):
            alias = buf.pull_varint()
            group = buf.pull_varint()
            mode = SubgroupIdMode((stream_type >> 1) & 0x03)
            subgroup: int | None
            if mode == SubgroupIdMode.EXPLICIT:
                subgroup = buf.pull_varint()
            else:
                subgroup = 0 if mode == SubgroupIdMode.ZERO else None
            priority = buf.pull_uint8()
            header = SubgroupHeader(
                alias, group, subgroup, priority, bool(stream_type & 0x01), bool(stream_type & 0x08), mode
            )
            self._subgroup_id = subgroup
            self._state = _S_SUBGROUP_OBJECT
        else:
            raise ProtocolViolation(f"unknown data stream type 0x{stream_type:x}")
        self._header = header
        self.stream_type = stream_type
        items.append(header)

    def _pull_extensions(self, buf: Buffer, start: int) -> tuple[KeyValuePair, ...]:
        length = buf.pull_varint()
        if length == 0:
            return ()
        if length > self.max_extensions_size:
            raise ObjectTooLarge(f"extension headers of {length} bytes (max {self.max_extensions_size})")
        if buf.remaining < length:
            # Wait for the whole block, plus at least one byte of what follows it.
            raise _Incomplete(buf.tell() - start + length + 1)
        return _decode_extensions(buf.pull_view(length))

    def _pull_length_and_status(self, buf: Buffer, extensions: tuple[KeyValuePair, ...]) -> tuple[int, ObjectStatus]:
        length = buf.pull_varint()
        if length > self.max_object_size:
            raise ObjectTooLarge(f"object of {length} bytes (max {self.max_object_size})")
        status = ObjectStatus.NORMAL
        if length == 0:
            status = _status(buf.pull_varint())
            if status == ObjectStatus.DOES_NOT_EXIST and extensions:
                raise ProtocolViolation("extensions on an object that does not exist")
        return length, status

    def _parse_subgroup_object(self, buf: Buffer, start: int, items: list[DataItem]) -> None:
        delta = buf.pull_varint()
        header = self._header
        assert isinstance(header, SubgroupHeader)
        extensions = self._pull_extensions(buf, start) if header.has_extensions else ()
        length, status = self._pull_length_and_status(buf, extensions)
        # Every field is read: commit the object.
        last = self._last_object_id
        object_id = delta if last is None else last + delta + 1
        if object_id > QUIC_VARINT_MAX:
            raise ProtocolViolation("object ID over 2^62-1")
        self._last_object_id = object_id
        if self._subgroup_id is None:
            self._subgroup_id = object_id
        subgroup = self._subgroup_id

        def make(payload: bytes) -> DataItem:
            return SubgroupObject(object_id, subgroup, status, payload, extensions)

        self._begin(length, make, items)

    def _parse_fetch_object(self, buf: Buffer, start: int, items: list[DataItem]) -> None:
        group = buf.pull_varint()
        subgroup = buf.pull_varint()
        obj = buf.pull_varint()
        priority = buf.pull_uint8()
        extensions = self._pull_extensions(buf, start)
        length, status = self._pull_length_and_status(buf, extensions)

        def make(payload: bytes) -> DataItem:
            return FetchObject(group, subgroup, obj, priority, status, payload, extensions)

        self._begin(length, make, items)

    def _begin(self, length: int, make: Callable[[bytes], DataItem], items: list[DataItem]) -> None:
        if length == 0:
            items.append(make(b""))
            return
        self._current = make
        self._remaining = length
        self._parts = []
        self._state = _S_PAYLOAD

    def _finish_payload(self) -> DataItem:
        parts = self._parts
        payload = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        self._parts = []
        make = self._current
        assert make is not None
        self._current = None
        self._state = _S_FETCH_OBJECT if isinstance(self._header, FetchHeader) else _S_SUBGROUP_OBJECT
        return make(payload)
