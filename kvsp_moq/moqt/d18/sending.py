"""What a draft-18 endpoint sends on request streams and its control stream: requests,
each on a new stream, REQUEST_UPDATEs, cancellations, GOAWAY, and the answers to the
peer's requests (REQUEST_OK, REQUEST_ERROR, NAMESPACE, NAMESPACE_DONE, PUBLISH_BLOCKED).
A part `session.MoqtSession` owns (`MessageSender`); the session's public methods of the
same names hand their calls to it."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from ..errors import NotSupported, PublishDoneCode, StreamClosed, StreamResetCode
from ..session.core import SessionPart
from ..wire import FetchType, Location, Properties, TrackNamespace
from .messages import (
    SCOPE_PUBLISH_OK,
    SCOPE_REQUEST_UPDATE_OK,
    SCOPE_TRACK_STATUS_OK,
    ControlStreamParser,
    Fetch,
    Goaway,
    Message,
    Namespace,
    NamespaceDone,
    Parameters,
    Publish,
    PublishBlocked,
    PublishNamespace,
    Redirect,
    RequestErrorMessage,
    RequestOk,
    RequestUpdate,
    Subscribe,
    SubscribeNamespace,
    SubscribeTracks,
    TrackStatus,
)
from .request_state import REQUEST_TYPES, UPDATE_SCOPE, FillState, Request18, RequestMessage, RequestStream
from .request_streams import RequestStreams

if TYPE_CHECKING:
    from .session import MoqtSession

__all__ = ["MessageSender"]


class MessageSender(SessionPart[Request18]):
    """The requests, updates and answers a draft-18 session sends; the request-stream
    state is its `RequestStreams` part's, the request lookups and Request IDs the session's."""

    def __init__(self, session: MoqtSession, streams: RequestStreams) -> None:
        super().__init__(session)
        self._session = session
        self._streams = streams
        self._draft = session.draft
        self._profile = session.profile
        self.goaway_sent_request_id: int | None = None  # peer requests from this ID on are refused

    # ------------------------------------------------------------------
    # Sending: requests
    # ------------------------------------------------------------------

    def open_request(self, build: Callable[[int], RequestMessage]) -> int:
        """Send the request `build` makes with the next Request ID, on a new stream."""
        self._session._check_open()
        request_id = self._session._next_request_id
        message = build(request_id)
        data = message.encode(self._draft)
        self._session._next_request_id += 2
        sid = self._quic.get_next_available_stream_id(is_unidirectional=False)
        request = RequestStream(request_id, type(message), True, message.parameters, stream_id=sid, message=message)
        if isinstance(message, Fetch) and message.parameters.group_order is not None:
            request.fetch_group_order = message.parameters.group_order
        self._requests[request_id] = request
        self._streams.by_stream[sid] = request
        self._streams.parsers[sid] = ControlStreamParser(self._draft)
        self._quic.send_stream_data(sid, data)
        return request_id

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int:
        """Send SUBSCRIBE on a new request stream; returns its Request ID."""
        return self.open_request(lambda rid: Subscribe(rid, namespace, track_name, parameters))

    def fetch(
        self, namespace: TrackNamespace, track_name: bytes, start: Location, end: Location, parameters: Parameters
    ) -> int:
        return self.open_request(
            lambda rid: Fetch(
                rid,
                FetchType.STANDALONE,
                namespace,
                track_name,
                Location(*start),
                Location(*end),
                parameters=parameters,
            )
        )

    def joining_fetch(
        self, subscribe_request_id: int, joining_start: int, *, relative: bool, parameters: Parameters
    ) -> int:
        """Send a joining FETCH for one of our subscriptions (draft-18 only: from
        draft-20 on, FILL_PARAMETERS in the SUBSCRIBE asks for the same objects)."""
        if self._profile.location_filter:
            raise NotSupported(f"draft-{self._draft} has no joining FETCH")
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        return self.open_request(
            lambda rid: Fetch(
                rid,
                fetch_type,
                joining_request_id=subscribe_request_id,
                joining_start=joining_start,
                parameters=parameters,
            )
        )

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int:
        return self.open_request(lambda rid: TrackStatus(rid, namespace, track_name, parameters))

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters) -> int:
        return self.open_request(lambda rid: PublishNamespace(rid, namespace, parameters))

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int:
        return self.open_request(lambda rid: SubscribeNamespace(rid, namespace_prefix, parameters))

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int:
        return self.open_request(lambda rid: SubscribeTracks(rid, namespace_prefix, parameters))

    def publish(
        self, namespace: TrackNamespace, track_name: bytes, *, track_alias: int | None, parameters: Parameters,
        track_properties: Properties,
    ) -> int:
        alias = self._session._allocate_alias(track_alias)
        request_id = self.open_request(
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
        self._session._check_open()
        request = self._session._request(request_id)
        assert isinstance(request, RequestStream)  # a fill's ID (2^64 and up) is no request of ours
        if request.closed or request.fin_sent:
            raise StreamClosed(f"request {request_id} is closed")
        if not request.local and request.kind is not Publish:
            raise ValueError("only the requester updates a request (or the subscriber of a PUBLISH)")
        allowed = UPDATE_SCOPE.get(request.kind, frozenset())
        for ptype in parameters.types():
            if ptype not in allowed:
                raise ValueError(f"parameter 0x{ptype:x} cannot update a {request.kind.NAME}")
        update_id = self._session._next_request_id
        data = RequestUpdate(update_id, parameters).encode(self._draft)
        self._session._next_request_id += 2
        request.our_updates.append(update_id)
        self._streams.update_parent[update_id] = request
        self._streams.update_parameters[update_id] = parameters
        self._quic.send_stream_data(request.stream_id, data)
        return update_id

    def cancel_request(self, request_id: int, error_code: int) -> None:
        """Abandon a request: reset our side of its stream and STOP_SENDING the other.

        This unsubscribes, withdraws a published namespace, stops a fetch, ...
        """
        request = self._requests.get(request_id)
        if request is None or self._session.closed:
            return
        assert isinstance(request, RequestStream)  # a fill's ID (2^64 and up) is no request of ours
        request.closed = True
        self._streams.abort_stream(request, error_code)
        for sid in list(request.open_data_streams):
            stream = self._receiving.streams.get(sid)
            if stream is not None:
                self._receiving.stop(sid, stream, error_code)
        self._streams.forget_if_done(request)

    def goaway(self, new_session_uri: str, timeout_ms: int) -> None:
        """Send GOAWAY on the control stream; later peer requests are refused."""
        self._session._check_open()
        if self._session.is_client and new_session_uri:
            raise ValueError("a client sends GOAWAY without a URI")
        highest = self._streams.peer_ids.highest
        last = (0 if not self._session.is_client else 1) if highest is None else highest + 2
        self.goaway_sent_request_id = last
        message = Goaway(new_session_uri, timeout_ms, last)
        self._quic.send_stream_data(self._session._control_stream_id, message.encode(self._draft))

    def request_goaway(self, request_id: int, new_session_uri: str, timeout_ms: int) -> None:
        """Send GOAWAY on one request stream: re-issue this request elsewhere."""
        self._session._check_open()
        request = self._session._request(request_id)
        assert isinstance(request, RequestStream)  # a fill has no stream of its own
        self.send_on_request(request, Goaway(new_session_uri, timeout_ms, None))

    # ------------------------------------------------------------------
    # Sending: answers
    # ------------------------------------------------------------------

    def send_on_request(self, request: RequestStream, message: Message, end_stream: bool = False) -> None:
        self._send_encoded(request, message.encode(self._draft), end_stream)

    def _send_encoded(self, request: RequestStream, data: bytes, end_stream: bool) -> None:
        if request.fin_sent:
            raise StreamClosed(f"request stream of {request.request_id} is closed")
        try:
            self._quic.send_stream_data(request.stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError, AssertionError) as exc:
            request.fin_sent = True
            raise StreamClosed(f"request stream of {request.request_id}: {exc}") from None
        if end_stream:
            request.fin_sent = True
            self._streams.forget_if_done(request)

    def send_about(self, request: Request18, data: bytes, *, final: bool = False) -> None:
        """On the request's stream; a final message (PUBLISH_DONE) ends it too."""
        assert isinstance(request, RequestStream)  # a fill has no stream and no answer
        if final:
            request.closed = True
        self._send_encoded(request, data, final)

    def request_ok(self, request_id: int, parameters: Parameters, track_properties: Properties) -> None:
        """Send REQUEST_OK: PUBLISH_OK, TRACK_STATUS_OK, PUBLISH_NAMESPACE_OK,
        SUBSCRIBE_NAMESPACE_OK, SUBSCRIBE_TRACKS_OK, or the answer to a peer's
        REQUEST_UPDATE (pass the update's Request ID)."""
        self._session._check_open()
        parent = self._streams.update_parent.get(request_id)
        if parent is not None and request_id in parent.peer_updates:
            _check_scope(parameters, SCOPE_REQUEST_UPDATE_OK, "REQUEST_UPDATE_OK")
            self.answer_update(parent, request_id)
            update = self._streams.update_parameters.pop(request_id, None)
            if update is not None:
                self.apply_update(parent, update, parameters)
            self.send_on_request(parent, RequestOk(parameters, ()))
            return
        request = self._session._peer_request(
            request_id, (Publish, TrackStatus, PublishNamespace, SubscribeNamespace, SubscribeTracks)
        )
        assert isinstance(request, RequestStream)  # not a FETCH, so not a fill
        follow_up = None
        if request.kind is Publish:
            _check_scope(parameters, SCOPE_PUBLISH_OK, "PUBLISH_OK")
            if self._profile.publish_ok_expires_only:
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
        self.send_on_request(request, RequestOk(parameters, track_properties), end_stream=final)
        request.answered = request.accepted = True
        if request.kind is Publish:
            request.parameters = request.parameters.merged(parameters)
            if follow_up is not None:
                self.request_update(request_id, follow_up)
        if final:
            request.closed = True
            self._streams.forget_if_done(request)

    def apply_update(self, request: RequestStream, update: Parameters, answer: Parameters) -> None:
        """An accepted REQUEST_UPDATE changes the request's parameters; one that turns
        the Forward State from 0 to 1 sets the Joining Location to the LARGEST_OBJECT of
        its REQUEST_UPDATE_OK (draft-18 "Subscriptions")."""
        resumed = request.parameters.forward is False and update.forward is True
        request.parameters = request.parameters.merged(update)
        if resumed and request.is_subscription:
            request.largest_at_ok = answer.largest_object

    def answer_update(self, request: RequestStream, update_id: int) -> None:
        if not request.peer_updates or request.peer_updates[0] != update_id:
            raise ValueError(f"REQUEST_UPDATE {update_id} is not the oldest unanswered update")
        request.peer_updates.popleft()
        self._streams.update_parent.pop(update_id, None)

    def request_error(
        self, request_id: int, error_code: int, reason: str, *, retry_interval: int, redirect: Redirect | None
    ) -> None:
        """Reject a peer's request (and close its stream) or one of its REQUEST_UPDATEs.

        A failed update of a subscription this endpoint publishes also ends it with
        PUBLISH_DONE UPDATE_FAILED, as section 10.9.1 requires.
        """
        self._session._check_open()
        message = RequestErrorMessage(error_code, retry_interval, reason, redirect)
        parent = self._streams.update_parent.get(request_id)
        if parent is not None and request_id in parent.peer_updates:
            self.answer_update(parent, request_id)
            self._streams.update_parameters.pop(request_id, None)
            self.send_on_request(parent, message)
            if parent.is_subscription and parent.publisher_is_local and parent.accepted:
                self._session.publish_done(parent.request_id, PublishDoneCode.UPDATE_FAILED, "update failed")
            elif parent.kind in (SubscribeNamespace, PublishNamespace, SubscribeTracks, Fetch):
                parent.closed = True
                self._streams.finish_stream(parent)
            return
        request = self._session._peer_request(request_id, REQUEST_TYPES)
        self.reject(request, error_code, reason, retry_interval, redirect)

    def reject(
        self,
        request: Request18,
        error_code: int,
        reason: str,
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        if isinstance(request, FillState):
            self._streams.fills.end(request, StreamResetCode.INTERNAL_ERROR)
            return
        request.answered = True
        request.closed = True
        data = self._dialect.request_error(request, error_code, reason, retry_interval, redirect)
        try:
            self._send_encoded(request, data, True)
        finally:
            if request.held_fetches:
                self._fetches.refuse_held(request, "subscription refused")

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Send NAMESPACE on a peer's SUBSCRIBE_NAMESPACE stream (after REQUEST_OK)."""
        request = self._session._answered_peer_request(request_id, SubscribeNamespace)
        assert isinstance(request, RequestStream)  # not a FETCH, so not a fill
        request.namespaces.add(tuple(namespace_suffix))
        self.send_on_request(request, Namespace(tuple(namespace_suffix)))

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        request = self._session._answered_peer_request(request_id, SubscribeNamespace)
        assert isinstance(request, RequestStream)  # not a FETCH, so not a fill
        suffix = tuple(namespace_suffix)
        if suffix not in request.namespaces:
            raise ValueError("NAMESPACE_DONE for a suffix never announced")
        request.namespaces.discard(suffix)
        self.send_on_request(request, NamespaceDone(suffix))

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        request = self._session._answered_peer_request(request_id, SubscribeTracks)
        assert isinstance(request, RequestStream)  # not a FETCH, so not a fill
        self.send_on_request(request, PublishBlocked(tuple(namespace_suffix), track_name))


def _check_scope(parameters: Parameters, allowed: frozenset[int], name: str) -> None:
    for ptype in parameters.types():
        if ptype not in allowed:
            raise ValueError(f"{name} may not carry parameter 0x{ptype:x}")
