"""Writing objects: subgroup streams and datagrams of the subscriptions this endpoint
publishes, the fetch stream answering a peer's FETCH, object by object or payload piece
by piece, and the ends of those streams (FIN, reset, or the peer's STOP_SENDING). A part
the session owns (`DataSender`), given requests the session has checked; what it asks of
the session in return is `SendingHooks`."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar, cast

from .. import events as ev
from ..d18.data import ObjectDatagram, SubgroupHeader
from ..d18.messages import Fetch
from ..engine import QuicEngine
from ..errors import StreamClosed, StreamResetCode
from ..wire import DEFAULT_PUBLISHER_PRIORITY, ObjectStatus, Properties
from .dialect import Dialect
from .records import FetchObjectWriter, OutgoingDataStream, RequestState, RequestT, SubgroupObjectWriter

__all__ = ["DataSender", "SendingHooks"]

_RequestC = TypeVar("_RequestC", bound=RequestState, contravariant=True)


class SendingHooks(Protocol[_RequestC]):
    """What the sending part asks of its session: whether it is closed, and what the
    opening and the end of one of a request's data streams mean for the request."""

    @property
    def closed(self) -> bool: ...

    def _data_stream_opened(self, request: _RequestC) -> None: ...

    def _data_stream_stopped(self, request: _RequestC) -> None:
        """The peer sent STOP_SENDING for one of the request's data streams."""
        ...

    def _data_stream_reset(self, request: _RequestC) -> None: ...

    def _maybe_finish_fetch(self, request: _RequestC) -> None: ...

    def _forget_if_done(self, request: _RequestC) -> None: ...


class DataSender(Generic[RequestT]):
    """Outgoing data streams (`streams`, by stream ID) and datagrams."""

    def __init__(self, quic: QuicEngine, session: SendingHooks[RequestT], dialect: Dialect[RequestT]) -> None:
        self._quic = quic
        self._session = session
        self._dialect = dialect
        self.streams: dict[int, OutgoingDataStream[RequestT]] = {}

    def on_stop_sending(self, sid: int, error_code: int, out: list[ev.MoqtEvent]) -> bool:
        """STOP_SENDING for one of our data streams; False when `sid` is not one."""
        stream = self.streams.get(sid)
        if stream is None:
            return False
        stream.reset = True  # aioquic resets the stream on STOP_SENDING
        stream.request.open_data_streams.discard(sid)
        out.append(ev.DataStreamStopped(stream.request.request_id, sid, error_code))
        if stream.request.kind is Fetch:
            stream.request.fetch_stream_closed = True
        self._session._data_stream_stopped(stream.request)
        return True

    def open_stream(self, request: RequestT, writer: SubgroupObjectWriter | FetchObjectWriter) -> int:
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, writer.header_bytes())
        self.streams[sid] = OutgoingDataStream(request, writer)
        request.data_streams_opened += 1
        request.open_data_streams.add(sid)
        self._session._data_stream_opened(request)
        return sid

    def open_subgroup(self, request: RequestT, header: SubgroupHeader) -> int:
        """Open a subgroup stream of a subscription this endpoint publishes."""
        return self.open_stream(request, self._dialect.subgroup_writer(request, header))

    def outgoing(self, stream_id: int) -> OutgoingDataStream[RequestT]:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise StreamClosed(f"no open data stream {stream_id}")
        if stream.reset or stream.fin_sent or self._session.closed:
            raise StreamClosed(f"data stream {stream_id} is closed")
        return stream

    def send_data(
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
            self._finished(stream_id, stream)

    def new_object(self, stream_id: int, fetch: bool) -> OutgoingDataStream[RequestT]:
        stream = self.outgoing(stream_id)
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
        stream = self.new_object(stream_id, fetch=False)
        writer = cast(SubgroupObjectWriter, stream.writer)  # new_object() checked it is no fetch writer
        header = writer.object_header(object_id, payload_length, properties=properties)
        self.send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_payload(self, stream_id: int, data: bytes | bytearray | memoryview, *, end_stream: bool = False) -> None:
        """Write payload bytes of the object begun on this stream."""
        stream = self.outgoing(stream_id)
        if len(data) > stream.payload_remaining:
            raise ValueError(f"{len(data)} payload bytes but {stream.payload_remaining} announced")
        if end_stream and len(data) != stream.payload_remaining:
            raise ValueError("FIN inside an object")
        stream.payload_remaining -= len(data)
        self.send_data(stream, stream_id, data, end_stream)

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
        stream = self.new_object(stream_id, fetch=False)
        writer = cast(SubgroupObjectWriter, stream.writer)  # new_object() checked it is no fetch writer
        header = writer.object_header(object_id, 0, status=status)
        self.send_data(stream, stream_id, header, end_stream)

    def open_fetch_stream(self, request: RequestT) -> int:
        """Open the data stream answering a peer's FETCH."""
        return self.open_stream(request, self._dialect.fetch_writer(request))

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
        stream = self.new_object(stream_id, fetch=True)
        writer = cast(FetchObjectWriter, stream.writer)  # new_object() checked it is a fetch writer
        header = writer.object_header(
            group_id,
            object_id,
            payload_length,
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        self.send_data(stream, stream_id, header)
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
        stream = self.streams.get(stream_id)
        if stream is None or stream.fin_sent or stream.reset:
            return
        if stream.payload_remaining:
            raise ValueError(f"stream {stream_id} closed inside an object; reset it instead")
        try:
            self._quic.send_stream_data(stream_id, b"", end_stream=True)
        except (ValueError, RuntimeError, AssertionError):
            stream.reset = True
        self._finished(stream_id, stream)

    def reset_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return
        stream.reset = True
        stream.request.open_data_streams.discard(stream_id)
        try:
            self._quic.reset_stream(stream_id, error_code)
        except (ValueError, RuntimeError, AssertionError):
            pass
        self._session._data_stream_reset(stream.request)

    def _finished(self, stream_id: int, stream: OutgoingDataStream[RequestT]) -> None:
        stream.fin_sent = True
        self.streams.pop(stream_id, None)
        request = stream.request
        request.open_data_streams.discard(stream_id)
        if request.kind is Fetch:
            request.fetch_stream_closed = True
            self._session._maybe_finish_fetch(request)
        self._session._forget_if_done(request)

    def data_stream_request(self, stream_id: int) -> int | None:
        """Request ID an outgoing data stream serves, while it can still be written."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.reset or stream.fin_sent:
            return None
        return stream.request.request_id

    def send_datagram(self, request: RequestT, datagram: ObjectDatagram) -> None:
        """Send one object of a subscription this endpoint publishes as an OBJECT_DATAGRAM."""
        self._quic.send_datagram_frame(self._dialect.encode_datagram(request, datagram))
