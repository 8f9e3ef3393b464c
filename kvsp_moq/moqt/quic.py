"""MOQT over raw QUIC with asyncio: the only module here that touches sockets.

`connect()` opens a client session to a ``moqt://host:port/path`` URL and `serve()`
accepts sessions. A server offers ALPN ``moqt-18`` (draft-18 section 3.1.2) and,
unless `QuicSettings.draft14_fallback` is off, ``moq-00`` after it (draft-14, whose
ALPN names no version); it picks the first of its own list that the client
offers, so draft-18 stays preferred. A client offers ``moqt-18`` only, unless
`connect(drafts=...)` says otherwise (``(18, 14)`` also reaches draft-14-only
servers, ``(14,)`` offers only ``moq-00``): a client of ours must not be moved to
the weaker draft just because a server lists it first. A `MoqtConnection` drives
one `MoqtSession` (``moqt-18``) or `MoqtSession14` (``moq-00``), chosen when ALPN
is negotiated, and offers an awaitable API on top of it:

* publisher side: `publish_namespace()`, `publish()`, and handlers for incoming
  SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, PUBLISH
  and SUBSCRIBE_TRACKS requests (`on_subscribe()`, `on_fetch()`, ...);
* subscriber side: `subscribe()` and `fetch()` return async iterators of
  `MoqtObject`; `Subscription.update()` sends REQUEST_UPDATE (filter, Forward
  State, priority, delivery timeouts); `track_status()`, `subscribe_namespace()`;
* the peer's REQUEST_UPDATEs reach `OutgoingSubscription.on_update` (else they
  are checked and accepted); delivery timeouts are enforced where objects are
  handed to QUIC (`SubgroupSender`, `OutgoingSubscription.send_datagram()`).

Backpressure, both ways:

* aioquic copies every write into its stream buffer at once. Writers here wait
  until the stream's unacknowledged bytes fall below `QuicSettings.stream_send_buffer`
  (and the connection's below `connection_send_buffer`) before writing more, and
  write large payloads in `write_chunk_size` pieces, so a slow peer bounds what a
  publisher holds.
* aioquic grants receive credit as soon as data arrives. The connection here grants
  MAX_STREAM_DATA / MAX_DATA only as the application consumes objects from its
  iterators, so a subscriber that reads slowly slows the publisher through QUIC flow
  control instead of buffering without bound.

A QUIC connection that is lost ends every iterator and pending call with
`SessionClosed`, never with a silent end of data.

On a draft-14 session (``moq-00``) the API is the same, but draft-14 has no wire
form for some of it (see session14.py), so these are lost or weakened:

* `Subscription.update()` sends SUBSCRIBE_UPDATE, which has no answer: it returns
  at once with no LARGEST_OBJECT / EXPIRES, a publisher cannot refuse it except by
  ending the subscription, and only FORWARD, SUBSCRIBER_PRIORITY,
  OBJECT_DELIVERY_TIMEOUT, tokens and an absolute start / end group can change
  (anything else raises NotSupported); only subscriptions can be updated;
* delivery timeouts: only OBJECT_DELIVERY_TIMEOUT travels (as DELIVERY_TIMEOUT);
  SUBGROUP_DELIVERY_TIMEOUT, RENDEZVOUS_TIMEOUT and the delivery-timeout Track
  Properties are not sent, so the peer enforces no subgroup deadline of ours;
* GOAWAY carries no timeout (it arrives as 0) and no Request ID; per-request
  GOAWAY, SUBSCRIBE_TRACKS, PUBLISH_BLOCKED and padding streams raise NotSupported;
* REQUEST_ERROR retry intervals and REQUEST_OK EXPIRES do not exist; error codes
  are renumbered to the closest draft-14 code (INTERNAL_ERROR when none);
* FETCH end-of-range markers are not written, and fetched objects that are not
  Normal produce no object;
* namespaces matched by a SUBSCRIBE_NAMESPACE travel as PUBLISH_NAMESPACE /
  PUBLISH_NAMESPACE_DONE; a peer's SUBSCRIBE_NAMESPACE, which in draft-14 also asks
  for a PUBLISH of every matching track, reaches both the ``subscribe_namespace``
  and the ``subscribe_tracks`` handler (the latter's answer sends nothing).

The negotiated draft is `MoqtConnection.draft`.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import ipaddress
import logging
import os
import socket
import ssl
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Iterable, TypeVar
from urllib.parse import urlsplit

import aioquic
from aioquic import tls
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import Buffer as QuicBuffer
from aioquic.buffer import size_uint_var
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    QuicConnection,
)
from aioquic.quic.congestion.base import create_congestion_control
from aioquic.quic.events import ConnectionTerminated, ProtocolNegotiated, QuicEvent
from aioquic.quic.packet import QuicFrameType, pull_quic_transport_parameters
from aioquic.quic.packet_builder import QuicDeliveryState
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.quic.stream import QuicStream, QuicStreamFrame, QuicStreamSender

from ..errors import SettingError
from . import draft14
from . import events as ev
from .certs import SelfSignedCertificate
from .data import DEFAULT_PUBLISHER_PRIORITY, ObjectStatus
from .errors import (
    DataStreamReset,
    DoesNotExist,
    InternalRequestError,
    InvalidRange,
    MoqtError,
    NotSupported,
    PublishDoneCode,
    PublishDoneError,
    RequestError,
    RequestErrorCode,
    SessionClosed,
    SessionCloseCode,
    StreamClosed,
    StreamResetCode,
    Uninterested,
    request_error_for,
)
from .messages import (
    AuthToken,
    FetchType,
    GroupOrder,
    Location,
    Parameters,
    Properties,
    Setup,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    namespace_of,
    property_value,
)
from .objects import MoqtObject
from .session import UNKNOWN_STREAM_COUNT, MoqtSession, alpn_for_draft
from .session14 import MoqtSession14

__all__ = [
    "QuicSettings",
    "LONG_FRAME_DATAGRAM_SIZE",
    "LOOPBACK_DATAGRAM_SIZE",
    "MoqtObject",
    "MoqtConnection",
    "MoqtServer",
    "Subscription",
    "FetchResult",
    "TrackStatusInfo",
    "NamespaceSubscription",
    "NamespaceUpdate",
    "PublishedNamespace",
    "OutgoingSubscription",
    "SubgroupSender",
    "FetchSender",
    "IncomingRequest",
    "IncomingSubscribe",
    "IncomingFetch",
    "IncomingTrackStatus",
    "IncomingPublishNamespace",
    "IncomingSubscribeNamespace",
    "IncomingPublish",
    "IncomingSubscribeTracks",
    "PublishBlocked",
    "TrackSubscriptions",
    "IncomingUpdate",
    "NamespaceRegistration",
    "NamespacePublisher",
    "SUPPORTED_DRAFTS",
    "alpn_of",
    "connect",
    "serve",
    "new_event_loop",
    "run",
]

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * 1024

T = TypeVar("T")
Handler = Callable[[Any], "Awaitable[None] | None"]

#: MOQT drafts this module can speak, most preferred first.
SUPPORTED_DRAFTS: tuple[int, ...] = (18, 14)


def alpn_of(draft: int) -> str:
    """The ALPN of a supported draft: "moqt-18", or "moq-00" for draft-14."""
    if draft not in SUPPORTED_DRAFTS:
        raise ValueError(f"unsupported MOQT draft {draft!r}; supported: {SUPPORTED_DRAFTS}")
    return draft14.ALPN if draft == 14 else alpn_for_draft(draft)


def _check_drafts(drafts: Iterable[int]) -> tuple[int, ...]:
    """The drafts as a tuple, each supported and listed once, at least one."""
    result = tuple(drafts)
    if not result:
        raise ValueError("no MOQT draft to offer")
    if len(set(result)) != len(result):
        raise ValueError(f"a draft is listed twice in {result}")
    for draft in result:
        alpn_of(draft)
    return result


# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------


@dataclass
class QuicSettings:
    """QUIC and buffering settings. The defaults are tuned for large objects over
    loopback (a 16 MiB FETCH of 32 objects between two processes on two cores:
    about 175-195 MB/s median with 32,000-byte datagrams, 115-130 MB/s with 16,384;
    through a relay, 60,000-byte datagrams spend about 30% less CPU than 32,000).

    max_datagram_size: UDP payload size; the default, 60000 (LOOPBACK_DATAGRAM_SIZE),
        is meant for loopback (and known jumbo-frame paths: there is no path MTU
        discovery). Use 1200-1452 on real networks (the KVSP_MOQT_DATAGRAM_SIZE
        environment variable sets the default of a whole process). aioquic 1.7 writes STREAM frame
        lengths as fixed 2-byte varints, so frames over 16,383 bytes are corrupt;
        above LONG_FRAME_DATAGRAM_SIZE (16384) connections use a fix for aioquic
        1.7.x (see _LongFrameConnection). Other aioquic releases refuse such sizes
        with ValueError, and their default is 16384. A peer's smaller
        max_udp_payload_size lowers it.
    congestion_control: "cubic" (or "reno").
    max_data / max_stream_data: receive windows (connection / stream). Credit is
        granted as the application consumes objects, so these bound what a slow
        subscriber buffers.
    socket_receive_buffer / socket_send_buffer: SO_RCVBUF / SO_SNDBUF of the UDP
        socket; bursts of large datagrams overflow the kernel defaults.
    stream_send_buffer / connection_send_buffer: unacknowledged bytes a writer may
        leave in aioquic before it waits.
    write_chunk_size: payloads are handed to aioquic in pieces of this size.
    max_streams: concurrent streams of each direction the peer may open.
    max_object_size: largest object accepted from the peer.
    use_uvloop: `run()` / `new_event_loop()` use uvloop when it is installed.
    draft14_fallback: a server also accepts draft-14 clients (ALPN "moq-00",
        offered after "moqt-18", so a client offering both gets draft-18). Off,
        a client offering only "moq-00" fails the TLS handshake (no common ALPN).
        Clients choose with `connect(drafts=...)`.
    """

    max_datagram_size: int = field(default_factory=lambda: _default_datagram_size())
    congestion_control: str = "cubic"
    max_data: int = 64 * MiB
    max_stream_data: int = 16 * MiB
    socket_receive_buffer: int = 4 * MiB
    socket_send_buffer: int = 4 * MiB
    idle_timeout: float = 30.0
    max_datagram_frame_size: int = 65536
    max_streams: int = 1024
    stream_send_buffer: int = 2 * MiB
    connection_send_buffer: int = 16 * MiB
    write_chunk_size: int = 256 * KiB
    max_object_size: int = 64 * MiB
    handshake_timeout: float = 10.0
    publish_done_grace: float = 2.0
    use_uvloop: bool = True
    draft14_fallback: bool = True

    def default_drafts(self, *, is_client: bool) -> tuple[int, ...]:
        """The drafts offered when none are given, most preferred first."""
        if is_client or not self.draft14_fallback:
            return (18,)
        return SUPPORTED_DRAFTS

    def quic_configuration(
        self, *, is_client: bool, drafts: Iterable[int] | None = None, **kwargs: Any
    ) -> QuicConfiguration:
        """The QUIC configuration, offering the ALPNs of `drafts` (default: `default_drafts()`)."""
        _check_datagram_size(self.max_datagram_size)
        offered = _check_drafts(self.default_drafts(is_client=is_client) if drafts is None else drafts)
        configuration = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[alpn_of(draft) for draft in offered],
            congestion_control_algorithm=self.congestion_control,
            idle_timeout=self.idle_timeout,
            max_data=self.max_data,
            max_stream_data=self.max_stream_data,
            max_datagram_size=self.max_datagram_size,
            max_datagram_frame_size=self.max_datagram_frame_size,
            **kwargs,
        )
        return configuration


def new_event_loop(settings: QuicSettings | None = None) -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed (and allowed), else asyncio's."""
    if settings is None or settings.use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is optional
            pass
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, settings: QuicSettings | None = None) -> T:
    """asyncio.run() on the loop new_event_loop() chooses."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(settings)) as runner:
        return runner.run(main)


# ---------------------------------------------------------------------------
# Flow control granted on consumption
# ---------------------------------------------------------------------------


#: The chunked sender replaces methods of aioquic 1.7's QuicStreamSender (read from 1.7.2).
_CHUNKED_SENDER_SUPPORTED = aioquic.__version__.startswith("1.7.")


class _ChunkedStreamSender(QuicStreamSender):
    """QuicStreamSender that keeps the bytes written as the writer's own immutable chunks.

    aioquic appends every write to one bytearray, which CPython copies whole again each time
    it grows past its allocation or shrinks below half of it after an ACK, and copies every
    frame twice on the way out of it. With MiB-sized stream buffers that is several copies
    of each byte; here the written bytes are not copied at all, and a frame is copied once
    out of them. Offsets, ranges and the FIN are aioquic's own (`_buffer_start`, `_buffer_stop`,
    `_pending`, `_acked`); only the storage differs.
    """

    _chunks: list[bytes | memoryview | None]
    _starts: list[int]
    _head: int

    def _init_chunks(self) -> None:
        self._chunks = []
        self._starts = []
        self._head = 0

    def write(self, data: bytes, end_stream: bool = False) -> None:
        if self._buffer_fin is not None:
            raise RuntimeError("Cannot send data after FIN")
        if self._reset_error_code is not None:
            raise RuntimeError("Cannot send data after the stream was reset")
        size = len(data)
        if size:
            chunk: bytes | memoryview
            if type(data) is bytes:
                chunk = data
            elif type(data) is memoryview and type(data.obj) is bytes and data.contiguous and data.itemsize == 1:
                chunk = data  # a view of immutable bytes: safe to keep until acknowledged
            else:
                chunk = bytes(data)  # the writer may change or release its buffer
                size = len(chunk)
            self.buffer_is_empty = False
            self._pending.add(self._buffer_stop, self._buffer_stop + size)
            self._chunks.append(chunk)
            self._starts.append(self._buffer_stop)
            self._buffer_stop += size
        if end_stream:
            self.buffer_is_empty = False
            self._buffer_fin = self._buffer_stop
            self._pending_eof = True

    def _data(self, start: int, stop: int) -> bytes:
        """The bytes at [start, stop), copied once (aioquic's Buffer takes only bytes)."""
        chunks, starts = self._chunks, self._starts
        i = bisect.bisect_right(starts, start, self._head) - 1
        chunk = chunks[i]
        assert chunk is not None
        offset = start - starts[i]
        if offset + (stop - start) <= len(chunk):
            if offset == 0 and stop - start == len(chunk) and type(chunk) is bytes:
                return chunk
            return bytes(memoryview(chunk)[offset : offset + (stop - start)])
        parts = []
        while start < stop:
            chunk = chunks[i]
            assert chunk is not None
            offset = start - starts[i]
            piece = memoryview(chunk)[offset : offset + (stop - start)]
            parts.append(piece)
            start += len(piece)
            i += 1
        return b"".join(parts)

    def get_frame(self, max_size: int, max_offset: int | None = None) -> QuicStreamFrame | None:
        # aioquic 1.7.2's, reading the data from the chunks.
        assert self._reset_error_code is None, "cannot call get_frame() after reset()"
        if max_size < 0:
            return None
        try:
            r = self._pending[0]
        except IndexError:
            if self._pending_eof:
                self._pending_eof = False
                return QuicStreamFrame(fin=True, offset=self._buffer_fin)
            self.buffer_is_empty = True
            return None
        start = r.start
        stop = min(r.stop, start + max_size)
        if max_offset is not None and stop > max_offset:
            stop = max_offset
        if stop <= start:
            return None
        frame = QuicStreamFrame(data=self._data(start, stop), offset=start)
        self._pending.subtract(start, stop)
        if stop > self.highest_offset:
            self.highest_offset = stop
        if self._buffer_fin == stop:
            frame.fin = True
            self._pending_eof = False
        return frame

    def on_data_delivery(self, delivery: QuicDeliveryState, start: int, stop: int, fin: bool) -> None:
        # aioquic 1.7.2's, dropping acknowledged chunks instead of bytearray bytes.
        assert not fin or stop == self._buffer_fin, "on_data_delivered() was called with inconsistent fin / stop"
        if self._reset_error_code is not None:
            return
        if delivery == QuicDeliveryState.ACKED:
            if stop > start:
                self._acked.add(start, stop)
                first_range = self._acked[0]
                if first_range.start == self._buffer_start:
                    self._acked.shift()
                    self._buffer_start = first_range.stop
                    self._drop_acknowledged()
            if fin:
                self._acked_fin = True
            if self._buffer_start == self._buffer_fin and self._acked_fin:
                self.is_finished = True
        else:
            if stop > start:
                self.buffer_is_empty = False
                self._pending.add(start, stop)
            if fin:
                self.buffer_is_empty = False
                self._pending_eof = True

    def _drop_acknowledged(self) -> None:
        chunks, starts, head = self._chunks, self._starts, self._head
        acknowledged = self._buffer_start
        count = len(chunks)
        while head < count and starts[head] + len(chunks[head]) <= acknowledged:  # type: ignore[arg-type]
            chunks[head] = None
            head += 1
        if head >= 64 and head * 2 >= count:
            del chunks[:head]
            del starts[:head]
            head = 0
        self._head = head


def _chunked(stream: QuicStream) -> QuicStream:
    """Give a stream aioquic just made the chunked sender (it has written nothing yet);
    only on the aioquic releases whose sender it was written against."""
    sender = stream.sender
    if (
        type(sender) is QuicStreamSender
        and _CHUNKED_SENDER_SUPPORTED
        and sender._buffer_stop == 0
        and not sender._buffer
    ):
        sender.__class__ = _ChunkedStreamSender
        sender._init_chunks()  # type: ignore[attr-defined]
    return stream


class _ConsumptionWindowConnection(QuicConnection):
    """QuicConnection that extends receive credit only for consumed bytes, and
    that keeps its datagrams within the peer's max_udp_payload_size.

    aioquic doubles a window whenever half of it was received; here the window
    is "bytes handed to the application and consumed, plus the configured window".
    `hold()` marks bytes delivered but not yet consumed, `release()` consumes them.

    aioquic also ignores the peer's max_udp_payload_size transport parameter, so
    16 KiB datagrams would be dropped by a peer that accepts ~1500 bytes (picoquic,
    hence aiomoqt); the packet size, pacer and congestion controller are lowered to
    what the peer accepts.
    """

    stream_window: int
    connection_window: int
    held_by_stream: dict[int, int]
    held_total: int

    def _init_consumption_window(self, stream_window: int, connection_window: int) -> None:
        self.stream_window = stream_window
        self.connection_window = connection_window
        self.held_by_stream = {}
        self.held_total = 0
        self.output_pending = False

    # aioquic writes an ACK only once its delay (1 ms) has passed, even into a packet it
    # sends anyway, and then sends it alone: a request answered at once cost the peer an
    # extra datagram (and a wake-up) per exchange. When frames of ours are queued, a
    # pending ACK rides along in their packet instead (RFC 9000 section 13.2.1 allows
    # any 1-RTT packet to carry one).

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        # A stream still in _streams is neither new nor discarded: of aioquic's checks
        # (_get_or_create_stream_for_send) only "may we send on it" applies. A relay makes
        # two writes per object, so the shorter path counts.
        stream = self._streams.get(stream_id)
        if stream is not None and self._stream_can_send(stream_id):
            stream.sender.write(data, end_stream=end_stream)
        else:
            super().send_stream_data(stream_id, data, end_stream)
        self.output_pending = True

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        super().reset_stream(stream_id, error_code)
        self.output_pending = True

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        super().stop_stream(stream_id, error_code)
        self.output_pending = True

    def send_datagram_frame(self, data: bytes) -> None:
        super().send_datagram_frame(data)
        self.output_pending = True

    def _write_application(self, builder, network_path, now: float) -> None:  # type: ignore[no-untyped-def]
        if self.output_pending:
            self.output_pending = False
            space = self._spaces.get(tls.Epoch.ONE_RTT)
            if space is not None and space.ack_at is not None and space.ack_at > now:
                space.ack_at = now
        super()._write_application(builder, network_path, now)

    def hold(self, stream_id: int, size: int) -> None:
        self.held_by_stream[stream_id] = self.held_by_stream.get(stream_id, 0) + size
        self.held_total += size

    def release(self, stream_id: int, size: int) -> bool:
        """Consume held bytes; True when that frees credit worth announcing now."""
        left = self.held_by_stream.get(stream_id, 0) - size
        if left > 0:
            self.held_by_stream[stream_id] = left
        else:
            self.held_by_stream.pop(stream_id, None)
        self.held_total -= size
        return self.credit_due(stream_id)

    def credit_due(self, stream_id: int) -> bool:
        """Whether the next packet would raise MAX_DATA or the stream's MAX_STREAM_DATA
        (the thresholds of _write_connection_limits / _write_stream_limits): consuming
        an object only needs a transmit then; below them it would build an empty one."""
        max_data = self._local_max_data
        if max_data.used - self.held_total + self.connection_window > max_data.value + self.connection_window // 8:
            return True
        stream = self._streams.get(stream_id)
        if stream is None or not stream.max_stream_data_local:
            return False
        wanted = stream.receiver.starting_offset() - self.held_by_stream.get(stream_id, 0) + self.stream_window
        return wanted > stream.max_stream_data_local + self.stream_window // 8

    def _get_or_create_stream(self, frame_type: int, stream_id: int) -> QuicStream:
        return _chunked(super()._get_or_create_stream(frame_type, stream_id))

    def _get_or_create_stream_for_send(self, stream_id: int) -> QuicStream:
        return _chunked(super()._get_or_create_stream_for_send(stream_id))

    def _parse_transport_parameters(self, data: bytes, from_session_ticket: bool = False) -> None:
        super()._parse_transport_parameters(data, from_session_ticket)
        try:
            parameters = pull_quic_transport_parameters(QuicBuffer(data=data))
        except ValueError:
            return
        limit = parameters.max_udp_payload_size
        if limit is not None and limit < self._max_datagram_size:
            self._lower_max_datagram_size(limit)

    def _lower_max_datagram_size(self, size: int) -> None:
        self._max_datagram_size = size
        recovery = self._loss
        in_flight = recovery._cc.bytes_in_flight
        recovery._cc = create_congestion_control(
            self._configuration.congestion_control_algorithm, max_datagram_size=size
        )
        recovery._cc.bytes_in_flight = in_flight
        recovery._pacer = QuicPacketPacer(max_datagram_size=size)

    def _write_connection_limits(self, builder, space) -> None:  # type: ignore[no-untyped-def]
        max_data = self._local_max_data
        wanted = max_data.used - self.held_total + self.connection_window
        if wanted > max_data.value + self.connection_window // 8:
            max_data.value = wanted
        for limit in (self._local_max_data, self._local_max_streams_bidi, self._local_max_streams_uni):
            if limit is not max_data and limit.sent - limit.used >= limit.value - limit.sent:
                continue
            if limit.value != limit.sent:
                buf = builder.start_frame(
                    limit.frame_type,
                    capacity=CONNECTION_LIMIT_FRAME_CAPACITY,
                    handler=self._on_connection_limit_delivery,
                    handler_args=(limit,),
                )
                buf.push_uint_var(limit.value)
                limit.sent = limit.value

    def _write_stream_limits(self, builder, space, stream) -> None:  # type: ignore[no-untyped-def]
        if stream.max_stream_data_local:
            wanted = (
                stream.receiver.starting_offset()
                - self.held_by_stream.get(stream.stream_id, 0)
                + self.stream_window
            )
            if wanted > stream.max_stream_data_local + self.stream_window // 8:
                stream.max_stream_data_local = wanted
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local


# ---------------------------------------------------------------------------
# STREAM frames longer than 16,383 bytes (aioquic 1.7)
# ---------------------------------------------------------------------------

# aioquic 1.7 writes the Length of a STREAM frame as a fixed 2-byte varint
# (`push_uint16(len(frame.data) | 0x4000)` in QuicConnection._write_stream_frame), so a
# frame of more than 16,383 data bytes is corrupt: the peer reads a wrong length and
# closes with FRAME_ENCODING_ERROR. A 1-RTT packet spends at least 19 bytes on its
# header, packet number and AEAD tag, and a STREAM frame at least 4 on its type, stream
# ID and length, so a datagram of up to this size never holds a frame of more than
# 16,383 data bytes; larger ones need the connection class below.
LONG_FRAME_DATAGRAM_SIZE = 16384
# Long header packets (INITIAL, HANDSHAKE) also write their Length as a 2-byte varint,
# so the CRYPTO data put in one stays well below it (an ACK frame, of at most
# MAX_ACK_RANGES ranges, and a PING share the packet).
_CRYPTO_FRAME_LIMIT = 12 * 1024
# Releases whose _write_stream_frame / _write_crypto_frame the overrides below replace
# (read from aioquic 1.7.2's quic/connection.py).
_PATCHED_AIOQUIC_SERIES = "1.7."
# Releases checked to write STREAM frame lengths as real varints themselves: no patch.
_VERIFIED_AIOQUIC_VERSIONS: frozenset[str] = frozenset()
#: The default max_datagram_size where long STREAM frames work (measured on loopback,
#: 16 MiB of 32 objects: ~1.5 times the throughput of 16,384-byte datagrams at 32,000;
#: holder -> relay -> client, ~30% less CPU per byte at 60,000 than at 32,000, since
#: aioquic's cost is mostly per packet). It stays below the largest UDP payload of a
#: 65,536-byte loopback MTU (65,507 bytes over IPv4, 65,488 over IPv6).
LOOPBACK_DATAGRAM_SIZE = 60000


def _long_frames_supported(version: str) -> bool | None:
    """True: aioquic writes long STREAM frames itself; False: the patch applies;
    None: neither is known for this release."""
    if version in _VERIFIED_AIOQUIC_VERSIONS:
        return True
    if version.startswith(_PATCHED_AIOQUIC_SERIES):
        return False
    return None


#: Sets the default max_datagram_size of every MOQT endpoint of a process (relay, holder,
#: agent, tools). The default suits loopback; across machines, the path's UDP payload size
#: (1,472 for a 1,500-byte MTU over IPv4, 1,452 over IPv6) avoids IP fragmentation.
DATAGRAM_SIZE_ENV = "KVSP_MOQT_DATAGRAM_SIZE"


def _default_datagram_size() -> int:
    text = os.environ.get(DATAGRAM_SIZE_ENV, "").strip()
    if text:
        try:
            size = int(text)
        except ValueError:
            raise SettingError(f"{DATAGRAM_SIZE_ENV}={text!r} is not a number of bytes") from None
        if not 1200 <= size <= 65507:
            raise SettingError(f"{DATAGRAM_SIZE_ENV}={size}: QUIC needs at least 1,200 bytes and "
                             f"UDP carries at most 65,507")
        return size
    if _long_frames_supported(aioquic.__version__) is None:
        return LONG_FRAME_DATAGRAM_SIZE
    return LOOPBACK_DATAGRAM_SIZE


def _check_datagram_size(max_datagram_size: int, version: str | None = None) -> bool:
    """Whether connections with this datagram size need the long-frame patch; raises
    ValueError when the installed aioquic is not known to handle the size."""
    if max_datagram_size <= LONG_FRAME_DATAGRAM_SIZE:
        return False
    version = aioquic.__version__ if version is None else version
    supported = _long_frames_supported(version)
    if supported is None:
        raise ValueError(
            f"max_datagram_size={max_datagram_size} needs STREAM frames of more than 16,383 bytes; "
            f"aioquic {version} is not verified to encode them (the length patch here is for "
            f"aioquic {_PATCHED_AIOQUIC_SERIES}x): use max_datagram_size <= {LONG_FRAME_DATAGRAM_SIZE}"
        )
    return not supported


class _LongFrameConnection(_ConsumptionWindowConnection):
    """_ConsumptionWindowConnection for datagrams above LONG_FRAME_DATAGRAM_SIZE on
    aioquic 1.7: STREAM frames carry their Length as a varint of its real size, and
    CRYPTO frames stay small enough for the 2-byte Length of long header packets.

    Both methods are aioquic 1.7.2's, changed only where said.
    """

    def _write_stream_frame(self, builder, space, stream, max_offset: int) -> int:  # type: ignore[no-untyped-def]
        sender = stream.sender
        # 1 byte of frame type and up to 4 of Length (a datagram is below 2**30 bytes);
        # aioquic reserves 2 for the Length.
        frame_overhead = (
            5
            + size_uint_var(stream.stream_id)
            + (size_uint_var(sender.next_offset) if sender.next_offset else 0)
        )
        previous_send_highest = sender.highest_offset
        frame = sender.get_frame(builder.remaining_flight_space - frame_overhead, max_offset)
        if frame is None:
            return 0
        frame_type = QuicFrameType.STREAM_BASE | 2  # length
        if frame.offset:
            frame_type |= 4
        if frame.fin:
            frame_type |= 1
        buf = builder.start_frame(
            frame_type,
            capacity=frame_overhead,
            handler=sender.on_data_delivery,
            handler_args=(frame.offset, frame.offset + len(frame.data), frame.fin),
        )
        buf.push_uint_var(stream.stream_id)
        if frame.offset:
            buf.push_uint_var(frame.offset)
        buf.push_uint_var(len(frame.data))  # aioquic: push_uint16(len(frame.data) | 0x4000)
        buf.push_bytes(frame.data)
        if self._quic_logger is not None:
            builder.quic_logger_frames.append(self._quic_logger.encode_stream_frame(frame, stream_id=stream.stream_id))
        return sender.highest_offset - previous_send_highest

    def _write_crypto_frame(self, builder, space, stream) -> bool:  # type: ignore[no-untyped-def]
        frame_overhead = 3 + size_uint_var(stream.sender.next_offset)
        room = min(builder.remaining_flight_space, _CRYPTO_FRAME_LIMIT)  # aioquic: no min()
        frame = stream.sender.get_frame(room - frame_overhead)
        if frame is None:
            return False
        buf = builder.start_frame(
            QuicFrameType.CRYPTO,
            capacity=frame_overhead,
            handler=stream.sender.on_data_delivery,
            handler_args=(frame.offset, frame.offset + len(frame.data), False),
        )
        buf.push_uint_var(frame.offset)
        buf.push_uint16(len(frame.data) | 0x4000)
        buf.push_bytes(frame.data)
        if self._quic_logger is not None:
            builder.quic_logger_frames.append(self._quic_logger.encode_crypto_frame(frame))
        return True


def _connection_class(settings: QuicSettings) -> type[_ConsumptionWindowConnection]:
    if _check_datagram_size(settings.max_datagram_size):
        return _LongFrameConnection
    return _ConsumptionWindowConnection


def _prepare_quic(quic: QuicConnection, settings: QuicSettings) -> _ConsumptionWindowConnection:
    """Give a QuicConnection (made by aioquic's server or by connect()) our receive
    windows and stream limits, before its transport parameters are sent; with
    datagrams above LONG_FRAME_DATAGRAM_SIZE, also the long-frame fix."""
    cls = _connection_class(settings)
    if type(quic) is not cls:
        quic.__class__ = cls
    assert isinstance(quic, _ConsumptionWindowConnection)
    quic._init_consumption_window(settings.max_stream_data, settings.max_data)
    for limit_name in ("_local_max_streams_bidi", "_local_max_streams_uni"):
        limit = getattr(quic, limit_name, None)
        if limit is not None and limit.sent == 0 and limit.used == 0:
            limit.value = settings.max_streams
    return quic


# ---------------------------------------------------------------------------
# Objects and iterators (subscriber side)
# ---------------------------------------------------------------------------


_END = object()


def _smaller_timeout(*values: int | None) -> int | None:
    """The smaller of the non-zero timeouts given (0 or None: no timeout)."""
    set_values = [v for v in values if v]
    return min(set_values) if set_values else None


def _expire_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen (its caller may have stopped waiting for it)."""
    if not future.cancelled():
        future.exception()


class _ObjectQueue:
    """Objects waiting for the application, with the flow-control bytes they hold."""

    def __init__(self, connection: "MoqtConnection") -> None:
        self._connection = connection
        self._items: deque[tuple[MoqtObject, int | None, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._ended = False

    def push(self, obj: MoqtObject, stream_id: int | None) -> None:
        held = len(obj.payload) if stream_id is not None else 0
        if held:
            self._connection._quic.hold(stream_id, held)  # type: ignore[attr-defined]
        self._items.append((obj, stream_id, held))
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        if self._ended or self._error is not None:
            return
        if error is not None:
            self._error = error
        else:
            self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: float | None = None) -> MoqtObject:
        """The next object; TimeoutError when none arrives within `timeout` seconds.

        The timeout is a timer on the waiter, armed only while waiting (asyncio.wait_for
        would start a task for every object)."""
        deadline: float | None = None
        while True:
            obj = self.pop_ready()
            if obj is not None:
                return obj
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            loop = self._connection._loop
            self._waiter = waiter = loop.create_future()
            timer = None
            if timeout is not None:
                if deadline is None:
                    deadline = loop.time() + timeout
                timer = loop.call_at(deadline, _expire_waiter, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def pop_ready(self) -> MoqtObject | None:
        """The next object when one is queued already, else None; never waits (an
        error or the end is left for get() to report)."""
        if not self._items:
            return None
        obj, stream_id, held = self._items.popleft()
        if held:
            self._connection._consumed(stream_id, held)  # type: ignore[arg-type]
        return obj

    def discard(self) -> None:
        """Drop queued objects, returning their flow-control credit."""
        while self._items:
            _, stream_id, held = self._items.popleft()
            if held:
                self._connection._consumed(stream_id, held)  # type: ignore[arg-type]


class Subscription:
    """A subscription this endpoint receives: iterate it for objects.

    Made by `MoqtConnection.subscribe()` (our SUBSCRIBE) or
    `IncomingPublish.accept()` (the peer's PUBLISH). Iteration ends after
    PUBLISH_DONE once the publisher's streams have ended; it raises
    PublishDoneError for an abnormal PUBLISH_DONE status or a cancellation by the
    publisher, DataStreamReset when a stream was reset, and SessionClosed when the
    connection is lost.
    """

    def __init__(self, connection: "MoqtConnection", request_id: int, namespace: TrackNamespace, track_name: bytes):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.track_name = track_name
        self.track_alias: int | None = None
        self.largest: Location | None = None
        self.expires: int | None = None
        self.track_properties: Properties = ()
        #: the subscription's parameters as the subscriber set them, with accepted updates
        self.parameters = Parameters()
        #: subgroup streams the publisher reset because their objects outlived a delivery timeout
        self.streams_timed_out = 0
        self.done: ev.PublishDoneReceived | None = None
        self._queue = _ObjectQueue(connection)
        self._streams_ended = 0
        self._open_streams: set[int] = set()
        self._grace: asyncio.TimerHandle | None = None
        self._finished = False

    def __aiter__(self) -> AsyncIterator[MoqtObject]:
        return self

    async def __anext__(self) -> MoqtObject:
        return await self._queue.get()

    async def unsubscribe(self) -> None:
        """Cancel the subscription (STOP_SENDING / reset of its request stream)."""
        self._finish(None, cancel=True)

    async def update(
        self,
        *,
        subscription_filter: SubscriptionFilter | None = None,
        forward: bool | None = None,
        subscriber_priority: int | None = None,
        object_delivery_timeout: int | None = None,
        subgroup_delivery_timeout: int | None = None,
        new_group_request: int | None = None,
        authorization: Any = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> Parameters:
        """REQUEST_UPDATE the subscription (draft-18 "Updating Subscriptions") and wait for the answer.

        Only what is given changes. Returns the REQUEST_UPDATE_OK parameters (its
        LARGEST_OBJECT tells what a widened filter may have missed, for a FETCH). A
        refused update raises its RequestError; the publisher then ends the
        subscription with PUBLISH_DONE UPDATE_FAILED, which ends iteration. On a
        draft-14 session the update (SUBSCRIBE_UPDATE) has no answer: this returns
        empty parameters at once, and a refusal shows only as that PUBLISH_DONE.
        """
        connection = self.connection
        if self._finished:
            raise StreamClosed(f"subscription {self.request_id} has ended")
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=_token_parameters(authorization),
                subscription_filter=subscription_filter,
                forward=forward,
                subscriber_priority=subscriber_priority,
                object_delivery_timeout=object_delivery_timeout,
                subgroup_delivery_timeout=subgroup_delivery_timeout,
                new_group_request=new_group_request,
            )
        session = connection._live_session()
        update_id = session.request_update(self.request_id, parameters)
        future = connection._begin(update_id)
        # draft-14's SUBSCRIBE_UPDATE has no answer: its session accepts it at once.
        connection._dispatch_released()
        try:
            accepted = await asyncio.wait_for(future, timeout)
        finally:
            connection._pending.pop(update_id, None)
        self.parameters = self.parameters.merged(parameters)
        if accepted.parameters.largest_object is not None:
            self.largest = accepted.parameters.largest_object
        if accepted.parameters.expires is not None:
            self.expires = accepted.parameters.expires
        return accepted.parameters

    async def aclose(self) -> None:
        """Stop iterating: cancel the subscription if it is live and return the
        flow-control credit of objects never consumed. Use it (or
        contextlib.aclosing) when leaving an `async for` early."""
        if self._finished:
            self._queue.discard()
        else:
            self._finish(None, cancel=True)

    def _accepted(self, event: ev.SubscribeAccepted) -> None:
        self.track_alias = event.track_alias
        self.largest = event.parameters.largest_object
        self.expires = event.parameters.expires
        self.track_properties = event.track_properties

    def _object(self, event: ev.ObjectReceived) -> None:
        if self._finished:
            return
        self._queue.push(
            MoqtObject(
                event.group_id,
                event.object_id,
                event.payload,
                event.subgroup_id,
                event.status,
                event.properties,
                event.publisher_priority,
            ),
            event.stream_id,
        )

    def _stream_opened(self, stream_id: int) -> None:
        self._open_streams.add(stream_id)

    def _stream_ended(self, event: ev.DataStreamEnded) -> None:
        if event.stream_id in self._open_streams:  # not already counted as stopped
            self._open_streams.discard(event.stream_id)
            self._streams_ended += 1
        if event.reset and event.error_code == StreamResetCode.DELIVERY_TIMEOUT:
            # Objects that outlived a delivery timeout are dropped, the
            # subscription goes on.
            self.streams_timed_out += 1
            self._check_complete()
            return
        if event.reset and not self._finished:
            self._finish(DataStreamReset(f"stream {event.stream_id} reset", error_code=event.error_code or 0))
            return
        self._check_complete()

    def _publish_done(self, event: ev.PublishDoneReceived) -> None:
        self.done = event
        if not self._check_complete():
            loop = self.connection._loop
            self._grace = loop.call_later(self.connection.settings.publish_done_grace, self._grace_expired)

    def _check_complete(self) -> bool:
        done = self.done
        session = self.connection.session
        if session is not None and self._open_streams:
            # Streams this endpoint stopped count as ended.
            stopped = {sid for sid in self._open_streams if not session.incoming_stream_open(sid)}
            self._open_streams -= stopped
            self._streams_ended += len(stopped)
        if done is None or self._finished or self._open_streams:
            return False
        # With an unknown Stream Count, late streams are awaited for the grace period.
        if done.stream_count == UNKNOWN_STREAM_COUNT or self._streams_ended < done.stream_count:
            return False
        self._complete()
        return True

    def _grace_expired(self) -> None:
        if not self._finished:
            self._complete()
            self.connection.session.release(self.request_id)  # type: ignore[union-attr]

    def _complete(self) -> None:
        done = self.done
        assert done is not None
        if done.status_code in (PublishDoneCode.TRACK_ENDED, PublishDoneCode.SUBSCRIPTION_ENDED):
            self._finish(None)
        else:
            self._finish(PublishDoneError(done.reason or "subscription ended", error_code=done.status_code))

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if self._finished:
            return
        self._finished = True
        connection = self.connection
        connection._subscriptions.pop(self.request_id, None)
        if cancel:
            self._queue.discard()
        # Objects already queued are still delivered, then the error is raised.
        if cancel or isinstance(error, (DataStreamReset, RequestError)):
            if connection.session is not None and not connection.session.closed:
                connection.session.cancel_request(self.request_id)
                connection._transmit_soon()
        self._queue.end(error)


class FetchResult:
    """The objects of one FETCH of ours: iterate it.

    Iteration ends when the publisher's fetch stream ends with a FIN; it raises
    DataStreamReset for a reset stream, the RequestError of a REQUEST_ERROR that
    arrives after FETCH_OK, and SessionClosed when the connection is lost.
    `ranges` collects the End of Range markers received.
    """

    def __init__(self, connection: "MoqtConnection", request_id: int):
        self.connection = connection
        self.request_id = request_id
        self.end_of_track = False
        self.end_location: Location | None = None
        self.track_properties: Properties = ()
        self.ranges: list[ev.FetchRangeReceived] = []
        self._queue = _ObjectQueue(connection)
        self._accepted = False
        self._stream_done = False
        self._finished = False

    def __aiter__(self) -> AsyncIterator[MoqtObject]:
        return self

    async def __anext__(self) -> MoqtObject:
        return await self._queue.get()

    def ready_object(self) -> MoqtObject | None:
        """The next object when it has arrived already, else None, without waiting:
        a reader drains what one datagram brought in one go, then awaits the rest."""
        return self._queue.pop_ready()

    async def next_object(self, timeout: float | None = None) -> MoqtObject | None:
        """The next object, None at the end of the response; TimeoutError when none
        arrives within `timeout` seconds (the response goes on: cancel it if unwanted)."""
        try:
            return await self._queue.get(timeout)
        except StopAsyncIteration:
            return None

    async def cancel(self) -> None:
        self._finish(None, cancel=True)

    async def aclose(self) -> None:
        """Stop iterating; see Subscription.aclose()."""
        self.close()

    def close(self) -> None:
        """aclose() for callers that cannot await (a callback): it never waits."""
        if self._finished:
            self._queue.discard()
        else:
            self._finish(None, cancel=True)

    def _on_accepted(self, event: ev.FetchAccepted) -> None:
        self._accepted = True
        self.end_of_track = event.end_of_track
        self.end_location = event.end_location
        self.track_properties = event.track_properties
        if self._stream_done:
            self._finish(None)

    def _object(self, event: ev.FetchObjectReceived) -> None:
        if self._finished:
            return
        self._queue.push(
            MoqtObject(
                event.group_id,
                event.object_id,
                event.payload,
                event.subgroup_id,
                ObjectStatus.NORMAL,
                event.properties,
                event.publisher_priority,
            ),
            event.stream_id,
        )

    def _stream_ended(self, event: ev.DataStreamEnded) -> None:
        if event.reset:
            self._finish(DataStreamReset(f"fetch stream {event.stream_id} reset", error_code=event.error_code or 0))
            return
        self._stream_done = True
        if self._accepted:
            self._finish(None)

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._finished:
            return
        self._finished = True
        connection = self.connection
        connection._fetches.pop(self.request_id, None)
        if cancel:
            self._queue.discard()
        if cancel or isinstance(error, (DataStreamReset, RequestError)):
            if connection.session is not None and not connection.session.closed:
                connection.session.cancel_request(self.request_id)
                connection._transmit_soon()
        self._queue.end(error)


@dataclass(frozen=True)
class TrackStatusInfo:
    """TRACK_STATUS_OK: the track's Largest Object (None: nothing published yet)."""

    largest: Location | None
    track_properties: Properties
    expires: int | None = None


@dataclass(frozen=True)
class NamespaceUpdate:
    """A NAMESPACE (active) or NAMESPACE_DONE (not active) for a full namespace."""

    namespace: TrackNamespace
    active: bool


class NamespaceSubscription:
    """Our SUBSCRIBE_NAMESPACE: iterate it for NamespaceUpdate items."""

    def __init__(self, connection: "MoqtConnection", request_id: int, prefix: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.prefix = prefix
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._finished = False

    def __aiter__(self) -> AsyncIterator[NamespaceUpdate]:
        return self

    async def __anext__(self) -> NamespaceUpdate:
        item = await self._items.get()
        if item is _END:
            self._items.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._items.put_nowait(item)
            raise item
        return item

    async def cancel(self) -> None:
        self._finish(None, cancel=True)

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._finished:
            return
        self._finished = True
        self.connection._namespace_subscriptions.pop(self.request_id, None)
        if cancel and self.connection.session is not None and not self.connection.session.closed:
            self.connection.session.cancel_request(self.request_id)
            self.connection._transmit_soon()
        self._items.put_nowait(error if error is not None else _END)


@dataclass(frozen=True)
class PublishBlocked:
    """PUBLISH_BLOCKED: the peer will not PUBLISH this track to our SUBSCRIBE_TRACKS."""

    namespace: TrackNamespace
    track_name: bytes


class TrackSubscriptions(NamespaceSubscription):
    """Our SUBSCRIBE_TRACKS: iterate it for the peer's PUBLISHes of tracks under the prefix
    (IncomingPublish: `accept()` returns the Subscription to read, or `reject()`) and for
    PublishBlocked notices. The PUBLISHes it covers come here, not to the "publish" handler;
    `cancel()` refuses those still queued."""

    def __aiter__(self) -> AsyncIterator["IncomingPublish | PublishBlocked"]:  # type: ignore[override]
        return self

    async def __anext__(self) -> "IncomingPublish | PublishBlocked":  # type: ignore[override]
        return await super().__anext__()  # type: ignore[return-value]

    def covers(self, namespace: TrackNamespace) -> bool:
        return tuple(namespace[:len(self.prefix)]) == tuple(self.prefix)

    async def cancel(self) -> None:
        while not self._items.empty():
            item = self._items.get_nowait()
            if isinstance(item, IncomingPublish) and not item.answered:
                try:
                    item.reject(Uninterested("SUBSCRIBE_TRACKS cancelled"))
                except (SessionClosed, StreamClosed):
                    pass
        await super().cancel()


_S = TypeVar("_S", bound=NamespaceSubscription)


class PublishedNamespace:
    """Our accepted PUBLISH_NAMESPACE; `withdraw()` cancels it."""

    def __init__(self, connection: "MoqtConnection", request_id: int, namespace: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.closed: asyncio.Future[int] = connection._loop.create_future()

    async def withdraw(self) -> None:
        if not self.closed.done():
            self.closed.set_result(StreamResetCode.CANCELLED)
        self.connection._announcements.pop(self.request_id, None)
        session = self.connection.session
        if session is not None and not session.closed:
            session.cancel_request(self.request_id)
            self.connection._transmit_soon()


# ---------------------------------------------------------------------------
# Publisher side
# ---------------------------------------------------------------------------


class SubgroupSender:
    """Writes the objects of one subgroup stream, waiting on backpressure.

    Delivery timeouts (draft-18 "Delivery Timeouts") of its subscription apply: an object
    whose first byte is older than OBJECT_DELIVERY_TIMEOUT when it would be handed
    to QUIC resets the stream with DELIVERY_TIMEOUT instead, and the subgroup sends
    nothing more (`timed_out`); after `close()`, a stream not fully acknowledged
    within SUBGROUP_DELIVERY_TIMEOUT is reset the same way.
    """

    def __init__(self, connection: "MoqtConnection", stream_id: int, subscription: "OutgoingSubscription | None" = None):
        self.connection = connection
        self.stream_id = stream_id
        self.subscription = subscription
        self.timed_out = False
        self.group_id = 0

    def _deadline(self, received_at: float | None) -> float | None:
        timeout = self.subscription.object_delivery_timeout if self.subscription is not None else None
        if not timeout:
            return None
        start = self.connection._loop.time() if received_at is None else received_at
        return start + timeout / 1000

    def _expire(self) -> None:
        if self.timed_out:
            return
        self.timed_out = True
        if self.subscription is not None:
            self.subscription.objects_timed_out += 1
        self.reset(StreamResetCode.DELIVERY_TIMEOUT)

    async def send(
        self,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        properties: Properties = (),
        received_at: float | None = None,
    ) -> bool:
        """Send a Normal object; returns once aioquic holds all of it.

        `received_at` is the event-loop time the object's first byte arrived (a
        relay's upstream); by default, now. While the subscription's Forward State is 0
        the object is held back (draft-18 "Subscriptions": no objects are sent then).
        Returns False, having reset the stream, when the object outlived the
        OBJECT_DELIVERY_TIMEOUT (or the stream already timed out).
        """
        if self.timed_out:
            return False
        connection = self.connection
        deadline = self._deadline(received_at)
        subscription = self.subscription
        if subscription is not None and not subscription.forward:
            await subscription.wait_forward()
        if not await connection._wait_writable_until(self.stream_id, deadline):
            self._expire()
            return False
        session = connection._live_session()
        session.begin_object(self.stream_id, object_id, len(payload), properties=properties)
        if not await connection._write_payload(self.stream_id, payload, deadline=deadline):
            self._expire()
            return False
        if self.subscription is not None:
            self.subscription._sent(Location(self.group_id, object_id))
        return True

    async def send_status(self, object_id: int, status: ObjectStatus) -> None:
        if self.timed_out:
            return
        connection = self.connection
        if self.subscription is not None and not self.subscription.forward:
            await self.subscription.wait_forward()
        await connection._wait_writable(self.stream_id)
        connection._live_session().write_object_status(self.stream_id, object_id, status)
        connection._transmit_soon()

    def close(self) -> None:
        """FIN the stream: the subgroup is complete."""
        session = self.connection.session
        if session is not None and not session.closed and not self.timed_out:
            session.close_data_stream(self.stream_id)
            self.connection._transmit_soon()
            timeout = self.subscription.subgroup_delivery_timeout if self.subscription is not None else None
            if timeout:
                self.connection._loop.call_later(timeout / 1000, self._subgroup_deadline)

    def _subgroup_deadline(self) -> None:
        """SUBGROUP_DELIVERY_TIMEOUT after the FIN: reset a stream QUIC has not fully delivered."""
        if self.connection._expire_stream(self.stream_id) and self.subscription is not None:
            self.timed_out = True
            self.subscription.objects_timed_out += 1

    def reset(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        session = self.connection.session
        if session is not None and not session.closed:
            session.reset_data_stream(self.stream_id, error_code)
            self.connection._transmit_soon()


class OutgoingSubscription:
    """A subscription this endpoint publishes (an accepted SUBSCRIBE, or our PUBLISH)."""

    def __init__(self, connection: "MoqtConnection", request_id: int, track_alias: int):
        self.connection = connection
        self.request_id = request_id
        self.track_alias = track_alias
        #: the subscriber's parameters (SUBSCRIBE or PUBLISH_OK), with accepted updates
        self.parameters = Parameters()
        #: the Track Properties this endpoint sent for the track
        self.track_properties: Properties = ()
        #: the largest Location sent or announced, for REQUEST_UPDATE_OK
        self.largest: Location | None = None
        #: objects and subgroups given up on a delivery timeout
        self.objects_timed_out = 0
        #: answers the subscriber's REQUEST_UPDATEs; without it they are checked and accepted
        self.on_update: Callable[["IncomingUpdate"], Any] | None = None
        self.cancelled: asyncio.Future[int] = connection._loop.create_future()
        self._done = False
        self._forward_waiters: list[asyncio.Future[None]] = []
        self.cancelled.add_done_callback(lambda _: self._wake_forward())

    @property
    def active(self) -> bool:
        return not self._done and not self.cancelled.done()

    @property
    def forward(self) -> bool:
        """The Forward State: objects are sent only while it is 1 (draft-18 "Subscriptions")."""
        return self.parameters.forward is not False

    async def wait_forward(self) -> None:
        """Wait until the Forward State is 1, since no object may be sent before; raises
        StreamClosed when the subscription ends first."""
        while not self.forward:
            if self.connection._error is not None:
                raise self.connection._error
            if not self.active:
                raise StreamClosed("the subscription ended while its Forward State was 0")
            waiter: asyncio.Future[None] = self.connection._loop.create_future()
            self._forward_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._forward_waiters:
                    self._forward_waiters.remove(waiter)

    def _wake_forward(self) -> None:
        waiters, self._forward_waiters = self._forward_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def object_delivery_timeout(self) -> int | None:
        """OBJECT_DELIVERY_TIMEOUT in force, ms: the smaller non-zero of the
        subscriber's parameter and our Track Property (draft-18 "Delivery Timeouts")."""
        return _smaller_timeout(
            self.parameters.object_delivery_timeout,
            property_value(self.track_properties, TrackPropertyType.OBJECT_DELIVERY_TIMEOUT),
        )

    @property
    def subgroup_delivery_timeout(self) -> int | None:
        """SUBGROUP_DELIVERY_TIMEOUT in force, ms (as object_delivery_timeout)."""
        return _smaller_timeout(
            self.parameters.subgroup_delivery_timeout,
            property_value(self.track_properties, TrackPropertyType.SUBGROUP_DELIVERY_TIMEOUT),
        )

    def _sent(self, location: Location) -> None:
        if self.largest is None or location > self.largest:
            self.largest = location

    def check_update(self, parameters: Parameters) -> None:
        """Refuse an update this publisher cannot satisfy: a filter whose End Group
        was already published (INVALID_RANGE, draft-18 "Subscription Filters")."""
        subscription_filter = parameters.subscription_filter
        if subscription_filter is None or subscription_filter.end_group is None or self.largest is None:
            return
        if subscription_filter.end_group < self.largest.group:
            raise InvalidRange("the filter's end group has already been published")

    def _apply_update(self, parameters: Parameters) -> None:
        self.parameters = self.parameters.merged(parameters)
        if self.forward:
            self._wake_forward()

    def _update_failed(self) -> None:
        """A refused update ended the subscription with PUBLISH_DONE UPDATE_FAILED."""
        self._done = True
        self.connection._outgoing.pop(self.request_id, None)
        if not self.cancelled.done():
            self.cancelled.set_result(PublishDoneCode.UPDATE_FAILED)
        self._wake_forward()
        self.connection._wake_writers()

    def open_subgroup(
        self,
        group_id: int,
        subgroup_id: int = 0,
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        end_of_group: bool = False,
        has_properties: bool = False,
        first_object: bool = True,
    ) -> SubgroupSender:
        connection = self.connection
        if self.cancelled.done():
            raise StreamClosed("subscription cancelled by the subscriber")
        stream_id = connection._live_session().open_subgroup(
            self.request_id,
            group_id,
            subgroup_id,
            publisher_priority=publisher_priority,
            end_of_group=end_of_group,
            has_properties=has_properties,
            first_object=first_object,
        )
        connection._writing.add(stream_id)
        connection._transmit_soon()
        sender = SubgroupSender(connection, stream_id, self)
        sender.group_id = group_id
        return sender

    def send_datagram(
        self, group_id: int, object_id: int, payload: bytes, *, received_at: float | None = None, **kwargs: Any
    ) -> bool:
        """Send an object as a datagram; False when it was dropped: it outlived a delivery
        timeout (for datagrams, the smaller of both applies), or the Forward State is 0."""
        if not self.forward:
            return False
        timeout = _smaller_timeout(self.object_delivery_timeout, self.subgroup_delivery_timeout)
        if timeout and received_at is not None and self.connection._loop.time() - received_at > timeout / 1000:
            self.objects_timed_out += 1
            return False
        self.connection._live_session().send_datagram(self.request_id, group_id, object_id, payload, **kwargs)
        self._sent(Location(group_id, object_id))
        self.connection._transmit_soon()
        return True

    async def finish(self, status_code: int = PublishDoneCode.TRACK_ENDED, reason: str = "") -> None:
        """Send PUBLISH_DONE (after closing the open subgroup streams)."""
        if self._done or self.cancelled.done():
            return
        self._done = True
        self._wake_forward()
        self.connection._outgoing.pop(self.request_id, None)
        session = self.connection.session
        if session is not None and not session.closed:
            try:
                session.publish_done(self.request_id, status_code, reason)
            except StreamClosed:
                pass
            self.connection._transmit_soon()

    def _on_cancelled(self, error_code: int) -> None:
        if not self.cancelled.done():
            self.cancelled.set_result(error_code)
        self.connection._outgoing.pop(self.request_id, None)
        self.connection._wake_writers()


class FetchSender:
    """Writes the objects of one FETCH response stream."""

    def __init__(self, connection: "MoqtConnection", request_id: int, stream_id: int):
        self.connection = connection
        self.request_id = request_id
        self.stream_id = stream_id
        self.cancelled: asyncio.Future[int] = connection._loop.create_future()

    async def send(
        self,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> None:
        if self.send_now(group_id, object_id, payload, subgroup_id=subgroup_id,
                         publisher_priority=publisher_priority, properties=properties):
            return
        connection = self.connection
        session = connection._live_session()
        await connection._wait_writable(self.stream_id)
        session.begin_fetch_object(
            self.stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        await connection._write_payload(self.stream_id, payload)

    def send_now(
        self,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> bool:
        """Write the object if that needs no wait: True with it written when the stream
        is writable now and the payload fits one write chunk; False, with nothing
        written, when it must wait (send() tries this first, then waits)."""
        connection = self.connection
        session = connection._live_session()
        stream_id = self.stream_id
        if len(payload) > connection.settings.write_chunk_size or not connection._writable(stream_id):
            return False
        if session.data_stream_request(stream_id) is None:
            raise StreamClosed(f"data stream {stream_id} is closed")
        session.begin_fetch_object(
            stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        if payload:
            session.write_payload(stream_id, payload)
        connection._transmit_soon()
        return True

    async def end_of_range(self, group_id: int, object_id: int, *, unknown: bool = False) -> None:
        connection = self.connection
        await connection._wait_writable(self.stream_id)
        connection._live_session().write_fetch_end_of_range(self.stream_id, group_id, object_id, unknown=unknown)
        connection._transmit_soon()

    def close(self) -> None:
        """FIN the stream: every object of the range was sent."""
        self._forget()
        session = self.connection.session
        if session is not None and not session.closed:
            session.close_data_stream(self.stream_id)
            self.connection._transmit_soon()

    def reset(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        self._forget()
        session = self.connection.session
        if session is not None and not session.closed:
            session.reset_data_stream(self.stream_id, error_code)
            self.connection._transmit_soon()

    def _forget(self) -> None:
        # Done writing: nothing can cancel or update it any more. A session that serves
        # FETCHes for days would otherwise keep one sender per FETCH it ever answered.
        senders = self.connection._fetch_senders
        if senders.get(self.request_id) is self:
            del senders[self.request_id]


class NamespaceRegistration:
    """A peer's accepted PUBLISH_NAMESPACE; `closed` resolves when it is withdrawn."""

    def __init__(self, connection: "MoqtConnection", request_id: int, namespace: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.closed: asyncio.Future[int] = connection._loop.create_future()

    def revoke(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Revoke the acceptance (cancel the peer's request)."""
        self._on_cancelled(error_code)
        session = self.connection.session
        if session is not None and not session.closed:
            session.cancel_request(self.request_id, error_code)
            self.connection._transmit_soon()

    def _on_cancelled(self, error_code: int) -> None:
        if not self.closed.done():
            self.closed.set_result(error_code)
        self.connection._registrations.pop(self.request_id, None)


class NamespacePublisher:
    """The answer side of a peer's accepted SUBSCRIBE_NAMESPACE or SUBSCRIBE_TRACKS."""

    def __init__(self, connection: "MoqtConnection", request_id: int, prefix: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.prefix = prefix
        self.closed: asyncio.Future[int] = connection._loop.create_future()

    def announce(self, namespace: TrackNamespace) -> None:
        """Send NAMESPACE for a full namespace under the prefix."""
        self.connection._live_session().namespace(self.request_id, self._suffix(namespace))
        self.connection._transmit_soon()

    def withdraw(self, namespace: TrackNamespace) -> None:
        self.connection._live_session().namespace_done(self.request_id, self._suffix(namespace))
        self.connection._transmit_soon()

    def publish_blocked(self, namespace: TrackNamespace, track_name: bytes | str) -> None:
        """PUBLISH_BLOCKED (SUBSCRIBE_TRACKS): this track will not be PUBLISHed here; the
        subscriber may SUBSCRIBE to it instead."""
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        self.connection._live_session().publish_blocked(self.request_id, self._suffix(namespace), name)
        self.connection._transmit_soon()

    def _suffix(self, namespace: TrackNamespace) -> TrackNamespace:
        namespace = namespace_of(namespace)
        if namespace[: len(self.prefix)] != self.prefix:
            raise ValueError(f"{namespace} is not under {self.prefix}")
        return namespace[len(self.prefix) :]

    def _on_cancelled(self, error_code: int) -> None:
        if not self.closed.done():
            self.closed.set_result(error_code)
        self.connection._registrations.pop(self.request_id, None)


class IncomingRequest:
    """A request from the peer, handed to a handler; answer it exactly once."""

    default_error: type[RequestError] = DoesNotExist

    def __init__(self, connection: "MoqtConnection", event: Any):
        self.connection = connection
        self.event = event
        self.request_id: int = event.request_id
        self.parameters: Parameters = event.parameters
        self.authorization_tokens: tuple[AuthToken, ...] = event.authorization_tokens
        self.answered = False

    @property
    def authorization(self) -> list[bytes]:
        """The token values sent with the request."""
        return [t.value or b"" for t in self.authorization_tokens]

    def reject(
        self,
        error: RequestError | int = RequestErrorCode.DOES_NOT_EXIST,
        reason: str = "",
        *,
        retry_interval: int = 0,
    ) -> None:
        if self.answered:
            return
        self.answered = True
        self.connection._unanswered.discard(self.request_id)
        self.connection._held_updates.pop(self.request_id, None)
        if isinstance(error, RequestError):
            code, reason, retry_interval = int(error.error_code), reason or error.reason, error.retry_interval
        else:
            code = int(error)
        session = self.connection.session
        if session is None or session.closed:
            return
        try:
            session.request_error(self.request_id, code, reason, retry_interval=retry_interval)
        except StreamClosed:
            return
        self.connection._transmit_soon()

    def _answer(self) -> MoqtSession | MoqtSession14:
        if self.answered:
            raise ValueError(f"request {self.request_id} was already answered")
        self.answered = True
        self.connection._unanswered.discard(self.request_id)
        session = self.connection._live_session()
        if self.request_id in self.connection._held_updates:
            # REQUEST_UPDATEs that arrived while the request was pending follow the answer.
            self.connection._loop.call_soon(self.connection._release_updates, self.request_id)
        return session


class IncomingSubscribe(IncomingRequest):
    """A SUBSCRIBE from the peer."""

    def __init__(self, connection: "MoqtConnection", event: ev.SubscribeReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name

    @property
    def forward(self) -> bool:
        return self.parameters.forward is not False

    @property
    def subscription_filter(self) -> SubscriptionFilter | None:
        return self.parameters.subscription_filter

    def accept(
        self,
        *,
        largest: Location | tuple[int, int] | None = None,
        expires: int | None = None,
        track_properties: Properties = (),
        track_alias: int | None = None,
    ) -> OutgoingSubscription:
        """Send SUBSCRIBE_OK; `largest` is the Largest Object when objects exist."""
        session = self._answer()
        alias = session.subscribe_ok(
            self.request_id,
            track_alias=track_alias,
            largest=None if largest is None else Location(*largest),
            expires=expires,
            track_properties=track_properties,
        )
        outgoing = OutgoingSubscription(self.connection, self.request_id, alias)
        outgoing.parameters = self.parameters
        outgoing.track_properties = track_properties
        outgoing.largest = None if largest is None else Location(*largest)
        self.connection._outgoing[self.request_id] = outgoing
        # Joining FETCHes that waited for this SUBSCRIBE_OK go to the fetch handler now.
        self.connection._dispatch_released()
        self.connection._transmit_soon()
        return outgoing


class IncomingFetch(IncomingRequest):
    """A FETCH from the peer; a joining fetch arrives already resolved to a range."""

    def __init__(self, connection: "MoqtConnection", event: ev.FetchReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name
        self.fetch_type: FetchType = event.fetch_type
        self.start: Location = event.start
        self.end: Location = event.end
        self.joining_request_id = event.joining_request_id

    @property
    def group_order(self) -> GroupOrder:
        return self.parameters.group_order or GroupOrder.ASCENDING

    @property
    def last(self) -> Location | None:
        """Last Location requested, inclusive; None when the whole end group is wanted."""
        if self.end.object == 0:
            return None
        return Location(self.end.group, self.end.object - 1)

    def includes(self, location: Location | tuple[int, int]) -> bool:
        """Whether a Location lies in the requested range."""
        location = Location(*location)
        if location < self.start:
            return False
        if self.end.object == 0:
            return location.group <= self.end.group
        return location < self.end

    def accept(
        self,
        *,
        end: Location | tuple[int, int] | None = None,
        end_of_track: bool = False,
        track_properties: Properties = (),
    ) -> FetchSender:
        """Send FETCH_OK and open the response stream. `end` is the wire End
        Location of what will be sent (default: the requested end)."""
        session = self._answer()
        stream_id = session.open_fetch_stream(self.request_id)
        session.fetch_ok(
            self.request_id,
            self.end if end is None else Location(*end),
            end_of_track=end_of_track,
            track_properties=track_properties,
        )
        sender = FetchSender(self.connection, self.request_id, stream_id)
        self.connection._writing.add(stream_id)
        self.connection._fetch_senders[self.request_id] = sender
        self.connection._transmit_soon()
        return sender


class IncomingTrackStatus(IncomingRequest):
    def __init__(self, connection: "MoqtConnection", event: ev.TrackStatusReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name

    def accept(
        self, *, largest: Location | tuple[int, int] | None = None, track_properties: Properties = ()
    ) -> None:
        session = self._answer()
        parameters = Parameters(largest_object=None if largest is None else Location(*largest))
        session.request_ok(self.request_id, parameters, track_properties)
        self.connection._transmit_soon()


class IncomingPublishNamespace(IncomingRequest):
    default_error = Uninterested

    def __init__(self, connection: "MoqtConnection", event: ev.PublishNamespaceReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace

    def accept(self) -> NamespaceRegistration:
        session = self._answer()
        session.request_ok(self.request_id)
        registration = NamespaceRegistration(self.connection, self.request_id, self.namespace)
        self.connection._registrations[self.request_id] = registration
        self.connection._transmit_soon()
        return registration


class IncomingSubscribeNamespace(IncomingRequest):
    default_error = NotSupported

    def __init__(self, connection: "MoqtConnection", event: ev.SubscribeNamespaceReceived):
        super().__init__(connection, event)
        self.namespace_prefix = event.namespace_prefix

    def accept(self) -> NamespacePublisher:
        session = self._answer()
        session.request_ok(self.request_id)
        publisher = NamespacePublisher(self.connection, self.request_id, self.namespace_prefix)
        self.connection._registrations[self.request_id] = publisher
        self.connection._transmit_soon()
        return publisher


class IncomingSubscribeTracks(IncomingRequest):
    default_error = NotSupported

    def __init__(self, connection: "MoqtConnection", event: ev.SubscribeTracksReceived):
        super().__init__(connection, event)
        self.namespace_prefix = event.namespace_prefix

    def accept(self) -> NamespacePublisher:
        """Accept; then offer tracks with MoqtConnection.publish()."""
        session = self._answer()
        session.request_ok(self.request_id)
        publisher = NamespacePublisher(self.connection, self.request_id, self.namespace_prefix)
        self.connection._registrations[self.request_id] = publisher
        self.connection._transmit_soon()
        return publisher


class IncomingPublish(IncomingRequest):
    """A PUBLISH from the peer: accept() returns the Subscription to iterate."""

    default_error = Uninterested

    def __init__(self, connection: "MoqtConnection", event: ev.PublishReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name
        self.track_alias = event.track_alias
        self.track_properties = event.track_properties
        self.subscription = Subscription(connection, self.request_id, self.namespace, self.track_name)
        self.subscription.track_alias = event.track_alias
        self.subscription.largest = event.parameters.largest_object
        self.subscription.track_properties = event.track_properties
        # Objects may precede PUBLISH_OK; the subscription collects them from now.
        connection._subscriptions[self.request_id] = self.subscription

    def accept(self, *, forward: bool | None = None, parameters: Parameters | None = None) -> Subscription:
        session = self._answer()
        if parameters is None:
            parameters = Parameters(forward=forward)
        session.request_ok(self.request_id, parameters)
        self.subscription.parameters = parameters
        self.connection._transmit_soon()
        return self.subscription

    def reject(self, error: RequestError | int = RequestErrorCode.UNINTERESTED, reason: str = "", **kw: Any) -> None:
        self.connection._subscriptions.pop(self.request_id, None)
        super().reject(error, reason, **kw)


class IncomingUpdate:
    """A REQUEST_UPDATE from the peer (draft-18 "REQUEST_UPDATE"): answer it exactly once.

    `target` is what it updates: an OutgoingSubscription (a subscription we
    publish), a Subscription (a PUBLISH the peer sent us), a FetchSender, a
    NamespaceRegistration or a NamespacePublisher. Refusing an update of a
    subscription we publish ends it with PUBLISH_DONE UPDATE_FAILED; of a FETCH,
    resets its stream; of a namespace request, closes it.
    """

    def __init__(self, connection: "MoqtConnection", event: ev.RequestUpdateReceived, target: Any):
        self.connection = connection
        self.request_id = event.request_id
        self.existing_request_id = event.existing_request_id
        self.parameters: Parameters = event.parameters
        self.authorization_tokens: tuple[AuthToken, ...] = event.authorization_tokens
        self.target = target
        self.answered = False

    @property
    def authorization(self) -> list[bytes]:
        """The token values sent with the update."""
        return [t.value or b"" for t in self.authorization_tokens]

    def accept(self, *, largest: Location | tuple[int, int] | None = None, expires: int | None = None) -> None:
        """Send REQUEST_UPDATE_OK and apply the update; `largest` defaults to the
        largest Location a subscription we publish has sent."""
        if self.answered:
            raise ValueError(f"REQUEST_UPDATE {self.request_id} was already answered")
        self.answered = True
        session = self.connection._live_session()
        if largest is None and isinstance(self.target, OutgoingSubscription):
            largest = self.target.largest
        parameters = Parameters(largest_object=None if largest is None else Location(*largest), expires=expires)
        try:
            session.request_ok(self.request_id, parameters)
        except StreamClosed:
            return
        apply = getattr(self.target, "_apply_update", None)
        if apply is not None:
            apply(self.parameters)
        self.connection._transmit_soon()

    def reject(self, error: RequestError | int = RequestErrorCode.INTERNAL_ERROR, reason: str = "") -> None:
        if self.answered:
            return
        self.answered = True
        if isinstance(error, RequestError):
            code, reason = int(error.error_code), reason or error.reason
        else:
            code = int(error)
        session = self.connection.session
        if session is None or session.closed:
            return
        target = self.target
        if isinstance(target, FetchSender):
            target.reset(StreamResetCode.CANCELLED)
        try:
            session.request_error(self.request_id, code, reason)
        except StreamClosed:
            pass
        if isinstance(target, OutgoingSubscription):
            target._update_failed()
        elif isinstance(target, (NamespaceRegistration, NamespacePublisher)):
            target._on_cancelled(StreamResetCode.CANCELLED)
        elif isinstance(target, FetchSender) and not target.cancelled.done():
            target.cancelled.set_result(StreamResetCode.CANCELLED)
        self.connection._transmit_soon()


_INCOMING: dict[type, tuple[str, type[IncomingRequest]]] = {
    ev.SubscribeReceived: ("subscribe", IncomingSubscribe),
    ev.FetchReceived: ("fetch", IncomingFetch),
    ev.TrackStatusReceived: ("track_status", IncomingTrackStatus),
    ev.PublishNamespaceReceived: ("publish_namespace", IncomingPublishNamespace),
    ev.SubscribeNamespaceReceived: ("subscribe_namespace", IncomingSubscribeNamespace),
    ev.SubscribeTracksReceived: ("subscribe_tracks", IncomingSubscribeTracks),
    ev.PublishReceived: ("publish", IncomingPublish),
}
HANDLER_KINDS = tuple(kind for kind, _ in _INCOMING.values())


# ---------------------------------------------------------------------------
# The connection
# ---------------------------------------------------------------------------


def _token_parameters(authorization: bytes | str | AuthToken | Iterable[Any] | None) -> tuple[AuthToken, ...]:
    if authorization is None:
        return ()
    if isinstance(authorization, (bytes, str, AuthToken)):
        authorization = [authorization]
    return tuple(t if isinstance(t, AuthToken) else AuthToken.use_value(t) for t in authorization)


class MoqtConnection(QuicConnectionProtocol):
    """One MOQT session over one QUIC connection, with an asyncio API.

    Handlers (`on_subscribe()`, `on_fetch()`, ...) receive an `Incoming...` request
    and must answer it (accept or reject); a handler may be a coroutine function and
    run as long as it needs. A request with no handler is rejected (DOES_NOT_EXIST
    for track requests, UNINTERESTED / NOT_SUPPORTED for the others); a handler
    that raises a RequestError rejects with its code, any other exception with
    INTERNAL_ERROR, and returning without an answer also rejects.
    """

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: Any = None,
        *,
        settings: QuicSettings | None = None,
        is_client: bool | None = None,
        setup: Setup | None = None,
        handlers: dict[str, Handler] | None = None,
        accept_path: Iterable[str] | None = None,
        max_auth_token_cache_size: int = 0,
        on_session: Callable[["MoqtConnection"], None] | None = None,
        drafts: Iterable[int] | None = None,
    ) -> None:
        super().__init__(quic, stream_handler)
        self.settings = settings or QuicSettings()
        self._quic = _prepare_quic(quic, self.settings)
        self.is_client = quic.configuration.is_client if is_client is None else is_client
        #: the drafts this endpoint accepts, most preferred first
        if drafts is None:
            drafts = self.settings.default_drafts(is_client=self.is_client)
        self.drafts = _check_drafts(drafts)
        #: the negotiated draft once ALPN is negotiated (until then the preferred one)
        self.draft = self.drafts[0]
        self._setup = setup
        self._accept_path = accept_path
        self._max_auth_token_cache_size = max_auth_token_cache_size
        self._on_session = on_session
        self.session: MoqtSession | MoqtSession14 | None = None
        self._ready: asyncio.Future[Setup] = self._loop.create_future()
        self._error: MoqtError | None = None
        self._handlers: dict[str, Handler] = dict(handlers or {})
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._subscriptions: dict[int, Subscription] = {}
        self._fetches: dict[int, FetchResult] = {}
        self._namespace_subscriptions: dict[int, NamespaceSubscription] = {}
        self._announcements: dict[int, PublishedNamespace] = {}
        self._outgoing: dict[int, OutgoingSubscription] = {}
        self._fetch_senders: dict[int, FetchSender] = {}
        self._registrations: dict[int, NamespaceRegistration | NamespacePublisher] = {}
        self._drain_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._held_updates: dict[int, list[ev.RequestUpdateReceived]] = {}
        self._unanswered: set[int] = set()
        self._writing: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._owns_transport = False
        self.goaway: ev.GoawayReceived | None = None
        self.on_goaway: Callable[[ev.GoawayReceived], None] | None = None

    # -- handlers -----------------------------------------------------------

    def set_handler(self, kind: str, handler: Handler | None) -> None:
        """Set the handler of one request kind: one of HANDLER_KINDS."""
        if kind not in HANDLER_KINDS:
            raise ValueError(f"unknown request kind {kind!r}")
        if handler is None:
            self._handlers.pop(kind, None)
        else:
            self._handlers[kind] = handler

    def on_subscribe(self, handler: Callable[[IncomingSubscribe], Any]) -> None:
        self.set_handler("subscribe", handler)

    def on_fetch(self, handler: Callable[[IncomingFetch], Any]) -> None:
        self.set_handler("fetch", handler)

    def on_track_status(self, handler: Callable[[IncomingTrackStatus], Any]) -> None:
        self.set_handler("track_status", handler)

    def on_publish_namespace(self, handler: Callable[[IncomingPublishNamespace], Any]) -> None:
        self.set_handler("publish_namespace", handler)

    def on_subscribe_namespace(self, handler: Callable[[IncomingSubscribeNamespace], Any]) -> None:
        self.set_handler("subscribe_namespace", handler)

    def on_subscribe_tracks(self, handler: Callable[[IncomingSubscribeTracks], Any]) -> None:
        self.set_handler("subscribe_tracks", handler)

    def on_publish(self, handler: Callable[[IncomingPublish], Any]) -> None:
        self.set_handler("publish", handler)

    # -- state --------------------------------------------------------------

    @property
    def peer_setup(self) -> Setup | None:
        return None if self.session is None else self.session.peer_setup

    @property
    def is_closed(self) -> bool:
        return self._error is not None

    async def wait_ready(self, timeout: float | None = None) -> Setup:
        """Wait for the peer's SETUP."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    def _live_session(self) -> MoqtSession | MoqtSession14:
        if self._error is not None:
            raise self._error
        if self.session is None:
            raise SessionClosed("session not established")
        return self.session

    # -- QUIC events ----------------------------------------------------------

    def quic_event_received(self, event: QuicEvent) -> None:
        if self.session is None:
            if isinstance(event, ProtocolNegotiated):
                self.session = self._new_session(event.alpn_protocol)
                if self.session is None:
                    return
                if self._on_session is not None:
                    self._on_session(self)
            elif isinstance(event, ConnectionTerminated):
                self._fail_all(SessionClosed(event.reason_phrase or "connection closed", error_code=event.error_code))
            return
        for moqt_event in self.session.handle_event(event):
            try:
                self._on_moqt_event(moqt_event)
            except Exception:  # a bug in a callback must not break the connection
                logger.exception("error handling %s", type(moqt_event).__name__)

    def _new_session(self, alpn: str | None) -> MoqtSession | MoqtSession14 | None:
        """The session of the negotiated ALPN, or None after closing the connection
        when it is none of the drafts offered."""
        by_alpn = {alpn_of(draft): draft for draft in self.drafts}
        draft = by_alpn.get(alpn or "")
        if draft is None:
            self._quic.close(
                error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED,
                reason_phrase=f"ALPN {alpn!r}, expected one of {', '.join(repr(a) for a in by_alpn)}",
            )
            return None
        self.draft = draft
        session_class = MoqtSession14 if draft == 14 else MoqtSession
        return session_class(
            self._quic,
            is_client=self.is_client,
            draft=draft,
            setup=self._setup,
            max_object_size=self.settings.max_object_size,
            max_auth_token_cache_size=self._max_auth_token_cache_size,
            accept_path=self._accept_path,
        )

    def _dispatch_released(self) -> None:
        """Handle the events the session produced outside handle_event() (a joining
        FETCH released by SUBSCRIBE_OK; on draft-14, the local acceptance of a
        SUBSCRIBE_UPDATE, which has no answer on the wire)."""
        session = self.session
        if session is None:
            return
        for moqt_event in session.take_events():
            try:
                self._on_moqt_event(moqt_event)
            except Exception:  # a bug in a callback must not break the connection
                logger.exception("error handling %s", type(moqt_event).__name__)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic transmits after every datagram; deferring to the end of the loop
        # iteration sends one batch (and one ACK) for a burst of datagrams.
        self._quic.receive_datagram(data, addr, now=self._loop.time())  # type: ignore[arg-type]
        self._process_events()
        self._transmit_soon()
        if self._drain_waiters:
            self._wake_writers()

    def _handle_timer(self) -> None:
        super()._handle_timer()
        if self._drain_waiters:
            self._wake_writers()

    def _on_moqt_event(self, event: ev.MoqtEvent) -> None:
        kind = type(event)
        if kind is ev.ObjectReceived:
            subscription = self._subscriptions.get(event.request_id)  # type: ignore[attr-defined]
            if subscription is not None:
                subscription._object(event)  # type: ignore[arg-type]
        elif kind is ev.FetchObjectReceived:
            fetch = self._fetches.get(event.request_id)  # type: ignore[attr-defined]
            if fetch is not None:
                fetch._object(event)  # type: ignore[arg-type]
        elif kind is ev.SubgroupStreamOpened:
            subscription = self._subscriptions.get(event.request_id)  # type: ignore[attr-defined]
            if subscription is not None:
                subscription._stream_opened(event.stream_id)  # type: ignore[attr-defined]
        elif kind is ev.DataStreamEnded:
            self._on_stream_ended(event)  # type: ignore[arg-type]
        elif kind in _INCOMING:
            self._dispatch_request(event)
        elif kind is ev.SetupCompleted:
            if not self._ready.done():
                self._ready.set_result(event.setup)  # type: ignore[attr-defined]
        elif kind is ev.SessionTerminated:
            self._fail_all(SessionClosed(event.reason or "session closed", error_code=event.error_code))  # type: ignore[attr-defined]
        elif kind in (ev.SubscribeAccepted, ev.FetchAccepted, ev.RequestAccepted, ev.RequestRejected):
            self._on_answer(event)
        elif kind is ev.PublishDoneReceived:
            subscription = self._subscriptions.get(event.request_id)  # type: ignore[attr-defined]
            if subscription is not None:
                subscription._publish_done(event)  # type: ignore[arg-type]
        elif kind is ev.RequestCancelled:
            self._on_cancelled(event)  # type: ignore[arg-type]
        elif kind is ev.PublishBlockedReceived:
            subscription = self._namespace_subscriptions.get(event.request_id)  # type: ignore[attr-defined]
            if subscription is not None:
                subscription._items.put_nowait(PublishBlocked(event.namespace, event.track_name))  # type: ignore[attr-defined]
        elif kind in (ev.NamespaceReceived, ev.NamespaceDoneReceived):
            subscription = self._namespace_subscriptions.get(event.request_id)  # type: ignore[attr-defined]
            if subscription is not None:
                subscription._items.put_nowait(NamespaceUpdate(event.namespace, kind is ev.NamespaceReceived))  # type: ignore[attr-defined]
        elif kind is ev.FetchRangeReceived:
            fetch = self._fetches.get(event.request_id)  # type: ignore[attr-defined]
            if fetch is not None:
                fetch.ranges.append(event)  # type: ignore[arg-type]
        elif kind is ev.RequestUpdateReceived:
            self._on_update(event)  # type: ignore[arg-type]
        elif kind is ev.DataStreamStopped:
            self._writing.discard(event.stream_id)  # type: ignore[attr-defined]
            self._wake_writers()
        elif kind is ev.GoawayReceived:
            if event.request_id is None:  # type: ignore[attr-defined]
                self.goaway = event  # type: ignore[assignment]
            if self.on_goaway is not None:
                self.on_goaway(event)  # type: ignore[arg-type]

    def _on_stream_ended(self, event: ev.DataStreamEnded) -> None:
        if event.request_id is None:
            return
        if event.fetch:
            fetch = self._fetches.get(event.request_id)
            if fetch is not None:
                fetch._stream_ended(event)
        else:
            subscription = self._subscriptions.get(event.request_id)
            if subscription is not None:
                subscription._stream_ended(event)

    def _on_answer(self, event: Any) -> None:
        rid = event.request_id
        future = self._pending.pop(rid, None)
        if future is not None:
            if not future.done():
                if isinstance(event, ev.RequestRejected):
                    future.set_exception(
                        request_error_for(
                            event.error_code, event.reason, retry_interval=event.retry_interval, redirect=event.redirect
                        )
                    )
                else:
                    future.set_result(event)
            return
        if isinstance(event, ev.RequestRejected):
            # A rejection after acceptance: a fetch that failed late.
            error = request_error_for(event.error_code, event.reason, retry_interval=event.retry_interval)
            fetch = self._fetches.get(rid)
            if fetch is not None:
                fetch._finish(error)
            subscription = self._subscriptions.get(rid)
            if subscription is not None:
                subscription._finish(error)

    def _on_cancelled(self, event: ev.RequestCancelled) -> None:
        rid = event.request_id
        if event.local_request:
            error = SessionClosed(f"request {rid} cancelled by the peer", error_code=event.error_code)
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(request_error_for(RequestErrorCode.INTERNAL_ERROR, "cancelled by the peer"))
            subscription = self._subscriptions.get(rid)
            if subscription is not None:
                subscription._finish(PublishDoneError("subscription cancelled by the publisher", error_code=event.error_code))
            fetch = self._fetches.get(rid)
            if fetch is not None:
                fetch._finish(error)
            announcement = self._announcements.pop(rid, None)
            if announcement is not None and not announcement.closed.done():
                announcement.closed.set_result(event.error_code)
            namespaces = self._namespace_subscriptions.get(rid)
            if namespaces is not None:
                namespaces._finish(None)
            outgoing = self._outgoing.get(rid)  # our PUBLISH, cancelled by the subscriber
            if outgoing is not None:
                outgoing._on_cancelled(event.error_code)
            return
        outgoing = self._outgoing.get(rid)
        if outgoing is not None:
            outgoing._on_cancelled(event.error_code)
        sender = self._fetch_senders.pop(rid, None)
        if sender is not None and not sender.cancelled.done():
            sender.cancelled.set_result(event.error_code)
            self._wake_writers()
        registration = self._registrations.get(rid)
        if registration is not None:
            registration._on_cancelled(event.error_code)
        subscription = self._subscriptions.get(rid)  # a peer PUBLISH ended without PUBLISH_DONE
        if subscription is not None:
            subscription._finish(PublishDoneError("publication cancelled", error_code=event.error_code))

    def _update_target(self, request_id: int) -> Any:
        for table in (self._outgoing, self._subscriptions, self._fetch_senders, self._registrations):
            target = table.get(request_id)  # type: ignore[attr-defined]
            if target is not None:
                return target
        return None

    def _on_update(self, event: ev.RequestUpdateReceived) -> None:
        rid = event.existing_request_id
        if rid in self._unanswered:
            self._held_updates.setdefault(rid, []).append(event)  # answered after the request
            return
        target = self._update_target(rid)
        update = IncomingUpdate(self, event, target)
        handler = getattr(target, "on_update", None)
        if handler is None:
            self._default_update(update)
            return
        task = self._loop.create_task(self._run_update_handler(handler, update))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release_updates(self, request_id: int) -> None:
        for event in self._held_updates.pop(request_id, []):
            self._on_update(event)

    def _default_update(self, update: IncomingUpdate) -> None:
        """Without a handler: refuse what cannot be honoured, accept the rest."""
        target = update.target
        try:
            if isinstance(target, OutgoingSubscription):
                target.check_update(update.parameters)
            if update.parameters.track_namespace_prefix is not None:
                raise NotSupported("changing the namespace prefix is not supported")
        except RequestError as exc:
            update.reject(exc)
            return
        except (SessionClosed, StreamClosed):
            return
        try:
            update.accept()
        except (SessionClosed, StreamClosed):
            pass

    async def _run_update_handler(self, handler: Callable[[IncomingUpdate], Any], update: IncomingUpdate) -> None:
        await self._handle(handler, update, "update handler", lambda: self._default_update(update))

    def _dispatch_request(self, event: Any) -> None:
        kind, cls = _INCOMING[type(event)]
        request = cls(self, event)
        if kind == "publish":
            for subscription in self._namespace_subscriptions.values():
                if isinstance(subscription, TrackSubscriptions) and not subscription._finished \
                        and subscription.covers(event.namespace):
                    subscription._items.put_nowait(request)
                    return
        handler = self._handlers.get(kind)
        if handler is None:
            request.reject(request.default_error(f"no {kind} handler"))
            return
        self._unanswered.add(request.request_id)
        task = self._loop.create_task(self._run_handler(handler, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_handler(self, handler: Handler, request: IncomingRequest) -> None:
        try:
            await self._handle(handler, request)
        finally:
            self._unanswered.discard(request.request_id)
            if not request.answered:
                self._held_updates.pop(request.request_id, None)

    async def _handle(self, handler: Callable[[Any], Any], request: "IncomingRequest | IncomingUpdate",
                      what: str = "handler", unanswered: Callable[[], None] | None = None) -> None:
        """Run an application handler; whatever it leaves unanswered gets an answer here
        (`unanswered`, or a refusal), and its failures become refusals, never a hung request."""
        try:
            result = handler(request)
            if inspect.isawaitable(result):
                await result
        except RequestError as exc:
            request.reject(exc)
        except (SessionClosed, StreamClosed):
            pass
        except asyncio.CancelledError:
            request.reject(InternalRequestError(f"{what} cancelled"))
            raise
        except Exception:
            logger.exception("%s failed", what)
            request.reject(InternalRequestError(f"{what} failed"))
        else:
            if not request.answered:
                if unanswered is not None:
                    unanswered()
                else:
                    request.reject(InternalRequestError("request not answered"))

    def _fail_all(self, error: MoqtError) -> None:
        if self._error is not None:
            return
        self._error = error
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved: not every caller waits for it
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for subscription in list(self._subscriptions.values()):
            subscription._finish(error)
        for fetch in list(self._fetches.values()):
            fetch._finish(error)
        for namespaces in list(self._namespace_subscriptions.values()):
            namespaces._finish(error)
        for announcement in self._announcements.values():
            if not announcement.closed.done():
                announcement.closed.set_result(StreamResetCode.SESSION_CLOSED)
        for outgoing in list(self._outgoing.values()):
            outgoing._on_cancelled(StreamResetCode.SESSION_CLOSED)
        for sender in self._fetch_senders.values():
            if not sender.cancelled.done():
                sender.cancelled.set_result(StreamResetCode.SESSION_CLOSED)
        for registration in list(self._registrations.values()):
            registration._on_cancelled(StreamResetCode.SESSION_CLOSED)
        for _, waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()

    # -- backpressure ---------------------------------------------------------

    def _buffered(self, stream_id: int) -> int:
        """Bytes aioquic holds for a stream: not yet sent, or sent and not acknowledged."""
        stream = self._quic._streams.get(stream_id)
        if stream is None:
            return 0
        sender = stream.sender
        return sender._buffer_stop - sender._buffer_start

    def _buffered_total(self) -> int:
        total = 0
        for stream_id in list(self._writing):
            size = self._buffered(stream_id)
            if size == 0 and self.session is not None and self.session.data_stream_request(stream_id) is None:
                self._writing.discard(stream_id)
            total += size
        return total

    def _writable(self, stream_id: int, factor: float = 1.0) -> bool:
        settings = self.settings
        return (
            self._buffered(stream_id) < settings.stream_send_buffer * factor
            and self._buffered_total() < settings.connection_send_buffer * factor
        )

    async def _wait_writable(self, stream_id: int) -> None:
        while True:
            session = self._live_session()
            if session.data_stream_request(stream_id) is None:
                raise StreamClosed(f"data stream {stream_id} is closed")
            if self._writable(stream_id):
                return
            waiter = self._loop.create_future()
            self._drain_waiters.append((stream_id, waiter))
            await waiter

    async def _wait_writable_until(self, stream_id: int, deadline: float | None) -> bool:
        """_wait_writable(), giving up (False) at `deadline`, event-loop time: a delivery
        timeout ends the wait of a writer that a blocked subscriber would hold forever."""
        if deadline is None:
            await self._wait_writable(stream_id)
            return True
        remaining = deadline - self._loop.time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._wait_writable(stream_id), remaining)
        except asyncio.TimeoutError:
            return False
        return self._loop.time() <= deadline

    def _wake_writers(self) -> None:
        waiters = self._drain_waiters
        if not waiters:
            return
        keep = []
        for stream_id, waiter in waiters:
            if waiter.done():
                continue
            session = self.session
            if session is None or session.data_stream_request(stream_id) is None or self._writable(stream_id, 0.5):
                waiter.set_result(None)
            else:
                keep.append((stream_id, waiter))
        self._drain_waiters = keep

    async def _write_payload(
        self, stream_id: int, payload: bytes | bytearray | memoryview, *, deadline: float | None = None
    ) -> bool:
        """Write an object's payload in pieces as the stream drains; False (with the
        object unfinished) when `deadline` passes before a piece is handed to QUIC."""
        session = self._live_session()
        view = payload if isinstance(payload, memoryview) else memoryview(payload)
        size = len(view)
        chunk = self.settings.write_chunk_size
        if size <= chunk:
            if size:
                session.write_payload(stream_id, view)
            self._transmit_soon()
            return True
        offset = 0
        while offset < size:
            if offset:
                if not await self._wait_writable_until(stream_id, deadline):
                    return False
                session = self._live_session()
            session.write_payload(stream_id, view[offset : offset + chunk])
            offset += chunk
            self.transmit()
        return True

    def _expire_stream(self, stream_id: int) -> bool:
        """Reset a data stream QUIC has not fully delivered (its FIN may be sent) with
        DELIVERY_TIMEOUT; False when everything was already acknowledged."""
        stream = self._quic._streams.get(stream_id)
        if stream is None or stream.sender.is_finished or self._error is not None:
            return False
        session = self.session
        if session is not None:
            session.reset_data_stream(stream_id, StreamResetCode.DELIVERY_TIMEOUT)
        try:
            self._quic.reset_stream(stream_id, StreamResetCode.DELIVERY_TIMEOUT)
        except (ValueError, AssertionError):
            return False
        self._transmit_soon()
        return True

    def _consumed(self, stream_id: int, size: int) -> None:
        quic = self._quic
        if quic.release(stream_id, size) and self._error is None:  # type: ignore[attr-defined]
            self._transmit_soon()

    # -- subscriber API -------------------------------------------------------

    def _begin(self, request_id: int) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        self._pending[request_id] = future
        self._transmit_soon()
        return future

    async def _await_answer(self, request_id: int, future: asyncio.Future[Any], timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(request_id, None)
            session = self.session
            if session is not None and not session.closed:
                session.cancel_request(request_id)
                self._transmit_soon()
            raise

    async def subscribe(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        subscription_filter: SubscriptionFilter | None = None,
        forward: bool | None = None,
        subscriber_priority: int | None = None,
        group_order: GroupOrder | None = None,
        authorization: Any = None,
        rendezvous_timeout: int | None = None,
        object_delivery_timeout: int | None = None,
        subgroup_delivery_timeout: int | None = None,
        new_group_request: int | None = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> Subscription:
        """SUBSCRIBE and wait for SUBSCRIBE_OK; raises the RequestError of a REQUEST_ERROR.

        The delivery timeouts (ms) let the publisher give up on objects that would
        arrive too late for this subscriber (draft-18 "Delivery Timeouts")."""
        session = self._live_session()
        namespace = namespace_of(namespace)
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=_token_parameters(authorization),
                subscription_filter=subscription_filter,
                forward=forward,
                subscriber_priority=subscriber_priority,
                group_order=group_order,
                rendezvous_timeout=rendezvous_timeout,
                object_delivery_timeout=object_delivery_timeout,
                subgroup_delivery_timeout=subgroup_delivery_timeout,
                new_group_request=new_group_request,
            )
        request_id = session.subscribe(namespace, name, parameters)
        subscription = Subscription(self, request_id, namespace, name)
        subscription.parameters = parameters
        self._subscriptions[request_id] = subscription
        future = self._begin(request_id)
        try:
            accepted = await self._await_answer(request_id, future, timeout)
        except BaseException:
            self._subscriptions.pop(request_id, None)
            raise
        subscription._accepted(accepted)
        return subscription

    async def fetch(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        start: Location | tuple[int, int],
        end: Location | tuple[int, int],
        *,
        whole_end_group: bool = False,
        subscriber_priority: int | None = None,
        group_order: GroupOrder | None = None,
        authorization: Any = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> FetchResult:
        """Standalone FETCH of `start` through `end`, both inclusive (or through the
        whole end group); waits for FETCH_OK and returns the object iterator."""
        session = self._live_session()
        namespace = namespace_of(namespace)
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        end = Location(*end)
        wire_end = Location(end.group, 0) if whole_end_group else Location(end.group, end.object + 1)
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=_token_parameters(authorization),
                subscriber_priority=subscriber_priority,
                group_order=group_order,
            )
        request_id = session.fetch(namespace, name, Location(*start), wire_end, parameters)
        return await self._start_fetch(request_id, timeout)

    async def joining_fetch(
        self,
        subscription: Subscription,
        joining_start: int = 0,
        *,
        absolute: bool = False,
        subscriber_priority: int | None = None,
        timeout: float | None = None,
    ) -> FetchResult:
        """Joining FETCH: `joining_start` groups before the subscription's Joining
        Location (or from that absolute group)."""
        session = self._live_session()
        parameters = Parameters(subscriber_priority=subscriber_priority)
        request_id = session.joining_fetch(
            subscription.request_id, joining_start, relative=not absolute, parameters=parameters
        )
        return await self._start_fetch(request_id, timeout)

    async def _start_fetch(self, request_id: int, timeout: float | None) -> FetchResult:
        fetch = FetchResult(self, request_id)
        self._fetches[request_id] = fetch
        future = self._begin(request_id)
        try:
            accepted = await self._await_answer(request_id, future, timeout)
        except BaseException:
            fetch._finished = True
            fetch._queue.discard()
            self._fetches.pop(request_id, None)
            raise
        fetch._on_accepted(accepted)
        return fetch

    async def track_status(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        authorization: Any = None,
        timeout: float | None = None,
    ) -> TrackStatusInfo:
        session = self._live_session()
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        parameters = Parameters(authorization_tokens=_token_parameters(authorization))
        request_id = session.track_status(namespace_of(namespace), name, parameters)
        accepted = await self._await_answer(request_id, self._begin(request_id), timeout)
        return TrackStatusInfo(accepted.parameters.largest_object, accepted.track_properties, accepted.parameters.expires)

    async def subscribe_namespace(
        self, prefix: TrackNamespace | Iterable[bytes | str], *, authorization: Any = None, timeout: float | None = None
    ) -> NamespaceSubscription:
        """SUBSCRIBE_NAMESPACE and wait for REQUEST_OK; iterate the result for NAMESPACE and
        NAMESPACE_DONE."""
        return await self._prefix_request(NamespaceSubscription, prefix, authorization, timeout)

    async def subscribe_tracks(
        self, prefix: TrackNamespace | Iterable[bytes | str], *, authorization: Any = None, timeout: float | None = None
    ) -> TrackSubscriptions:
        """SUBSCRIBE_TRACKS and wait for REQUEST_OK: the peer PUBLISHes every track under
        `prefix`, those it has and those that come later (draft-18 only)."""
        return await self._prefix_request(TrackSubscriptions, prefix, authorization, timeout)

    async def _prefix_request(self, kind: type[_S], prefix: TrackNamespace | Iterable[bytes | str],
                              authorization: Any, timeout: float | None) -> _S:
        session = self._live_session()
        prefix = namespace_of(prefix)
        parameters = Parameters(authorization_tokens=_token_parameters(authorization))
        send = session.subscribe_tracks if kind is TrackSubscriptions else session.subscribe_namespace
        request_id = send(prefix, parameters)
        subscription = kind(self, request_id, prefix)
        self._namespace_subscriptions[request_id] = subscription
        try:
            await self._await_answer(request_id, self._begin(request_id), timeout)
        except BaseException:
            self._namespace_subscriptions.pop(request_id, None)
            raise
        return subscription

    # -- publisher API --------------------------------------------------------

    async def publish_namespace(
        self, namespace: TrackNamespace | Iterable[bytes | str], *, authorization: Any = None, timeout: float | None = None
    ) -> PublishedNamespace:
        """PUBLISH_NAMESPACE and wait for REQUEST_OK; raises RequestError on refusal."""
        session = self._live_session()
        namespace = namespace_of(namespace)
        parameters = Parameters(authorization_tokens=_token_parameters(authorization))
        request_id = session.publish_namespace(namespace, parameters)
        announcement = PublishedNamespace(self, request_id, namespace)
        self._announcements[request_id] = announcement
        try:
            await self._await_answer(request_id, self._begin(request_id), timeout)
        except BaseException:
            self._announcements.pop(request_id, None)
            raise
        return announcement

    async def publish(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        largest: Location | tuple[int, int] | None = None,
        forward: bool | None = None,
        track_properties: Properties = (),
        authorization: Any = None,
        timeout: float | None = None,
    ) -> OutgoingSubscription:
        """PUBLISH a track and wait for PUBLISH_OK; returns the subscription to send on."""
        session = self._live_session()
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        parameters = Parameters(
            authorization_tokens=_token_parameters(authorization),
            largest_object=None if largest is None else Location(*largest),
            forward=forward,
        )
        request_id = session.publish(namespace_of(namespace), name, parameters=parameters, track_properties=track_properties)
        outgoing = OutgoingSubscription(self, request_id, session.track_alias_of(request_id))  # type: ignore[arg-type]
        outgoing.track_properties = track_properties
        outgoing.largest = parameters.largest_object
        self._outgoing[request_id] = outgoing
        try:
            accepted = await self._await_answer(request_id, self._begin(request_id), timeout)
        except BaseException:
            self._outgoing.pop(request_id, None)
            raise
        outgoing.parameters = accepted.parameters
        return outgoing

    # -- session --------------------------------------------------------------

    def send_goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        self._live_session().goaway(new_session_uri, timeout_ms)
        self._transmit_soon()

    async def ping(self) -> None:
        """QUIC PING and wait for its acknowledgement (ConnectionError if the session ends).

        aioquic's, except that a waiter its caller gave up on (a probe's timeout) has its
        failure retrieved when the session ends, instead of being reported by asyncio as
        "Future exception was never retrieved" for every vanished peer.
        """
        waiter = self._loop.create_future()
        waiter.add_done_callback(_retrieve)
        uid = id(waiter)
        self._ping_waiters[uid] = waiter
        self._quic.send_ping(uid)
        self.transmit()
        await asyncio.shield(waiter)

    def close(self, error_code: int = SessionCloseCode.NO_ERROR, reason_phrase: str = "") -> None:
        """Close the session and the QUIC connection."""
        if self.session is not None:
            self.session.close(error_code, reason_phrase)
        else:
            self._quic.close(error_code=error_code, reason_phrase=reason_phrase)
        self._fail_all(SessionClosed(reason_phrase or "closed locally", error_code=error_code))
        self.transmit()

    async def aclose(self, timeout: float = 2.0) -> None:
        """Close and wait for the connection to end (and close our socket)."""
        self.close()
        try:
            await asyncio.wait_for(self.wait_closed(), timeout)
        except asyncio.TimeoutError:
            pass
        for task in list(self._tasks):
            task.cancel()
        if self._owns_transport and self._transport is not None:
            self._transport.close()

    async def __aenter__(self) -> "MoqtConnection":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


# ---------------------------------------------------------------------------
# Client and server
# ---------------------------------------------------------------------------


def _udp_socket(family: int, bind_host: str, settings: QuicSettings, port: int = 0) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, settings.socket_receive_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.socket_send_buffer)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if bind_host == "::" else 1)
        sock.bind((bind_host, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _local_bind_address(family: int, remote_host: str) -> str:
    """Loopback for a loopback peer, the family's wildcard otherwise."""
    try:
        if ipaddress.ip_address(remote_host).is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
    except ValueError:
        pass
    return "0.0.0.0" if family == socket.AF_INET else "::"


def _ssl_verify_settings(verify: bool, cadata: bytes | None, cafile: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if not verify:
        kwargs["verify_mode"] = ssl.CERT_NONE
    if cadata is not None:
        kwargs["cadata"] = cadata
    if cafile is not None:
        kwargs["cafile"] = cafile
    return kwargs


async def connect(
    url: str,
    *,
    settings: QuicSettings | None = None,
    verify: bool = True,
    cadata: bytes | None = None,
    cafile: str | None = None,
    server_name: str | None = None,
    authorization: Any = None,
    handlers: dict[str, Handler] | None = None,
    implementation: str | None = None,
    timeout: float | None = None,
    drafts: Iterable[int] | None = None,
) -> MoqtConnection:
    """Open a MOQT session to ``moqt://host[:port][/path][?query]`` over raw QUIC.

    `drafts` are the MOQT drafts offered, most preferred first: draft-18 only by
    default; ``(18, 14)`` falls back to draft-14 (ALPN "moq-00") with a server
    that lacks draft-18, ``(14,)`` offers only "moq-00". The server's choice is
    `MoqtConnection.draft`.

    The socket is bound to the loopback address for a loopback peer (aioquic's own
    connect() binds every interface). PATH and AUTHORITY Setup Options come from the
    URL (section 9.3); `authorization` tokens go in SETUP. Returns once the peer's
    SETUP arrived.
    """
    settings = settings or QuicSettings()
    offered = _check_drafts(settings.default_drafts(is_client=True) if drafts is None else drafts)
    parts = urlsplit(url)
    if parts.scheme != "moqt":
        raise ValueError(f"not a moqt:// URL: {url!r}")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    host = parts.hostname
    port = parts.port or 443
    path = parts.path or ""
    if parts.query:
        path += "?" + parts.query
    setup = Setup(
        path=path,
        authority=parts.netloc.rsplit("@", 1)[-1],
        authorization_tokens=_token_parameters(authorization),
        implementation=implementation,
    )
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    sock = _udp_socket(family, _local_bind_address(family, address[0]), settings)
    configuration = settings.quic_configuration(
        is_client=True, drafts=offered, server_name=server_name or host, **_ssl_verify_settings(verify, cadata, cafile)
    )
    quic = _connection_class(settings)(configuration=configuration)
    try:
        _, protocol = await loop.create_datagram_endpoint(
            lambda: MoqtConnection(
                quic, settings=settings, is_client=True, setup=setup, handlers=handlers, drafts=offered
            ),
            sock=sock,
        )
    except BaseException:
        sock.close()
        raise
    connection: MoqtConnection = protocol  # type: ignore[assignment]
    connection._owns_transport = True
    connection.connect(address)
    try:
        limit = settings.handshake_timeout if timeout is None else timeout
        await asyncio.wait_for(connection.wait_ready(), limit)
    except BaseException:
        connection.close()
        if connection._transport is not None:
            connection._transport.close()
        raise
    return connection


class MoqtServer:
    """A listening MOQT server; `connections` are the live sessions."""

    def __init__(self, quic_server: QuicServer, transport: asyncio.DatagramTransport, host: str, port: int):
        self._quic_server = quic_server
        self._transport = transport
        self.host = host
        self.port = port
        self.connections: set[MoqtConnection] = set()
        self._watchers: set[asyncio.Task[None]] = set()  # each forgets a connection once closed

    def _watch(self, connection: MoqtConnection) -> None:
        task = connection._loop.create_task(_forget_when_closed(self, connection))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"moqt://{host}:{self.port}"

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()
        for watcher in list(self._watchers):
            watcher.cancel()
        self._quic_server.close()

    async def aclose(self, timeout: float = 2.0) -> None:
        connections = list(self.connections)
        for connection in connections:
            connection.close()
        if connections:
            await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in connections], timeout=timeout)
        for connection in connections:
            for task in list(connection._tasks):
                task.cancel()
        for watcher in list(self._watchers):
            watcher.cancel()
        self._quic_server.close()

    async def __aenter__(self) -> "MoqtServer":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    certificate: SelfSignedCertificate | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    settings: QuicSettings | None = None,
    handlers: dict[str, Handler] | None = None,
    on_connection: Callable[[MoqtConnection], None] | None = None,
    accept_path: Iterable[str] | None = None,
    max_auth_token_cache_size: int = 0,
    drafts: Iterable[int] | None = None,
) -> MoqtServer:
    """Listen for MOQT sessions on `host`:`port` (loopback and an ephemeral port by
    default). `handlers` apply to every connection; `on_connection` is called once a
    connection's session exists, to set per-connection handlers. `drafts` are the
    drafts accepted, most preferred first (default: 18, then 14 unless
    `settings.draft14_fallback` is off); `MoqtConnection.draft` is each one's."""
    settings = settings or QuicSettings()
    accepted = _check_drafts(settings.default_drafts(is_client=False) if drafts is None else drafts)
    configuration = settings.quic_configuration(is_client=False, drafts=accepted)
    if certificate is not None:
        configuration.certificate = certificate.certificate
        configuration.private_key = certificate.private_key
    elif certfile is not None:
        configuration.load_cert_chain(certfile, keyfile)
    else:
        raise ValueError("a server needs a certificate")
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = _udp_socket(family, host, settings, port)
    server_ref: list[MoqtServer] = []

    def on_session(connection: MoqtConnection) -> None:
        server = server_ref[0]
        server.connections.add(connection)
        server._watch(connection)
        if on_connection is not None:
            on_connection(connection)

    def create_protocol(quic: QuicConnection, stream_handler: Any = None) -> MoqtConnection:
        return MoqtConnection(
            quic,
            stream_handler,
            settings=settings,
            is_client=False,
            handlers=handlers,
            accept_path=accept_path,
            max_auth_token_cache_size=max_auth_token_cache_size,
            on_session=on_session,
            drafts=accepted,
        )

    try:
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: QuicServer(configuration=configuration, create_protocol=create_protocol), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()
    server = MoqtServer(protocol, transport, bound[0], bound[1])  # type: ignore[arg-type]
    server_ref.append(server)
    return server


async def _forget_when_closed(server: MoqtServer, connection: MoqtConnection) -> None:
    await connection.wait_closed()
    server.connections.discard(connection)
