"""Two MoqtSessions over in-memory QUIC connections: sans-I/O session tests."""

from __future__ import annotations

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.d18.messages import Setup
from kvsp_moq.moqt.d18.session import MoqtSession
from kvsp_moq.moqt.drafts import alpn_of
from kvsp_moq.moqt.engine import ProtocolNegotiated
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.quic.aioquic_engine import AioquicEngine

CERT = generate_self_signed()
CLIENT_ADDR = ("127.0.0.1", 1234)
SERVER_ADDR = ("127.0.0.1", 4433)


class SessionPair:
    """A client and a server MoqtSession; `exchange()` moves datagrams until quiet.

    Events each side produced accumulate in `client_events` / `server_events`.
    """

    def __init__(self, *, client_setup: Setup | None = None, server_kwargs: dict | None = None,
                 client_kwargs: dict | None = None, max_datagram_size: int = 1350,
                 client_session: bool = True, draft: int = 18) -> None:
        alpn = [alpn_of(draft)]
        self.draft = draft
        self.now = 0.0
        client_config = QuicConfiguration(is_client=True, alpn_protocols=alpn, max_datagram_size=max_datagram_size,
                                          max_datagram_frame_size=65536)
        client_config.verify_mode = 0  # ssl.CERT_NONE
        server_config = QuicConfiguration(is_client=False, alpn_protocols=alpn, max_datagram_size=max_datagram_size,
                                          max_datagram_frame_size=65536)
        server_config.certificate = CERT.certificate
        server_config.private_key = CERT.private_key
        settings = QuicSettings(engine="aioquic")
        client_quic = QuicConnection(configuration=client_config)
        self.client_quic = AioquicEngine(client_quic, settings)
        self.server_quic = AioquicEngine(
            QuicConnection(configuration=server_config,
                           original_destination_connection_id=client_quic.original_destination_connection_id),
            settings)
        self._client_setup = client_setup
        self._client_session = client_session
        self._client_kwargs = client_kwargs or {}
        self._server_kwargs = server_kwargs or {}
        self.client: MoqtSession | None = None
        self.server: MoqtSession | None = None
        self.client_events: list = []
        self.server_events: list = []
        self.client_quic.connect(SERVER_ADDR, now=self.now)
        self.exchange()

    def _drain(self, quic: AioquicEngine, is_client: bool) -> None:
        while (event := quic.next_event()) is not None:
            session = self.client if is_client else self.server
            if isinstance(event, ProtocolNegotiated) and session is None:
                if is_client and not self._client_session:
                    continue
                if is_client:
                    self.client = MoqtSession(quic, is_client=True, draft=self.draft, setup=self._client_setup,
                                              **self._client_kwargs)
                else:
                    self.server = MoqtSession(quic, is_client=False, draft=self.draft, **self._server_kwargs)
                continue
            if session is not None:
                (self.client_events if is_client else self.server_events).extend(session.handle_event(event))

    def exchange(self, rounds: int = 200) -> None:
        for _ in range(rounds):
            moved = False
            self.now += 0.001
            for quic, peer, peer_is_client, addr in (
                (self.client_quic, self.server_quic, False, CLIENT_ADDR),
                (self.server_quic, self.client_quic, True, SERVER_ADDR),
            ):
                for data, _ in quic.datagrams_to_send(now=self.now):
                    moved = True
                    peer.receive_datagram(data, addr, now=self.now)
                self._drain(peer, peer_is_client)
            self._drain(self.client_quic, True)
            self._drain(self.server_quic, False)
            if not moved:
                timer = min((t for t in (self.client_quic.get_timer(), self.server_quic.get_timer()) if t is not None),
                            default=None)
                if timer is None or timer - self.now > 0.05:
                    return
                self.now = max(self.now, timer)
                for quic, is_client in ((self.client_quic, True), (self.server_quic, False)):
                    if quic.get_timer() is not None and quic.get_timer() <= self.now:
                        quic.handle_timer(now=self.now)
                        self._drain(quic, is_client)

    def advance(self, seconds: float) -> None:
        """Let `seconds` of simulated time pass, firing timers (e.g. a close's draining period)."""
        self.now += seconds
        for quic, is_client in ((self.client_quic, True), (self.server_quic, False)):
            timer = quic.get_timer()
            if timer is not None and timer <= self.now:
                quic.handle_timer(now=self.now)
                self._drain(quic, is_client)
        self.exchange()

    def take(self, side: str) -> list:
        events = self.client_events if side == "client" else self.server_events
        out = list(events)
        events.clear()
        return out
