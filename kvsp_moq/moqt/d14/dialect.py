"""Draft-14's wire forms of data streams, datagrams and answers for the machinery every
draft shares (`session.dialect.Dialect`): objects and answers are converted from and to
their draft-18 forms, and what draft-14 always carries (a publisher priority) is filled
in with the track's default when the caller leaves it to be inherited. Each kind of
request has an error message of its own (`ERROR_MESSAGES`), its code renumbered."""

from __future__ import annotations

from ..d18 import data as data18
from ..d18 import messages as m18
from ..wire import TrackNamespace
from . import data as d14data
from . import messages as d14
from .adapters import FetchWriter14, SubgroupWriter14
from .request_state import (
    ANNOUNCED,
    FETCH,
    PUBLISH,
    PUBLISH_NAMESPACE,
    SUBSCRIBE,
    SUBSCRIBE_NAMESPACE,
    TRACK_STATUS,
    Request14,
)

__all__ = ["ERROR_MESSAGES", "Dialect14"]

#: The error message refusing each kind of request a peer may make.
ERROR_MESSAGES: dict[type[m18.Message], type[d14._RequestError]] = {
    SUBSCRIBE: d14.SubscribeError,
    FETCH: d14.FetchError,
    TRACK_STATUS: d14.TrackStatusError,
    PUBLISH: d14.PublishError,
    PUBLISH_NAMESPACE: d14.PublishNamespaceError,
    SUBSCRIBE_NAMESPACE: d14.SubscribeNamespaceError,
}


class Dialect14:
    """Draft-14's datagrams, data stream writers and answers."""

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

    def answer(self, request: Request14, message: m18.SubscribeOk | m18.FetchOk) -> bytes:
        if isinstance(message, m18.SubscribeOk):
            return d14.SubscribeOk.from_draft18(message, request.request_id).encode()
        return d14.FetchOk.from_draft18(message, request.request_id, request.fetch_group_order).encode()

    def publish_done(self, request: Request14, status_code: int, reason: str) -> bytes:
        done = m18.PublishDone(status_code, request.data_streams_opened, reason)
        return d14.PublishDone.from_draft18(done, request.request_id).encode()

    def request_error(
        self, request: Request14, error_code: int, reason: str, retry_interval: int = 0,
        redirect: m18.Redirect | None = None,
    ) -> bytes:
        """Retry Interval and redirect have no draft-14 field; a draft-18 code without a
        draft-14 counterpart is sent as INTERNAL_ERROR."""
        cls = ERROR_MESSAGES[PUBLISH_NAMESPACE if request.kind == ANNOUNCED else request.kind]
        return cls.from_draft18(m18.RequestErrorMessage(error_code, 0, reason), request.request_id).encode()
