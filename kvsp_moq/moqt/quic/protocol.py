"""One QUIC connection on asyncio, whatever the engine: datagrams in and out, timers, pings.

The shape is aioquic's QuicConnectionProtocol (and qh3's, its fork), so both engines'
servers can demultiplex datagrams to it; it drives an `EngineConnection` instead of
one engine's QuicConnection. A transport that sends several datagrams in one call
(`sendto_many`, qh3's GSO transport) gets them in one batch, and one that receives
several (`datagrams_received`, GRO or recvmmsg) hands them over together.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Literal, cast

from ..engine import (
    ConnectionIdIssued,
    ConnectionIdRetired,
    ConnectionTerminated,
    EngineConnection,
    HandshakeCompleted,
    PingAcknowledged,
    QuicEvent,
)

__all__ = ["QuicProtocol"]


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's failure as seen (its caller may have stopped waiting for it)."""
    if not future.cancelled():
        future.exception()


#: what a liveness probe found (`QuicProtocol.liveness`)
Liveness = Literal["answered", "sending", "silent"]


class QuicProtocol(asyncio.DatagramProtocol):
    """Drives one engine connection: subclasses handle its events in `quic_event_received`."""

    def __init__(self, quic: EngineConnection) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._quic = quic
        self._closed = asyncio.Event()
        self._connected = False
        self._ping_waiters: dict[int, asyncio.Future[None]] = {}
        #: the event loop's time when the last datagram from the peer arrived (None: none yet)
        self.last_received: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._transmit_task: asyncio.Handle | None = None
        self._process_task: asyncio.Handle | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._sendto_many: Callable[[list[bytes], Any], None] | None = None
        # set by the engines' servers, which route connection IDs to this protocol
        self._connection_id_issued_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_id_retired_handler: Callable[[bytes], None] = lambda cid: None
        self._connection_terminated_handler: Callable[[], None] = lambda: None

    @property
    def quic(self) -> EngineConnection:
        """The engine connection."""
        return self._quic

    def connect(self, addr: Any) -> None:
        """Start the handshake (client)."""
        self._quic.connect(addr, now=self._loop.time())
        self.transmit()

    async def ping(self) -> None:
        """QUIC PING and wait for its acknowledgement (ConnectionError if the connection ends).

        A waiter its caller gave up on (a probe's timeout) has its failure retrieved when
        the connection ends, instead of asyncio reporting "Future exception was never
        retrieved" for every vanished peer."""
        if self._closed.is_set():
            raise ConnectionError("connection closed")
        waiter = self._loop.create_future()
        waiter.add_done_callback(_retrieve)
        uid = id(waiter)
        self._ping_waiters[uid] = waiter
        self._quic.send_ping(uid)
        self.transmit()
        await asyncio.shield(waiter)

    def transmit(self) -> None:
        """Send what the engine has to send and re-arm its timer."""
        self._transmit_task = None
        transport = self._transport
        if transport is None:
            return
        datagrams = self._quic.datagrams_to_send(now=self._loop.time())
        if datagrams:
            sendto_many = self._sendto_many
            if sendto_many is not None and len(datagrams) > 1:
                batch: list[bytes] = []
                batch_addr: Any = None
                for data, addr in datagrams:
                    if batch and addr != batch_addr:
                        sendto_many(batch, batch_addr)
                        batch = []
                    batch.append(data)
                    batch_addr = addr
                sendto_many(batch, batch_addr)
            else:
                for data, addr in datagrams:
                    transport.sendto(data, addr)
        timer_at = self._quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at

    def transmit_soon(self) -> None:
        """Transmit at the end of this loop iteration: one batch for everything queued."""
        if self._transmit_task is None:
            self._transmit_task = self._loop.call_soon(self.transmit)

    def process_soon(self) -> None:
        """Handle the engine's pending events and transmit, at the end of this loop
        iteration: consumed bytes may have freed credit, or events the engine held back."""
        if self._process_task is None:
            self._process_task = self._loop.call_soon(self._process_and_transmit)

    def _process_and_transmit(self) -> None:
        self._process_task = None
        if self._transport is None:
            return
        self._process_events()
        self.transmit()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- asyncio.DatagramProtocol ------------------------------------------

    async def liveness(self, timeout: float) -> Liveness:
        """Whether the peer is still there: "answered" (it acknowledged a PING within
        `timeout`), "sending" (it did not, but datagrams from it kept arriving) or "silent".
        A PING or its ACK lost on a lossy path, or queued behind a transfer, is not a lost
        machine: a liveness probe that closed a "sending" session would fail the transfers it
        carries. ConnectionError when the connection ends."""
        sent = self._loop.time()
        try:
            await asyncio.wait_for(self.ping(), timeout)
            return "answered"
        except asyncio.TimeoutError:
            heard = self.last_received
            return "sending" if heard is not None and heard > sent else "silent"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)  # a datagram endpoint's
        self._sendto_many = getattr(transport, "sendto_many", None)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        # Transmit once at the end of the loop iteration: one batch (and one ACK) for a
        # burst of datagrams.
        self.last_received = now = self._loop.time()
        self._quic.receive_datagram(data, addr, now=now)
        self._process_events()
        self.transmit_soon()

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        self.last_received = now = self._loop.time()
        self._quic.receive_datagrams(datagrams, addr, now=now)
        self._process_events()
        self.transmit_soon()

    # -- events --------------------------------------------------------------

    def quic_event_received(self, event: QuicEvent) -> None:
        """Handle one engine event (after the bookkeeping here)."""

    def _handle_timer(self) -> None:
        now = max(self._timer_at or 0.0, self._loop.time())
        self._timer = None
        self._timer_at = None
        self._quic.handle_timer(now=now)
        self._process_events()
        self.transmit()

    def _process_events(self) -> None:
        quic = self._quic
        handle = self.quic_event_received
        event = quic.next_event()
        while event is not None:
            kind = type(event)  # compared, not isinstance'd: this runs for every event
            if kind is PingAcknowledged:
                waiter = self._ping_waiters.pop(cast(PingAcknowledged, event).uid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif kind is ConnectionIdIssued:
                self._connection_id_issued_handler(cast(ConnectionIdIssued, event).connection_id)
            elif kind is ConnectionIdRetired:
                self._connection_id_retired_handler(cast(ConnectionIdRetired, event).connection_id)
            elif kind is ConnectionTerminated:
                self._connection_terminated_handler()
                for waiter in self._ping_waiters.values():
                    if not waiter.done():
                        waiter.set_exception(ConnectionError("connection closed"))
                self._ping_waiters.clear()
                self._closed.set()
            elif kind is HandshakeCompleted:
                self._connected = True
            handle(event)
            event = quic.next_event()
