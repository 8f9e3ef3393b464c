"""Two sans-I/O MOQT sessions over in-memory QUIC connections: the one harness of the
session tests, for every draft (the session class is the draft's) and both QUIC engines.

The engine is `engine=` or, left out, the one the `pair_engine` fixture
(tests/moqt/conftest.py) chose for the test: modules that mark their tests with it run
each test on aioquic and on qh3. With `client_session=False` the client is a bare QUIC
endpoint writing raw bytes (`send`, `raw_control`), and what it receives is kept per
stream (`raw`, `fins`, `resets`), so what a session puts on the wire can be checked byte
for byte."""

from __future__ import annotations

from typing import Any, Callable

from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.drafts import session_class
from kvsp_moq.moqt.engine import ProtocolNegotiated, QuicEngine, StreamDataReceived, StreamReset
from kvsp_moq.moqt.quic import QuicSettings
from kvsp_moq.moqt.quic.settings import engine_module

CERT = generate_self_signed()
CLIENT_ADDR = ("127.0.0.1", 1234)
SERVER_ADDR = ("127.0.0.1", 4433)
ENGINES = ("aioquic", "qh3")

#: The engine of pairs made without `engine=`: set per test by the `pair_engine` fixture.
default_engine = "aioquic"


class SessionPair:
    """A client and a server session of `draft`; `exchange()` moves datagrams until quiet.

    Events each side produced accumulate in `client_events` / `server_events`.
    `on_client` is called with the client session as soon as it exists (before SETUP
    is answered).
    """

    def __init__(self, *, draft: int = 18, engine: str | None = None, client_setup: m.Setup | None = None,
                 server_kwargs: dict | None = None, client_kwargs: dict | None = None,
                 max_datagram_size: int = 1350, client_session: bool = True,
                 on_client: Callable[[Any], object] | None = None) -> None:
        self.draft = draft
        self.engine = engine or default_engine
        self.now = 0.0
        settings = QuicSettings(engine=self.engine, max_datagram_size=max_datagram_size,
                                max_datagram_frame_size=65536)
        module = engine_module(self.engine)
        client_config = settings.quic_configuration(is_client=True, drafts=[draft], verify_mode=0)  # CERT_NONE
        server_config = settings.quic_configuration(is_client=False, drafts=[draft])
        module.load_certificate(server_config, CERT, None, None)
        self.client_quic: QuicEngine = module.client_connection(client_config, settings)
        self.server_quic: QuicEngine = module.server_connection(
            server_config, settings, self.client_quic.quic.original_destination_connection_id)
        self._session_class = session_class(draft)
        self._client_setup = client_setup
        self._client_session = client_session
        self._on_client = on_client
        self._client_kwargs = client_kwargs or {}
        self._server_kwargs = server_kwargs or {}
        self.client: Any = None
        self.server: Any = None
        self.client_events: list = []
        self.server_events: list = []
        self.raw: dict[int, bytearray] = {}  # a bare client: bytes received, by stream
        self.fins: set[int] = set()
        self.resets: dict[int, int] = {}
        self.client_quic.connect(SERVER_ADDR, now=self.now)
        self.exchange()

    def _new_session(self, quic: QuicEngine, is_client: bool) -> Any:
        kwargs = dict(self._client_kwargs if is_client else self._server_kwargs)
        if is_client and self._client_setup is not None:
            kwargs["setup"] = self._client_setup
        return self._session_class(quic, is_client=is_client, draft=self.draft, **kwargs)

    def _drain(self, quic: QuicEngine, is_client: bool) -> None:
        while (event := quic.next_event()) is not None:
            session = self.client if is_client else self.server
            if is_client and not self._client_session:
                if isinstance(event, StreamDataReceived):
                    self.raw.setdefault(event.stream_id, bytearray()).extend(event.data)
                    if event.end_stream:
                        self.fins.add(event.stream_id)
                elif isinstance(event, StreamReset):
                    self.resets[event.stream_id] = event.error_code
                continue
            if isinstance(event, ProtocolNegotiated) and session is None:
                session = self._new_session(quic, is_client)
                if is_client:
                    self.client = session
                    if self._on_client is not None:
                        self._on_client(session)
                else:
                    self.server = session
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

    # -- a bare client -----------------------------------------------------------

    def send(self, data: bytes, *, bidi: bool = True, end_stream: bool = False, stream_id: int | None = None) -> int:
        """Write raw bytes from the client on a new stream (or `stream_id`); returns the stream."""
        if stream_id is None:
            stream_id = self.client_quic.get_next_available_stream_id(is_unidirectional=not bidi)
        self.client_quic.send_stream_data(stream_id, data, end_stream=end_stream)
        self.exchange()
        return stream_id

    def raw_control(self, *messages: Any) -> None:
        """Write messages on the client session's control stream behind its back."""
        assert self.client is not None
        sid = self.client._control_stream_id
        assert sid is not None
        self.client_quic.send_stream_data(sid, b"".join(msg.encode() for msg in messages))
        self.exchange()

    def messages_on(self, stream_id: int) -> list[m.Message]:
        """The draft-18-family control messages the server wrote on a stream to a bare client."""
        parser = m.ControlStreamParser(self.draft)
        messages = parser.feed(bytes(self.raw.get(stream_id, b"")))
        assert parser.buffered == 0
        return messages
