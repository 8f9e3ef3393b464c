"""Draft-18's wire forms of data streams, datagrams and answers (shared by drafts 20 and
22, `profiles`) for the machinery every draft shares (`session.dialect.Dialect`): the
draft-18 forms themselves, a padding datagram carrying no object, a fill's fetch stream
carrying the Request ID of the SUBSCRIBE or REQUEST_UPDATE that asked for it and no
FETCH_OK for a fill, and the codes draft-20 removed sent as their nearest kin."""

from __future__ import annotations

from ..errors import PublishDoneCode, RequestErrorCode
from ..wire import TrackNamespace
from .data import FetchStreamWriter, ObjectDatagram, PaddingDatagram, SubgroupHeader, SubgroupWriter, decode_datagram
from .messages import FetchOk, PublishDone, Redirect, RequestErrorMessage, Subscribe, SubscribeOk
from .profiles import Profile
from .request_state import FillState, Request18, RequestStream

__all__ = ["Dialect18"]


class Dialect18:
    """Draft-18's datagrams, data stream writers and answers, in the draft `profile`."""

    fetch_writer_type = FetchStreamWriter

    def __init__(self, profile: Profile) -> None:
        self._profile = profile

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

    def answer(self, request: Request18, message: SubscribeOk | FetchOk) -> bytes | None:
        if isinstance(request, FillState):
            return None  # a fill has no FETCH_OK
        return message.encode(self._profile.draft)

    def publish_done(self, request: Request18, status_code: int, reason: str) -> bytes:
        if status_code == PublishDoneCode.SUBSCRIPTION_ENDED and not self._profile.subscription_ended:
            status_code = PublishDoneCode.TRACK_ENDED  # the code draft-20 sends in its place
        return PublishDone(status_code, request.data_streams_opened, reason).encode(self._profile.draft)

    def request_error(
        self, request: Request18, error_code: int, reason: str, retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> bytes:
        if not self._profile.joining_error_codes and error_code in (
            RequestErrorCode.DUPLICATE_SUBSCRIPTION, RequestErrorCode.INVALID_JOINING_REQUEST_ID
        ):
            error_code = RequestErrorCode.INTERNAL_ERROR  # codes draft-20 removed
        return RequestErrorMessage(error_code, retry_interval, reason, redirect).encode(self._profile.draft)
