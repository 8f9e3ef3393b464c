"""FETCH as the relay answers it (`Fetches`), and one upstream FETCH response shared by the
FETCHes of its range (`SharedFetch`).

A FETCH is answered from the cache (cache.py) as far as the cache can vouch for the range,
and the rest is fetched upstream, once, appended to the response and cached in turn. Cold
FETCHes of one range that arrive while it is in flight read the same upstream response
(`SharedFetch`), so N agents loading one prefix cost the publisher one copy; a reader that
takes nothing for `fetch_stall_timeout` while the others wait for it has its response reset,
and the others go on. A publisher that goes away resets its FETCH responses in progress.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable

from kvsp_moq.moqt.errors import (
    DoesNotExist,
    InternalRequestError,
    MoqtError,
    SessionClosed,
    StreamClosed,
    StreamResetCode,
)
from kvsp_moq.moqt.quic import FetchResponse, FetchSender, IncomingFetch, MoqtObject
from kvsp_moq.moqt.wire import GroupOrder, Location, ObjectStatus

from .access import Action
from .cache import TrackKey, track_label
from .host import RelayHost
from .peers import Peer, request_error

__all__ = ["Fetches", "SharedFetch"]

log = logging.getLogger("kvsp.relay")


@dataclass(eq=False)
class SharedFetch:
    """One upstream FETCH response read by every downstream FETCH of the same range that
    arrived while it was in flight (N agents loading one prefix cost the publisher's link
    one copy, not N). A task reads the upstream into `objects`; each reader sends them at
    its own pace. The task reads no more than `window` octets (a stream's receive window)
    ahead of the slowest reader, so QUIC flow control still slows the publisher to the
    readers' pace, and it cancels the upstream FETCH when the last reader leaves."""

    window: int
    #: seconds the slowest reader may take nothing while the others wait for it
    stall_timeout: float = 10.0
    #: the upstream FETCH once it is answered (those who join meanwhile wait for it)
    started: "asyncio.Future[FetchResponse]" = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    objects: list[MoqtObject] = field(default_factory=list)
    #: octets of objects[:i + 1]
    offsets: list[int] = field(default_factory=list)
    #: reader -> how many objects it has taken
    readers: dict[int, int] = field(default_factory=dict)
    #: reader -> what drops it (resets its stream) when it stalls the others
    droppers: dict[int, Callable[[], None]] = field(default_factory=dict)
    done: bool = False
    failed: BaseException | None = None
    _arrived: "asyncio.Event" = field(default_factory=asyncio.Event)
    _taken: "asyncio.Event" = field(default_factory=asyncio.Event)

    @property
    def upstream(self) -> FetchResponse | None:
        started = self.started
        return started.result() if started.done() and started.exception() is None else None

    def append(self, obj: MoqtObject) -> None:
        self.objects.append(obj)
        self.offsets.append((self.offsets[-1] if self.offsets else 0) + len(obj.payload))
        self._arrived.set()

    def finish(self, error: BaseException | None = None) -> None:
        self.done, self.failed = True, error
        self._arrived.set()

    def ahead(self) -> int:
        """Octets read upstream that the slowest reader has not taken yet."""
        if not self.readers or not self.offsets:
            return 0
        slowest = min(self.readers.values())
        return self.offsets[-1] - (self.offsets[slowest - 1] if slowest else 0)

    async def wait_for_readers(self) -> None:
        """Until the slowest reader is within the window; with other readers waiting, one
        that takes nothing for `stall_timeout` meanwhile is dropped, so that it cannot hold
        the rest (a lone reader only slows its own response)."""
        while self.readers and self.ahead() > self.window:
            self._taken.clear()
            try:
                await asyncio.wait_for(self._taken.wait(),
                                       self.stall_timeout if len(self.readers) > 1 else None)
            except asyncio.TimeoutError:
                slowest = min(self.readers, key=self.readers.__getitem__)
                self.readers.pop(slowest)
                self.droppers.pop(slowest, lambda: None)()

    async def read(self, reader: int, drop: Callable[[], None] = lambda: None) -> AsyncGenerator[MoqtObject, None]:
        """The response's objects from the first, as they arrive; raises what ended it.
        `drop` ends the reader's response if it stalls the others."""
        self.readers[reader] = 0
        self.droppers[reader] = drop
        i = 0
        try:
            while True:
                while i < len(self.objects):
                    if reader not in self.readers:
                        return  # dropped
                    obj = self.objects[i]
                    i += 1
                    self.readers[reader] = i
                    self._taken.set()
                    yield obj
                if self.done:
                    break
                self._arrived.clear()
                await self._arrived.wait()
            if self.failed is not None:
                raise self.failed
        finally:
            self.readers.pop(reader, None)
            self.droppers.pop(reader, None)
            self._taken.set()
            upstream = self.upstream
            if not self.readers and not self.done and upstream is not None:
                upstream.close()  # the last reader left: stop the upstream FETCH


class Fetches:
    """The relay's FETCH handling: the cache first, the rest upstream, cold FETCHes of one
    range sharing one upstream response."""

    def __init__(self, host: RelayHost) -> None:
        self.host = host
        #: cold FETCHes in flight upstream, by track and range: a FETCH of the same range
        #: that arrives meanwhile reads the same response instead of asking again
        self.in_flight: dict[tuple[TrackKey, Location, Location, bool], SharedFetch] = {}

    async def on_fetch(self, peer: Peer, req: IncomingFetch) -> None:
        self.host.policy.check(Action.FETCH, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.host.stats.fetches += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        descending = req.group_order == GroupOrder.DESCENDING
        found = self.host.cache.lookup(key, req.start, req.end)
        if found.resume is None:
            self.host.stats.cache_hits += 1
            objects = _ordered(found.objects, descending)
            sender = req.accept(end=req.end)
            await self._send_fetched(sender, objects, from_cache=True)
            sender.close()
            return
        self.host.stats.cache_misses += 1
        prefix, resume = found.objects, found.resume
        end = req.end
        whole = end.object == 0
        last = Location(end.group, 0) if whole else Location(end.group, end.object - 1)
        ident = (key, resume, last, whole)
        shared: SharedFetch | None = None
        if not descending and not prefix:  # cold: the response may be shared
            joined = self.in_flight.get(ident)
            if joined is not None and not joined.done:
                try:
                    started = await asyncio.shield(joined.started)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:
                    raise request_error(e) from None
                self.host.stats.fetches_shared += 1
                sender = req.accept(end=started.end_location or req.end, end_of_track=started.end_of_track,
                                    track_properties=started.track_properties)
                await self._follow(joined, req, sender)
                return
            shared = self.in_flight[ident] = SharedFetch(self.host.settings.quic.max_stream_data,
                                                          self.host.settings.fetch_stall_timeout)
        try:
            upstream, source, prefix = await self._fetch_upstream(req, peer, key, found, prefix, resume,
                                                                  last, whole)
        except BaseException as e:
            if shared is not None:  # those who joined get the same answer
                del self.in_flight[ident]
                shared.started.set_exception(e if not isinstance(e, asyncio.CancelledError)
                                             else DoesNotExist("the FETCH this one joined was cancelled"))
                shared.started.exception()  # (retrieved: nobody may have joined)
                shared.finish(e)
            raise
        if upstream is None:
            return  # served from the cache's prefix
        sender = req.accept(end=upstream.end_location or req.end, end_of_track=upstream.end_of_track,
                            track_properties=upstream.track_properties)
        if shared is None:  # a response of this request's alone (after a prefix, or descending)
            shared = SharedFetch(self.host.settings.quic.max_stream_data, self.host.settings.fetch_stall_timeout)
        shared.started.set_result(upstream)
        self.host.spawn(self._read_shared(key, source, shared, ident), name="relay-fetch")
        try:
            await self._send_fetched(sender, prefix, from_cache=True)
        except (StreamClosed, SessionClosed):
            upstream.close()  # the subscriber went away
            return
        await self._follow(shared, req, sender)

    async def _fetch_upstream(self, req: IncomingFetch, peer: Peer, key: TrackKey, found: Any,
                              prefix: list[MoqtObject], resume: Location, last: Location, whole: bool
                              ) -> tuple[FetchResponse | None, Peer, list[MoqtObject]]:
        """FETCH the rest of the range from a publisher of the track: the response, its
        publisher and the cache's prefix to send before it (none when the response must
        cover the whole range); no response when it could not and the prefix was served."""
        descending = req.group_order == GroupOrder.DESCENDING
        for _ in range(3):  # a route whose session just ended is skipped
            source = self.host.route(key[0], peer)
            if descending or (source is not None and prefix and found.origin != source.id):
                prefix, resume = [], req.start  # the response must come from one origin, in order
            if source is None:
                if prefix:
                    await self._serve_prefix(req, prefix)
                    return None, peer, prefix
                raise DoesNotExist("no publisher for this track")
            self.host.stats.upstream_requests += 1
            self.host.stats.upstream_fetches += 1
            try:
                upstream = await source.connection.fetch(
                    key[0], key[1], resume, last, whole_end_group=whole,
                    group_order=req.parameters.group_order,
                    timeout=self.host.settings.upstream_timeout)
                return upstream, source, prefix
            except BaseException as e:
                if isinstance(e, asyncio.CancelledError):
                    raise
                if isinstance(e, SessionClosed) and not source.alive:
                    continue
                if prefix:
                    await self._serve_prefix(req, prefix)
                    return None, peer, prefix
                raise request_error(e) from None
        raise DoesNotExist("the publishers of this track went away")

    async def _read_shared(self, key: TrackKey, source: Peer, shared: SharedFetch,
                           ident: tuple[TrackKey, Location, Location, bool]) -> None:
        """Read an upstream FETCH response into `shared` and the cache, no faster than its
        slowest reader takes it (what arrives together is taken without a trip through the
        event loop)."""
        stats = self.host.stats
        put = self.host.cache.put
        upstream = shared.upstream
        assert upstream is not None
        last_in_group: dict[int, int] = {}
        error: BaseException | None = None
        try:
            iterator = upstream.__aiter__()
            while True:
                obj = upstream.ready_object()
                if obj is None:
                    await shared.wait_for_readers()
                    try:
                        obj = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                stats.objects_in += 1
                stats.bytes_in += len(obj.payload)
                put(key, source.id, obj)
                if last_in_group.get(obj.group_id, -1) < obj.object_id:
                    last_in_group[obj.group_id] = obj.object_id
                shared.append(obj)
            end = upstream.end_location
            # A response ended by FIN lists every object that exists in its range: the end
            # of each group it covered whole is now known.
            if end is not None:
                for group, last in last_in_group.items():
                    if group < end.group or (group == end.group and end.object == 0):
                        self.host.cache.note_group_end(key, source.id, group, last)
        except MoqtError as e:
            log.info("upstream FETCH of %s failed: %s", track_label(key), e)
            error = e
        except BaseException:
            # (the relay closing): the readers reset their streams rather than end them,
            # since a FETCH response ended by FIN says the range is complete
            error = InternalRequestError("the relay stopped reading this response")
            raise
        finally:
            if self.in_flight.get(ident) is shared:
                del self.in_flight[ident]
            shared.finish(error)

    async def _follow(self, shared: SharedFetch, req: IncomingFetch, sender: FetchSender) -> None:
        """Send a shared response's objects in `req`'s range; reset the stream if the
        upstream failed, stop reading if the subscriber left."""
        includes = req.includes
        normal = ObjectStatus.NORMAL
        stream_closed = asyncio.Event()
        sender.cancelled.add_done_callback(lambda _: stream_closed.set())

        def drop() -> None:  # it stalled the others: reset (not end) its response
            self.host.stats.fetch_readers_dropped += 1
            stream_closed.set()
            sender.reset(StreamResetCode.INTERNAL_ERROR)

        stream = shared.read(id(sender), drop)
        try:
            async for obj in stream:
                if stream_closed.is_set():
                    break
                if obj.status == normal and includes((obj.group_id, obj.object_id)):
                    await self._send(sender, obj)
        except MoqtError:
            sender.reset(StreamResetCode.INTERNAL_ERROR)
            return
        except (StreamClosed, SessionClosed):
            return  # the subscriber went away
        finally:
            await stream.aclose()
        if not stream_closed.is_set():
            sender.close()

    async def _serve_prefix(self, req: IncomingFetch, prefix: list[MoqtObject]) -> None:
        """Answer with what the cache holds from the start of the range (upstream failed)."""
        tail = prefix[-1]
        sender = req.accept(end=Location(tail.group_id, tail.object_id + 1))
        await self._send_fetched(sender, prefix, from_cache=True)
        sender.close()

    async def _send_fetched(self, sender: FetchSender, objects: list[MoqtObject], *, from_cache: bool) -> None:
        stats = self.host.stats
        for obj in objects:
            if obj.status != ObjectStatus.NORMAL:
                continue  # a FETCH response marks no statuses; a gap says "does not exist"
            await self._send(sender, obj)
            if from_cache:
                stats.cache_objects_served += 1

    async def _send(self, sender: FetchSender, obj: MoqtObject) -> None:
        """Write an object downstream (waiting only when the stream has no room)."""
        await sender.send(obj.group_id, obj.object_id, obj.payload, subgroup_id=obj.subgroup_id,
                          publisher_priority=obj.publisher_priority, properties=obj.properties)
        stats = self.host.stats
        stats.objects_out += 1
        stats.bytes_out += len(obj.payload)


def _ordered(objects: list[MoqtObject], descending: bool) -> list[MoqtObject]:
    if not descending:
        return objects
    return sorted(objects, key=lambda o: (-o.group_id, o.object_id))
