"""The QUIC engine as a MOQT session sees it: the events it consumes and the calls it makes.

The sans-I/O sessions (`d18.session`, `d14.session`) never import a QUIC engine. They read
the events below and write through `QuicEngine`, a handful of calls named as aioquic
names them. One adapter per engine (`kvsp_moq.moqt.quic.aioquic_engine`,
`kvsp_moq.moqt.quic.qh3_engine`) turns that engine's events into these and adds what
the asyncio binding needs (`EngineConnection`): datagrams in and out, timers, pings,
and how much a stream still holds, for backpressure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

__all__ = [
    "ConnectionIdIssued",
    "ConnectionIdRetired",
    "ConnectionTerminated",
    "DatagramFrameReceived",
    "EngineConnection",
    "HandshakeCompleted",
    "PingAcknowledged",
    "ProtocolNegotiated",
    "QuicEngine",
    "QuicEvent",
    "StopSendingReceived",
    "StreamDataReceived",
    "StreamReset",
    "stream_is_unidirectional",
]

NetworkAddress = Any


def stream_is_unidirectional(stream_id: int) -> bool:
    """RFC 9000 section 2.1: the second least significant bit marks a unidirectional stream."""
    return bool(stream_id & 2)


@dataclass(slots=True)
class StreamDataReceived:
    """Bytes of a stream, in order."""

    data: bytes
    """The bytes, following those of the previous event of the stream."""
    end_stream: bool
    """Whether the stream ends with these bytes (FIN)."""
    stream_id: int
    """The stream."""


@dataclass(slots=True)
class StreamReset:
    """The peer reset a stream it sends on (RESET_STREAM)."""

    error_code: int
    """The application error code."""
    stream_id: int
    """The stream."""


@dataclass(slots=True)
class StopSendingReceived:
    """The peer asked us to stop sending on a stream (STOP_SENDING)."""

    error_code: int
    """The application error code."""
    stream_id: int
    """The stream."""


@dataclass(slots=True)
class DatagramFrameReceived:
    """A DATAGRAM frame (RFC 9221)."""

    data: bytes
    """Its payload."""


@dataclass(slots=True)
class ProtocolNegotiated:
    """ALPN is chosen: the session of that draft can start."""

    alpn_protocol: str | None
    """The negotiated ALPN, None when there is none."""


@dataclass(slots=True)
class HandshakeCompleted:
    """The TLS handshake is complete."""

    alpn_protocol: str | None
    """The negotiated ALPN."""


@dataclass(slots=True)
class PingAcknowledged:
    """A PING of ours was acknowledged."""

    uid: int
    """The identifier given to `EngineConnection.send_ping`."""


@dataclass(slots=True)
class ConnectionTerminated:
    """The QUIC connection ended (closed by either side, or idle)."""

    error_code: int
    """The error code of the CONNECTION_CLOSE."""
    frame_type: int | None
    """The frame type that caused a transport error, if any."""
    reason_phrase: str
    """The reason given."""


@dataclass(slots=True)
class ConnectionIdIssued:
    """A connection ID of ours a server must route to this connection."""

    connection_id: bytes
    """The connection ID."""


@dataclass(slots=True)
class ConnectionIdRetired:
    """A connection ID of ours that no longer routes here."""

    connection_id: bytes
    """The connection ID."""


QuicEvent = Union[
    StreamDataReceived,
    StreamReset,
    StopSendingReceived,
    DatagramFrameReceived,
    ProtocolNegotiated,
    HandshakeCompleted,
    PingAcknowledged,
    ConnectionTerminated,
    ConnectionIdIssued,
    ConnectionIdRetired,
]


class QuicEngine(Protocol):
    """What a sans-I/O MOQT session calls on its QUIC connection."""

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        """The ID the next stream we open gets (opened by its first send)."""

    def send_stream_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None:
        """Queue bytes on a stream; the engine keeps them until acknowledged."""

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """RESET_STREAM: abandon what we send on a stream."""

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        """STOP_SENDING: ask the peer to abandon a stream it sends on."""

    def send_datagram_frame(self, data: bytes) -> None:
        """Queue a DATAGRAM frame."""

    def close(self, error_code: int = 0, reason_phrase: str = "") -> None:
        """Close the connection (CONNECTION_CLOSE with an application error code)."""


class EngineConnection(QuicEngine, Protocol):
    """What the asyncio binding drives: a `QuicEngine` plus I/O, timers and buffer state."""

    is_client: bool
    #: the ALPNs this side offers (a client) or accepts (a server), most preferred first
    alpn_protocols: list[str]
    #: the largest UDP payload this side sends
    max_datagram_size: int
    #: whether the engine extends receive credit only for bytes `release()`d
    credit_on_consumption: bool

    def connect(self, addr: NetworkAddress, now: float) -> None:
        """Start the handshake (client)."""

    def receive_datagram(self, data: bytes, addr: NetworkAddress, now: float) -> None:
        """One UDP datagram arrived."""

    def receive_datagrams(self, datagrams: list[bytes], addr: NetworkAddress, now: float) -> None:
        """Several UDP datagrams from one address arrived (GRO, recvmmsg)."""

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, NetworkAddress]]:
        """The datagrams to send now."""

    def get_timer(self) -> float | None:
        """When `handle_timer` must run next (loop time), None for never."""

    def handle_timer(self, now: float) -> None:
        """Run the engine's timers (loss detection, idle, ACK delay)."""

    def next_event(self) -> QuicEvent | None:
        """The next event, translated into ours; None when there is none."""

    def send_ping(self, uid: int) -> None:
        """Send a PING; `PingAcknowledged(uid)` follows its acknowledgement."""

    def buffered(self, stream_id: int) -> int:
        """Bytes the engine holds for a stream of ours, counted against its writer's budget."""

    def delivered(self, stream_id: int) -> bool:
        """Whether everything written on a stream of ours (and its FIN) was acknowledged,
        or the stream is gone: a delivery timeout then has nothing left to reset."""

    def hold(self, stream_id: int, size: int) -> None:
        """`size` received bytes of a stream are handed to the application, not consumed."""

    def release(self, stream_id: int, size: int) -> bool:
        """Held bytes are consumed; True when that frees credit worth announcing now, or
        lets events the engine held back out (the caller then handles events and transmits)."""
