"""The connection as the handle classes of this package see it: `ConnectionCore`.

Subscriptions, fetches, senders and incoming requests (subscriber.py, publisher.py,
incoming.py) are handles on one connection. They need its session, its tables of live
requests, transmission and backpressure: that is this class, and all they use. The
MOQT API and the dispatch of events (connection.py) build on it, so no handle module
imports the connection, and none imports another in a cycle.

Backpressure, both ways:

* writers wait until the engine holds less than `QuicSettings.stream_send_buffer` for
  their stream (and `connection_send_buffer` for the connection) before writing more,
  and write large payloads in `write_chunk_size` pieces, so a slow peer bounds what a
  publisher holds;
* objects handed to the application hold their bytes (`hold()`) until consumed
  (`consumed()`); the engine grants credit only then (`credit_on_consumption`: per
  stream on aioquic, per connection on qh3), so a subscriber that reads slowly slows
  its publisher through QUIC flow control and nothing grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Iterable

from ..d14.session import MoqtSession14
from ..d18.messages import Setup
from ..d18.session import MoqtSession
from ..engine import EngineConnection
from ..errors import MoqtError, SessionClosed, StreamClosed, StreamResetCode
from ..wire import AuthToken
from .protocol import QuicProtocol
from .settings import QuicSettings

if TYPE_CHECKING:  # annotations only: the handle modules import this one
    from .. import events as ev
    from .publisher import (
        FetchSender,
        NamespacePublisher,
        NamespaceRegistration,
        OutgoingSubscription,
    )
    from .subscriber import (
        FetchResponse,
        NamespaceSubscription,
        PublishedNamespace,
        Subscription,
    )

__all__ = ["ConnectionCore", "token_parameters"]

logger = logging.getLogger("kvsp_moq.moqt.quic")


class ConnectionCore(QuicProtocol):
    """One QUIC connection's MOQT state shared with its handles (tables by Request ID,
    the session, transmission, backpressure); the public API is MoqtConnection's."""

    def __init__(self, quic: EngineConnection, settings: QuicSettings) -> None:
        super().__init__(quic)
        self.settings = settings
        self.session: MoqtSession | MoqtSession14 | None = None
        #: the error that ended the session, None while it lives
        self.error: MoqtError | None = None
        self._ready: asyncio.Future[Setup] = self._loop.create_future()
        #: answers awaited, by Request ID
        self.pending: dict[int, asyncio.Future[Any]] = {}
        # handles of live requests, by Request ID
        self.subscriptions: dict[int, Subscription] = {}
        self.fetches: dict[int, FetchResponse] = {}
        self.namespace_subscriptions: dict[int, NamespaceSubscription] = {}
        self.announcements: dict[int, PublishedNamespace] = {}
        self.outgoing: dict[int, OutgoingSubscription] = {}
        self.fetch_senders: dict[int, FetchSender] = {}
        self.registrations: dict[int, NamespaceRegistration | NamespacePublisher] = {}
        #: peer requests a handler has not answered yet, and REQUEST_UPDATEs held for them
        self.unanswered: set[int] = set()
        self.held_updates: dict[int, list[ev.RequestUpdateReceived]] = {}
        #: data streams we write on (their buffered bytes count against the connection)
        self.writing: set[int] = set()
        self._drain_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: whether the UDP socket is this connection's alone (a client's), not a server's
        self.owns_transport = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def on_moqt_event(self, event: ev.MoqtEvent) -> None:
        """Handle one MOQT event (MoqtConnection)."""
        raise NotImplementedError

    def release_updates(self, request_id: int) -> None:
        """Handle the REQUEST_UPDATEs held while a request was unanswered (MoqtConnection)."""
        raise NotImplementedError

    def hold(self, stream_id: int, size: int) -> None:
        """`size` bytes of a stream were handed to the application (see `consumed()`)."""
        self._quic.hold(stream_id, size)

    def live_session(self) -> MoqtSession | MoqtSession14:
        if self.error is not None:
            raise self.error
        if self.session is None:
            raise SessionClosed("session not established")
        return self.session

    def dispatch_released(self) -> None:
        """Handle the events the session produced outside handle_event() (a joining
        FETCH released by SUBSCRIBE_OK; on draft-14, the local acceptance of a
        SUBSCRIBE_UPDATE, which has no answer on the wire)."""
        session = self.session
        if session is None:
            return
        for moqt_event in session.take_events():
            try:
                self.on_moqt_event(moqt_event)
            except Exception:  # a bug in a callback must not break the connection
                logger.exception("error handling %s", type(moqt_event).__name__)

    def fail_all(self, error: MoqtError) -> None:
        if self.error is not None:
            return
        self.error = error
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved: not every caller waits for it
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.pending.clear()
        for subscription in list(self.subscriptions.values()):
            subscription._finish(error)
        for fetch in list(self.fetches.values()):
            fetch._finish(error)
        for namespaces in list(self.namespace_subscriptions.values()):
            namespaces._finish(error)
        for announcement in self.announcements.values():
            if not announcement.closed.done():
                announcement.closed.set_result(StreamResetCode.SESSION_CLOSED)
        for outgoing in list(self.outgoing.values()):
            outgoing._on_cancelled(StreamResetCode.SESSION_CLOSED)
        for sender in self.fetch_senders.values():
            if not sender.cancelled.done():
                sender.cancelled.set_result(StreamResetCode.SESSION_CLOSED)
        for registration in list(self.registrations.values()):
            registration._on_cancelled(StreamResetCode.SESSION_CLOSED)
        for _, waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()

    # -- backpressure ---------------------------------------------------------

    def buffered(self, stream_id: int) -> int:
        """Bytes the engine holds for a stream of ours, counted against its writer."""
        return self._quic.buffered(stream_id)

    def buffered_total(self) -> int:
        total = 0
        for stream_id in list(self.writing):
            size = self.buffered(stream_id)
            if size == 0 and self.session is not None and self.session.data_stream_request(stream_id) is None:
                self.writing.discard(stream_id)
            total += size
        return total

    def writable(self, stream_id: int, factor: float = 1.0) -> bool:
        settings = self.settings
        return (
            self.buffered(stream_id) < settings.stream_send_buffer * factor
            and self.buffered_total() < settings.connection_send_buffer * factor
        )

    async def wait_writable(self, stream_id: int) -> None:
        while True:
            session = self.live_session()
            if session.data_stream_request(stream_id) is None:
                raise StreamClosed(f"data stream {stream_id} is closed")
            if self.writable(stream_id):
                return
            waiter = self._loop.create_future()
            self._drain_waiters.append((stream_id, waiter))
            await waiter

    async def wait_writable_until(self, stream_id: int, deadline: float | None) -> bool:
        """wait_writable(), giving up (False) at `deadline`, event-loop time: a delivery
        timeout ends the wait of a writer that a blocked subscriber would hold forever."""
        if deadline is None:
            await self.wait_writable(stream_id)
            return True
        remaining = deadline - self._loop.time()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self.wait_writable(stream_id), remaining)
        except asyncio.TimeoutError:
            return False
        return self._loop.time() <= deadline

    def wake_writers(self) -> None:
        waiters = self._drain_waiters
        if not waiters:
            return
        keep = []
        for stream_id, waiter in waiters:
            if waiter.done():
                continue
            session = self.session
            if session is None or session.data_stream_request(stream_id) is None or self.writable(stream_id, 0.5):
                waiter.set_result(None)
            else:
                keep.append((stream_id, waiter))
        self._drain_waiters = keep

    async def write_payload(
        self, stream_id: int, payload: bytes | bytearray | memoryview, *, deadline: float | None = None
    ) -> bool:
        """Write an object's payload in pieces as the stream drains; False (with the
        object unfinished) when `deadline` passes before a piece is handed to QUIC."""
        session = self.live_session()
        view = payload if isinstance(payload, memoryview) else memoryview(payload)
        size = len(view)
        chunk = self.settings.write_chunk_size
        if size <= chunk:
            if size:
                session.write_payload(stream_id, view)
            self.transmit_soon()
            return True
        offset = 0
        while offset < size:
            if offset:
                if not await self.wait_writable_until(stream_id, deadline):
                    return False
                session = self.live_session()
            session.write_payload(stream_id, view[offset : offset + chunk])
            offset += chunk
            self.transmit()
        return True

    def expire_stream(self, stream_id: int) -> bool:
        """Reset a data stream QUIC has not fully delivered (its FIN may be sent) with
        DELIVERY_TIMEOUT; False when everything was already acknowledged."""
        if self.error is not None or self._quic.delivered(stream_id):
            return False
        session = self.session
        if session is not None:
            session.reset_data_stream(stream_id, StreamResetCode.DELIVERY_TIMEOUT)
        try:
            self._quic.reset_stream(stream_id, StreamResetCode.DELIVERY_TIMEOUT)
        except Exception:  # the engine refuses: the stream is already gone
            return False
        self.transmit_soon()
        return True

    def consumed(self, stream_id: int, size: int) -> None:
        """Held bytes were consumed: return their credit."""
        if self._quic.release(stream_id, size) and self.error is None:
            self.process_soon()

    def begin_request(self, request_id: int) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        self.pending[request_id] = future
        self.transmit_soon()
        return future

    async def await_answer(self, request_id: int, future: asyncio.Future[Any], timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self.pending.pop(request_id, None)
            session = self.session
            if session is not None and not session.closed:
                session.cancel_request(request_id)
                self.transmit_soon()
            raise


def token_parameters(authorization: bytes | str | AuthToken | Iterable[Any] | None) -> tuple[AuthToken, ...]:
    """AUTHORIZATION_TOKEN parameters for what a caller passes as `authorization`:
    token values (bytes or str), AuthTokens, or an iterable of either."""
    if authorization is None:
        return ()
    tokens: Iterable[Any] = [authorization] if isinstance(authorization, (bytes, str, AuthToken)) else authorization
    return tuple(t if isinstance(t, AuthToken) else AuthToken.use_value(t) for t in tokens)
