"""A MOQT session over one QUIC connection, without I/O (in the style of H3Connection).

`handle_event()` takes each QUIC event and returns MOQT events; the other methods
write into the QuicConnection, and the caller transmits. Nothing here touches a
socket, a clock or an event loop. `session_base.SessionBase` holds what every
draft's session shares; `MoqtSession` adds draft-18's streams, messages and wire
forms.

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

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable

from .. import events as ev
from ..engine import (
    QuicEngine,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
    stream_is_unidirectional,
)
from ..errors import (
    DuplicateTrackAlias,
    InvalidRequestId,
    NotSupported,
    ProtocolViolation,
    PublishDoneCode,
    RequestErrorCode,
    StreamClosed,
    StreamResetCode,
)
from ..fetches import fetch_end_before_start
from ..session_base import SessionBase
from ..state import IncomingDataStream, RequestIdTracker, RequestState
from ..varint import decode_vi64
from ..wire import (
    DEFAULT_MAX_OBJECT_SIZE,
    DEFAULT_PUBLISHER_PRIORITY,
    FetchType,
    GroupOrder,
    Location,
    Properties,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    mandatory_properties,
    property_value,
)
from .data import (
    STREAM_TYPE_SETUP,
    DataStreamParser,
    FetchHeader,
    ObjectDatagram,
    PaddingDatagram,
    PaddingHeader,
    SubgroupHeader,
    SubgroupWriter,
    decode_datagram,
    encode_padding_stream,
)
from .messages import (
    OPEN_END,
    SCOPE_PUBLISH_OK,
    SCOPE_REQUEST_UPDATE_OK,
    SCOPE_TRACK_STATUS_OK,
    ControlStreamParser,
    Fetch,
    FetchOk,
    Fill,
    Goaway,
    LocationFilterType,
    Message,
    Namespace,
    NamespaceDone,
    Parameters,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishStateNotify,
    Redirect,
    RequestErrorMessage,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
    inclusive_end_to_exclusive,
    location_filter_to_range,
)
from .profiles import profile

__all__ = ["MoqtSession"]


_RESERVED_FIRST_FIELDS = (b".", b".session")
_REQUEST_TYPES = (TrackStatus, Subscribe, Publish, Fetch, PublishNamespace, SubscribeNamespace, SubscribeTracks)

# Parameters a REQUEST_UPDATE may carry, by the kind of request it updates ("Parameter Scope":
# each parameter names the messages it may appear in, "REQUEST_UPDATE (for a
# subscription)" and the like; any other is a PROTOCOL_VIOLATION).
_SUBSCRIPTION_UPDATE_SCOPE = frozenset({0x02, 0x03, 0x06, 0x10, 0x20, 0x21, 0x32})
_UPDATE_SCOPE: dict[type, frozenset[int]] = {
    Subscribe: _SUBSCRIPTION_UPDATE_SCOPE,
    Publish: _SUBSCRIPTION_UPDATE_SCOPE,
    Fetch: frozenset({0x03, 0x20}),
    SubscribeNamespace: frozenset({0x03, 0x34}),
    SubscribeTracks: frozenset({0x03, 0x34}),
    PublishNamespace: frozenset({0x03}),
}






@dataclass(eq=False)
class _Request(RequestState):
    """State of one draft-18 request stream."""

    stream_id: int = field(kw_only=True)
    message: Message = field(kw_only=True)
    fin_sent: bool = False
    fin_received: bool = False
    our_updates: deque = field(default_factory=deque)  # REQUEST_UPDATEs awaiting an answer
    peer_updates: deque = field(default_factory=deque)  # peer REQUEST_UPDATEs we must answer
    goaway_seen: bool = False
    namespaces: set = field(default_factory=set)  # NAMESPACE suffixes announced on this stream










@dataclass(eq=False)
class _Fill(RequestState):
    """A draft-20+ fill: FILL_PARAMETERS on a peer's SUBSCRIBE (or REQUEST_UPDATE),
    served as the joining FETCH it replaces. It has no stream of its own and no answer
    (no FETCH_OK; a refusal sends nothing, or resets the fetch stream); its fetch stream
    carries the Request ID of the message that asked for it (`wire_id`)."""

    wire_id: int = field(kw_only=True)
    joined: RequestState = field(kw_only=True)  # the subscription it fills
    #: The range, when the fill names one: evaluated as a FETCH's (draft-18 form: end
    #: exclusive, Object 0 the whole group), clamped to the Largest Object.
    bounds: tuple[Location, Location] | None = None


#: Why a request with range filters is refused: this endpoint advertises no MAX_FILTER_RANGES.
_NO_RANGE_FILTERS = "range filters are not accepted (MAX_FILTER_RANGES 0)"

#: Fills are kept under IDs no peer request can have.
_FILL_ID_BASE = 1 << 64


def _fill_as_joining(
    fill: Fill, subscription: SubscriptionFilter | None
) -> tuple[FetchType, int, tuple[Location, Location] | None] | None:
    """The joining FETCH a fill amounts to: its type, Joining Start and, for a range named
    by Locations, that range (a FETCH's, ended at the Largest Object when open); None when
    it is empty (it starts after the Largest Object)."""
    if fill.location_filter is not None:
        kind, values = fill.location_filter
        if kind == LocationFilterType.NEXT_OBJECT or (kind == LocationFilterType.RELATIVE_START and values[0] == 0):
            return None
        if kind == LocationFilterType.RELATIVE_START:
            return FetchType.RELATIVE_JOINING, values[0] - 1, None
        start, end = location_filter_to_range(fill.location_filter)
        return FetchType.ABSOLUTE_JOINING, start.group, (start, end)
    if subscription is None:
        return FetchType.ABSOLUTE_JOINING, 0, None
    if subscription.start is None:  # Next Group Start, Largest Object: nothing before them
        return None
    end = OPEN_END if subscription.end_group is None else Location(subscription.end_group, 0)
    if subscription.end_object is not None:
        end = inclusive_end_to_exclusive(Location(subscription.end_group, subscription.end_object))  # type: ignore[arg-type]
    return FetchType.ABSOLUTE_JOINING, subscription.start.group, (subscription.start, end)


def _covers_more(end: Location, other: Location) -> bool:
    """Whether the range end `end` reaches past `other` (both draft-18 FETCH ends)."""
    def key(x: Location) -> tuple[int, int]:
        return (x.group + 1, 0) if x.object == 0 else (x.group, x.object)
    return key(end) > key(other)


class MoqtSession(SessionBase):
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
            max_object_size=max_object_size,
            max_auth_token_cache_size=max_auth_token_cache_size,
            max_buffered_before_setup=max_buffered_before_setup,
            max_unmatched_stream_bytes=max_unmatched_stream_bytes,
            accept_path=accept_path,
            accept_authority=accept_authority,
        )
        self._goaway_sent_request_id: int | None = None
        self._peer_ids = RequestIdTracker(1 if is_client else 0)
        self._requests: dict[int, _Request] = {}  # type: ignore[assignment]
        self._stream_requests: dict[int, _Request] = {}
        self._request_parsers: dict[int, ControlStreamParser] = {}
        self._update_parent: dict[int, _Request] = {}
        self._update_parameters: dict[int, Parameters] = {}  # REQUEST_UPDATEs not yet answered
        self._fills: dict[int, list[_Fill]] = {}  # fills being served, by the subscription's Request ID

        self._peer_control_stream_id: int | None = None
        self._control_parser = ControlStreamParser(draft)
        self._unclassified_uni: dict[int, bytearray] = {}
        self._ignored_streams: set[int] = set()
        options = self.local_setup
        self._control_stream_id = quic.get_next_available_stream_id(is_unidirectional=True)
        quic.send_stream_data(self._control_stream_id, options.encode(draft))

    # ------------------------------------------------------------------
    # Properties
    # ------------------------------------------------------------------

    def request_stream_id(self, request_id: int) -> int | None:
        request = self._requests.get(request_id)
        return None if request is None else request.stream_id

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def _is_control_event(self, event: QuicEvent) -> bool:
        """Whether an event arriving before the peer's SETUP is processed at once:
        traffic of the peer's control stream, or of a new unidirectional stream
        that may be it (its type decides)."""
        sid = getattr(event, "stream_id", None)
        if sid is None:
            return False
        if sid == self._peer_control_stream_id or sid == self._control_stream_id:
            return True
        return (
            isinstance(event, StreamDataReceived)
            and stream_is_unidirectional(sid)
            and self._peer_control_stream_id is None
            and sid not in self._incoming_data
            and not self._is_local_stream(sid)
        )

    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._peer_control_stream_id:
            self._on_control_data(event.data, out)
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            return
        data_stream = self._incoming_data.get(sid)
        if data_stream is not None:
            self._on_data_stream(sid, data_stream, event.data, event.end_stream, out)
            return
        if sid in self._ignored_streams:
            return
        if stream_is_unidirectional(sid):
            if self._is_local_stream(sid):
                return
            self._on_new_uni(sid, event, out)
            return
        self._on_request_stream(sid, event.data, event.end_stream, out)

    def _on_new_uni(self, sid: int, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        prefix = self._unclassified_uni.pop(sid, bytearray()) + event.data
        try:
            stream_type, _ = decode_vi64(prefix, 0)
        except ProtocolViolation:
            if event.end_stream:
                raise ProtocolViolation("unidirectional stream ended inside its type") from None
            self._unclassified_uni[sid] = prefix
            return
        if stream_type == STREAM_TYPE_SETUP:
            if self._peer_control_stream_id is not None:
                raise ProtocolViolation("second control stream")
            self._peer_control_stream_id = sid
            if event.end_stream:
                raise ProtocolViolation("control stream closed")
            self._on_control_data(bytes(prefix), out)
            return
        parser = DataStreamParser(
            max_object_size=self.max_object_size,
            fetch_group_order=self._fetch_order_of,
            timed_out_range=self.profile.timed_out_range,
        )
        data_stream = IncomingDataStream(parser)
        self._incoming_data[sid] = data_stream
        if self.peer_setup is None:
            self._hold_before_setup(StreamDataReceived(data=bytes(prefix), end_stream=event.end_stream, stream_id=sid))
            return
        self._on_data_stream(sid, data_stream, bytes(prefix), event.end_stream, out)

    # -- control stream ----------------------------------------------------

    def _on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        for message in self._control_parser.feed(data):
            if self.peer_setup is None:
                if not isinstance(message, Setup):
                    raise ProtocolViolation(f"{message.NAME} before SETUP")
                self._on_setup(message, out)
                continue
            if isinstance(message, Goaway):
                self._on_session_goaway(message, out)
            else:
                raise ProtocolViolation(f"{message.NAME} on the control stream")

    def _on_setup(self, setup: Setup, out: list[ev.MoqtEvent]) -> None:
        self._check_peer_target(setup.path, setup.authority, "option")
        self._register_setup_tokens(setup.authorization_tokens)
        self.peer_setup = setup
        out.append(ev.SetupCompleted(setup))
        self._replay_held(out)

    def _on_session_goaway(self, message: Goaway, out: list[ev.MoqtEvent]) -> None:
        if self.goaway_received is not None:
            raise ProtocolViolation("second GOAWAY on the control stream")
        if not self._is_client and message.new_session_uri:
            raise ProtocolViolation("GOAWAY with a URI from the client")
        own_parity = 0 if self._is_client else 1
        if message.request_id is not None and message.request_id & 1 != own_parity:
            raise InvalidRequestId(f"GOAWAY Request ID {message.request_id} has the wrong parity")
        event = ev.GoawayReceived(message.new_session_uri, message.timeout_ms, message.request_id, None)
        self.goaway_received = event
        out.append(event)

    # -- request streams ---------------------------------------------------

    def _on_request_stream(self, sid: int, data: bytes, end_stream: bool, out: list[ev.MoqtEvent]) -> None:
        parser = self._request_parsers.get(sid)
        if parser is None:
            if self._is_local_stream(sid) or sid in self._ignored_streams:
                return
            parser = self._request_parsers[sid] = ControlStreamParser(self.draft)
        for message in parser.feed(data):
            request = self._stream_requests.get(sid)
            if request is None:
                self._on_new_request(sid, message, out)
            else:
                self._on_request_message(request, message, out)
        if end_stream:
            if parser.buffered:
                raise ProtocolViolation("request stream ended inside a message")
            request = self._stream_requests.get(sid)
            if request is None:
                if sid not in self._ignored_streams:
                    raise ProtocolViolation("request stream ended before its request")
                return
            self._on_request_fin(request, out)

    def _check_peer_request_id(self, request_id: int) -> None:
        peer_parity = 0 if not self._is_client else 1
        if request_id & 1 != peer_parity:
            raise InvalidRequestId(f"peer Request ID {request_id} has the wrong parity")
        if not self._peer_ids.add(request_id):
            raise InvalidRequestId(f"peer Request ID {request_id} repeated")

    def _on_new_request(self, sid: int, message: Message, out: list[ev.MoqtEvent]) -> None:
        if not isinstance(message, _REQUEST_TYPES):
            raise ProtocolViolation(f"request stream begins with {message.NAME}")
        request_id: int = message.request_id  # type: ignore[attr-defined]
        self._check_peer_request_id(request_id)
        parameters: Parameters = message.parameters  # type: ignore[attr-defined]
        request = _Request(request_id, type(message), False, parameters, stream_id=sid, message=message)
        self._requests[request_id] = request
        self._stream_requests[sid] = request
        tokens = self._resolve_tokens(parameters.authorization_tokens)

        if self._goaway_sent_request_id is not None and request_id >= self._goaway_sent_request_id:
            self._reject(request, RequestErrorCode.GOING_AWAY, "going away")
            return
        namespace = getattr(message, "namespace", None)
        if namespace is None:
            namespace = getattr(message, "namespace_prefix", None)
        if namespace and namespace[0] in _RESERVED_FIRST_FIELDS:
            # Section 3.2: "." is never used and no session-level track is
            # defined, so both are rejected here, not passed to the application.
            self._reject(request, RequestErrorCode.DOES_NOT_EXIST, "reserved namespace")
            return
        if parameters.range_filters:
            self._reject(request, RequestErrorCode.INVALID_FILTER, _NO_RANGE_FILTERS)
            return
        if parameters.unsupported:
            self._reject(request, RequestErrorCode.NOT_SUPPORTED, f"not supported: {parameters.unsupported}")
            return

        if isinstance(message, Subscribe):
            out.append(ev.SubscribeReceived(request_id, message.namespace, message.track_name, parameters, tokens))
            if parameters.fill is not None:
                self._open_fill(request, parameters.fill, request_id, tokens, out)
        elif isinstance(message, Publish):
            unsupported = mandatory_properties(message.track_properties)
            other = self._aliases_in.get(message.track_alias)
            if other is not None and not other.closed:
                raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
            request.track_alias = message.track_alias
            request.default_priority = property_value(
                message.track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
            )
            self._aliases_in[message.track_alias] = request
            if unsupported:
                self._reject(request, RequestErrorCode.UNSUPPORTED_EXTENSION, "unsupported mandatory property")
                return
            out.append(
                ev.PublishReceived(
                    request_id,
                    message.namespace,
                    message.track_name,
                    message.track_alias,
                    parameters,
                    message.track_properties,
                    tokens,
                )
            )
            self._flush_held_for_alias(message.track_alias, out)
        elif isinstance(message, Fetch):
            self._on_fetch_request(request, message, tokens, out)
        elif isinstance(message, TrackStatus):
            out.append(ev.TrackStatusReceived(request_id, message.namespace, message.track_name, parameters, tokens))
        elif isinstance(message, PublishNamespace):
            out.append(ev.PublishNamespaceReceived(request_id, message.namespace, parameters, tokens))
        elif isinstance(message, SubscribeNamespace):
            out.append(ev.SubscribeNamespaceReceived(request_id, message.namespace_prefix, parameters, tokens))
        elif isinstance(message, SubscribeTracks):
            out.append(ev.SubscribeTracksReceived(request_id, message.namespace_prefix, parameters, tokens))

    def _open_fill(
        self, joined: RequestState, fill: Fill, wire_id: int, tokens: tuple, out: list[ev.MoqtEvent]
    ) -> None:
        """Serve a fill as the joining FETCH it replaces (held until the SUBSCRIBE is
        answered, like one); the layer above sees a FetchReceived."""
        joining = _fill_as_joining(fill, joined.parameters.subscription_filter)
        if joining is None:
            return
        fetch_type, joining_start, bounds = joining
        internal = _FILL_ID_BASE + wire_id
        parameters = Parameters(
            subscriber_priority=fill.subscriber_priority,
            group_order=fill.group_order or joined.parameters.group_order,
        )
        message = Fetch(internal, fetch_type, joining_request_id=joined.request_id, joining_start=joining_start,
                        parameters=parameters)
        request = _Fill(internal, Fetch, False, parameters, wire_id=wire_id, joined=joined, bounds=bounds)
        self._requests[internal] = request  # type: ignore[assignment]
        self._fills.setdefault(joined.request_id, []).append(request)
        self._on_fetch_request(request, message, tokens, out)

    def _resolve_joining(
        self, request: RequestState, message: Fetch, tokens: tuple, joined: RequestState, out: list[ev.MoqtEvent]
    ) -> None:
        """A fill that names its range is that range clamped to the Largest Object (a
        FETCH's evaluation); nothing is sent when it starts after the Largest Object."""
        if not isinstance(request, _Fill) or request.bounds is None:
            super()._resolve_joining(request, message, tokens, joined, out)
            return
        largest = joined.largest_at_ok
        start, end = request.bounds
        if joined.parameters.forward is False or largest is None or start > largest:
            self._end_fill(request)
            return
        limit = Location(largest.group, largest.object + 1)
        if _covers_more(end, limit):
            end = limit
        namespace, track_name = self._track_of(joined)
        out.append(ev.FetchReceived(request.request_id, message.fetch_type, namespace, track_name, start, end,
                                    joined.request_id, message.parameters, tokens))

    def _on_data_stream_stopped(self, sid: int, error_code: int, out: list[ev.MoqtEvent]) -> bool:
        stream = self._outgoing_data.get(sid)
        if not super()._on_data_stream_stopped(sid, error_code, out):
            return False
        if stream is not None and isinstance(stream.request, _Fill):
            self._end_fill(stream.request)  # the subscriber wants no more of this fill
        return True

    def _filled_subscription(self, request_id: int) -> RequestState | None:
        """Our subscription whose fill a FETCH_HEADER with this Request ID carries: the
        SUBSCRIBE's own ID, or one of its REQUEST_UPDATEs' (draft-20+)."""
        if not self.profile.location_filter:
            return None
        request = self._requests.get(request_id)
        if request is None:
            request = self._update_parent.get(request_id)
        if request is None or request.kind is not Subscribe or not request.local:
            return None
        return request

    def _wire_id(self, request: RequestState) -> int:
        return request.wire_id if isinstance(request, _Fill) else request.request_id

    def _open_data_stream(self, request: RequestState, writer: object) -> int:
        sid = super()._open_data_stream(request, writer)
        if isinstance(request, _Fill):
            request.joined.data_streams_opened += 1  # draft-20: PUBLISH_DONE counts fill streams
        return sid

    def _end_fill(self, request: _Fill, error_code: int | None = None) -> None:
        """A fill is over: reset its stream when it failed, and forget it."""
        request.answered = request.closed = True
        siblings = self._fills.get(request.joined.request_id)
        if siblings is not None and request in siblings:
            siblings.remove(request)
            if not siblings:
                del self._fills[request.joined.request_id]
        if error_code is not None:
            for sid in list(request.open_data_streams):
                if sid in self._outgoing_data:
                    self.reset_data_stream(sid, error_code)
        if not request.open_data_streams:
            self._requests.pop(request.request_id, None)

    def _on_request_message(self, request: _Request, message: Message, out: list[ev.MoqtEvent]) -> None:
        if request.closed:
            return
        if isinstance(message, Goaway):
            if request.goaway_seen:
                raise ProtocolViolation("second GOAWAY on a request stream")
            if message.request_id is not None:
                raise ProtocolViolation("GOAWAY with a Request ID on a request stream")
            request.goaway_seen = True
            out.append(ev.GoawayReceived(message.new_session_uri, message.timeout_ms, None, request.request_id))
            return
        if isinstance(message, RequestUpdate):
            self._on_peer_update(request, message, out)
            return
        if isinstance(message, PublishStateNotify):
            # Draft-20: the publisher changed Forward, the filter or the Largest Object of the
            # subscription itself; nothing is answered, nothing here depends on it.
            if not request.is_subscription or request.publisher_is_local:
                raise ProtocolViolation("PUBLISH_STATE_NOTIFY from the subscriber")
            return
        if request.local and not request.answered:
            self._on_first_answer(request, message, out)
            return
        if isinstance(message, (RequestOk, RequestErrorMessage)):
            if not request.our_updates:
                raise ProtocolViolation(f"unexpected {message.NAME}")
            update_id = request.our_updates.popleft()
            self._update_parent.pop(update_id, None)
            sent = self._update_parameters.pop(update_id, None)
            if isinstance(message, RequestOk) and sent is not None:
                self._apply_update(request, sent, message.parameters)
            if isinstance(message, RequestOk):
                out.append(ev.RequestAccepted(update_id, message.parameters, message.track_properties))
            else:
                out.append(
                    ev.RequestRejected(
                        update_id, message.error_code, message.reason, message.retry_interval, message.redirect
                    )
                )
            return
        if isinstance(message, PublishDone):
            if not request.is_subscription or request.publisher_is_local:
                raise ProtocolViolation("PUBLISH_DONE from the subscriber")
            if request.done_stream_count is not None:
                raise ProtocolViolation("second PUBLISH_DONE")
            out.append(ev.PublishDoneReceived(request.request_id, message.status_code, message.stream_count, message.reason))
            # Late data streams are still accepted until Stream Count of them ended.
            request.done_stream_count = message.stream_count
            self._finish_stream(request)
            self._maybe_end_subscription(request)
            return
        if isinstance(message, (Namespace, NamespaceDone)) and request.local and request.kind is SubscribeNamespace:
            prefix = request.message.namespace_prefix  # type: ignore[attr-defined]
            suffix = message.namespace_suffix
            if isinstance(message, Namespace):
                request.namespaces.add(suffix)
                out.append(ev.NamespaceReceived(request.request_id, suffix, prefix + suffix))
            else:
                if suffix not in request.namespaces:
                    raise ProtocolViolation("NAMESPACE_DONE before NAMESPACE")
                request.namespaces.discard(suffix)
                out.append(ev.NamespaceDoneReceived(request.request_id, suffix, prefix + suffix))
            return
        if isinstance(message, PublishBlocked) and request.local and request.kind is SubscribeTracks:
            prefix = request.message.namespace_prefix  # type: ignore[attr-defined]
            out.append(ev.PublishBlockedReceived(request.request_id, prefix + message.namespace_suffix, message.track_name))
            return
        raise ProtocolViolation(f"{message.NAME} not expected on a {request.kind.NAME} stream")

    def _on_first_answer(self, request: _Request, message: Message, out: list[ev.MoqtEvent]) -> None:
        request.answered = True
        kind = request.kind
        rid = request.request_id
        if isinstance(message, RequestErrorMessage):
            request.closed = True
            out.append(ev.RequestRejected(rid, message.error_code, message.reason, message.retry_interval, message.redirect))
            self._finish_stream(request)
            return
        if kind is Subscribe and isinstance(message, SubscribeOk):
            other = self._aliases_in.get(message.track_alias)
            if other is not None and other is not request and not other.closed:
                raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
            if mandatory_properties(message.track_properties):
                self._cancel(request, StreamResetCode.CANCELLED)
                out.append(
                    ev.RequestRejected(
                        rid, RequestErrorCode.UNSUPPORTED_EXTENSION, "unsupported mandatory property", 0, None
                    )
                )
                return
            request.accepted = True
            request.track_alias = message.track_alias
            request.default_priority = property_value(
                message.track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
            )
            self._aliases_in[message.track_alias] = request
            out.append(ev.SubscribeAccepted(rid, message.track_alias, message.parameters, message.track_properties))
            self._flush_held_for_alias(message.track_alias, out)
            return
        if kind is Fetch and isinstance(message, FetchOk):
            fetch: Fetch = request.message  # type: ignore[assignment]
            if fetch.fetch_type == FetchType.STANDALONE and fetch_end_before_start(message.end_location, fetch.start):  # type: ignore[arg-type]
                raise ProtocolViolation("FETCH_OK End Location before the FETCH start")
            if mandatory_properties(message.track_properties):
                self._cancel(request, StreamResetCode.CANCELLED)
                out.append(
                    ev.RequestRejected(
                        rid, RequestErrorCode.UNSUPPORTED_EXTENSION, "unsupported mandatory property", 0, None
                    )
                )
                return
            request.accepted = True
            out.append(
                ev.FetchAccepted(rid, message.end_of_track, message.end_location, message.parameters, message.track_properties)
            )
            self._maybe_finish_fetch(request)
            return
        if kind not in (Subscribe, Fetch) and isinstance(message, RequestOk):
            if kind is Publish:
                allowed = SCOPE_PUBLISH_OK
            elif kind is TrackStatus:
                allowed = SCOPE_TRACK_STATUS_OK
            else:
                allowed = frozenset({0x08})  # EXPIRES; namespace OKs carry nothing else
            for ptype in message.parameters.types():
                if ptype not in allowed:
                    raise ProtocolViolation(f"REQUEST_OK for {kind.NAME} with parameter 0x{ptype:x}")
            if message.track_properties and kind is not TrackStatus:
                raise ProtocolViolation(f"REQUEST_OK for {kind.NAME} with Track Properties")
            request.accepted = True
            if kind is Publish:
                request.parameters = request.parameters.merged(message.parameters)
            out.append(ev.RequestAccepted(rid, message.parameters, message.track_properties))
            if kind is TrackStatus:
                request.closed = True
                self._finish_stream(request)
            return
        raise ProtocolViolation(f"{message.NAME} is not an answer to {kind.NAME}")

    def _on_peer_update(self, request: _Request, message: RequestUpdate, out: list[ev.MoqtEvent]) -> None:
        self._check_peer_request_id(message.request_id)
        if request.kind in (TrackStatus,):
            raise ProtocolViolation("REQUEST_UPDATE on a TRACK_STATUS stream")
        # The requester updates its request; for a PUBLISH the subscriber may too.
        if request.local and request.kind is not Publish:
            raise ProtocolViolation(f"REQUEST_UPDATE from the responder of {request.kind.NAME}")
        allowed = _UPDATE_SCOPE.get(request.kind, frozenset())
        if self.profile.location_filter and request.kind in (Subscribe, Publish):
            allowed = allowed | {0x23}
        for ptype in message.parameters.types():
            if ptype not in allowed:
                raise ProtocolViolation(f"REQUEST_UPDATE of {request.kind.NAME} with parameter 0x{ptype:x}")
        request.peer_updates.append(message.request_id)
        self._update_parent[message.request_id] = request
        self._update_parameters[message.request_id] = message.parameters
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if message.parameters.range_filters:
            self.request_error(message.request_id, RequestErrorCode.INVALID_FILTER, _NO_RANGE_FILTERS)
            return
        if message.parameters.unsupported:
            self.request_error(message.request_id, RequestErrorCode.NOT_SUPPORTED,
                               f"not supported: {message.parameters.unsupported}")
            return
        out.append(ev.RequestUpdateReceived(message.request_id, request.request_id, message.parameters, tokens))
        if message.parameters.fill is not None and request.kind is Subscribe and not request.local:
            self._open_fill(request, message.parameters.fill, message.request_id, tokens, out)

    def _on_request_fin(self, request: _Request, out: list[ev.MoqtEvent]) -> None:
        request.fin_received = True
        if request.closed or request.done_stream_count is not None:
            self._forget_if_done(request)
            return
        kind = request.kind
        if request.local:
            # The responder will say nothing more: unanswered, or a subscription
            # or namespace registration left without its PUBLISH_DONE / withdrawal.
            cancels = not request.answered or kind in (Subscribe, PublishNamespace, SubscribeTracks)
        else:
            # Section 6.1: a requester FIN cancels SUBSCRIBE_NAMESPACE and
            # SUBSCRIBE_TRACKS; for PUBLISH_NAMESPACE it withdraws the namespace; a
            # PUBLISH ended without PUBLISH_DONE is over too.
            cancels = kind in (SubscribeNamespace, SubscribeTracks, PublishNamespace, Publish)
            if not self.profile.fin_cancels_discovery:
                # Draft-20: a FIN only ends what the requester sends; cancelling is a reset.
                cancels = kind is Publish
        if cancels:
            request.closed = True
            out.append(ev.RequestCancelled(request.request_id, StreamResetCode.CANCELLED, request.local))
            self._finish_stream(request)
        elif request.local and kind is SubscribeNamespace:
            # Treated as though each active namespace received NAMESPACE_DONE.
            prefix = request.message.namespace_prefix  # type: ignore[attr-defined]
            for suffix in sorted(request.namespaces):
                out.append(ev.NamespaceDoneReceived(request.request_id, suffix, prefix + suffix))
            request.namespaces.clear()
            request.closed = True
            out.append(ev.RequestCancelled(request.request_id, StreamResetCode.CANCELLED, True))
            self._finish_stream(request)
        elif request.local and kind is Fetch:
            self._maybe_finish_fetch(request)
        self._forget_if_done(request)

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._peer_control_stream_id:
            raise ProtocolViolation("control stream reset")
        data_stream = self._incoming_data.pop(sid, None)
        if data_stream is not None:
            self._on_data_stream_reset(sid, data_stream, event.error_code, out)
            return
        if self._unclassified_uni.pop(sid, None) is not None:
            return
        request = self._stream_requests.get(sid)
        if request is None:
            self._request_parsers.pop(sid, None)
            self._ignored_streams.add(sid)
            return
        request.fin_received = True
        if not request.closed:
            request.closed = True
            if not self._forget_held(request):
                out.append(ev.RequestCancelled(request.request_id, event.error_code, request.local))
            if request.local and request.kind is SubscribeNamespace:
                prefix = request.message.namespace_prefix  # type: ignore[attr-defined]
                for suffix in sorted(request.namespaces):
                    out.append(ev.NamespaceDoneReceived(request.request_id, suffix, prefix + suffix))
                request.namespaces.clear()
            self._abort_stream(request, StreamResetCode.CANCELLED)
        self._forget_if_done(request)

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if self._on_data_stream_stopped(sid, event.error_code, out):
            return
        if sid == self._control_stream_id:
            raise ProtocolViolation("STOP_SENDING on the control stream")
        request = self._stream_requests.get(sid)
        if request is None:
            return
        request.fin_sent = True  # the stream was reset by the transport
        if not request.closed:
            request.closed = True
            if not self._forget_held(request):
                out.append(ev.RequestCancelled(request.request_id, event.error_code, request.local))
            self._abort_stream(request, event.error_code)
        self._forget_if_done(request)

    # -- data streams ------------------------------------------------------

    def _fetch_order_of(self, request_id: int) -> GroupOrder:
        request = self._requests.get(request_id)
        return GroupOrder.ASCENDING if request is None else request.fetch_group_order

    def _on_data_header(self, sid: int, stream: IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> bool:
        if isinstance(item, PaddingHeader):
            stream.discard = True
            return False
        if isinstance(item, FetchHeader):
            stream.fetch = True
            request = self._requests.get(item.request_id)
            subscription = self._filled_subscription(item.request_id)
            if subscription is not None:
                # Draft-20: a fill of our subscription; its objects are the subscription's.
                stream.fill = True
                stream.request = subscription
                if subscription.closed:
                    self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
                    return False
                subscription.open_data_streams.add(sid)
                out.append(ev.SubgroupStreamOpened(subscription.request_id, sid, None))
                return True
            if request is None or request.kind is not Fetch or not request.local:
                raise ProtocolViolation(f"FETCH_HEADER for unknown fetch {item.request_id}")
            if request.closed:
                self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
                return False
            stream.request = request
            request.open_data_streams.add(sid)
            return True
        assert isinstance(item, SubgroupHeader)
        return self._on_subgroup_header(sid, stream, item, out)

    # -- authorization tokens ----------------------------------------------

    # ------------------------------------------------------------------
    # Sending: requests
    # ------------------------------------------------------------------

    def _open_request(self, build) -> int:
        self._check_open()
        request_id = self._next_request_id
        message = build(request_id)
        data = message.encode(self.draft)
        self._next_request_id += 2
        sid = self._quic.get_next_available_stream_id(is_unidirectional=False)
        request = _Request(request_id, type(message), True, message.parameters, stream_id=sid, message=message)
        if isinstance(message, Fetch) and message.parameters.group_order is not None:
            request.fetch_group_order = message.parameters.group_order
        self._requests[request_id] = request
        self._stream_requests[sid] = request
        self._request_parsers[sid] = ControlStreamParser(self.draft)
        self._quic.send_stream_data(sid, data)
        return request_id

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE on a new request stream; returns its Request ID."""
        return self._open_request(lambda rid: Subscribe(rid, namespace, track_name, parameters))

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
        return self._open_request(
            lambda rid: Fetch(rid, FetchType.STANDALONE, namespace, track_name, Location(*start), Location(*end), parameters=parameters)
        )

    def joining_fetch(
        self, subscribe_request_id: int, joining_start: int, *, relative: bool = True, parameters: Parameters = Parameters()
    ) -> int:
        """Send a joining FETCH for one of our subscriptions (draft-18 only: from
        draft-20 on, FILL_PARAMETERS in the SUBSCRIBE asks for the same objects)."""
        if self.profile.location_filter:
            raise NotSupported(f"draft-{self.draft} has no joining FETCH")
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        return self._open_request(
            lambda rid: Fetch(
                rid, fetch_type, joining_request_id=subscribe_request_id, joining_start=joining_start, parameters=parameters
            )
        )

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        return self._open_request(lambda rid: TrackStatus(rid, namespace, track_name, parameters))

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        return self._open_request(lambda rid: PublishNamespace(rid, namespace, parameters))

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        return self._open_request(lambda rid: SubscribeNamespace(rid, namespace_prefix, parameters))

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters = Parameters()) -> int:
        return self._open_request(lambda rid: SubscribeTracks(rid, namespace_prefix, parameters))

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
        request_id = self._open_request(
            lambda rid: Publish(rid, namespace, track_name, alias, parameters, track_properties)
        )
        request = self._requests[request_id]
        request.track_alias = alias
        request.accepted = False
        request.largest_at_ok = parameters.largest_object
        self._aliases_out[alias] = request
        return request_id

    def request_update(self, request_id: int, parameters: Parameters) -> int:
        """Send REQUEST_UPDATE for a request of ours (or a PUBLISH we receive);
        returns the update's own Request ID, which its answer will carry."""
        self._check_open()
        request = self._request(request_id)
        if request.closed or request.fin_sent:
            raise StreamClosed(f"request {request_id} is closed")
        if not request.local and request.kind is not Publish:
            raise ValueError("only the requester updates a request (or the subscriber of a PUBLISH)")
        allowed = _UPDATE_SCOPE.get(request.kind, frozenset())
        for ptype in parameters.types():
            if ptype not in allowed:
                raise ValueError(f"parameter 0x{ptype:x} cannot update a {request.kind.NAME}")
        update_id = self._next_request_id
        data = RequestUpdate(update_id, parameters).encode(self.draft)
        self._next_request_id += 2
        request.our_updates.append(update_id)
        self._update_parent[update_id] = request
        self._update_parameters[update_id] = parameters
        self._quic.send_stream_data(request.stream_id, data)
        return update_id

    def cancel_request(self, request_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Abandon a request: reset our side of its stream and STOP_SENDING the other.

        This unsubscribes, withdraws a published namespace, stops a fetch, ...
        """
        request = self._requests.get(request_id)
        if request is None or self._closed:
            return
        request.closed = True
        self._abort_stream(request, error_code)
        for sid in list(request.open_data_streams):
            stream = self._incoming_data.get(sid)
            if stream is not None:
                self._stop_incoming(sid, stream, error_code)
        self._forget_if_done(request)

    def goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY on the control stream; later peer requests are refused."""
        self._check_open()
        if self._is_client and new_session_uri:
            raise ValueError("a client sends GOAWAY without a URI")
        highest = self._peer_ids.highest
        last = (0 if not self._is_client else 1) if highest is None else highest + 2
        self._goaway_sent_request_id = last
        self._quic.send_stream_data(self._control_stream_id, Goaway(new_session_uri, timeout_ms, last).encode(self.draft))

    def request_goaway(self, request_id: int, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        """Send GOAWAY on one request stream: re-issue this request elsewhere."""
        self._check_open()
        request = self._request(request_id)
        self._send_on_request(request, Goaway(new_session_uri, timeout_ms, None))

    # ------------------------------------------------------------------
    # Sending: answers
    # ------------------------------------------------------------------

    def _send_on_request(self, request: _Request, message: Message, end_stream: bool = False) -> None:
        if request.fin_sent:
            raise StreamClosed(f"request stream of {request.request_id} is closed")
        data = message.encode(self.draft)
        try:
            self._quic.send_stream_data(request.stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError, AssertionError) as exc:
            request.fin_sent = True
            raise StreamClosed(f"request stream of {request.request_id}: {exc}") from None
        if end_stream:
            request.fin_sent = True
            self._forget_if_done(request)

    def request_ok(self, request_id: int, parameters: Parameters = Parameters(), track_properties: Properties = ()) -> None:
        """Send REQUEST_OK: PUBLISH_OK, TRACK_STATUS_OK, PUBLISH_NAMESPACE_OK,
        SUBSCRIBE_NAMESPACE_OK, SUBSCRIBE_TRACKS_OK, or the answer to a peer's
        REQUEST_UPDATE (pass the update's Request ID)."""
        self._check_open()
        parent = self._update_parent.get(request_id)
        if parent is not None and request_id in parent.peer_updates:
            _check_scope(parameters, SCOPE_REQUEST_UPDATE_OK, "REQUEST_UPDATE_OK")
            self._answer_update(parent, request_id)
            update = self._update_parameters.pop(request_id, None)
            if update is not None:
                self._apply_update(parent, update, parameters)
            self._send_on_request(parent, RequestOk(parameters, ()))
            return
        request = self._peer_request(
            request_id, (Publish, TrackStatus, PublishNamespace, SubscribeNamespace, SubscribeTracks)
        )
        follow_up = None
        if request.kind is Publish:
            _check_scope(parameters, SCOPE_PUBLISH_OK, "PUBLISH_OK")
            if self.profile.publish_ok_expires_only:
                # Draft-20: PUBLISH_OK carries EXPIRES; the subscriber's settings follow
                # in a REQUEST_UPDATE (which has no GROUP_ORDER).
                rest = replace(parameters, expires=None, group_order=None)
                follow_up = rest if rest.types() else None
                parameters = Parameters(expires=parameters.expires)
        elif request.kind is TrackStatus:
            _check_scope(parameters, SCOPE_TRACK_STATUS_OK, "TRACK_STATUS_OK")
        else:
            _check_scope(parameters, frozenset({0x08}), "REQUEST_OK")
        if track_properties and request.kind is not TrackStatus:
            raise ValueError("Track Properties go only in TRACK_STATUS_OK")
        final = request.kind is TrackStatus
        self._send_on_request(request, RequestOk(parameters, track_properties), end_stream=final)
        request.answered = request.accepted = True
        if request.kind is Publish:
            request.parameters = request.parameters.merged(parameters)
            if follow_up is not None:
                self.request_update(request_id, follow_up)
        if final:
            request.closed = True
            self._forget_if_done(request)

    def _apply_update(self, request: _Request, update: Parameters, answer: Parameters) -> None:
        """An accepted REQUEST_UPDATE changes the request's parameters; one that turns
        the Forward State from 0 to 1 sets the Joining Location to the LARGEST_OBJECT of
        its REQUEST_UPDATE_OK (draft-18 "Subscriptions")."""
        resumed = request.parameters.forward is False and update.forward is True
        request.parameters = request.parameters.merged(update)
        if resumed and request.is_subscription:
            request.largest_at_ok = answer.largest_object

    def _answer_update(self, request: _Request, update_id: int) -> None:
        if not request.peer_updates or request.peer_updates[0] != update_id:
            raise ValueError(f"REQUEST_UPDATE {update_id} is not the oldest unanswered update")
        request.peer_updates.popleft()
        self._update_parent.pop(update_id, None)

    def request_error(
        self,
        request_id: int,
        error_code: int,
        reason: str = "",
        *,
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        """Reject a peer's request (and close its stream) or one of its REQUEST_UPDATEs.

        A failed update of a subscription this endpoint publishes also ends it with
        PUBLISH_DONE UPDATE_FAILED, as section 10.9.1 requires.
        """
        self._check_open()
        message = RequestErrorMessage(error_code, retry_interval, reason, redirect)
        parent = self._update_parent.get(request_id)
        if parent is not None and request_id in parent.peer_updates:
            self._answer_update(parent, request_id)
            self._update_parameters.pop(request_id, None)
            self._send_on_request(parent, message)
            if parent.is_subscription and parent.publisher_is_local and parent.accepted:
                self.publish_done(parent.request_id, PublishDoneCode.UPDATE_FAILED, "update failed")
            elif parent.kind in (SubscribeNamespace, PublishNamespace, SubscribeTracks, Fetch):
                parent.closed = True
                self._finish_stream(parent)
            return
        request = self._peer_request(request_id, _REQUEST_TYPES)
        self._reject(request, error_code, reason, retry_interval, redirect)

    def _reject(
        self, request: _Request, error_code: int, reason: str, retry_interval: int = 0, redirect: Redirect | None = None
    ) -> None:
        if isinstance(request, _Fill):
            self._end_fill(request, StreamResetCode.INTERNAL_ERROR)
            return
        if not self.profile.joining_error_codes and error_code in (
            RequestErrorCode.DUPLICATE_SUBSCRIPTION, RequestErrorCode.INVALID_JOINING_REQUEST_ID
        ):
            error_code = RequestErrorCode.INTERNAL_ERROR  # codes draft-20 removed
        request.answered = True
        request.closed = True
        message = RequestErrorMessage(error_code, retry_interval, reason, redirect)
        try:
            self._send_on_request(request, message, end_stream=True)
        finally:
            if request.held_fetches:
                self._refuse_held_fetches(request, "subscription refused")

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE on a peer's SUBSCRIBE_NAMESPACE stream (after REQUEST_OK)."""
        request = self._answered_peer_request(request_id, SubscribeNamespace)
        request.namespaces.add(tuple(namespace_suffix))
        self._send_on_request(request, Namespace(tuple(namespace_suffix)))

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        request = self._answered_peer_request(request_id, SubscribeNamespace)
        suffix = tuple(namespace_suffix)
        if suffix not in request.namespaces:
            raise ValueError("NAMESPACE_DONE for a suffix never announced")
        request.namespaces.discard(suffix)
        self._send_on_request(request, NamespaceDone(suffix))

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        request = self._answered_peer_request(request_id, SubscribeTracks)
        self._send_on_request(request, PublishBlocked(tuple(namespace_suffix), track_name))

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    def write_fetch_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False, end_stream: bool = False
    ) -> None:
        stream = self._new_object(stream_id, fetch=True)
        marker = stream.writer.end_of_range(group_id, object_id, unknown=unknown)  # type: ignore[union-attr]
        self._send_data(stream, stream_id, marker, end_stream)

    def send_padding_stream(self, size: int) -> None:
        """Open a padding stream of `size` zero bytes and FIN it."""
        self._check_open()
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, encode_padding_stream(size), end_stream=True)

    # ------------------------------------------------------------------
    # Draft-18 forms of what SessionBase sends and receives
    # ------------------------------------------------------------------

    def _decode_datagram(self, data: bytes) -> ObjectDatagram | None:
        datagram = decode_datagram(data)
        return None if isinstance(datagram, PaddingDatagram) else datagram

    def _encode_datagram(self, request: RequestState, datagram: ObjectDatagram) -> bytes:
        return datagram.encode()

    def _subgroup_writer(self, request: RequestState, header: SubgroupHeader) -> SubgroupWriter:
        return SubgroupWriter(header)

    def _track_of(self, request: RequestState) -> tuple[TrackNamespace, bytes]:
        subscribe: Subscribe = request.message  # type: ignore[attr-defined]
        return subscribe.namespace, subscribe.track_name

    def _send_answer(self, request: RequestState, message: SubscribeOk | FetchOk) -> None:
        if isinstance(request, _Fill):
            return  # a fill has no FETCH_OK
        self._send_on_request(request, message)  # type: ignore[arg-type]

    def _send_publish_done(self, request: RequestState, status_code: int, reason: str) -> None:
        """PUBLISH_DONE ends the request stream too."""
        request.closed = True
        done = PublishDone(status_code, request.data_streams_opened, reason)
        self._send_on_request(request, done, end_stream=True)  # type: ignore[arg-type]

    def _fetch_stream_reset(self, request: RequestState) -> None:
        if isinstance(request, _Fill):
            self._end_fill(request, StreamResetCode.CANCELLED)
            return
        self._cancel(request, StreamResetCode.CANCELLED)  # type: ignore[arg-type]

    def _close_request(self, request: RequestState) -> None:
        if isinstance(request, _Fill):
            self._end_fill(request)
            return
        request.closed = True
        self._forget_if_done(request)  # type: ignore[arg-type]

    # ------------------------------------------------------------------
    # Request stream teardown
    # ------------------------------------------------------------------

    def _maybe_finish_fetch(self, request: _Request) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if isinstance(request, _Fill):
            if request.fetch_stream_closed and not request.open_data_streams:
                self._end_fill(request)
            return
        if request.local:
            if request.fetch_stream_closed:
                request.closed = True
                self._finish_stream(request)
        elif request.fetch_stream_closed and not request.open_data_streams:
            request.closed = True
            self._finish_stream(request)

    def _finish_stream(self, request: _Request) -> None:
        """FIN our side of a finished request's stream and forget it once both ends closed."""
        if not request.fin_sent:
            request.fin_sent = True
            try:
                self._quic.send_stream_data(request.stream_id, b"", end_stream=True)
            except (ValueError, RuntimeError, AssertionError):
                pass
        self._forget_if_done(request)

    def _abort_stream(self, request: _Request, error_code: int) -> None:
        for fill in list(self._fills.get(request.request_id, ())):
            self._end_fill(fill, error_code)  # draft-20: cancelling a subscription resets its fills
        if request.held_fetches:
            self._refuse_held_fetches(request, "subscription cancelled")
        for sid in list(request.open_data_streams):
            if sid in self._outgoing_data:
                self.reset_data_stream(sid, error_code)
        if not request.fin_sent:
            request.fin_sent = True
            try:
                self._quic.reset_stream(request.stream_id, error_code)
            except (ValueError, RuntimeError, AssertionError):
                pass
        if not request.fin_received:
            try:
                self._quic.stop_stream(request.stream_id, error_code)
            except (ValueError, RuntimeError, AssertionError):
                pass
            request.fin_received = True

    def _cancel(self, request: _Request, error_code: int) -> None:
        if isinstance(request, _Fill):
            self._end_fill(request, error_code)
            return
        request.closed = True
        self._abort_stream(request, error_code)
        self._forget_if_done(request)

    def _forget_if_done(self, request: _Request) -> None:
        if isinstance(request, _Fill):
            if request.closed and not request.open_data_streams:
                self._requests.pop(request.request_id, None)
            return
        """Drop per-stream state; the request entry stays while data may still refer to it."""
        if request.fin_sent and request.fin_received and request.closed:
            self._stream_requests.pop(request.stream_id, None)
            self._request_parsers.pop(request.stream_id, None)
            self._ignored_streams.add(request.stream_id)
            if not request.open_data_streams:
                self._requests.pop(request.request_id, None)
                for update_id in (*request.our_updates, *request.peer_updates):
                    self._update_parent.pop(update_id, None)
                    self._update_parameters.pop(update_id, None)
                if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                    del self._aliases_out[request.track_alias]


def _check_scope(parameters: Parameters, allowed: frozenset[int], name: str) -> None:
    for ptype in parameters.types():
        if ptype not in allowed:
            raise ValueError(f"{name} may not carry parameter 0x{ptype:x}")


