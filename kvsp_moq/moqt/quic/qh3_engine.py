"""The qh3 engine: qh3's QuicConnection (aioquic's API over a Rust core) behind our interface.

qh3 keeps aioquic's sans-I/O method names, so a session's calls go straight to it; its
packet work (framing, encryption, loss recovery) runs natively, several times cheaper
per packet than aioquic. Its asyncio transport sends a burst of datagrams with one
system call (GSO) and receives several at once (GRO, recvmmsg): both ends use it here,
servers included. What it lacks, and what is done about it:

* its core grants receive credit as the Python side takes received data out of it, and
  the Python side takes it after every datagram, so a reader that falls behind could
  not slow its publisher: while the application holds more than `max_data` received
  bytes, the connection leaves its events in the core (`_Connection.withholding`), the
  core grants no credit and the peer's flow control stops it; below half, they are
  taken again (`Qh3Engine.release`). ACKs and loss recovery go on meanwhile (the core
  does them); the connection's other events wait, like its data;
* a client advertises a max_udp_payload_size of 1,472 bytes whatever its configuration,
  so a peer would never send it larger datagrams: the advertised value is raised to the
  configured datagram size here (`_TlsBridge`);
* it advertises a max_ack_delay of 25 ms though its core acknowledges within 1 ms: the
  advertised value (and the core's) is `QuicSettings.max_ack_delay` here;
* whether a stream's bytes were acknowledged is not public: `delivered()` reads the
  connection's record of our open streams, which qh3 clears once a stream's bytes and
  FIN are acknowledged;
* 100 concurrent bidirectional and 103 unidirectional streams per peer, fixed in its
  core and its transport parameters, and a stream past the peer's limit is a ValueError
  rather than a wait (each draft-18 request is a bidirectional stream, and a relay
  carries many clients' FETCHes on one upstream connection): both are raised to
  `QuicSettings.max_streams` here (`_Connection`);
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
import inspect
import logging
import socket
from typing import Any, Callable, cast

import qh3.asyncio.server as _server_module
import qh3.quic.connection as _connection_module
from qh3 import tls
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
from .transport_parameters import (
    INITIAL_MAX_STREAMS_BIDI,
    INITIAL_MAX_STREAMS_UNI,
    MAX_ACK_DELAY,
    MAX_UDP_PAYLOAD_SIZE,
    with_transport_parameters,
)

__all__ = ["Qh3Engine", "LARGEST_DATAGRAM_SIZE", "QuicServer", "check_datagram_size", "client_connection",
           "configuration", "create_endpoint", "load_certificate", "server_connection", "wrap"]

#: The largest datagram sent: loopback's.
LARGEST_DATAGRAM_SIZE = LOOPBACK_DATAGRAM_SIZE


def _core_argument(name: str, position: int) -> int:
    """Where QuicConnectionCore takes argument `name` (qh3 builds it with positional
    arguments): read from its signature, `position` (qh3 2.1's) where it has none."""
    try:
        names = list(inspect.signature(_connection_module.QuicConnectionCore).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a build without text signatures
        return position
    return names.index(name)


_CORE_MAX_STREAMS_BIDI = _core_argument("local_max_streams_bidi", 21)
_CORE_MAX_STREAMS_UNI = _core_argument("local_max_streams_uni", 22)
_CORE_MAX_ACK_DELAY = _core_argument("max_ack_delay", 26)
_CAPACITY_EXHAUSTED = "packet builder capacity exhausted"
_CLOSED = "connection is closed"
# Receive buffer of the transport: the largest UDP payload, so no datagram is truncated.
_RECEIVE_BUFFER = 65536


class _TlsBridge(QuicTlsBridge):
    """qh3's TLS bridge, advertising the configured datagram size as a client too, the
    connection's stream limits and its max_ack_delay."""

    max_streams: int = 0
    max_ack_delay_ms: int = 0

    def serialize_transport_parameters(self) -> bytes:
        data = super().serialize_transport_parameters()
        values: dict[int, int] = {}
        if self.configuration.is_client and self.configuration.max_datagram_size > 1472:
            values[MAX_UDP_PAYLOAD_SIZE] = self.configuration.max_datagram_size
        if self.max_streams:
            values[INITIAL_MAX_STREAMS_BIDI] = values[INITIAL_MAX_STREAMS_UNI] = self.max_streams
        if self.max_ack_delay_ms:
            values[MAX_ACK_DELAY] = self.max_ack_delay_ms
        return with_transport_parameters(data, values) if values else data


class _Connection(QuicConnection):
    """qh3's connection with `max_streams` concurrent streams of each direction for the
    peer (in its core and in what it advertises), its max_ack_delay, and the client
    datagram size fix."""

    max_streams = 0  # 0: qh3's own limits
    max_ack_delay = 0.0  # seconds; 0: qh3's own (25 ms)
    #: True while the application holds too much: events, and with them credit, stay in the core
    withholding = False

    def _drain_core(self) -> None:
        if not self.withholding:
            super()._drain_core()

    def _create_tls(self, remote_source_cid: bytes | None) -> QuicTlsBridge:
        bridge = super()._create_tls(remote_source_cid)
        bridge.__class__ = _TlsBridge  # made by qh3 and not started yet: only the method differs
        ours = cast(_TlsBridge, bridge)
        ours.max_streams = self.max_streams
        ours.max_ack_delay_ms = round(self.max_ack_delay * 1000)
        # The parameters were encoded as the bridge was made: encode them again, ours.
        ours.tls.handshake_extensions = [
            (tls.ExtensionType.QUIC_TRANSPORT_PARAMETERS, ours.serialize_transport_parameters())
        ]
        return ours

    def _create_core(self, *args: Any, **kwargs: Any) -> None:
        if not self.max_streams and not self.max_ack_delay:
            return super()._create_core(*args, **kwargs)
        native = _connection_module.QuicConnectionCore
        limit, max_ack_delay = self.max_streams, self.max_ack_delay

        def core(*values: Any) -> Any:
            values_list = list(values)
            if limit:
                values_list[_CORE_MAX_STREAMS_BIDI] = values_list[_CORE_MAX_STREAMS_UNI] = limit
            if max_ack_delay:
                values_list[_CORE_MAX_ACK_DELAY] = max_ack_delay
            return native(*values_list)

        # qh3 builds its core with fixed positional arguments: swap the name for this call.
        _connection_module.QuicConnectionCore = core  # type: ignore[misc, assignment]  # deliberate swap
        try:
            return super()._create_core(*args, **kwargs)
        finally:
            _connection_module.QuicConnectionCore = native  # type: ignore[misc]  # and back


def _not_a_normal_close(record: logging.LogRecord) -> bool:
    """qh3 logs a WARNING whenever the peer closes, normal closes included: drop those
    with error code 0 (a close with an error still reaches the session as an event)."""
    if record.msg != "Native peer close: %r" or not isinstance(record.args, tuple) or not record.args:
        return True
    native = record.args[0]
    return not (isinstance(native, tuple) and len(native) > 2 and native[2] == 0)


_connection_module.logger.addFilter(_not_a_normal_close)


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
        if certfile is None:
            raise ValueError("a server needs a certificate")
        configuration.load_cert_chain(certfile, keyfile)


def client_connection(configuration: QuicConfiguration, settings: QuicSettings) -> "Qh3Engine":
    """A client connection, not yet connected."""
    return wrap(_Connection(configuration=configuration), settings)


def server_connection(configuration: QuicConfiguration, settings: QuicSettings,
                      original_destination_connection_id: bytes) -> "Qh3Engine":
    """A server connection for the client whose first Initial named that connection ID,
    without a socket (a server endpoint makes its own: `QuicServer`)."""
    return wrap(_Connection(configuration=configuration,
                            original_destination_connection_id=original_destination_connection_id), settings)


def wrap(quic: QuicConnection, settings: QuicSettings) -> "Qh3Engine":
    """The engine interface over a connection (made by `QuicServer` or `client_connection`)."""
    if isinstance(quic, _Connection):  # before its core and TLS exist
        quic.max_streams = settings.max_streams
        quic.max_ack_delay = settings.max_ack_delay
    return Qh3Engine(quic, settings.max_data)


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

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # qh3's server makes a new connection by its module's name: ours, for this call.
        _server_module.QuicConnection = _Connection  # type: ignore[misc]  # deliberate swap of a class
        try:
            super().datagram_received(data, addr)
        finally:
            _server_module.QuicConnection = QuicConnection  # type: ignore[misc]  # and back

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


def _unless_closed(call: Callable[..., None], *args: Any) -> None:
    """Make a call, ignoring that the connection is closing (aioquic ignores it too)."""
    try:
        call(*args)
    except QuicConnectionError as exc:
        if exc.reason_phrase != _CLOSED:
            raise


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
    credit_on_consumption = True

    def __init__(self, quic: QuicConnection, hold_limit: int) -> None:
        self.quic = quic
        self._hold_limit = hold_limit
        configuration = quic.configuration
        self.is_client: bool = configuration.is_client
        self.alpn_protocols: list[str] = list(configuration.alpn_protocols or [])
        self.max_datagram_size: int = configuration.max_datagram_size
        self.held_total = 0
        self._blocked: dict[int, list[tuple[bytes, bool]]] = {}  # streams over the peer's limit
        self.get_next_available_stream_id = quic.get_next_available_stream_id
        self.connect = quic.connect
        self.receive_datagram = quic.receive_datagram
        self.receive_datagrams = quic.receive_many_datagrams
        self.get_timer = quic.get_timer
        self.handle_timer = quic.handle_timer

    def send_ping(self, uid: int) -> None:
        # A ping on a closing connection is never acknowledged: its waiter fails when the
        # connection ends, as on aioquic, instead of the call raising.
        _unless_closed(self.quic.send_ping, uid)

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        if isinstance(self.quic, _Connection):
            self.quic.withholding = False  # a closing connection's events must come out
        self.quic.close(error_code=error_code, reason_phrase=reason_phrase)

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        blocked = self._blocked
        if blocked and stream_id in blocked:
            blocked[stream_id].append((bytes(data), end_stream))
            return
        try:
            self.quic.send_stream_data(stream_id, data, end_stream)
        except QuicConnectionError as exc:
            if exc.reason_phrase != _CLOSED:
                raise
        except ValueError as exc:
            # A stream past the peer's MAX_STREAMS: aioquic queues it until the peer
            # allows more, qh3 refuses. Its writes wait here, and go at the next transmit
            # that finds room (streams open in order, so the later ones wait too).
            if "stream limit" not in str(exc):
                raise
            blocked[stream_id] = [(bytes(data), end_stream)]

    def _send_blocked(self) -> None:
        blocked = self._blocked
        for stream_id in sorted(blocked):
            writes = blocked[stream_id]
            try:
                self.quic.send_stream_data(stream_id, writes[0][0], writes[0][1])
            except ValueError as exc:
                if "stream limit" not in str(exc):
                    raise
                return
            except QuicConnectionError as exc:
                if exc.reason_phrase != _CLOSED:
                    raise
                blocked.clear()
                return
            del blocked[stream_id]
            for data, end_stream in writes[1:]:
                self.send_stream_data(stream_id, data, end_stream)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        if self._blocked.pop(stream_id, None) is not None:
            return  # never opened: the peer has nothing to forget
        _unless_closed(self.quic.reset_stream, stream_id, error_code)

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        _unless_closed(self.quic.stop_stream, stream_id, error_code)

    def send_datagram_frame(self, data: bytes) -> None:
        _unless_closed(self.quic.send_datagram_frame, data)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        """qh3's datagrams_to_send(), keeping what was built when the core cannot build
        more now (see the module's docstring)."""
        if self._blocked:
            self._send_blocked()
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
            if type(event) is q3.StreamDataReceived:
                return qe.StreamDataReceived(event.data, event.end_stream, event.stream_id)
            convert = _EVENTS.get(type(event))
            if convert is not None:
                return convert(event)

    def buffered(self, stream_id: int) -> int:
        blocked = self._blocked.get(stream_id) if self._blocked else None
        if blocked is not None:
            return sum(len(data) for data, _ in blocked)
        return self.quic.get_send_buffer_size(stream_id)

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
        if self.held_total > self._hold_limit and isinstance(self.quic, _Connection):
            self.quic.withholding = True

    def release(self, stream_id: int, size: int) -> bool:
        self.held_total -= size
        quic = self.quic
        if isinstance(quic, _Connection) and quic.withholding and self.held_total <= self._hold_limit // 2:
            quic.withholding = False
            quic._drain_core()  # the events left in the core, and the credit they free
            return True
        return False
