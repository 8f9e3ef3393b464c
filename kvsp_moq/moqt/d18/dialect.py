"""Draft-18's wire forms of data streams and datagrams (shared by drafts 20 and 22) for
the machinery every draft shares (`session.dialect.Dialect`): the draft-18 forms
themselves, a padding datagram carrying no object, and a fill's fetch stream carrying
the Request ID of the SUBSCRIBE or REQUEST_UPDATE that asked for it."""

from __future__ import annotations

from ..wire import TrackNamespace
from .data import FetchStreamWriter, ObjectDatagram, PaddingDatagram, SubgroupHeader, SubgroupWriter, decode_datagram
from .messages import Subscribe
from .request_state import FillState, Request18, RequestStream

__all__ = ["Dialect18"]


class Dialect18:
    """Draft-18's datagrams and data stream writers."""

    fetch_writer_type = FetchStreamWriter

    def decode_datagram(self, data: bytes) -> ObjectDatagram | None:
        datagram = decode_datagram(data)
        return None if isinstance(datagram, PaddingDatagram) else datagram

    def encode_datagram(self, request: Request18, datagram: ObjectDatagram) -> bytes:
        return datagram.encode()

    def subgroup_writer(self, request: Request18, header: SubgroupHeader) -> SubgroupWriter:
        return SubgroupWriter(header)

    def fetch_writer(self, request: Request18) -> FetchStreamWriter:
        wire_id = request.wire_id if isinstance(request, FillState) else request.request_id
        return FetchStreamWriter(wire_id, request.fetch_group_order)

    def track_of(self, request: Request18) -> tuple[TrackNamespace, bytes]:
        assert isinstance(request, RequestStream)  # a subscription, not a fill
        subscribe = request.message_as(Subscribe)
        return subscribe.namespace, subscribe.track_name
