"""The publisher side: what this endpoint sends.

`OutgoingSubscription` is a subscription we publish (an accepted SUBSCRIBE, or our
PUBLISH), written through one `SubgroupSender` per subgroup stream; `FetchSender` writes
one FETCH response; `NamespaceRegistration` and `NamespacePublisher` answer the peer's
PUBLISH_NAMESPACE and SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS; `IncomingUpdate` is the
peer's REQUEST_UPDATE of one of them. Each but the senders of subgroups is a
`RequestHandle` that registers with its connection when made and forgets itself when
done. Writers wait for the stream to drain, and delivery timeouts are enforced where
objects are handed to QUIC.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from .. import events as ev
from ..d18.messages import Parameters
from ..errors import (
    InvalidRange,
    MoqtError,
    PublishDoneCode,
    RequestError,
    RequestErrorCode,
    StreamClosed,
    StreamResetCode,
)
from ..wire import (
    DEFAULT_PUBLISHER_PRIORITY,
    AuthToken,
    Location,
    ObjectStatus,
    Properties,
    TrackNamespace,
    TrackPropertyType,
    namespace_of,
    property_value,
)
from .core import ConnectionCore

__all__ = [
    "FetchSender",
    "IncomingUpdate",
    "NamespacePublisher",
    "NamespaceRegistration",
    "OutgoingSubscription",
    "SubgroupSender",
]


def _smaller_timeout(*values: int | None) -> int | None:
    """The smaller of the non-zero timeouts given (0 or None: no timeout)."""
    set_values = [v for v in values if v]
    return min(set_values) if set_values else None


def _ended_code(error: MoqtError | None) -> int:
    """The code a handle's `cancelled` / `closed` resolves with when its request ends
    on this side (RequestHandle.end()): SESSION_CLOSED, or CANCELLED without an error."""
    return StreamResetCode.CANCELLED if error is None else StreamResetCode.SESSION_CLOSED


class SubgroupSender:
    """Writes the objects of one subgroup stream, waiting on backpressure.

    Delivery timeouts (draft-18 "Delivery Timeouts") of its subscription apply: an object
    whose first byte is older than OBJECT_DELIVERY_TIMEOUT when it would be handed
    to QUIC resets the stream with DELIVERY_TIMEOUT instead, and the subgroup sends
    nothing more (`timed_out`); after `close()`, a stream not fully acknowledged
    within SUBGROUP_DELIVERY_TIMEOUT is reset the same way.
    """

    def __init__(self, connection: ConnectionCore, stream_id: int, subscription: "OutgoingSubscription | None" = None):
        self.connection = connection
        self.stream_id = stream_id
        self.subscription = subscription
        self.timed_out = False
        self.group_id = 0

    def _deadline(self, received_at: float | None) -> float | None:
        timeout = self.subscription.object_delivery_timeout if self.subscription is not None else None
        if not timeout:
            return None
        start = self.connection.loop.time() if received_at is None else received_at
        return start + timeout / 1000

    def _expire(self) -> None:
        if self.timed_out:
            return
        self.timed_out = True
        if self.subscription is not None:
            self.subscription.objects_timed_out += 1
        self.reset(StreamResetCode.DELIVERY_TIMEOUT)

    async def send(
        self,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        properties: Properties = (),
        received_at: float | None = None,
    ) -> bool:
        """Send a Normal object; returns once aioquic holds all of it.

        `received_at` is the event-loop time the object's first byte arrived (a
        relay's upstream); by default, now. While the subscription's Forward State is 0
        the object is held back (draft-18 "Subscriptions": no objects are sent then).
        Returns False, having reset the stream, when the object outlived the
        OBJECT_DELIVERY_TIMEOUT (or the stream already timed out).
        """
        if self.timed_out:
            return False
        connection = self.connection
        deadline = self._deadline(received_at)
        subscription = self.subscription
        if subscription is not None and not subscription.forward:
            await subscription.wait_forward()
        if not await connection.wait_writable_until(self.stream_id, deadline):
            self._expire()
            return False
        session = connection.live_session()
        session.begin_object(self.stream_id, object_id, len(payload), properties=properties)
        if not await connection.write_payload(self.stream_id, payload, deadline=deadline):
            self._expire()
            return False
        if self.subscription is not None:
            self.subscription._sent(Location(self.group_id, object_id))
        return True

    async def send_status(self, object_id: int, status: ObjectStatus) -> None:
        if self.timed_out:
            return
        connection = self.connection
        if self.subscription is not None and not self.subscription.forward:
            await self.subscription.wait_forward()
        await connection.wait_writable(self.stream_id)
        connection.live_session().write_object_status(self.stream_id, object_id, status)
        connection.transmit_soon()

    def close(self) -> None:
        """FIN the stream: the subgroup is complete."""
        session = self.connection.session
        if session is not None and not session.closed and not self.timed_out:
            session.close_data_stream(self.stream_id)
            self.connection.transmit_soon()
            timeout = self.subscription.subgroup_delivery_timeout if self.subscription is not None else None
            if timeout:
                self.connection.loop.call_later(timeout / 1000, self._subgroup_deadline)

    def _subgroup_deadline(self) -> None:
        """SUBGROUP_DELIVERY_TIMEOUT after the FIN: reset a stream QUIC has not fully delivered."""
        if self.connection.expire_stream(self.stream_id) and self.subscription is not None:
            self.timed_out = True
            self.subscription.objects_timed_out += 1

    def reset(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        session = self.connection.session
        if session is not None and not session.closed:
            session.reset_data_stream(self.stream_id, error_code)
            self.connection.transmit_soon()


class OutgoingSubscription:
    """A subscription this endpoint publishes (an accepted SUBSCRIBE, or our PUBLISH)."""

    def __init__(self, connection: ConnectionCore, request_id: int, track_alias: int):
        self.connection = connection
        self.request_id = request_id
        self.track_alias = track_alias
        #: the subscriber's parameters (SUBSCRIBE or PUBLISH_OK), with accepted updates
        self.parameters = Parameters()
        #: the Track Properties this endpoint sent for the track
        self.track_properties: Properties = ()
        #: the largest Location sent or announced, for REQUEST_UPDATE_OK
        self.largest: Location | None = None
        #: objects and subgroups given up on a delivery timeout
        self.objects_timed_out = 0
        #: answers the subscriber's REQUEST_UPDATEs; without it they are checked and accepted
        self.on_update: Callable[["IncomingUpdate"], Any] | None = None
        self.cancelled: asyncio.Future[int] = connection.loop.create_future()
        self._done = False
        self._forward_waiters: list[asyncio.Future[None]] = []
        self.cancelled.add_done_callback(lambda _: self._wake_forward())
        # SUBSCRIBE_OK went out now; the joining FETCHes of it being answered (see finish())
        self._accepted_at = connection.loop.time()
        self._joining: set[asyncio.Future[Any]] = set()
        self._joined: asyncio.Future[None] = connection.loop.create_future()
        connection.register(self)

    @property
    def active(self) -> bool:
        return not self._done and not self.cancelled.done()

    @property
    def forward(self) -> bool:
        """The Forward State: objects are sent only while it is 1 (draft-18 "Subscriptions")."""
        return self.parameters.forward is not False

    async def wait_forward(self) -> None:
        """Wait until the Forward State is 1, since no object may be sent before; raises
        StreamClosed when the subscription ends first."""
        while not self.forward:
            if self.connection.error is not None:
                raise self.connection.error
            if not self.active:
                raise StreamClosed("the subscription ended while its Forward State was 0")
            waiter: asyncio.Future[None] = self.connection.loop.create_future()
            self._forward_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._forward_waiters:
                    self._forward_waiters.remove(waiter)

    def _wake_forward(self) -> None:
        waiters, self._forward_waiters = self._forward_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def object_delivery_timeout(self) -> int | None:
        """OBJECT_DELIVERY_TIMEOUT in force, ms: the smaller non-zero of the
        subscriber's parameter and our Track Property (draft-18 "Delivery Timeouts")."""
        return _smaller_timeout(
            self.parameters.object_delivery_timeout,
            property_value(self.track_properties, TrackPropertyType.OBJECT_DELIVERY_TIMEOUT),
        )

    @property
    def subgroup_delivery_timeout(self) -> int | None:
        """SUBGROUP_DELIVERY_TIMEOUT in force, ms (as object_delivery_timeout)."""
        return _smaller_timeout(
            self.parameters.subgroup_delivery_timeout,
            property_value(self.track_properties, TrackPropertyType.SUBGROUP_DELIVERY_TIMEOUT),
        )

    def _sent(self, location: Location) -> None:
        if self.largest is None or location > self.largest:
            self.largest = location

    def check_update(self, parameters: Parameters) -> None:
        """Refuse an update this publisher cannot satisfy: a filter whose End Group
        was already published (INVALID_RANGE, draft-18 "Subscription Filters")."""
        subscription_filter = parameters.subscription_filter
        if subscription_filter is None or subscription_filter.end_group is None or self.largest is None:
            return
        if subscription_filter.end_group < self.largest.group:
            raise InvalidRange("the filter's end group has already been published")

    def _apply_update(self, parameters: Parameters) -> None:
        self.parameters = self.parameters.merged(parameters)
        if self.forward:
            self._wake_forward()

    def _update_failed(self) -> None:
        """A refused update ended the subscription with PUBLISH_DONE UPDATE_FAILED."""
        self._done = True
        self.connection.forget(self.request_id)
        if not self.cancelled.done():
            self.cancelled.set_result(PublishDoneCode.UPDATE_FAILED)
        self._wake_forward()
        self.connection.wake_writers()

    def open_subgroup(
        self,
        group_id: int,
        subgroup_id: int = 0,
        *,
        publisher_priority: int | None = DEFAULT_PUBLISHER_PRIORITY,
        end_of_group: bool = False,
        has_properties: bool = False,
        first_object: bool = True,
    ) -> SubgroupSender:
        connection = self.connection
        if self.cancelled.done():
            raise StreamClosed("subscription cancelled by the subscriber")
        stream_id = connection.live_session().open_subgroup(
            self.request_id,
            group_id,
            subgroup_id,
            publisher_priority=publisher_priority,
            end_of_group=end_of_group,
            has_properties=has_properties,
            first_object=first_object,
        )
        connection.start_writing(stream_id)
        connection.transmit_soon()
        sender = SubgroupSender(connection, stream_id, self)
        sender.group_id = group_id
        return sender

    def send_datagram(
        self, group_id: int, object_id: int, payload: bytes, *, received_at: float | None = None, **kwargs: Any
    ) -> bool:
        """Send an object as a datagram; False when it was dropped: it outlived a delivery
        timeout (for datagrams, the smaller of both applies), or the Forward State is 0."""
        if not self.forward:
            return False
        timeout = _smaller_timeout(self.object_delivery_timeout, self.subgroup_delivery_timeout)
        if timeout and received_at is not None and self.connection.loop.time() - received_at > timeout / 1000:
            self.objects_timed_out += 1
            return False
        self.connection.live_session().send_datagram(self.request_id, group_id, object_id, payload, **kwargs)
        self._sent(Location(group_id, object_id))
        self.connection.transmit_soon()
        return True

    def joined_by(self, answer: asyncio.Future[Any]) -> None:
        """A joining FETCH of this subscription is being answered; `answer` is done when
        its response is written (or refused)."""
        self._joining.add(answer)
        answer.add_done_callback(self._joining.discard)
        if not self._joined.done():
            self._joined.set_result(None)

    async def finish(self, status_code: int = PublishDoneCode.TRACK_ENDED, reason: str = "") -> None:
        """Send PUBLISH_DONE (after closing the open subgroup streams, and after the
        joining FETCHes of the subscription are answered: see QuicSettings.joining_fetch_wait)."""
        if self._done or self.cancelled.done():
            return
        self._done = True
        self._wake_forward()
        if status_code in (PublishDoneCode.TRACK_ENDED, PublishDoneCode.SUBSCRIPTION_ENDED):
            await self._let_joining_fetches_through()
            if self.cancelled.done():
                return
        self.connection.forget(self.request_id)
        session = self.connection.session
        if session is not None and not session.closed:
            try:
                session.publish_done(self.request_id, status_code, reason)
            except StreamClosed:
                pass
            self.connection.transmit_soon()

    async def _let_joining_fetches_through(self) -> None:
        """Wait, before a normal PUBLISH_DONE, for the joining FETCHes a subscriber may send
        on receipt of SUBSCRIBE_OK: its end would otherwise overtake them (a track that
        ended before any object was sent on the subscription), or refuse them outright."""
        connection = self.connection
        session = connection.session
        if session is None or session.closed or not session.joins_by_fetch:
            return
        loop, settings = connection.loop, connection.settings
        window = self._accepted_at + settings.joining_fetch_wait - loop.time()
        try:
            sent_nothing = session.stream_count(self.request_id) == 0
        except StreamClosed:
            return  # the request is gone already: PUBLISH_DONE cannot follow anything
        if not self._joining and window > 0 and sent_nothing:
            first: set[asyncio.Future[Any]] = {self.cancelled, self._joined}
            await asyncio.wait(first, timeout=window, return_when=asyncio.FIRST_COMPLETED)
        deadline = loop.time() + settings.publish_done_grace
        while self._joining and not self.cancelled.done() and loop.time() < deadline:
            pending: set[asyncio.Future[Any]] = {self.cancelled, *self._joining}
            await asyncio.wait(pending, timeout=deadline - loop.time(),
                               return_when=asyncio.FIRST_COMPLETED)

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this subscription (RequestHandle): the subscriber's cancellation."""
        if isinstance(event, ev.RequestCancelled):
            self._on_cancelled(event.error_code)

    def end(self, error: MoqtError | None) -> None:
        """The subscription is over (RequestHandle): `cancelled` resolves (see _ended_code())."""
        self._on_cancelled(_ended_code(error))

    def _on_cancelled(self, error_code: int) -> None:
        if not self.cancelled.done():
            self.cancelled.set_result(error_code)
        self.connection.forget(self.request_id)
        self.connection.wake_writers()


class FetchSender:
    """Writes the objects of one FETCH response stream."""

    def __init__(self, connection: ConnectionCore, request_id: int, stream_id: int):
        self.connection = connection
        self.request_id = request_id
        self.stream_id = stream_id
        self.cancelled: asyncio.Future[int] = connection.loop.create_future()
        connection.register(self)

    async def send(
        self,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> None:
        if self.send_now(group_id, object_id, payload, subgroup_id=subgroup_id,
                         publisher_priority=publisher_priority, properties=properties):
            return
        connection = self.connection
        session = connection.live_session()
        await connection.wait_writable(self.stream_id)
        session.begin_fetch_object(
            self.stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        await connection.write_payload(self.stream_id, payload)

    def send_now(
        self,
        group_id: int,
        object_id: int,
        payload: bytes | bytearray | memoryview,
        *,
        subgroup_id: int | None = 0,
        publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY,
        properties: Properties = (),
    ) -> bool:
        """Write the object if that needs no wait: True with it written when the stream
        is writable now and the payload fits one write chunk; False, with nothing
        written, when it must wait (send() tries this first, then waits)."""
        connection = self.connection
        session = connection.live_session()
        stream_id = self.stream_id
        if len(payload) > connection.settings.write_chunk_size or not connection.writable(stream_id):
            return False
        if session.data_stream_request(stream_id) is None:
            raise StreamClosed(f"data stream {stream_id} is closed")
        session.begin_fetch_object(
            stream_id,
            group_id,
            object_id,
            len(payload),
            subgroup_id=subgroup_id,
            publisher_priority=publisher_priority,
            properties=properties,
        )
        if payload:
            session.write_payload(stream_id, payload)
        connection.transmit_soon()
        return True

    async def end_of_range(self, group_id: int, object_id: int, *, unknown: bool = False) -> None:
        connection = self.connection
        await connection.wait_writable(self.stream_id)
        connection.live_session().write_fetch_end_of_range(self.stream_id, group_id, object_id, unknown=unknown)
        connection.transmit_soon()

    def close(self) -> None:
        """FIN the stream: every object of the range was sent."""
        self._forget()
        session = self.connection.session
        if session is not None and not session.closed:
            session.close_data_stream(self.stream_id)
            self.connection.transmit_soon()

    def reset(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        self._forget()
        session = self.connection.session
        if session is not None and not session.closed:
            session.reset_data_stream(self.stream_id, error_code)
            self.connection.transmit_soon()

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this FETCH (RequestHandle): the subscriber's cancellation."""
        if isinstance(event, ev.RequestCancelled):
            self._forget()
            if not self.cancelled.done():
                self.cancelled.set_result(event.error_code)
                self.connection.wake_writers()

    def end(self, error: MoqtError | None) -> None:
        """The FETCH is over (RequestHandle): `cancelled` resolves (see _ended_code())."""
        self._forget()
        if not self.cancelled.done():
            self.cancelled.set_result(_ended_code(error))

    def _forget(self) -> None:
        # Done writing: nothing can cancel or update it any more. A session that serves
        # FETCHes for days would otherwise keep one sender per FETCH it ever answered.
        if self.connection.request_handle(self.request_id) is self:
            self.connection.forget(self.request_id)


class NamespaceRegistration:
    """A peer's accepted PUBLISH_NAMESPACE; `closed` resolves when it is withdrawn."""

    def __init__(self, connection: ConnectionCore, request_id: int, namespace: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.closed: asyncio.Future[int] = connection.loop.create_future()
        connection.register(self)

    def revoke(self, error_code: int = StreamResetCode.CANCELLED) -> None:
        """Revoke the acceptance (cancel the peer's request)."""
        self._on_cancelled(error_code)
        session = self.connection.session
        if session is not None and not session.closed:
            session.cancel_request(self.request_id, error_code)
            self.connection.transmit_soon()

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this request (RequestHandle): the peer's cancellation closes it."""
        if isinstance(event, ev.RequestCancelled):
            self._on_cancelled(event.error_code)

    def end(self, error: MoqtError | None) -> None:
        """The request is over (RequestHandle): `closed` resolves (see _ended_code())."""
        self._on_cancelled(_ended_code(error))

    def _on_cancelled(self, error_code: int) -> None:
        if not self.closed.done():
            self.closed.set_result(error_code)
        self.connection.forget(self.request_id)


class NamespacePublisher:
    """The answer side of a peer's accepted SUBSCRIBE_NAMESPACE or SUBSCRIBE_TRACKS."""

    def __init__(self, connection: ConnectionCore, request_id: int, prefix: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.prefix = prefix
        self.closed: asyncio.Future[int] = connection.loop.create_future()
        connection.register(self)

    def announce(self, namespace: TrackNamespace) -> None:
        """Send NAMESPACE for a full namespace under the prefix."""
        self.connection.live_session().namespace(self.request_id, self._suffix(namespace))
        self.connection.transmit_soon()

    def withdraw(self, namespace: TrackNamespace) -> None:
        self.connection.live_session().namespace_done(self.request_id, self._suffix(namespace))
        self.connection.transmit_soon()

    def publish_blocked(self, namespace: TrackNamespace, track_name: bytes | str) -> None:
        """PUBLISH_BLOCKED (SUBSCRIBE_TRACKS): this track will not be PUBLISHed here; the
        subscriber may SUBSCRIBE to it instead."""
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        self.connection.live_session().publish_blocked(self.request_id, self._suffix(namespace), name)
        self.connection.transmit_soon()

    def _suffix(self, namespace: TrackNamespace) -> TrackNamespace:
        namespace = namespace_of(namespace)
        if namespace[: len(self.prefix)] != self.prefix:
            raise ValueError(f"{namespace} is not under {self.prefix}")
        return namespace[len(self.prefix) :]

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this request (RequestHandle): the peer's cancellation closes it."""
        if isinstance(event, ev.RequestCancelled):
            self._on_cancelled(event.error_code)

    def end(self, error: MoqtError | None) -> None:
        """The request is over (RequestHandle): `closed` resolves (see _ended_code())."""
        self._on_cancelled(_ended_code(error))

    def _on_cancelled(self, error_code: int) -> None:
        if not self.closed.done():
            self.closed.set_result(error_code)
        self.connection.forget(self.request_id)


class IncomingUpdate:
    """A REQUEST_UPDATE from the peer (draft-18 "REQUEST_UPDATE"): answer it exactly once.

    `target` is what it updates: an OutgoingSubscription (a subscription we
    publish), a Subscription (a PUBLISH the peer sent us), a FetchSender, a
    NamespaceRegistration or a NamespacePublisher. Refusing an update of a
    subscription we publish ends it with PUBLISH_DONE UPDATE_FAILED; of a FETCH,
    resets its stream; of a namespace request, closes it.
    """

    def __init__(self, connection: ConnectionCore, event: ev.RequestUpdateReceived, target: Any):
        self.connection = connection
        self.request_id = event.request_id
        self.existing_request_id = event.existing_request_id
        self.parameters: Parameters = event.parameters
        self.authorization_tokens: tuple[AuthToken, ...] = event.authorization_tokens
        self.target = target
        self.answered = False

    @property
    def authorization(self) -> list[bytes]:
        """The token values sent with the update."""
        return [t.value or b"" for t in self.authorization_tokens]

    def accept(self, *, largest: Location | tuple[int, int] | None = None, expires: int | None = None) -> None:
        """Send REQUEST_UPDATE_OK and apply the update; `largest` defaults to the
        largest Location a subscription we publish has sent."""
        if self.answered:
            raise ValueError(f"REQUEST_UPDATE {self.request_id} was already answered")
        self.answered = True
        session = self.connection.live_session()
        if largest is None and isinstance(self.target, OutgoingSubscription):
            largest = self.target.largest
        parameters = Parameters(largest_object=None if largest is None else Location(*largest), expires=expires)
        try:
            session.request_ok(self.request_id, parameters)
        except StreamClosed:
            return
        apply = getattr(self.target, "_apply_update", None)
        if apply is not None:
            apply(self.parameters)
        self.connection.transmit_soon()

    def reject(self, error: RequestError | int = RequestErrorCode.INTERNAL_ERROR, reason: str = "") -> None:
        if self.answered:
            return
        self.answered = True
        if isinstance(error, RequestError):
            code, reason = int(error.error_code), reason or error.reason
        else:
            code = int(error)
        session = self.connection.session
        if session is None or session.closed:
            return
        target = self.target
        if isinstance(target, FetchSender):
            target.reset(StreamResetCode.CANCELLED)
        try:
            session.request_error(self.request_id, code, reason)
        except StreamClosed:
            pass
        if isinstance(target, OutgoingSubscription):
            target._update_failed()
        elif isinstance(target, (NamespaceRegistration, NamespacePublisher)):
            target._on_cancelled(StreamResetCode.CANCELLED)
        elif isinstance(target, FetchSender) and not target.cancelled.done():
            target.cancelled.set_result(StreamResetCode.CANCELLED)
        self.connection.transmit_soon()
