"""Requests from the peer, handed to the application's handlers: answer each exactly once.

A handler gets an `Incoming...` request; `accept()` answers it and returns the handle
to publish on (publisher.py) or, for a PUBLISH, the Subscription to read
(subscriber.py); `reject()` refuses it with a REQUEST_ERROR code. `IncomingUpdate`, a
REQUEST_UPDATE of a request already accepted, lives with what it updates (publisher.py).
"""

from __future__ import annotations

from typing import Any

from .. import events as ev
from ..d14.session import MoqtSession14
from ..d18.messages import Parameters
from ..d18.session import MoqtSession
from ..errors import (
    DoesNotExist,
    NotSupported,
    RequestError,
    RequestErrorCode,
    StreamClosed,
    Uninterested,
)
from ..wire import (
    AuthToken,
    FetchType,
    GroupOrder,
    Location,
    Properties,
    SubscriptionFilter,
)
from .core import ConnectionCore
from .publisher import (
    FetchSender,
    IncomingUpdate,
    NamespacePublisher,
    NamespaceRegistration,
    OutgoingSubscription,
)
from .subscriber import Subscription

__all__ = [
    "HANDLER_KINDS",
    "IncomingFetch",
    "IncomingPublish",
    "IncomingPublishNamespace",
    "IncomingRequest",
    "IncomingSubscribe",
    "IncomingSubscribeNamespace",
    "IncomingSubscribeTracks",
    "IncomingTrackStatus",
    "IncomingUpdate",
    "INCOMING",
]

class IncomingRequest:
    """A request from the peer, handed to a handler; answer it exactly once."""

    default_error: type[RequestError] = DoesNotExist

    def __init__(self, connection: ConnectionCore, event: Any):
        self.connection = connection
        self.event = event
        self.request_id: int = event.request_id
        self.parameters: Parameters = event.parameters
        self.authorization_tokens: tuple[AuthToken, ...] = event.authorization_tokens
        self.answered = False

    @property
    def authorization(self) -> list[bytes]:
        """The token values sent with the request."""
        return [t.value or b"" for t in self.authorization_tokens]

    def reject(
        self,
        error: RequestError | int = RequestErrorCode.DOES_NOT_EXIST,
        reason: str = "",
        *,
        retry_interval: int = 0,
    ) -> None:
        if self.answered:
            return
        self.answered = True
        self.connection.settle(self.request_id, accepted=False)
        if isinstance(error, RequestError):
            code, reason, retry_interval = int(error.error_code), reason or error.reason, error.retry_interval
        else:
            code = int(error)
        session = self.connection.session
        if session is None or session.closed:
            return
        try:
            session.request_error(self.request_id, code, reason, retry_interval=retry_interval)
        except StreamClosed:
            return
        self.connection.transmit_soon()

    def _answer(self) -> MoqtSession | MoqtSession14:
        if self.answered:
            raise ValueError(f"request {self.request_id} was already answered")
        self.answered = True
        try:
            session = self.connection.live_session()
        except BaseException:
            self.connection.settle(self.request_id, accepted=False)
            raise
        # REQUEST_UPDATEs that arrived while the request was pending follow the answer.
        self.connection.settle(self.request_id, accepted=True)
        return session


class IncomingSubscribe(IncomingRequest):
    """A SUBSCRIBE from the peer."""

    def __init__(self, connection: ConnectionCore, event: ev.SubscribeReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name

    @property
    def forward(self) -> bool:
        return self.parameters.forward is not False

    @property
    def subscription_filter(self) -> SubscriptionFilter | None:
        return self.parameters.subscription_filter

    def accept(
        self,
        *,
        largest: Location | tuple[int, int] | None = None,
        expires: int | None = None,
        track_properties: Properties = (),
        track_alias: int | None = None,
    ) -> OutgoingSubscription:
        """Send SUBSCRIBE_OK; `largest` is the Largest Object when objects exist."""
        session = self._answer()
        alias = session.subscribe_ok(
            self.request_id,
            track_alias=track_alias,
            largest=None if largest is None else Location(*largest),
            expires=expires,
            track_properties=track_properties,
        )
        outgoing = OutgoingSubscription(self.connection, self.request_id, alias)
        outgoing.parameters = self.parameters
        outgoing.track_properties = track_properties
        outgoing.largest = None if largest is None else Location(*largest)
        # Joining FETCHes that waited for this SUBSCRIBE_OK go to the fetch handler now.
        self.connection.dispatch_released()
        self.connection.transmit_soon()
        return outgoing


class IncomingFetch(IncomingRequest):
    """A FETCH from the peer; a joining fetch arrives already resolved to a range."""

    def __init__(self, connection: ConnectionCore, event: ev.FetchReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name
        self.fetch_type: FetchType = event.fetch_type
        self.start: Location = event.start
        self.end: Location = event.end
        self.joining_request_id = event.joining_request_id

    @property
    def group_order(self) -> GroupOrder:
        return self.parameters.group_order or GroupOrder.ASCENDING

    @property
    def last(self) -> Location | None:
        """Last Location requested, inclusive; None when the whole end group is wanted."""
        if self.end.object == 0:
            return None
        return Location(self.end.group, self.end.object - 1)

    def includes(self, location: Location | tuple[int, int]) -> bool:
        """Whether a Location lies in the requested range."""
        location = Location(*location)
        if location < self.start:
            return False
        if self.end.object == 0:
            return location.group <= self.end.group
        return location < self.end

    def accept(
        self,
        *,
        end: Location | tuple[int, int] | None = None,
        end_of_track: bool = False,
        track_properties: Properties = (),
    ) -> FetchSender:
        """Send FETCH_OK and open the response stream. `end` is the wire End
        Location of what will be sent (default: the requested end)."""
        session = self._answer()
        stream_id = session.open_fetch_stream(self.request_id)
        session.fetch_ok(
            self.request_id,
            self.end if end is None else Location(*end),
            end_of_track=end_of_track,
            track_properties=track_properties,
        )
        sender = FetchSender(self.connection, self.request_id, stream_id)
        self.connection.start_writing(stream_id)
        self.connection.transmit_soon()
        return sender


class IncomingTrackStatus(IncomingRequest):
    def __init__(self, connection: ConnectionCore, event: ev.TrackStatusReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name

    def accept(
        self, *, largest: Location | tuple[int, int] | None = None, track_properties: Properties = ()
    ) -> None:
        session = self._answer()
        parameters = Parameters(largest_object=None if largest is None else Location(*largest))
        session.request_ok(self.request_id, parameters, track_properties)
        self.connection.transmit_soon()


class IncomingPublishNamespace(IncomingRequest):
    default_error = Uninterested

    def __init__(self, connection: ConnectionCore, event: ev.PublishNamespaceReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace

    def accept(self) -> NamespaceRegistration:
        session = self._answer()
        session.request_ok(self.request_id)
        registration = NamespaceRegistration(self.connection, self.request_id, self.namespace)
        self.connection.transmit_soon()
        return registration


class IncomingSubscribeNamespace(IncomingRequest):
    default_error = NotSupported

    def __init__(self, connection: ConnectionCore, event: ev.SubscribeNamespaceReceived):
        super().__init__(connection, event)
        self.namespace_prefix = event.namespace_prefix

    def accept(self) -> NamespacePublisher:
        session = self._answer()
        session.request_ok(self.request_id)
        publisher = NamespacePublisher(self.connection, self.request_id, self.namespace_prefix)
        self.connection.transmit_soon()
        return publisher


class IncomingSubscribeTracks(IncomingRequest):
    default_error = NotSupported

    def __init__(self, connection: ConnectionCore, event: ev.SubscribeTracksReceived):
        super().__init__(connection, event)
        self.namespace_prefix = event.namespace_prefix

    def accept(self) -> NamespacePublisher:
        """Accept; then offer tracks with MoqtConnection.publish()."""
        session = self._answer()
        session.request_ok(self.request_id)
        publisher = NamespacePublisher(self.connection, self.request_id, self.namespace_prefix)
        self.connection.transmit_soon()
        return publisher


class IncomingPublish(IncomingRequest):
    """A PUBLISH from the peer: accept() returns the Subscription to iterate."""

    default_error = Uninterested

    def __init__(self, connection: ConnectionCore, event: ev.PublishReceived):
        super().__init__(connection, event)
        self.namespace = event.namespace
        self.track_name = event.track_name
        self.track_alias = event.track_alias
        self.track_properties = event.track_properties
        self.subscription = Subscription(connection, self.request_id, self.namespace, self.track_name)
        self.subscription.track_alias = event.track_alias
        self.subscription.largest = event.parameters.largest_object
        self.subscription.track_properties = event.track_properties
        # Objects may precede PUBLISH_OK: the subscription, registered as it was made,
        # collects them from now.

    def accept(self, *, forward: bool | None = None, parameters: Parameters | None = None) -> Subscription:
        session = self._answer()
        if parameters is None:
            parameters = Parameters(forward=forward)
        session.request_ok(self.request_id, parameters)
        self.subscription.parameters = parameters
        self.connection.transmit_soon()
        return self.subscription

    def reject(self, error: RequestError | int = RequestErrorCode.UNINTERESTED, reason: str = "", **kw: Any) -> None:
        self.connection.forget(self.request_id)
        super().reject(error, reason, **kw)


INCOMING: dict[type, tuple[str, type[IncomingRequest]]] = {
    ev.SubscribeReceived: ("subscribe", IncomingSubscribe),
    ev.FetchReceived: ("fetch", IncomingFetch),
    ev.TrackStatusReceived: ("track_status", IncomingTrackStatus),
    ev.PublishNamespaceReceived: ("publish_namespace", IncomingPublishNamespace),
    ev.SubscribeNamespaceReceived: ("subscribe_namespace", IncomingSubscribeNamespace),
    ev.SubscribeTracksReceived: ("subscribe_tracks", IncomingSubscribeTracks),
    ev.PublishReceived: ("publish", IncomingPublish),
}
HANDLER_KINDS = tuple(kind for kind, _ in INCOMING.values())
