"""One upstream subscription to a track and the subscribers it feeds (`Feed`).

One upstream subscription per track is fanned out to every downstream subscriber
(downstream.py), and every object that passes through is cached (cache.py). What matters
upstream of the subscribers' REQUEST_UPDATEs (Forward 1 while any subscriber forwards, the
most urgent priority, a NEW_GROUP_REQUEST) is sent upstream as a REQUEST_UPDATE of the one
upstream subscription. A publisher that goes away ends the feed's subscriptions downstream
with PUBLISH_DONE (INTERNAL_ERROR, "publisher went away") after what was already received.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any, Protocol

from kvsp_moq.moqt.errors import MoqtError, PublishDoneCode, PublishDoneError, SessionClosed
from kvsp_moq.moqt.quic import MoqtObject, SubgroupEnd, Subscription
from kvsp_moq.moqt.wire import Location, Properties, TrackPropertyType, property_value

from .cache import TrackKey, track_label
from .downstream import Downstream
from .host import RelayHost
from .peers import Peer

__all__ = ["Feed", "FeedTable"]

log = logging.getLogger("kvsp.relay")


class FeedTable(Protocol):
    """What a feed tells the table of feeds that holds it (subscriptions.py)."""

    def forget(self, feed: Feed) -> None:
        """The feed has ended: the next request for its track opens another."""
        ...

    def unsubscribing(self, key: TrackKey, task: asyncio.Task[Any]) -> None:
        """`task` closes the track's upstream subscription; a new one waits for it."""
        ...

    def unpublished(self, namespace: tuple[bytes, ...]) -> None:
        """A track PUBLISHed here has ended (while the relay runs)."""
        ...


def _cached(obj: MoqtObject, received_at: float | None = None) -> MoqtObject:
    """The object as the cache and the subscriber queues keep it: itself, stamped with
    the time it arrived when that matters for delivery timeouts."""
    if received_at is None or obj.received_at is not None:
        return obj
    return replace(obj, received_at=received_at)


class Feed:
    """One upstream subscription to a track and the subscribers it feeds."""

    def __init__(self, host: RelayHost, table: FeedTable, key: TrackKey, origin: Peer, *,
                 published: bool = False) -> None:
        self.host = host
        self.table = table
        self.key = key
        self.origin = origin
        self.published = published  # opened by the publisher's PUBLISH, not by our SUBSCRIBE
        self.upstream: Subscription | None = None
        self.largest: Location | None = None
        self.track_properties: Properties = ()
        self.downstreams: list[Downstream] = []
        #: set when a subscriber's queue empties or a subscriber leaves
        self.drained = asyncio.Event()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ended = False
        self.pump: asyncio.Task[None] | None = None
        #: what the upstream subscription was last asked for
        self.upstream_forward = True
        self.upstream_priority: int | None = None
        self.new_group_requested: int | None = None

    def start(self, upstream: Subscription) -> None:
        self.upstream = upstream
        upstream.subgroup_ends = True  # each downstream stream ends where the upstream's did
        if upstream.largest is not None:
            self.largest = upstream.largest
        self.track_properties = upstream.track_properties
        if not self.ready.done():
            self.ready.set_result(None)
        self.pump = self.host.spawn(self._pump(), name="relay-feed")

    def fail(self, error: BaseException) -> None:
        self.ended = True
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: nobody else may be waiting

    def attach(self, downstream: Downstream) -> None:
        self.downstreams.append(downstream)
        if downstream.forward and not self.upstream_forward:
            self.reconsider()

    def reconsider(self, *, new_group_request: int | None = None) -> None:
        """Update the upstream subscription after a downstream change (draft-18
        REQUEST_UPDATE): Forward 1 while any subscriber forwards, the most urgent subscriber
        priority, and a NEW_GROUP_REQUEST as its "Relay Handling" says. Delivery
        timeouts stay per subscriber and are not sent upstream (their parameter definitions)."""
        upstream = self.upstream
        if upstream is None or self.ended:
            return
        changes: dict[str, Any] = {}
        if self.downstreams:
            forward = any(d.forward for d in self.downstreams)
            if forward != self.upstream_forward:
                changes["forward"] = self.upstream_forward = forward
            priorities = [d.priority for d in self.downstreams if d.priority is not None]
            priority = min(priorities) if priorities else None
            if priority is not None and priority != self.upstream_priority:
                changes["subscriber_priority"] = self.upstream_priority = priority
        if new_group_request is not None and self._wants_new_group(new_group_request):
            changes["new_group_request"] = self.new_group_requested = new_group_request
        if not changes:
            return
        host = self.host
        host.stats.upstream_updates += 1

        async def send() -> None:
            try:
                await upstream.update(**changes, timeout=host.settings.upstream_timeout)
            except (MoqtError, asyncio.TimeoutError) as e:
                log.info("upstream refused an update of %s: %s", track_label(self.key), e)

        host.spawn(send(), name="relay-update-upstream")

    def _wants_new_group(self, value: int) -> bool:
        """Whether a downstream NEW_GROUP_REQUEST goes upstream (its "Relay Handling")."""
        if property_value(self.track_properties, TrackPropertyType.DYNAMIC_GROUPS) != 1:
            return False
        largest_group = self.largest.group if self.largest is not None else None
        if value != 0 and largest_group is not None and value <= largest_group:
            return False
        outstanding = self.new_group_requested
        return outstanding is None or outstanding < value

    def detach(self, downstream: Downstream) -> None:
        self.drained.set()
        if downstream in self.downstreams:
            self.downstreams.remove(downstream)
            if self.downstreams:
                self.reconsider()
        if not self.downstreams and not self.published and not self.ended:
            # Nobody is left: stop the upstream subscription (the pump then ends).
            self.ended = True
            self.table.forget(self)
            if self.upstream is not None:
                # A new SUBSCRIBE for the track waits for this to go out first (one upstream
                # subscription per track at a time).
                self.table.unsubscribing(self.key, self.host.spawn(
                    self.upstream.aclose(), name="relay-unsubscribe"))

    async def _pump(self) -> None:
        host = self.host
        stats = host.stats
        cache = host.cache
        origin = self.origin.id
        code, reason = int(PublishDoneCode.TRACK_ENDED), ""
        assert self.upstream is not None
        try:
            loop = asyncio.get_running_loop()
            async for obj in self.upstream:
                if isinstance(obj, SubgroupEnd):
                    for downstream in self.downstreams:
                        downstream.end_subgroup(obj)
                    continue
                stats.objects_in += 1
                stats.bytes_in += len(obj.payload)
                cached = _cached(obj, loop.time())
                cache.put(self.key, origin, cached)
                if self.largest is None or cached.location > self.largest:
                    if self.largest is not None and cached.group_id > self.largest.group:
                        self.new_group_requested = None  # the outstanding request is met
                    self.largest = cached.location
                for downstream in list(self.downstreams):
                    if not downstream.offer(cached):
                        stats.subscribers_dropped += 1
                        log.info("dropping slow subscriber %s of %s", downstream.peer, track_label(self.key))
                        downstream.drop()
                # With several subscribers the feed reads the upstream no faster than the
                # fastest of them takes objects. Objects that arrived together are otherwise
                # all taken from the upstream before any subscriber runs, and when the relay
                # itself is the bottleneck every subscriber would be found too slow; this
                # way QUIC flow control slows the publisher instead, and one subscriber that
                # falls behind the others still is dropped. A single subscriber is served
                # in bursts (its queue limit bounds what it holds).
                while len(self.downstreams) > 1 and all(d.busy or d.queue for d in self.downstreams):
                    self.drained.clear()
                    await self.drained.wait()
            done = self.upstream.done
            if done is not None:
                code, reason = int(done.status_code), done.reason
        except PublishDoneError as e:
            code, reason = int(e.error_code), e.reason
        except SessionClosed:
            stats.publishers_lost += 1
            code, reason = int(PublishDoneCode.INTERNAL_ERROR), "publisher went away"
            log.info("publisher %s of %s went away", self.origin, track_label(self.key))
        except MoqtError as e:
            code, reason = int(PublishDoneCode.INTERNAL_ERROR), f"upstream failed: {e}"
        except asyncio.CancelledError:
            code, reason = int(PublishDoneCode.GOING_AWAY), "relay shutting down"
            raise
        finally:
            self.ended = True
            self.table.forget(self)
            for downstream in list(self.downstreams):
                downstream.close(code, reason)
            if self.published and not host.closed:
                self.table.unpublished(self.key[0])
