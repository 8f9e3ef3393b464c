"""The draft-18 control messages this endpoint receives: SETUP and GOAWAY on the control
stream; on request streams, the peer's requests, the answers to ours, REQUEST_UPDATEs,
PUBLISH_DONE, NAMESPACE / NAMESPACE_DONE, PUBLISH_BLOCKED, and what a FIN means. A part
`session.MoqtSession` owns (`ControlReceiver`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from ..errors import (
    DuplicateTrackAlias,
    InvalidRequestId,
    ProtocolViolation,
    RequestErrorCode,
    StreamResetCode,
)
from ..session.core import SessionPart
from ..session.fetches import fetch_end_before_start
from ..wire import (
    DEFAULT_PUBLISHER_PRIORITY,
    FetchType,
    TrackPropertyType,
    mandatory_properties,
    property_value,
)
from .messages import (
    SCOPE_PUBLISH_OK,
    SCOPE_TRACK_STATUS_OK,
    ControlStreamParser,
    Fetch,
    FetchOk,
    Goaway,
    Message,
    Namespace,
    NamespaceDone,
    Publish,
    PublishBlocked,
    PublishDone,
    PublishNamespace,
    PublishStateNotify,
    RequestErrorMessage,
    RequestOk,
    RequestUpdate,
    Setup,
    Subscribe,
    SubscribeNamespace,
    SubscribeOk,
    SubscribeTracks,
    TrackStatus,
)
from .request_state import REQUEST_TYPES, UPDATE_SCOPE, Request18, RequestStream
from .request_streams import RequestStreams
from .sending import MessageSender

if TYPE_CHECKING:
    from .session import MoqtSession

__all__ = ["ControlReceiver"]


_RESERVED_FIRST_FIELDS = (b".", b".session")

#: Why a request with range filters is refused: this endpoint advertises no MAX_FILTER_RANGES.
_NO_RANGE_FILTERS = "range filters are not accepted (MAX_FILTER_RANGES 0)"


class ControlReceiver(SessionPart[Request18]):
    """The control messages a draft-18 session receives, each turned into events and the
    state of its request; what they call for is sent by the `MessageSender` part."""

    def __init__(self, session: MoqtSession, streams: RequestStreams, sender: MessageSender) -> None:
        super().__init__(session)
        self._session = session
        self._streams = streams
        self._sender = sender
        self._profile = session.profile
        self._parser = ControlStreamParser(session.draft)  # the peer's control stream

    def on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        for message in self._parser.feed(data):
            if self._session.peer_setup is None:
                if not isinstance(message, Setup):
                    raise ProtocolViolation(f"{message.NAME} before SETUP")
                self._on_setup(message, out)
                continue
            if isinstance(message, Goaway):
                self._on_session_goaway(message, out)
            else:
                raise ProtocolViolation(f"{message.NAME} on the control stream")

    def _on_setup(self, setup: Setup, out: list[ev.MoqtEvent]) -> None:
        self._session._check_peer_target(setup.path, setup.authority, "option")
        self._tokens.register_setup(setup.authorization_tokens)
        self._session.peer_setup = setup
        out.append(ev.SetupCompleted(setup))
        self._session._replay_held(out)

    def _on_session_goaway(self, message: Goaway, out: list[ev.MoqtEvent]) -> None:
        if self._session.goaway_received is not None:
            raise ProtocolViolation("second GOAWAY on the control stream")
        if not self._session.is_client and message.new_session_uri:
            raise ProtocolViolation("GOAWAY with a URI from the client")
        own_parity = 0 if self._session.is_client else 1
        if message.request_id is not None and message.request_id & 1 != own_parity:
            raise InvalidRequestId(f"GOAWAY Request ID {message.request_id} has the wrong parity")
        event = ev.GoawayReceived(message.new_session_uri, message.timeout_ms, message.request_id, None)
        self._session.goaway_received = event
        out.append(event)

    def _check_peer_request_id(self, request_id: int) -> None:
        peer_parity = 0 if not self._session.is_client else 1
        if request_id & 1 != peer_parity:
            raise InvalidRequestId(f"peer Request ID {request_id} has the wrong parity")
        if not self._streams.peer_ids.add(request_id):
            raise InvalidRequestId(f"peer Request ID {request_id} repeated")

    def on_new_request(self, sid: int, message: Message, out: list[ev.MoqtEvent]) -> None:
        if not isinstance(message, REQUEST_TYPES):
            raise ProtocolViolation(f"request stream begins with {message.NAME}")
        request_id = message.request_id
        self._check_peer_request_id(request_id)
        parameters = message.parameters
        request = RequestStream(request_id, type(message), False, parameters, stream_id=sid, message=message)
        self._requests[request_id] = request
        self._streams.by_stream[sid] = request
        tokens = self._tokens.resolve(parameters.authorization_tokens)

        if self._sender.goaway_sent_request_id is not None and request_id >= self._sender.goaway_sent_request_id:
            self._sender.reject(request, RequestErrorCode.GOING_AWAY, "going away")
            return
        namespace = getattr(message, "namespace", None)
        if namespace is None:
            namespace = getattr(message, "namespace_prefix", None)
        if namespace and namespace[0] in _RESERVED_FIRST_FIELDS:
            # Section 3.2: "." is never used and no session-level track is
            # defined, so both are rejected here, not passed to the application.
            self._sender.reject(request, RequestErrorCode.DOES_NOT_EXIST, "reserved namespace")
            return
        if parameters.range_filters:
            self._sender.reject(request, RequestErrorCode.INVALID_FILTER, _NO_RANGE_FILTERS)
            return
        if parameters.unsupported:
            self._sender.reject(request, RequestErrorCode.NOT_SUPPORTED, f"not supported: {parameters.unsupported}")
            return

        if isinstance(message, Subscribe):
            out.append(ev.SubscribeReceived(request_id, message.namespace, message.track_name, parameters, tokens))
            if parameters.fill is not None:
                self._streams.fills.open(request, parameters.fill, request_id, tokens, out)
        elif isinstance(message, Publish):
            unsupported = mandatory_properties(message.track_properties)
            other = self._receiving.aliases.get(message.track_alias)
            if other is not None and not other.closed:
                raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
            request.track_alias = message.track_alias
            request.default_priority = property_value(
                message.track_properties, TrackPropertyType.DEFAULT_PUBLISHER_PRIORITY, DEFAULT_PUBLISHER_PRIORITY
            )
            self._receiving.aliases[message.track_alias] = request
            if unsupported:
                self._sender.reject(request, RequestErrorCode.UNSUPPORTED_EXTENSION, "unsupported mandatory property")
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
            self._receiving.flush_held_for_alias(message.track_alias, out)
        elif isinstance(message, Fetch):
            self._fetches.on_fetch(request, message, tokens, out)
        elif isinstance(message, TrackStatus):
            out.append(ev.TrackStatusReceived(request_id, message.namespace, message.track_name, parameters, tokens))
        elif isinstance(message, PublishNamespace):
            out.append(ev.PublishNamespaceReceived(request_id, message.namespace, parameters, tokens))
        elif isinstance(message, SubscribeNamespace):
            out.append(ev.SubscribeNamespaceReceived(request_id, message.namespace_prefix, parameters, tokens))
        elif isinstance(message, SubscribeTracks):
            out.append(ev.SubscribeTracksReceived(request_id, message.namespace_prefix, parameters, tokens))

    def on_request_message(self, request: RequestStream, message: Message, out: list[ev.MoqtEvent]) -> None:
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
            self._streams.update_parent.pop(update_id, None)
            sent = self._streams.update_parameters.pop(update_id, None)
            if isinstance(message, RequestOk) and sent is not None:
                self._sender.apply_update(request, sent, message.parameters)
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
            out.append(
                ev.PublishDoneReceived(request.request_id, message.status_code, message.stream_count, message.reason)
            )
            # Late data streams are still accepted until Stream Count of them ended.
            request.done_stream_count = message.stream_count
            self._streams.finish_stream(request)
            self._receiving.maybe_end_subscription(request)
            return
        if isinstance(message, (Namespace, NamespaceDone)) and request.local and request.kind is SubscribeNamespace:
            prefix = request.message_as(SubscribeNamespace).namespace_prefix
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
            prefix = request.message_as(SubscribeTracks).namespace_prefix
            out.append(
                ev.PublishBlockedReceived(request.request_id, prefix + message.namespace_suffix, message.track_name)
            )
            return
        raise ProtocolViolation(f"{message.NAME} not expected on a {request.kind.NAME} stream")

    def _on_first_answer(self, request: RequestStream, message: Message, out: list[ev.MoqtEvent]) -> None:
        request.answered = True
        kind = request.kind
        rid = request.request_id
        if isinstance(message, RequestErrorMessage):
            request.closed = True
            out.append(
                ev.RequestRejected(rid, message.error_code, message.reason, message.retry_interval, message.redirect)
            )
            self._streams.finish_stream(request)
            return
        if kind is Subscribe and isinstance(message, SubscribeOk):
            other = self._receiving.aliases.get(message.track_alias)
            if other is not None and other is not request and not other.closed:
                raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
            if mandatory_properties(message.track_properties):
                self._streams.cancel(request, StreamResetCode.CANCELLED)
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
            self._receiving.aliases[message.track_alias] = request
            out.append(ev.SubscribeAccepted(rid, message.track_alias, message.parameters, message.track_properties))
            self._receiving.flush_held_for_alias(message.track_alias, out)
            return
        if kind is Fetch and isinstance(message, FetchOk):
            fetch = request.message_as(Fetch)
            if fetch.fetch_type == FetchType.STANDALONE:
                _, _, start, _ = fetch.track_and_range()
                if fetch_end_before_start(message.end_location, start):
                    raise ProtocolViolation("FETCH_OK End Location before the FETCH start")
            if mandatory_properties(message.track_properties):
                self._streams.cancel(request, StreamResetCode.CANCELLED)
                out.append(
                    ev.RequestRejected(
                        rid, RequestErrorCode.UNSUPPORTED_EXTENSION, "unsupported mandatory property", 0, None
                    )
                )
                return
            request.accepted = True
            out.append(
                ev.FetchAccepted(
                    rid, message.end_of_track, message.end_location, message.parameters, message.track_properties
                )
            )
            self._streams.maybe_finish_fetch(request)
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
                self._streams.finish_stream(request)
            return
        raise ProtocolViolation(f"{message.NAME} is not an answer to {kind.NAME}")

    def _on_peer_update(self, request: RequestStream, message: RequestUpdate, out: list[ev.MoqtEvent]) -> None:
        self._check_peer_request_id(message.request_id)
        if request.kind in (TrackStatus,):
            raise ProtocolViolation("REQUEST_UPDATE on a TRACK_STATUS stream")
        # The requester updates its request; for a PUBLISH the subscriber may too.
        if request.local and request.kind is not Publish:
            raise ProtocolViolation(f"REQUEST_UPDATE from the responder of {request.kind.NAME}")
        allowed = UPDATE_SCOPE.get(request.kind, frozenset())
        if self._profile.location_filter and request.kind in (Subscribe, Publish):
            allowed = allowed | {0x23}
        for ptype in message.parameters.types():
            if ptype not in allowed:
                raise ProtocolViolation(f"REQUEST_UPDATE of {request.kind.NAME} with parameter 0x{ptype:x}")
        request.peer_updates.append(message.request_id)
        self._streams.update_parent[message.request_id] = request
        self._streams.update_parameters[message.request_id] = message.parameters
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        if message.parameters.range_filters:
            self._session.request_error(message.request_id, RequestErrorCode.INVALID_FILTER, _NO_RANGE_FILTERS)
            return
        if message.parameters.unsupported:
            self._session.request_error(message.request_id, RequestErrorCode.NOT_SUPPORTED,
                               f"not supported: {message.parameters.unsupported}")
            return
        out.append(ev.RequestUpdateReceived(message.request_id, request.request_id, message.parameters, tokens))
        if message.parameters.fill is not None and request.kind is Subscribe and not request.local:
            self._streams.fills.open(request, message.parameters.fill, message.request_id, tokens, out)

    def on_request_fin(self, request: RequestStream, out: list[ev.MoqtEvent]) -> None:
        request.fin_received = True
        if request.closed or request.done_stream_count is not None:
            self._streams.forget_if_done(request)
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
            if not self._profile.fin_cancels_discovery:
                # Draft-20: a FIN only ends what the requester sends; cancelling is a reset.
                cancels = kind is Publish
        if cancels:
            request.closed = True
            out.append(ev.RequestCancelled(request.request_id, StreamResetCode.CANCELLED, request.local))
            self._streams.finish_stream(request)
        elif request.local and kind is SubscribeNamespace:
            # Treated as though each active namespace received NAMESPACE_DONE.
            prefix = request.message_as(SubscribeNamespace).namespace_prefix
            for suffix in sorted(request.namespaces):
                out.append(ev.NamespaceDoneReceived(request.request_id, suffix, prefix + suffix))
            request.namespaces.clear()
            request.closed = True
            out.append(ev.RequestCancelled(request.request_id, StreamResetCode.CANCELLED, True))
            self._streams.finish_stream(request)
        elif request.local and kind is Fetch:
            self._streams.maybe_finish_fetch(request)
        self._streams.forget_if_done(request)
