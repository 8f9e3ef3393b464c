"""The core of every session, sans I/O: the state it keeps (requests, data streams, track
aliases), the parts it owns (the peer's tokens, a `tokens.PeerTokens`; the draft's wire
forms, a `dialect.Dialect`; reading data, a `receiving.DataReceiver`; the peer's
FETCHes, a `fetches.PeerFetches`; writing data, a `sending.DataSender`), the lookups of
its requests, the draft's control messages (a `messages.Messages`, which the draft's
session sets), and the hooks through which a draft routes its streams and the parts ask
of it (abstract where every draft must fill them in). `base.SessionBase`
builds the session's public methods on it; a draft's `session` module fills in the hooks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Generic, Iterable, Protocol, TypeVar

from .. import events as ev
from ..d18.messages import Fetch, Message, Setup
from ..engine import QuicEngine, QuicEvent, StopSendingReceived, StreamDataReceived, StreamReset
from ..errors import StreamClosed
from ..wire import AuthToken
from .dialect import Dialect
from .fetches import PeerFetches
from .messages import Messages
from .receiving import DataReceiver
from .records import IncomingDataStream, RequestState, RequestT
from .sending import DataSender
from .tokens import PeerTokens

__all__ = ["IMPLEMENTATION", "RequestEnds", "SessionCore", "SessionPart"]

IMPLEMENTATION = "kvsp-moq/0.1"


_RequestC = TypeVar("_RequestC", bound=RequestState, contravariant=True)


class RequestEnds(Protocol[_RequestC]):
    """How a draft ends its requests (the part that keeps their streams, draft-18, or their
    credit, draft-14); the data stream parts ask it through the session's hooks."""

    def fetch_stream_reset(self, request: _RequestC) -> None:
        """The data stream of an open FETCH of ours was reset."""
        ...

    def data_stream_reset(self, request: _RequestC) -> None:
        """One of the request's data streams was reset (by us or, through STOP_SENDING,
        the peer) or, one of the peer's, stopped by us."""
        ...

    def maybe_finish_fetch(self, request: _RequestC) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        ...

    def close_request(self, request: _RequestC) -> None:
        """Mark a request over; forget it once nothing refers to it."""
        ...

    def forget_if_done(self, request: _RequestC) -> None:
        """Drop a request that is over once nothing refers to it."""
        ...


class SessionCore(ABC, Generic[RequestT]):
    """The state and hooks every session shares; see `base.SessionBase` for the
    whole of what the drafts share. `RequestT` is the record a draft keeps of each
    request (draft-18: its stream or a fill; draft-14: `Request14`), so the shared code
    and the draft's parts agree on what `_requests` and the hooks hold."""

    draft: int
    _messages: Messages[RequestT]  # the draft's control messages, set by the draft's session
    _ends: RequestEnds[RequestT]  # how the draft ends its requests, set by the draft's session

    def __init__(
        self,
        quic: QuicEngine,
        *,
        is_client: bool,
        draft: int,
        setup: Setup | None,
        dialect: Dialect[RequestT],
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
        self._dialect = dialect  # the wire forms of the draft's data streams and datagrams
        self.max_object_size = max_object_size
        self._max_buffered_before_setup = max_buffered_before_setup
        self._accept_path = None if accept_path is None else set(accept_path)
        self._accept_authority = None if accept_authority is None else set(accept_authority)
        self._closed = False
        self.peer_setup: Setup | None = None
        self.goaway_received: ev.GoawayReceived | None = None

        self._next_request_id = 0 if is_client else 1
        self._requests: dict[int, RequestT] = {}

        self._aliases_out: dict[int, RequestT] = {}  # track alias -> subscription we publish
        self._next_alias = 0

        self._before_setup: list[QuicEvent] = []
        self._released: list[ev.MoqtEvent] = []  # events produced by calls outside handle_event()
        self._before_setup_bytes = 0

        # Peer token registrations (section 10.2.2); ours are not tracked.
        self._tokens = PeerTokens(max_auth_token_cache_size)
        # The peer's data streams and datagrams, and our subscriptions by track alias.
        self._receiving = DataReceiver(quic, self, dialect, max_unmatched_stream_bytes)
        self._fetches = PeerFetches(self, dialect, self._requests)  # the peer's FETCHes
        self._sending = DataSender(quic, self, dialect)  # our data streams and datagrams

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

    def _is_local_stream(self, stream_id: int) -> bool:
        return bool(stream_id & 1) != self._is_client

    # ------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------

    def _request(self, request_id: int) -> RequestT:
        request = self._requests.get(request_id)
        if request is None:
            raise StreamClosed(f"no active request {request_id}")
        return request

    def _check_open(self) -> None:
        if self._closed:
            raise StreamClosed("session closed")

    def _peer_request(self, request_id: int, kinds: tuple[type[Message], ...]) -> RequestT:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind not in kinds:
            raise ValueError(f"request {request_id} is not a peer {'/'.join(k.NAME for k in kinds)}")
        if request.answered:
            raise ValueError(f"request {request_id} was already answered")
        if request.closed:
            raise StreamClosed(f"request {request_id} was cancelled")
        return request

    def _answered_peer_request(self, request_id: int, kind: type[Message]) -> RequestT:
        self._check_open()
        request = self._request(request_id)
        if request.local or request.kind is not kind or not request.accepted:
            raise ValueError(f"request {request_id} is not an accepted peer {kind.NAME}")
        if request.closed:
            raise StreamClosed(f"request {request_id} was cancelled")
        return request

    # ------------------------------------------------------------------
    # What each draft supplies (abstract), and what the parts ask of it
    # ------------------------------------------------------------------

    @abstractmethod
    def _on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        """Bytes of the peer's control stream (both drafts have one)."""

    @abstractmethod
    def _is_control_event(self, event: QuicEvent) -> bool:
        """Whether an event arriving before the peer's SETUP is processed at once."""

    @abstractmethod
    def _on_stream_data(self, event: StreamDataReceived, out: list[ev.MoqtEvent]) -> None:
        """Data on any stream, routed by the draft by the stream's kind."""

    @abstractmethod
    def _on_stream_reset(self, event: StreamReset, out: list[ev.MoqtEvent]) -> None:
        """The peer reset one of its streams."""

    @abstractmethod
    def _on_stop_sending(self, event: StopSendingReceived, out: list[ev.MoqtEvent]) -> None:
        """The peer sent STOP_SENDING for one of our streams."""

    @abstractmethod
    def _on_data_header(
        self, sid: int, stream: IncomingDataStream[RequestT], item: object, out: list[ev.MoqtEvent]
    ) -> bool:
        """The first item of an incoming data stream; False when the stream is dropped."""

    def _reject(self, request: RequestT, error_code: int, reason: str) -> None:
        """Refuse a peer request with a request error (the draft's `Messages` sends it)."""
        self._messages.reject(request, error_code, reason)

    def _resolve_own_joining(
        self, request: RequestT, message: Fetch, tokens: tuple[AuthToken, ...], joined: RequestT,
        out: list[ev.MoqtEvent],
    ) -> bool:
        """Resolve a joining FETCH the draft resolves itself (a draft-20 fill that names
        its range); False when it is an ordinary one."""
        return False

    def _fetch_stream_reset(self, request: RequestT) -> None:
        self._ends.fetch_stream_reset(request)

    def _data_stream_reset(self, request: RequestT) -> None:
        self._ends.data_stream_reset(request)

    def _data_stream_opened(self, request: RequestT) -> None:
        """A data stream of the request was opened (draft-20: a fill's counts for its subscription)."""

    def _data_stream_stopped(self, request: RequestT) -> None:
        """The peer sent STOP_SENDING for one of the request's data streams (after the
        stream was marked reset and the event reported)."""

    def _maybe_finish_fetch(self, request: RequestT) -> None:
        self._ends.maybe_finish_fetch(request)

    def _close_request(self, request: RequestT) -> None:
        self._ends.close_request(request)

    def _forget_if_done(self, request: RequestT) -> None:
        self._ends.forget_if_done(request)


class SessionPart(Generic[RequestT]):
    """What a draft's own part (its requests' teardown, its sending, its control messages
    received, ...) starts from: the core's QUIC engine, tables and shared parts, which stay
    the same objects for the session's life. The part keeps the draft's session itself
    for the rest."""

    def __init__(self, core: SessionCore[RequestT]) -> None:
        self._quic = core._quic
        self._dialect = core._dialect
        self._requests = core._requests
        self._aliases_out = core._aliases_out
        self._tokens = core._tokens
        self._receiving = core._receiving
        self._fetches = core._fetches
        self._sending = core._sending
