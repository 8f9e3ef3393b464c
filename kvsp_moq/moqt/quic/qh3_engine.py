"""The qh3 engine: qh3's QuicConnection (aioquic's API over a Rust core) behind our interface.

qh3 keeps aioquic's sans-I/O method names, so a session's calls go straight to it; its
packet work (framing, encryption, loss recovery) runs natively, several times cheaper
per packet than aioquic. Its asyncio transport sends a burst of datagrams with one
system call (GSO) and receives several at once (GRO, recvmmsg): both ends use it here,
servers included. What it lacks, and what is done about it:

* receive credit is granted as data arrives (there is no "credit on consumption"),
  so a reader that falls behind cannot slow its publisher through QUIC flow control:
  `credit_on_consumption` is False, and the layers above bound what they keep (the
  relay's cache and forwarding queues);
* a client advertises a max_udp_payload_size of 1,472 bytes whatever its configuration,
  so a peer would never send it larger datagrams: the advertised value is raised to the
  configured datagram size here (`_TlsBridge`);
* whether a stream's bytes were acknowledged is not public: `delivered()` reads the
  connection's record of our open streams, which qh3 clears once a stream's bytes and
  FIN are acknowledged;
* 100 concurrent bidirectional and 103 unidirectional streams per peer (fixed in its
  core): MOQT requests beyond 100 at once wait for MAX_STREAMS;
* its core refuses to build a packet whose first queued frame does not fit what it may
  send ("packet builder capacity exhausted"), as happens to a server's handshake flight
  while its peer's address is unvalidated (three times what it received); its
  `datagrams_to_send()` then raises and drops the datagrams already built. Servers here
  validate addresses with a Retry first (`QuicServer`), and should the error come
  anyway, the datagrams built are sent and the rest waits for the next transmission
  (the core keeps its state);
* calls on a connection that is closing raise ("connection is closed"); aioquic ignores
  them, and so does this adapter, since the session learns of the end only with
  ConnectionTerminated, after the closing period.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

from qh3.asyncio._transport import create_optimized_datagram_transport
from qh3.asyncio.server import QuicServer as _Qh3Server
from qh3.quic import events as q3
from qh3.quic.configuration import QuicConfiguration
from qh3.quic.connection import QuicConnection, QuicConnectionError
from qh3.quic.tls_bridge import QuicTlsBridge

from ...errors import SettingError
from .. import engine as qe
from ..certs import SelfSignedCertificate
from .settings import LOOPBACK_DATAGRAM_SIZE, QuicSettings

__all__ = ["Qh3Engine", "LARGEST_DATAGRAM_SIZE", "QuicServer", "check_datagram_size", "client_connection",
           "configuration", "create_endpoint", "load_certificate", "wrap"]

#: The largest datagram sent: loopback's.
LARGEST_DATAGRAM_SIZE = LOOPBACK_DATAGRAM_SIZE
# RFC 9000 section 18.2: max_udp_payload_size is transport parameter 0x03.
_MAX_UDP_PAYLOAD_SIZE = 0x03
_CAPACITY_EXHAUSTED = "packet builder capacity exhausted"
_CLOSED = "connection is closed"
# Receive buffer of the transport: the largest UDP payload, so no datagram is truncated.
_RECEIVE_BUFFER = 65536


def _varint(data: bytes, offset: int) -> tuple[int, int]:
    first = data[offset]
    length = 1 << (first >> 6)
    value = first & 0x3F
    for i in range(1, length):
        value = (value << 8) | data[offset + i]
    return value, offset + length


def _encode_varint(value: int) -> bytes:
    if value < 0x40:
        return bytes([value])
    if value < 0x4000:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 0x40000000:
        return (value | 0x80000000).to_bytes(4, "big")
    return (value | 0xC000000000000000).to_bytes(8, "big")


def with_max_udp_payload_size(parameters: bytes, size: int) -> bytes:
    """Encoded transport parameters with max_udp_payload_size set to `size` (added when
    absent); every other parameter is kept octet for octet."""
    out = bytearray()
    offset = 0
    while offset < len(parameters):
        start = offset
        identifier, offset = _varint(parameters, offset)
        length, offset = _varint(parameters, offset)
        offset += length
        if identifier != _MAX_UDP_PAYLOAD_SIZE:
            out += parameters[start:offset]
    value = _encode_varint(size)
    out += _encode_varint(_MAX_UDP_PAYLOAD_SIZE) + _encode_varint(len(value)) + value
    return bytes(out)


class _TlsBridge(QuicTlsBridge):
    """qh3's TLS bridge, advertising the configured datagram size as a client too."""

    def serialize_transport_parameters(self) -> bytes:
        data = super().serialize_transport_parameters()
        if self.configuration.is_client and self.configuration.max_datagram_size > 1472:
            data = with_max_udp_payload_size(data, self.configuration.max_datagram_size)
        return data


class _Connection(QuicConnection):
    def _create_tls(self, remote_source_cid: bytes | None) -> QuicTlsBridge:
        bridge = super()._create_tls(remote_source_cid)
        bridge.__class__ = _TlsBridge  # made by qh3 and not started yet: only the method differs
        return bridge


def check_datagram_size(size: int) -> None:
    """SettingError when qh3 cannot send datagrams of `size` bytes."""
    if not 1200 <= size <= 65507:
        raise SettingError(f"datagram size {size}: QUIC needs at least 1,200 bytes and UDP carries at most 65,507")


def configuration(settings: QuicSettings, *, is_client: bool, alpn_protocols: list[str], max_datagram_size: int,
                  **kwargs: Any) -> QuicConfiguration:
    """qh3's configuration for these settings (`kwargs`: TLS options such as verify_mode).
    There is no path MTU probing: the datagram size is the configured one."""
    return QuicConfiguration(
        is_client=is_client,
        alpn_protocols=alpn_protocols,
        idle_timeout=settings.idle_timeout,
        max_data=settings.max_data,
        max_stream_data=settings.max_stream_data,
        max_datagram_size=max_datagram_size,
        max_datagram_frame_size=settings.max_datagram_frame_size,
        probe_datagram_size=False,
        **kwargs,
    )


def load_certificate(configuration: QuicConfiguration, certificate: SelfSignedCertificate | None,
                     certfile: str | None, keyfile: str | None) -> None:
    if certificate is not None:
        configuration.load_cert_chain(certificate.certificate_pem, certificate.private_key_pem)
    else:
        configuration.load_cert_chain(certfile, keyfile)  # type: ignore[arg-type]


def client_connection(configuration: QuicConfiguration, settings: QuicSettings) -> "Qh3Engine":
    """A client connection, not yet connected."""
    return Qh3Engine(_Connection(configuration=configuration))


def wrap(quic: QuicConnection, settings: QuicSettings) -> "Qh3Engine":
    """The engine interface over a connection qh3's server made."""
    return Qh3Engine(quic)


async def create_endpoint(loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.DatagramProtocol],
                          sock: socket.socket) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
    """qh3's transport on `sock`: GSO sends and GRO / batched receives where the kernel has them."""
    return await create_optimized_datagram_transport(loop, factory, sock, gro_segment_size=_RECEIVE_BUFFER)


class QuicServer(_Qh3Server):
    """qh3's server, validating each client's address with a Retry first, and taking a
    batch of received datagrams at once: consecutive datagrams for one connection reach
    it together (one engine call, one round of events).

    Retry costs one round trip per connection. Without it, the server's first flight is
    bounded by three times what the client sent (RFC 9000 section 8.1), and qh3's core
    does not split its queued CRYPTO frames to fit that allowance: with a client whose
    first flight is small (picoquic, hence aiomoqt) the handshake stalled for seconds,
    sending only ACKs, or never finished. A client with a Retry token is validated at
    once."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("retry", True)
        super().__init__(**kwargs)
        self._cid_length = self._configuration.connection_id_length

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        protocols = self._protocols
        cid_end = 1 + self._cid_length
        batch: list[bytes] = []
        target: Any = None
        for data in datagrams:
            protocol = protocols.get(data[1:cid_end]) if data and not data[0] & 0x80 else None
            if protocol is not None and protocol is target:
                batch.append(data)
                continue
            if batch:
                target.datagrams_received(batch, addr)
                batch = []
                target = None
            if protocol is not None:
                target = protocol
                batch.append(data)
            else:
                self.datagram_received(data, addr)  # a long header: handshake, or a new connection
        if batch:
            target.datagrams_received(batch, addr)


_EVENTS: dict[type, Callable[[Any], qe.QuicEvent]] = {
    q3.StreamReset: lambda e: qe.StreamReset(e.error_code, e.stream_id),
    q3.StopSendingReceived: lambda e: qe.StopSendingReceived(e.error_code, e.stream_id),
    q3.DatagramFrameReceived: lambda e: qe.DatagramFrameReceived(e.data),
    q3.ProtocolNegotiated: lambda e: qe.ProtocolNegotiated(e.alpn_protocol),
    q3.HandshakeCompleted: lambda e: qe.HandshakeCompleted(e.alpn_protocol),
    q3.PingAcknowledged: lambda e: qe.PingAcknowledged(e.uid),
    q3.ConnectionTerminated: lambda e: qe.ConnectionTerminated(e.error_code, e.frame_type, e.reason_phrase),
    q3.ConnectionIdIssued: lambda e: qe.ConnectionIdIssued(e.connection_id),
    q3.ConnectionIdRetired: lambda e: qe.ConnectionIdRetired(e.connection_id),
}


class Qh3Engine:
    """`EngineConnection` over qh3's QuicConnection."""

    name = "qh3"
    credit_on_consumption = False

    def __init__(self, quic: QuicConnection) -> None:
        self.quic = quic
        configuration = quic.configuration
        self.is_client: bool = configuration.is_client
        self.alpn_protocols: list[str] = list(configuration.alpn_protocols or [])
        self.max_datagram_size: int = configuration.max_datagram_size
        self.held_total = 0
        self.get_next_available_stream_id = quic.get_next_available_stream_id
        self.connect = quic.connect
        self.receive_datagram = quic.receive_datagram
        self.receive_datagrams = quic.receive_many_datagrams
        self.get_timer = quic.get_timer
        self.handle_timer = quic.handle_timer
        self.send_ping = quic.send_ping
        self.buffered = quic.get_send_buffer_size

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        self.quic.close(error_code=error_code, reason_phrase=reason_phrase)

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        try:
            self.quic.send_stream_data(stream_id, data, end_stream)
        except QuicConnectionError as exc:
            if exc.reason_phrase != _CLOSED:
                raise

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        try:
            self.quic.reset_stream(stream_id, error_code)
        except QuicConnectionError as exc:
            if exc.reason_phrase != _CLOSED:
                raise

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        try:
            self.quic.stop_stream(stream_id, error_code)
        except QuicConnectionError as exc:
            if exc.reason_phrase != _CLOSED:
                raise

    def send_datagram_frame(self, data: bytes) -> None:
        try:
            self.quic.send_datagram_frame(data)
        except QuicConnectionError as exc:
            if exc.reason_phrase != _CLOSED:
                raise

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        """qh3's datagrams_to_send(), keeping what was built when the core cannot build
        more now (see the module's docstring)."""
        quic = self.quic
        core = quic._core
        if core is None:
            return []
        out: list[tuple[bytes, Any]] = []
        logged = quic._quic_logger is not None
        while True:
            try:
                transmit = core.poll_transmit(now)
            except RuntimeError as exc:
                if str(exc) in (_CAPACITY_EXHAUSTED, _CLOSED):
                    return out
                raise QuicConnectionError(1, None, str(exc)) from exc
            if transmit is None:
                return out
            if logged:
                quic._log_datagram("datagrams_sent", transmit[0])
                quic._log_packets("packet_sent", transmit[0])
            out.append((transmit[0], transmit[1]))

    def next_event(self) -> qe.QuicEvent | None:
        next_event = self.quic.next_event
        while True:
            event = next_event()
            if event is None:
                return None
            kind = type(event)
            if kind is q3.StreamDataReceived:
                return qe.StreamDataReceived(event.data, event.end_stream, event.stream_id)
            convert = _EVENTS.get(kind)
            if convert is not None:
                return convert(event)

    def delivered(self, stream_id: int) -> bool:
        # qh3 forgets a stream of ours once its bytes and FIN are acknowledged (and, for a
        # bidirectional one, its receive side finished); until then it stays recorded.
        quic = self.quic
        created = getattr(quic, "_created_local_stream_ids", None)
        if created is None:  # not exposed by this release: everything sent is the best we know
            return quic.get_send_buffer_size(stream_id) == 0
        return stream_id not in created

    def hold(self, stream_id: int, size: int) -> None:
        self.held_total += size

    def release(self, stream_id: int, size: int) -> bool:
        self.held_total -= size
        return False
