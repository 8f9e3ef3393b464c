"""The connection as the handle classes of this package see it: `ConnectionCore`.

Subscriptions, fetches, senders and incoming requests (subscriber.py, publisher.py,
incoming.py) are handles on one connection. They need its session, its table of live
requests, transmission and backpressure: that is this class, and all they use. The
MOQT API and the dispatch of events (connection.py) build on it, so no handle module
imports the connection, and none imports another in a cycle.

The table holds every live request's handle by Request ID, seen only through the
`RequestHandle` protocol (handles.py): handles register and forget themselves through
`register()` and `forget()`, the only writers of the table; the connection delivers
each event addressed to a request to its handle, and `fail_all()` ends them all.

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
from typing import Any, Iterable

from .. import events as ev
from ..d14.session import MoqtSession14
from ..d18.messages import Setup
from ..d18.session import MoqtSession
from ..engine import EngineConnection
from ..errors import MoqtError, SessionClosed, StreamClosed, StreamResetCode
from ..wire import AuthToken
from .handles import RequestHandle
from .protocol import QuicProtocol
from .settings import QuicSettings

__all__ = ["ConnectionCore", "token_parameters"]

logger = logging.getLogger("kvsp_moq.moqt.quic")


class ConnectionCore(QuicProtocol):
    """One QUIC connection's MOQT state shared with its handles (the table of live
    requests, the session, transmission, backpressure); the public API is MoqtConnection's."""

    def __init__(self, quic: EngineConnection, settings: QuicSettings) -> None:
        super().__init__(quic)
        self.settings = settings
        self.session: MoqtSession | MoqtSession14 | None = None
        #: the error that ended the session, None while it lives
        self.error: MoqtError | None = None
        self._ready: asyncio.Future[Setup] = self._loop.create_future()
        # answers awaited, by Request ID (begin_request(), take_pending())
        self._pending: dict[int, asyncio.Future[Any]] = {}
        # the handles of live requests of both directions, by Request ID (register(), forget())
        self._request_table: dict[int, RequestHandle] = {}
        # peer requests a handler has not answered yet, and REQUEST_UPDATEs held for them
        self._unanswered: set[int] = set()
        self._held_updates: dict[int, list[ev.RequestUpdateReceived]] = {}
        #: data streams we write on (their buffered bytes count against the connection)
        self.writing: set[int] = set()
        # What they hold, as last read (`_total_bound`), and the streams written since.
        self._sizes: dict[int, int] = {}
        self._total = 0
        self._written: set[int] = set()
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

    # -- the table of live requests ---------------------------------------------

    def register(self, handle: RequestHandle) -> None:
        """Address the events of a request to its handle until it is forgotten."""
        request_id = handle.request_id
        assert self._request_table.get(request_id, handle) is handle, f"request {request_id} has a handle already"
        self._request_table[request_id] = handle

    def forget(self, request_id: int) -> None:
        """Events of the request are no longer delivered (its handle is done with them)."""
        self._request_table.pop(request_id, None)

    def request_handle(self, request_id: int) -> RequestHandle | None:
        """The handle of a live request, None when it has none (or no longer)."""
        return self._request_table.get(request_id)

    def request_handles(self) -> list[RequestHandle]:
        """The handles of the live requests, oldest first (a copy: handles may forget
        themselves while the caller walks it)."""
        return list(self._request_table.values())

    # -- peer requests awaiting the application ---------------------------------

    def await_handler(self, request_id: int) -> None:
        """A handler was given a peer request: REQUEST_UPDATEs for it wait for its answer."""
        self._unanswered.add(request_id)

    def hold_update(self, event: ev.RequestUpdateReceived) -> bool:
        """Keep an update of a request not yet answered (True) for after its answer."""
        request_id = event.existing_request_id
        if request_id not in self._unanswered:
            return False
        self._held_updates.setdefault(request_id, []).append(event)
        return True

    def settle(self, request_id: int, *, accepted: bool) -> None:
        """A peer request was answered (or given up): the updates held for it follow
        an acceptance, and are dropped with a refusal."""
        self._unanswered.discard(request_id)
        if not accepted:
            self._held_updates.pop(request_id, None)
        elif request_id in self._held_updates:
            self._loop.call_soon(self.release_updates, request_id)

    def take_held_updates(self, request_id: int) -> list[ev.RequestUpdateReceived]:
        return self._held_updates.pop(request_id, [])

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
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for handle in self.request_handles():
            handle.end(error)
        for _, waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._drain_waiters.clear()

    # -- backpressure ---------------------------------------------------------

    def buffered(self, stream_id: int) -> int:
        """Bytes the engine holds for a stream of ours, counted against its writer."""
        return self._quic.buffered(stream_id)

    def start_writing(self, stream_id: int) -> None:
        """A data stream of ours was opened (its header written): it counts from now on."""
        self.writing.add(stream_id)
        self._written.add(stream_id)

    def buffered_total(self) -> int:
        """Bytes the engine holds for all our data streams, read from it stream by stream."""
        sizes: dict[int, int] = {}
        for stream_id in list(self.writing):
            size = self.buffered(stream_id)
            if size == 0 and self.session is not None and self.session.data_stream_request(stream_id) is None:
                self.writing.discard(stream_id)
            else:
                sizes[stream_id] = size
        self._sizes = sizes
        self._total = sum(sizes.values())
        self._written.clear()
        return self._total

    def _total_bound(self) -> int:
        """At least `buffered_total()`, for the cost of the streams written since it was last
        read: a stream's bytes grow only by our writes (each writer passes `writable` first, or
        `start_writing`), and the engine only lowers them meanwhile (sending, ACKs). Reading
        every stream on each write cost a relay fanning out a prompt's blocks a third of its
        CPU."""
        written = self._written
        if written:
            sizes = self._sizes
            total = self._total
            for stream_id in written:
                if stream_id in self.writing:
                    size = self.buffered(stream_id)
                    total += size - sizes.get(stream_id, 0)
                    sizes[stream_id] = size
            self._total = total
            written.clear()
        return self._total

    def writable(self, stream_id: int, factor: float = 1.0, total: int | None = None) -> bool:
        """Whether a writer may write on `stream_id` now (its caller then does: the stream is
        counted as written). `total`: `buffered_total()` already read by the caller."""
        settings = self.settings
        limit = settings.connection_send_buffer * factor
        ok = self.buffered(stream_id) < settings.stream_send_buffer * factor and (
            (total if total is not None else self._total_bound()) < limit
            or (total is None and self.buffered_total() < limit))
        self._written.add(stream_id)
        return ok

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
            async with asyncio.timeout(remaining):  # no task made per wait, as wait_for would
                await self.wait_writable(stream_id)
        except TimeoutError:
            return False
        return self._loop.time() <= deadline

    def wake_writers(self) -> None:
        waiters = self._drain_waiters
        if not waiters:
            return
        keep = []
        total = self.buffered_total()  # once for every waiter: bytes were sent or acknowledged
        for stream_id, waiter in waiters:
            if waiter.done():
                continue
            session = self.session
            if (session is None or session.data_stream_request(stream_id) is None
                    or self.writable(stream_id, 0.5, total)):
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
        """The future of a request's answer (resolved by the dispatch of the answer)."""
        future = self._loop.create_future()
        self._pending[request_id] = future
        self.transmit_soon()
        return future

    def take_pending(self, request_id: int) -> asyncio.Future[Any] | None:
        """The future of an answer still awaited, no longer awaited from now on."""
        return self._pending.pop(request_id, None)

    async def await_answer(self, request_id: int, future: asyncio.Future[Any], timeout: float | None) -> Any:
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(request_id, None)
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
