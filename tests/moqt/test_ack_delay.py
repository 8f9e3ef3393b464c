"""max_ack_delay: what each engine advertises is what its peer waits for before probing a lost
last packet (RFC 9002 section 6.2), measured on a virtual clock between sans-I/O engines."""

from __future__ import annotations

import pytest

from kvsp_moq.bench.virtual_link import VirtualLink
from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.quic import QuicSettings


def probe_after_a_lost_last_packet(server_engine: str, client_engine: str, client_max_ack_delay: float) -> float:
    """Seconds from the server's lost last packet to the next packet it sends (its probe)."""
    link = VirtualLink(server_engine, client_engine,
                       client_settings=QuicSettings(engine=client_engine, max_datagram_size=1452,
                                                    max_ack_delay=client_max_ack_delay))
    assert link.run_until(lambda: link.server_handshake_done, seconds=1.0)
    link.run_until(lambda: False, seconds=0.2)  # RTT estimates settled, nothing in flight
    assert link.server is not None
    stream_id = link.server.get_next_available_stream_id(is_unidirectional=True)
    link.server.send_stream_data(stream_id, b"x" * 100, end_stream=True)
    link.down.drop_next = 1
    sent = link.down.sent
    assert link.run_until(lambda: link.down.sent > sent, seconds=0.1)  # it may wait for its pacer
    assert link.down.dropped == 1
    lost_at = link.now
    assert link.run_until(lambda: link.down.sent > sent + 1, seconds=1.0), "no probe within a second"
    return link.now - lost_at


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
