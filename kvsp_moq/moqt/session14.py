"""A draft-14 MOQT session over one QUIC connection, without I/O.

`MoqtSession14` has the constructor shape, the `handle_event()` contract and the
public methods of the draft-18 `MoqtSession`, and returns the same `events.py`
events, so the layer above needs no second code path for the fallback version.
The wire is draft-14's (codec in `draft14.py`):

* the client opens one bidirectional control stream and sends CLIENT_SETUP with
  the versions it offers; the server answers SERVER_SETUP with the one it chose,
  or closes with VERSION_NEGOTIATION_FAILED when it supports none of them. Every
  control message of the session travels on that stream; another bidirectional
  stream from the peer is a PROTOCOL_VIOLATION;
* requests carry Request IDs (client even, server odd), each exactly the next
  one expected (else INVALID_REQUEST_ID) and below the Maximum Request ID this
  endpoint granted (else TOO_MANY_REQUESTS). The grant starts in SETUP at
  `max_requests` concurrent requests and is raised with MAX_REQUEST_ID as peer
  requests end. A request of ours beyond the peer's grant is queued (its ID is
  returned at once) and sent when MAX_REQUEST_ID arrives; REQUESTS_BLOCKED is sent
  once per grant;
* answers are *_OK / *_ERROR messages: each *_ERROR becomes a RequestRejected with
  its code renumbered to the draft-18 REQUEST_ERROR code (see draft14.py), and a
  draft-18 code this side rejects with is renumbered back (a code without a
  draft-14 counterpart is sent as INTERNAL_ERROR);
* cancellation is by message, not by stream reset: `cancel_request()` sends
  UNSUBSCRIBE, FETCH_CANCEL, PUBLISH_NAMESPACE_DONE or UNSUBSCRIBE_NAMESPACE for a
  request of ours, and SUBSCRIBE_ERROR / FETCH_ERROR (unanswered) or PUBLISH_DONE,
  a fetch stream reset, PUBLISH_NAMESPACE_CANCEL for a peer's. The receiver sees
  RequestCancelled, as with a draft-18 stream reset. Draft-14 has no way to end
  an answered peer SUBSCRIBE_NAMESPACE or TRACK_STATUS, nor an answered peer FETCH
  whose data stream was never opened: cancelling those only drops local state.

What has no draft-14 form, and what happens instead:

* NAMESPACE / NAMESPACE_DONE on a SUBSCRIBE_NAMESPACE: draft-14 announces the
  matching namespaces with PUBLISH_NAMESPACE / PUBLISH_NAMESPACE_DONE. So
  `namespace()` sends a PUBLISH_NAMESPACE (a request with its own Request ID) and
  `namespace_done()` its PUBLISH_NAMESPACE_DONE; on receipt, a PUBLISH_NAMESPACE
  inside the prefix of one of our SUBSCRIBE_NAMESPACEs is answered
  PUBLISH_NAMESPACE_OK here and reported as NamespaceReceived (the longest
  matching prefix wins); any other is a PublishNamespaceReceived for the
  application to answer. When the peer sends UNSUBSCRIBE_NAMESPACE (or this side
  cancels its SUBSCRIBE_NAMESPACE), the namespaces announced under it are
  withdrawn with PUBLISH_NAMESPACE_DONE, so neither side keeps their state.
* SUBSCRIBE_TRACKS: a draft-14 SUBSCRIBE_NAMESPACE also asks for a PUBLISH of
  every matching track (section "Subscribing to Namespaces"), which draft-18 asks
  with SUBSCRIBE_TRACKS. So a peer's SUBSCRIBE_NAMESPACE is reported twice:
  SubscribeNamespaceReceived with its Request ID, then SubscribeTracksReceived
  with that ID plus 2**62 (above every varint, so never on the wire). Answering
  or cancelling that second request sends nothing; it ends (RequestCancelled)
  with its SUBSCRIBE_NAMESPACE. The PUBLISHes made for it are ordinary requests.
  Sending SUBSCRIBE_TRACKS raises NotSupported.
* REQUEST_UPDATE: only a subscription (SUBSCRIBE of ours) can be updated, by
  SUBSCRIBE_UPDATE carrying FORWARD, SUBSCRIBER_PRIORITY, OBJECT_DELIVERY_TIMEOUT,
  tokens and the start / end group of an AbsoluteStart or AbsoluteRange
  SUBSCRIPTION_FILTER (other filters keep the start at the Largest Location of
  SUBSCRIBE_OK); any other parameter or request raises NotSupported.
  SUBSCRIBE_UPDATE has no answer, so the update is reported accepted at once
  (RequestAccepted via `take_events()`), and on the publisher side `request_ok()`
  / `request_error()` for it send nothing (a refused update of a subscription
  this side publishes ends it with PUBLISH_DONE, as in draft-18). The publisher
  sees the update as RequestUpdateReceived with an absolute SUBSCRIPTION_FILTER.
* Delivery timeouts: OBJECT_DELIVERY_TIMEOUT travels as DELIVERY_TIMEOUT in
  SUBSCRIBE / PUBLISH; SUBGROUP_DELIVERY_TIMEOUT, RENDEZVOUS_TIMEOUT and the
  delivery-timeout Track Properties have no draft-14 field and are not sent.
  MAX_CACHE_DURATION and DEFAULT_PUBLISHER_GROUP_ORDER map both ways;
  DEFAULT_PUBLISHER_PRIORITY is applied to the headers and datagrams this side
  sends; other Track Properties are dropped.
* GOAWAY carries only the URI: `timeout_ms` is not sent and arrives as 0, with no
  Request ID. Requests the peer makes after our GOAWAY are refused with
  GOING_AWAY, which has no draft-14 code and so goes out as INTERNAL_ERROR.
  Per-request GOAWAY, PUBLISH_BLOCKED and padding streams raise NotSupported.
  EXPIRES of REQUEST_OK has no place in draft-14 OK messages.
* FETCH end-of-range markers do not exist: `write_fetch_end_of_range()` writes
  nothing (it still honours `end_stream`). Fetch objects with a status other than
  Normal, and objects that "Do Not Exist", produce no event (draft14 conversions).
* Subgroup headers have no FIRST_OBJECT bit nor an inherited priority: a header
  opened with `publisher_priority=None` carries the track's default priority.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from aioquic.quic.connection import QuicConnection, stream_is_unidirectional
from aioquic.quic.events import (
    ConnectionTerminated,
    DatagramFrameReceived,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from . import data as data18
from . import draft14 as d14
from . import events as ev
from . import messages as m18
from .data import DEFAULT_MAX_OBJECT_SIZE, DEFAULT_PUBLISHER_PRIORITY, ObjectStatus
from .errors import (
    AuthTokenCacheOverflow,
    DuplicateAuthTokenAlias,
    DuplicateTrackAlias,
    InvalidAuthority,
    InvalidPath,
    InvalidRequestId,
    NotSupported,
    ProtocolViolation,
    PublishDoneCode,
    RequestErrorCode,
    SessionCloseCode,
    SessionError,
    StreamClosed,
    StreamResetCode,
    UnknownAuthTokenAlias,
)
from .messages import (
    AliasType,
    AuthToken,
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    Parameters,
    Properties,
    Redirect,
    Setup,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    property_value,
)

__all__ = ["MoqtSession14", "ALPN", "DEFAULT_MAX_REQUESTS", "UNKNOWN_STREAM_COUNT"]

ALPN = d14.ALPN
DEFAULT_MAX_REQUESTS = 100
UNKNOWN_STREAM_COUNT = (1 << 62) - 1
IMPLEMENTATION = "kvsp-moq/0.1"
_TOKEN_ENTRY_OVERHEAD = 16

# Request kinds. ANNOUNCED is a PUBLISH_NAMESPACE that answers a SUBSCRIBE_NAMESPACE
# (draft-18 NAMESPACE); the others are named after their request message.
SUBSCRIBE = "SUBSCRIBE"
FETCH = "FETCH"
TRACK_STATUS = "TRACK_STATUS"
PUBLISH = "PUBLISH"
PUBLISH_NAMESPACE = "PUBLISH_NAMESPACE"
SUBSCRIBE_NAMESPACE = "SUBSCRIBE_NAMESPACE"
ANNOUNCED = "ANNOUNCED"
TRACKS = "TRACKS"  # the SUBSCRIBE_TRACKS half of a peer's SUBSCRIBE_NAMESPACE; never on the wire

#: Request IDs of TRACKS requests: above every varint, so never a wire Request ID.
_TRACKS_ID_BASE = 1 << 62

_ERROR_MESSAGES: dict[str, type] = {
    SUBSCRIBE: d14.SubscribeError,
    FETCH: d14.FetchError,
    TRACK_STATUS: d14.TrackStatusError,
    PUBLISH: d14.PublishError,
    PUBLISH_NAMESPACE: d14.PublishNamespaceError,
    SUBSCRIBE_NAMESPACE: d14.SubscribeNamespaceError,
}


@dataclass(eq=False)
class _Request:
    """State of one request, from either side."""

    request_id: int
    kind: str
    local: bool  # this endpoint sent the request
    parameters: Parameters = field(default_factory=Parameters)  # draft-18 view
    namespace: TrackNamespace = ()
    track_name: bytes = b""
    fetch: m18.Fetch | None = None
    answered: bool = False
    accepted: bool = False
    closed: bool = False
    sent: bool = True  # False while queued behind the peer's Maximum Request ID
    track_alias: int | None = None
    default_priority: int = DEFAULT_PUBLISHER_PRIORITY
    largest_at_ok: Location | None = None
    fetch_group_order: GroupOrder = GroupOrder.ASCENDING
    data_streams_opened: int = 0
    open_data_streams: set = field(default_factory=set)
    fetch_stream_closed: bool = False
    done_stream_count: int | None = None
    data_streams_ended: int = 0
    announced: dict = field(default_factory=dict)  # SUBSCRIBE_NAMESPACE: suffix -> ANNOUNCED request
    parent: "_Request | None" = None  # ANNOUNCED, TRACKS: its SUBSCRIBE_NAMESPACE
    tracks: "_Request | None" = None  # peer SUBSCRIBE_NAMESPACE: its TRACKS half
    held_fetches: list = field(default_factory=list)
    held_by: "_Request | None" = None
    credit_returned: bool = False

    @property
    def is_subscription(self) -> bool:
        return self.kind in (SUBSCRIBE, PUBLISH)

    @property
    def publisher_is_local(self) -> bool:
        return (self.kind == PUBLISH) == self.local


@dataclass(eq=False)
class _IncomingDataStream:
    parser: d14.DataStreamParser
    request: _Request | None = None
    fetch: bool = False
    header: data18.SubgroupHeader | None = None
    held: list = field(default_factory=list)  # items waiting for their track alias; None = FIN
    held_bytes: int = 0
    discard: bool = False


@dataclass(eq=False)
class _OutgoingDataStream:
    request: _Request
    writer: d14.SubgroupWriter | None  # None: a fetch stream
    fin_sent: bool = False
    reset: bool = False
    payload_remaining: int = 0


class MoqtSession14:
    """The draft-14 MOQT state of one QUIC connection (ALPN "moq-00").

    `versions` are the SETUP versions offered (client, most preferred first) or
    accepted (server). `max_requests` bounds the peer's concurrent requests through
    MAX_REQUEST_ID. The client writes CLIENT_SETUP when the session is created.
    """

    def __init__(
        self,
        quic: QuicConnection,
        *,
        is_client: bool,
        draft: int = 14,
        setup: Setup | None = None,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        max_auth_token_cache_size: int = 0,
        max_buffered_before_setup: int = 4 * 1024 * 1024,
        max_unmatched_stream_bytes: int = 16 * 1024 * 1024,
        accept_path: Iterable[str] | None = None,
        accept_authority: Iterable[str] | None = None,
        versions: Iterable[int] = (d14.VERSION,),
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        if draft != 14:
            raise NotImplementedError(f"draft-{draft} is not this session's version")
        self._quic = quic
        self._is_client = is_client
        self.draft = draft
        self.versions = tuple(versions)
        if not self.versions:
            raise ValueError("no version to offer")
        self.version: int | None = None
        self.max_object_size = max_object_size
        self._max_buffered_before_setup = max_buffered_before_setup
        self._max_unmatched_stream_bytes = max_unmatched_stream_bytes
        self._accept_path = None if accept_path is None else set(accept_path)
        self._accept_authority = None if accept_authority is None else set(accept_authority)
        self._closed = False
        self.peer_setup: Setup | None = None
        self.goaway_received: ev.GoawayReceived | None = None
        self._goaway_sent = False

        # Request IDs and their credit (section 9.1 / MAX_REQUEST_ID).
        self._max_requests = max_requests
        self._next_request_id = 0 if is_client else 1
        self._peer_next_id = 1 if is_client else 0
        self._peer_active = 0
        self._granted = self._peer_next_id + 2 * max_requests  # peer IDs below this are allowed
        self._peer_grant = 0  # our IDs below this may be sent
        self._blocked_reported: int | None = None
        self._queue: deque[list] = deque()  # [request_id, bytearray] not yet sent

        self._requests: dict[int, _Request] = {}
        self._aliases_in: dict[int, _Request] = {}
        self._aliases_out: dict[int, _Request] = {}
        self._next_alias = 0
        self._updates: dict[int, _Request] = {}  # peer SUBSCRIBE_UPDATE id -> subscription

        self._control_stream_id: int | None = None
        self._control_parser = d14.ControlStreamParser()
        self._incoming_data: dict[int, _IncomingDataStream] = {}
        self._outgoing_data: dict[int, _OutgoingDataStream] = {}
        self._before_setup: list[QuicEvent] = []
        self._before_setup_bytes = 0
        self._released: list[ev.MoqtEvent] = []

        self._max_auth_token_cache_size = max_auth_token_cache_size
        self._peer_tokens: dict[int, AuthToken] = {}
        self._peer_token_bytes = 0

        options = setup or Setup()
        if options.implementation is None:
            options = _replace(options, implementation=IMPLEMENTATION)
        if options.max_auth_token_cache_size is None and max_auth_token_cache_size:
            options = _replace(options, max_auth_token_cache_size=max_auth_token_cache_size)
        self.local_setup = options
        if is_client:
            self._control_stream_id = quic.get_next_available_stream_id(is_unidirectional=False)
            hello = d14.ClientSetup(self.versions, self._setup_parameters())
            quic.send_stream_data(self._control_stream_id, hello.encode())

    # ------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------

    @property
    def is_client(self) -> bool:
        return self._is_client

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def setup_completed(self) -> bool:
        return self.peer_setup is not None

    def request_stream_id(self, request_id: int) -> int | None:
        """Draft-14 requests share the control stream."""
        return self._control_stream_id if request_id in self._requests else None

    def track_alias_of(self, request_id: int) -> int | None:
        request = self._requests.get(request_id)
        return None if request is None else request.track_alias

    def stream_count(self, request_id: int) -> int:
        return self._request(request_id).data_streams_opened

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def take_events(self) -> list[ev.MoqtEvent]:
        """Events produced by calls of the application (a held joining FETCH released
        by subscribe_ok(), an update reported accepted); handle_event() returns them
        too, ahead of its own."""
        out, self._released = self._released, []
        return out

    def handle_event(self, event: QuicEvent) -> list[ev.MoqtEvent]:
        """Process one QUIC event; returns the MOQT events it produced."""
        if self._closed:
            return []
        out: list[ev.MoqtEvent] = self.take_events()
        try:
            if isinstance(event, ConnectionTerminated):
                self._closed = True
                out.append(ev.SessionTerminated(event.error_code, event.reason_phrase, False))
                return out
            sid = getattr(event, "stream_id", None)
            if self.peer_setup is None and (sid is None or stream_is_unidirectional(sid)):
                self._hold_before_setup(event)
            else:
                self._dispatch(event, out)
        except SessionError as exc:
            self.close(int(exc.error_code), exc.reason)
            out.append(ev.SessionTerminated(int(exc.error_code), exc.reason, True))
        return out

    def close(self, error_code: int = SessionCloseCode.NO_ERROR, reason: str = "") -> None:
        """Close the session and its QUIC connection."""
        if self._closed:
            return
        self._closed = True
        self._quic.close(error_code=error_code, reason_phrase=reason)

    def _hold_before_setup(self, event: QuicEvent) -> None:
        self._before_setup_bytes += len(getattr(event, "data", b""))
        if self._before_setup_bytes > self._max_buffered_before_setup:
            raise ProtocolViolation("too much data before SETUP")
        self._before_setup.append(event)

    def _dispatch(self, event: QuicEvent, out: list[ev.MoqtEvent]) -> None:
        if isinstance(event, StreamDataReceived):
            self._on_stream_data(event, out)
        elif isinstance(event, StreamReset):
            self._on_stream_reset(event, out)
        elif isinstance(event, StopSendingReceived):
            self._on_stop_sending(event, out)
        elif isinstance(event, DatagramFrameReceived):
            self._on_datagram(event.data, out)

    def _is_local_stream(self, stream_id: int) -> bool:
        return bool(stream_id & 1) != self._is_client

    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if not stream_is_unidirectional(sid):
            if self._control_stream_id is None and not self._is_client and not self._is_local_stream(sid):
                self._control_stream_id = sid
            if sid != self._control_stream_id:
                raise ProtocolViolation("bidirectional stream other than the control stream")
            self._on_control_data(event.data, out)
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            return
        if self._is_local_stream(sid):
            return
        stream = self._incoming_data.get(sid)
        if stream is None:
            stream = _IncomingDataStream(d14.DataStreamParser(max_object_size=self.max_object_size))
            self._incoming_data[sid] = stream
        self._on_data_stream(sid, stream, event.data, event.end_stream, out)

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._control_stream_id:
            raise ProtocolViolation("control stream reset")
        stream = self._incoming_data.pop(sid, None)
        if stream is None or stream.discard or stream.request is None:
            return
        request = stream.request
        request.open_data_streams.discard(sid)
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch, True, event.error_code))
        if stream.fetch:
            if not request.closed:
                # A reset fetch stream ends the fetch (the range is incomplete); the
                # publisher has dropped it already, so no FETCH_CANCEL follows.
                self._close_request(request)
        else:
            request.data_streams_ended += 1
            self._maybe_end_subscription(request)

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._control_stream_id:
            raise ProtocolViolation("STOP_SENDING on the control stream")
        stream = self._outgoing_data.get(sid)
        if stream is None:
            return
        stream.reset = True  # aioquic resets the stream on STOP_SENDING
        stream.request.open_data_streams.discard(sid)
        out.append(ev.DataStreamStopped(stream.request.request_id, sid, event.error_code))
        if stream.request.kind == FETCH:
            stream.request.fetch_stream_closed = True

    # ------------------------------------------------------------------
    # Control stream
    # ------------------------------------------------------------------

    def _send(self, message: d14.Message) -> None:
        assert self._control_stream_id is not None
        self._quic.send_stream_data(self._control_stream_id, message.encode())

    def _on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        for message in self._control_parser.feed(data):
            if self.peer_setup is None:
                if isinstance(message, d14.ClientSetup) and not self._is_client:
                    self._on_client_setup(message, out)
                elif isinstance(message, d14.ServerSetup) and self._is_client:
                    self._on_server_setup(message, out)
                else:
                    raise ProtocolViolation(f"{message.NAME} before SETUP")
                continue
            handler = self._HANDLERS.get(type(message))
            if handler is None:
                raise ProtocolViolation(f"{message.NAME} after SETUP")
            handler(self, message, out)

    def _setup_parameters(self) -> d14.SetupParameters:
        s = self.local_setup
        return d14.SetupParameters(
            path=s.path if self._is_client else None,
            max_request_id=self._granted,
            authorization_tokens=s.authorization_tokens,
            max_auth_token_cache_size=s.max_auth_token_cache_size,
            authority=s.authority if self._is_client else None,
            implementation=s.implementation,
        )

    def _on_client_setup(self, message: d14.ClientSetup, out: list[ev.MoqtEvent]) -> None:
        version = next((v for v in message.versions if v in self.versions), None)
        if version is None:
            offered = ", ".join(f"{v:#x}" for v in message.versions)
            raise SessionError(
                f"no supported version among {offered}", error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED
            )
        p = message.parameters
        if self._accept_path is not None and (p.path or "") not in self._accept_path:
            raise InvalidPath(f"path {p.path!r} is not served here")
        if self._accept_authority is not None and p.authority not in self._accept_authority:
            raise InvalidAuthority(f"authority {p.authority!r} is not served here")
        self.version = version
        self._send(d14.ServerSetup(version, self._setup_parameters()))
        self._complete_setup(p, out)

    def _on_server_setup(self, message: d14.ServerSetup, out: list[ev.MoqtEvent]) -> None:
        if message.selected_version not in self.versions:
            raise SessionError(
                f"server chose version {message.selected_version:#x}, not offered",
                error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED,
            )
        p = message.parameters
        if p.path is not None:
            raise InvalidPath("PATH parameter from the server")
        if p.authority is not None:
            raise InvalidAuthority("AUTHORITY parameter from the server")
        self.version = message.selected_version
        self._complete_setup(p, out)

    def _complete_setup(self, p: d14.SetupParameters, out: list[ev.MoqtEvent]) -> None:
        for token in p.authorization_tokens:
            if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                raise ProtocolViolation(f"{token.alias_type.name} token in SETUP")
            if token.alias_type == AliasType.REGISTER:
                size = _TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                if token.alias in self._peer_tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {token.alias} already registered")
                if self._peer_token_bytes + size <= self._max_auth_token_cache_size:
                    self._peer_tokens[token.alias] = token  # type: ignore[index]
                    self._peer_token_bytes += size
        setup = Setup(
            path=p.path,
            authority=p.authority,
            max_auth_token_cache_size=p.max_auth_token_cache_size,
            authorization_tokens=p.authorization_tokens,
            implementation=p.implementation,
        )
        self.peer_setup = setup
        self._peer_grant = p.max_request_id or 0
        out.append(ev.SetupCompleted(setup))
        self._flush_queue()
        held, self._before_setup, self._before_setup_bytes = self._before_setup, [], 0
        for event in held:
            self._dispatch(event, out)

    # -- session-level messages ------------------------------------------

    def _on_goaway(self, message: d14.Goaway, out: list[ev.MoqtEvent]) -> None:
        if self.goaway_received is not None:
            raise ProtocolViolation("second GOAWAY")
        if not self._is_client and message.new_session_uri:
            raise ProtocolViolation("GOAWAY with a URI from the client")
        event = ev.GoawayReceived(message.new_session_uri, 0, None, None)
        self.goaway_received = event
        out.append(event)

    def _on_max_request_id(self, message: d14.MaxRequestId, out: list[ev.MoqtEvent]) -> None:
        if message.request_id <= self._peer_grant:
            raise ProtocolViolation(f"MAX_REQUEST_ID {message.request_id} does not increase {self._peer_grant}")
        self._peer_grant = message.request_id
        self._flush_queue()

    def _on_requests_blocked(self, message: d14.RequestsBlocked, out: list[ev.MoqtEvent]) -> None:
        self._grant(force=True)

    # -- request credit ----------------------------------------------------

    def _accept_peer_id(self, request_id: int) -> None:
        if request_id != self._peer_next_id:
            raise InvalidRequestId(f"peer Request ID {request_id}, expected {self._peer_next_id}")
        if request_id >= self._granted:
            raise SessionError(
                f"Request ID {request_id} at or over the maximum {self._granted}",
                error_code=d14.SessionCloseCode.TOO_MANY_REQUESTS,
            )
        self._peer_next_id += 2

    def _new_peer_request(self, request_id: int, kind: str, **fields) -> _Request:
        self._accept_peer_id(request_id)
        request = _Request(request_id, kind, False, **fields)
        self._requests[request_id] = request
        self._peer_active += 1
        return request

    def _grant(self, force: bool = False) -> None:
        """Raise the peer's Maximum Request ID to keep `max_requests` available."""
        if self._closed or self._control_stream_id is None or self.peer_setup is None:
            return
        target = self._peer_next_id + 2 * max(0, self._max_requests - self._peer_active)
        step = 2 * max(1, self._max_requests // 4)
        if target > self._granted and (force or target - self._granted >= step):
            self._granted = target
            self._send(d14.MaxRequestId(target))

    def _flush_queue(self) -> None:
        if self.peer_setup is None or self._control_stream_id is None or self._closed:
            return
        while self._queue and self._queue[0][0] < self._peer_grant:
            request_id, data = self._queue.popleft()
            self._quic.send_stream_data(self._control_stream_id, bytes(data))
            request = self._requests.get(request_id)
            if request is not None:
                request.sent = True
        if self._queue and self._blocked_reported != self._peer_grant:
            self._blocked_reported = self._peer_grant
            self._send(d14.RequestsBlocked(self._peer_grant))

    def _send_request(self, request: _Request, message: d14.Message) -> None:
        data = message.encode()
        if self._queue or self.peer_setup is None or request.request_id >= self._peer_grant:
            request.sent = False
            self._queue.append([request.request_id, bytearray(data)])
            self._flush_queue()
            return
        assert self._control_stream_id is not None
        self._quic.send_stream_data(self._control_stream_id, data)

    def _send_about(self, request: _Request, message: d14.Message) -> None:
        """Send a message about a request, after the request itself if still queued."""
        if not request.sent:
            for entry in self._queue:
                if entry[0] == request.request_id:
                    entry[1] += message.encode()
                    return
        self._send(message)

    # -- peer requests -------------------------------------------------------

    def _refuse_if_going_away(self, request: _Request) -> bool:
        if self._goaway_sent:
            self._reject(request, RequestErrorCode.GOING_AWAY, "going away")
            return True
        return False

    def _on_subscribe(self, message: d14.Subscribe, out: list[ev.MoqtEvent]) -> None:
        s18 = message.to_draft18()
        request = self._new_peer_request(
            message.request_id, SUBSCRIBE, parameters=s18.parameters,
            namespace=message.namespace, track_name=message.track_name,
        )
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        out.append(ev.SubscribeReceived(request.request_id, message.namespace, message.track_name, s18.parameters, tokens))

    def _on_publish(self, message: d14.Publish, out: list[ev.MoqtEvent]) -> None:
        other = self._aliases_in.get(message.track_alias)
        if other is not None and not other.closed:
            raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
        p = message.parameters
        parameters = Parameters(
            authorization_tokens=p.authorization_tokens,
            object_delivery_timeout=p.delivery_timeout,
            largest_object=message.largest_location,
            forward=message.forward,
        )
        properties: list[m18.Property] = []
        if p.max_cache_duration is not None:
            properties.append((TrackPropertyType.MAX_CACHE_DURATION, p.max_cache_duration))
        properties.append((TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, int(message.group_order)))
        request = self._new_peer_request(
            message.request_id, PUBLISH, parameters=parameters,
            namespace=message.namespace, track_name=message.track_name, track_alias=message.track_alias,
        )
        self._aliases_in[message.track_alias] = request
        tokens = self._resolve_tokens(p.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        out.append(
            ev.PublishReceived(
                request.request_id, message.namespace, message.track_name, message.track_alias,
                parameters, tuple(properties), tokens,
            )
        )
        self._flush_held_for_alias(message.track_alias, out)

    def _on_fetch(self, message: d14.Fetch, out: list[ev.MoqtEvent]) -> None:
        f18 = message.to_draft18()
        request = self._new_peer_request(message.request_id, FETCH, parameters=f18.parameters, fetch=f18)
        if message.group_order is not None:
            request.fetch_group_order = message.group_order
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        if message.fetch_type == FetchType.STANDALONE:
            start, end = message.start, message.end
            assert start is not None and end is not None
            if end < start and not (end.object == 0 and end.group >= start.group):
                self._reject(request, RequestErrorCode.INVALID_RANGE, "end before start")
                return
            request.namespace, request.track_name = message.namespace or (), message.track_name or b""
            out.append(
                ev.FetchReceived(
                    request.request_id, message.fetch_type, request.namespace, request.track_name,
                    start, end, None, f18.parameters, tokens,
                )
            )
            return
        joined = self._requests.get(message.joining_request_id)  # type: ignore[arg-type]
        if joined is None or joined.kind != SUBSCRIBE or joined.local or joined.closed:
            self._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, "no such subscription")
            return
        if not joined.accepted:
            request.held_by = joined
            joined.held_fetches.append((request, message, tokens))
            return
        self._resolve_joining(request, message, tokens, joined, out)

    def _resolve_joining(
        self, request: _Request, message: d14.Fetch, tokens: tuple[AuthToken, ...], joined: _Request,
        out: list[ev.MoqtEvent],
    ) -> None:
        """Turn a joining FETCH of an established subscription into its range."""
        if joined.parameters.forward is False:
            self._reject(request, RequestErrorCode.INVALID_RANGE, "joined subscription has Forward 0")
            return
        largest = joined.largest_at_ok
        if largest is None:
            self._reject(request, RequestErrorCode.INVALID_RANGE, "no objects published")
            return
        if message.fetch_type == FetchType.RELATIVE_JOINING:
            start = Location(max(0, largest.group - message.joining_start), 0)  # type: ignore[operator]
        else:
            start = Location(message.joining_start, 0)  # type: ignore[arg-type]
        end = Location(largest.group, largest.object + 1)
        request.namespace, request.track_name = joined.namespace, joined.track_name
        out.append(
            ev.FetchReceived(
                request.request_id, message.fetch_type, joined.namespace, joined.track_name,
                start, end, joined.request_id, request.parameters, tokens,
            )
        )

    def _refuse_held_fetches(self, joined: _Request, reason: str) -> None:
        held, joined.held_fetches = joined.held_fetches, []
        for request, _, _ in held:
            request.held_by = None
            if not request.closed and not request.answered and not self._closed:
                self._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, reason)

    def _on_track_status(self, message: d14.TrackStatus, out: list[ev.MoqtEvent]) -> None:
        t18 = message.to_draft18()
        request = self._new_peer_request(
            message.request_id, TRACK_STATUS, parameters=t18.parameters,
            namespace=message.namespace, track_name=message.track_name,
        )
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        out.append(ev.TrackStatusReceived(request.request_id, message.namespace, message.track_name, t18.parameters, tokens))

    def _on_publish_namespace(self, message: d14.PublishNamespace, out: list[ev.MoqtEvent]) -> None:
        parameters = Parameters(authorization_tokens=message.parameters.authorization_tokens)
        parent = self._subscription_for(message.namespace)
        kind = PUBLISH_NAMESPACE if parent is None else ANNOUNCED
        request = self._new_peer_request(
            message.request_id, kind, parameters=parameters, namespace=message.namespace, parent=parent
        )
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if parent is not None:
            # The draft-18 NAMESPACE: answered here, reported against the SUBSCRIBE_NAMESPACE.
            suffix = message.namespace[len(parent.namespace):]
            parent.announced[suffix] = request
            request.answered = request.accepted = True
            self._send(d14.PublishNamespaceOk(request.request_id))
            out.append(ev.NamespaceReceived(parent.request_id, suffix, message.namespace))
            return
        if self._refuse_if_going_away(request):
            return
        out.append(ev.PublishNamespaceReceived(request.request_id, message.namespace, parameters, tokens))

    def _subscription_for(self, namespace: TrackNamespace) -> _Request | None:
        """Our open SUBSCRIBE_NAMESPACE with the longest prefix of `namespace`."""
        best: _Request | None = None
        for request in self._requests.values():
            if (
                request.local and request.kind == SUBSCRIBE_NAMESPACE and not request.closed
                and namespace[: len(request.namespace)] == request.namespace
                and (best is None or len(request.namespace) > len(best.namespace))
            ):
                best = request
        return best

    def _on_subscribe_namespace(self, message: d14.SubscribeNamespace, out: list[ev.MoqtEvent]) -> None:
        parameters = Parameters(authorization_tokens=message.parameters.authorization_tokens)
        request = self._new_peer_request(
            message.request_id, SUBSCRIBE_NAMESPACE, parameters=parameters, namespace=message.namespace_prefix
        )
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        out.append(ev.SubscribeNamespaceReceived(request.request_id, message.namespace_prefix, parameters, tokens))
        # Draft-14's SUBSCRIBE_NAMESPACE also asks for a PUBLISH of every matching track,
        # which draft-18 asks with SUBSCRIBE_TRACKS: the application sees both requests.
        tracks = _Request(
            _TRACKS_ID_BASE + request.request_id, TRACKS, False, parameters=parameters,
            namespace=message.namespace_prefix, parent=request, credit_returned=True,
        )
        request.tracks = tracks
        self._requests[tracks.request_id] = tracks
        out.append(ev.SubscribeTracksReceived(tracks.request_id, message.namespace_prefix, parameters, tokens))

    def _on_subscribe_update(self, message: d14.SubscribeUpdate, out: list[ev.MoqtEvent]) -> None:
        subscription = self._requests.get(message.subscription_request_id)
        self._accept_peer_id(message.request_id)
        self._grant()  # an update uses a Request ID but holds nothing open
        if subscription is None or subscription.closed:
            return  # a race with PUBLISH_DONE / UNSUBSCRIBE
        if subscription.local or subscription.kind != SUBSCRIBE:
            raise ProtocolViolation("SUBSCRIBE_UPDATE for a request that is not a peer SUBSCRIBE")
        if message.end_group is None:
            flt = SubscriptionFilter.absolute_start(message.start.group, message.start.object)
        else:
            flt = SubscriptionFilter.absolute_range(message.start.group, message.start.object, message.end_group)
        parameters = Parameters(
            authorization_tokens=message.parameters.authorization_tokens,
            object_delivery_timeout=message.parameters.delivery_timeout,
            forward=message.forward,
            subscriber_priority=message.subscriber_priority,
            subscription_filter=flt,
        )
        resumed = subscription.parameters.forward is False and message.forward
        subscription.parameters = subscription.parameters.merged(parameters)
        if resumed:
            subscription.largest_at_ok = None  # no REQUEST_UPDATE_OK carries the new Joining Location
        self._updates[message.request_id] = subscription
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        out.append(ev.RequestUpdateReceived(message.request_id, subscription.request_id, parameters, tokens))

    # -- answers to our requests -----------------------------------------

    def _our_request(self, request_id: int, kinds: tuple[str, ...], name: str) -> _Request | None:
        """Our request answered by `name`; None when it was cancelled meanwhile."""
        request = self._requests.get(request_id)
        if request is None or not request.local:
            if request_id & 1 == self._next_request_id & 1 and request_id < self._next_request_id:
                return None  # ours, already forgotten
            raise ProtocolViolation(f"{name} for unknown request {request_id}")
        if request.kind not in kinds:
            raise ProtocolViolation(f"{name} answers a {request.kind}")
        if request.closed:
            return None
        return request

    def _first_answer(self, request_id: int, kinds: tuple[str, ...], name: str) -> _Request | None:
        request = self._our_request(request_id, kinds, name)
        if request is None:
            return None
        if request.answered:
            raise ProtocolViolation(f"second answer ({name}) to request {request_id}")
        request.answered = True
        return request

    def _on_request_error(self, message: d14.Message, out: list[ev.MoqtEvent]) -> None:
        kinds = {
            d14.SubscribeError: (SUBSCRIBE,),
            d14.FetchError: (FETCH,),
            d14.TrackStatusError: (TRACK_STATUS,),
            d14.PublishError: (PUBLISH,),
            d14.PublishNamespaceError: (PUBLISH_NAMESPACE, ANNOUNCED),
            d14.SubscribeNamespaceError: (SUBSCRIBE_NAMESPACE,),
        }[type(message)]
        request = self._first_answer(message.request_id, kinds, message.NAME)  # type: ignore[attr-defined]
        if request is None:
            return
        self._close_request(request)
        if request.kind == ANNOUNCED:
            self._drop_announced(request)
            return
        e18 = message.to_draft18()  # type: ignore[attr-defined]
        out.append(ev.RequestRejected(request.request_id, e18.error_code, e18.reason, 0, None))

    def _on_subscribe_ok(self, message: d14.SubscribeOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (SUBSCRIBE,), message.NAME)
        if request is None:
            return
        other = self._aliases_in.get(message.track_alias)
        if other is not None and other is not request and not other.closed:
            raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
        ok = message.to_draft18()
        request.accepted = True
        request.track_alias = message.track_alias
        request.largest_at_ok = message.largest_location
        self._aliases_in[message.track_alias] = request
        out.append(ev.SubscribeAccepted(request.request_id, message.track_alias, ok.parameters, ok.track_properties))
        self._flush_held_for_alias(message.track_alias, out)

    def _on_fetch_ok(self, message: d14.FetchOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (FETCH,), message.NAME)
        if request is None:
            return
        fetch = request.fetch
        assert fetch is not None
        if fetch.fetch_type == FetchType.STANDALONE and _fetch_end_before_start(message.end_location, fetch.start):  # type: ignore[arg-type]
            raise ProtocolViolation("FETCH_OK End Location before the FETCH start")
        ok = message.to_draft18()
        request.accepted = True
        out.append(ev.FetchAccepted(request.request_id, ok.end_of_track, ok.end_location, ok.parameters, ok.track_properties))
        self._maybe_finish_fetch(request)

    def _on_track_status_ok(self, message: d14.TrackStatusOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (TRACK_STATUS,), message.NAME)
        if request is None:
            return
        ok = message.to_draft18()
        request.accepted = True
        self._close_request(request)
        out.append(ev.RequestAccepted(request.request_id, ok.parameters, ok.track_properties))

    def _on_publish_ok(self, message: d14.PublishOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (PUBLISH,), message.NAME)
        if request is None:
            return
        parameters = Parameters(
            object_delivery_timeout=message.parameters.delivery_timeout,
            forward=message.forward,
            subscriber_priority=message.subscriber_priority,
            group_order=message.group_order,
            subscription_filter=message.filter,
        )
        request.accepted = True
        request.parameters = request.parameters.merged(parameters)
        out.append(ev.RequestAccepted(request.request_id, parameters, ()))

    def _on_namespace_ok(self, message: d14.Message, out: list[ev.MoqtEvent]) -> None:
        if isinstance(message, d14.PublishNamespaceOk):
            kinds: tuple[str, ...] = (PUBLISH_NAMESPACE, ANNOUNCED)
        else:
            kinds = (SUBSCRIBE_NAMESPACE,)
        request = self._first_answer(message.request_id, kinds, message.NAME)  # type: ignore[attr-defined]
        if request is None:
            return
        request.accepted = True
        if request.kind != ANNOUNCED:
            out.append(ev.RequestAccepted(request.request_id, Parameters(), ()))

    def _on_publish_done(self, message: d14.PublishDone, out: list[ev.MoqtEvent]) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.closed:
            return  # a race with our UNSUBSCRIBE
        if not request.is_subscription or request.publisher_is_local:
            raise ProtocolViolation("PUBLISH_DONE for a subscription this endpoint does not receive")
        if request.done_stream_count is not None:
            raise ProtocolViolation("second PUBLISH_DONE")
        done = message.to_draft18()
        out.append(ev.PublishDoneReceived(request.request_id, done.status_code, done.stream_count, done.reason))
        request.done_stream_count = message.stream_count
        self._maybe_end_subscription(request)

    # -- cancellations by the peer ---------------------------------------

    def _peer_cancelled(self, request: _Request, code: int, out: list[ev.MoqtEvent]) -> None:
        if request.held_by is not None:
            joined = request.held_by
            joined.held_fetches = [h for h in joined.held_fetches if h[0] is not request]
            request.held_by = None
            self._close_request(request)
            return  # the application never saw it
        out.append(ev.RequestCancelled(request.request_id, code, request.local))
        if request.held_fetches:
            self._refuse_held_fetches(request, "subscription cancelled")
        for sid in list(request.open_data_streams):
            if sid in self._outgoing_data:
                self.reset_data_stream(sid, StreamResetCode.CANCELLED)
            else:
                stream = self._incoming_data.get(sid)
                if stream is not None:
                    self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
        self._close_request(request)

    def _on_unsubscribe(self, message: d14.Unsubscribe, out: list[ev.MoqtEvent]) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.closed:
            return
        if not request.is_subscription or not request.publisher_is_local:
            raise ProtocolViolation("UNSUBSCRIBE for a subscription this endpoint does not publish")
        self._peer_cancelled(request, StreamResetCode.CANCELLED, out)

    def _on_fetch_cancel(self, message: d14.FetchCancel, out: list[ev.MoqtEvent]) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.closed:
            return
        if request.local or request.kind != FETCH:
            raise ProtocolViolation("FETCH_CANCEL for a request that is not a peer FETCH")
        self._peer_cancelled(request, StreamResetCode.CANCELLED, out)

    def _on_publish_namespace_done(self, message: d14.PublishNamespaceDone, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace, local=False, kinds=(PUBLISH_NAMESPACE, ANNOUNCED))
        if request is None:
            return
        if request.kind == ANNOUNCED:
            parent = request.parent
            self._close_request(request)
            if parent is not None and not parent.closed:
                suffix = request.namespace[len(parent.namespace):]
                parent.announced.pop(suffix, None)
                out.append(ev.NamespaceDoneReceived(parent.request_id, suffix, request.namespace))
            return
        self._peer_cancelled(request, StreamResetCode.CANCELLED, out)

    def _on_publish_namespace_cancel(self, message: d14.PublishNamespaceCancel, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace, local=True, kinds=(PUBLISH_NAMESPACE, ANNOUNCED))
        if request is None:
            return
        if request.kind == ANNOUNCED:
            self._close_request(request)
            self._drop_announced(request)
            return
        code = int(d14.PublishNamespaceError(0, message.error_code).to_draft18().error_code)
        out.append(ev.RequestCancelled(request.request_id, code, True))
        self._close_request(request)

    def _on_unsubscribe_namespace(self, message: d14.UnsubscribeNamespace, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace_prefix, local=False, kinds=(SUBSCRIBE_NAMESPACE,))
        if request is None:
            return
        for announced in list(request.announced.values()):
            if not announced.closed:
                self._send_about(announced, d14.PublishNamespaceDone(announced.namespace))
                self._close_request(announced)
        request.announced.clear()
        self._peer_cancelled(request, StreamResetCode.CANCELLED, out)
        self._end_tracks(request, out)

    def _end_tracks(self, request: _Request, out: list[ev.MoqtEvent]) -> None:
        """End the TRACKS half of a peer SUBSCRIBE_NAMESPACE that has ended."""
        tracks, request.tracks = request.tracks, None
        if tracks is not None and not tracks.closed:
            out.append(ev.RequestCancelled(tracks.request_id, StreamResetCode.CANCELLED, False))
            self._close_request(tracks)

    def _find_namespace(self, namespace: TrackNamespace, *, local: bool, kinds: tuple[str, ...]) -> _Request | None:
        for request in self._requests.values():
            if request.local == local and request.kind in kinds and request.namespace == namespace and not request.closed:
                return request
        return None

    def _drop_announced(self, request: _Request) -> None:
        parent = request.parent
        if parent is not None:
            suffix = request.namespace[len(parent.namespace):]
            if parent.announced.get(suffix) is request:
                del parent.announced[suffix]

    _HANDLERS: dict[type, Callable[["MoqtSession14", d14.Message, list[ev.MoqtEvent]], None]] = {}

    # ------------------------------------------------------------------
    # Data streams and datagrams
    # ------------------------------------------------------------------

    def _on_data_stream(
        self, sid: int, stream: _IncomingDataStream, data: bytes, end_stream: bool, out: list[ev.MoqtEvent]
    ) -> None:
        if stream.discard:
            if end_stream:
                self._incoming_data.pop(sid, None)
            return
        for item in stream.parser.feed(data, end_stream):
            if stream.request is None and stream.header is None and not stream.fetch:
                if not self._on_data_header(sid, stream, item, out):
                    return
                continue
            if stream.request is None:
                stream.held.append(item)
                stream.held_bytes += len(getattr(item, "payload", b"")) + 32
                if stream.held_bytes > self._max_unmatched_stream_bytes:
                    self._stop_incoming(sid, stream, StreamResetCode.EXCESSIVE_LOAD)
                    return
                continue
            self._deliver_item(sid, stream, item, out)
        if end_stream:
            if stream.request is not None:
                self._incoming_data.pop(sid, None)
                self._end_incoming(sid, stream, out)
            else:
                stream.held.append(None)

    def _on_data_header(self, sid: int, stream: _IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> bool:
        if isinstance(item, d14.FetchHeader):
            stream.fetch = True
            request = self._requests.get(item.request_id)
            if request is None or request.closed:
                if item.request_id & 1 == self._next_request_id & 1 and item.request_id < self._next_request_id:
                    self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
                    return False
                raise ProtocolViolation(f"FETCH_HEADER for unknown fetch {item.request_id}")
            if request.kind != FETCH or not request.local:
                raise ProtocolViolation(f"FETCH_HEADER for request {item.request_id}, not a FETCH of ours")
            stream.request = request
            request.open_data_streams.add(sid)
            return True
        assert isinstance(item, d14.SubgroupHeader)
        header = item.to_draft18()
        stream.header = header
        request = self._aliases_in.get(item.track_alias)
        if request is None:
            return True  # held until SUBSCRIBE_OK / PUBLISH names the alias
        if request.closed:
            self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
            return False
        stream.request = request
        request.open_data_streams.add(sid)
        out.append(ev.SubgroupStreamOpened(request.request_id, sid, header))
        return True

    def _deliver_item(self, sid: int, stream: _IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> None:
        request = stream.request
        assert request is not None
        if isinstance(item, d14.SubgroupObject):
            obj = item.to_draft18()
            header = stream.header
            if obj is None or header is None:
                return
            priority = header.publisher_priority
            out.append(
                ev.ObjectReceived(
                    request.request_id, header.track_alias, header.group_id, obj.subgroup_id, obj.object_id,
                    request.default_priority if priority is None else priority,
                    obj.status, obj.payload, obj.properties, sid, header.end_of_group,
                )
            )
        elif isinstance(item, d14.FetchObject):
            fobj = item.to_draft18()
            if fobj is None:
                return
            out.append(
                ev.FetchObjectReceived(
                    request.request_id, fobj.group_id, fobj.subgroup_id, fobj.object_id,
                    fobj.publisher_priority, fobj.payload, fobj.properties, sid,
                )
            )

    def _end_incoming(self, sid: int, stream: _IncomingDataStream, out: list[ev.MoqtEvent]) -> None:
        request = stream.request
        assert request is not None
        request.open_data_streams.discard(sid)
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch, False, None))
        if stream.fetch:
            request.fetch_stream_closed = True
            self._maybe_finish_fetch(request)
        else:
            request.data_streams_ended += 1
            self._maybe_end_subscription(request)
        self._forget_if_done(request)

    def _flush_held_for_alias(self, alias: int, out: list[ev.MoqtEvent]) -> None:
        request = self._aliases_in[alias]
        for sid, stream in list(self._incoming_data.items()):
            if stream.request is not None or stream.header is None or stream.header.track_alias != alias:
                continue
            if stream.fetch or stream.discard:
                continue
            stream.request = request
            request.open_data_streams.add(sid)
            out.append(ev.SubgroupStreamOpened(request.request_id, sid, stream.header))
            held, stream.held, stream.held_bytes = stream.held, [], 0
            ended = False
            for item in held:
                if item is None:
                    ended = True
                else:
                    self._deliver_item(sid, stream, item, out)
            if ended:
                self._incoming_data.pop(sid, None)
                self._end_incoming(sid, stream, out)

    def _on_datagram(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        datagram = d14.decode_datagram(data).to_draft18()
        if datagram is None:
            return
        request = self._aliases_in.get(datagram.track_alias)
        if request is None or request.closed:
            return  # an unknown alias may be dropped
        priority = datagram.publisher_priority
        out.append(
            ev.ObjectReceived(
                request.request_id, datagram.track_alias, datagram.group_id, None, datagram.object_id,
                request.default_priority if priority is None else priority,
                ObjectStatus.NORMAL if datagram.status is None else datagram.status,
                datagram.payload, datagram.properties, None, datagram.end_of_group,
            )
        )

    def stop_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """STOP_SENDING an incoming data stream; the subscription goes on."""
        stream = self._incoming_data.get(stream_id)
        if stream is not None:
            self._stop_incoming(stream_id, stream, error_code)

    def incoming_stream_open(self, stream_id: int) -> bool:
        stream = self._incoming_data.get(stream_id)
        return stream is not None and not stream.discard

    def _stop_incoming(self, sid: int, stream: _IncomingDataStream, code: int) -> None:
        if stream.discard:
            return
        stream.discard = True
        stream.held = []
        request = stream.request
        if request is not None and sid in request.open_data_streams:
            request.open_data_streams.discard(sid)
            if not stream.fetch:
                request.data_streams_ended += 1
                self._maybe_end_subscription(request)
            self._forget_if_done(request)
        try:
            self._quic.stop_stream(sid, code)
        except (ValueError, RuntimeError, AssertionError):
            pass

    def _maybe_end_subscription(self, request: _Request) -> None:
        """After PUBLISH_DONE, forget the subscription once all its streams ended."""
        count = request.done_stream_count
        if count is None or request.closed or request.open_data_streams:
            return
        if count != UNKNOWN_STREAM_COUNT and request.data_streams_ended >= count:
            self._close_request(request)

    def release(self, request_id: int) -> None:
        """Forget a subscription that ended with PUBLISH_DONE, even if some of its
        streams never arrived (after a grace period chosen by the caller)."""
        request = self._requests.get(request_id)
        if request is None or request.done_stream_count is None:
            return
        for sid in list(request.open_data_streams):
            stream = self._incoming_data.get(sid)
            if stream is not None:
                self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
        request.open_data_streams.clear()
        self._close_request(request)

    # -- authorization tokens ----------------------------------------------

    def _resolve_tokens(self, tokens: tuple[AuthToken, ...]) -> tuple[AuthToken, ...]:
        """Apply the peer's alias operations; return the tokens in USE_VALUE form."""
        resolved: list[AuthToken] = []
        for token in tokens:
            if token.alias_type == AliasType.USE_VALUE:
                resolved.append(token)
            elif token.alias_type == AliasType.REGISTER:
                if token.alias in self._peer_tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {token.alias} already registered")
                size = _TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                if self._peer_token_bytes + size > self._max_auth_token_cache_size:
                    raise AuthTokenCacheOverflow("authorization token cache full")
                self._peer_tokens[token.alias] = token  # type: ignore[index]
                self._peer_token_bytes += size
                resolved.append(AuthToken.use_value(token.value or b"", token.token_type or 0))
            elif token.alias_type == AliasType.USE_ALIAS:
                registered = self._peer_tokens.get(token.alias)  # type: ignore[arg-type]
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                resolved.append(AuthToken.use_value(registered.value or b"", registered.token_type or 0))
            else:
                registered = self._peer_tokens.pop(token.alias, None)  # type: ignore[arg-type]
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                self._peer_token_bytes -= _TOKEN_ENTRY_OVERHEAD + len(registered.value or b"")
        return tuple(resolved)

    # ------------------------------------------------------------------
    # Sending: requests
    # ------------------------------------------------------------------

    def _request(self, request_id: int) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise StreamClosed(f"no active request {request_id}")
        return request

    def _check_open(self) -> None:
        if self._closed:
            raise StreamClosed("session closed")

    def _open_request(self, kind: str, build: Callable[[int], d14.Message], **fields) -> int:
        self._check_open()
        request_id = self._next_request_id
        message = build(request_id)
        self._next_request_id += 2
        request = _Request(request_id, kind, True, **fields)
        self._requests[request_id] = request
        self._send_request(request, message)
        return request_id

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE; returns its Request ID."""
        message18 = m18.Subscribe(0, tuple(namespace), track_name, parameters)
        return self._open_request(
            SUBSCRIBE,
            lambda rid: d14.Subscribe.from_draft18(_replace(message18, request_id=rid)),
            parameters=parameters, namespace=tuple(namespace), track_name=track_name,
        )

    def fetch(
        self,
        namespace: TrackNamespace,
        track_name: bytes,
        start: Location,
        end: Location,
        parameters: Parameters = Parameters(),
    ) -> int:
        """Send a standalone FETCH. `end` is the wire End Location (last Object + 1,
        or Object 0 for the whole group)."""
        f18 = m18.Fetch(0, FetchType.STANDALONE, tuple(namespace), track_name, Location(*start), Location(*end),
                        parameters=parameters)
        return self._fetch(f18)

    def joining_fetch(
        self, subscribe_request_id: int, joining_start: int, *, relative: bool = True, parameters: Parameters = Parameters()
    ) -> int:
        """Send a joining FETCH for one of our subscriptions."""
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        f18 = m18.Fetch(0, fetch_type, joining_request_id=subscribe_request_id, joining_start=joining_start,
                        parameters=parameters)
        return self._fetch(f18)

    def _fetch(self, f18: m18.Fetch) -> int:
        request_id = self._open_request(
            FETCH,
            lambda rid: d14.Fetch.from_draft18(_replace(f18, request_id=rid)),
            parameters=f18.parameters,
        )
        request = self._requests[request_id]
        request.fetch = _replace(f18, request_id=request_id)
        if f18.parameters.group_order is not None:
            request.fetch_group_order = f18.parameters.group_order
        return request_id

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        t18 = m18.TrackStatus(0, tuple(namespace), track_name, parameters)
        return self._open_request(
            TRACK_STATUS, lambda rid: d14.TrackStatus.from_draft18(_replace(t18, request_id=rid)),
            parameters=parameters, namespace=tuple(namespace), track_name=track_name,
        )

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        """Send PUBLISH_NAMESPACE; withdrawn by cancel_request() (PUBLISH_NAMESPACE_DONE)."""
        ns = tuple(namespace)
        return self._open_request(
            PUBLISH_NAMESPACE,
            lambda rid: d14.PublishNamespace(rid, ns, d14.Parameters(parameters.authorization_tokens)),
            parameters=parameters, namespace=ns,
        )

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE_NAMESPACE; the namespaces come as NamespaceReceived events."""
        prefix = tuple(namespace_prefix)
        return self._open_request(
            SUBSCRIBE_NAMESPACE,
            lambda rid: d14.SubscribeNamespace(rid, prefix, d14.Parameters(parameters.authorization_tokens)),
            parameters=parameters, namespace=prefix,
        )

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        raise NotSupported("SUBSCRIBE_TRACKS does not exist in draft-14")

    def publish(
        self,
        namespace: TrackNamespace,
        track_name: bytes,
        *,
        track_alias: int | None = None,
        parameters: Parameters = Parameters(),
        track_properties: Properties = (),
    ) -> int:
        """Send PUBLISH; objects may follow at once unless FORWARD is 0."""
        alias = self._allocate_alias(track_alias)
        ns = tuple(namespace)
        order = GroupOrder(property_value(track_properties, TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, 1))
        cache = property_value(track_properties, TrackPropertyType.MAX_CACHE_DURATION)
        wire_parameters = d14.Parameters(
            parameters.authorization_tokens, parameters.object_delivery_timeout, cache
        )
        request_id = self._open_request(
            PUBLISH,
            lambda rid: d14.Publish(
                rid, ns, track_name, alias, order, parameters.largest_object,
                parameters.forward is not False, wire_parameters,
            ),
            parameters=parameters, namespace=ns, track_name=track_name,
        )
        request = self._requests[request_id]
        request.track_alias = alias
        request.largest_at_ok = parameters.largest_object
        request.default_priority = property_value(
            track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
        )
        self._aliases_out[alias] = request
        return request_id

    def request_update(self, request_id: int, parameters: Parameters) -> int:
        """Send SUBSCRIBE_UPDATE for a subscription of ours; returns its Request ID.

        Draft-14 sends no answer, so RequestAccepted for it is queued at once.
        """
        self._check_open()
        request = self._request(request_id)
        if request.closed:
            raise StreamClosed(f"request {request_id} is closed")
        if not request.local or request.kind != SUBSCRIBE:
            raise NotSupported("draft-14 updates only subscriptions of this endpoint (SUBSCRIBE_UPDATE)")
        allowed = {"forward", "subscriber_priority", "subscription_filter", "object_delivery_timeout",
                   "authorization_tokens"}
        for name in ("rendezvous_timeout", "subgroup_delivery_timeout", "expires", "largest_object",
                     "fill_timeout", "group_order", "new_group_request", "track_namespace_prefix"):
            if getattr(parameters, name) is not None and name not in allowed:
                raise NotSupported(f"{name} cannot be updated in draft-14")
        merged = request.parameters.merged(parameters)
        flt = merged.subscription_filter
        start, end_group = Location(0, 0), None
        if flt is not None and flt.filter_type in (FilterType.ABSOLUTE_START, FilterType.ABSOLUTE_RANGE):
            start, end_group = flt.start, flt.end_group  # type: ignore[assignment]
        elif request.largest_at_ok is not None:
            start = request.largest_at_ok
        update_id = self._next_request_id
        self._next_request_id += 2
        message = d14.SubscribeUpdate(
            update_id, request_id, start, end_group,
            128 if merged.subscriber_priority is None else merged.subscriber_priority,
            merged.forward is not False,
            d14.Parameters(parameters.authorization_tokens, parameters.object_delivery_timeout),
        )
        update = _Request(update_id, "SUBSCRIBE_UPDATE", True, closed=True)
        self._send_request(update, message)
        request.parameters = merged
        self._released.append(ev.RequestAccepted(update_id, Parameters(), ()))
        return update_id

    def cancel_request(self, request_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Abandon a request: UNSUBSCRIBE, FETCH_CANCEL, PUBLISH_NAMESPACE_DONE,
        UNSUBSCRIBE_NAMESPACE for ours; an error, PUBLISH_DONE or
        PUBLISH_NAMESPACE_CANCEL for a peer's."""
        request = self._requests.get(request_id)
        if request is None or self._closed or request.closed:
            return
        if request.kind == TRACKS:  # no message: PUBLISHes already sent go on
            request.answered = True
            self._close_request(request)
            return
        self._end_tracks(request, self._released)
        if request.held_fetches:
            self._refuse_held_fetches(request, "subscription cancelled")
        if not request.local and not request.answered and request.kind in _ERROR_MESSAGES:
            self._reject(request, RequestErrorCode.INTERNAL_ERROR, "cancelled")
        else:
            self._send_cancel(request, error_code)
        for sid in list(request.open_data_streams):
            if sid in self._outgoing_data:
                self.reset_data_stream(sid, error_code)
            else:
                stream = self._incoming_data.get(sid)
                if stream is not None:
                    self._stop_incoming(sid, stream, error_code)
        self._close_request(request)

    def _send_cancel(self, request: _Request, error_code: int = StreamResetCode.CANCELLED) -> None:
        """The message that ends `request` from this side, if it has one."""
        kind, rid = request.kind, request.request_id
        message: d14.Message | None = None
        if request.local:
            if kind == SUBSCRIBE:
                message = d14.Unsubscribe(rid)
            elif kind == FETCH:
                message = d14.FetchCancel(rid)
            elif kind in (PUBLISH_NAMESPACE, ANNOUNCED):
                message = d14.PublishNamespaceDone(request.namespace)
            elif kind == SUBSCRIBE_NAMESPACE:
                message = d14.UnsubscribeNamespace(request.namespace)
            elif kind == PUBLISH:
                message = d14.PublishDone(rid, d14.PublishDoneCode.SUBSCRIPTION_ENDED, request.data_streams_opened,
                                          "cancelled")
        else:
            if kind == SUBSCRIBE:
                message = d14.PublishDone(rid, d14.PublishDoneCode.SUBSCRIPTION_ENDED, request.data_streams_opened,
                                          "cancelled")
            elif kind == PUBLISH:
                message = d14.Unsubscribe(rid)
            elif kind in (PUBLISH_NAMESPACE, ANNOUNCED):
                message = d14.PublishNamespaceCancel(request.namespace, d14.PublishNamespaceErrorCode.INTERNAL_ERROR,
                                                     "cancelled")
            elif kind == SUBSCRIBE_NAMESPACE:
                for announced in list(request.announced.values()):
                    if not announced.closed:
                        self._send_about(announced, d14.PublishNamespaceDone(announced.namespace))
                        self._close_request(announced)
                request.announced.clear()
            # A peer FETCH already answered ends by resetting its data stream.
        if message is not None and not self._closed:
            self._send_about(request, message)

    def goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY (draft-14 carries no timeout); later peer requests are refused."""
        self._check_open()
        if self._is_client and new_session_uri:
            raise ValueError("a client sends GOAWAY without a URI")
        if self._control_stream_id is None:
            raise StreamClosed("no control stream yet")
        self._goaway_sent = True
        self._send(d14.Goaway(new_session_uri))

    def request_goaway(self, request_id: int, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        raise NotSupported("draft-14 has no per-request GOAWAY")

    # ------------------------------------------------------------------
    # Sending: answers
    # ------------------------------------------------------------------

    def _peer_request(self, request_id: int, kinds: tuple[str, ...]) -> _Request:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind not in kinds:
            raise ValueError(f"request {request_id} is not a peer {'/'.join(kinds)}")
        if request.answered:
            raise ValueError(f"request {request_id} was already answered")
        if request.closed:
            raise StreamClosed(f"request {request_id} was cancelled")
        return request

    def _allocate_alias(self, alias: int | None) -> int:
        if alias is None:
            while self._next_alias in self._aliases_out:
                self._next_alias += 1
            alias = self._next_alias
            self._next_alias += 1
        elif alias in self._aliases_out and not self._aliases_out[alias].closed:
            raise ValueError(f"track alias {alias} in use")
        return alias

    def subscribe_ok(
        self,
        request_id: int,
        *,
        track_alias: int | None = None,
        largest: Location | None = None,
        expires: int | None = None,
        track_properties: Properties = (),
    ) -> int:
        """Accept a peer's SUBSCRIBE; returns the Track Alias its objects carry."""
        request = self._peer_request(request_id, (SUBSCRIBE,))
        alias = self._allocate_alias(track_alias)
        largest_location = None if largest is None else Location(*largest)
        ok18 = m18.SubscribeOk(alias, Parameters(expires=expires, largest_object=largest_location), track_properties)
        self._send(d14.SubscribeOk.from_draft18(ok18, request_id))
        request.answered = request.accepted = True
        request.track_alias = alias
        request.largest_at_ok = largest_location
        request.default_priority = property_value(
            track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
        )
        self._aliases_out[alias] = request
        held, request.held_fetches = request.held_fetches, []
        for fetch, message, tokens in held:
            fetch.held_by = None
            if not fetch.closed and not self._closed:
                self._resolve_joining(fetch, message, tokens, request, self._released)
        return alias

    def fetch_ok(
        self,
        request_id: int,
        end_location: Location,
        *,
        end_of_track: bool = False,
        track_properties: Properties = (),
    ) -> None:
        """Accept a peer's FETCH. `end_location` uses the wire encoding (last + 1)."""
        request = self._peer_request(request_id, (FETCH,))
        ok18 = m18.FetchOk(end_of_track, Location(*end_location), Parameters(), track_properties)
        self._send(d14.FetchOk.from_draft18(ok18, request_id, request.fetch_group_order))
        request.answered = request.accepted = True
        self._maybe_finish_fetch(request)

    def request_ok(self, request_id: int, parameters: Parameters = Parameters(), track_properties: Properties = ()) -> None:
        """Send PUBLISH_OK, TRACK_STATUS_OK, PUBLISH_NAMESPACE_OK or
        SUBSCRIBE_NAMESPACE_OK; for a peer SUBSCRIBE_UPDATE, or the SUBSCRIBE_TRACKS
        half of a SUBSCRIBE_NAMESPACE, nothing is sent."""
        self._check_open()
        if self._updates.pop(request_id, None) is not None:
            return
        if self._answer_tracks(request_id):
            return
        request = self._peer_request(request_id, (PUBLISH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE))
        if track_properties and request.kind != TRACK_STATUS:
            raise ValueError("Track Properties go only in TRACK_STATUS_OK")
        rid = request.request_id
        message: d14.Message
        if request.kind == PUBLISH:
            message = d14.PublishOk(
                rid,
                parameters.forward is not False,
                128 if parameters.subscriber_priority is None else parameters.subscriber_priority,
                parameters.group_order or GroupOrder.ASCENDING,
                parameters.subscription_filter or SubscriptionFilter.largest_object(),
                d14.Parameters(delivery_timeout=parameters.object_delivery_timeout),
            )
            request.parameters = request.parameters.merged(parameters)
        elif request.kind == TRACK_STATUS:
            message = d14.TrackStatusOk.from_draft18(m18.RequestOk(parameters, track_properties), rid)
        elif request.kind == PUBLISH_NAMESPACE:
            message = d14.PublishNamespaceOk(rid)
        else:
            message = d14.SubscribeNamespaceOk(rid)
        self._send(message)
        request.answered = request.accepted = True
        if request.kind == TRACK_STATUS:
            self._close_request(request)

    def request_error(
        self,
        request_id: int,
        error_code: int,
        reason: str = "",
        *,
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        """Reject a peer's request with its *_ERROR message (code renumbered to
        draft-14; Retry Interval and redirect have no draft-14 field)."""
        self._check_open()
        subscription = self._updates.pop(request_id, None)
        if subscription is not None:
            if not subscription.closed and subscription.accepted:
                self.publish_done(subscription.request_id, PublishDoneCode.UPDATE_FAILED, "update failed")
            return
        if self._answer_tracks(request_id, refused=True):
            return  # the SUBSCRIBE_NAMESPACE half answers the peer
        request = self._peer_request(request_id, tuple(_ERROR_MESSAGES))
        self._reject(request, error_code, reason)

    def _answer_tracks(self, request_id: int, *, refused: bool = False) -> bool:
        """Record the answer to a TRACKS request, which sends nothing; False for another request."""
        if request_id < _TRACKS_ID_BASE:
            return False
        request = self._peer_request(request_id, (TRACKS,))
        request.answered = True
        if refused:
            self._close_request(request)
        else:
            request.accepted = True
        return True

    def _reject(self, request: _Request, error_code: int, reason: str) -> None:
        self._end_tracks(request, self._released)
        request.answered = True
        cls = _ERROR_MESSAGES[PUBLISH_NAMESPACE if request.kind == ANNOUNCED else request.kind]
        message = cls.from_draft18(m18.RequestErrorMessage(error_code, 0, reason), request.request_id)
        self._close_request(request)
        if not self._closed:
            self._send(message)
        if request.held_fetches:
            self._refuse_held_fetches(request, "subscription refused")

    def publish_done(self, request_id: int, status_code: int = PublishDoneCode.TRACK_ENDED, reason: str = "") -> None:
        """End a subscription this endpoint publishes: FIN its open data streams and
        send PUBLISH_DONE with the stream count."""
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        for sid in list(request.open_data_streams):
            stream = self._outgoing_data.get(sid)
            if stream is not None and stream.payload_remaining:
                self.reset_data_stream(sid, StreamResetCode.CANCELLED)
            else:
                self.close_data_stream(sid)
        done = m18.PublishDone(status_code, request.data_streams_opened, reason)
        self._send_about(request, d14.PublishDone.from_draft18(done, request_id))
        self._close_request(request)

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Announce a namespace under a peer's SUBSCRIBE_NAMESPACE (a PUBLISH_NAMESPACE)."""
        request = self._answered_peer_request(request_id, SUBSCRIBE_NAMESPACE)
        suffix = tuple(namespace_suffix)
        if suffix in request.announced:
            raise ValueError("namespace already announced")
        ns = request.namespace + suffix
        announced_id = self._open_request(
            ANNOUNCED, lambda rid: d14.PublishNamespace(rid, ns), namespace=ns, parent=request
        )
        request.announced[suffix] = self._requests[announced_id]

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Withdraw a namespace announced by namespace() (PUBLISH_NAMESPACE_DONE)."""
        request = self._answered_peer_request(request_id, SUBSCRIBE_NAMESPACE)
        announced = request.announced.pop(tuple(namespace_suffix), None)
        if announced is None:
            raise ValueError("NAMESPACE_DONE for a suffix never announced")
        if not announced.closed:
            self._send_about(announced, d14.PublishNamespaceDone(announced.namespace))
            self._close_request(announced)

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        raise NotSupported("PUBLISH_BLOCKED does not exist in draft-14")

    def _answered_peer_request(self, request_id: int, kind: str) -> _Request:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind != kind or not request.accepted:
            raise ValueError(f"request {request_id} is not an accepted peer {kind}")
        if request.closed:
            raise StreamClosed(f"request {request_id} was cancelled")
        return request

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    def _publishing_request(self, request_id: int) -> _Request:
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        if request.kind == SUBSCRIBE and not request.accepted:
            raise ValueError("objects are sent only after SUBSCRIBE_OK")
        return request

    def open_subgroup(
        self,
        request_id: int,
        group_id: int,
        subgroup_id: int = 0,
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        end_of_group: bool = False,
        has_properties: bool = False,
        first_object: bool = True,
    ) -> int:
        """Open a subgroup stream; returns its stream ID. Draft-14 headers always carry
        a priority (None: the track's default) and have no FIRST_OBJECT bit."""
        request = self._publishing_request(request_id)
        priority = request.default_priority if publisher_priority is None else publisher_priority
        header = d14.SubgroupHeader(
            request.track_alias, group_id, subgroup_id, priority, has_properties, end_of_group  # type: ignore[arg-type]
        )
        writer = d14.SubgroupWriter(header)
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, writer.header_bytes())
        self._outgoing_data[sid] = _OutgoingDataStream(request, writer)
        request.data_streams_opened += 1
        request.open_data_streams.add(sid)
        return sid

    def _outgoing(self, stream_id: int) -> _OutgoingDataStream:
        stream = self._outgoing_data.get(stream_id)
        if stream is None:
            raise StreamClosed(f"no open data stream {stream_id}")
        if stream.reset or stream.fin_sent or self._closed:
            raise StreamClosed(f"data stream {stream_id} is closed")
        return stream

    def _send_data(self, stream: _OutgoingDataStream, stream_id: int, data, end_stream: bool = False) -> None:
        try:
            self._quic.send_stream_data(stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError, AssertionError) as exc:
            stream.reset = True
            raise StreamClosed(f"data stream {stream_id}: {exc}") from None
        if end_stream:
            self._data_stream_finished(stream_id, stream)

    def _new_object(self, stream_id: int, fetch: bool) -> _OutgoingDataStream:
        stream = self._outgoing(stream_id)
        if (stream.writer is None) != fetch:
            raise ValueError(f"stream {stream_id} is not a {'fetch' if fetch else 'subgroup'} stream")
        if stream.payload_remaining:
            raise ValueError(f"stream {stream_id}: the previous object has {stream.payload_remaining} payload bytes unwritten")
        return stream

    def begin_object(self, stream_id: int, object_id: int, payload_length: int, *, properties: Properties = ()) -> None:
        """Write the header of a Normal object on a subgroup stream; write_payload() follows."""
        stream = self._new_object(stream_id, fetch=False)
        assert stream.writer is not None
        header = stream.writer.object_header(object_id, payload_length, extensions=_extensions(properties))
        self._send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_payload(self, stream_id: int, data: bytes | bytearray | memoryview, *, end_stream: bool = False) -> None:
        stream = self._outgoing(stream_id)
        if len(data) > stream.payload_remaining:
            raise ValueError(f"{len(data)} payload bytes but {stream.payload_remaining} announced")
        if end_stream and len(data) != stream.payload_remaining:
            raise ValueError("FIN inside an object")
        stream.payload_remaining -= len(data)
        self._send_data(stream, stream_id, data, end_stream)

    def write_object(
        self,
        stream_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        self.begin_object(stream_id, object_id, len(payload), properties=properties)
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

    def write_object_status(self, stream_id: int, object_id: int, status: ObjectStatus, *, end_stream: bool = False) -> None:
        stream = self._new_object(stream_id, fetch=False)
        assert stream.writer is not None
        header = stream.writer.object_header(object_id, 0, status=d14.ObjectStatus(int(status)))
        self._send_data(stream, stream_id, header, end_stream)

    def open_fetch_stream(self, request_id: int) -> int:
        """Open the data stream answering a peer's FETCH; returns the stream ID."""
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind != FETCH:
            raise ValueError(f"request {request_id} is not a peer FETCH")
        if request.closed:
            raise StreamClosed(f"fetch {request_id} was cancelled")
        if request.data_streams_opened:
            raise ValueError("a FETCH is answered on one stream")
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, d14.FetchHeader(request_id).encode())
        self._outgoing_data[sid] = _OutgoingDataStream(request, None)
        request.data_streams_opened += 1
        request.open_data_streams.add(sid)
        return sid

    def begin_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> None:
        """Write the header of the next fetch object; `subgroup_id` None (a Datagram
        object) is sent as the Object ID, draft-14's convention."""
        stream = self._new_object(stream_id, fetch=True)
        header = d14.encode_fetch_object(
            group_id, object_id if subgroup_id is None else subgroup_id, object_id, payload_length,
            publisher_priority=publisher_priority, extensions=_extensions(properties),
        )
        self._send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_fetch_object(
        self,
        stream_id: int,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
        end_stream: bool = False,
    ) -> None:
        self.begin_fetch_object(
            stream_id, group_id, object_id, len(payload), subgroup_id=subgroup_id,
            publisher_priority=publisher_priority, properties=properties,
        )
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

    def write_fetch_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False, end_stream: bool = False
    ) -> None:
        """Draft-14 has no end-of-range marker: nothing is written; `end_stream` FINs."""
        self._new_object(stream_id, fetch=True)
        if end_stream:
            self.close_data_stream(stream_id)

    def close_data_stream(self, stream_id: int) -> None:
        """FIN a data stream: every object of it was written."""
        stream = self._outgoing_data.get(stream_id)
        if stream is None or stream.fin_sent or stream.reset:
            return
        if stream.payload_remaining:
            raise ValueError(f"stream {stream_id} closed inside an object; reset it instead")
        try:
            self._quic.send_stream_data(stream_id, b"", end_stream=True)
        except (ValueError, RuntimeError, AssertionError):
            stream.reset = True
        self._data_stream_finished(stream_id, stream)

    def reset_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        stream = self._outgoing_data.pop(stream_id, None)
        if stream is None:
            return
        stream.reset = True
        stream.request.open_data_streams.discard(stream_id)
        try:
            self._quic.reset_stream(stream_id, error_code)
        except (ValueError, RuntimeError, AssertionError):
            pass
        self._forget_if_done(stream.request)

    def _data_stream_finished(self, stream_id: int, stream: _OutgoingDataStream) -> None:
        stream.fin_sent = True
        self._outgoing_data.pop(stream_id, None)
        request = stream.request
        request.open_data_streams.discard(stream_id)
        if request.kind == FETCH:
            request.fetch_stream_closed = True
            self._maybe_finish_fetch(request)
        self._forget_if_done(request)

    def data_stream_request(self, stream_id: int) -> int | None:
        """Request ID an outgoing data stream serves, while it can still be written."""
        stream = self._outgoing_data.get(stream_id)
        if stream is None or stream.reset or stream.fin_sent:
            return None
        return stream.request.request_id

    def send_datagram(
        self,
        request_id: int,
        group_id: int,
        object_id: int,
        payload: bytes = b"",
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        status: ObjectStatus | None = None,
        properties: Properties = (),
        end_of_group: bool = False,
    ) -> None:
        """Send one object as an OBJECT_DATAGRAM (dropped by QUIC if it does not fit)."""
        request = self._publishing_request(request_id)
        priority = request.default_priority if publisher_priority is None else publisher_priority
        datagram = d14.ObjectDatagram(
            request.track_alias, group_id, object_id, payload, priority,  # type: ignore[arg-type]
            None if status is None else d14.ObjectStatus(int(status)), _extensions(properties), end_of_group,
        )
        self._quic.send_datagram_frame(datagram.encode())

    def send_padding_stream(self, size: int) -> None:
        raise NotSupported("draft-14 has no padding streams")

    # ------------------------------------------------------------------
    # Teardown
    # ------------------------------------------------------------------

    def _maybe_finish_fetch(self, request: _Request) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if request.fetch_stream_closed and not request.open_data_streams:
            self._close_request(request)

    def _close_request(self, request: _Request) -> None:
        """Mark a request over; a peer request gives its Request ID credit back."""
        request.closed = True
        if not request.local and not request.credit_returned:
            request.credit_returned = True
            self._peer_active -= 1
            self._grant()
        self._forget_if_done(request)

    def _forget_if_done(self, request: _Request) -> None:
        """Drop a closed request once no data stream refers to it."""
        if request.closed and not request.open_data_streams:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
            if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                del self._aliases_out[request.track_alias]


MoqtSession14._HANDLERS = {
    d14.Goaway: MoqtSession14._on_goaway,
    d14.MaxRequestId: MoqtSession14._on_max_request_id,
    d14.RequestsBlocked: MoqtSession14._on_requests_blocked,
    d14.Subscribe: MoqtSession14._on_subscribe,
    d14.SubscribeOk: MoqtSession14._on_subscribe_ok,
    d14.SubscribeError: MoqtSession14._on_request_error,
    d14.SubscribeUpdate: MoqtSession14._on_subscribe_update,
    d14.Unsubscribe: MoqtSession14._on_unsubscribe,
    d14.PublishDone: MoqtSession14._on_publish_done,
    d14.Publish: MoqtSession14._on_publish,
    d14.PublishOk: MoqtSession14._on_publish_ok,
    d14.PublishError: MoqtSession14._on_request_error,
    d14.Fetch: MoqtSession14._on_fetch,
    d14.FetchOk: MoqtSession14._on_fetch_ok,
    d14.FetchError: MoqtSession14._on_request_error,
    d14.FetchCancel: MoqtSession14._on_fetch_cancel,
    d14.TrackStatus: MoqtSession14._on_track_status,
    d14.TrackStatusOk: MoqtSession14._on_track_status_ok,
    d14.TrackStatusError: MoqtSession14._on_request_error,
    d14.PublishNamespace: MoqtSession14._on_publish_namespace,
    d14.PublishNamespaceOk: MoqtSession14._on_namespace_ok,
    d14.PublishNamespaceError: MoqtSession14._on_request_error,
    d14.PublishNamespaceDone: MoqtSession14._on_publish_namespace_done,
    d14.PublishNamespaceCancel: MoqtSession14._on_publish_namespace_cancel,
    d14.SubscribeNamespace: MoqtSession14._on_subscribe_namespace,
    d14.SubscribeNamespaceOk: MoqtSession14._on_namespace_ok,
    d14.SubscribeNamespaceError: MoqtSession14._on_request_error,
    d14.UnsubscribeNamespace: MoqtSession14._on_unsubscribe_namespace,
}  # type: ignore[assignment]


def _replace(obj, **changes):
    from dataclasses import replace

    return replace(obj, **changes)


def _extensions(properties: Properties) -> tuple[d14.KeyValuePair, ...]:
    """Draft-18 Properties as draft-14 extension headers."""
    return d14._properties_from_18(properties) if properties else ()


def _fetch_end_before_start(end: Location, start: Location) -> bool:
    if end.object == 0:
        return end.group < start.group
    return (end.group, end.object - 1) < (start.group, start.object)
