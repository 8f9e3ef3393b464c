"""MoqtConnection: one MOQT session over one QUIC connection, with an asyncio API.

It drives a `MoqtSession` (draft-18, ALPN ``moqt-18``) or `MoqtSession14` (draft-14,
``moq-00``), chosen when ALPN is negotiated, turns the peer's requests into those of
incoming.py, delivers each event of a live request to its handle (the table of
ConnectionCore), and offers the requests of both roles:
`subscribe()`, `fetch()`, `track_status()`, `subscribe_namespace()`,
`subscribe_tracks()` to read; `publish_namespace()`, `publish()` and handlers for the
peer's requests (`on_subscribe()`, `on_fetch()`, ...) to publish.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping

from ...tasks import TaskSet
from .. import events as ev
from ..d14.session import MoqtSession14
from ..d18.messages import Parameters, Setup
from ..d18.session import MoqtSession
from ..drafts import alpn_of, check_drafts, draft_of_alpn, session_class
from ..engine import (
    ConnectionTerminated,
    EngineConnection,
    ProtocolNegotiated,
    QuicEvent,
)
from ..errors import (
    InternalRequestError,
    KvspError,
    NotSupported,
    RequestError,
    RequestErrorCode,
    SessionCloseCode,
    SessionClosed,
    StreamClosed,
    as_request_error,
    request_error_for,
)
from ..wire import (
    GroupOrder,
    Location,
    Properties,
    SubscriptionFilter,
    TrackNamespace,
    namespace_of,
)
from .core import ConnectionCore, token_parameters
from .incoming import (
    HANDLER_KINDS,
    INCOMING,
    IncomingFetch,
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingSubscribeNamespace,
    IncomingSubscribeTracks,
    IncomingTrackStatus,
)
from .publisher import IncomingUpdate, OutgoingSubscription
from .settings import QuicSettings
from .subscriber import (
    FetchResponse,
    NamespaceSubscription,
    PublishedNamespace,
    S,
    Subscription,
    TrackStatusInfo,
)
from .track_subscriptions import TrackSubscriptions

if TYPE_CHECKING:
    from ..session.base import SessionBase

__all__ = ["Handler", "MoqtConnection"]

logger = logging.getLogger("kvsp_moq.moqt.quic")

Handler = Callable[[Any], "Awaitable[None] | None"]

#: events addressed to one request of ours or the peer's: its handle takes them
_ADDRESSED = frozenset({
    ev.ObjectReceived,
    ev.FetchObjectReceived,
    ev.SubgroupStreamOpened,
    ev.DataStreamEnded,
    ev.PublishDoneReceived,
    ev.PublishBlockedReceived,
    ev.NamespaceReceived,
    ev.NamespaceDoneReceived,
    ev.FetchRangeReceived,
})
_ANSWERS = frozenset({ev.SubscribeAccepted, ev.FetchAccepted, ev.RequestAccepted, ev.RequestRejected})


class MoqtConnection(ConnectionCore):
    """One MOQT session over one QUIC connection, with an asyncio API.

    Handlers (`on_subscribe()`, `on_fetch()`, ...) receive an `Incoming...` request
    and must answer it (accept or reject); a handler may be a coroutine function and
    run as long as it needs. A request with no handler is rejected (DOES_NOT_EXIST
    for track requests, UNINTERESTED / NOT_SUPPORTED for the others); a handler
    that raises a RequestError rejects with its code, any other exception with
    INTERNAL_ERROR, and returning without an answer also rejects.
    """

    def __init__(
        self,
        quic: EngineConnection,
        *,
        settings: QuicSettings | None = None,
        setup: Setup | None = None,
        handlers: Mapping[str, Handler] | None = None,
        accept_path: Iterable[str] | None = None,
        max_auth_token_cache_size: int = 0,
        on_session: Callable[["MoqtConnection"], None] | None = None,
        drafts: Iterable[int] | None = None,
        owns_transport: bool = False,
    ) -> None:
        super().__init__(quic, settings or QuicSettings())
        self.is_client = quic.is_client
        #: the drafts this endpoint accepts, most preferred first
        if drafts is None:
            drafts = self.settings.default_drafts(is_client=self.is_client)
        self.drafts = check_drafts(drafts)
        #: the negotiated draft once ALPN is negotiated (until then the preferred one)
        self.draft = self.drafts[0]
        self._setup = setup
        self._accept_path = accept_path
        self._max_auth_token_cache_size = max_auth_token_cache_size
        self._on_session = on_session
        self._handlers: dict[str, Handler] = dict(handlers or {})
        self._tasks = TaskSet()
        self.owns_transport = owns_transport
        self.goaway: ev.GoawayReceived | None = None
        self.on_goaway: Callable[[ev.GoawayReceived], None] | None = None

    @property
    def engine(self) -> str:
        """The QUIC engine's name ("aioquic", "qh3")."""
        return self._quic.name  # type: ignore[attr-defined]  # both adapters set it; EngineConnection omits it

    # -- handlers -----------------------------------------------------------

    def set_handler(self, kind: str, handler: Handler | None) -> None:
        """Set the handler of one request kind: one of HANDLER_KINDS."""
        if kind not in HANDLER_KINDS:
            raise ValueError(f"unknown request kind {kind!r}")
        if handler is None:
            self._handlers.pop(kind, None)
        else:
            self._handlers[kind] = handler

    def on_subscribe(self, handler: Callable[[IncomingSubscribe], Any]) -> None:
        self.set_handler("subscribe", handler)

    def on_fetch(self, handler: Callable[[IncomingFetch], Any]) -> None:
        self.set_handler("fetch", handler)

    def on_track_status(self, handler: Callable[[IncomingTrackStatus], Any]) -> None:
        self.set_handler("track_status", handler)

    def on_publish_namespace(self, handler: Callable[[IncomingPublishNamespace], Any]) -> None:
        self.set_handler("publish_namespace", handler)

    def on_subscribe_namespace(self, handler: Callable[[IncomingSubscribeNamespace], Any]) -> None:
        self.set_handler("subscribe_namespace", handler)

    def on_subscribe_tracks(self, handler: Callable[[IncomingSubscribeTracks], Any]) -> None:
        self.set_handler("subscribe_tracks", handler)

    def on_publish(self, handler: Callable[[IncomingPublish], Any]) -> None:
        self.set_handler("publish", handler)

    # -- state --------------------------------------------------------------

    @property
    def peer_setup(self) -> Setup | None:
        return None if self.session is None else self.session.peer_setup

    @property
    def is_closed(self) -> bool:
        return self.error is not None

    async def wait_ready(self, timeout: float | None = None) -> Setup:
        """Wait for the peer's SETUP."""
        return await asyncio.wait_for(asyncio.shield(self._ready), timeout)

    # -- QUIC events ----------------------------------------------------------

    def quic_event_received(self, event: QuicEvent) -> None:
        if self.session is None:
            if isinstance(event, ProtocolNegotiated):
                self.session = self._new_session(event.alpn_protocol)
                if self.session is None:
                    return
                if self._on_session is not None:
                    self._on_session(self)
            elif isinstance(event, ConnectionTerminated):
                self.fail_all(SessionClosed(event.reason_phrase or "connection closed", error_code=event.error_code))
            return
        for moqt_event in self.session.handle_event(event):
            try:
                self.on_moqt_event(moqt_event)
            except Exception:  # a bug in a callback must not break the connection
                logger.exception("error handling %s", type(moqt_event).__name__)

    def _new_session(self, alpn: str | None) -> MoqtSession | MoqtSession14 | None:
        """The session of the negotiated ALPN, or None after closing the connection
        when it is none of the drafts offered."""
        draft = draft_of_alpn(alpn, self.drafts)
        if draft is None:
            expected = ", ".join(repr(alpn_of(d)) for d in self.drafts)
            self._quic.close(
                error_code=SessionCloseCode.VERSION_NEGOTIATION_FAILED,
                reason_phrase=f"ALPN {alpn!r}, expected one of {expected}",
            )
            return None
        self.draft = draft
        # The base class's constructor takes no defaults; each draft's session gives them.
        factory: Callable[..., SessionBase] = session_class(draft)
        session = factory(
            self._quic,
            is_client=self.is_client,
            draft=draft,
            setup=self._setup,
            max_object_size=self.settings.max_object_size,
            max_auth_token_cache_size=self._max_auth_token_cache_size,
            accept_path=self._accept_path,
        )
        assert isinstance(session, (MoqtSession, MoqtSession14))
        return session

    def datagram_received(self, data: bytes, addr: Any) -> None:
        super().datagram_received(data, addr)
        if self._drain_waiters:
            self.wake_writers()

    def datagrams_received(self, datagrams: list[bytes], addr: Any) -> None:
        super().datagrams_received(datagrams, addr)
        if self._drain_waiters:
            self.wake_writers()

    def _handle_timer(self) -> None:
        super()._handle_timer()
        if self._drain_waiters:
            self.wake_writers()

    def on_moqt_event(self, event: ev.MoqtEvent) -> None:
        kind = type(event)
        if kind in _ADDRESSED:
            request_id: int | None = event.request_id  # type: ignore[attr-defined]  # every kind of _ADDRESSED has one
            handle = None if request_id is None else self.request_handle(request_id)
            if handle is not None:
                handle.deliver(event)
        elif kind in INCOMING:
            self._dispatch_request(event)
        elif kind in _ANSWERS:
            self._on_answer(event)
        # `type(event) is X` (not isinstance): events have no subclasses, and this narrows too.
        elif type(event) is ev.RequestCancelled:
            self._on_cancelled(event)
        elif type(event) is ev.RequestUpdateReceived:
            self._on_update(event)
        elif type(event) is ev.SetupCompleted:
            if not self._ready.done():
                self._ready.set_result(event.setup)
        elif type(event) is ev.SessionTerminated:
            self.fail_all(SessionClosed(event.reason or "session closed", error_code=event.error_code))
        elif type(event) is ev.DataStreamStopped:
            self.writing.discard(event.stream_id)
            self.wake_writers()
        elif type(event) is ev.GoawayReceived:
            if event.request_id is None:
                self.goaway = event
            if self.on_goaway is not None:
                self.on_goaway(event)

    def _on_answer(self, event: Any) -> None:
        """The answer to a request of ours: the first resolves its awaited future; a
        later one (a rejection after acceptance: a fetch that failed late) goes to
        the request's handle."""
        rid = event.request_id
        future = self.take_pending(rid)
        if future is not None:
            if not future.done():
                if isinstance(event, ev.RequestRejected):
                    future.set_exception(
                        request_error_for(
                            event.error_code, event.reason, retry_interval=event.retry_interval, redirect=event.redirect
                        )
                    )
                else:
                    future.set_result(event)
            return
        handle = self.request_handle(rid)
        if handle is not None:
            handle.deliver(event)

    def _on_cancelled(self, event: ev.RequestCancelled) -> None:
        rid = event.request_id
        if event.local_request:
            future = self.take_pending(rid)
            if future is not None and not future.done():
                future.set_exception(request_error_for(RequestErrorCode.INTERNAL_ERROR, "cancelled by the peer"))
        handle = self.request_handle(rid)
        if handle is not None:
            handle.deliver(event)

    def _on_update(self, event: ev.RequestUpdateReceived) -> None:
        if self.hold_update(event):  # answered after the request
            return
        target = self.request_handle(event.existing_request_id)
        update = IncomingUpdate(self, event, target)
        handler = getattr(target, "on_update", None)
        if handler is None:
            self._default_update(update)
            return
        self._tasks.spawn(self._run_update_handler(handler, update), loop=self._loop)

    def release_updates(self, request_id: int) -> None:
        for event in self.take_held_updates(request_id):
            self._on_update(event)

    def _default_update(self, update: IncomingUpdate) -> None:
        """Without a handler: refuse what cannot be honoured, accept the rest."""
        target = update.target
        try:
            if isinstance(target, OutgoingSubscription):
                target.check_update(update.parameters)
            if update.parameters.track_namespace_prefix is not None:
                raise NotSupported("changing the namespace prefix is not supported")
        except RequestError as exc:
            update.reject(exc)
            return
        except (SessionClosed, StreamClosed):
            return
        try:
            update.accept()
        except (SessionClosed, StreamClosed):
            pass

    async def _run_update_handler(self, handler: Callable[[IncomingUpdate], Any], update: IncomingUpdate) -> None:
        await self._handle(handler, update, "update handler", lambda: self._default_update(update))

    def _dispatch_request(self, event: Any) -> None:
        kind, cls = INCOMING[type(event)]
        request = cls(self, event)
        if isinstance(request, IncomingPublish):
            for handle in self.request_handles():
                if isinstance(handle, TrackSubscriptions) and handle.offer(request):
                    return
        handler = self._handlers.get(kind)
        if handler is None:
            request.reject(request.default_error(f"no {kind} handler"))
            return
        self.await_handler(request.request_id)
        task = self._tasks.spawn(self._run_handler(handler, request), loop=self._loop)
        if isinstance(request, IncomingFetch) and request.joining_request_id is not None:
            joined = self.request_handle(request.joining_request_id)
            if isinstance(joined, OutgoingSubscription):
                joined.joined_by(task)  # its PUBLISH_DONE waits for this answer

    async def _run_handler(self, handler: Handler, request: IncomingRequest) -> None:
        try:
            await self._handle(handler, request)
        finally:
            if not request.answered:
                self.settle(request.request_id, accepted=False)

    async def _handle(self, handler: Callable[[Any], Any], request: "IncomingRequest | IncomingUpdate",
                      what: str = "handler", unanswered: Callable[[], None] | None = None) -> None:
        """Run an application handler; whatever it leaves unanswered gets an answer here
        (`unanswered`, or a refusal), and its failures become refusals, never a hung request."""
        try:
            result = handler(request)
            if inspect.isawaitable(result):
                await result
        except RequestError as exc:
            request.reject(exc)
        except (SessionClosed, StreamClosed):
            pass
        except KvspError as exc:  # a condition of ours: answered with its own code
            request.reject(as_request_error(exc))
        except asyncio.CancelledError:
            request.reject(InternalRequestError(f"{what} cancelled"))
            raise
        except Exception:
            logger.exception("%s failed", what)
            request.reject(InternalRequestError(f"{what} failed"))
        else:
            if not request.answered:
                if unanswered is not None:
                    unanswered()
                else:
                    request.reject(InternalRequestError("request not answered"))


    # -- subscriber API -------------------------------------------------------


    async def subscribe(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        subscription_filter: SubscriptionFilter | None = None,
        forward: bool | None = None,
        subscriber_priority: int | None = None,
        group_order: GroupOrder | None = None,
        authorization: Any = None,
        rendezvous_timeout: int | None = None,
        object_delivery_timeout: int | None = None,
        subgroup_delivery_timeout: int | None = None,
        new_group_request: int | None = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> Subscription:
        """SUBSCRIBE and wait for SUBSCRIBE_OK; raises the RequestError of a REQUEST_ERROR.

        The delivery timeouts (ms) let the publisher give up on objects that would
        arrive too late for this subscriber (draft-18 "Delivery Timeouts")."""
        session = self.live_session()
        namespace = namespace_of(namespace)
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=token_parameters(authorization),
                subscription_filter=subscription_filter,
                forward=forward,
                subscriber_priority=subscriber_priority,
                group_order=group_order,
                rendezvous_timeout=rendezvous_timeout,
                object_delivery_timeout=object_delivery_timeout,
                subgroup_delivery_timeout=subgroup_delivery_timeout,
                new_group_request=new_group_request,
            )
        request_id = session.subscribe(namespace, name, parameters)
        subscription = Subscription(self, request_id, namespace, name)
        subscription.parameters = parameters
        future = self.begin_request(request_id)
        try:
            accepted = await self.await_answer(request_id, future, timeout)
        except BaseException:
            subscription.end(None)
            raise
        subscription.deliver(accepted)
        return subscription

    async def fetch(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        start: Location | tuple[int, int],
        end: Location | tuple[int, int],
        *,
        whole_end_group: bool = False,
        subscriber_priority: int | None = None,
        group_order: GroupOrder | None = None,
        authorization: Any = None,
        parameters: Parameters | None = None,
        timeout: float | None = None,
    ) -> FetchResponse:
        """Standalone FETCH of `start` through `end`, both inclusive (or through the
        whole end group); waits for FETCH_OK and returns the object iterator."""
        session = self.live_session()
        namespace = namespace_of(namespace)
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        end = Location(*end)
        wire_end = Location(end.group, 0) if whole_end_group else Location(end.group, end.object + 1)
        if parameters is None:
            parameters = Parameters(
                authorization_tokens=token_parameters(authorization),
                subscriber_priority=subscriber_priority,
                group_order=group_order,
            )
        request_id = session.fetch(namespace, name, Location(*start), wire_end, parameters)
        return await self._start_fetch(request_id, timeout)

    async def joining_fetch(
        self,
        subscription: Subscription,
        joining_start: int = 0,
        *,
        absolute: bool = False,
        subscriber_priority: int | None = None,
        timeout: float | None = None,
    ) -> FetchResponse:
        """Joining FETCH: `joining_start` groups before the subscription's Joining
        Location (or from that absolute group)."""
        session = self.live_session()
        parameters = Parameters(subscriber_priority=subscriber_priority)
        request_id = session.joining_fetch(
            subscription.request_id, joining_start, relative=not absolute, parameters=parameters
        )
        return await self._start_fetch(request_id, timeout)

    async def _start_fetch(self, request_id: int, timeout: float | None) -> FetchResponse:
        fetch = FetchResponse(self, request_id)
        future = self.begin_request(request_id)
        try:
            accepted = await self.await_answer(request_id, future, timeout)
        except BaseException:
            fetch.end(None)
            fetch.close()  # objects that came before the refusal return their credit
            raise
        fetch.deliver(accepted)
        return fetch

    async def track_status(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        authorization: Any = None,
        timeout: float | None = None,
    ) -> TrackStatusInfo:
        session = self.live_session()
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        parameters = Parameters(authorization_tokens=token_parameters(authorization))
        request_id = session.track_status(namespace_of(namespace), name, parameters)
        accepted = await self.await_answer(request_id, self.begin_request(request_id), timeout)
        return TrackStatusInfo(
            accepted.parameters.largest_object, accepted.track_properties, accepted.parameters.expires
        )

    async def subscribe_namespace(
        self, prefix: TrackNamespace | Iterable[bytes | str], *, authorization: Any = None, timeout: float | None = None
    ) -> NamespaceSubscription:
        """SUBSCRIBE_NAMESPACE and wait for REQUEST_OK; iterate the result for NAMESPACE and
        NAMESPACE_DONE."""
        return await self._prefix_request(NamespaceSubscription, prefix, authorization, timeout)

    async def subscribe_tracks(
        self, prefix: TrackNamespace | Iterable[bytes | str], *, authorization: Any = None, timeout: float | None = None
    ) -> TrackSubscriptions:
        """SUBSCRIBE_TRACKS and wait for REQUEST_OK: the peer PUBLISHes every track under
        `prefix`, those it has and those that come later (draft-18 only)."""
        return await self._prefix_request(TrackSubscriptions, prefix, authorization, timeout)

    async def _prefix_request(self, kind: type[S], prefix: TrackNamespace | Iterable[bytes | str],
                              authorization: Any, timeout: float | None) -> S:
        session = self.live_session()
        prefix = namespace_of(prefix)
        parameters = Parameters(authorization_tokens=token_parameters(authorization))
        send = session.subscribe_tracks if kind is TrackSubscriptions else session.subscribe_namespace
        request_id = send(prefix, parameters)
        subscription = kind(self, request_id, prefix)
        try:
            await self.await_answer(request_id, self.begin_request(request_id), timeout)
        except BaseException:
            subscription.end(None)
            raise
        return subscription

    # -- publisher API --------------------------------------------------------

    async def publish_namespace(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        *,
        authorization: Any = None,
        timeout: float | None = None,
    ) -> PublishedNamespace:
        """PUBLISH_NAMESPACE and wait for REQUEST_OK; raises RequestError on refusal."""
        session = self.live_session()
        namespace = namespace_of(namespace)
        parameters = Parameters(authorization_tokens=token_parameters(authorization))
        request_id = session.publish_namespace(namespace, parameters)
        announcement = PublishedNamespace(self, request_id, namespace)
        try:
            await self.await_answer(request_id, self.begin_request(request_id), timeout)
        except BaseException:
            announcement.end(None)
            raise
        return announcement

    async def publish(
        self,
        namespace: TrackNamespace | Iterable[bytes | str],
        track_name: bytes | str,
        *,
        largest: Location | tuple[int, int] | None = None,
        forward: bool | None = None,
        track_properties: Properties = (),
        authorization: Any = None,
        timeout: float | None = None,
    ) -> OutgoingSubscription:
        """PUBLISH a track and wait for PUBLISH_OK; returns the subscription to send on."""
        session = self.live_session()
        name = track_name.encode() if isinstance(track_name, str) else bytes(track_name)
        parameters = Parameters(
            authorization_tokens=token_parameters(authorization),
            largest_object=None if largest is None else Location(*largest),
            forward=forward,
        )
        request_id = session.publish(
            namespace_of(namespace), name, parameters=parameters, track_properties=track_properties
        )
        alias = session.track_alias_of(request_id)
        assert alias is not None  # publish() gave the request its alias
        outgoing = OutgoingSubscription(self, request_id, alias)
        outgoing.track_properties = track_properties
        outgoing.largest = parameters.largest_object
        try:
            accepted = await self.await_answer(request_id, self.begin_request(request_id), timeout)
        except BaseException:
            outgoing.end(None)
            raise
        outgoing.parameters = accepted.parameters
        return outgoing

    # -- session --------------------------------------------------------------

    def send_goaway(self, new_session_uri: str = "", timeout_ms: int = 0) -> None:
        self.live_session().goaway(new_session_uri, timeout_ms)
        self.transmit_soon()

    def close(self, error_code: int = SessionCloseCode.NO_ERROR, reason_phrase: str = "") -> None:
        """Close the session and the QUIC connection."""
        if self.session is not None:
            self.session.close(error_code, reason_phrase)
        else:
            self._quic.close(error_code=error_code, reason_phrase=reason_phrase)
        self.fail_all(SessionClosed(reason_phrase or "closed locally", error_code=error_code))
        self.transmit()

    async def aclose(self, timeout: float = 2.0) -> None:
        """Close and wait for the connection to end (and close our socket)."""
        self.close()
        try:
            await asyncio.wait_for(self.wait_closed(), timeout)
        except asyncio.TimeoutError:
            pass
        self.cancel_tasks()
        if self.owns_transport and self._transport is not None:
            self._transport.close()

    def cancel_tasks(self) -> None:
        """Cancel the handlers still running for this connection."""
        self._tasks.cancel()

    async def __aenter__(self) -> "MoqtConnection":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


