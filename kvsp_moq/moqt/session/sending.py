"""Writing objects: subgroup streams and datagrams of the subscriptions this endpoint
publishes, the fetch stream answering a peer's FETCH, object by object or payload piece
by piece, and the ends of those streams (FIN, reset, or the peer's STOP_SENDING)."""

from __future__ import annotations

from typing import cast

from .. import events as ev
from ..d18.data import ObjectDatagram, SubgroupHeader
from ..d18.messages import Fetch, Subscribe
from ..errors import StreamClosed, StreamResetCode
from ..wire import DEFAULT_PUBLISHER_PRIORITY, ObjectStatus, Properties
from .core import SessionCore
from .records import FetchObjectWriter, OutgoingDataStream, RequestT, SubgroupObjectWriter

__all__ = ["DataSending"]


class DataSending(SessionCore[RequestT]):
    """Outgoing data streams (`_outgoing_data`) and datagrams."""

    def _on_data_stream_stopped(self, sid: int, error_code: int, out: list[ev.MoqtEvent]) -> bool:
        """STOP_SENDING for one of our data streams; False when `sid` is not one."""
        stream = self._outgoing_data.get(sid)
        if stream is None:
            return False
        stream.reset = True  # aioquic resets the stream on STOP_SENDING
        stream.request.open_data_streams.discard(sid)
        out.append(ev.DataStreamStopped(stream.request.request_id, sid, error_code))
        if stream.request.kind is Fetch:
            stream.request.fetch_stream_closed = True
        return True

    def _publishing_request(self, request_id: int) -> RequestT:
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        if request.kind is Subscribe and not request.accepted:
            raise ValueError("objects are sent only after SUBSCRIBE_OK")
        return request

    def _open_data_stream(self, request: RequestT, writer: SubgroupObjectWriter | FetchObjectWriter) -> int:
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, writer.header_bytes())
        self._outgoing_data[sid] = OutgoingDataStream(request, writer)
        request.data_streams_opened += 1
        request.open_data_streams.add(sid)
        return sid

    def open_subgroup(
        self,
        request_id: int,
        group_id: int,
        subgroup_id: int = 0,
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        end_of_group: bool = False,
        has_properties: bool = False,
        first_object: bool = True,
    ) -> int:
        """Open a subgroup stream for a subscription this endpoint publishes; returns
        the stream ID. `publisher_priority` None inherits the track's default."""
        request = self._publishing_request(request_id)
        alias = request.track_alias
        assert alias is not None  # set by subscribe_ok() or publish(), before any object
        header = SubgroupHeader(
            alias,
            group_id,
            subgroup_id,
            publisher_priority,
            has_properties,
            end_of_group,
            first_object,
        )
        return self._open_data_stream(request, self._dialect.subgroup_writer(request, header))

    def _outgoing(self, stream_id: int) -> OutgoingDataStream[RequestT]:
        stream = self._outgoing_data.get(stream_id)
        if stream is None:
            raise StreamClosed(f"no open data stream {stream_id}")
        if stream.reset or stream.fin_sent or self._closed:
            raise StreamClosed(f"data stream {stream_id} is closed")
        return stream

    def _send_data(
        self,
        stream: OutgoingDataStream[RequestT],
        stream_id: int,
        data: bytes | bytearray | memoryview,
        end_stream: bool = False,
    ) -> None:
        try:
            self._quic.send_stream_data(stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError, AssertionError) as exc:
            stream.reset = True
            raise StreamClosed(f"data stream {stream_id}: {exc}") from None
        if end_stream:
            self._data_stream_finished(stream_id, stream)

    def _new_object(self, stream_id: int, fetch: bool) -> OutgoingDataStream[RequestT]:
        stream = self._outgoing(stream_id)
        if isinstance(stream.writer, self._dialect.fetch_writer_type) != fetch:
            raise ValueError(f"stream {stream_id} is not a {'fetch' if fetch else 'subgroup'} stream")
        if stream.payload_remaining:
            raise ValueError(
                f"stream {stream_id}: the previous object has {stream.payload_remaining} payload bytes unwritten"
            )
        return stream

    def begin_object(
        self, stream_id: int, object_id: int, payload_length: int, *, properties: Properties = ()
    ) -> None:
        """Write the header of a Normal object on a subgroup stream; its payload
        follows with write_payload(), in as many pieces as the caller likes."""
        stream = self._new_object(stream_id, fetch=False)
        writer = cast(SubgroupObjectWriter, stream.writer)  # _new_object() checked it is no fetch writer
        header = writer.object_header(object_id, payload_length, properties=properties)
        self._send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_payload(self, stream_id: int, data: bytes | bytearray | memoryview, *, end_stream: bool = False) -> None:
        """Write payload bytes of the object begun on this stream."""
        stream = self._outgoing(stream_id)
        if len(data) > stream.payload_remaining:
            raise ValueError(f"{len(data)} payload bytes but {stream.payload_remaining} announced")
        if end_stream and len(data) != stream.payload_remaining:
            raise ValueError("FIN inside an object")
        stream.payload_remaining -= len(data)
        self._send_data(stream, stream_id, data, end_stream)

    def write_object(
        self,
        stream_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        """Write a whole Normal object on a subgroup stream (the payload is not copied here)."""
        self.begin_object(stream_id, object_id, len(payload), properties=properties)
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

    def write_object_status(
        self, stream_id: int, object_id: int, status: ObjectStatus, *, end_stream: bool = False
    ) -> None:
        """Write an object status (End of Group / End of Track, or an empty Normal object)."""
        stream = self._new_object(stream_id, fetch=False)
        writer = cast(SubgroupObjectWriter, stream.writer)  # _new_object() checked it is no fetch writer
        header = writer.object_header(object_id, 0, status=status)
        self._send_data(stream, stream_id, header, end_stream)

    def open_fetch_stream(self, request_id: int) -> int:
        """Open the data stream answering a peer's FETCH; returns the stream ID."""
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind is not Fetch:
            raise ValueError(f"request {request_id} is not a peer FETCH")
        if request.closed:
            raise StreamClosed(f"fetch {request_id} was cancelled")
        if request.data_streams_opened:
            raise ValueError("a FETCH is answered on one stream")
        return self._open_data_stream(request, self._dialect.fetch_writer(request))

    def begin_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> None:
        """Write the header of the next object of a FETCH response; the payload
        follows with write_payload(). `subgroup_id` None marks a Datagram object."""
        stream = self._new_object(stream_id, fetch=True)
        writer = cast(FetchObjectWriter, stream.writer)  # _new_object() checked it is a fetch writer
        header = writer.object_header(
            group_id,
            object_id,
            payload_length,
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        self._send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        self.begin_fetch_object(
            stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

    def close_data_stream(self, stream_id: int) -> None:
        """FIN a data stream: every object of it was written."""
        stream = self._outgoing_data.get(stream_id)
        if stream is None or stream.fin_sent or stream.reset:
            return
        if stream.payload_remaining:
            raise ValueError(f"stream {stream_id} closed inside an object; reset it instead")
        try:
            self._quic.send_stream_data(stream_id, b"", end_stream=True)
        except (ValueError, RuntimeError, AssertionError):
            stream.reset = True
        self._data_stream_finished(stream_id, stream)

    def reset_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        stream = self._outgoing_data.pop(stream_id, None)
        if stream is None:
            return
        stream.reset = True
        stream.request.open_data_streams.discard(stream_id)
        try:
            self._quic.reset_stream(stream_id, error_code)
        except (ValueError, RuntimeError, AssertionError):
            pass
        self._data_stream_reset(stream.request)

    def _data_stream_finished(self, stream_id: int, stream: OutgoingDataStream[RequestT]) -> None:
        stream.fin_sent = True
        self._outgoing_data.pop(stream_id, None)
        request = stream.request
        request.open_data_streams.discard(stream_id)
        if request.kind is Fetch:
            request.fetch_stream_closed = True
            self._maybe_finish_fetch(request)
        self._forget_if_done(request)

    def data_stream_request(self, stream_id: int) -> int | None:
        """Request ID an outgoing data stream serves, while it can still be written."""
        stream = self._outgoing_data.get(stream_id)
        if stream is None or stream.reset or stream.fin_sent:
            return None
        return stream.request.request_id

    def send_datagram(
        self,
        request_id: int,
        group_id: int,
        object_id: int,
        payload: bytes = b"",
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        status: ObjectStatus | None = None,
        properties: Properties = (),
        end_of_group: bool = False,
    ) -> None:
        """Send one object as an OBJECT_DATAGRAM (dropped by QUIC if it does not fit)."""
        request = self._publishing_request(request_id)
        alias = request.track_alias
        assert alias is not None  # set by subscribe_ok() or publish(), before any object
        datagram = ObjectDatagram(
            alias,
            group_id,
            object_id,
            payload,
            publisher_priority,
            status,
            properties,
            end_of_group,
        )
        self._quic.send_datagram_frame(self._dialect.encode_datagram(request, datagram))
