"""Draft-14's wire forms of data streams and datagrams for the machinery every draft
shares (`session.dialect.Dialect`): objects are converted from and to their draft-18
forms, and what draft-14 always carries (a publisher priority) is filled in with the
track's default when the caller leaves it to be inherited."""

from __future__ import annotations

from ..d18 import data as data18
from ..wire import TrackNamespace
from . import data as d14data
from .adapters import FetchWriter14, SubgroupWriter14
from .request_state import Request14

__all__ = ["Dialect14"]


class Dialect14:
    """Draft-14's datagrams and data stream writers."""

    fetch_writer_type = FetchWriter14

    def decode_datagram(self, data: bytes) -> data18.ObjectDatagram | None:
        return d14data.decode_datagram(data).to_draft18()

    def encode_datagram(self, request: Request14, datagram: data18.ObjectDatagram) -> bytes:
        """Draft-14 datagrams always carry a priority: an inherited one is the track's default."""
        return d14data.ObjectDatagram.from_draft18(datagram, request.default_priority).encode()

    def subgroup_writer(self, request: Request14, header: data18.SubgroupHeader) -> SubgroupWriter14:
        """Draft-14 headers always carry a priority (None: the track's default) and have
        no FIRST_OBJECT bit."""
        return SubgroupWriter14(d14data.SubgroupHeader.from_draft18(header, request.default_priority))

    def fetch_writer(self, request: Request14) -> FetchWriter14:
        return FetchWriter14(request.request_id, request.fetch_group_order)

    def track_of(self, request: Request14) -> tuple[TrackNamespace, bytes]:
        return request.namespace, request.track_name
