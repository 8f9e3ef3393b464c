"""Two sans-I/O QUIC engines joined by a simulated link, on a virtual clock.

What an engine's loss recovery, congestion control and pacing allow, apart from what the CPU
allows: each direction of the link has a rate (datagrams queue behind each other), a one-way
delay and a probability of dropping each datagram; time jumps from one arrival or engine
timer to the next, so the figures are the same on any machine and for any seed.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from kvsp_moq.moqt.certs import SelfSignedCertificate, generate_self_signed
from kvsp_moq.moqt.engine import EngineConnection, HandshakeCompleted, QuicEvent
from kvsp_moq.moqt.quic.settings import QuicSettings, engine_module

__all__ = ["LinkDirection", "VirtualLink"]

CLIENT_ADDR = ("10.0.0.1", 50000)
SERVER_ADDR = ("10.0.0.2", 4443)
ALPN = "kvsp-virtual-link"
#: the smallest step of the clock, in seconds
TICK = 1e-6

_certificate: SelfSignedCertificate | None = None


def _server_certificate() -> SelfSignedCertificate:
    global _certificate
    if _certificate is None:
        _certificate = generate_self_signed()
    return _certificate


@dataclass
class LinkDirection:
    """One direction of the link: what leaves one end for the other."""

    #: octets per second; datagrams queue behind each other
    rate: float = 125e6
    #: seconds from the end of a datagram's serialization to its arrival
    delay: float = 50e-6
    #: probability that a datagram is dropped
    loss: float = 0.0
    #: the next datagrams to drop whatever `loss` says
    drop_next: int = 0
    sent: int = 0
    dropped: int = 0
    #: when the last queued datagram has left
    free_at: float = 0.0


@dataclass(order=True)
class _Arrival:
    at: float
    seq: int
    to_server: bool = field(compare=False)
    data: bytes = field(compare=False)


class VirtualLink:
    """A client and a server engine (`server_engine`, `client_engine`: "qh3" or "aioquic")
    whose datagrams cross `up` (client to server) and `down` (server to client). The client
    connects at time 0; `advance()` moves the clock to the next thing that happens."""

    def __init__(self, server_engine: str, client_engine: str, *, up: LinkDirection | None = None,
                 down: LinkDirection | None = None, seed: int = 1, datagram_size: int = 1452,
                 server_settings: QuicSettings | None = None, client_settings: QuicSettings | None = None,
                 on_event: Callable[[bool, QuicEvent], None] | None = None) -> None:
        self.up, self.down = up or LinkDirection(), down or LinkDirection()
        self.now = 0.0
        self.random = random.Random(seed)
        self.datagram_size = datagram_size
        self.server_settings = server_settings or QuicSettings(engine=server_engine, max_datagram_size=datagram_size)
        client_settings = client_settings or QuicSettings(engine=client_engine, max_datagram_size=datagram_size)
        self.on_event = on_event
        self.server_handshake_done = False
        self._server_module = engine_module(server_engine)
        client_module = engine_module(client_engine)
        configuration = client_module.configuration(client_settings, is_client=True, alpn_protocols=[ALPN],
                                                    max_datagram_size=datagram_size, verify_mode=0)
        self.client: EngineConnection = client_module.client_connection(configuration, client_settings)
        self.server: EngineConnection | None = None
        self._in_flight: list[_Arrival] = []
        self._seq = 0
        self.client.connect(SERVER_ADDR, now=self.now)
        self._transmit()

    def _make_server(self, first: bytes) -> EngineConnection:
        module = self._server_module
        configuration = module.configuration(self.server_settings, is_client=False, alpn_protocols=[ALPN],
                                             max_datagram_size=self.datagram_size)
        module.load_certificate(configuration, _server_certificate(), None, None)
        # RFC 9000 section 17.2: a long header's destination connection ID length is octet 5.
        destination_cid = first[6:6 + first[5]]
        return module.server_connection(configuration, self.server_settings, destination_cid)

    def _send(self, engine: EngineConnection, direction: LinkDirection, to_server: bool) -> int:
        count = 0
        for data, _ in engine.datagrams_to_send(now=self.now):
            count += 1
            direction.sent += 1
            leaves = max(self.now, direction.free_at) + len(data) / direction.rate
            direction.free_at = leaves
            if direction.drop_next:
                direction.drop_next -= 1
            elif not direction.loss or self.random.random() >= direction.loss:
                self._seq += 1
                heapq.heappush(self._in_flight, _Arrival(leaves + direction.delay, self._seq, to_server, data))
                continue
            direction.dropped += 1
        return count

    def _transmit(self) -> int:
        """Both ends send what they may now; the server's datagram count."""
        self._send(self.client, self.up, True)
        return self._send(self.server, self.down, False) if self.server is not None else 0

    def _drain(self, engine: EngineConnection, is_server: bool) -> None:
        while (event := engine.next_event()) is not None:
            if is_server and isinstance(event, HandshakeCompleted):
                self.server_handshake_done = True
            if self.on_event is not None:
                self.on_event(is_server, event)

    def next_time(self) -> float | None:
        """When something happens next: an arrival or an engine's timer."""
        times = [self._in_flight[0].at] if self._in_flight else []
        for engine in (self.client, self.server):
            timer = engine.get_timer() if engine is not None else None
            if timer is not None:
                times.append(timer)
        return min(times) if times else None

    def advance(self) -> int:
        """Move the clock to the next event, deliver what arrives, run due timers, and let
        both ends send: the server's datagram count. 0 with nothing left to happen."""
        at = self.next_time()
        if at is None:
            return 0
        # A real clock moves on between two wake-ups: an engine whose timer is due but which
        # finds, in floating point, that it is not yet would otherwise be woken forever.
        self.now = at if at > self.now else self.now + TICK
        while self._in_flight and self._in_flight[0].at <= self.now:
            arrival = heapq.heappop(self._in_flight)
            if arrival.to_server:
                if self.server is None:
                    self.server = self._make_server(arrival.data)
                self.server.receive_datagram(arrival.data, CLIENT_ADDR, now=self.now)
            else:
                self.client.receive_datagram(arrival.data, SERVER_ADDR, now=self.now)
        for engine in (self.client, self.server):
            if engine is not None:
                timer = engine.get_timer()
                if timer is not None and timer <= self.now:
                    engine.handle_timer(now=self.now)
        self._drain(self.client, False)
        if self.server is not None:
            self._drain(self.server, True)
        return self._transmit()

    def run_until(self, done: Callable[[], bool], *, seconds: float, steps: int = 5_000_000) -> bool:
        """Advance until `done()` (True) or for `seconds` of virtual time / `steps` events (False).
        What the application wrote since the last step is sent first."""
        end = self.now + seconds
        self._transmit()
        for _ in range(steps):
            if done():
                return True
            at = self.next_time()
            if at is None or at > end:  # the clock stops at `end`, not at the next timer
                self.now = max(self.now, end) if at is not None else self.now
                return False
            self.advance()
        return done()

    def sender_state(self) -> dict[str, Any]:
        """The server's congestion window, smoothed RTT and, where the engine counts them,
        packets declared lost and probe timeouts."""
        quic: Any = getattr(self.server, "quic", None)
        core = getattr(quic, "_core", None)
        if core is not None:  # qh3
            return {"cwnd": core.congestion_window, "srtt_ms": round((core.smoothed_rtt or 0.0) * 1e3, 3),
                    "lost": core.loss_total, "pto": core.pto_total}
        loss = getattr(quic, "_loss", None)
        if loss is not None:  # aioquic
            return {"cwnd": loss.congestion_window, "srtt_ms": round(loss._rtt_smoothed * 1e3, 3),
                    "pto": loss._pto_count}
        return {}
