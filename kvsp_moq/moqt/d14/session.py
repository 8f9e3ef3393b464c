"""A draft-14 MOQT session over one QUIC connection, without I/O.

`MoqtSession14` has the constructor shape, the `handle_event()` contract and the
public methods of the draft-18 `MoqtSession`, and returns the same `events.py`
events, so the layer above needs no second code path for the fallback version.
Both derive from `session_base.SessionBase`, which keeps what the drafts share (token
cache, track aliases, joining FETCHes, data streams and datagrams, writing
objects); data stream items and answers are converted to and from their
draft-18 forms at the edges. The wire is draft-14's (codec in `messages` and `data`):

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
  its code renumbered to the draft-18 REQUEST_ERROR code (see `messages`), and a
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
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from .. import events as ev
from .. import wire
from ..d18 import data as data18
from ..d18 import messages as m18
from ..d18.messages import Parameters, Redirect, Setup
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
    SessionCloseCode,
    SessionError,
    StreamClosed,
    StreamResetCode,
)
from ..fetches import fetch_end_before_start
from ..session_base import SessionBase
from ..state import UNKNOWN_STREAM_COUNT, IncomingDataStream, RequestState
from ..wire import (
    DEFAULT_MAX_OBJECT_SIZE,
    DEFAULT_PUBLISHER_PRIORITY,
    FetchType,
    FilterType,
    GroupOrder,
    Location,
    ObjectStatus,
    Properties,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    property_value,
)
from . import data as d14data
from . import messages as d14

__all__ = ["MoqtSession14", "ALPN", "DEFAULT_MAX_REQUESTS", "UNKNOWN_STREAM_COUNT"]

ALPN = d14.ALPN
DEFAULT_MAX_REQUESTS = 100

# Request kinds: the draft-18 message class of each request. ANNOUNCED is a
# PUBLISH_NAMESPACE that answers a SUBSCRIBE_NAMESPACE (draft-18 NAMESPACE); TRACKS
# is the SUBSCRIBE_TRACKS half of a peer's SUBSCRIBE_NAMESPACE, never on the wire.
SUBSCRIBE = m18.Subscribe
FETCH = m18.Fetch
TRACK_STATUS = m18.TrackStatus
PUBLISH = m18.Publish
PUBLISH_NAMESPACE = m18.PublishNamespace
SUBSCRIBE_NAMESPACE = m18.SubscribeNamespace
ANNOUNCED = m18.Namespace
TRACKS = m18.SubscribeTracks
SUBSCRIBE_UPDATE = m18.RequestUpdate

#: Request IDs of TRACKS requests: above every varint, so never a wire Request ID.
_TRACKS_ID_BASE = 1 << 62

_ERROR_MESSAGES: dict[type, type] = {
    SUBSCRIBE: d14.SubscribeError,
    FETCH: d14.FetchError,
    TRACK_STATUS: d14.TrackStatusError,
    PUBLISH: d14.PublishError,
    PUBLISH_NAMESPACE: d14.PublishNamespaceError,
    SUBSCRIBE_NAMESPACE: d14.SubscribeNamespaceError,
}


@dataclass(eq=False)
class _Request(RequestState):
    """State of one draft-14 request; `parameters` are its draft-18 view."""

    namespace: TrackNamespace = ()
    track_name: bytes = b""
    fetch: m18.Fetch | None = None
    sent: bool = True  # False while queued behind the peer's Maximum Request ID
    announced: dict = field(default_factory=dict)  # SUBSCRIBE_NAMESPACE: suffix -> ANNOUNCED request
    parent: "_Request | None" = None  # ANNOUNCED, TRACKS: its SUBSCRIBE_NAMESPACE
    tracks: "_Request | None" = None  # peer SUBSCRIBE_NAMESPACE: its TRACKS half
    credit_returned: bool = False


class _DataStreamParser14:
    """Reads a draft-14 data stream and returns its items in their draft-18 form
    (a FETCH_HEADER is one already); what has none (objects that do not exist,
    fetch objects with a status) is dropped."""

    __slots__ = ("_parser",)

    def __init__(self, max_object_size: int) -> None:
        self._parser = d14data.DataStreamParser(max_object_size=max_object_size)

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> list[object]:
        items: list[object] = []
        for item in self._parser.feed(data, end_stream):
            converted = item if isinstance(item, data18.FetchHeader) else item.to_draft18()
            if converted is not None:
                items.append(converted)
        return items


class _SubgroupWriter14:
    """A draft-14 subgroup stream writer that takes draft-18 properties and statuses."""

    __slots__ = ("_writer",)

    def __init__(self, header: d14data.SubgroupHeader) -> None:
        self._writer = d14data.SubgroupWriter(header)

    def header_bytes(self) -> bytes:
        return self._writer.header_bytes()

    def object_header(
        self, object_id: int, payload_length: int, *, properties: Properties = (), status: ObjectStatus = ObjectStatus.NORMAL
    ) -> bytes:
        return self._writer.object_header(
            object_id, payload_length, extensions=_extensions(properties), status=d14.ObjectStatus(int(status))
        )


class _FetchWriter14:
    """A draft-14 fetch stream writer: every object repeats all its fields, so the
    group order needs no tracking."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: int, group_order: GroupOrder = GroupOrder.ASCENDING) -> None:
        self.request_id = request_id

    def header_bytes(self) -> bytes:
        return d14data.FetchHeader(self.request_id).encode()

    def object_header(
        self,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> bytes:
        """`subgroup_id` None (a Datagram object) is sent as the Object ID, draft-14's convention."""
        return d14data.encode_fetch_object(
            group_id, object_id if subgroup_id is None else subgroup_id, object_id, payload_length,
            publisher_priority=publisher_priority, extensions=_extensions(properties),
        )


class MoqtSession14(SessionBase):
    """The draft-14 MOQT state of one QUIC connection (ALPN "moq-00").

    `versions` are the SETUP versions offered (client, most preferred first) or
    accepted (server). `max_requests` bounds the peer's concurrent requests through
    MAX_REQUEST_ID. The client writes CLIENT_SETUP when the session is created.
    """

    _requests: dict[int, _Request]  # type: ignore[assignment]

    def __init__(
        self,
        quic: QuicEngine,
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
        self.versions = tuple(versions)
        if not self.versions:
            raise ValueError("no version to offer")
        self.version: int | None = None
        self._goaway_sent = False

        # Request IDs and their credit (section 9.1 / MAX_REQUEST_ID).
        self._max_requests = max_requests
        self._peer_next_id = 1 if is_client else 0
        self._peer_active = 0
        self._granted = self._peer_next_id + 2 * max_requests  # peer IDs below this are allowed
        self._peer_grant = 0  # our IDs below this may be sent
        self._blocked_reported: int | None = None
        self._queue: deque[list] = deque()  # [request_id, bytearray] not yet sent
        self._updates: dict[int, _Request] = {}  # peer SUBSCRIBE_UPDATE id -> subscription

        self._control_stream_id: int | None = None
        self._control_parser = d14.ControlStreamParser()
        if is_client:
            self._control_stream_id = quic.get_next_available_stream_id(is_unidirectional=False)
            hello = d14.ClientSetup(self.versions, self._setup_parameters())
            quic.send_stream_data(self._control_stream_id, hello.encode())

    def request_stream_id(self, request_id: int) -> int | None:
        """Draft-14 requests share the control stream."""
        return self._control_stream_id if request_id in self._requests else None

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def _is_control_event(self, event: QuicEvent) -> bool:
        """Before SETUP only the bidirectional control stream is read."""
        sid = getattr(event, "stream_id", None)
        return sid is not None and not stream_is_unidirectional(sid)

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
            stream = IncomingDataStream(_DataStreamParser14(self.max_object_size))
            self._incoming_data[sid] = stream
        self._on_data_stream(sid, stream, event.data, event.end_stream, out)

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        sid = event.stream_id
        if sid == self._control_stream_id:
            raise ProtocolViolation("control stream reset")
        stream = self._incoming_data.pop(sid, None)
        if stream is not None:
            self._on_data_stream_reset(sid, stream, event.error_code, out)

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        if event.stream_id == self._control_stream_id:
            raise ProtocolViolation("STOP_SENDING on the control stream")
        self._on_data_stream_stopped(event.stream_id, event.error_code, out)

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
        self._check_peer_target(message.parameters.path, message.parameters.authority, "parameter")
        self.version = version
        self._send(d14.ServerSetup(version, self._setup_parameters()))
        self._complete_setup(message.parameters, out)

    def _on_server_setup(self, message: d14.ServerSetup, out: list[ev.MoqtEvent]) -> None:
        if message.selected_version not in self.versions:
            raise SessionError(
                f"server chose version {message.selected_version:#x}, not offered",
                error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED,
            )
        self._check_peer_target(message.parameters.path, message.parameters.authority, "parameter")
        self.version = message.selected_version
        self._complete_setup(message.parameters, out)

    def _complete_setup(self, p: d14.SetupParameters, out: list[ev.MoqtEvent]) -> None:
        self._register_setup_tokens(p.authorization_tokens)
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
        self._replay_held(out)
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

    def _new_peer_request(self, request_id: int, kind: type, **fields) -> _Request:
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

    def _send_request(self, request: _Request, data: bytes) -> None:
        """Send an encoded request, or queue it until the peer's SETUP and grant allow."""
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
        """SUBSCRIBE, or TRACK_STATUS (SUBSCRIBE's format)."""
        s18 = message.to_draft18()
        status = isinstance(message, d14.TrackStatus)
        request = self._new_peer_request(
            message.request_id, TRACK_STATUS if status else SUBSCRIBE, parameters=s18.parameters,
            namespace=message.namespace, track_name=message.track_name,
        )
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        received = ev.TrackStatusReceived if status else ev.SubscribeReceived
        out.append(received(request.request_id, message.namespace, message.track_name, s18.parameters, tokens))

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
        properties: list[wire.Property] = []
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
        tokens = self._resolve_tokens(message.parameters.authorization_tokens)
        if self._refuse_if_going_away(request):
            return
        self._on_fetch_request(request, f18, tokens, out)

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

    def _our_request(self, request_id: int, kinds: tuple[type, ...], name: str) -> _Request | None:
        """Our request answered by `name`; None when it was cancelled meanwhile."""
        request = self._requests.get(request_id)
        if request is None or not request.local:
            if self._was_ours(request_id):
                return None  # ours, already forgotten
            raise ProtocolViolation(f"{name} for unknown request {request_id}")
        if request.kind not in kinds:
            raise ProtocolViolation(f"{name} answers a {request.kind.NAME}")
        if request.closed:
            return None
        return request

    def _first_answer(self, request_id: int, kinds: tuple[type, ...], name: str) -> _Request | None:
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
        if fetch.fetch_type == FetchType.STANDALONE and fetch_end_before_start(message.end_location, fetch.start):  # type: ignore[arg-type]
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
            kinds: tuple[type, ...] = (PUBLISH_NAMESPACE, ANNOUNCED)
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
        if self._forget_held(request):
            self._close_request(request)
            return
        out.append(ev.RequestCancelled(request.request_id, code, request.local))
        if request.held_fetches:
            self._refuse_held_fetches(request, "subscription cancelled")
        self._end_data_streams(request, StreamResetCode.CANCELLED)
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
        self._withdraw_announced(request)
        self._peer_cancelled(request, StreamResetCode.CANCELLED, out)
        self._end_tracks(request, out)

    def _end_tracks(self, request: _Request, out: list[ev.MoqtEvent]) -> None:
        """End the TRACKS half of a peer SUBSCRIBE_NAMESPACE that has ended."""
        tracks, request.tracks = request.tracks, None
        if tracks is not None and not tracks.closed:
            out.append(ev.RequestCancelled(tracks.request_id, StreamResetCode.CANCELLED, False))
            self._close_request(tracks)

    def _find_namespace(self, namespace: TrackNamespace, *, local: bool, kinds: tuple[type, ...]) -> _Request | None:
        for request in self._requests.values():
            if request.local == local and request.kind in kinds and request.namespace == namespace and not request.closed:
                return request
        return None

    def _withdraw_announced(self, request: _Request) -> None:
        """PUBLISH_NAMESPACE_DONE for every namespace announced under a peer's SUBSCRIBE_NAMESPACE."""
        for announced in list(request.announced.values()):
            self._withdraw(announced)
        request.announced.clear()

    def _withdraw(self, announced: _Request) -> None:
        if not announced.closed:
            self._send_about(announced, d14.PublishNamespaceDone(announced.namespace))
            self._close_request(announced)

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

    def _was_ours(self, request_id: int) -> bool:
        """Whether a Request ID is one this endpoint used (its request may be forgotten)."""
        return request_id & 1 == self._next_request_id & 1 and request_id < self._next_request_id

    def _on_data_header(self, sid: int, stream: IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> bool:
        if isinstance(item, data18.FetchHeader):
            stream.fetch = True
            request = self._requests.get(item.request_id)
            if request is None or request.closed:
                if self._was_ours(item.request_id):
                    self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
                    return False
                raise ProtocolViolation(f"FETCH_HEADER for unknown fetch {item.request_id}")
            if request.kind is not FETCH or not request.local:
                raise ProtocolViolation(f"FETCH_HEADER for request {item.request_id}, not a FETCH of ours")
            stream.request = request
            request.open_data_streams.add(sid)
            return True
        assert isinstance(item, data18.SubgroupHeader)
        return self._on_subgroup_header(sid, stream, item, out)

    def _stop_incoming(self, sid: int, stream: IncomingDataStream, code: int) -> None:
        request = stream.request
        attached = request is not None and not stream.discard and sid in request.open_data_streams
        super()._stop_incoming(sid, stream, code)
        if attached:
            self._forget_if_done(request)  # type: ignore[arg-type]

    def _end_data_streams(self, request: _Request, error_code: int) -> None:
        """Reset the data streams we send for a request and stop those we receive."""
        for sid in list(request.open_data_streams):
            if sid in self._outgoing_data:
                self.reset_data_stream(sid, error_code)
            else:
                stream = self._incoming_data.get(sid)
                if stream is not None:
                    self._stop_incoming(sid, stream, error_code)

    def _decode_datagram(self, data: bytes) -> data18.ObjectDatagram | None:
        return d14data.decode_datagram(data).to_draft18()

    def _encode_datagram(self, request: RequestState, datagram: data18.ObjectDatagram) -> bytes:
        """Draft-14 datagrams always carry a priority: an inherited one is the track's default."""
        return d14data.ObjectDatagram.from_draft18(datagram, request.default_priority).encode()

    # ------------------------------------------------------------------
    # Sending: requests
    # ------------------------------------------------------------------

    def _open_request(self, kind: type, build: Callable[[int], d14.Message], **fields) -> int:
        self._check_open()
        request_id = self._next_request_id
        # Encoded first: a value draft-14 cannot carry is refused before the ID is spent.
        data = build(request_id).encode()
        self._next_request_id += 2
        request = _Request(request_id, kind, True, **fields)
        self._requests[request_id] = request
        self._send_request(request, data)
        return request_id

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        """Send SUBSCRIBE; returns its Request ID."""
        message18 = m18.Subscribe(0, tuple(namespace), track_name, parameters)
        return self._open_request(
            SUBSCRIBE,
            lambda rid: d14.Subscribe.from_draft18(replace(message18, request_id=rid)),
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
            lambda rid: d14.Fetch.from_draft18(replace(f18, request_id=rid)),
            parameters=f18.parameters,
        )
        request = self._requests[request_id]
        request.fetch = replace(f18, request_id=request_id)
        if f18.parameters.group_order is not None:
            request.fetch_group_order = f18.parameters.group_order
        return request_id

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters = Parameters()) -> int:
        t18 = m18.TrackStatus(0, tuple(namespace), track_name, parameters)
        return self._open_request(
            TRACK_STATUS, lambda rid: d14.TrackStatus.from_draft18(replace(t18, request_id=rid)),
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
        message = d14.SubscribeUpdate(
            update_id, request_id, start, end_group,
            128 if merged.subscriber_priority is None else merged.subscriber_priority,
            merged.forward is not False,
            d14.Parameters(parameters.authorization_tokens, parameters.object_delivery_timeout),
        )
        data = message.encode()  # before the ID is spent, as for requests
        self._next_request_id += 2
        update = _Request(update_id, SUBSCRIBE_UPDATE, True, closed=True)
        self._send_request(update, data)
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
        self._end_data_streams(request, error_code)
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
                self._withdraw_announced(request)
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

    def _send_answer(self, request: RequestState, message: m18.SubscribeOk | m18.FetchOk) -> None:
        if isinstance(message, m18.SubscribeOk):
            self._send(d14.SubscribeOk.from_draft18(message, request.request_id))
        else:
            self._send(d14.FetchOk.from_draft18(message, request.request_id, request.fetch_group_order))

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

    def _send_publish_done(self, request: RequestState, status_code: int, reason: str) -> None:
        done = m18.PublishDone(status_code, request.data_streams_opened, reason)
        self._send_about(request, d14.PublishDone.from_draft18(done, request.request_id))  # type: ignore[arg-type]
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
        self._withdraw(announced)

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        raise NotSupported("PUBLISH_BLOCKED does not exist in draft-14")

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    _FETCH_WRITER = _FetchWriter14

    def _subgroup_writer(self, request: RequestState, header: data18.SubgroupHeader) -> _SubgroupWriter14:
        """Draft-14 headers always carry a priority (None: the track's default) and have
        no FIRST_OBJECT bit."""
        return _SubgroupWriter14(d14data.SubgroupHeader.from_draft18(header, request.default_priority))

    def write_fetch_end_of_range(
        self, stream_id: int, group_id: int, object_id: int, *, unknown: bool = False, end_stream: bool = False
    ) -> None:
        """Draft-14 has no end-of-range marker: nothing is written; `end_stream` FINs."""
        self._new_object(stream_id, fetch=True)
        if end_stream:
            self.close_data_stream(stream_id)

    def send_padding_stream(self, size: int) -> None:
        raise NotSupported("draft-14 has no padding streams")

    # ------------------------------------------------------------------
    # Teardown
    # ------------------------------------------------------------------

    def _track_of(self, request: RequestState) -> tuple[TrackNamespace, bytes]:
        return request.namespace, request.track_name  # type: ignore[attr-defined]

    def _fetch_stream_reset(self, request: RequestState) -> None:
        """The publisher has dropped the fetch already, so no FETCH_CANCEL follows."""
        self._close_request(request)

    def _data_stream_reset(self, request: RequestState) -> None:
        self._forget_if_done(request)

    def _maybe_finish_fetch(self, request: RequestState) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if request.fetch_stream_closed and not request.open_data_streams:
            self._close_request(request)

    def _close_request(self, request: RequestState) -> None:
        """Mark a request over; a peer request gives its Request ID credit back."""
        request.closed = True
        if not request.local and not request.credit_returned:  # type: ignore[attr-defined]
            request.credit_returned = True  # type: ignore[attr-defined]
            self._peer_active -= 1
            self._grant()
        self._forget_if_done(request)

    def _forget_if_done(self, request: RequestState) -> None:
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
    d14.TrackStatus: MoqtSession14._on_subscribe,
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


def _extensions(properties: Properties) -> tuple[d14.KeyValuePair, ...]:
    """Draft-18 Properties as draft-14 extension headers."""
    return d14data._properties_from_18(properties) if properties else ()
