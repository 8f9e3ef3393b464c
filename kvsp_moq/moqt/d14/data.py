"""MOQT draft-14 data streams and datagrams, sans I/O, with their conversion to the
draft-18 items a session works with (see `messages` for what does not map)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from ..d18 import data as data18
from ..d18 import messages as m18
from ..errors import BufferReadError, ObjectTooLarge, ProtocolViolation
from ..varint import QUIC_VARINT, QUIC_VARINT_MAX, VI64, Buffer, encode_quic_varint
from ..wire import Location
from .messages import (
    _STATUSES,
    DEFAULT_MAX_EXTENSIONS_SIZE,
    DEFAULT_MAX_OBJECT_SIZE,
    STREAM_TYPE_FETCH_HEADER,
    ExtensionType,
    KeyValuePair,
    ObjectStatus,
    SubgroupIdMode,
    _check_uint8,
    _check_varint,
    _decode_extensions,
    encode_extensions,
)


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

    def resolved_mode(self) -> SubgroupIdMode:
        return data18.resolve_subgroup_mode(self.subgroup_id_mode, self.subgroup_id)

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
        if mode == SubgroupIdMode.EXPLICIT and self.subgroup_id is not None:  # EXPLICIT has one: checked above
            parts.append(encode_quic_varint(self.subgroup_id))
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
