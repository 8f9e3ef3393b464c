"""The session machinery every draft shares, sans I/O: lifecycle, request state, data
streams and datagrams, object writing, flow control of the engine beneath. A draft's
`session` module supplies its control messages and stream formats; requests and answers
reach this code in their draft-18 form (`kvsp_moq.moqt.d18.messages`) whatever the wire."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from . import events as ev
from .d18.data import (
    FetchEndOfRange,
    FetchObject,
    FetchStreamWriter,
    ObjectDatagram,
    SubgroupHeader,
    SubgroupObject,
)
from .d18.messages import (
    Fetch,
    FetchOk,
    Message,
    Parameters,
    Publish,
    Setup,
    Subscribe,
    SubscribeOk,
)
from .engine import (
    ConnectionTerminated,
    DatagramFrameReceived,
    QuicEngine,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)
from .errors import (
    AuthTokenCacheOverflow,
    DuplicateAuthTokenAlias,
    InvalidAuthority,
    InvalidPath,
    ProtocolViolation,
    PublishDoneCode,
    RequestErrorCode,
    SessionCloseCode,
    SESSION_ENDING,
    StreamClosed,
    StreamResetCode,
    UnknownAuthTokenAlias,
)
from .wire import (
    DEFAULT_PUBLISHER_PRIORITY,
    AliasType,
    AuthToken,
    FetchType,
    GroupOrder,
    Location,
    ObjectStatus,
    Properties,
    TrackNamespace,
    TrackPropertyType,
    property_value,
)

UNKNOWN_STREAM_COUNT = (1 << 62) - 1

IMPLEMENTATION = "kvsp-moq/0.1"

TOKEN_ENTRY_OVERHEAD = 16  # section 9.3.3: 16 bytes + the Token Value

@dataclass(eq=False)
class RequestState:
    """What both drafts track of one request, from either side; `kind` is the
    draft-18 request message class (draft-14 requests are named the same way)."""

    request_id: int
    kind: type[Message]
    local: bool  # this endpoint sent the request
    parameters: Parameters = field(default_factory=Parameters)
    answered: bool = False  # the first answer was sent (peer request) or received (ours)
    accepted: bool = False
    closed: bool = False
    track_alias: int | None = None
    default_priority: int = DEFAULT_PUBLISHER_PRIORITY
    largest_at_ok: Location | None = None  # Joining Location of a subscription
    fetch_group_order: GroupOrder = GroupOrder.ASCENDING
    data_streams_opened: int = 0
    open_data_streams: set = field(default_factory=set)
    fetch_stream_closed: bool = False
    done_stream_count: int | None = None  # PUBLISH_DONE received: streams the publisher opened
    data_streams_ended: int = 0
    held_fetches: list = field(default_factory=list)  # joining FETCHes waiting for this SUBSCRIBE's answer
    held_by: "RequestState | None" = None  # a joining FETCH: the pending SUBSCRIBE it waits for

    @property
    def is_subscription(self) -> bool:
        return self.kind in (Subscribe, Publish)

    @property
    def publisher_is_local(self) -> bool:
        """For a subscription: whether this endpoint is the publisher."""
        return (self.kind is Publish) == self.local

@dataclass(eq=False)
class IncomingDataStream:
    """A data stream being read; its items are draft-18 ones whatever the wire."""

    parser: object  # feed(data, end_stream) -> draft-18 items
    request: RequestState | None = None
    fetch: bool = False
    header: SubgroupHeader | None = None
    held: list = field(default_factory=list)  # items waiting for their track alias; None = FIN
    held_bytes: int = 0
    discard: bool = False
    fill: bool = False  # draft-20+: a fetch stream carrying a fill of `request`, a subscription


@dataclass(eq=False)
class OutgoingDataStream:
    request: RequestState
    writer: object  # a subgroup or fetch stream writer of the session's draft
    fin_sent: bool = False
    reset: bool = False
    payload_remaining: int = 0  # bytes of the current object's payload still to write

class RequestIdTracker:
    """Detects repeated peer Request IDs without keeping every ID seen."""

    __slots__ = ("floor", "seen", "highest")

    def __init__(self, first: int) -> None:
        self.floor = first  # every ID below this was seen
        self.seen: set[int] = set()
        self.highest: int | None = None

    def add(self, request_id: int) -> bool:
        """False when the ID was seen before."""
        if request_id < self.floor or request_id in self.seen:
            return False
        self.seen.add(request_id)
        while self.floor in self.seen:
            self.seen.discard(self.floor)
            self.floor += 2
        if self.highest is None or request_id > self.highest:
            self.highest = request_id
        return True

class SessionBase:
    """What the draft-18 and draft-14 sessions share: the session's lifecycle, the
    authorization token cache, track aliases, joining FETCHes, reading data streams
    and datagrams, and writing objects. A draft supplies its control messages and
    wire encodings through the hooks at the end of the class; data stream items
    and answers reach this code in their draft-18 form whatever the wire."""

    draft: int

    def __init__(
        self,
        quic: QuicEngine,
        *,
        is_client: bool,
        draft: int,
        setup: Setup | None,
        max_object_size: int,
        max_auth_token_cache_size: int,
        max_buffered_before_setup: int,
        max_unmatched_stream_bytes: int,
        accept_path: Iterable[str] | None,
        accept_authority: Iterable[str] | None,
    ) -> None:
        self._quic = quic
        self._is_client = is_client
        self.draft = draft
        self.max_object_size = max_object_size
        self._max_buffered_before_setup = max_buffered_before_setup
        self._max_unmatched_stream_bytes = max_unmatched_stream_bytes
        self._accept_path = None if accept_path is None else set(accept_path)
        self._accept_authority = None if accept_authority is None else set(accept_authority)
        self._closed = False
        self.peer_setup: Setup | None = None
        self.goaway_received: ev.GoawayReceived | None = None

        self._next_request_id = 0 if is_client else 1
        self._requests: dict[int, RequestState] = {}
        self._incoming_data: dict[int, IncomingDataStream] = {}
        self._outgoing_data: dict[int, OutgoingDataStream] = {}

        self._aliases_in: dict[int, RequestState] = {}  # track alias -> our subscription
        self._aliases_out: dict[int, RequestState] = {}  # track alias -> subscription we publish
        self._next_alias = 0

        self._before_setup: list[QuicEvent] = []
        self._released: list[ev.MoqtEvent] = []  # events produced by calls outside handle_event()
        self._before_setup_bytes = 0

        # Peer token registrations (section 10.2.2); ours are not tracked.
        self._max_auth_token_cache_size = max_auth_token_cache_size
        self._peer_tokens: dict[int, AuthToken] = {}
        self._peer_token_bytes = 0

        options = setup or Setup()
        if options.max_auth_token_cache_size is None and max_auth_token_cache_size:
            options = replace(options, max_auth_token_cache_size=max_auth_token_cache_size)
        if options.implementation is None:
            options = replace(options, implementation=IMPLEMENTATION)
        self.local_setup = options

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

    def track_alias_of(self, request_id: int) -> int | None:
        request = self._requests.get(request_id)
        return None if request is None else request.track_alias

    def stream_count(self, request_id: int) -> int:
        """Data streams opened so far for a subscription this endpoint publishes."""
        return self._request(request_id).data_streams_opened

    # ------------------------------------------------------------------
    # QUIC events
    # ------------------------------------------------------------------

    def take_events(self) -> list[ev.MoqtEvent]:
        """Events produced by calls of the application rather than by QUIC events
        (a joining FETCH held until its SUBSCRIBE was accepted is released by
        subscribe_ok() as a FetchReceived). handle_event() also returns any of these
        not yet taken, ahead of its own."""
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
            if self.peer_setup is None and not self._is_control_event(event):
                self._hold_before_setup(event)
            else:
                self._dispatch(event, out)
        except SESSION_ENDING as exc:
            self.close(int(exc.session_code), exc.reason)
            out.append(ev.SessionTerminated(int(exc.session_code), exc.reason, True))
        return out

    def close(self, error_code: int = SessionCloseCode.NO_ERROR, reason: str = "") -> None:
        """Close the session and its QUIC connection."""
        if self._closed:
            return
        self._closed = True
        self._quic.close(error_code=error_code, reason_phrase=reason)

    def _dispatch(self, event: QuicEvent, out: list[ev.MoqtEvent]) -> None:
        if isinstance(event, StreamDataReceived):
            self._on_stream_data(event, out)
        elif isinstance(event, StreamReset):
            self._on_stream_reset(event, out)
        elif isinstance(event, StopSendingReceived):
            self._on_stop_sending(event, out)
        elif isinstance(event, DatagramFrameReceived):
            self._on_datagram(event.data, out)

    def _hold_before_setup(self, event: QuicEvent) -> None:
        self._before_setup_bytes += len(getattr(event, "data", b""))
        if self._before_setup_bytes > self._max_buffered_before_setup:
            raise ProtocolViolation("too much data before SETUP")
        self._before_setup.append(event)

    def _replay_held(self, out: list[ev.MoqtEvent]) -> None:
        held = self._before_setup
        self._before_setup = []
        self._before_setup_bytes = 0
        for event in held:
            self._dispatch(event, out)

    def _is_local_stream(self, stream_id: int) -> bool:
        return bool(stream_id & 1) != self._is_client

    # -- setup ---------------------------------------------------------------

    def _check_peer_target(self, path: str | None, authority: str | None, noun: str) -> None:
        """PATH and AUTHORITY of the peer's setup: none from a server, and on a
        server only those it serves."""
        if self._is_client:
            if path is not None:
                raise InvalidPath(f"PATH {noun} from the server")
            if authority is not None:
                raise InvalidAuthority(f"AUTHORITY {noun} from the server")
        else:
            if self._accept_path is not None and (path or "") not in self._accept_path:
                raise InvalidPath(f"path {path!r} is not served here")
            if self._accept_authority is not None and authority not in self._accept_authority:
                raise InvalidAuthority(f"authority {authority!r} is not served here")

    def _register_setup_tokens(self, tokens: tuple[AuthToken, ...]) -> None:
        for token in tokens:
            if token.alias_type in (AliasType.DELETE, AliasType.USE_ALIAS):
                raise ProtocolViolation(f"{token.alias_type.name} token in SETUP")
            if token.alias_type == AliasType.REGISTER:
                # Section 9.3.4: a registration over the limit is used as USE_VALUE.
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
                if token.alias in self._peer_tokens:
                    raise DuplicateAuthTokenAlias(f"token alias {token.alias} already registered")
                if self._peer_token_bytes + size <= self._max_auth_token_cache_size:
                    self._peer_tokens[token.alias] = token  # type: ignore[index]
                    self._peer_token_bytes += size

    # -- joining FETCH --------------------------------------------------------

    def _on_fetch_request(
        self, request: RequestState, message: Fetch, tokens: tuple[AuthToken, ...], out: list[ev.MoqtEvent]
    ) -> None:
        """A peer FETCH (in its draft-18 form): check a standalone range, or find the
        subscription a joining FETCH joins."""
        if message.parameters.group_order is not None:
            request.fetch_group_order = message.parameters.group_order
        if message.fetch_type == FetchType.STANDALONE:
            if message.end < message.start and not (  # type: ignore[operator]
                message.end.object == 0 and message.end.group >= message.start.group  # type: ignore[union-attr]
            ):
                self._reject(request, RequestErrorCode.INVALID_RANGE, "end before start")
                return
            out.append(
                ev.FetchReceived(
                    request.request_id,
                    message.fetch_type,
                    message.namespace,  # type: ignore[arg-type]
                    message.track_name,  # type: ignore[arg-type]
                    message.start,  # type: ignore[arg-type]
                    message.end,  # type: ignore[arg-type]
                    None,
                    message.parameters,
                    tokens,
                )
            )
            return
        joined = self._requests.get(message.joining_request_id)  # type: ignore[arg-type]
        if (
            joined is None
            or joined.kind is not Subscribe
            or joined.local
            or joined.closed
        ):
            self._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, "no such subscription")
            return
        if not joined.accepted:
            # Section 10.12.2: the subscription is Pending, so the FETCH waits for its answer.
            request.held_by = joined
            joined.held_fetches.append((request, message, tokens))
            return
        self._resolve_joining(request, message, tokens, joined, out)

    def _resolve_joining(
        self,
        request: RequestState,
        message: Fetch,
        tokens: tuple[AuthToken, ...],
        joined: RequestState,
        out: list[ev.MoqtEvent],
    ) -> None:
        """Turn a joining FETCH of an Established subscription into its range."""
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
        namespace, track_name = self._track_of(joined)
        out.append(
            ev.FetchReceived(
                request.request_id,
                message.fetch_type,
                namespace,
                track_name,
                start,
                end,
                joined.request_id,
                message.parameters,
                tokens,
            )
        )

    def _release_held_fetches(self, joined: RequestState) -> None:
        """SUBSCRIBE_OK went out: resolve the joining FETCHes that waited for it."""
        held, joined.held_fetches = joined.held_fetches, []
        for request, message, tokens in held:
            request.held_by = None
            if request.closed or self._closed:
                continue
            self._resolve_joining(request, message, tokens, joined, self._released)

    def _refuse_held_fetches(self, joined: RequestState, reason: str) -> None:
        """The SUBSCRIBE was refused or cancelled: so are the FETCHes joining it."""
        held, joined.held_fetches = joined.held_fetches, []
        for request, _, _ in held:
            request.held_by = None
            if request.closed or request.answered or self._closed:
                continue
            try:
                self._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, reason)
            except StreamClosed:
                request.closed = True

    def _forget_held(self, request: RequestState) -> bool:
        """A held joining FETCH was cancelled by its requester: drop it quietly (the
        application never saw it). Returns whether it was held."""
        joined = request.held_by
        if joined is None:
            return False
        request.held_by = None
        joined.held_fetches = [entry for entry in joined.held_fetches if entry[0] is not request]
        return True

    # -- data streams ------------------------------------------------------

    def _on_data_stream_reset(
        self, sid: int, stream: IncomingDataStream, error_code: int, out: list[ev.MoqtEvent]
    ) -> None:
        """The publisher reset an incoming data stream (already removed from the table)."""
        request = stream.request
        if request is None or stream.discard:
            return
        request.open_data_streams.discard(sid)
        if stream.fill:
            # A fill that failed: the subscription goes on without those objects.
            out.append(ev.DataStreamEnded(request.request_id, sid, False, False, None))
            request.data_streams_ended += 1
            self._maybe_end_subscription(request)
            return
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch, True, error_code))
        if stream.fetch:
            if not request.closed:
                # A reset fetch stream ends the fetch: the range is incomplete.
                self._fetch_stream_reset(request)
        else:
            request.data_streams_ended += 1
            self._maybe_end_subscription(request)

    def _on_data_stream_stopped(self, sid: int, error_code: int, out: list[ev.MoqtEvent]) -> bool:
        """STOP_SENDING for one of our data streams; False when `sid` is not one."""
        stream = self._outgoing_data.get(sid)
        if stream is None:
            return False
        stream.reset = True  # aioquic resets the stream on STOP_SENDING
        stream.request.open_data_streams.discard(sid)
        out.append(ev.DataStreamStopped(stream.request.request_id, sid, error_code))
        if stream.request.kind is Fetch:
            stream.request.fetch_stream_closed = True
        return True

    def _on_data_stream(
        self, sid: int, stream: IncomingDataStream, data: bytes, end_stream: bool, out: list[ev.MoqtEvent]
    ) -> None:
        if stream.discard:
            if end_stream:
                self._incoming_data.pop(sid, None)
            return
        items = stream.parser.feed(data, end_stream)  # type: ignore[attr-defined]
        for item in items:
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
                stream.held.append(None)  # FIN marker, delivered with the held items

    def _on_subgroup_header(
        self, sid: int, stream: IncomingDataStream, header: SubgroupHeader, out: list[ev.MoqtEvent]
    ) -> bool:
        """A subgroup stream begins; its objects wait until the track alias is known.
        False when the stream is stopped instead."""
        stream.header = header
        request = self._aliases_in.get(header.track_alias)
        if request is None:
            stream.held.append(header)
            return True
        if request.closed:
            self._stop_incoming(sid, stream, StreamResetCode.CANCELLED)
            return False
        stream.request = request
        request.open_data_streams.add(sid)
        out.append(ev.SubgroupStreamOpened(request.request_id, sid, header))
        return True

    def stop_data_stream(self, stream_id: int, error_code: int = StreamResetCode.CANCELLED) -> None:
        """STOP_SENDING an incoming data stream, e.g. a group no longer of interest;
        its remaining bytes are discarded and the subscription goes on."""
        stream = self._incoming_data.get(stream_id)
        if stream is not None:
            self._stop_incoming(stream_id, stream, error_code)

    def incoming_stream_open(self, stream_id: int) -> bool:
        """Whether an incoming data stream is still being read."""
        stream = self._incoming_data.get(stream_id)
        return stream is not None and not stream.discard

    def _stop_incoming(self, sid: int, stream: IncomingDataStream, code: int) -> None:
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
        try:
            self._quic.stop_stream(sid, code)
        except (ValueError, RuntimeError, AssertionError):
            pass

    def _deliver_item(self, sid: int, stream: IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> None:
        request = stream.request
        assert request is not None
        if isinstance(item, SubgroupObject):
            header = stream.header
            assert header is not None
            priority = header.publisher_priority
            out.append(
                ev.ObjectReceived(
                    request.request_id,
                    header.track_alias,
                    header.group_id,
                    item.subgroup_id,
                    item.object_id,
                    request.default_priority if priority is None else priority,
                    item.status,
                    item.payload,
                    item.properties,
                    sid,
                    header.end_of_group,
                )
            )
        elif isinstance(item, FetchObject) and stream.fill:
            out.append(
                ev.ObjectReceived(
                    request.request_id,
                    request.track_alias,
                    item.group_id,
                    None,
                    item.object_id,
                    request.default_priority if item.publisher_priority is None else item.publisher_priority,
                    ObjectStatus.NORMAL,
                    item.payload,
                    item.properties,
                    sid,
                    False,
                )
            )
        elif isinstance(item, FetchEndOfRange) and stream.fill:
            pass  # a gap in a fill: nothing to deliver
        elif isinstance(item, FetchObject):
            out.append(
                ev.FetchObjectReceived(
                    request.request_id,
                    item.group_id,
                    item.subgroup_id,
                    item.object_id,
                    item.publisher_priority,
                    item.payload,
                    item.properties,
                    sid,
                )
            )
        elif isinstance(item, FetchEndOfRange):
            out.append(ev.FetchRangeReceived(request.request_id, item.location, item.unknown))
        elif isinstance(item, SubgroupHeader):
            out.append(ev.SubgroupStreamOpened(request.request_id, sid, item))

    def _end_incoming(self, sid: int, stream: IncomingDataStream, out: list[ev.MoqtEvent]) -> None:
        request = stream.request
        assert request is not None
        request.open_data_streams.discard(sid)
        out.append(ev.DataStreamEnded(request.request_id, sid, stream.fetch and not stream.fill, False, None))
        if stream.fetch and not stream.fill:
            request.fetch_stream_closed = True
            self._maybe_finish_fetch(request)
        else:
            request.data_streams_ended += 1
            self._maybe_end_subscription(request)
        self._forget_if_done(request)

    def _maybe_end_subscription(self, request: RequestState) -> None:
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

    def _flush_held_for_alias(self, alias: int, out: list[ev.MoqtEvent]) -> None:
        request = self._aliases_in[alias]
        for sid, stream in list(self._incoming_data.items()):
            if stream.request is not None or stream.header is None or stream.header.track_alias != alias:
                continue
            if stream.discard:
                continue
            stream.request = request
            request.open_data_streams.add(sid)
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
        datagram = self._decode_datagram(data)
        if datagram is None:
            return
        request = self._aliases_in.get(datagram.track_alias)
        if request is None or request.closed:
            return  # section 11.3: an unknown alias MAY be dropped
        priority = datagram.publisher_priority
        out.append(
            ev.ObjectReceived(
                request.request_id,
                datagram.track_alias,
                datagram.group_id,
                None,
                datagram.object_id,
                request.default_priority if priority is None else priority,
                ObjectStatus.NORMAL if datagram.status is None else datagram.status,
                datagram.payload,
                datagram.properties,
                None,
                datagram.end_of_group,
            )
        )

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
                size = TOKEN_ENTRY_OVERHEAD + len(token.value or b"")
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
            else:  # DELETE
                registered = self._peer_tokens.pop(token.alias, None)  # type: ignore[arg-type]
                if registered is None:
                    raise UnknownAuthTokenAlias(f"token alias {token.alias} not registered")
                self._peer_token_bytes -= TOKEN_ENTRY_OVERHEAD + len(registered.value or b"")
        return tuple(resolved)

    # ------------------------------------------------------------------
    # Sending: requests and answers
    # ------------------------------------------------------------------

    def _request(self, request_id: int) -> RequestState:
        request = self._requests.get(request_id)
        if request is None:
            raise StreamClosed(f"no active request {request_id}")
        return request

    def _check_open(self) -> None:
        if self._closed:
            raise StreamClosed("session closed")

    def _peer_request(self, request_id: int, kinds: tuple[type[Message], ...]) -> RequestState:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind not in kinds:
            raise ValueError(f"request {request_id} is not a peer {'/'.join(k.NAME for k in kinds)}")
        if request.answered:
            raise ValueError(f"request {request_id} was already answered")
        if request.closed:
            raise StreamClosed(f"request {request_id} was cancelled")
        return request

    def _answered_peer_request(self, request_id: int, kind: type[Message]) -> RequestState:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind is not kind or not request.accepted:
            raise ValueError(f"request {request_id} is not an accepted peer {kind.NAME}")
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
        """Accept a peer's SUBSCRIBE; returns the Track Alias its objects carry.

        `largest` is the Largest Object (must be given when objects exist); it is
        also the Joining Location for joining fetches.
        """
        request = self._peer_request(request_id, (Subscribe,))
        alias = self._allocate_alias(track_alias)
        parameters = Parameters(expires=expires, largest_object=None if largest is None else Location(*largest))
        self._send_answer(request, SubscribeOk(alias, parameters, track_properties))
        request.answered = request.accepted = True
        request.track_alias = alias
        request.largest_at_ok = parameters.largest_object
        request.default_priority = property_value(
            track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
        )
        self._aliases_out[alias] = request
        if request.held_fetches:
            self._release_held_fetches(request)
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
        request = self._peer_request(request_id, (Fetch,))
        self._send_answer(request, FetchOk(end_of_track, Location(*end_location), Parameters(), track_properties))
        request.answered = request.accepted = True
        self._maybe_finish_fetch(request)

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
        self._send_publish_done(request, status_code, reason)

    # ------------------------------------------------------------------
    # Sending: objects
    # ------------------------------------------------------------------

    def _publishing_request(self, request_id: int) -> RequestState:
        self._check_open()
        request = self._request(request_id)
        if not request.is_subscription or not request.publisher_is_local:
            raise ValueError(f"request {request_id} is not a subscription this endpoint publishes")
        if request.closed:
            raise StreamClosed(f"subscription {request_id} is closed")
        if request.kind is Subscribe and not request.accepted:
            raise ValueError("objects are sent only after SUBSCRIBE_OK")
        return request

    def _open_data_stream(self, request: RequestState, writer: object) -> int:
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        self._quic.send_stream_data(sid, writer.header_bytes())  # type: ignore[attr-defined]
        self._outgoing_data[sid] = OutgoingDataStream(request, writer)
        request.data_streams_opened += 1
        request.open_data_streams.add(sid)
        return sid

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
        """Open a subgroup stream for a subscription this endpoint publishes; returns
        the stream ID. `publisher_priority` None inherits the track's default."""
        request = self._publishing_request(request_id)
        header = SubgroupHeader(
            request.track_alias,  # type: ignore[arg-type]
            group_id,
            subgroup_id,
            publisher_priority,
            has_properties,
            end_of_group,
            first_object,
        )
        return self._open_data_stream(request, self._subgroup_writer(request, header))

    def _outgoing(self, stream_id: int) -> OutgoingDataStream:
        stream = self._outgoing_data.get(stream_id)
        if stream is None:
            raise StreamClosed(f"no open data stream {stream_id}")
        if stream.reset or stream.fin_sent or self._closed:
            raise StreamClosed(f"data stream {stream_id} is closed")
        return stream

    def _send_data(self, stream: OutgoingDataStream, stream_id: int, data, end_stream: bool = False) -> None:
        try:
            self._quic.send_stream_data(stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError, AssertionError) as exc:
            stream.reset = True
            raise StreamClosed(f"data stream {stream_id}: {exc}") from None
        if end_stream:
            self._data_stream_finished(stream_id, stream)

    def _new_object(self, stream_id: int, fetch: bool) -> OutgoingDataStream:
        stream = self._outgoing(stream_id)
        if isinstance(stream.writer, self._FETCH_WRITER) != fetch:
            raise ValueError(f"stream {stream_id} is not a {'fetch' if fetch else 'subgroup'} stream")
        if stream.payload_remaining:
            raise ValueError(f"stream {stream_id}: the previous object has {stream.payload_remaining} payload bytes unwritten")
        return stream

    def begin_object(
        self, stream_id: int, object_id: int, payload_length: int, *, properties: Properties = ()
    ) -> None:
        """Write the header of a Normal object on a subgroup stream; its payload
        follows with write_payload(), in as many pieces as the caller likes."""
        stream = self._new_object(stream_id, fetch=False)
        header = stream.writer.object_header(object_id, payload_length, properties=properties)  # type: ignore[attr-defined]
        self._send_data(stream, stream_id, header)
        stream.payload_remaining = payload_length

    def write_payload(self, stream_id: int, data: bytes | bytearray | memoryview, *, end_stream: bool = False) -> None:
        """Write payload bytes of the object begun on this stream."""
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
        """Write a whole Normal object on a subgroup stream (the payload is not copied here)."""
        self.begin_object(stream_id, object_id, len(payload), properties=properties)
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

    def write_object_status(
        self, stream_id: int, object_id: int, status: ObjectStatus, *, end_stream: bool = False
    ) -> None:
        """Write an object status (End of Group / End of Track, or an empty Normal object)."""
        stream = self._new_object(stream_id, fetch=False)
        header = stream.writer.object_header(object_id, 0, status=status)  # type: ignore[attr-defined]
        self._send_data(stream, stream_id, header, end_stream)

    def open_fetch_stream(self, request_id: int) -> int:
        """Open the data stream answering a peer's FETCH; returns the stream ID."""
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind is not Fetch:
            raise ValueError(f"request {request_id} is not a peer FETCH")
        if request.closed:
            raise StreamClosed(f"fetch {request_id} was cancelled")
        if request.data_streams_opened:
            raise ValueError("a FETCH is answered on one stream")
        return self._open_data_stream(request, self._FETCH_WRITER(self._wire_id(request), request.fetch_group_order))

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
        """Write the header of the next object of a FETCH response; the payload
        follows with write_payload(). `subgroup_id` None marks a Datagram object."""
        stream = self._new_object(stream_id, fetch=True)
        header = stream.writer.object_header(  # type: ignore[attr-defined]
            group_id,
            object_id,
            payload_length,
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
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
            stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        if payload or end_stream:
            self.write_payload(stream_id, payload, end_stream=end_stream)

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
        self._data_stream_reset(stream.request)

    def _data_stream_finished(self, stream_id: int, stream: OutgoingDataStream) -> None:
        stream.fin_sent = True
        self._outgoing_data.pop(stream_id, None)
        request = stream.request
        request.open_data_streams.discard(stream_id)
        if request.kind is Fetch:
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
        datagram = ObjectDatagram(
            request.track_alias,  # type: ignore[arg-type]
            group_id,
            object_id,
            payload,
            publisher_priority,
            status,
            properties,
            end_of_group,
        )
        self._quic.send_datagram_frame(self._encode_datagram(request, datagram))

    # ------------------------------------------------------------------
    # What each draft supplies
    # ------------------------------------------------------------------

    _FETCH_WRITER: type = FetchStreamWriter  # writes a fetch stream: (request_id, group_order)

    def _is_control_event(self, event: QuicEvent) -> bool:
        """Whether an event arriving before the peer's SETUP is processed at once."""
        raise NotImplementedError

    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    def _wire_id(self, request: RequestState) -> int:
        """The Request ID a request's data streams carry."""
        return request.request_id

    def _on_data_header(self, sid: int, stream: IncomingDataStream, item: object, out: list[ev.MoqtEvent]) -> bool:
        """The first item of an incoming data stream; False when the stream is dropped."""
        raise NotImplementedError

    def _decode_datagram(self, data: bytes) -> ObjectDatagram | None:
        """A received datagram in its draft-18 form; None when it carries no object."""
        raise NotImplementedError

    def _encode_datagram(self, request: RequestState, datagram: ObjectDatagram) -> bytes:
        raise NotImplementedError

    def _subgroup_writer(self, request: RequestState, header: SubgroupHeader) -> object:
        """The writer of a new subgroup stream (header_bytes(), object_header())."""
        raise NotImplementedError

    def _track_of(self, request: RequestState) -> tuple[TrackNamespace, bytes]:
        """Namespace and track name of a peer SUBSCRIBE."""
        raise NotImplementedError

    def _send_answer(self, request: RequestState, message: SubscribeOk | FetchOk) -> None:
        """Send SUBSCRIBE_OK / FETCH_OK (draft-18 form) for a peer request."""
        raise NotImplementedError

    def _send_publish_done(self, request: RequestState, status_code: int, reason: str) -> None:
        """Send PUBLISH_DONE for a subscription this endpoint publishes and close it."""
        raise NotImplementedError

    def _reject(self, request: RequestState, error_code: int, reason: str) -> None:
        raise NotImplementedError

    def _fetch_stream_reset(self, request: RequestState) -> None:
        """The data stream of an open FETCH of ours was reset."""
        raise NotImplementedError

    def _data_stream_reset(self, request: RequestState) -> None:
        """One of our data streams was reset (by us or, through STOP_SENDING, the peer)."""

    def _maybe_finish_fetch(self, request: RequestState) -> None:
        raise NotImplementedError

    def _close_request(self, request: RequestState) -> None:
        """Mark a request over; forget it once nothing refers to it."""
        raise NotImplementedError

    def _forget_if_done(self, request: RequestState) -> None:
        raise NotImplementedError

def fetch_end_before_start(end: Location, start: Location) -> bool:
    """FETCH_OK's End Location is smaller than the FETCH's Start Location (drafts 14 and 18:
    a PROTOCOL_VIOLATION). End is encoded as in a FETCH: {G, 0} covers all of group G, so it
    is smaller only for an earlier group; an End equal to the Start (an empty range, which a
    FETCH may ask for: "the same or a larger Location") is not smaller."""
    if end.object == 0:
        return end.group < start.group
    return (end.group, end.object) < (start.group, start.object)
