"""A MOQT session over one QUIC connection, without I/O (in the style of H3Connection).

`handle_event()` takes each QUIC event and returns MOQT events; the other methods
write into the QuicConnection, and the caller transmits. Nothing here touches a
socket, a clock or an event loop. `session.base.SessionBase` holds what every
draft's session shares; `MoqtSession` hands it draft-18's wire forms of data
(`dialect.Dialect18`) and owns draft-18's parts as objects: the state and teardown of
request streams, with the fills of drafts 20 and 22 (`request_streams.RequestStreams`,
`fill.Fills`), what it sends (`sending.MessageSender`, the session's `Messages`), the
control messages received (`control.ControlReceiver`) and stream routing
(`streams.StreamRouting`); this module builds them and hands the hooks of
`SessionBase` to them.

Stream layout in draft-18 (section 3.3):

* each endpoint opens one unidirectional control stream whose first bytes are its
  SETUP message (type 0x2F00, which doubles as the stream type); afterwards only
  GOAWAY may appear on it;
* every request (SUBSCRIBE, PUBLISH, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE,
  SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS) opens its own bidirectional stream; all
  answers and later messages of that request (REQUEST_OK, SUBSCRIBE_OK,
  REQUEST_UPDATE, PUBLISH_DONE, NAMESPACE, ...) travel on it, without a Request ID;
  answers to REQUEST_UPDATEs come back in the order the updates were sent;
* objects travel on unidirectional data streams and datagrams.

Requests are cancelled by resetting / STOP_SENDING their stream (there are no
cancel messages in draft-18). Draft-18 has no MAX_REQUEST_ID: the QUIC stream
limits bound concurrent requests. Request IDs are even from the client and odd
from the server, starting at 0 and 1, incremented by 2 (section 10.1); a wrong
parity or a repeated ID closes the session with INVALID_REQUEST_ID.

Interpretations of points the draft leaves open:

* A FIN from the publisher on a PUBLISH_NAMESPACE stream withdraws the namespace,
  as a reset does (the stream can carry nothing further from it).
* A FIN from the requester on a SUBSCRIBE_NAMESPACE or SUBSCRIBE_TRACKS stream
  cancels it (section 6.1 says so); on other request streams a requester FIN only
  means it will send no REQUEST_UPDATE.
* A reference to an unregistered token alias closes the session with
  UNKNOWN_AUTH_TOKEN_ALIAS: the draft says to "reject the message" with that code,
  but it exists only as a session close code.
* A GOAWAY on the control stream without its Request ID is accepted.
* A joining FETCH whose SUBSCRIBE is still pending is held (section 10.12.2 says
  the publisher buffers it) and released as a FetchReceived event when
  subscribe_ok() is called; `take_events()` returns it. If the SUBSCRIBE is
  refused or cancelled instead, the FETCH is refused with
  INVALID_JOINING_REQUEST_ID. No timer runs here: a held FETCH waits as long as
  its SUBSCRIBE does, and the caller bounds how long that is.
"""

from __future__ import annotations

from typing import Iterable

from .. import events as ev
from ..engine import QuicEngine, QuicEvent, StopSendingReceived, StreamDataReceived, StreamReset
from ..session.base import SessionBase
from ..session.records import IncomingDataStream
from ..wire import DEFAULT_MAX_OBJECT_SIZE, AuthToken
from .control import ControlReceiver
from .data import FetchStreamWriter, encode_padding_stream
from .dialect import Dialect18
from .messages import Fetch, Setup
from .profiles import profile
from .request_state import FillState, Request18, RequestStream
from .request_streams import RequestStreams
from .sending import MessageSender
from .streams import StreamRouting

__all__ = ["MoqtSession"]


class MoqtSession(SessionBase[Request18]):
    """The MOQT state of one QUIC connection.

    `setup` holds the Setup Options to send; a client should set `path` and
    `authority` from the URI (section 9.3). SETUP is written when the session is
    created, like H3Connection's settings, so create it once ALPN is known.

    `accept_path` / `accept_authority`, on a server, restrict the PATH and AUTHORITY
    a client may ask for (None accepts any).
    """

    def __init__(
        self,
        quic: QuicEngine,
        *,
        is_client: bool,
        draft: int = 18,
        setup: Setup | None = None,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        max_auth_token_cache_size: int = 0,
        max_buffered_before_setup: int = 4 * 1024 * 1024,
        max_unmatched_stream_bytes: int = 16 * 1024 * 1024,
        accept_path: Iterable[str] | None = None,
        accept_authority: Iterable[str] | None = None,
    ) -> None:
        self.profile = profile(draft)
        super().__init__(
            quic,
            is_client=is_client,
            draft=draft,
            setup=setup,
            dialect=Dialect18(self.profile),
            max_object_size=max_object_size,
            max_auth_token_cache_size=max_auth_token_cache_size,
            max_buffered_before_setup=max_buffered_before_setup,
            max_unmatched_stream_bytes=max_unmatched_stream_bytes,
            accept_path=accept_path,
            accept_authority=accept_authority,
        )
        self._control_stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
        self._streams = self._ends = RequestStreams(self)
        self._fills = self._streams.fills  # drafts 20 and 22
        self._sender = self._messages = MessageSender(self, self._streams)
        self._control = ControlReceiver(self, self._streams, self._sender)
        self._routing = StreamRouting(self, self._streams, self._control)
        quic.send_stream_data(self._control_stream_id, self.local_setup.encode(draft))

    # ------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------

    @property
    def joins_by_fetch(self) -> bool:
        """Whether a subscriber may join a subscription by FETCH (drafts 20 and 22 fill it
        within the SUBSCRIBE instead)."""
        return not self.profile.location_filter

    def request_stream_id(self, request_id: int) -> int | None:
        """The stream of a request; None for an unknown one or a fill, which has none."""
        request = self._requests.get(request_id)
        return request.stream_id if isinstance(request, RequestStream) else None

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    def write_fetch_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False, end_stream: bool = False
    ) -> None:
        stream = self._sending.new_object(stream_id, fetch=True)
        writer = stream.writer
        assert isinstance(writer, FetchStreamWriter)  # new_object() checked it is the fetch writer
        marker = writer.end_of_range(group_id, object_id, unknown=unknown)
        self._sending.send_data(stream, stream_id, marker, end_stream)

    def send_padding_stream(self, size: int) -> None:
        """Open a padding stream of `size` zero bytes and FIN it."""
        self._check_open()
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, encode_padding_stream(size), end_stream=True)

    # ------------------------------------------------------------------
    # The hooks of SessionBase, handed to the parts
    # ------------------------------------------------------------------

    def _on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        self._control.on_control_data(data, out)

    def _is_control_event(self, event: QuicEvent) -> bool:
        return self._routing.is_control_event(event)

    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        self._routing.on_stream_data(event, out)

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        self._routing.on_stream_reset(event, out)

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        self._routing.on_stop_sending(event, out)

    def _on_data_header(
        self, sid: int, stream: IncomingDataStream[Request18], item: object, out: list[ev.MoqtEvent]
    ) -> bool:
        return self._routing.on_data_header(sid, stream, item, out)

    def _resolve_own_joining(
        self,
        request: Request18,
        message: Fetch,
        tokens: tuple[AuthToken, ...],
        joined: Request18,
        out: list[ev.MoqtEvent],
    ) -> bool:
        return self._fills.resolve_own_joining(request, message, tokens, joined, out)

    def _data_stream_opened(self, request: Request18) -> None:
        if isinstance(request, FillState):
            request.joined.data_streams_opened += 1  # draft-20: PUBLISH_DONE counts fill streams

    def _data_stream_stopped(self, request: Request18) -> None:
        if isinstance(request, FillState):
            self._fills.end(request)  # the subscriber wants no more of this fill
