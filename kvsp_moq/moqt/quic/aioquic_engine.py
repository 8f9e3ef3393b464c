"""The aioquic engine: aioquic's QuicConnection, tuned, behind our engine interface.

aioquic is the reference engine: pure Python, so every packet costs ~70-100 us of
interpreter time per side. What is changed here, and why:

* receive credit is granted as the application consumes objects (`hold()` /
  `release()`), not as data arrives, so a subscriber that reads slowly slows its
  publisher through QUIC flow control instead of buffering without bound;
* written bytes are kept as the writer's own chunks (no copies of MiB-sized buffers);
* a pending ACK rides in a packet that carries our frames instead of its own datagram;
* the peer's max_udp_payload_size is honoured (aioquic ignores it);
* on aioquic 1.7, datagrams above 16,384 bytes get STREAM frames whose Length is a real
  varint (aioquic writes a fixed 2-byte one, corrupting longer frames).
"""

from __future__ import annotations

import asyncio
import bisect
import socket
from typing import Any, Callable, cast

import aioquic
from aioquic import tls
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer as QuicBuffer
from aioquic.buffer import size_uint_var
from aioquic.quic import events as aq
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.congestion.base import create_congestion_control
from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    QuicConnection,
)
from aioquic.quic.packet import QuicFrameType, pull_quic_transport_parameters
from aioquic.quic.packet_builder import QuicDeliveryState
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.quic.stream import QuicStream, QuicStreamFrame, QuicStreamSender

from ...errors import SettingError
from .. import engine as qe
from ..certs import SelfSignedCertificate
from .settings import QuicSettings
from .transport_parameters import MAX_ACK_DELAY, with_transport_parameters

__all__ = ["AioquicEngine", "LARGEST_DATAGRAM_SIZE", "LONG_FRAME_DATAGRAM_SIZE", "QuicServer", "check_datagram_size",
           "client_connection", "configuration", "load_certificate", "server_connection", "wrap"]


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
                fin = self._buffer_fin
                assert fin is not None  # a pending FIN has its offset
                return QuicStreamFrame(fin=True, offset=fin)
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
        # chunks[head:] are all present: only acknowledged ones (before head) are None
        while head < count and starts[head] + len(chunks[head]) <= acknowledged:  # type: ignore[arg-type]  # see above
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
        cast(_ChunkedStreamSender, sender)._init_chunks()
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

    def _write_application(self, builder, network_path, now: float) -> None:
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

    #: milliseconds advertised as max_ack_delay (aioquic's own: 25, though it acknowledges within 1 ms)
    max_ack_delay_ms = 0

    def _serialize_transport_parameters(self) -> bytes:
        data = super()._serialize_transport_parameters()
        if not self.max_ack_delay_ms:
            return data
        return with_transport_parameters(data, {MAX_ACK_DELAY: self.max_ack_delay_ms})

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

    def _write_connection_limits(self, builder, space) -> None:
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

    def _write_stream_limits(self, builder, space, stream) -> None:
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

    def _write_stream_frame(self, builder, space, stream, max_offset: int) -> int:
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

    def _write_crypto_frame(self, builder, space, stream) -> bool:
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


def _connection_class(max_datagram_size: int) -> type[_ConsumptionWindowConnection]:
    if _check_datagram_size(max_datagram_size):
        return _LongFrameConnection
    return _ConsumptionWindowConnection


def _prepare_quic(quic: QuicConnection, settings: QuicSettings) -> _ConsumptionWindowConnection:
    """Give a QuicConnection (made by aioquic's server or by connect()) our receive
    windows and stream limits, before its transport parameters are sent; with
    datagrams above LONG_FRAME_DATAGRAM_SIZE, also the long-frame fix."""
    cls = _connection_class(quic.configuration.max_datagram_size)
    if type(quic) is not cls:
        quic.__class__ = cls
    assert isinstance(quic, _ConsumptionWindowConnection)
    quic._init_consumption_window(settings.max_stream_data, settings.max_data)
    quic.max_ack_delay_ms = round(settings.max_ack_delay * 1000)
    for limit_name in ("_local_max_streams_bidi", "_local_max_streams_uni"):
        limit = getattr(quic, limit_name, None)
        # A server's connection has sent aioquic's 128 already (in its transport parameters):
        # a larger limit then goes out in MAX_STREAMS.
        if limit is not None and limit.used == 0:
            limit.value = max(limit.value, settings.max_streams)
    return quic


# ---------------------------------------------------------------------------
# The engine interface
# ---------------------------------------------------------------------------

#: The largest datagram this engine sends: loopback's, where the long-frame fix applies.
LARGEST_DATAGRAM_SIZE = LOOPBACK_DATAGRAM_SIZE if _long_frames_supported(aioquic.__version__) is not None \
    else LONG_FRAME_DATAGRAM_SIZE


def check_datagram_size(size: int) -> None:
    """SettingError when aioquic cannot send datagrams of `size` bytes."""
    if not 1200 <= size <= 65507:
        raise SettingError(f"datagram size {size}: QUIC needs at least 1,200 bytes and UDP carries at most 65,507")
    try:
        _check_datagram_size(size)
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def configuration(settings: QuicSettings, *, is_client: bool, alpn_protocols: list[str], max_datagram_size: int,
                  **kwargs: Any) -> QuicConfiguration:
    """aioquic's configuration for these settings (`kwargs`: TLS options such as verify_mode)."""
    return QuicConfiguration(
        is_client=is_client,
        alpn_protocols=alpn_protocols,
        congestion_control_algorithm=settings.congestion_control,
        idle_timeout=settings.idle_timeout,
        max_data=settings.max_data,
        max_stream_data=settings.max_stream_data,
        max_datagram_size=max_datagram_size,
        max_datagram_frame_size=settings.max_datagram_frame_size,
        **kwargs,
    )


def load_certificate(configuration: QuicConfiguration, certificate: SelfSignedCertificate | None,
                     certfile: str | None, keyfile: str | None) -> None:
    if certificate is not None:
        configuration.certificate = certificate.certificate
        configuration.private_key = certificate.private_key
    else:
        if certfile is None:
            raise ValueError("a server needs a certificate")
        configuration.load_cert_chain(certfile, keyfile)


def client_connection(configuration: QuicConfiguration, settings: QuicSettings) -> "AioquicEngine":
    """A client connection, not yet connected."""
    return AioquicEngine(_connection_class(configuration.max_datagram_size)(configuration=configuration), settings)


def server_connection(configuration: QuicConfiguration, settings: QuicSettings,
                      original_destination_connection_id: bytes) -> "AioquicEngine":
    """A server connection for the client whose first Initial named that connection ID,
    without a socket (a server endpoint makes its own: `QuicServer`)."""
    quic = QuicConnection(configuration=configuration,
                          original_destination_connection_id=original_destination_connection_id)
    return AioquicEngine(quic, settings)


async def create_endpoint(loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.DatagramProtocol],
                          sock: socket.socket) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
    """asyncio's datagram endpoint on `sock` (aioquic sends one datagram a call)."""
    return await loop.create_datagram_endpoint(factory, sock=sock)


def wrap(quic: QuicConnection, settings: QuicSettings) -> "AioquicEngine":
    """The engine interface over a connection aioquic's server made."""
    return AioquicEngine(quic, settings)


def _translate(event: aq.QuicEvent) -> qe.QuicEvent | None:
    if type(event) is aq.StreamReset:
        return qe.StreamReset(event.error_code, event.stream_id)
    if type(event) is aq.StopSendingReceived:
        return qe.StopSendingReceived(event.error_code, event.stream_id)
    if type(event) is aq.DatagramFrameReceived:
        return qe.DatagramFrameReceived(event.data)
    if type(event) is aq.ProtocolNegotiated:
        return qe.ProtocolNegotiated(event.alpn_protocol)
    if type(event) is aq.HandshakeCompleted:
        return qe.HandshakeCompleted(event.alpn_protocol)
    if type(event) is aq.PingAcknowledged:
        return qe.PingAcknowledged(event.uid)
    if type(event) is aq.ConnectionTerminated:
        return qe.ConnectionTerminated(event.error_code, event.frame_type, event.reason_phrase)
    if type(event) is aq.ConnectionIdIssued:
        return qe.ConnectionIdIssued(event.connection_id)
    if type(event) is aq.ConnectionIdRetired:
        return qe.ConnectionIdRetired(event.connection_id)
    return None


class AioquicEngine:
    """`EngineConnection` over a tuned aioquic QuicConnection.

    The calls a session makes go straight to aioquic's methods (bound once, no wrapper
    on the per-object path); events are translated into ours."""

    name = "aioquic"
    credit_on_consumption = True

    def __init__(self, quic: QuicConnection, settings: QuicSettings) -> None:
        self.quic = quic = _prepare_quic(quic, settings)
        self.is_client: bool = quic.configuration.is_client
        self.alpn_protocols: list[str] = list(quic.configuration.alpn_protocols or [])
        self.get_next_available_stream_id = quic.get_next_available_stream_id
        self.send_stream_data = quic.send_stream_data
        self.reset_stream = quic.reset_stream
        self.stop_stream = quic.stop_stream
        self.send_datagram_frame = quic.send_datagram_frame
        self.connect = quic.connect
        self.receive_datagram = quic.receive_datagram
        self.datagrams_to_send = quic.datagrams_to_send
        self.get_timer = quic.get_timer
        self.handle_timer = quic.handle_timer
        self.send_ping = quic.send_ping
        self.hold = quic.hold
        self.release = quic.release

    @property
    def max_datagram_size(self) -> int:
        return self.quic._max_datagram_size

    @property
    def held_total(self) -> int:
        """Bytes handed to the application and not yet consumed."""
        return self.quic.held_total

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        self.quic.close(error_code=error_code, reason_phrase=reason_phrase)

    def receive_datagrams(self, datagrams: list[bytes], addr: Any, now: float) -> None:
        receive = self.quic.receive_datagram
        for data in datagrams:
            receive(data, addr, now)

    def next_event(self) -> qe.QuicEvent | None:
        next_event = self.quic.next_event
        while True:
            event = next_event()
            if event is None:
                return None
            if type(event) is aq.StreamDataReceived:
                return qe.StreamDataReceived(event.data, event.end_stream, event.stream_id)
            translated = _translate(event)
            if translated is not None:
                return translated

    def buffered(self, stream_id: int) -> int:
        """Bytes aioquic holds for a stream: not yet sent, or sent and not acknowledged."""
        stream = self.quic._streams.get(stream_id)
        if stream is None:
            return 0
        sender = stream.sender
        return sender._buffer_stop - sender._buffer_start

    def delivered(self, stream_id: int) -> bool:
        stream = self.quic._streams.get(stream_id)
        return stream is None or stream.sender.is_finished
