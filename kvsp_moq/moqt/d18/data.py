"""Data-stream and datagram framing (draft-18 section 11), and an incremental parser.

Objects travel on unidirectional streams that start with a stream type: a
SUBGROUP_HEADER (types 0b0XX1XXXX) followed by objects of one subgroup, a
FETCH_HEADER (0x05) followed by the objects of one FETCH response, or PADDING
(0x132B3E28). A single object can also travel in an OBJECT_DATAGRAM.

`DataStreamParser` takes bytes as QUIC delivers them and returns each object as
soon as its last payload byte arrives, so a receiver can use object N while N+1 is
in flight. Payload bytes are kept as slices of the received chunks and joined once
per object: one copy, no per-byte work. Every declared length is checked against a
configured maximum before bytes are accumulated for it.

The writers (`SubgroupWriter`, `FetchStreamWriter`) return only the object header;
the caller writes the payload after it, so a payload is never copied to be framed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Union

from ..errors import BufferReadError, ObjectTooLarge, ProtocolViolation
from ..varint import U64_MAX, VI64, Buffer, encode_vi64
from ..wire import (
    DEFAULT_MAX_OBJECT_SIZE,
    DEFAULT_MAX_PROPERTIES_SIZE,
    DEFAULT_PUBLISHER_PRIORITY,
    GroupOrder,
    Location,
    ObjectStatus,
    Properties,
    Writer,
    decode_properties,
    encode_properties,
)

__all__ = [
    "STREAM_TYPE_FETCH_HEADER",
    "STREAM_TYPE_SETUP",
    "STREAM_TYPE_PADDING",
    "DATAGRAM_TYPE_PADDING",
    "DEFAULT_PUBLISHER_PRIORITY",
    "DEFAULT_MAX_OBJECT_SIZE",
    "DEFAULT_MAX_PROPERTIES_SIZE",
    "ObjectStatus",
    "SubgroupIdMode",
    "SubgroupHeader",
    "SubgroupObject",
    "FetchHeader",
    "FetchObject",
    "FetchEndOfRange",
    "PaddingHeader",
    "ObjectDatagram",
    "PaddingDatagram",
    "DataItem",
    "SubgroupWriter",
    "FetchStreamWriter",
    "DataStreamParser",
    "is_subgroup_stream_type",
    "encode_padding_stream",
    "decode_datagram",
]

STREAM_TYPE_FETCH_HEADER = 0x05
STREAM_TYPE_SETUP = 0x2F00
STREAM_TYPE_PADDING = 0x132B3E28
DATAGRAM_TYPE_PADDING = 0x132B3E29


FETCH_END_OF_NON_EXISTENT_RANGE = 0x8C
FETCH_END_OF_UNKNOWN_RANGE = 0x10C
FETCH_END_OF_TIMED_OUT_RANGE = 0x20C  # draft-20+: read as an unknown range

_FLAG_SUBGROUP_MASK = 0x03
_FLAG_OBJECT_ID = 0x04
_FLAG_GROUP_ID = 0x08
_FLAG_PRIORITY = 0x10
_FLAG_PROPERTIES = 0x20
_FLAG_DATAGRAM = 0x40




_STATUSES = frozenset(int(s) for s in ObjectStatus)


class SubgroupIdMode(IntEnum):
    """How a SUBGROUP_HEADER carries the Subgroup ID (type bits 1-2)."""

    ZERO = 0
    FIRST_OBJECT = 1
    EXPLICIT = 2


def resolve_subgroup_mode(mode: SubgroupIdMode | None, subgroup_id: int | None) -> SubgroupIdMode:
    """The Subgroup ID mode a header is written with when none was chosen: ZERO for subgroup
    0, EXPLICIT otherwise (both drafts' rule)."""
    if mode is not None:
        return mode
    return SubgroupIdMode.ZERO if subgroup_id == 0 else SubgroupIdMode.EXPLICIT


def is_subgroup_stream_type(stream_type: int) -> bool:
    """True for a valid SUBGROUP_HEADER type (0b0XX1XXXX, mode not 0b11)."""
    return stream_type < 0x80 and stream_type & 0x10 != 0 and stream_type & 0x06 != 0x06


def _status(raw: int) -> ObjectStatus:
    if raw not in _STATUSES:
        raise ProtocolViolation(f"unknown object status 0x{raw:x}")
    return ObjectStatus(raw)


# ---------------------------------------------------------------------------
# Stream headers and the items the parser yields
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubgroupHeader:
    """SUBGROUP_HEADER. `publisher_priority` None means the DEFAULT_PRIORITY bit
    (inherit the subscription's); `subgroup_id` None means FIRST_OBJECT mode before
    the first object is seen. `subgroup_id_mode` None picks ZERO for subgroup 0 and
    EXPLICIT otherwise."""

    track_alias: int
    group_id: int
    subgroup_id: int | None = 0
    publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY
    has_properties: bool = False
    end_of_group: bool = False
    first_object: bool = True
    subgroup_id_mode: SubgroupIdMode | None = None

    def resolved_mode(self) -> SubgroupIdMode:
        return resolve_subgroup_mode(self.subgroup_id_mode, self.subgroup_id)

    def stream_type(self) -> int:
        mode = self.resolved_mode()
        value = 0x10 | (mode << 1)
        if self.has_properties:
            value |= 0x01
        if self.end_of_group:
            value |= 0x08
        if self.publisher_priority is None:
            value |= 0x20
        if self.first_object:
            value |= 0x40
        return value

    def encode(self) -> bytes:
        mode = self.resolved_mode()
        if mode == SubgroupIdMode.ZERO and self.subgroup_id not in (0, None):
            raise ValueError("ZERO subgroup mode with a non-zero subgroup ID")
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is None:
            raise ValueError("EXPLICIT subgroup mode needs a subgroup ID")
        parts = [encode_vi64(self.stream_type()), encode_vi64(self.track_alias), encode_vi64(self.group_id)]
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is not None:  # EXPLICIT has one: checked above
            parts.append(encode_vi64(self.subgroup_id))
        if self.publisher_priority is not None:
            if not 0 <= self.publisher_priority <= 255:
                raise ValueError("publisher priority outside 0-255")
            parts.append(bytes((self.publisher_priority,)))
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class SubgroupObject:
    """An object read from a subgroup stream."""

    object_id: int
    subgroup_id: int
    status: ObjectStatus
    payload: bytes
    properties: Properties = ()


@dataclass(frozen=True, slots=True)
class FetchHeader:
    """FETCH_HEADER: the stream answers the FETCH with this Request ID."""

    request_id: int

    def encode(self) -> bytes:
        return encode_vi64(STREAM_TYPE_FETCH_HEADER) + encode_vi64(self.request_id)


@dataclass(frozen=True, slots=True)
class FetchObject:
    """An object read from a fetch stream; `subgroup_id` None is Forwarding
    Preference Datagram."""

    group_id: int
    subgroup_id: int | None
    object_id: int
    publisher_priority: int
    payload: bytes
    properties: Properties = ()

    @property
    def location(self) -> Location:
        return Location(self.group_id, self.object_id)


@dataclass(frozen=True, slots=True)
class FetchEndOfRange:
    """Objects after the previous one up to `location` (inclusive) do not exist
    (`unknown` False) or have unknown status (`unknown` True)."""

    location: Location
    unknown: bool


@dataclass(frozen=True, slots=True)
class PaddingHeader:
    """The stream is padding; its bytes are discarded."""


DataItem = Union[SubgroupHeader, SubgroupObject, FetchHeader, FetchObject, FetchEndOfRange, PaddingHeader]


def encode_padding_stream(size: int) -> bytes:
    """A padding stream's bytes: the type and `size` zero bytes."""
    return encode_vi64(STREAM_TYPE_PADDING) + bytes(size)


# ---------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------


def _encode_object_properties(properties: Properties) -> bytes:
    w = Writer(VI64)
    encode_properties(w, properties)
    return encode_vi64(len(w.data)) + bytes(w.data)


class SubgroupWriter:
    """Frames the objects of one subgroup stream, in ascending Object ID."""

    __slots__ = ("header", "_last_object_id", "_properties_flag")

    def __init__(self, header: SubgroupHeader) -> None:
        self.header = header
        self._last_object_id: int | None = None
        self._properties_flag = header.has_properties

    @property
    def last_object_id(self) -> int | None:
        return self._last_object_id

    def header_bytes(self) -> bytes:
        return self.header.encode()

    def object_header(
        self,
        object_id: int,
        payload_length: int,
        *,
        properties: Properties = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> bytes:
        """The bytes that precede the payload of the next object."""
        last = self._last_object_id
        if last is None:
            delta = object_id
        else:
            delta = object_id - last - 1
            if delta < 0:
                raise ValueError(f"object {object_id} after {last}: subgroup objects ascend")
        if properties and not self._properties_flag:
            raise ValueError("properties on a subgroup opened without the PROPERTIES bit")
        if status != ObjectStatus.NORMAL:
            if payload_length or properties:
                raise ValueError("a status object has no payload and no properties")
        if object_id > U64_MAX:
            raise ValueError("object ID over 2^64-1")
        self._last_object_id = object_id
        if delta < 0x80 and payload_length < 0x80 and not self._properties_flag and payload_length:
            return bytes((delta, payload_length))
        parts = [encode_vi64(delta)]
        if self._properties_flag:
            parts.append(_encode_object_properties(properties) if properties else b"\x00")
        parts.append(encode_vi64(payload_length))
        if payload_length == 0:
            parts.append(encode_vi64(status))
        return b"".join(parts)


class FetchStreamWriter:
    """Frames the objects of one FETCH response, delta-coded against the prior object."""

    __slots__ = ("request_id", "descending", "_group", "_object", "_subgroup", "_priority", "_started")

    def __init__(self, request_id: int, group_order: GroupOrder = GroupOrder.ASCENDING) -> None:
        self.request_id = request_id
        self.descending = group_order == GroupOrder.DESCENDING
        self._group: int | None = None
        self._object: int | None = None
        self._subgroup: int | None = None  # last actual object's; None before one
        self._priority: int | None = None
        self._started = False

    def header_bytes(self) -> bytes:
        return FetchHeader(self.request_id).encode()

    def _group_delta(self, group_id: int) -> int:
        prior = self._group
        assert prior is not None
        delta = prior - group_id - 1 if self.descending else group_id - prior - 1
        if delta < 0:
            order = "descending" if self.descending else "ascending"
            raise ValueError(f"group {group_id} after {prior} breaks {order} group order")
        return delta

    def object_header(
        self,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> bytes:
        """The bytes before the payload. `subgroup_id` None marks a Datagram object."""
        if not 0 <= publisher_priority <= 255:
            raise ValueError("publisher priority outside 0-255")
        flags = 0
        fields: list[bytes] = []
        prior_object = self._object  # set with self._group
        if self._group is None or prior_object is None:
            flags |= _FLAG_GROUP_ID | _FLAG_OBJECT_ID
            fields += [encode_vi64(group_id), encode_vi64(object_id)]
        elif group_id != self._group:
            flags |= _FLAG_GROUP_ID | _FLAG_OBJECT_ID
            fields += [encode_vi64(self._group_delta(group_id)), encode_vi64(object_id)]
        elif object_id != prior_object + 1:
            delta = object_id - prior_object
            if delta <= 0:
                raise ValueError(f"object {object_id} after {prior_object} in group {group_id}")
            flags |= _FLAG_OBJECT_ID
            fields.append(encode_vi64(delta))
        subgroup_field = b""
        if subgroup_id is None:
            flags |= _FLAG_DATAGRAM
        elif subgroup_id == 0:
            pass
        elif self._subgroup is not None and subgroup_id == self._subgroup:
            flags |= 0x01
        elif self._subgroup is not None and subgroup_id == self._subgroup + 1:
            flags |= 0x02
        else:
            flags |= 0x03
            subgroup_field = encode_vi64(subgroup_id)
        if self._priority is None or publisher_priority != self._priority:
            flags |= _FLAG_PRIORITY
        if properties:
            flags |= _FLAG_PROPERTIES
        out = [encode_vi64(flags)]
        if flags & _FLAG_GROUP_ID:
            out.append(fields.pop(0))
        out.append(subgroup_field)
        if fields:
            out.append(fields[0])
        if flags & _FLAG_PRIORITY:
            out.append(bytes((publisher_priority,)))
        if properties:
            out.append(_encode_object_properties(properties))
        out.append(encode_vi64(payload_length))
        self._group, self._object = group_id, object_id
        # A Datagram object reads as Subgroup 0 when it is the prior object.
        self._subgroup = 0 if subgroup_id is None else subgroup_id
        self._priority = publisher_priority
        self._started = True
        return b"".join(out)

    def end_of_range(self, group_id: int, object_id: int, *, unknown: bool = False) -> bytes:
        """Objects up to (group_id, object_id) do not exist, or are unknown."""
        if self._group is not None and (group_id, object_id) == (self._group, self._object):
            raise ValueError("end of range at the prior object")
        flags = FETCH_END_OF_UNKNOWN_RANGE if unknown else FETCH_END_OF_NON_EXISTENT_RANGE
        self._group, self._object = group_id, object_id
        return encode_vi64(flags) + encode_vi64(group_id) + encode_vi64(object_id)


# ---------------------------------------------------------------------------
# Datagrams
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectDatagram:
    """OBJECT_DATAGRAM (section 11.3.1). `publisher_priority` None means inherit."""

    track_alias: int
    group_id: int
    object_id: int
    payload: bytes = b""
    publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY
    status: ObjectStatus | None = None
    properties: Properties = ()
    end_of_group: bool = False

    def encode(self) -> bytes:
        dtype = 0
        if self.properties:
            dtype |= 0x01
        if self.end_of_group:
            dtype |= 0x02
        if self.object_id == 0:
            dtype |= 0x04
        if self.publisher_priority is None:
            dtype |= 0x08
        if self.status is not None:
            if self.end_of_group:
                raise ValueError("a status datagram cannot carry END_OF_GROUP")
            if self.payload:
                raise ValueError("a status datagram has no payload")
            if self.properties and self.status != ObjectStatus.NORMAL:
                raise ValueError("only Normal objects carry properties")
            dtype |= 0x20
        parts = [encode_vi64(dtype), encode_vi64(self.track_alias), encode_vi64(self.group_id)]
        if self.object_id != 0:
            parts.append(encode_vi64(self.object_id))
        if self.publisher_priority is not None:
            parts.append(bytes((self.publisher_priority,)))
        if self.properties:
            parts.append(_encode_object_properties(self.properties))
        if self.status is not None:
            parts.append(encode_vi64(self.status))
        else:
            parts.append(self.payload)
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class PaddingDatagram:
    """A padding datagram; its content is discarded."""


def decode_datagram(
    data: bytes | memoryview, *, max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE
) -> ObjectDatagram | PaddingDatagram:
    """Decode one QUIC DATAGRAM payload; raises ProtocolViolation when malformed."""
    buf = Buffer(data)
    try:
        dtype = buf.pull_varint()
        if dtype == DATAGRAM_TYPE_PADDING:
            return PaddingDatagram()
        if dtype > 0x2F or dtype & 0x10:
            raise ProtocolViolation(f"unknown datagram type 0x{dtype:x}")
        is_status = bool(dtype & 0x20)
        if is_status and dtype & 0x02:
            raise ProtocolViolation(f"datagram type 0x{dtype:x}: status with END_OF_GROUP")
        alias = buf.pull_varint()
        group = buf.pull_varint()
        obj = 0 if dtype & 0x04 else buf.pull_varint()
        priority = None if dtype & 0x08 else buf.pull_uint8()
        properties: Properties = ()
        if dtype & 0x01:
            length = buf.pull_varint()
            if length == 0:
                raise ProtocolViolation("datagram PROPERTIES bit with empty properties")
            if length > max_properties_size:
                raise ObjectTooLarge(f"datagram properties of {length} bytes")
            properties = decode_properties(buf, buf.tell() + length)
        status = None
        payload = b""
        if is_status:
            status = _status(buf.pull_varint())
            if properties and status != ObjectStatus.NORMAL:
                raise ProtocolViolation("properties on a non-Normal status datagram")
            if not buf.eof():
                raise ProtocolViolation("status datagram with trailing bytes")
        else:
            payload = buf.pull_rest()
    except BufferReadError:
        raise ProtocolViolation("truncated datagram") from None
    return ObjectDatagram(alias, group, obj, payload, priority, status, properties, bool(dtype & 0x02))


# ---------------------------------------------------------------------------
# Incremental parser
# ---------------------------------------------------------------------------

_S_TYPE, _S_SUBGROUP_OBJECT, _S_FETCH_OBJECT, _S_PAYLOAD, _S_DISCARD = range(5)


_END_MARKERS_18 = frozenset({FETCH_END_OF_NON_EXISTENT_RANGE, FETCH_END_OF_UNKNOWN_RANGE})
_END_MARKERS_20 = _END_MARKERS_18 | {FETCH_END_OF_TIMED_OUT_RANGE}


class DataStreamParser:
    """Parses one unidirectional data stream incrementally.

    `feed()` returns the items completed by the new bytes: the stream header
    (SubgroupHeader, FetchHeader or PaddingHeader) first, then SubgroupObject or
    FetchObject / FetchEndOfRange items. Malformed input raises ProtocolViolation
    (ObjectTooLarge for a length over the configured maximum); a FIN inside an
    object or header raises ProtocolViolation too.

    `fetch_group_order` maps the Request ID of a FETCH_HEADER to the group order of
    that FETCH, which decides the sign of Group ID deltas; it defaults to Ascending.
    A SETUP stream type is reported as ProtocolViolation: control streams are
    routed before a data parser is made.
    """

    __slots__ = (
        "max_object_size",
        "max_properties_size",
        "_fetch_group_order",
        "_end_markers",
        "_state",
        "_pending",
        "_parts",
        "_remaining",
        "_header",
        "_has_properties",
        "_subgroup_id",
        "_last_object_id",
        "_descending",
        "_prior_group",
        "_prior_object",
        "_prior_subgroup",
        "_prior_priority",
        "_current",
        "stream_type",
        "finished",
        "bytes_received",
    )

    def __init__(
        self,
        *,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
        fetch_group_order: Callable[[int], GroupOrder] | None = None,
        timed_out_range: bool = False,
    ) -> None:
        """`timed_out_range`: End of Timed-Out Range markers are valid (draft-20+)."""
        self.max_object_size = max_object_size
        self._end_markers = _END_MARKERS_20 if timed_out_range else _END_MARKERS_18
        self.max_properties_size = max_properties_size
        self._fetch_group_order = fetch_group_order
        self._state = _S_TYPE
        self._pending = bytearray()
        self._parts: list[memoryview] = []
        self._remaining = 0
        self._header: SubgroupHeader | FetchHeader | None = None
        self._has_properties = False
        self._subgroup_id: int | None = None
        self._last_object_id: int | None = None
        self._descending = False
        self._prior_group: int | None = None
        self._prior_object: int | None = None
        self._prior_subgroup: int | None = None
        self._prior_priority: int | None = None
        # Fields of the object whose payload is being collected.
        self._current: tuple = ()
        self.stream_type: int | None = None
        self.finished = False
        self.bytes_received = 0

    @property
    def header(self) -> SubgroupHeader | FetchHeader | None:
        return self._header

    @property
    def at_boundary(self) -> bool:
        """True when no object or header is partially received."""
        return self._state in (_S_SUBGROUP_OBJECT, _S_FETCH_OBJECT, _S_DISCARD) and not self._pending

    def set_group_order(self, group_order: GroupOrder) -> None:
        """Set the FETCH group order once it is known (before any object arrived)."""
        if self._prior_group is not None:
            raise ValueError("group order changed after objects were parsed")
        self._descending = group_order == GroupOrder.DESCENDING

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> list[DataItem]:
        if self.finished:
            if data:
                raise ProtocolViolation("data after the end of the stream")
            return []
        items: list[DataItem] = []
        view = data if isinstance(data, memoryview) else memoryview(data)
        self.bytes_received += len(view)
        pos = 0
        size = len(view)
        while True:
            state = self._state
            if state == _S_PAYLOAD:
                take = self._remaining if self._remaining < size - pos else size - pos
                if take:
                    self._parts.append(view[pos : pos + take])
                    pos += take
                    self._remaining -= take
                if self._remaining:
                    break
                items.append(self._finish_payload())
                continue
            if state == _S_DISCARD:
                pos = size
                break
            if pos >= size and not self._pending:
                break
            # A header (stream or object) is parsed from a contiguous buffer: the
            # new bytes directly, or the held partial header plus them.
            if self._pending:
                self._pending += view[pos:]
                source: bytes | memoryview = bytes(self._pending)
                start = 0
                pos = size
            else:
                source = view
                start = pos
            try:
                consumed = self._parse_header(source, start, items)
            except BufferReadError:
                if not self._pending:
                    self._pending = bytearray(view[pos:])
                    pos = size
                break
            if source is view:
                pos = consumed
            else:
                rest = source[consumed:]
                self._pending = bytearray()
                view = memoryview(rest)
                pos = 0
                size = len(view)
        if end_stream:
            self.finished = True
            if not self.at_boundary:
                raise ProtocolViolation("stream ended inside an object or header")
        return items

    # -- headers -----------------------------------------------------------

    def _parse_header(self, source: bytes | memoryview, start: int, items: list[DataItem]) -> int:
        buf = Buffer(source, start)
        state = self._state
        if state == _S_TYPE:
            self._parse_stream_header(buf, items)
        elif state == _S_SUBGROUP_OBJECT:
            self._parse_subgroup_object(buf, items)
        else:
            self._parse_fetch_object(buf, items)
        return buf.tell()

    def _parse_stream_header(self, buf: Buffer, items: list[DataItem]) -> None:
        stream_type = buf.pull_varint()
        if stream_type == STREAM_TYPE_FETCH_HEADER:
            fetch_header = FetchHeader(buf.pull_varint())
            self._header = fetch_header
            if self._fetch_group_order is not None:
                self._descending = self._fetch_group_order(fetch_header.request_id) == GroupOrder.DESCENDING
            self._state = _S_FETCH_OBJECT
            items.append(fetch_header)
        elif stream_type == STREAM_TYPE_PADDING:
            self._state = _S_DISCARD
            items.append(PaddingHeader())
        elif is_subgroup_stream_type(stream_type):
            alias = buf.pull_varint()
            group = buf.pull_varint()
            mode = SubgroupIdMode((stream_type >> 1) & 0x03)
            subgroup: int | None
            if mode == SubgroupIdMode.EXPLICIT:
                subgroup = buf.pull_varint()
            elif mode == SubgroupIdMode.ZERO:
                subgroup = 0
            else:
                subgroup = None
            priority = None if stream_type & 0x20 else buf.pull_uint8()
            header = SubgroupHeader(
                alias,
                group,
                subgroup,
                priority,
                bool(stream_type & 0x01),
                bool(stream_type & 0x08),
                bool(stream_type & 0x40),
                mode,
            )
            self._header = header
            self._has_properties = header.has_properties
            self._subgroup_id = subgroup
            self._state = _S_SUBGROUP_OBJECT
            items.append(header)
        else:
            raise ProtocolViolation(f"unknown data stream type 0x{stream_type:x}")
        self.stream_type = stream_type

    def _pull_properties(self, buf: Buffer) -> Properties:
        length = buf.pull_varint()
        if length == 0:
            return ()
        if length > self.max_properties_size:
            raise ObjectTooLarge(f"object properties of {length} bytes (max {self.max_properties_size})")
        return decode_properties(buf, buf.tell() + length)

    def _payload_length(self, buf: Buffer) -> int:
        length = buf.pull_varint()
        if length > self.max_object_size:
            raise ObjectTooLarge(f"object of {length} bytes (max {self.max_object_size})")
        return length

    def _parse_subgroup_object(self, buf: Buffer, items: list[DataItem]) -> None:
        delta = buf.pull_varint()
        properties = self._pull_properties(buf) if self._has_properties else ()
        length = self._payload_length(buf)
        status = ObjectStatus.NORMAL
        if length == 0:
            status = _status(buf.pull_varint())
            if properties and status != ObjectStatus.NORMAL:
                raise ProtocolViolation("properties on a non-Normal status object")
        # Every field is read: commit the object.
        last = self._last_object_id
        object_id = delta if last is None else last + delta + 1
        if object_id > U64_MAX:
            raise ProtocolViolation("object ID over 2^64-1")
        self._last_object_id = object_id
        if self._subgroup_id is None:
            self._subgroup_id = object_id
        if length == 0:
            items.append(SubgroupObject(object_id, self._subgroup_id, status, b"", properties))
            return
        self._current = (object_id, properties)
        self._remaining = length
        self._parts = []
        self._state = _S_PAYLOAD

    def _parse_fetch_object(self, buf: Buffer, items: list[DataItem]) -> None:
        flags = buf.pull_varint()
        prior_group, prior_object = self._prior_group, self._prior_object  # set together
        if flags in self._end_markers:
            group = buf.pull_varint()
            obj = buf.pull_varint()
            self._prior_group, self._prior_object = group, obj
            items.append(FetchEndOfRange(Location(group, obj), flags != FETCH_END_OF_NON_EXISTENT_RANGE))
            return
        if flags >= 0x80:
            raise ProtocolViolation(f"invalid fetch serialization flags 0x{flags:x}")
        if prior_group is None and (not flags & _FLAG_GROUP_ID or not flags & _FLAG_OBJECT_ID):
            raise ProtocolViolation("first fetch object without Group and Object ID")
        if flags & _FLAG_GROUP_ID:
            group_field = buf.pull_varint()
            if prior_group is None:
                group = group_field
            elif self._descending:
                group = prior_group - group_field - 1
                if group < 0:
                    raise ProtocolViolation("fetch group ID below 0")
            else:
                group = prior_group + group_field + 1
                if group > U64_MAX:
                    raise ProtocolViolation("fetch group ID over 2^64-1")
        else:
            assert prior_group is not None  # checked above: the first object names its group
            group = prior_group
        subgroup: int | None
        if flags & _FLAG_DATAGRAM:
            subgroup = None
        else:
            mode = flags & _FLAG_SUBGROUP_MASK
            if mode == 0:
                subgroup = 0
            elif mode == 3:
                subgroup = buf.pull_varint()
            else:
                if self._prior_subgroup is None:
                    raise ProtocolViolation("fetch object refers to a prior subgroup that does not exist")
                subgroup = self._prior_subgroup + (mode - 1)
        if flags & _FLAG_OBJECT_ID:
            object_field = buf.pull_varint()
            if prior_object is None or flags & _FLAG_GROUP_ID:
                obj = object_field
            else:
                obj = prior_object + object_field
        else:
            assert prior_object is not None  # checked above: the first object names its object
            obj = prior_object + 1
        if obj > U64_MAX:
            raise ProtocolViolation("fetch object ID over 2^64-1")
        if flags & _FLAG_PRIORITY:
            priority = buf.pull_uint8()
        elif self._prior_priority is None:
            raise ProtocolViolation("fetch object refers to a prior priority that does not exist")
        else:
            priority = self._prior_priority
        properties = self._pull_properties(buf) if flags & _FLAG_PROPERTIES else ()
        length = self._payload_length(buf)
        self._prior_group, self._prior_object = group, obj
        self._prior_subgroup = 0 if subgroup is None else subgroup
        self._prior_priority = priority
        if length == 0:
            items.append(FetchObject(group, subgroup, obj, priority, b"", properties))
            return
        self._current = (group, subgroup, obj, priority, properties)
        self._remaining = length
        self._parts = []
        self._state = _S_PAYLOAD

    def _finish_payload(self) -> DataItem:
        parts = self._parts
        payload = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        self._parts = []
        current = self._current
        self._current = ()
        if isinstance(self._header, FetchHeader):
            self._state = _S_FETCH_OBJECT
            group, subgroup, obj, priority, properties = current
            return FetchObject(group, subgroup, obj, priority, payload, properties)
        self._state = _S_SUBGROUP_OBJECT
        object_id, properties = current
        subgroup_id = self._subgroup_id
        assert subgroup_id is not None  # known once an object header was read
        return SubgroupObject(object_id, subgroup_id, ObjectStatus.NORMAL, payload, properties)
