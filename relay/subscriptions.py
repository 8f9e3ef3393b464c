"""Subscriptions at the relay (`Subscriptions`): SUBSCRIBE, PUBLISH, SUBSCRIBE_TRACKS and
TRACK_STATUS, and the table of feeds (feed.py), one per track.

* SUBSCRIBE and TRACK_STATUS go to the publisher whose announced namespace is the longest
  prefix of the track's (routing.py), or else to the upstream relay when one is configured
  (a chain of relays). One upstream subscription per track is fanned out to every
  downstream subscriber.
* A SUBSCRIBE with RENDEZVOUS_TIMEOUT for a track nobody publishes yet waits (up to the
  relay's own cap) for a PUBLISH_NAMESPACE or PUBLISH that covers it, then proceeds; on
  expiry it is refused with TIMEOUT, and without the parameter at once with DOES_NOT_EXIST.
* A PUBLISH opens a feed of its own, offered to every SUBSCRIBE_TRACKS subscriber whose
  prefix covers it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvsp_moq.auth import Principal
from kvsp_moq.moqt.errors import (
    DoesNotExist,
    InternalRequestError,
    InvalidRange,
    MoqtError,
    PublishDoneCode,
    RequestTimeout,
    SessionClosed,
    Uninterested,
)
from kvsp_moq.moqt.quic import (
    IncomingPublish,
    IncomingSubscribe,
    IncomingSubscribeTracks,
    IncomingTrackStatus,
)
from kvsp_moq.moqt.wire import SubscriptionFilter

from .access import Action
from .cache import TrackKey, track_label
from .downstream import Downstream, filter_bounds
from .feed import Feed
from .host import RelayHost
from .namespaces import Namespaces, check_overlap
from .peers import Peer, request_error
from .routing import covers

__all__ = ["Subscriptions", "TrackWatcher"]

log = logging.getLogger("kvsp.relay")


@dataclass
class TrackWatcher:
    peer: Peer
    prefix: tuple[bytes, ...]
    principals: list[Principal]


class _SourceGone(Exception):
    """The session a request was routed to ended before answering."""


class Subscriptions:
    """The relay's tracks: one feed per track, opened by a SUBSCRIBE (upstream) or a PUBLISH,
    and the subscribers attached to it."""

    def __init__(self, host: RelayHost, namespaces: Namespaces) -> None:
        self.host = host
        self.namespaces = namespaces
        self.feeds: dict[TrackKey, Feed] = {}
        self._closing: dict[TrackKey, asyncio.Task[Any]] = {}
        self._track_watchers: list[TrackWatcher] = []
        #: set and replaced whenever a publisher may have appeared (None until the relay starts)
        self._changed: asyncio.Event | None = None

    def start(self) -> None:
        """The relay is starting: from now on requests may wait for a publisher."""
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Wake requests waiting for a publisher (rendezvous)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # ---------------------------------------------------------------- the table of feeds

    def forget(self, feed: Feed) -> None:
        if self.feeds.get(feed.key) is feed:
            del self.feeds[feed.key]

    def unsubscribing(self, key: TrackKey, task: asyncio.Task[Any]) -> None:
        self._closing[key] = task

    def unpublished(self, namespace: tuple[bytes, ...]) -> None:
        self.namespaces.track_unpublished(namespace)

    # ---------------------------------------------------------------- requests

    async def on_subscribe(self, peer: Peer, req: IncomingSubscribe) -> None:
        self.host.policy.check(Action.SUBSCRIBE, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.host.stats.subscribes += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        feed = await self._feed_for(key, peer, req.parameters.rendezvous_timeout or 0,
                                    req.parameters.new_group_request)
        start, end_group = filter_bounds(req.subscription_filter, feed.largest)
        if end_group is not None and feed.largest is not None and end_group < feed.largest.group:
            raise InvalidRange("the filter's end group has already been published")
        outgoing = req.accept(largest=feed.largest, track_properties=feed.track_properties)
        if feed.ended:
            await outgoing.finish(PublishDoneCode.TRACK_ENDED, "track ended")
            return
        feed.attach(Downstream(self.host, feed, peer, outgoing, start, end_group, req.forward,
                                req.parameters.subscriber_priority))

    async def _feed_for(self, key: TrackKey, requester: Peer, rendezvous_ms: int,
                        new_group_request: int | None = None) -> Feed:
        """The live feed of a track, opening one upstream (after a rendezvous wait) if needed."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        for _ in range(10_000):  # bounded: each turn waits for a change or the deadline
            feed = self.feeds.get(key)
            if feed is not None and not feed.ended:
                if not feed.ready.done():
                    await asyncio.shield(feed.ready)
                if not feed.ended:
                    return feed
                continue
            source = self.host.route(key[0], requester)
            if source is not None:
                try:
                    return await self._open_feed(key, source, new_group_request)
                except _SourceGone:
                    continue  # its session just ended; its routes are gone with it
            if not rendezvous_ms:
                raise DoesNotExist("no publisher for this track")
            if deadline is None:
                self.host.stats.rendezvous_waits += 1
                deadline = loop.time() + min(rendezvous_ms, self.host.settings.max_rendezvous_ms) / 1000
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.host.stats.rendezvous_timeouts += 1
                raise RequestTimeout("no publisher appeared within the rendezvous timeout")
            assert self._changed is not None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        raise InternalRequestError("no stable route for this track")

    async def _open_feed(self, key: TrackKey, source: Peer,
                         new_group_request: int | None = None) -> Feed:
        feed = Feed(self.host, self, key, source)
        self.feeds[key] = feed
        closing = self._closing.pop(key, None)
        if closing is not None:
            await asyncio.wait([closing], timeout=self.host.settings.upstream_timeout)
        self.host.stats.upstream_requests += 1
        self.host.stats.upstream_subscribes += 1
        try:
            # Forward 1 whatever the subscriber asked ("Forward Handling"); a NEW_GROUP_REQUEST
            # for a track without an Established subscription goes along (its "Relay Handling").
            # No token of the subscriber's goes along: the subscriber was authorized here, and
            # upstream this relay is authorized as itself (its SETUP token; access.py).
            upstream = await source.connection.subscribe(
                key[0], key[1], forward=True, new_group_request=new_group_request,
                timeout=self.host.settings.upstream_timeout)
        except BaseException as e:
            self.forget(feed)
            error = request_error(e)
            feed.fail(error)
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, SessionClosed) and not source.alive:
                raise _SourceGone() from None
            raise error from None
        log.info("subscribed upstream to %s via %s", track_label(key), source)
        feed.start(upstream)
        return feed

    async def on_publish(self, peer: Peer, req: IncomingPublish) -> None:
        self.host.policy.check(Action.PUBLISH, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        current = self.feeds.get(key)
        if current is not None and not current.ended:
            raise Uninterested("this track already has a publisher here")
        self.host.stats.publishes += 1
        feed = Feed(self.host, self, key, peer, published=True)
        self.feeds[key] = feed
        try:
            upstream = req.accept(forward=True)
        except BaseException:
            self.forget(feed)
            raise
        feed.start(upstream)
        self.namespaces.track_published(key[0])
        self.notify()
        for watcher in list(self._track_watchers):
            if watcher.peer is not peer and covers(watcher.prefix, key[0]) \
                    and self.host.policy.may_see(watcher.principals, key[0]):
                self.host.spawn(self._publish_to(watcher, feed), name="relay-publish-downstream")

    async def _publish_to(self, watcher: TrackWatcher, feed: Feed) -> None:
        """Offer a published track to a SUBSCRIBE_TRACKS subscriber."""
        try:
            outgoing = await watcher.peer.connection.publish(
                feed.key[0], feed.key[1], largest=feed.largest, track_properties=feed.track_properties,
                timeout=self.host.settings.upstream_timeout)
        except (MoqtError, asyncio.TimeoutError) as e:
            log.info("%s declined %s: %s", watcher.peer, track_label(feed.key), e)
            return
        if feed.ended:
            await outgoing.finish(PublishDoneCode.TRACK_ENDED, "track ended")
            return
        start, _ = filter_bounds(SubscriptionFilter.largest_object(), feed.largest)
        feed.attach(Downstream(self.host, feed, watcher.peer, outgoing, start, None, True))

    async def on_subscribe_tracks(self, peer: Peer, req: IncomingSubscribeTracks) -> None:
        principals = self.host.policy.check(Action.DISCOVER, req.namespace_prefix, peer.tokens(req),
                                       upstream=peer.is_upstream)
        check_overlap(self._track_watchers, peer, tuple(req.namespace_prefix))
        publisher = req.accept()
        watcher = TrackWatcher(peer, tuple(req.namespace_prefix), principals)
        self._track_watchers.append(watcher)
        try:
            for feed in list(self.feeds.values()):
                if feed.published and not feed.ended and feed.origin is not peer \
                        and covers(watcher.prefix, feed.key[0]) \
                        and self.host.policy.may_see(principals, feed.key[0]):
                    self.host.spawn(self._publish_to(watcher, feed), name="relay-publish-downstream")
            await publisher.closed
        finally:
            self._track_watchers.remove(watcher)

    async def on_track_status(self, peer: Peer, req: IncomingTrackStatus) -> None:
        self.host.policy.check(Action.SUBSCRIBE, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.host.stats.track_statuses += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        feed = self.feeds.get(key)
        if feed is not None and not feed.ended and feed.ready.done():
            req.accept(largest=feed.largest, track_properties=feed.track_properties)
            return
        source = self.host.route(key[0], peer)
        if source is None:
            raise DoesNotExist("no publisher for this track")
        self.host.stats.upstream_requests += 1
        self.host.stats.upstream_track_statuses += 1
        try:
            info = await source.connection.track_status(
                key[0], key[1], timeout=self.host.settings.upstream_timeout)
        except BaseException as e:
            raise request_error(e) from None
        req.accept(largest=info.largest, track_properties=info.track_properties)
