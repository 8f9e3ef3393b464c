"""The subscriber side: what this endpoint receives, as async iterators.

`Subscription` (our SUBSCRIBE, or a PUBLISH we accepted) and `FetchResponse` (our FETCH)
yield `MoqtObject`s; `NamespaceSubscription` yields the peer's NAMESPACE /
NAMESPACE_DONE (`TrackSubscriptions`, in track_subscriptions.py, its PUBLISHes);
`PublishedNamespace` is our accepted PUBLISH_NAMESPACE. Each is a `RequestHandle`: it
registers with its connection when made, takes the events of its request through
`deliver()`, and forgets itself when done. Objects hold their flow-control bytes until
the application takes them, so a slow reader slows its publisher instead of filling memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, TypeVar

from .. import events as ev
from ..d18.messages import Parameters
from ..errors import (
    DataStreamReset,
    MoqtError,
    PublishDoneCode,
    PublishDoneError,
    RequestError,
    SessionClosed,
    StreamClosed,
    StreamResetCode,
    request_error_for,
)
from ..objects import MoqtObject, SubgroupEnd
from ..session.records import UNKNOWN_STREAM_COUNT
from ..wire import (
    Location,
    ObjectStatus,
    Properties,
    SubscriptionFilter,
    TrackNamespace,
)
from .core import ConnectionCore, token_parameters

__all__ = [
    "BlockedTrack",
    "FetchResponse",
    "NamespaceSubscription",
    "NamespaceUpdate",
    "PublishedNamespace",
    "Subscription",
    "TrackStatusInfo",
]

_END = object()


def _expire_waiter(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class _ObjectQueue:
    """Objects waiting for the application, with the flow-control bytes they hold."""

    def __init__(self, connection: ConnectionCore) -> None:
        self._connection = connection
        self._items: deque[tuple[MoqtObject, int | None, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._ended = False

    def push(self, obj: MoqtObject, stream_id: int | None) -> None:
        held = 0
        if stream_id is not None:
            held = len(obj.payload)
            if held:
                self._connection.hold(stream_id, held)
        self._items.append((obj, stream_id, held))
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        if self._ended or self._error is not None:
            return
        if error is not None:
            self._error = error
        else:
            self._ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: float | None = None) -> MoqtObject:
        """The next object; TimeoutError when none arrives within `timeout` seconds.

        The timeout is a timer on the waiter, armed only while waiting (asyncio.wait_for
        would start a task for every object)."""
        deadline: float | None = None
        while True:
            obj = self.pop_ready()
            if obj is not None:
                return obj
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            loop = self._connection.loop
            self._waiter = waiter = loop.create_future()
            timer = None
            if timeout is not None:
                if deadline is None:
                    deadline = loop.time() + timeout
                timer = loop.call_at(deadline, _expire_waiter, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def pop_ready(self) -> MoqtObject | None:
        """The next object when one is queued already, else None; never waits (an
        error or the end is left for get() to report)."""
        if not self._items:
            return None
        obj, stream_id, held = self._items.popleft()
        if held and stream_id is not None:  # only stream objects hold bytes
            self._connection.consumed(stream_id, held)
        return obj

    def discard(self) -> None:
        """Drop queued objects, returning their flow-control credit."""
        while self._items:
            _, stream_id, held = self._items.popleft()
            if held and stream_id is not None:
                self._connection.consumed(stream_id, held)


class Subscription:
    """A subscription this endpoint receives: iterate it for objects.

    Made by `MoqtConnection.subscribe()` (our SUBSCRIBE) or
    `IncomingPublish.accept()` (the peer's PUBLISH). Iteration ends after
    PUBLISH_DONE once the publisher's streams have ended; it raises
    PublishDoneError for an abnormal PUBLISH_DONE status or a cancellation by the
    publisher, DataStreamReset when a stream was reset, and SessionClosed when the
    connection is lost.
    """

    def __init__(self, connection: ConnectionCore, request_id: int, namespace: TrackNamespace, track_name: bytes):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.track_name = track_name
        self.track_alias: int | None = None
        self.largest: Location | None = None
        self.expires: int | None = None
        self.track_properties: Properties = ()
        #: the subscription's parameters as the subscriber set them, with accepted updates
        self.parameters = Parameters()
        #: subgroup streams the publisher reset because their objects outlived a delivery timeout
        self.streams_timed_out = 0
        #: also yield a `SubgroupEnd` after the last object of each subgroup stream the
        #: publisher finished (a relay ends its own stream of the subgroup there); they are
        #: queued either way, so setting this after subscribe() returns misses none
        self.subgroup_ends = False
        self._subgroups: dict[int, tuple[int, int, bool]] = {}  # stream -> its subgroup
        self.done: ev.PublishDoneReceived | None = None
        self._queue = _ObjectQueue(connection)
        self._streams_ended = 0
        self._open_streams: set[int] = set()
        self._grace: asyncio.TimerHandle | None = None
        self._grace_over = False
        self._finished = False
        connection.register(self)

    def __aiter__(self) -> AsyncIterator[MoqtObject]:
        return self

    async def __anext__(self) -> MoqtObject:
        """The next object (or, with `subgroup_ends`, a `SubgroupEnd`)."""
        item = await self.next_object()
        if item is None:
            raise StopAsyncIteration
        return item

    async def next_object(self, timeout: float | None = None) -> MoqtObject | None:
        """The next object (or, with `subgroup_ends`, a `SubgroupEnd`), None at the end of
        the subscription; TimeoutError when none arrives within `timeout` seconds (the
        subscription goes on). Cheaper than asyncio.timeout around __anext__: a timer is
        armed only while nothing is queued, not for every object."""
        loop = self.connection.loop
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            try:
                item = await self._queue.get(None if deadline is None else max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return None
            if self.subgroup_ends or not isinstance(item, SubgroupEnd):
                return item

    async def unsubscribe(self) -> None:
        """Cancel the subscription (STOP_SENDING / reset of its request stream)."""
        self._finish(None, cancel=True)

    async def update(
        self,
        *,
        subscription_filter: SubscriptionFilter | None = None,
        forward: bool | None = None,
        subscriber_priority: int | None = None,
        object_delivery_timeout: int | None = None,
        subgroup_delivery_timeout: int | None = None,
        new_group_request: int | None = None,
        authorization: Any = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> Parameters:
        """REQUEST_UPDATE the subscription (draft-18 "Updating Subscriptions") and wait for the answer.

        Only what is given changes. Returns the REQUEST_UPDATE_OK parameters (its
        LARGEST_OBJECT tells what a widened filter may have missed, for a FETCH). A
        refused update raises its RequestError; the publisher then ends the
        subscription with PUBLISH_DONE UPDATE_FAILED, which ends iteration. On a
        draft-14 session the update (SUBSCRIBE_UPDATE) has no answer: this returns
        empty parameters at once, and a refusal shows only as that PUBLISH_DONE.
        """
        connection = self.connection
        if self._finished:
            raise StreamClosed(f"subscription {self.request_id} has ended")
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=token_parameters(authorization),
                subscription_filter=subscription_filter,
                forward=forward,
                subscriber_priority=subscriber_priority,
                object_delivery_timeout=object_delivery_timeout,
                subgroup_delivery_timeout=subgroup_delivery_timeout,
                new_group_request=new_group_request,
            )
        session = connection.live_session()
        update_id = session.request_update(self.request_id, parameters)
        future = connection.begin_request(update_id)
        # draft-14's SUBSCRIBE_UPDATE has no answer: its session accepts it at once.
        connection.dispatch_released()
        try:
            accepted = await asyncio.wait_for(future, timeout)
        finally:
            connection.take_pending(update_id)
        self.parameters = self.parameters.merged(parameters)
        if accepted.parameters.largest_object is not None:
            self.largest = accepted.parameters.largest_object
        if accepted.parameters.expires is not None:
            self.expires = accepted.parameters.expires
        return accepted.parameters

    async def aclose(self) -> None:
        """Stop iterating: cancel the subscription if it is live and return the
        flow-control credit of objects never consumed. Use it (or
        contextlib.aclosing) when leaving an `async for` early."""
        if self._finished:
            self._queue.discard()
        else:
            self._finish(None, cancel=True)

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this subscription (RequestHandle)."""
        if isinstance(event, ev.ObjectReceived):
            self._object(event)
        elif isinstance(event, ev.SubgroupStreamOpened):
            self._stream_opened(event.stream_id)
        elif isinstance(event, ev.DataStreamEnded):
            if not event.fetch:
                self._stream_ended(event)
        elif isinstance(event, ev.PublishDoneReceived):
            self._publish_done(event)
        elif isinstance(event, ev.SubscribeAccepted):
            self._accepted(event)
        elif isinstance(event, ev.RequestRejected):  # after the acceptance
            self._finish(request_error_for(event.error_code, event.reason, retry_interval=event.retry_interval))
        elif isinstance(event, ev.RequestCancelled):
            # our SUBSCRIBE cancelled by its publisher, or the peer's PUBLISH ended without PUBLISH_DONE
            reason = "subscription cancelled by the publisher" if event.local_request else "publication cancelled"
            self._finish(PublishDoneError(reason, error_code=event.error_code))

    def end(self, error: MoqtError | None) -> None:
        """The subscription is over (RequestHandle): objects queued are still yielded,
        then `error` is raised (None: iteration ends)."""
        self._finish(error)

    def _accepted(self, event: ev.SubscribeAccepted) -> None:
        self.track_alias = event.track_alias
        self.largest = event.parameters.largest_object
        self.expires = event.parameters.expires
        self.track_properties = event.track_properties

    def _object(self, event: ev.ObjectReceived) -> None:
        if self._finished:
            return
        if event.stream_id is not None and event.subgroup_id is not None:
            self._subgroups[event.stream_id] = (event.group_id, event.subgroup_id, event.end_of_group)
        self._queue.push(
            MoqtObject(
                event.group_id,
                event.object_id,
                event.payload,
                event.subgroup_id,
                event.status,
                event.properties,
                event.publisher_priority,
                end_of_group=event.end_of_group,
            ),
            event.stream_id,
        )

    def _stream_opened(self, stream_id: int) -> None:
        self._open_streams.add(stream_id)

    def _stream_ended(self, event: ev.DataStreamEnded) -> None:
        if event.stream_id in self._open_streams:  # not already counted as stopped
            self._open_streams.discard(event.stream_id)
            self._streams_ended += 1
        subgroup = self._subgroups.pop(event.stream_id, None)
        if subgroup is not None and not event.reset and not self._finished:
            # It rides the object queue; __anext__ yields it only when `subgroup_ends` is set.
            self._queue.push(SubgroupEnd(*subgroup), None)  # type: ignore[arg-type]  # not a MoqtObject
        if event.reset and event.error_code == StreamResetCode.DELIVERY_TIMEOUT:
            # Objects that outlived a delivery timeout are dropped, the
            # subscription goes on.
            self.streams_timed_out += 1
            self._check_complete()
            return
        if event.reset and not self._finished:
            self._finish(DataStreamReset(f"stream {event.stream_id} reset", error_code=event.error_code or 0))
            return
        self._check_complete()

    def _publish_done(self, event: ev.PublishDoneReceived) -> None:
        self.done = event
        if not self._check_complete():
            loop = self.connection.loop
            self._grace = loop.call_later(self.connection.settings.publish_done_grace, self._grace_expired)

    def _check_complete(self) -> bool:
        done = self.done
        session = self.connection.session
        if session is not None and self._open_streams:
            # Streams this endpoint stopped count as ended.
            stopped = {sid for sid in self._open_streams if not session.incoming_stream_open(sid)}
            self._open_streams -= stopped
            self._streams_ended += len(stopped)
        if done is None or self._finished or self._open_streams:
            return False
        # With an unknown Stream Count, late streams are awaited for the grace period; after
        # it, the streams still open are (draft 18 "PUBLISH_DONE": state is destroyed "once
        # all open streams for the subscription have closed", not when the timer fires).
        if not self._grace_over and (done.stream_count == UNKNOWN_STREAM_COUNT
                                     or self._streams_ended < done.stream_count):
            return False
        self._complete()
        if self._grace_over:
            session = self.connection.session
            if session is not None:  # always set once a subscription exists
                session.release(self.request_id)
        return True

    def _grace_expired(self) -> None:
        """Streams that never opened are given up; those still open end first (an object
        in flight on one is not cut off because PUBLISH_DONE arrived on the control stream
        before its last octets)."""
        self._grace = None
        self._grace_over = True
        self._check_complete()

    def _complete(self) -> None:
        done = self.done
        assert done is not None
        if done.status_code in (PublishDoneCode.TRACK_ENDED, PublishDoneCode.SUBSCRIPTION_ENDED):
            self._finish(None)
        else:
            self._finish(PublishDoneError(done.reason or "subscription ended", error_code=done.status_code))

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if self._finished:
            return
        self._finished = True
        connection = self.connection
        connection.forget(self.request_id)
        if cancel:
            self._queue.discard()
        # Objects already queued are still delivered, then the error is raised.
        if cancel or isinstance(error, (DataStreamReset, RequestError)):
            if connection.session is not None and not connection.session.closed:
                connection.session.cancel_request(self.request_id)
                connection.transmit_soon()
        self._queue.end(error)


class FetchResponse:
    """The response to one FETCH of ours: FETCH_OK's fields, and the objects of its fetch
    stream: iterate it.

    Iteration ends when the publisher's fetch stream ends with a FIN; it raises
    DataStreamReset for a reset stream, the RequestError of a REQUEST_ERROR that
    arrives after FETCH_OK, and SessionClosed when the connection is lost.
    `ranges` collects the End of Range markers received.
    """

    def __init__(self, connection: ConnectionCore, request_id: int):
        self.connection = connection
        self.request_id = request_id
        self.end_of_track = False
        self.end_location: Location | None = None
        self.track_properties: Properties = ()
        self.ranges: list[ev.FetchRangeReceived] = []
        self._queue = _ObjectQueue(connection)
        self._accepted = False
        self._stream_done = False
        self._finished = False
        connection.register(self)

    def __aiter__(self) -> AsyncIterator[MoqtObject]:
        return self

    async def __anext__(self) -> MoqtObject:
        return await self._queue.get()

    def ready_object(self) -> MoqtObject | None:
        """The next object when it has arrived already, else None, without waiting:
        a reader drains what one datagram brought in one go, then awaits the rest."""
        return self._queue.pop_ready()

    async def next_object(self, timeout: float | None = None) -> MoqtObject | None:
        """The next object, None at the end of the response; TimeoutError when none
        arrives within `timeout` seconds (the response goes on: cancel it if unwanted)."""
        try:
            return await self._queue.get(timeout)
        except StopAsyncIteration:
            return None

    async def cancel(self) -> None:
        self._finish(None, cancel=True)

    async def aclose(self) -> None:
        """Stop iterating; see Subscription.aclose()."""
        self.close()

    def close(self) -> None:
        """aclose() for callers that cannot await (a callback): it never waits."""
        if self._finished:
            self._queue.discard()
        else:
            self._finish(None, cancel=True)

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this fetch (RequestHandle)."""
        if isinstance(event, ev.FetchObjectReceived):
            self._object(event)
        elif isinstance(event, ev.DataStreamEnded):
            if event.fetch:
                self._stream_ended(event)
        elif isinstance(event, ev.FetchRangeReceived):
            self.ranges.append(event)
        elif isinstance(event, ev.FetchAccepted):
            self._on_accepted(event)
        elif isinstance(event, ev.RequestRejected):  # after FETCH_OK: a fetch that failed late
            self._finish(request_error_for(event.error_code, event.reason, retry_interval=event.retry_interval))
        elif isinstance(event, ev.RequestCancelled):
            self._finish(SessionClosed(f"request {self.request_id} cancelled by the peer", error_code=event.error_code))

    def end(self, error: MoqtError | None) -> None:
        """The fetch is over (RequestHandle): objects queued are still yielded, then
        `error` is raised (None: iteration ends)."""
        self._finish(error)

    def _on_accepted(self, event: ev.FetchAccepted) -> None:
        self._accepted = True
        self.end_of_track = event.end_of_track
        self.end_location = event.end_location
        self.track_properties = event.track_properties
        if self._stream_done:
            self._finish(None)

    def _object(self, event: ev.FetchObjectReceived) -> None:
        if self._finished:
            return
        self._queue.push(
            MoqtObject(
                event.group_id,
                event.object_id,
                event.payload,
                event.subgroup_id,
                ObjectStatus.NORMAL,
                event.properties,
                event.publisher_priority,
            ),
            event.stream_id,
        )

    def _stream_ended(self, event: ev.DataStreamEnded) -> None:
        if event.reset:
            self._finish(DataStreamReset(f"fetch stream {event.stream_id} reset", error_code=event.error_code or 0))
            return
        self._stream_done = True
        if self._accepted:
            self._finish(None)

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._finished:
            return
        self._finished = True
        connection = self.connection
        connection.forget(self.request_id)
        if cancel:
            self._queue.discard()
        if cancel or isinstance(error, (DataStreamReset, RequestError)):
            if connection.session is not None and not connection.session.closed:
                connection.session.cancel_request(self.request_id)
                connection.transmit_soon()
        self._queue.end(error)


@dataclass(frozen=True)
class TrackStatusInfo:
    """TRACK_STATUS_OK: the track's Largest Object (None: nothing published yet)."""

    largest: Location | None
    track_properties: Properties
    expires: int | None = None


@dataclass(frozen=True)
class NamespaceUpdate:
    """A NAMESPACE (active) or NAMESPACE_DONE (not active) for a full namespace."""

    namespace: TrackNamespace
    active: bool


class NamespaceSubscription:
    """Our SUBSCRIBE_NAMESPACE: iterate it for NamespaceUpdate items."""

    def __init__(self, connection: ConnectionCore, request_id: int, prefix: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.prefix = prefix
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._finished = False
        connection.register(self)

    def __aiter__(self) -> AsyncIterator[NamespaceUpdate]:
        return self

    async def __anext__(self) -> NamespaceUpdate:
        item = await self._items.get()
        if item is _END:
            self._items.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._items.put_nowait(item)
            raise item
        return item

    async def cancel(self) -> None:
        self._finish(None, cancel=True)

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this namespace subscription (RequestHandle)."""
        if isinstance(event, (ev.NamespaceReceived, ev.NamespaceDoneReceived)):
            self._items.put_nowait(NamespaceUpdate(event.namespace, isinstance(event, ev.NamespaceReceived)))
        elif isinstance(event, ev.PublishBlockedReceived):
            self._items.put_nowait(BlockedTrack(event.namespace, event.track_name))
        elif isinstance(event, ev.RequestCancelled):
            self._finish(None)

    def end(self, error: MoqtError | None) -> None:
        """The subscription is over (RequestHandle): iteration raises `error` (None: ends)."""
        self._finish(error)

    def _finish(self, error: BaseException | None, *, cancel: bool = False) -> None:
        if self._finished:
            return
        self._finished = True
        self.connection.forget(self.request_id)
        if cancel and self.connection.session is not None and not self.connection.session.closed:
            self.connection.session.cancel_request(self.request_id)
            self.connection.transmit_soon()
        self._items.put_nowait(error if error is not None else _END)


@dataclass(frozen=True)
class BlockedTrack:
    """A PUBLISH_BLOCKED notice: the peer will not PUBLISH this track to our SUBSCRIBE_TRACKS."""

    namespace: TrackNamespace
    track_name: bytes


#: a kind of namespace subscription (MoqtConnection makes either)
S = TypeVar("S", bound=NamespaceSubscription)


class PublishedNamespace:
    """Our accepted PUBLISH_NAMESPACE; `withdraw()` cancels it."""

    def __init__(self, connection: ConnectionCore, request_id: int, namespace: TrackNamespace):
        self.connection = connection
        self.request_id = request_id
        self.namespace = namespace
        self.closed: asyncio.Future[int] = connection.loop.create_future()
        connection.register(self)

    async def withdraw(self) -> None:
        self._close(StreamResetCode.CANCELLED)
        session = self.connection.session
        if session is not None and not session.closed:
            session.cancel_request(self.request_id)
            self.connection.transmit_soon()

    def deliver(self, event: ev.MoqtEvent) -> None:
        """An event of this request (RequestHandle): the peer's cancellation closes it."""
        if isinstance(event, ev.RequestCancelled):
            self._close(event.error_code)

    def end(self, error: MoqtError | None) -> None:
        """The request is over (RequestHandle): `closed` resolves with SESSION_CLOSED
        (CANCELLED without an error)."""
        self._close(StreamResetCode.CANCELLED if error is None else StreamResetCode.SESSION_CLOSED)

    def _close(self, code: int) -> None:
        if not self.closed.done():
            self.closed.set_result(code)
        self.connection.forget(self.request_id)
