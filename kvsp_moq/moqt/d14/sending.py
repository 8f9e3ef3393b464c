"""What a draft-14 endpoint sends on its control stream: requests (queued while the
peer's grant does not cover them), SUBSCRIBE_UPDATE, the message that cancels each kind
of request, GOAWAY, and the answers to the peer's requests (*_OK, *_ERROR with its code
renumbered, PUBLISH_DONE). A part `session.MoqtSession14` owns (`MessageSender14`), its
`session.messages.Messages`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .. import events as ev
from ..d18 import messages as m18
from ..d18.messages import Parameters, Redirect
from ..errors import NotSupported, PublishDoneCode, RequestErrorCode, StreamClosed, StreamResetCode
from ..session.core import SessionPart
from ..wire import (
    DEFAULT_PUBLISHER_PRIORITY,
    FetchType,
    GroupOrder,
    Location,
    Properties,
    SubscriptionFilter,
    TrackNamespace,
    TrackPropertyType,
    property_value,
)
from . import messages as d14
from .dialect import ERROR_MESSAGES
from .namespaces import NamespaceMapping
from .request_state import (
    ANNOUNCED,
    FETCH,
    PUBLISH,
    PUBLISH_NAMESPACE,
    SUBSCRIBE,
    SUBSCRIBE_NAMESPACE,
    SUBSCRIBE_UPDATE,
    TRACK_STATUS,
    TRACKS,
    Request14,
)
from .requests import Requests14

if TYPE_CHECKING:
    from .session import MoqtSession14

__all__ = ["MessageSender14"]


class MessageSender14(SessionPart[Request14]):
    """The requests, updates, cancellations and answers a draft-14 session sends, on its
    control stream; the namespace announcements are the `NamespaceMapping` part's."""

    def __init__(self, session: MoqtSession14, requests14: Requests14, namespaces: NamespaceMapping) -> None:
        super().__init__(session)
        self._session = session
        self._requests14 = requests14
        self._namespaces = namespaces

    # ------------------------------------------------------------------
    # Sending: requests
    # ------------------------------------------------------------------

    def subscribe(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int:
        """Send SUBSCRIBE; returns its Request ID."""
        message18 = m18.Subscribe(0, tuple(namespace), track_name, parameters)
        return self._requests14.open_request(
            SUBSCRIBE,
            lambda rid: d14.Subscribe.from_draft18(replace(message18, request_id=rid)),
            parameters=parameters, namespace=tuple(namespace), track_name=track_name,
        )

    def fetch(
        self, namespace: TrackNamespace, track_name: bytes, start: Location, end: Location, parameters: Parameters
    ) -> int:
        f18 = m18.Fetch(0, FetchType.STANDALONE, tuple(namespace), track_name, Location(*start), Location(*end),
                        parameters=parameters)
        return self._fetch(f18)

    def joining_fetch(
        self, subscribe_request_id: int, joining_start: int, *, relative: bool, parameters: Parameters
    ) -> int:
        """Send a joining FETCH for one of our subscriptions."""
        fetch_type = FetchType.RELATIVE_JOINING if relative else FetchType.ABSOLUTE_JOINING
        f18 = m18.Fetch(0, fetch_type, joining_request_id=subscribe_request_id, joining_start=joining_start,
                        parameters=parameters)
        return self._fetch(f18)

    def _fetch(self, f18: m18.Fetch) -> int:
        request_id = self._requests14.open_request(
            FETCH,
            lambda rid: d14.Fetch.from_draft18(replace(f18, request_id=rid)),
            parameters=f18.parameters,
        )
        request = self._requests[request_id]
        request.fetch = replace(f18, request_id=request_id)
        if f18.parameters.group_order is not None:
            request.fetch_group_order = f18.parameters.group_order
        return request_id

    def track_status(self, namespace: TrackNamespace, track_name: bytes, parameters: Parameters) -> int:
        t18 = m18.TrackStatus(0, tuple(namespace), track_name, parameters)
        return self._requests14.open_request(
            TRACK_STATUS, lambda rid: d14.TrackStatus.from_draft18(replace(t18, request_id=rid)),
            parameters=parameters, namespace=tuple(namespace), track_name=track_name,
        )

    def publish_namespace(self, namespace: TrackNamespace, parameters: Parameters) -> int:
        """Send PUBLISH_NAMESPACE; withdrawn by cancel_request() (PUBLISH_NAMESPACE_DONE)."""
        ns = tuple(namespace)
        return self._requests14.open_request(
            PUBLISH_NAMESPACE,
            lambda rid: d14.PublishNamespace(rid, ns, d14.Parameters(parameters.authorization_tokens)),
            parameters=parameters, namespace=ns,
        )

    def subscribe_namespace(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int:
        """Send SUBSCRIBE_NAMESPACE; the namespaces come as NamespaceReceived events."""
        prefix = tuple(namespace_prefix)
        return self._requests14.open_request(
            SUBSCRIBE_NAMESPACE,
            lambda rid: d14.SubscribeNamespace(rid, prefix, d14.Parameters(parameters.authorization_tokens)),
            parameters=parameters, namespace=prefix,
        )

    def subscribe_tracks(self, namespace_prefix: TrackNamespace, parameters: Parameters) -> int:
        raise NotSupported("SUBSCRIBE_TRACKS does not exist in draft-14")

    def publish(
        self, namespace: TrackNamespace, track_name: bytes, *, track_alias: int | None, parameters: Parameters,
        track_properties: Properties,
    ) -> int:
        alias = self._session._allocate_alias(track_alias)
        ns = tuple(namespace)
        order = GroupOrder(property_value(track_properties, TrackPropertyType.DEFAULT_PUBLISHER_GROUP_ORDER, 1))
        cache = property_value(track_properties, TrackPropertyType.MAX_CACHE_DURATION)
        wire_parameters = d14.Parameters(
            parameters.authorization_tokens, parameters.object_delivery_timeout, cache
        )
        request_id = self._requests14.open_request(
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
        self._session._check_open()
        request = self._session._request(request_id)
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
        start = Location(0, 0)
        end_group: int | None = None
        if flt is not None and flt.start is not None:  # AbsoluteStart, AbsoluteRange: the filters with a start
            start, end_group = flt.start, flt.end_group
        elif request.largest_at_ok is not None:
            start = request.largest_at_ok
        update_id = self._session._next_request_id
        message = d14.SubscribeUpdate(
            update_id, request_id, start, end_group,
            128 if merged.subscriber_priority is None else merged.subscriber_priority,
            merged.forward is not False,
            d14.Parameters(parameters.authorization_tokens, parameters.object_delivery_timeout),
        )
        data = message.encode()  # before the ID is spent, as for requests
        self._session._next_request_id += 2
        update = Request14(update_id, SUBSCRIBE_UPDATE, True, closed=True)
        self._session._credit.send_request(update, data)
        request.parameters = merged
        self._session._released.append(ev.RequestAccepted(update_id, Parameters(), ()))
        return update_id

    def cancel_request(self, request_id: int, error_code: int) -> None:
        """Abandon a request: UNSUBSCRIBE, FETCH_CANCEL, PUBLISH_NAMESPACE_DONE,
        UNSUBSCRIBE_NAMESPACE for ours; an error, PUBLISH_DONE or
        PUBLISH_NAMESPACE_CANCEL for a peer's."""
        request = self._requests.get(request_id)
        if request is None or self._session.closed or request.closed:
            return
        if request.kind == TRACKS:  # no message: PUBLISHes already sent go on
            request.answered = True
            self._requests14.close_request(request)
            return
        self._namespaces.end_tracks(request, self._session._released)
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription cancelled")
        if not request.local and not request.answered and request.kind in ERROR_MESSAGES:
            self.reject(request, RequestErrorCode.INTERNAL_ERROR, "cancelled")
        else:
            self._send_cancel(request, error_code)
        self._requests14.end_data_streams(request, error_code)
        self._requests14.close_request(request)

    def _send_cancel(self, request: Request14, error_code: int = StreamResetCode.CANCELLED) -> None:
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
                self._namespaces.withdraw_announced(request)
            # A peer FETCH already answered ends by resetting its data stream.
        if message is not None and not self._session.closed:
            self._session._credit.send_about(request, message)

    def goaway(self, new_session_uri: str, timeout_ms: int) -> None:
        """Send GOAWAY (draft-14 carries no timeout); later peer requests are refused."""
        self._session._check_open()
        if self._session.is_client and new_session_uri:
            raise ValueError("a client sends GOAWAY without a URI")
        if self._session._control_stream_id is None:
            raise StreamClosed("no control stream yet")
        self._requests14.goaway_sent = True
        self._session._send(d14.Goaway(new_session_uri))

    def request_goaway(self, request_id: int, new_session_uri: str, timeout_ms: int) -> None:
        raise NotSupported("draft-14 has no per-request GOAWAY")

    # ------------------------------------------------------------------
    # Sending: answers
    # ------------------------------------------------------------------

    def send_about(self, request: Request14, data: bytes, *, final: bool = False) -> None:
        """On the control stream, after the request itself if it is still queued."""
        self._session._credit.send_encoded_about(request, data)
        if final:
            self._requests14.close_request(request)

    def request_ok(self, request_id: int, parameters: Parameters, track_properties: Properties) -> None:
        """Send PUBLISH_OK, TRACK_STATUS_OK, PUBLISH_NAMESPACE_OK or
        SUBSCRIBE_NAMESPACE_OK; for a peer SUBSCRIBE_UPDATE, or the SUBSCRIBE_TRACKS
        half of a SUBSCRIBE_NAMESPACE, nothing is sent."""
        self._session._check_open()
        if self._requests14.updates.pop(request_id, None) is not None:
            return
        if self._namespaces.answer_tracks(request_id):
            return
        kinds = (PUBLISH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE)
        request = self._session._peer_request(request_id, kinds)
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
        self._session._send(message)
        request.answered = request.accepted = True
        if request.kind == TRACK_STATUS:
            self._requests14.close_request(request)

    def request_error(
        self, request_id: int, error_code: int, reason: str, *, retry_interval: int, redirect: Redirect | None
    ) -> None:
        """Reject a peer's request with its *_ERROR message (code renumbered to
        draft-14; Retry Interval and redirect have no draft-14 field)."""
        self._session._check_open()
        subscription = self._requests14.updates.pop(request_id, None)
        if subscription is not None:
            if not subscription.closed and subscription.accepted:
                self._session.publish_done(subscription.request_id, PublishDoneCode.UPDATE_FAILED, "update failed")
            return
        if self._namespaces.answer_tracks(request_id, refused=True):
            return  # the SUBSCRIBE_NAMESPACE half answers the peer
        request = self._session._peer_request(request_id, tuple(ERROR_MESSAGES))
        self.reject(request, error_code, reason)

    def reject(self, request: Request14, error_code: int, reason: str) -> None:
        self._namespaces.end_tracks(request, self._session._released)
        request.answered = True
        data = self._dialect.request_error(request, error_code, reason)
        self._requests14.close_request(request)
        if not self._session.closed:
            self.send_about(request, data)
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription refused")

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        self._namespaces.namespace(request_id, namespace_suffix)

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        self._namespaces.namespace_done(request_id, namespace_suffix)

    def publish_blocked(self, request_id: int, namespace_suffix: TrackNamespace, track_name: bytes) -> None:
        raise NotSupported("PUBLISH_BLOCKED does not exist in draft-14")
