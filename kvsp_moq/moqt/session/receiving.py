"""Reading the peer's data streams and datagrams: subgroup streams matched to their
subscription by track alias (held until the alias is known), fetch streams to their
FETCH, and each item delivered as an event; a subscription ended by PUBLISH_DONE is
forgotten once all its streams ended. A part the session owns (`DataReceiver`); what
it asks of the session in return is `ReceivingHooks`."""

from __future__ import annotations

from typing import Generic, Protocol

from .. import events as ev
from ..d18.data import FetchEndOfRange, FetchObject, SubgroupHeader, SubgroupObject
from ..engine import QuicEngine
from ..errors import StreamResetCode
from ..wire import ObjectStatus
from .dialect import Dialect
from .records import UNKNOWN_STREAM_COUNT, IncomingDataStream, RequestT

__all__ = ["DataReceiver", "ReceivingHooks"]

class ReceivingHooks(Protocol[RequestT]):
    """What the receiving part asks of its session: the first item of a data stream
    (whose form is the draft's), and what a stream's end means for its request."""

    def _on_data_header(
        self, sid: int, stream: IncomingDataStream[RequestT], item: object, out: list[ev.MoqtEvent]
    ) -> bool:
        """The first item of an incoming data stream; False when the stream is dropped."""
        ...

    def _fetch_stream_reset(self, request: RequestT) -> None:
        """The data stream of an open FETCH of ours was reset."""
        ...

    def _data_stream_reset(self, request: RequestT) -> None:
        """One of the request's data streams was reset or stopped."""
        ...

    def _maybe_finish_fetch(self, request: RequestT) -> None: ...

    def _close_request(self, request: RequestT) -> None: ...

    def _forget_if_done(self, request: RequestT) -> None: ...


class DataReceiver(Generic[RequestT]):
    """Incoming data streams (`streams`, by stream ID) and datagrams, as events; our
    subscriptions by the track alias their objects carry (`aliases`)."""

    def __init__(
        self,
        quic: QuicEngine,
        session: ReceivingHooks[RequestT],
        dialect: Dialect[RequestT],
        max_unmatched_stream_bytes: int,
    ) -> None:
        self._quic = quic
        self._session = session
        self._dialect = dialect
        self._max_unmatched_stream_bytes = max_unmatched_stream_bytes
        self.streams: dict[int, IncomingDataStream[RequestT]] = {}
        self.aliases: dict[int, RequestT] = {}  # track alias -> our subscription

    def on_reset(
        self, sid: int, stream: IncomingDataStream[RequestT], error_code: int, out: list[ev.MoqtEvent]
    ) -> None:
        """The publisher reset an incoming data stream (already removed from the table)."""
        request = stream.request
        if request is None or stream.discard:
            return
        request.open_data_streams.discard(sid)
        if stream.fill:
            # A fill that failed: the subscription goes on without those objects.
            out.append(ev.DataStreamEnded(request.request_id, sid, False, False, None))
            request.data_streams_ended += 1
            self.maybe_end_subscription(request)
            return
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch, True, error_code))
        if stream.fetch:
            if not request.closed:
                # A reset fetch stream ends the fetch: the range is incomplete.
                self._session._fetch_stream_reset(request)
        else:
            request.data_streams_ended += 1
            self.maybe_end_subscription(request)

    def on_data(
        self, sid: int, stream: IncomingDataStream[RequestT], data: bytes, end_stream: bool, out: list[ev.MoqtEvent]
    ) -> None:
        if stream.discard:
            if end_stream:
                self.streams.pop(sid, None)
            return
        items = stream.parser.feed(data, end_stream)
        for item in items:
            if stream.request is None and stream.header is None and not stream.fetch:
                if not self._session._on_data_header(sid, stream, item, out):
                    return
                continue
            if stream.request is None:
                stream.held.append(item)
                stream.held_bytes += len(getattr(item, "payload", b"")) + 32
                if stream.held_bytes > self._max_unmatched_stream_bytes:
                    self.stop(sid, stream, StreamResetCode.EXCESSIVE_LOAD)
                    return
                continue
            self._deliver_item(sid, stream, item, out)
        if end_stream:
            if stream.request is not None:
                self.streams.pop(sid, None)
                self._end_incoming(sid, stream, out)
            else:
                stream.held.append(None)  # FIN marker, delivered with the held items

    def on_subgroup_header(
        self, sid: int, stream: IncomingDataStream[RequestT], header: SubgroupHeader, out: list[ev.MoqtEvent]
    ) -> bool:
        """A subgroup stream begins; its objects wait until the track alias is known.
        False when the stream is stopped instead."""
        stream.header = header
        request = self.aliases.get(header.track_alias)
        if request is None:
            stream.held.append(header)
            return True
        if request.closed:
            self.stop(sid, stream, StreamResetCode.CANCELLED)
            return False
        stream.request = request
        request.open_data_streams.add(sid)
        out.append(ev.SubgroupStreamOpened(request.request_id, sid, header))
        return True

    def stop_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """STOP_SENDING an incoming data stream, e.g. a group no longer of interest;
        its remaining bytes are discarded and the subscription goes on."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.stop(stream_id, stream, error_code)

    def incoming_stream_open(self, stream_id: int) -> bool:
        """Whether an incoming data stream is still being read."""
        stream = self.streams.get(stream_id)
        return stream is not None and not stream.discard

    def stop(self, sid: int, stream: IncomingDataStream[RequestT], code: int) -> None:
        """STOP_SENDING a data stream and discard what is left of it."""
        if stream.discard:
            return
        stream.discard = True
        stream.held = []
        request = stream.request
        attached = request is not None and sid in request.open_data_streams
        if request is not None and attached:
            request.open_data_streams.discard(sid)
            if not stream.fetch:
                request.data_streams_ended += 1
                self.maybe_end_subscription(request)
        try:
            self._quic.stop_stream(sid, code)
        except (ValueError, RuntimeError, AssertionError):
            pass
        if request is not None and attached:
            self._session._data_stream_reset(request)

    def _deliver_item(
        self, sid: int, stream: IncomingDataStream[RequestT], item: object, out: list[ev.MoqtEvent]
    ) -> None:
        request = stream.request
        assert request is not None
        if isinstance(item, SubgroupObject):
            header = stream.header
            assert header is not None
            priority = header.publisher_priority
            out.append(
                ev.ObjectReceived(
                    request.request_id,
                    header.track_alias,
                    header.group_id,
                    item.subgroup_id,
                    item.object_id,
                    request.default_priority if priority is None else priority,
                    item.status,
                    item.payload,
                    item.properties,
                    sid,
                    header.end_of_group,
                )
            )
        elif isinstance(item, FetchObject) and stream.fill:
            out.append(
                ev.ObjectReceived(
                    request.request_id,
                    request.track_alias,
                    item.group_id,
                    None,
                    item.object_id,
                    request.default_priority if item.publisher_priority is None else item.publisher_priority,
                    ObjectStatus.NORMAL,
                    item.payload,
                    item.properties,
                    sid,
                    False,
                )
            )
        elif isinstance(item, FetchEndOfRange) and stream.fill:
            pass  # a gap in a fill: nothing to deliver
        elif isinstance(item, FetchObject):
            out.append(
                ev.FetchObjectReceived(
                    request.request_id,
                    item.group_id,
                    item.subgroup_id,
                    item.object_id,
                    item.publisher_priority,
                    item.payload,
                    item.properties,
                    sid,
                )
            )
        elif isinstance(item, FetchEndOfRange):
            out.append(ev.FetchRangeReceived(request.request_id, item.location, item.unknown))
        elif isinstance(item, SubgroupHeader):
            out.append(ev.SubgroupStreamOpened(request.request_id, sid, item))

    def _end_incoming(self, sid: int, stream: IncomingDataStream[RequestT], out: list[ev.MoqtEvent]) -> None:
        request = stream.request
        assert request is not None
        request.open_data_streams.discard(sid)
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch and not stream.fill, False, None))
        if stream.fetch and not stream.fill:
            request.fetch_stream_closed = True
            self._session._maybe_finish_fetch(request)
        else:
            request.data_streams_ended += 1
            self.maybe_end_subscription(request)
        self._session._forget_if_done(request)

    def maybe_end_subscription(self, request: RequestT) -> None:
        """After PUBLISH_DONE, forget the subscription once all its streams ended."""
        count = request.done_stream_count
        if count is None or request.closed or request.open_data_streams:
            return
        if count != UNKNOWN_STREAM_COUNT and request.data_streams_ended >= count:
            self._session._close_request(request)

    def release(self, request: RequestT) -> None:
        """Forget a subscription that ended with PUBLISH_DONE, even if some of its
        streams never arrived (after a grace period chosen by the caller)."""
        if request.done_stream_count is None:
            return
        for sid in list(request.open_data_streams):
            stream = self.streams.get(sid)
            if stream is not None:
                self.stop(sid, stream, StreamResetCode.CANCELLED)
        request.open_data_streams.clear()
        self._session._close_request(request)

    def flush_held_for_alias(self, alias: int, out: list[ev.MoqtEvent]) -> None:
        request = self.aliases[alias]
        for sid, stream in list(self.streams.items()):
            if stream.request is not None or stream.header is None or stream.header.track_alias != alias:
                continue
            if stream.discard:
                continue
            stream.request = request
            request.open_data_streams.add(sid)
            held, stream.held, stream.held_bytes = stream.held, [], 0
            ended = False
            for item in held:
                if item is None:
                    ended = True
                else:
                    self._deliver_item(sid, stream, item, out)
            if ended:
                self.streams.pop(sid, None)
                self._end_incoming(sid, stream, out)

    def on_datagram(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        datagram = self._dialect.decode_datagram(data)
        if datagram is None:
            return
        request = self.aliases.get(datagram.track_alias)
        if request is None or request.closed:
            return  # section 11.3: an unknown alias MAY be dropped
        priority = datagram.publisher_priority
        out.append(
            ev.ObjectReceived(
                request.request_id,
                datagram.track_alias,
                datagram.group_id,
                None,
                datagram.object_id,
                request.default_priority if priority is None else priority,
                ObjectStatus.NORMAL if datagram.status is None else datagram.status,
                datagram.payload,
                datagram.properties,
                None,
                datagram.end_of_group,
            )
        )
