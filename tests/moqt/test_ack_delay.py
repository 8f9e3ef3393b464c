"""max_ack_delay: what each engine advertises is what its peer waits for before probing a lost
last packet (RFC 9002 section 6.2), measured on a virtual clock between sans-I/O engines."""

from __future__ import annotations

from typing import Any

import pytest

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.quic.settings import engine_module

CERT = generate_self_signed()
CLIENT_ADDR = ("10.0.0.1", 50000)
SERVER_ADDR = ("10.0.0.2", 4443)
#: one way across the virtual link, in seconds
DELAY = 50e-6
TICK = 50e-6


class Link:
    """A client and a server engine joined by a virtual link that can drop what one sends."""

    def __init__(self, server_engine: str, client_engine: str, client_max_ack_delay: float) -> None:
        server_settings = QuicSettings(engine=server_engine, max_datagram_size=1452)
        client_settings = QuicSettings(engine=client_engine, max_datagram_size=1452,
                                       max_ack_delay=client_max_ack_delay)
        self.now = 0.0
        client_module = engine_module(client_engine)
        configuration = client_module.configuration(client_settings, is_client=True, alpn_protocols=["x"],
                                                    max_datagram_size=1452, verify_mode=0)
        self.client = client_module.client_connection(configuration, client_settings)
        self.server_module = engine_module(server_engine)
        self.server_settings = server_settings
        self.server: Any = None
        self.in_flight: list[tuple[float, str, bytes]] = []
        self.client.connect(SERVER_ADDR, now=self.now)

    def _server_for(self, first: bytes) -> Any:
        module = self.server_module
        configuration = module.configuration(self.server_settings, is_client=False, alpn_protocols=["x"],
                                             max_datagram_size=1452)
        module.load_certificate(configuration, CERT, None, None)
        cid = first[6:6 + first[5]]  # an Initial's destination connection ID
        if module.__name__.endswith("qh3_engine"):
            quic = module._Connection(configuration=configuration, original_destination_connection_id=cid)
        else:
            from aioquic.quic.connection import QuicConnection
            quic = QuicConnection(configuration=configuration, original_destination_connection_id=cid)
        return module.wrap(quic, self.server_settings)

    def send(self, *, drop_server: bool = False) -> int:
        """Put what both ends want to send on the link; what the server sends is dropped
        with `drop_server`. The server's datagrams, counted."""
        sent = 0
        for data, _ in self.client.datagrams_to_send(now=self.now):
            self.in_flight.append((self.now + DELAY, "server", data))
        if self.server is not None:
            for data, _ in self.server.datagrams_to_send(now=self.now):
                sent += 1
                if not drop_server:
                    self.in_flight.append((self.now + DELAY, "client", data))
        return sent

    def step(self) -> None:
        self.now += TICK
        arrived = [d for d in self.in_flight if d[0] <= self.now]
        self.in_flight = [d for d in self.in_flight if d[0] > self.now]
        for _, to, data in arrived:
            if to == "server":
                if self.server is None:
                    self.server = self._server_for(data)
                self.server.receive_datagram(data, CLIENT_ADDR, now=self.now)
            else:
                self.client.receive_datagram(data, SERVER_ADDR, now=self.now)
        for engine in (self.client, self.server):
            if engine is not None:
                timer = engine.get_timer()
                if timer is not None and timer <= self.now:
                    engine.handle_timer(now=self.now)
                while engine.next_event() is not None:
                    pass

    def settle(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.send()
            self.step()


def probe_after_a_lost_last_packet(server_engine: str, client_engine: str, client_max_ack_delay: float) -> float:
    """Seconds from the server's lost last packet to the next packet it sends (its probe)."""
    link = Link(server_engine, client_engine, client_max_ack_delay)
    link.settle(0.2)  # handshake done, RTT estimates settled
    assert link.server is not None
    stream_id = link.server.get_next_available_stream_id(is_unidirectional=True)
    link.server.send_stream_data(stream_id, b"x" * 100, end_stream=True)
    while not link.send(drop_server=True):  # it may wait for its pacer
        link.step()
        assert link.now < 1.0
    lost_at = link.now
    while link.now - lost_at < 1.0:
        link.step()
        if link.send():
            return link.now - lost_at
    raise AssertionError("no probe within a second")


@pytest.mark.parametrize("server_engine, client_engine",
                         [("qh3", "qh3"), ("qh3", "aioquic"), ("aioquic", "qh3"), ("aioquic", "aioquic")])
def test_a_lost_last_packet_is_probed_after_the_max_ack_delay_its_receiver_advertises(
        server_engine: str, client_engine: str) -> None:
    default = QuicSettings().max_ack_delay
    quick = probe_after_a_lost_last_packet(server_engine, client_engine, default)
    slow = probe_after_a_lost_last_packet(server_engine, client_engine, 0.025)
    # PTO = smoothed RTT + max(4 x RTT variation, 1 ms) + the receiver's max_ack_delay
    assert default <= quick < default + 0.006
    assert 0.025 <= slow < 0.031
    assert slow - quick == pytest.approx(0.025 - default, abs=0.001)


@pytest.mark.parametrize("value", [0.0, 0.0005, 16.384])
def test_a_max_ack_delay_the_engines_cannot_keep_or_quic_cannot_carry_is_refused(value: float) -> None:
    with pytest.raises(SettingError, match="max_ack_delay"):
        QuicSettings(max_ack_delay=value)
