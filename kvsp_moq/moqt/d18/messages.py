"""MOQT control messages: one frozen dataclass each, encoders and a decoder.

Wire form (draft-18 section 10): Message Type (vi64), Message Length (16 bits),
payload. The message classes are draft-neutral descriptions; the draft-18 encoding
of each lives in its `_encode18` / `_decode18` methods and the draft-18 type table
`MESSAGE_TYPES[18]`. A codec for another draft adds its own methods and table; the
`draft` argument of `encode()` and `decode_message()` selects one.

Decoding follows the draft's rules for what closes the session: an unknown message
type, an unknown Message Parameter, a parameter outside the messages it may appear
in, a repeated parameter, a value outside its range, a namespace over 32 fields or
4096 bytes, an empty namespace field, a Reason Phrase over 1024 bytes and a length
that does not match the payload all raise ProtocolViolation; an Authorization Token
that cannot be decoded raises KeyValueFormattingError (section 10.2.2). Unknown
Setup Options and unknown Properties are kept, not rejected.

Wire details the draft leaves open, matched to aiomoqt 0.13.3:

* TRACK_NAMESPACE_PREFIX (0x34) is a Track Namespace wrapped in a length prefix,
  like every parameter value that is not uint8, varint or Location.
* REQUEST_ERROR carries a Redirect only when its code is REDIRECT.
* The Message Type of every message is a vi64 (0x50 is one byte, 0x2F00 two).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import IntEnum
from typing import Any, ClassVar

from ..errors import (
    ProtocolViolation,
    RequestErrorCode,
)
from ..varint import U64_MAX, VI64, Buffer
from ..wire import (
    MAX_GOAWAY_URI,
    AuthToken,
    FetchFields,
    FetchType,
    FilterType,
    FramedMessageParser,
    GroupOrder,
    Location,
    Properties,
    Property,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    Writer,
    check_full_track_name,
    decode_checked,
    decode_framed,
    decode_properties,
    encode_properties,
    frame_message,
    pull_full_track_name,
    pull_goaway_uri,
    pull_location,
    pull_namespace,
    pull_reason,
    put_goaway_uri,
    setup_value,
)
from .profiles import D18, Profile, profile

__all__ = [
    "DRAFT",
    "SUPPORTED_DRAFTS",
    "MAX_GOAWAY_URI",
    "TrackNamespace",
    "Property",
    "Properties",
    "Location",
    "GroupOrder",
    "FilterType",
    "FetchType",
    "ParameterType",
    "SetupOption",
    "TrackPropertyType",
    "AuthToken",
    "SubscriptionFilter",
    "Parameters",
    "Redirect",
    "Message",
    "Setup",
    "Goaway",
    "Subscribe",
    "SubscribeOk",
    "Publish",
    "PublishDone",
    "Fetch",
    "FetchOk",
    "TrackStatus",
    "PublishNamespace",
    "SubscribeNamespace",
    "SubscribeTracks",
    "Namespace",
    "NamespaceDone",
    "PublishBlocked",
    "RequestUpdate",
    "RequestOk",
    "RequestErrorMessage",
    "MESSAGE_TYPES",
    "REQUEST_MESSAGES",
    "Writer",
    "encode_properties",
    "decode_properties",
    "decode_message",
    "ControlStreamParser",
]

DRAFT = 18
SUPPORTED_DRAFTS = (18, 20, 22)












class ParameterType(IntEnum):
    """Message Parameter types (draft-18 section 15.7)."""

    OBJECT_DELIVERY_TIMEOUT = 0x02
    AUTHORIZATION_TOKEN = 0x03
    RENDEZVOUS_TIMEOUT = 0x04
    SUBGROUP_DELIVERY_TIMEOUT = 0x06
    EXPIRES = 0x08
    LARGEST_OBJECT = 0x09
    FILL_TIMEOUT = 0x0A
    FORWARD = 0x10
    SUBSCRIBER_PRIORITY = 0x20
    SUBSCRIPTION_FILTER = 0x21  # LOCATION_FILTER from draft-20
    GROUP_ORDER = 0x22
    FILL_PARAMETERS = 0x23  # draft-20+
    NEW_GROUP_REQUEST = 0x32
    TRACK_NAMESPACE_PREFIX = 0x34
    INCLUDE_PROPERTIES = 0x35  # draft-20+


class SetupOption(IntEnum):
    """Setup Option types (draft-18 section 15.4)."""

    PATH = 0x01
    AUTHORIZATION_TOKEN = 0x03
    MAX_AUTH_TOKEN_CACHE_SIZE = 0x04
    AUTHORITY = 0x05
    MAX_FILTER_RANGES = 0x06  # draft-20+
    MOQT_IMPLEMENTATION = 0x07
    MAX_REQUEST_UPDATES = 0x08  # draft-20+






# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------










# ---------------------------------------------------------------------------
# Reader helpers
# ---------------------------------------------------------------------------












# ---------------------------------------------------------------------------
# Key-Value-Pairs and Properties (section 1.4.3, section 2.5)
# ---------------------------------------------------------------------------










_TRACK_PROPERTY_RANGES: dict[int, tuple[int, int]] = {
    TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY: (0, 255),
    TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER: (1, 2),
    TrackPropertyType.DYNAMIC_GROUPS: (0, 1),
}


def _check_track_properties(properties: Properties) -> None:
    for ptype, value in properties:
        bounds = _TRACK_PROPERTY_RANGES.get(ptype)
        if bounds is not None and not (isinstance(value, int) and bounds[0] <= value <= bounds[1]):
            raise ProtocolViolation(f"track property 0x{ptype:x} value {value!r} out of range")


# ---------------------------------------------------------------------------
# Authorization token, subscription filter, parameters
# ---------------------------------------------------------------------------






# Value kinds of the draft-18 Message Parameters (section 10.2).
_VARINT, _UINT8, _LOCATION, _TOKEN, _FILTER, _NAMESPACE, _FILL = range(7)

_PARAMETER_FIELDS: dict[int, tuple[str, int]] = {
    ParameterType.OBJECT_DELIVERY_TIMEOUT: ("object_delivery_timeout", _VARINT),
    ParameterType.AUTHORIZATION_TOKEN: ("authorization_tokens", _TOKEN),
    ParameterType.RENDEZVOUS_TIMEOUT: ("rendezvous_timeout", _VARINT),
    ParameterType.SUBGROUP_DELIVERY_TIMEOUT: ("subgroup_delivery_timeout", _VARINT),
    ParameterType.EXPIRES: ("expires", _VARINT),
    ParameterType.LARGEST_OBJECT: ("largest_object", _LOCATION),
    ParameterType.FILL_TIMEOUT: ("fill_timeout", _VARINT),
    ParameterType.FORWARD: ("forward", _UINT8),
    ParameterType.SUBSCRIBER_PRIORITY: ("subscriber_priority", _UINT8),
    ParameterType.SUBSCRIPTION_FILTER: ("subscription_filter", _FILTER),
    ParameterType.GROUP_ORDER: ("group_order", _UINT8),
    ParameterType.NEW_GROUP_REQUEST: ("new_group_request", _VARINT),
    ParameterType.FILL_PARAMETERS: ("fill", _FILL),
    ParameterType.TRACK_NAMESPACE_PREFIX: ("track_namespace_prefix", _NAMESPACE),
    ParameterType.INCLUDE_PROPERTIES: ("include_properties", _UINT8),
}
# Parameters that exist from draft-20 on.
_SINCE_20 = frozenset({ParameterType.FILL_PARAMETERS, ParameterType.INCLUDE_PROPERTIES})
# Draft-20 range filters (SUBGROUP, OBJECTID, PRIORITY, OBJECT_PROPERTY, TRACK_PROPERTY): a
# length and ranges. This endpoint advertises no MAX_FILTER_RANGES, so a peer may send none;
# they are counted (`Parameters.range_filters`) for the request to be refused with
# INVALID_FILTER, never applied.
_RANGE_FILTERS = frozenset(range(0x25, 0x2A))
_FIELD_TYPES = {name: ptype for ptype, (name, _) in _PARAMETER_FIELDS.items()}


class LocationFilterType(IntEnum):
    """Forms of a draft-20+ LOCATION_FILTER (0x21); every range is inclusive."""

    NONE = 0x0  # a SUBSCRIBE unfiltered; a FETCH {0, 0} to Largest
    RELATIVE_START = 0x1  # (S): from {Largest.Group + 1 - S, 0}; S = 0 is the next group
    ABSOLUTE_START = 0x2  # (G, O)
    ABSOLUTE_GROUP_END = 0x3  # (G, O, end group delta): to the end of group G + delta
    ABSOLUTE_RANGE = 0x4  # (G, O, end group delta, end object)
    NEXT_OBJECT = 0x5  # from the object after Largest


#: Fields of each LOCATION_FILTER form.
_LF_FIELDS = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 0}

LocationFilter = tuple[LocationFilterType, tuple[int, ...]]


def put_location_filter(w: Writer, flt: LocationFilter, p: Profile) -> None:
    """A LOCATION_FILTER value: draft-20 a length and 0-4 fields (two zero fields meaning
    Next Object, so an absolute start at {0, 0} is sent as none), draft-22 a type and its
    fields."""
    kind, values = flt
    if len(values) != _LF_FIELDS[kind]:
        raise ValueError(f"{kind.name} location filter with {len(values)} fields")
    if p.location_filter_typed:
        w.varint(kind)
        for value in values:
            w.varint(value)
        return
    if kind == LocationFilterType.NEXT_OBJECT:
        values = (0, 0)
    elif kind == LocationFilterType.ABSOLUTE_START and values == (0, 0):
        values = ()
    inner = Writer()
    for value in values:
        inner.varint(value)
    w.length_prefixed(inner.data)


def pull_location_filter(buf: Buffer, p: Profile) -> LocationFilter:
    if p.location_filter_typed:
        raw = buf.pull_varint()
        if raw not in _LF_FIELDS:
            raise ProtocolViolation(f"unknown location filter type {raw}")
        kind = LocationFilterType(raw)
        return kind, tuple(buf.pull_varint() for _ in range(_LF_FIELDS[kind]))
    inner = buf.pull_buffer(buf.pull_varint())
    values: list[int] = []
    while not inner.eof():
        if len(values) == 4:
            raise ProtocolViolation("location filter of more than 4 fields")
        values.append(inner.pull_varint())
    if values == [0, 0]:
        return LocationFilterType.NEXT_OBJECT, ()
    return LocationFilterType(len(values)), tuple(values)


def _end_group(start: int, delta: int) -> int:
    if start + delta > U64_MAX:
        raise ProtocolViolation("location filter end group over 2^64-1")
    return start + delta


def subscription_to_location_filter(flt: SubscriptionFilter) -> LocationFilter:
    """The draft-20 form of a subscription filter."""
    kind = flt.filter_type
    if kind == FilterType.NEXT_GROUP_START:
        return LocationFilterType.RELATIVE_START, (0,)
    if kind == FilterType.LARGEST_OBJECT:
        return LocationFilterType.NEXT_OBJECT, ()
    start = flt.start
    assert start is not None
    if kind == FilterType.ABSOLUTE_START:
        return LocationFilterType.ABSOLUTE_START, (start.group, start.object)
    end_group = flt.end_group
    assert end_group is not None  # an AbsoluteRange, the one filter left
    delta = end_group - start.group
    if flt.end_object is not None:
        return LocationFilterType.ABSOLUTE_RANGE, (start.group, start.object, delta, flt.end_object)
    return LocationFilterType.ABSOLUTE_GROUP_END, (start.group, start.object, delta)


def location_to_subscription_filter(flt: LocationFilter) -> SubscriptionFilter | None:
    """A draft-20 LOCATION_FILTER as a subscription filter; None for none. A relative
    start of S > 0 groups has no such form (ProtocolViolation)."""
    kind, v = flt
    if kind == LocationFilterType.NONE:
        return None
    if kind == LocationFilterType.NEXT_OBJECT:
        return SubscriptionFilter(FilterType.LARGEST_OBJECT)
    if kind == LocationFilterType.RELATIVE_START:
        if v[0] != 0:
            raise UnsupportedFilter(f"a subscription {v[0]} groups back from the Largest Object")
        return SubscriptionFilter(FilterType.NEXT_GROUP_START)
    if kind == LocationFilterType.ABSOLUTE_START:
        return SubscriptionFilter(FilterType.ABSOLUTE_START, Location(v[0], v[1]))
    end_object = v[3] if kind == LocationFilterType.ABSOLUTE_RANGE else None
    return SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(v[0], v[1]), _end_group(v[0], v[2]), end_object)


class UnsupportedFilter(Exception):
    """A well-formed LOCATION_FILTER this endpoint has no form for (one relative to the
    Largest Object where the draft-18 form needs Locations): the request is refused with
    NOT_SUPPORTED, the session kept (`Parameters.unsupported`)."""


#: A FETCH range end with no end: everything to the Largest Object.
OPEN_END = Location(U64_MAX, 0)


def range_to_location_filter(start: Location, end: Location) -> LocationFilter:
    """The draft-20 (inclusive) form of a draft-18 FETCH range (end is last + 1, Object 0
    meaning the whole group)."""
    if end == OPEN_END:
        return LocationFilterType.ABSOLUTE_START, (start.group, start.object)
    if end.group < start.group:
        raise ValueError("FETCH end before its start")
    if end.object == 0:
        return LocationFilterType.ABSOLUTE_GROUP_END, (start.group, start.object, end.group - start.group)
    return LocationFilterType.ABSOLUTE_RANGE, (start.group, start.object, end.group - start.group, end.object - 1)


def location_filter_to_range(flt: LocationFilter) -> tuple[Location, Location]:
    """A FETCH's LOCATION_FILTER as the draft-18 range (start, end + 1). Forms relative
    to the Largest Object have none here (ProtocolViolation)."""
    kind, v = flt
    if kind == LocationFilterType.NONE:
        return Location(0, 0), OPEN_END
    if kind == LocationFilterType.ABSOLUTE_START:
        return Location(v[0], v[1]), OPEN_END
    if kind == LocationFilterType.ABSOLUTE_GROUP_END:
        return Location(v[0], v[1]), Location(_end_group(v[0], v[2]), 0)
    if kind == LocationFilterType.ABSOLUTE_RANGE:
        return Location(v[0], v[1]), inclusive_end_to_exclusive(Location(_end_group(v[0], v[2]), v[3]))
    raise UnsupportedFilter(f"a FETCH with a {kind.name} location filter")


def exclusive_end_to_inclusive(end: Location) -> Location:
    """A draft-18 End Location (last + 1; Object 0 the whole group) as draft-20's last
    Location; the whole group's last Object is written as 2^64-1."""
    return Location(end.group, U64_MAX) if end.object == 0 else Location(end.group, end.object - 1)


def inclusive_end_to_exclusive(end: Location) -> Location:
    return Location(end.group, 0) if end.object == U64_MAX else Location(end.group, end.object + 1)


@dataclass(frozen=True, slots=True)
class Fill:
    """FILL_PARAMETERS (0x23, draft-20+): objects already published in the subscription's
    range (or `location_filter`'s) arrive on a fetch stream under the request's ID, the
    draft-20 successor of the joining FETCH. Sent as a length, a count and parameters."""

    location_filter: LocationFilter | None = None
    fill_timeout: int | None = None
    subscriber_priority: int | None = None
    group_order: GroupOrder | None = None

    def encode(self, w: Writer, p: Profile) -> None:
        inner = Writer()
        items: list[tuple[int, Any]] = [
            (t, v) for t, v in ((0x0A, self.fill_timeout), (0x20, self.subscriber_priority),
                                (0x21, self.location_filter), (0x22, self.group_order)) if v is not None
        ]
        inner.varint(len(items))
        previous = 0
        for ptype, value in items:
            inner.varint(ptype - previous)
            previous = ptype
            if ptype == 0x0A:
                inner.varint(value)
            elif ptype == 0x21:
                put_location_filter(inner, value, p)
            else:
                inner.uint8(int(value))
        w.length_prefixed(inner.data)

    @classmethod
    def decode(cls, buf: Buffer, p: Profile) -> "Fill":
        inner = buf.pull_buffer(buf.pull_varint())
        count = inner.pull_varint()
        values: dict[str, Any] = {}
        ptype = 0
        for _ in range(count):
            ptype += inner.pull_varint()
            name = {0x0A: "fill_timeout", 0x20: "subscriber_priority", 0x21: "location_filter",
                    0x22: "group_order"}.get(ptype)
            if name is None:
                raise ProtocolViolation(f"FILL_PARAMETERS: parameter 0x{ptype:x} not allowed here")
            if name in values:
                raise ProtocolViolation(f"FILL_PARAMETERS: parameter 0x{ptype:x} repeated")
            if ptype == 0x0A:
                values[name] = inner.pull_varint()
            elif ptype == 0x21:
                values[name] = pull_location_filter(inner, p)
            else:
                byte = inner.pull_uint8()
                if ptype == 0x22:
                    if byte not in (1, 2):
                        raise ProtocolViolation(f"GROUP_ORDER value {byte}")
                    values[name] = GroupOrder(byte)
                else:
                    values[name] = byte
        if not inner.eof():
            raise ProtocolViolation("FILL_PARAMETERS longer than its parameters")
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Parameters:
    """The Message Parameters of one message, typed. None (or empty) means absent.

    Defaults the draft applies to an absent parameter (FORWARD 1, SUBSCRIBER_PRIORITY
    128, ...) are the reader's business: absence is kept distinct here because it
    means "unchanged" in REQUEST_UPDATE.
    """

    authorization_tokens: tuple[AuthToken, ...] = ()
    object_delivery_timeout: int | None = None
    rendezvous_timeout: int | None = None
    subgroup_delivery_timeout: int | None = None
    expires: int | None = None
    largest_object: Location | None = None
    fill_timeout: int | None = None
    forward: bool | None = None
    subscriber_priority: int | None = None
    subscription_filter: SubscriptionFilter | None = None
    group_order: GroupOrder | None = None
    new_group_request: int | None = None
    track_namespace_prefix: TrackNamespace | None = None
    fill: Fill | None = None
    include_properties: bool | None = None
    range_filters: int | None = None  # draft-20 range filters received (never sent)
    unsupported: str | None = None  # why the request cannot be served as asked (never sent)

    def types(self) -> list[int]:
        """Parameter types present, in wire order."""
        present = []
        for ptype, (name, _) in sorted(_PARAMETER_FIELDS.items()):
            value = getattr(self, name)
            if value is None or (name == "authorization_tokens" and not value):
                continue
            present.extend([ptype] * (len(value) if name == "authorization_tokens" else 1))
        return present

    def encode(self, w: Writer, p: Profile = D18, extra: dict[int, bytes] | None = None) -> None:
        """`extra`: parameters already encoded (value bytes as on the wire), by type."""
        items: list[tuple[int, Any]] = list((extra or {}).items())
        for ptype, (name, _) in sorted(_PARAMETER_FIELDS.items()):
            value = getattr(self, name)
            if value is None or (name == "authorization_tokens" and not value):
                continue
            if name == "authorization_tokens":
                items.extend((ptype, token) for token in value)
            else:
                items.append((ptype, value))
        items.sort(key=lambda item: item[0])
        w.varint(len(items))
        previous = 0
        for ptype, value in items:
            w.varint(ptype - previous)
            previous = ptype
            if extra and ptype in extra:
                w.raw(value)
                continue
            if ptype in _SINCE_20 and not p.location_filter:
                raise ValueError(f"parameter 0x{ptype:x} does not exist in draft-{p.draft}")
            kind = _PARAMETER_FIELDS[ptype][1]
            if kind == _VARINT:
                w.varint(value)
            elif kind == _UINT8:
                w.uint8(int(value))
            elif kind == _LOCATION:
                w.location(value)
            elif kind == _TOKEN:
                w.length_prefixed(value.encode())
            elif kind == _FILTER:
                if p.location_filter:
                    put_location_filter(w, subscription_to_location_filter(value), p)
                else:
                    w.length_prefixed(value.encode())
            elif kind == _FILL:
                value.encode(w, p)
            elif p.bare_namespace_prefix:
                w.namespace(value)
            else:
                inner = Writer()
                inner.namespace(value)
                w.length_prefixed(inner.data)

    @classmethod
    def decode(
        cls, buf: Buffer, allowed: frozenset[int], message: str, p: Profile, raw: dict[int, bytes] | None = None
    ) -> "Parameters":
        """`raw`: filled with the undecoded value bytes of the types it holds as keys
        (a message that gives a parameter its own meaning decodes it itself)."""
        allowed = _scope_in(allowed, message, p)
        count = buf.pull_varint()
        if count > buf.remaining // 2:
            raise ProtocolViolation(f"{message}: {count} parameters cannot fit in the message")
        values: dict[str, Any] = {}
        tokens: list[AuthToken] = []
        ptype = 0
        for _ in range(count):
            ptype += buf.pull_varint()
            if ptype > U64_MAX:
                raise ProtocolViolation("parameter type over 2^64-1")
            if p.location_filter and ptype in _RANGE_FILTERS and ptype in allowed:
                buf.pull_view(buf.pull_varint())
                values["range_filters"] = values.get("range_filters", 0) + 1
                continue
            spec = _PARAMETER_FIELDS.get(ptype)
            if ptype in _SINCE_20 and not p.location_filter:
                spec = None
            if spec is None:
                raise ProtocolViolation(f"{message}: unknown parameter 0x{ptype:x}")
            if ptype not in allowed:
                raise ProtocolViolation(f"{message}: parameter 0x{ptype:x} not allowed here")
            name, kind = spec
            if name in values or (raw is not None and raw.get(ptype)):
                raise ProtocolViolation(f"{message}: parameter 0x{ptype:x} repeated")
            if raw is not None and ptype in raw:
                start = buf.tell()
                if p.location_filter and ptype == ParameterType.SUBSCRIPTION_FILTER:
                    pull_location_filter(buf, p)
                else:
                    raise AssertionError(f"no raw form of parameter 0x{ptype:x}")
                end = buf.tell()
                buf.seek(start)
                raw[ptype] = buf.pull_bytes(end - start)
                continue
            if kind == _VARINT:
                values[name] = buf.pull_varint()
            elif kind == _UINT8:
                byte = buf.pull_uint8()
                if ptype == ParameterType.FORWARD:
                    if byte > 1:
                        raise ProtocolViolation(f"FORWARD value {byte}")
                    values[name] = bool(byte)
                elif ptype == ParameterType.GROUP_ORDER:
                    if byte not in (1, 2):
                        raise ProtocolViolation(f"GROUP_ORDER value {byte}")
                    values[name] = GroupOrder(byte)
                elif ptype == ParameterType.INCLUDE_PROPERTIES:
                    if byte > 1:
                        raise ProtocolViolation(f"INCLUDE_PROPERTIES value {byte}")
                    values[name] = bool(byte)
                else:
                    values[name] = byte
            elif kind == _LOCATION:
                values[name] = pull_location(buf)
            elif kind == _FILTER and p.location_filter:
                try:
                    values[name] = location_to_subscription_filter(pull_location_filter(buf, p))
                except UnsupportedFilter as e:
                    values["unsupported"] = str(e)
            elif kind == _FILL:
                values[name] = Fill.decode(buf, p)
            elif kind == _NAMESPACE and p.bare_namespace_prefix:
                values[name] = pull_namespace(buf)
            else:
                raw_value = buf.pull_view(buf.pull_varint())
                if kind == _TOKEN:
                    tokens.append(AuthToken.decode(raw_value))
                elif kind == _FILTER:
                    values[name] = SubscriptionFilter.decode(raw_value)
                else:
                    inner = Buffer(raw_value)
                    values[name] = pull_namespace(inner)
                    if not inner.eof():
                        raise ProtocolViolation("TRACK_NAMESPACE_PREFIX longer than its namespace")
        if tokens:
            values["authorization_tokens"] = tuple(tokens)
        return cls(**values) if values else _NO_PARAMETERS

    def merged(self, update: "Parameters") -> "Parameters":
        """These parameters with those present in `update` replacing them."""
        changes = {f.name: getattr(update, f.name) for f in fields(self)}
        changes = {k: v for k, v in changes.items() if v is not None and not (k == "authorization_tokens" and not v)}
        return replace(self, **changes) if changes else self


_NO_PARAMETERS = Parameters()


def _scope(*types: ParameterType) -> frozenset[int]:
    return frozenset(int(t) for t in types)


P = ParameterType
_SCOPE_SUBSCRIBE = _scope(
    P.AUTHORIZATION_TOKEN,
    P.OBJECT_DELIVERY_TIMEOUT,
    P.SUBGROUP_DELIVERY_TIMEOUT,
    P.RENDEZVOUS_TIMEOUT,
    P.SUBSCRIBER_PRIORITY,
    P.GROUP_ORDER,
    P.SUBSCRIPTION_FILTER,
    P.FORWARD,
    P.NEW_GROUP_REQUEST,
)
_SCOPE_SUBSCRIBE_OK = _scope(P.EXPIRES, P.LARGEST_OBJECT)
_SCOPE_PUBLISH = _scope(P.AUTHORIZATION_TOKEN, P.EXPIRES, P.LARGEST_OBJECT, P.FORWARD)
_SCOPE_FETCH = _scope(P.AUTHORIZATION_TOKEN, P.FILL_TIMEOUT, P.SUBSCRIBER_PRIORITY, P.GROUP_ORDER)
_SCOPE_FETCH_OK: frozenset[int] = frozenset()
_SCOPE_TRACK_STATUS = _scope(P.AUTHORIZATION_TOKEN)
_SCOPE_NAMESPACE_REQUEST = _scope(P.AUTHORIZATION_TOKEN)
_SCOPE_SUBSCRIBE_TRACKS = _scope(P.AUTHORIZATION_TOKEN, P.FORWARD)
_SCOPE_REQUEST_UPDATE = _scope(
    P.AUTHORIZATION_TOKEN,
    P.OBJECT_DELIVERY_TIMEOUT,
    P.SUBGROUP_DELIVERY_TIMEOUT,
    P.SUBSCRIBER_PRIORITY,
    P.SUBSCRIPTION_FILTER,
    P.FORWARD,
    P.NEW_GROUP_REQUEST,
    P.TRACK_NAMESPACE_PREFIX,
)
# REQUEST_OK answers PUBLISH (PUBLISH_OK), REQUEST_UPDATE and TRACK_STATUS; a
# stateless decoder can only check the union of what those may carry.
_SCOPE_REQUEST_OK = _scope(
    P.OBJECT_DELIVERY_TIMEOUT,
    P.SUBGROUP_DELIVERY_TIMEOUT,
    P.SUBSCRIBER_PRIORITY,
    P.GROUP_ORDER,
    P.SUBSCRIPTION_FILTER,
    P.FORWARD,
    P.NEW_GROUP_REQUEST,
    P.EXPIRES,
    P.LARGEST_OBJECT,
)
SCOPE_PUBLISH_OK = _scope(
    P.OBJECT_DELIVERY_TIMEOUT,
    P.SUBGROUP_DELIVERY_TIMEOUT,
    P.SUBSCRIBER_PRIORITY,
    P.GROUP_ORDER,
    P.SUBSCRIPTION_FILTER,
    P.FORWARD,
    P.NEW_GROUP_REQUEST,
    P.EXPIRES,
)
SCOPE_REQUEST_UPDATE_OK = _scope(P.EXPIRES, P.LARGEST_OBJECT)
SCOPE_TRACK_STATUS_OK = _scope(P.LARGEST_OBJECT)


# What draft-20 allows beyond draft-18, by message (PUBLISH_OK, a REQUEST_OK, carries
# only EXPIRES there: the session sends the rest in a REQUEST_UPDATE).
_SUBSCRIBE_20 = _scope(P.FILL_PARAMETERS, P.INCLUDE_PROPERTIES) | frozenset(range(0x25, 0x29))
_SCOPE_ADDED_20: dict[str, frozenset[int]] = {
    "SUBSCRIBE": _SUBSCRIBE_20,
    "PUBLISH": _scope(P.OBJECT_DELIVERY_TIMEOUT, P.SUBGROUP_DELIVERY_TIMEOUT, P.SUBSCRIBER_PRIORITY,
                      P.SUBSCRIPTION_FILTER, P.GROUP_ORDER),
    "FETCH": _scope(P.INCLUDE_PROPERTIES) | frozenset(range(0x25, 0x29)),
    "TRACK_STATUS": _scope(P.INCLUDE_PROPERTIES),
    "SUBSCRIBE_TRACKS": _SCOPE_SUBSCRIBE | _SUBSCRIBE_20 | {0x29},
    "REQUEST_UPDATE": _scope(P.FILL_PARAMETERS) | frozenset(range(0x25, 0x2A)),
}
del P


def _scope_in(allowed: frozenset[int], message: str, p: Profile) -> frozenset[int]:
    """A message's parameter scope in the profile's draft."""
    if not p.location_filter:
        return allowed
    return allowed | _SCOPE_ADDED_20.get(message, frozenset())


def _check_parameters(parameters: Parameters, allowed: frozenset[int], message: str, p: Profile) -> None:
    allowed = _scope_in(allowed, message, p)
    for ptype in parameters.types():
        if ptype not in allowed:
            raise ValueError(f"{message} may not carry parameter 0x{ptype:x}")


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


class Message:
    """Base of the control messages; subclasses are frozen dataclasses."""

    __slots__ = ()
    NAME: ClassVar[str] = ""

    def encode(self, draft: int = DRAFT) -> bytes:
        """The framed message: Type, 16-bit Length, payload."""
        p = profile(draft)
        w = Writer(VI64)
        self._encode18(w, p)
        return frame_message(VI64, _TYPE_OF[draft][type(self)], self.NAME, w.data)

    def _encode18(self, w: Writer, p: Profile) -> None:
        raise NotImplementedError

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Message":
        raise NotImplementedError


#: The Setup field of each known Setup Option.
_SETUP_OPTION_NAMES: dict[int, str] = {
    SetupOption.PATH: "path",
    SetupOption.MAX_AUTH_TOKEN_CACHE_SIZE: "max_auth_token_cache_size",
    SetupOption.AUTHORITY: "authority",
    SetupOption.MOQT_IMPLEMENTATION: "implementation",
}


@dataclass(frozen=True, slots=True)
class Setup(Message):
    """SETUP (0x2F00): the first message on each control stream."""

    NAME: ClassVar[str] = "SETUP"
    path: str | None = None
    authority: str | None = None
    max_auth_token_cache_size: int | None = None
    authorization_tokens: tuple[AuthToken, ...] = ()
    implementation: str | None = None
    unknown_options: Properties = ()

    def _encode18(self, w: Writer, p: Profile) -> None:
        options: list[Property] = []
        if self.path is not None:
            options.append((SetupOption.PATH, self.path.encode("utf-8")))
        for token in self.authorization_tokens:
            options.append((SetupOption.AUTHORIZATION_TOKEN, token.encode()))
        if self.max_auth_token_cache_size is not None:
            options.append((SetupOption.MAX_AUTH_TOKEN_CACHE_SIZE, self.max_auth_token_cache_size))
        if self.authority is not None:
            options.append((SetupOption.AUTHORITY, self.authority.encode("utf-8")))
        if self.implementation is not None:
            options.append((SetupOption.MOQT_IMPLEMENTATION, self.implementation.encode("utf-8")))
        options.extend(self.unknown_options)
        options.sort(key=lambda item: item[0])
        encode_properties(w, tuple(options))

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Setup":
        options = decode_properties(buf, buf.end)
        values: dict[str, Any] = {}
        tokens = []
        unknown = []
        for otype, value in options:
            if otype == SetupOption.AUTHORIZATION_TOKEN:
                assert isinstance(value, bytes)  # an odd option type, read as bytes
                tokens.append(AuthToken.decode(value))
                continue
            name = _SETUP_OPTION_NAMES.get(otype)
            if name is None:
                unknown.append((otype, value))
                continue
            if name in values:
                raise ProtocolViolation(f"SETUP option 0x{otype:x} repeated")
            values[name] = setup_value(name, value)
        return cls(authorization_tokens=tuple(tokens), unknown_options=tuple(unknown), **values)


@dataclass(frozen=True, slots=True)
class Goaway(Message):
    """GOAWAY (0x10). `request_id` is present only on the control stream."""

    NAME: ClassVar[str] = "GOAWAY"
    new_session_uri: str = ""
    timeout_ms: int = 0
    request_id: int | None = None

    def _encode18(self, w: Writer, p: Profile) -> None:
        put_goaway_uri(w, self.new_session_uri)
        w.varint(self.timeout_ms)
        if self.request_id is not None and p.goaway_request_id:
            w.varint(self.request_id)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Goaway":
        uri = pull_goaway_uri(buf)
        timeout = buf.pull_varint()
        request_id = None if buf.eof() or not p.goaway_request_id else buf.pull_varint()
        return cls(uri, timeout, request_id)


@dataclass(frozen=True, slots=True)
class Subscribe(Message):
    """SUBSCRIBE (0x3): first message of a request stream."""

    NAME: ClassVar[str] = "SUBSCRIBE"
    request_id: int
    namespace: TrackNamespace
    track_name: bytes
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        check_full_track_name(self.namespace, self.track_name)
        _check_parameters(self.parameters, _SCOPE_SUBSCRIBE, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace)
        w.track_name(self.track_name)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Subscribe":
        request_id = buf.pull_varint()
        namespace, name = pull_full_track_name(buf)
        return cls(request_id, namespace, name, Parameters.decode(buf, _SCOPE_SUBSCRIBE, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class SubscribeOk(Message):
    """SUBSCRIBE_OK (0x4)."""

    NAME: ClassVar[str] = "SUBSCRIBE_OK"
    track_alias: int
    parameters: Parameters = _NO_PARAMETERS
    track_properties: Properties = ()

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_SUBSCRIBE_OK, self.NAME, p)
        w.varint(self.track_alias)
        self.parameters.encode(w, p)
        encode_properties(w, self.track_properties)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "SubscribeOk":
        alias = buf.pull_varint()
        parameters = Parameters.decode(buf, _SCOPE_SUBSCRIBE_OK, cls.NAME, p)
        properties = decode_properties(buf, buf.end)
        _check_track_properties(properties)
        return cls(alias, parameters, properties)


@dataclass(frozen=True, slots=True)
class Publish(Message):
    """PUBLISH (0x1D): a publisher-initiated subscription."""

    NAME: ClassVar[str] = "PUBLISH"
    request_id: int
    namespace: TrackNamespace
    track_name: bytes
    track_alias: int
    parameters: Parameters = _NO_PARAMETERS
    track_properties: Properties = ()

    def _encode18(self, w: Writer, p: Profile) -> None:
        check_full_track_name(self.namespace, self.track_name)
        _check_parameters(self.parameters, _SCOPE_PUBLISH, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace)
        w.track_name(self.track_name)
        w.varint(self.track_alias)
        self.parameters.encode(w, p)
        encode_properties(w, self.track_properties)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Publish":
        request_id = buf.pull_varint()
        namespace, name = pull_full_track_name(buf)
        alias = buf.pull_varint()
        parameters = Parameters.decode(buf, _SCOPE_PUBLISH, cls.NAME, p)
        properties = decode_properties(buf, buf.end)
        _check_track_properties(properties)
        return cls(request_id, namespace, name, alias, parameters, properties)


@dataclass(frozen=True, slots=True)
class PublishDone(Message):
    """PUBLISH_DONE (0xB): the last message of the publisher on a subscription."""

    NAME: ClassVar[str] = "PUBLISH_DONE"
    status_code: int
    stream_count: int
    reason: str = ""

    def _encode18(self, w: Writer, p: Profile) -> None:
        w.varint(self.status_code)
        w.varint(self.stream_count)
        w.reason(self.reason)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "PublishDone":
        status = buf.pull_varint()
        count = buf.pull_varint()
        return cls(status, count, pull_reason(buf))


@dataclass(frozen=True, slots=True)
class Fetch(FetchFields, Message):
    """FETCH (0x16). Standalone: namespace, track_name, start, end (end is the wire
    End Location: the last Object plus one, Object 0 meaning the whole group).
    Joining: joining_request_id and joining_start."""

    NAME: ClassVar[str] = "FETCH"
    request_id: int
    fetch_type: FetchType = FetchType.STANDALONE
    namespace: TrackNamespace | None = None
    track_name: bytes | None = None
    start: Location | None = None
    end: Location | None = None
    joining_request_id: int | None = None
    joining_start: int | None = None
    parameters: Parameters = _NO_PARAMETERS


    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_FETCH, self.NAME, p)
        w.varint(self.request_id)
        if p.location_filter:
            # Draft-20: standalone only, its range in LOCATION_FILTER, inclusive.
            if self.fetch_type != FetchType.STANDALONE:
                raise ValueError(f"draft-{p.draft} has no joining FETCH (FILL_PARAMETERS replaces it)")
            namespace, track_name, start, end = self.track_and_range()
            check_full_track_name(namespace, track_name)
            w.namespace(namespace)
            w.track_name(track_name)
            lf = Writer()
            put_location_filter(lf, range_to_location_filter(start, end), p)
            self.parameters.encode(w, p, {int(ParameterType.SUBSCRIPTION_FILTER): bytes(lf.data)})
            return
        w.varint(self.fetch_type)
        if self.fetch_type == FetchType.STANDALONE:
            namespace, track_name, start, end = self.track_and_range()
            check_full_track_name(namespace, track_name)
            w.namespace(namespace)
            w.track_name(track_name)
            w.location(start)
            w.location(end)
        else:
            joining_request_id, joining_start = self.joining()
            w.varint(joining_request_id)
            w.varint(joining_start)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Fetch":
        request_id = buf.pull_varint()
        if p.location_filter:
            namespace, name = pull_full_track_name(buf)
            raw: dict[int, bytes] = {int(ParameterType.SUBSCRIPTION_FILTER): b""}
            parameters = Parameters.decode(buf, _SCOPE_FETCH | {ParameterType.SUBSCRIPTION_FILTER}, cls.NAME, p, raw)
            start, end = Location(0, 0), OPEN_END
            if raw[ParameterType.SUBSCRIPTION_FILTER]:
                flt = pull_location_filter(Buffer(raw[ParameterType.SUBSCRIPTION_FILTER]), p)
                try:
                    start, end = location_filter_to_range(flt)
                except UnsupportedFilter as e:
                    parameters = replace(parameters, unsupported=str(e))
            return cls(request_id, FetchType.STANDALONE, namespace, name, start, end, parameters=parameters)
        raw_type = buf.pull_varint()
        if raw_type not in (1, 2, 3):
            raise ProtocolViolation(f"unknown fetch type {raw_type}")
        fetch_type = FetchType(raw_type)
        if fetch_type == FetchType.STANDALONE:
            namespace, name = pull_full_track_name(buf)
            start = pull_location(buf)
            end = pull_location(buf)
            parameters = Parameters.decode(buf, _SCOPE_FETCH, cls.NAME, p)
            return cls(request_id, fetch_type, namespace, name, start, end, parameters=parameters)
        joining_id = buf.pull_varint()
        joining_start = buf.pull_varint()
        parameters = Parameters.decode(buf, _SCOPE_FETCH, cls.NAME, p)
        return cls(
            request_id,
            fetch_type,
            joining_request_id=joining_id,
            joining_start=joining_start,
            parameters=parameters,
        )


@dataclass(frozen=True, slots=True)
class FetchOk(Message):
    """FETCH_OK (0x18). `end_location` uses the FETCH End Location encoding."""

    NAME: ClassVar[str] = "FETCH_OK"
    end_of_track: bool
    end_location: Location
    parameters: Parameters = _NO_PARAMETERS
    track_properties: Properties = ()

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_FETCH_OK, self.NAME, p)
        w.uint8(1 if self.end_of_track else 0)
        w.location(exclusive_end_to_inclusive(self.end_location) if p.location_filter else self.end_location)
        self.parameters.encode(w, p)
        encode_properties(w, self.track_properties)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "FetchOk":
        raw = buf.pull_uint8()
        if raw > 1:
            raise ProtocolViolation(f"FETCH_OK End Of Track value {raw}")
        end = pull_location(buf)
        if p.location_filter:
            end = inclusive_end_to_exclusive(end)
        parameters = Parameters.decode(buf, _SCOPE_FETCH_OK, cls.NAME, p)
        properties = decode_properties(buf, buf.end)
        _check_track_properties(properties)
        return cls(bool(raw), end, parameters, properties)


@dataclass(frozen=True, slots=True)
class TrackStatus(Message):
    """TRACK_STATUS (0xD): SUBSCRIBE's format, answered by REQUEST_OK."""

    NAME: ClassVar[str] = "TRACK_STATUS"
    request_id: int
    namespace: TrackNamespace
    track_name: bytes
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        check_full_track_name(self.namespace, self.track_name)
        _check_parameters(self.parameters, _SCOPE_TRACK_STATUS, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace)
        w.track_name(self.track_name)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "TrackStatus":
        request_id = buf.pull_varint()
        namespace, name = pull_full_track_name(buf)
        return cls(request_id, namespace, name, Parameters.decode(buf, _SCOPE_TRACK_STATUS, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class PublishNamespace(Message):
    """PUBLISH_NAMESPACE (0x6)."""

    NAME: ClassVar[str] = "PUBLISH_NAMESPACE"
    request_id: int
    namespace: TrackNamespace
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_NAMESPACE_REQUEST, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "PublishNamespace":
        request_id = buf.pull_varint()
        namespace = pull_namespace(buf)
        return cls(request_id, namespace, Parameters.decode(buf, _SCOPE_NAMESPACE_REQUEST, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class SubscribeNamespace(Message):
    """SUBSCRIBE_NAMESPACE (0x50): asks for NAMESPACE / NAMESPACE_DONE under a prefix."""

    NAME: ClassVar[str] = "SUBSCRIBE_NAMESPACE"
    request_id: int
    namespace_prefix: TrackNamespace
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_NAMESPACE_REQUEST, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace_prefix)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "SubscribeNamespace":
        request_id = buf.pull_varint()
        prefix = pull_namespace(buf)
        return cls(request_id, prefix, Parameters.decode(buf, _SCOPE_NAMESPACE_REQUEST, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class SubscribeTracks(Message):
    """SUBSCRIBE_TRACKS (0x51): asks for PUBLISH of the tracks under a prefix."""

    NAME: ClassVar[str] = "SUBSCRIBE_TRACKS"
    request_id: int
    namespace_prefix: TrackNamespace
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_SUBSCRIBE_TRACKS, self.NAME, p)
        w.varint(self.request_id)
        w.namespace(self.namespace_prefix)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "SubscribeTracks":
        request_id = buf.pull_varint()
        prefix = pull_namespace(buf)
        return cls(request_id, prefix, Parameters.decode(buf, _SCOPE_SUBSCRIBE_TRACKS, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class Namespace(Message):
    """NAMESPACE (0x8): a namespace under the SUBSCRIBE_NAMESPACE prefix, as a suffix."""

    NAME: ClassVar[str] = "NAMESPACE"
    namespace_suffix: TrackNamespace

    def _encode18(self, w: Writer, p: Profile) -> None:
        w.namespace(self.namespace_suffix)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "Namespace":
        return cls(pull_namespace(buf))


@dataclass(frozen=True, slots=True)
class NamespaceDone(Message):
    """NAMESPACE_DONE (0xE): a namespace suffix is no longer published."""

    NAME: ClassVar[str] = "NAMESPACE_DONE"
    namespace_suffix: TrackNamespace

    def _encode18(self, w: Writer, p: Profile) -> None:
        w.namespace(self.namespace_suffix)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "NamespaceDone":
        return cls(pull_namespace(buf))


@dataclass(frozen=True, slots=True)
class PublishBlocked(Message):
    """PUBLISH_BLOCKED (0xF): a PUBLISH for this track could not be sent."""

    NAME: ClassVar[str] = "PUBLISH_BLOCKED"
    namespace_suffix: TrackNamespace
    track_name: bytes

    def _encode18(self, w: Writer, p: Profile) -> None:
        check_full_track_name(self.namespace_suffix, self.track_name)
        w.namespace(self.namespace_suffix)
        w.track_name(self.track_name)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "PublishBlocked":
        suffix, name = pull_full_track_name(buf)
        return cls(suffix, name)


@dataclass(frozen=True, slots=True)
class RequestUpdate(Message):
    """REQUEST_UPDATE (0x2): changes the parameters of the request on its stream."""

    NAME: ClassVar[str] = "REQUEST_UPDATE"
    request_id: int
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_REQUEST_UPDATE, self.NAME, p)
        w.varint(self.request_id)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "RequestUpdate":
        request_id = buf.pull_varint()
        return cls(request_id, Parameters.decode(buf, _SCOPE_REQUEST_UPDATE, cls.NAME, p))


@dataclass(frozen=True, slots=True)
class RequestOk(Message):
    """REQUEST_OK (0x7): PUBLISH_OK, REQUEST_UPDATE_OK, TRACK_STATUS_OK,
    SUBSCRIBE_NAMESPACE_OK, SUBSCRIBE_TRACKS_OK or PUBLISH_NAMESPACE_OK."""

    NAME: ClassVar[str] = "REQUEST_OK"
    parameters: Parameters = _NO_PARAMETERS
    track_properties: Properties = ()

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_REQUEST_OK, self.NAME, p)
        self.parameters.encode(w, p)
        encode_properties(w, self.track_properties)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "RequestOk":
        parameters = Parameters.decode(buf, _SCOPE_REQUEST_OK, cls.NAME, p)
        properties = decode_properties(buf, buf.end)
        _check_track_properties(properties)
        return cls(parameters, properties)


@dataclass(frozen=True, slots=True)
class Redirect:
    """Where to retry a request (section 10.6.1); empty fields mean "unchanged"."""

    connect_uri: str = ""
    namespace: TrackNamespace = ()
    track_name: bytes = b""


@dataclass(frozen=True, slots=True)
class RequestErrorMessage(Message):
    """REQUEST_ERROR (0x5). `retry_interval` is the wire value (ms + 1, 0 = never)."""

    NAME: ClassVar[str] = "REQUEST_ERROR"
    error_code: int
    retry_interval: int = 0
    reason: str = ""
    redirect: Redirect | None = None

    def _encode18(self, w: Writer, p: Profile) -> None:
        is_redirect = self.error_code == RequestErrorCode.REDIRECT
        if is_redirect != (self.redirect is not None):
            raise ValueError("a Redirect goes with the REDIRECT code, and only with it")
        w.varint(self.error_code)
        w.varint(self.retry_interval)
        w.reason(self.reason)
        if self.redirect is not None:
            check_full_track_name(self.redirect.namespace, self.redirect.track_name)
            w.length_prefixed(self.redirect.connect_uri.encode("utf-8"))
            w.namespace(self.redirect.namespace)
            w.track_name(self.redirect.track_name)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "RequestErrorMessage":
        code = buf.pull_varint()
        retry = buf.pull_varint()
        reason = pull_reason(buf)
        redirect = None
        if code == RequestErrorCode.REDIRECT:
            length = buf.pull_varint()
            if length > MAX_GOAWAY_URI:
                raise ProtocolViolation(f"redirect URI of {length} bytes (max {MAX_GOAWAY_URI})")
            uri = buf.pull_bytes(length).decode("utf-8", errors="replace")
            namespace, name = pull_full_track_name(buf)
            redirect = Redirect(uri, namespace, name)
        return cls(code, retry, reason, redirect)


@dataclass(frozen=True, slots=True)
class PublishStateNotify(Message):
    """PUBLISH_STATE_NOTIFY (0x22, draft-20+): the publisher changed a subscription's
    Forward, filter or Largest Object itself; never answered."""

    NAME: ClassVar[str] = "PUBLISH_STATE_NOTIFY"
    parameters: Parameters = _NO_PARAMETERS

    def _encode18(self, w: Writer, p: Profile) -> None:
        _check_parameters(self.parameters, _SCOPE_PUBLISH_STATE_NOTIFY, self.NAME, p)
        self.parameters.encode(w, p)

    @classmethod
    def _decode18(cls, buf: Buffer, p: Profile) -> "PublishStateNotify":
        return cls(Parameters.decode(buf, _SCOPE_PUBLISH_STATE_NOTIFY, cls.NAME, p))


_SCOPE_PUBLISH_STATE_NOTIFY = _scope(
    ParameterType.LARGEST_OBJECT, ParameterType.FORWARD, ParameterType.SUBSCRIPTION_FILTER
)

MESSAGE_TYPES: dict[int, dict[int, type[Message]]] = {
    18: {
        0x2F00: Setup,
        0x10: Goaway,
        0x3: Subscribe,
        0x4: SubscribeOk,
        0x1D: Publish,
        0xB: PublishDone,
        0x16: Fetch,
        0x18: FetchOk,
        0xD: TrackStatus,
        0x6: PublishNamespace,
        0x50: SubscribeNamespace,
        0x51: SubscribeTracks,
        0x8: Namespace,
        0xE: NamespaceDone,
        0xF: PublishBlocked,
        0x2: RequestUpdate,
        0x7: RequestOk,
        0x5: RequestErrorMessage,
    }
}
MESSAGE_TYPES[20] = MESSAGE_TYPES[22] = {**MESSAGE_TYPES[18], 0x22: PublishStateNotify}
_TYPE_OF: dict[int, dict[type[Message], int]] = {
    draft: {cls: mtype for mtype, cls in table.items()} for draft, table in MESSAGE_TYPES.items()
}

# Messages that may open a request stream (section 3.3).
REQUEST_MESSAGES: tuple[type[Message], ...] = (
    TrackStatus,
    Subscribe,
    Publish,
    Fetch,
    PublishNamespace,
    SubscribeNamespace,
    SubscribeTracks,
)


def message_type(message: Message, draft: int = DRAFT) -> int:
    return _TYPE_OF[draft][type(message)]




def _decode_payload(mtype: int, payload: Buffer, draft: int) -> Message:
    cls = MESSAGE_TYPES[draft].get(mtype)
    if cls is None:
        raise ProtocolViolation(f"unknown message type 0x{mtype:x}")
    p = profile(draft)
    return decode_checked(cls.NAME, payload, lambda buf: cls._decode18(buf, p))






def decode_message(data: bytes | bytearray | memoryview, draft: int = DRAFT) -> Message:
    """Decode exactly one framed message; raises ProtocolViolation otherwise."""
    if draft not in MESSAGE_TYPES:
        raise NotImplementedError(f"no codec for draft-{draft}")
    return decode_framed(data, VI64, lambda mtype, payload: _decode_payload(mtype, payload, draft))




class ControlStreamParser(FramedMessageParser):
    """Splits a control or request stream into messages as bytes arrive."""

    __slots__ = ("_draft",)

    def __init__(self, draft: int = DRAFT) -> None:
        if draft not in MESSAGE_TYPES:
            raise NotImplementedError(f"no codec for draft-{draft}")
        super().__init__()
        self._draft = draft

    def _known(self, mtype: int) -> bool:
        return mtype in MESSAGE_TYPES[self._draft]

    def _decode(self, mtype: int, payload: Buffer) -> Message:
        return _decode_payload(mtype, payload, self._draft)
