"""Draft-14 data streams in their draft-18 form: a parser whose items are draft-18 ones,
and subgroup and fetch stream writers that take draft-18 properties and statuses, so
that `SessionBase` reads and writes objects the same way for both drafts."""

from __future__ import annotations

from ..d18 import data as data18
from ..wire import DEFAULT_PUBLISHER_PRIORITY, GroupOrder, ObjectStatus, Properties
from . import data as d14data
from . import messages as d14

__all__ = ["DataStreamParser14", "FetchWriter14", "SubgroupWriter14"]


class DataStreamParser14:
    """Reads a draft-14 data stream and returns its items in their draft-18 form
    (a FETCH_HEADER is one already); what has none (objects that do not exist,
    fetch objects with a status) is dropped."""

    __slots__ = ("_parser",)

    def __init__(self, max_object_size: int) -> None:
        self._parser = d14data.DataStreamParser(max_object_size=max_object_size)

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> list[object]:
        items: list[object] = []
        for item in self._parser.feed(data, end_stream):
            converted = item if isinstance(item, data18.FetchHeader) else item.to_draft18()
            if converted is not None:
                items.append(converted)
        return items


class SubgroupWriter14:
    """A draft-14 subgroup stream writer that takes draft-18 properties and statuses."""

    __slots__ = ("_writer",)

    def __init__(self, header: d14data.SubgroupHeader) -> None:
        self._writer = d14data.SubgroupWriter(header)

    def header_bytes(self) -> bytes:
        return self._writer.header_bytes()

    def object_header(
        self,
        object_id: int,
        payload_length: int,
        *,
        properties: Properties = (),
        status: ObjectStatus = ObjectStatus.NORMAL,
    ) -> bytes:
        return self._writer.object_header(
            object_id, payload_length, extensions=_extensions(properties), status=d14.ObjectStatus(int(status))
        )


class FetchWriter14:
    """A draft-14 fetch stream writer: every object repeats all its fields, so the
    group order needs no tracking."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: int, group_order: GroupOrder = GroupOrder.ASCENDING) -> None:
        self.request_id = request_id

    def header_bytes(self) -> bytes:
        return d14data.FetchHeader(self.request_id).encode()

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
        """`subgroup_id` None (a Datagram object) is sent as the Object ID, draft-14's convention."""
        return d14data.encode_fetch_object(
            group_id, object_id if subgroup_id is None else subgroup_id, object_id, payload_length,
            publisher_priority=publisher_priority, extensions=_extensions(properties),
        )


def _extensions(properties: Properties) -> tuple[d14.KeyValuePair, ...]:
    """Draft-18 Properties as draft-14 extension headers."""
    return d14data._properties_from_18(properties) if properties else ()
