"""Draft-18 streams (section 3.3), sans I/O: each QUIC stream event goes to the control
stream, a request stream or a data stream; a new unidirectional stream is one or the
other by its type; resets and STOP_SENDING end what the stream carried. A part `session.MoqtSession` owns
(`StreamRouting`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from ..engine import (
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
    stream_is_unidirectional,
)
from ..errors import ProtocolViolation, StreamResetCode
from ..session.core import SessionPart
from ..session.records import IncomingDataStream
from ..varint import decode_vi64
from ..wire import GroupOrder
from .control import ControlReceiver
from .data import STREAM_TYPE_SETUP, DataStreamParser, FetchHeader, PaddingHeader, SubgroupHeader
from .messages import ControlStreamParser, Fetch, SubscribeNamespace
from .request_state import Request18
from .request_streams import RequestStreams

if TYPE_CHECKING:
    from .session import MoqtSession

__all__ = ["StreamRouting"]


class StreamRouting(SessionPart[Request18]):
    """QUIC stream events of a draft-18 session, by the stream they concern: the control
    stream and request streams to the `ControlReceiver` part, data streams to the session's
    receiving part."""

    def __init__(self, session: MoqtSession, streams: RequestStreams, control: ControlReceiver) -> None:
        super().__init__(session)
        self._session = session
        self._streams = streams
        self._control = control
        self._draft = session.draft
        self._profile = session.profile
        self._peer_control_stream_id: int | None = None
        self._unclassified_uni: dict[int, bytearray] = {}  # new unidirectional streams before their type

    def is_control_event(self, event: QuicEvent) -> bool:
        """Whether an event arriving before the peer's SETUP is processed at once:
        traffic of the peer's control stream, or of a new unidirectional stream
        that may be it (its type decides)."""
        sid = getattr(event, "stream_id", None)
        if sid is None:
            return False
        if sid == self._peer_control_stream_id or sid == self._session._control_stream_id:
            return True
        return (
            isinstance(event, StreamDataReceived)
            and stream_is_unidirectional(sid)
            and self._peer_control_stream_id is None
            and sid not in self._receiving.streams
            and not self._session._is_local_stream(sid)
        )

    def on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._peer_control_stream_id:
            self._control.on_control_data(event.data, out)
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            return
        data_stream = self._receiving.streams.get(sid)
        if data_stream is not None:
            self._receiving.on_data(sid, data_stream, event.data, event.end_stream, out)
            return
        if sid in self._streams.ignored:
            return
        if stream_is_unidirectional(sid):
            if self._session._is_local_stream(sid):
                return
            self._on_new_uni(sid, event, out)
            return
        self._on_request_stream(sid, event.data, event.end_stream, out)

    def _on_new_uni(self, sid: int, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        prefix = self._unclassified_uni.pop(sid, bytearray()) + event.data
        try:
            stream_type, _ = decode_vi64(prefix, 0)
        except ProtocolViolation:
            if event.end_stream:
                raise ProtocolViolation("unidirectional stream ended inside its type") from None
            self._unclassified_uni[sid] = prefix
            return
        if stream_type == STREAM_TYPE_SETUP:
            if self._peer_control_stream_id is not None:
                raise ProtocolViolation("second control stream")
            self._peer_control_stream_id = sid
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            self._control.on_control_data(bytes(prefix), out)
            return
        parser = DataStreamParser(
            max_object_size=self._session.max_object_size,
            fetch_group_order=self._fetch_order_of,
            timed_out_range=self._profile.timed_out_range,
        )
        data_stream: IncomingDataStream[Request18] = IncomingDataStream(parser)
        self._receiving.streams[sid] = data_stream
        if self._session.peer_setup is None:
            held = StreamDataReceived(data=bytes(prefix), end_stream=event.end_stream, stream_id=sid)
            self._session._hold_before_setup(held)
            return
        self._receiving.on_data(sid, data_stream, bytes(prefix), event.end_stream, out)

    def _on_request_stream(self, sid: int, data: bytes, end_stream: bool, out: list[ev.MoqtEvent]) -> None:
        parser = self._streams.parsers.get(sid)
        if parser is None:
            if self._session._is_local_stream(sid) or sid in self._streams.ignored:
                return
            parser = self._streams.parsers[sid] = ControlStreamParser(self._draft)
        for message in parser.feed(data):
            request = self._streams.by_stream.get(sid)
            if request is None:
                self._control.on_new_request(sid, message, out)
            else:
                self._control.on_request_message(request, message, out)
        if end_stream:
            if parser.buffered:
                raise ProtocolViolation("request stream ended inside a message")
            request = self._streams.by_stream.get(sid)
            if request is None:
                if sid not in self._streams.ignored:
                    raise ProtocolViolation("request stream ended before its request")
                return
            self._control.on_request_fin(request, out)

    def on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._peer_control_stream_id:
            raise ProtocolViolation("control stream reset")
        data_stream = self._receiving.streams.pop(sid, None)
        if data_stream is not None:
            self._receiving.on_reset(sid, data_stream, event.error_code, out)
            return
        if self._unclassified_uni.pop(sid, None) is not None:
            return
        request = self._streams.by_stream.get(sid)
        if request is None:
            self._streams.parsers.pop(sid, None)
            self._streams.ignored.add(sid)
            return
        request.fin_received = True
        if not request.closed:
            request.closed = True
            if not self._fetches.forget_held(request):
                out.append(ev.RequestCancelled(request.request_id, event.error_code, request.local))
            if request.local and request.kind is SubscribeNamespace:
                prefix = request.message_as(SubscribeNamespace).namespace_prefix
                for suffix in sorted(request.namespaces):
                    out.append(ev.NamespaceDoneReceived(request.request_id, suffix, prefix + suffix))
                request.namespaces.clear()
            self._streams.abort_stream(request, StreamResetCode.CANCELLED)
        self._streams.forget_if_done(request)

    def on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if self._sending.on_stop_sending(sid, event.error_code, out):
            return
        if sid == self._session._control_stream_id:
            raise ProtocolViolation("STOP_SENDING on the control stream")
        request = self._streams.by_stream.get(sid)
        if request is None:
            return
        request.fin_sent = True  # the stream was reset by the transport
        if not request.closed:
            request.closed = True
            if not self._fetches.forget_held(request):
                out.append(ev.RequestCancelled(request.request_id, event.error_code, request.local))
            self._streams.abort_stream(request, event.error_code)
        self._streams.forget_if_done(request)

    def _fetch_order_of(self, request_id: int) -> GroupOrder:
        request = self._requests.get(request_id)
        return GroupOrder.ASCENDING if request is None else request.fetch_group_order

    def on_data_header(self, sid: int, stream: IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> bool:
        if isinstance(item, PaddingHeader):
            stream.discard = True
            return False
        if isinstance(item, FetchHeader):
            stream.fetch = True
            request = self._requests.get(item.request_id)
            subscription = self._streams.fills.filled_subscription(item.request_id)
            if subscription is not None:
                # Draft-20: a fill of our subscription; its objects are the subscription's.
                stream.fill = True
                stream.request = subscription
                if subscription.closed:
                    self._receiving.stop(sid, stream, StreamResetCode.CANCELLED)
                    return False
                subscription.open_data_streams.add(sid)
                out.append(ev.SubgroupStreamOpened(subscription.request_id, sid, None))
                return True
            if request is None or request.kind is not Fetch or not request.local:
                raise ProtocolViolation(f"FETCH_HEADER for unknown fetch {item.request_id}")
            if request.closed:
                self._receiving.stop(sid, stream, StreamResetCode.CANCELLED)
                return False
            stream.request = request
            request.open_data_streams.add(sid)
            return True
        assert isinstance(item, SubgroupHeader)
        return self._receiving.on_subgroup_header(sid, stream, item, out)
