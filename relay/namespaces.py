"""Namespaces at the relay (`Namespaces`): PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, and the
namespace subscriptions the relay keeps at its upstream relay.

* PUBLISH_NAMESPACE registers a route (routing.py); with an upstream relay the namespace is
  announced there too.
* SUBSCRIBE_NAMESPACE is answered with the namespaces announced here, those of tracks
  PUBLISHed here and, with an upstream relay, those the upstream relay reports: the relay
  keeps one SUBSCRIBE_NAMESPACE there for every prefix its watchers need.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from kvsp_moq.auth import Principal
from kvsp_moq.moqt.errors import MoqtError, PrefixOverlap, RequestError
from kvsp_moq.moqt.quic import (
    IncomingPublishNamespace,
    IncomingSubscribeNamespace,
    NamespacePublisher,
    NamespaceSubscription,
    PublishedNamespace,
)

from .access import Action
from .cache import track_label
from .host import RelayHost
from .peers import Peer
from .routing import Route, RouteTable, covers

__all__ = ["NamespaceWatcher", "Namespaces", "UpstreamWatch", "check_overlap"]

log = logging.getLogger("kvsp.relay")


#: how often, and after how long (s, growing), a refused wider upstream namespace
#: subscription is asked again while the narrower one it replaces is being cancelled
_OVERLAP_RETRIES = 5
_OVERLAP_RETRY_DELAY = 0.05


@dataclass
class NamespaceWatcher:
    peer: Peer
    prefix: tuple[bytes, ...]
    publisher: NamespacePublisher
    principals: list[Principal]
    shown: set[tuple[bytes, ...]] = field(default_factory=set)
    upstream: "UpstreamWatch | None" = None


@dataclass(eq=False)
class UpstreamWatch:
    """A SUBSCRIBE_NAMESPACE this relay keeps at its upstream relay for its own watchers."""

    prefix: tuple[bytes, ...]
    users: int = 0
    namespaces: set[tuple[bytes, ...]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    #: the upstream subscription in force, cancelled at once when a wider watch replaces this one
    subscription: NamespaceSubscription | None = None


def check_overlap(watchers: list[Any], peer: Peer, prefix: tuple[bytes, ...]) -> None:
    """Refuse a prefix that overlaps one the same session already watches (draft-18
    SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS: the receiver MUST answer PREFIX_OVERLAP)."""
    for watcher in watchers:
        if watcher.peer is peer and (covers(watcher.prefix, prefix) or covers(prefix, watcher.prefix)):
            raise PrefixOverlap(f"the session already subscribes to {track_label((watcher.prefix, b''))}")


class Namespaces:
    """The namespaces this relay knows (announced here, of tracks PUBLISHed here, reported by
    the upstream relay) and the sessions that watch them."""

    def __init__(self, host: RelayHost, routes: RouteTable[Peer]) -> None:
        self.host = host
        self.routes = routes
        self._route_tokens: dict[Route[Peer], list[bytes]] = {}
        self._forwarded: dict[Route[Peer], PublishedNamespace] = {}
        self.watchers: list[NamespaceWatcher] = []
        # Namespaces known besides announced routes: of tracks PUBLISHed here, and those the
        # upstream relay reported (NAMESPACE); each with how many sources say so.
        self.published: dict[tuple[bytes, ...], int] = {}
        self.upstream_namespaces: dict[tuple[bytes, ...], int] = {}
        self.upstream_watches: dict[tuple[bytes, ...], UpstreamWatch] = {}

    def track_published(self, namespace: tuple[bytes, ...]) -> None:
        """A track of `namespace` was PUBLISHed here."""
        self._count_namespace(self.published, namespace, +1)

    def track_unpublished(self, namespace: tuple[bytes, ...]) -> None:
        """A track of `namespace` PUBLISHed here ended."""
        self._count_namespace(self.published, namespace, -1)

    def upstream_connected(self, up: Peer) -> None:
        """A session to the upstream relay is up: announce the local namespaces there."""
        for route in list(self.routes):
            if route.owner is not up:
                self._forward_announce(route)

    def upstream_lost(self) -> None:
        """The session to the upstream relay ended, and the announcements made there."""
        self._forwarded.clear()

    async def on_publish_namespace(self, peer: Peer, req: IncomingPublishNamespace) -> None:
        tokens = peer.tokens(req)
        self.host.policy.check(Action.ANNOUNCE, req.namespace, tokens, upstream=peer.is_upstream)
        namespace = tuple(req.namespace)
        registration = req.accept()
        route = self.routes.add(namespace, peer)
        self._route_tokens[route] = tokens
        self.host.stats.announces += 1
        log.info("%s announced %s", peer, track_label((namespace, b"")))
        self._namespace_shown(namespace)
        self._forward_announce(route)
        self.host.notify()
        try:
            await registration.closed
        finally:
            self.routes.remove(route)
            self._route_tokens.pop(route, None)
            forwarded = self._forwarded.pop(route, None)
            if forwarded is not None and not self.host.closed:
                self.host.spawn(forwarded.withdraw(), name="relay-withdraw-upstream")
            self._namespace_gone(namespace)
            log.info("%s withdrew %s", peer, track_label((namespace, b"")))

    def _namespace_shown(self, namespace: tuple[bytes, ...]) -> None:
        for watcher in list(self.watchers):
            if covers(watcher.prefix, namespace) and namespace not in watcher.shown \
                    and self.host.policy.may_see(watcher.principals, namespace):
                try:
                    watcher.publisher.announce(namespace)
                    watcher.shown.add(namespace)
                except (MoqtError, ValueError):
                    pass

    def _known_namespaces(self, prefix: tuple[bytes, ...]) -> list[tuple[bytes, ...]]:
        """Every namespace under `prefix` this relay can tell a SUBSCRIBE_NAMESPACE about."""
        known = dict.fromkeys(self.routes.under(prefix))
        for source in (self.published, self.upstream_namespaces):
            known.update(dict.fromkeys(ns for ns in source if covers(prefix, ns)))
        return list(known)

    def _namespace_gone(self, namespace: tuple[bytes, ...]) -> None:
        """One source of a namespace went away: NAMESPACE_DONE if it was the last."""
        if not (self.routes.is_announced(namespace) or namespace in self.published
                or namespace in self.upstream_namespaces):
            self._namespace_withdrawn(namespace)

    def _count_namespace(self, table: dict[tuple[bytes, ...], int], namespace: tuple[bytes, ...],
                         delta: int) -> None:
        count = table.get(namespace, 0) + delta
        if count > 0:
            table[namespace] = count
            if delta > 0:
                self._namespace_shown(namespace)
        else:
            table.pop(namespace, None)
            self._namespace_gone(namespace)

    def _namespace_withdrawn(self, namespace: tuple[bytes, ...]) -> None:
        for watcher in list(self.watchers):
            if namespace in watcher.shown:
                watcher.shown.discard(namespace)
                try:
                    watcher.publisher.withdraw(namespace)
                except (MoqtError, ValueError):
                    pass

    async def on_subscribe_namespace(self, peer: Peer, req: IncomingSubscribeNamespace) -> None:
        tokens = peer.tokens(req)
        principals = self.host.policy.check(Action.DISCOVER, req.namespace_prefix, tokens,
                                       upstream=peer.is_upstream)
        check_overlap(self.watchers, peer, tuple(req.namespace_prefix))
        publisher = req.accept()
        watcher = NamespaceWatcher(peer, tuple(req.namespace_prefix), publisher, principals)
        self.watchers.append(watcher)
        try:
            for namespace in self._known_namespaces(watcher.prefix):
                if self.host.policy.may_see(principals, namespace):
                    publisher.announce(namespace)
                    watcher.shown.add(namespace)
            self._watch_upstream(watcher)
            await publisher.closed
        finally:
            self.watchers.remove(watcher)
            self._unwatch_upstream(watcher)

    # ---------------------------------------------------------------- namespaces upstream

    def _watch_upstream(self, watcher: NamespaceWatcher) -> None:
        """Forward a watcher's SUBSCRIBE_NAMESPACE to the upstream relay, so that namespaces
        announced (or tracks published) there reach it too. One upstream subscription serves
        every watcher whose prefix it covers, and the upstream subscriptions never overlap
        (the upstream would refuse with PREFIX_OVERLAP): a wider prefix replaces the
        narrower ones it covers, taking over their watchers and namespaces."""
        if self.host.settings.upstream is None or watcher.peer.is_upstream or self.host.closed:
            return
        for prefix, watch in self.upstream_watches.items():
            if covers(prefix, watcher.prefix):
                watch.users += 1
                watcher.upstream = watch
                return
        watch = UpstreamWatch(watcher.prefix, users=1)
        watcher.upstream = watch
        for prefix, narrower in list(self.upstream_watches.items()):
            if not covers(watcher.prefix, prefix):
                continue
            del self.upstream_watches[prefix]
            watch.users += narrower.users
            watch.namespaces |= narrower.namespaces  # still known: no NAMESPACE_DONE in between
            narrower.namespaces.clear()
            for other in self.watchers:
                if other.upstream is narrower:
                    other.upstream = watch
            if narrower.subscription is not None:
                # Cancelled before the wider SUBSCRIBE_NAMESPACE is sent.
                self.host.spawn(narrower.subscription.cancel(), name="relay-namespaces-upstream-cancel")
            if narrower.task is not None:
                narrower.task.cancel()
        self.upstream_watches[watcher.prefix] = watch
        watch.task = self.host.spawn(self._run_upstream_watch(watch), name="relay-namespaces-upstream")

    def _unwatch_upstream(self, watcher: NamespaceWatcher) -> None:
        watch, watcher.upstream = watcher.upstream, None
        if watch is None:
            return
        watch.users -= 1
        if watch.users <= 0:
            if self.upstream_watches.get(watch.prefix) is watch:
                del self.upstream_watches[watch.prefix]
            if watch.task is not None:
                watch.task.cancel()

    async def _run_upstream_watch(self, watch: UpstreamWatch) -> None:
        """Keep one SUBSCRIBE_NAMESPACE at the upstream relay (again after each reconnection)
        and mirror its NAMESPACE / NAMESPACE_DONE into what this relay knows."""
        ready = self.host.upstream_ready
        assert ready is not None
        s = self.host.settings
        while not self.host.closed:
            await ready.wait()
            up = self.host.upstream_peer
            if up is None or not up.alive:
                await asyncio.sleep(s.upstream_retry_initial)
                continue
            subscription: NamespaceSubscription | None = None
            try:
                self.host.stats.upstream_requests += 1
                self.host.stats.upstream_namespace_subscribes += 1
                for attempt in range(_OVERLAP_RETRIES + 1):
                    try:
                        subscription = await up.connection.subscribe_namespace(
                            watch.prefix, timeout=s.upstream_timeout)
                        break
                    except PrefixOverlap:
                        # The narrower subscription this one replaces may not be gone upstream
                        # yet (request streams are not ordered): ask again shortly.
                        if attempt == _OVERLAP_RETRIES:
                            raise
                        await asyncio.sleep(_OVERLAP_RETRY_DELAY * (attempt + 1))
                assert subscription is not None
                watch.subscription = subscription
                async for item in subscription:
                    namespace = tuple(item.namespace)
                    if item.active and namespace not in watch.namespaces:
                        watch.namespaces.add(namespace)
                        self._count_namespace(self.upstream_namespaces, namespace, +1)
                    elif not item.active and namespace in watch.namespaces:
                        watch.namespaces.discard(namespace)
                        self._count_namespace(self.upstream_namespaces, namespace, -1)
                log.info("upstream ended the namespace subscription to %s", track_label((watch.prefix, b"")))
                return
            except RequestError as e:
                log.info("upstream refused the namespace subscription to %s: %s",
                         track_label((watch.prefix, b"")), e)
                return
            except (MoqtError, asyncio.TimeoutError):
                pass  # the upstream session ended: subscribe again on the next one
            finally:
                watch.subscription = None
                # A subscription that ended counts as NAMESPACE_DONE for each of its namespaces.
                for namespace in list(watch.namespaces):
                    self._count_namespace(self.upstream_namespaces, namespace, -1)
                watch.namespaces.clear()
                if subscription is not None and not self.host.closed:
                    self.host.spawn(subscription.cancel(), name="relay-namespaces-upstream-cancel")
            if up.alive:
                await up.connection.wait_closed()

    def _forward_announce(self, route: Route[Peer]) -> None:
        """Announce a local publisher's namespace to the upstream relay too."""
        up = self.host.upstream_peer
        if up is None or not up.alive or route.owner is up:
            return

        async def forward() -> None:
            try:
                published = await up.connection.publish_namespace(
                    route.namespace, authorization=self._route_tokens.get(route) or None,
                    timeout=self.host.settings.upstream_timeout)
            except (MoqtError, asyncio.TimeoutError) as e:
                log.info("upstream refused the announcement of %s: %s", track_label((route.namespace, b"")), e)
                return
            if route in self._route_tokens:
                self._forwarded[route] = published
            else:
                await published.withdraw()

        self.host.spawn(forward(), name="relay-announce-upstream")
