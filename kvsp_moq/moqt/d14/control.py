"""The draft-14 control messages this endpoint receives, on its one control stream:
CLIENT_SETUP / SERVER_SETUP, GOAWAY, the peer's requests and SUBSCRIBE_UPDATEs, the
answers to ours, PUBLISH_DONE, and the peer's UNSUBSCRIBE and FETCH_CANCEL. The
namespace messages are in `namespaces`; MAX_REQUEST_ID and REQUESTS_BLOCKED are handed
to `credit`. A part `session.MoqtSession14` owns (`ControlReceiver14`), whose table of
handlers maps each message after SETUP to its handler, here or in `namespaces`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import events as ev
from .. import wire
from ..d18.messages import Parameters, Setup
from ..errors import (
    DuplicateTrackAlias,
    ProtocolViolation,
    SessionCloseCode,
    SessionError,
    StreamResetCode,
)
from ..session.core import SessionPart
from ..session.fetches import fetch_end_before_start
from ..wire import SubscriptionFilter, TrackPropertyType
from . import messages as d14
from .namespaces import NamespaceMapping
from .request_state import (
    ANNOUNCED,
    FETCH,
    PUBLISH,
    PUBLISH_NAMESPACE,
    SUBSCRIBE,
    SUBSCRIBE_NAMESPACE,
    TRACK_STATUS,
    Request14,
)
from .requests import Requests14

if TYPE_CHECKING:
    from .session import MoqtSession14

__all__ = ["ControlReceiver14"]


class ControlReceiver14(SessionPart[Request14]):
    """The control messages a draft-14 session receives, each turned into events and the
    state of its request."""

    def __init__(self, session: MoqtSession14, requests14: Requests14, namespaces: NamespaceMapping) -> None:
        super().__init__(session)
        self._session = session
        self._requests14 = requests14
        self._namespaces = namespaces
        self._credit = session._credit
        self._parser = d14.ControlStreamParser()
        # Message class -> its handler; the message type cannot be spelled for every entry.
        self._handlers: dict[type[d14.Message], Callable[[Any, list[ev.MoqtEvent]], None]] = {
            d14.Goaway: self._on_goaway,
            d14.MaxRequestId: self._on_max_request_id,
            d14.RequestsBlocked: self._on_requests_blocked,
            d14.Subscribe: self._on_subscribe,
            d14.SubscribeOk: self._on_subscribe_ok,
            d14.SubscribeError: self._on_request_error,
            d14.SubscribeUpdate: self._on_subscribe_update,
            d14.Unsubscribe: self._on_unsubscribe,
            d14.PublishDone: self._on_publish_done,
            d14.Publish: self._on_publish,
            d14.PublishOk: self._on_publish_ok,
            d14.PublishError: self._on_request_error,
            d14.Fetch: self._on_fetch,
            d14.FetchOk: self._on_fetch_ok,
            d14.FetchError: self._on_request_error,
            d14.FetchCancel: self._on_fetch_cancel,
            d14.TrackStatus: self._on_subscribe,
            d14.TrackStatusOk: self._on_track_status_ok,
            d14.TrackStatusError: self._on_request_error,
            d14.PublishNamespace: namespaces.on_publish_namespace,
            d14.PublishNamespaceOk: self._on_namespace_ok,
            d14.PublishNamespaceError: self._on_request_error,
            d14.PublishNamespaceDone: namespaces.on_publish_namespace_done,
            d14.PublishNamespaceCancel: namespaces.on_publish_namespace_cancel,
            d14.SubscribeNamespace: namespaces.on_subscribe_namespace,
            d14.SubscribeNamespaceOk: self._on_namespace_ok,
            d14.SubscribeNamespaceError: self._on_request_error,
            d14.UnsubscribeNamespace: namespaces.on_unsubscribe_namespace,
        }

    def on_control_data(self, data: bytes, out: list[ev.MoqtEvent]) -> None:
        for message in self._parser.feed(data):
            if self._session.peer_setup is None:
                if isinstance(message, d14.ClientSetup) and not self._session.is_client:
                    self._on_client_setup(message, out)
                elif isinstance(message, d14.ServerSetup) and self._session.is_client:
                    self._on_server_setup(message, out)
                else:
                    raise ProtocolViolation(f"{message.NAME} before SETUP")
                continue
            handler = self._handlers.get(type(message))
            if handler is None:
                raise ProtocolViolation(f"{message.NAME} after SETUP")
            handler(message, out)

    def setup_parameters(self) -> d14.SetupParameters:
        s = self._session.local_setup
        return d14.SetupParameters(
            path=s.path if self._session.is_client else None,
            max_request_id=self._credit.granted,
            authorization_tokens=s.authorization_tokens,
            max_auth_token_cache_size=s.max_auth_token_cache_size,
            authority=s.authority if self._session.is_client else None,
            implementation=s.implementation,
        )

    def _on_client_setup(self, message: d14.ClientSetup, out: list[ev.MoqtEvent]) -> None:
        version = next((v for v in message.versions if v in self._session.versions), None)
        if version is None:
            offered = ", ".join(f"{v:#x}" for v in message.versions)
            raise SessionError(
                f"no supported version among {offered}", error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED
            )
        self._session._check_peer_target(message.parameters.path, message.parameters.authority, "parameter")
        self._session.version = version
        self._session._send(d14.ServerSetup(version, self.setup_parameters()))
        self._complete_setup(message.parameters, out)

    def _on_server_setup(self, message: d14.ServerSetup, out: list[ev.MoqtEvent]) -> None:
        if message.selected_version not in self._session.versions:
            raise SessionError(
                f"server chose version {message.selected_version:#x}, not offered",
                error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED,
            )
        self._session._check_peer_target(message.parameters.path, message.parameters.authority, "parameter")
        self._session.version = message.selected_version
        self._complete_setup(message.parameters, out)

    def _complete_setup(self, p: d14.SetupParameters, out: list[ev.MoqtEvent]) -> None:
        self._tokens.register_setup(p.authorization_tokens)
        setup = Setup(
            path=p.path,
            authority=p.authority,
            max_auth_token_cache_size=p.max_auth_token_cache_size,
            authorization_tokens=p.authorization_tokens,
            implementation=p.implementation,
        )
        self._session.peer_setup = setup
        self._credit.peer_grant = p.max_request_id or 0
        out.append(ev.SetupCompleted(setup))
        self._credit.flush_queue()
        self._session._replay_held(out)

    # -- session-level messages --------------------------------------------

    def _on_max_request_id(self, message: d14.MaxRequestId, out: list[ev.MoqtEvent]) -> None:
        self._credit.on_max_request_id(message)

    def _on_requests_blocked(self, message: d14.RequestsBlocked, out: list[ev.MoqtEvent]) -> None:
        self._credit.grant(force=True)

    def _on_goaway(self, message: d14.Goaway, out: list[ev.MoqtEvent]) -> None:
        if self._session.goaway_received is not None:
            raise ProtocolViolation("second GOAWAY")
        if not self._session.is_client and message.new_session_uri:
            raise ProtocolViolation("GOAWAY with a URI from the client")
        event = ev.GoawayReceived(message.new_session_uri, 0, None, None)
        self._session.goaway_received = event
        out.append(event)

    # -- peer requests -----------------------------------------------------

    def _on_subscribe(self, message: d14.Subscribe, out: list[ev.MoqtEvent]) -> None:
        """SUBSCRIBE, or TRACK_STATUS (SUBSCRIBE's format)."""
        s18 = message.to_draft18()
        status = isinstance(message, d14.TrackStatus)
        request = self._credit.new_peer_request(
            message.request_id, TRACK_STATUS if status else SUBSCRIBE, parameters=s18.parameters,
            namespace=message.namespace, track_name=message.track_name,
        )
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        if self._requests14.refuse_if_going_away(request):
            return
        received = ev.TrackStatusReceived if status else ev.SubscribeReceived
        out.append(received(request.request_id, message.namespace, message.track_name, s18.parameters, tokens))

    def _on_publish(self, message: d14.Publish, out: list[ev.MoqtEvent]) -> None:
        other = self._receiving.aliases.get(message.track_alias)
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
        request = self._credit.new_peer_request(
            message.request_id, PUBLISH, parameters=parameters,
            namespace=message.namespace, track_name=message.track_name, track_alias=message.track_alias,
        )
        self._receiving.aliases[message.track_alias] = request
        tokens = self._tokens.resolve(p.authorization_tokens)
        if self._requests14.refuse_if_going_away(request):
            return
        out.append(
            ev.PublishReceived(
                request.request_id, message.namespace, message.track_name, message.track_alias,
                parameters, tuple(properties), tokens,
            )
        )
        self._receiving.flush_held_for_alias(message.track_alias, out)

    def _on_fetch(self, message: d14.Fetch, out: list[ev.MoqtEvent]) -> None:
        f18 = message.to_draft18()
        request = self._credit.new_peer_request(message.request_id, FETCH, parameters=f18.parameters, fetch=f18)
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        if self._requests14.refuse_if_going_away(request):
            return
        self._fetches.on_fetch(request, f18, tokens, out)

    def _on_subscribe_update(self, message: d14.SubscribeUpdate, out: list[ev.MoqtEvent]) -> None:
        subscription = self._requests.get(message.subscription_request_id)
        self._credit.accept_peer_id(message.request_id)
        self._credit.grant()  # an update uses a Request ID but holds nothing open
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
        self._requests14.updates[message.request_id] = subscription
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        out.append(ev.RequestUpdateReceived(message.request_id, subscription.request_id, parameters, tokens))

    # -- answers to our requests -------------------------------------------

    def _our_request(self, request_id: int, kinds: tuple[type, ...], name: str) -> Request14 | None:
        """Our request answered by `name`; None when it was cancelled meanwhile."""
        request = self._requests.get(request_id)
        if request is None or not request.local:
            if self._requests14.was_ours(request_id):
                return None  # ours, already forgotten
            raise ProtocolViolation(f"{name} for unknown request {request_id}")
        if request.kind not in kinds:
            raise ProtocolViolation(f"{name} answers a {request.kind.NAME}")
        if request.closed:
            return None
        return request

    def _first_answer(self, request_id: int, kinds: tuple[type, ...], name: str) -> Request14 | None:
        request = self._our_request(request_id, kinds, name)
        if request is None:
            return None
        if request.answered:
            raise ProtocolViolation(f"second answer ({name}) to request {request_id}")
        request.answered = True
        return request

    def _on_request_error(self, message: d14._RequestError, out: list[ev.MoqtEvent]) -> None:
        kinds = {
            d14.SubscribeError: (SUBSCRIBE,),
            d14.FetchError: (FETCH,),
            d14.TrackStatusError: (TRACK_STATUS,),
            d14.PublishError: (PUBLISH,),
            d14.PublishNamespaceError: (PUBLISH_NAMESPACE, ANNOUNCED),
            d14.SubscribeNamespaceError: (SUBSCRIBE_NAMESPACE,),
        }[type(message)]
        request = self._first_answer(message.request_id, kinds, message.NAME)
        if request is None:
            return
        self._requests14.close_request(request)
        if request.kind == ANNOUNCED:
            self._namespaces.drop_announced(request)
            return
        e18 = message.to_draft18()
        out.append(ev.RequestRejected(request.request_id, e18.error_code, e18.reason, 0, None))

    def _on_subscribe_ok(self, message: d14.SubscribeOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (SUBSCRIBE,), message.NAME)
        if request is None:
            return
        other = self._receiving.aliases.get(message.track_alias)
        if other is not None and other is not request and not other.closed:
            raise DuplicateTrackAlias(f"track alias {message.track_alias} already in use")
        ok = message.to_draft18()
        request.accepted = True
        request.track_alias = message.track_alias
        request.largest_at_ok = message.largest_location
        self._receiving.aliases[message.track_alias] = request
        out.append(ev.SubscribeAccepted(request.request_id, message.track_alias, ok.parameters, ok.track_properties))
        self._receiving.flush_held_for_alias(message.track_alias, out)

    def _on_fetch_ok(self, message: d14.FetchOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (FETCH,), message.NAME)
        if request is None:
            return
        fetch = request.fetch
        assert fetch is not None
        if fetch.start is not None and fetch_end_before_start(message.end_location, fetch.start):  # a standalone FETCH
            raise ProtocolViolation("FETCH_OK End Location before the FETCH start")
        ok = message.to_draft18()
        request.accepted = True
        out.append(
            ev.FetchAccepted(request.request_id, ok.end_of_track, ok.end_location, ok.parameters, ok.track_properties)
        )
        self._requests14.maybe_finish_fetch(request)

    def _on_track_status_ok(self, message: d14.TrackStatusOk, out: list[ev.MoqtEvent]) -> None:
        request = self._first_answer(message.request_id, (TRACK_STATUS,), message.NAME)
        if request is None:
            return
        ok = message.to_draft18()
        request.accepted = True
        self._requests14.close_request(request)
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

    def _on_namespace_ok(
        self, message: d14.PublishNamespaceOk | d14.SubscribeNamespaceOk, out: list[ev.MoqtEvent]
    ) -> None:
        if isinstance(message, d14.PublishNamespaceOk):
            kinds: tuple[type, ...] = (PUBLISH_NAMESPACE, ANNOUNCED)
        else:
            kinds = (SUBSCRIBE_NAMESPACE,)
        request = self._first_answer(message.request_id, kinds, message.NAME)
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
        self._receiving.maybe_end_subscription(request)

    # -- cancellations by the peer -----------------------------------------

    def _on_unsubscribe(self, message: d14.Unsubscribe, out: list[ev.MoqtEvent]) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.closed:
            return
        if not request.is_subscription or not request.publisher_is_local:
            raise ProtocolViolation("UNSUBSCRIBE for a subscription this endpoint does not publish")
        self._requests14.peer_cancelled(request, StreamResetCode.CANCELLED, out)

    def _on_fetch_cancel(self, message: d14.FetchCancel, out: list[ev.MoqtEvent]) -> None:
        request = self._requests.get(message.request_id)
        if request is None or request.closed:
            return
        if request.local or request.kind != FETCH:
            raise ProtocolViolation("FETCH_CANCEL for a request that is not a peer FETCH")
        self._requests14.peer_cancelled(request, StreamResetCode.CANCELLED, out)
