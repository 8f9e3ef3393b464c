"""The MOQT relay (draft-18 "Relays"; DESIGN §4).

A `Relay` accepts MOQT sessions on 127.0.0.1 and connects publishers with subscribers. It
holds the sessions and hands each request to the part of the relay that serves it:

* namespaces.py: PUBLISH_NAMESPACE registers a route; SUBSCRIBE_NAMESPACE is answered with
  the namespaces announced here, those of tracks PUBLISHed here and those the upstream
  relay reports.
* subscriptions.py: SUBSCRIBE and TRACK_STATUS go to the publisher whose announced
  namespace is the longest prefix of the track's (routing.py), or else to the upstream
  relay when one is configured (a chain of relays); a SUBSCRIBE with RENDEZVOUS_TIMEOUT
  waits for a publisher; PUBLISH and SUBSCRIBE_TRACKS.
* feed.py: one upstream subscription per track is fanned out to every downstream
  subscriber (downstream.py: each with its own bounded queue, filter and delivery
  timeouts; a slow one is dropped), and every object that passes through is cached
  (cache.py).
* fetch.py: a FETCH is answered from the cache as far as the cache can vouch for the range,
  the rest is fetched upstream once; cold FETCHes of one range share one upstream response.
* upstream.py: the session to the upstream relay.

Every request is authorized by its AUTHORIZATION TOKENs and its session's (access.py);
a request on the session to the upstream relay comes from that relay and is accepted.
Requests forwarded upstream carry no client token: upstream this relay is authorized as
itself, by the token of its SETUP there (`upstream_token`, a principal with the relay role).

A publisher that goes away ends its subscriptions downstream with PUBLISH_DONE
(INTERNAL_ERROR, "publisher went away") after what was already received; its FETCH
responses in progress are reset. Other tracks are not affected. A session that leaves a
PING unanswered is closed (`probe_interval`, `probe_timeout`), unless datagrams from it still
arrive meanwhile (a lossy path: its PING or the ACK of it was lost).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Coroutine

from kvsp_moq.moqt.errors import MoqtError, RequestError, SessionCloseCode
from kvsp_moq.moqt.quic import MoqtConnection, MoqtServer, serve
from kvsp_moq.tasks import TaskSet

from .access import AccessPolicy
from .cache import ObjectCache
from .fetch import Fetches
from .namespaces import Namespaces
from .peers import Peer
from .routing import RouteTable
from .settings import RelaySettings, RelayStats
from .subscriptions import Subscriptions
from .upstream import Handlers, UpstreamLink

__all__ = ["Relay", "RelaySettings", "RelayStats"]

log = logging.getLogger("kvsp.relay")


class Relay:
    """A MOQT relay in this process: `await relay.start()`, then `relay.url`."""

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.policy = AccessPolicy(self.settings.authenticator)
        self.cache = ObjectCache(self.settings.cache_bytes)
        self.stats = RelayStats()
        self.routes: RouteTable[Peer] = RouteTable()
        self.server: MoqtServer | None = None
        self.namespaces = Namespaces(self, self.routes)
        self.subscriptions = Subscriptions(self, self.namespaces)
        self.fetches = Fetches(self)
        self._tasks = TaskSet()
        self._next_peer = 0
        self._peers: list[Peer] = []
        self._upstream: UpstreamLink | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> "Relay":
        s = self.settings
        certificate = s.certificate
        if certificate is None and s.certfile is None:
            from urllib.parse import urlsplit

            from kvsp_moq.moqt.certs import certificate_names, generate_self_signed

            public_host = urlsplit(s.public_url).hostname if s.public_url else None
            certificate = s.certificate = generate_self_signed(certificate_names(s.host, public_host))
        self.subscriptions.start()
        self.server = await serve(s.host, s.port, certificate=certificate, certfile=s.certfile,
                                  keyfile=s.keyfile, settings=s.quic, on_connection=self._on_connection)
        if s.upstream:
            self._upstream = UpstreamLink(self, new_peer=self._new_upstream_peer, handlers=self._handlers,
                                          connected=self._upstream_connected,
                                          lost=self.namespaces.upstream_lost)
            self.spawn(self._upstream.run(), name="relay-upstream")
        if s.probe_interval > 0:
            self.spawn(self._probe_loop(), name="relay-probe")
        log.info("relay at %s (cache %d octets%s)%s", self.url, s.cache_bytes,
                 f", upstream {s.upstream}" if s.upstream else "",
                 "; no principals: open to every client" if self.policy.is_open else "")
        return self

    async def aclose(self) -> None:
        self._closed = True
        self._tasks.cancel()
        upstream = self.upstream_peer
        if upstream is not None and upstream.connection is not None:
            await upstream.connection.aclose()
        if self.server is not None:
            await self.server.aclose()
            await asyncio.sleep(0)  # the UDP transport closes its socket on the next turn
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)

    async def __aenter__(self) -> "Relay":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def url(self) -> str:
        """moqt:// URL of this relay."""
        if self.server is None:
            raise RuntimeError("the relay is not started")
        return self.server.url

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def upstream_connected(self) -> bool:
        upstream = self.upstream_peer
        return upstream is not None and upstream.alive

    async def wait_upstream(self, timeout: float = 10.0) -> None:
        """Wait until the session to the upstream relay is up (tests, the demo)."""
        ready = self.upstream_ready
        assert ready is not None, "no upstream configured"
        await asyncio.wait_for(ready.wait(), timeout)

    def snapshot(self) -> dict[str, int]:
        """Counters and cache figures in one flat dict."""
        out = self.stats.as_dict()
        out.update(self.cache.stats())
        feeds = self.subscriptions.feeds
        out["feeds"] = len(feeds)
        out["routes"] = len(self.routes)
        out["subscribers"] = sum(len(f.downstreams) for f in feeds.values())
        self._peers = [p for p in self._peers if p.alive]
        out["sessions"] = len(self._peers) + (1 if self.upstream_connected else 0)
        return out

    # ---------------------------------------------------------------- what the parts use (host.py)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def upstream_peer(self) -> Peer | None:
        return self._upstream.peer if self._upstream is not None else None

    @property
    def upstream_ready(self) -> asyncio.Event | None:
        return self._upstream.ready if self._upstream is not None else None

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task of the relay's, cancelled when the relay closes."""
        task = self._tasks.spawn(coro, name=name)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, (MoqtError, asyncio.TimeoutError)):
                log.error("relay task %s failed", task.get_name(), exc_info=exc)

    def notify(self) -> None:
        """Wake requests waiting for a publisher (rendezvous)."""
        self.subscriptions.notify()

    # ---------------------------------------------------------------- sessions

    def _new_peer(self, connection: MoqtConnection | None, *, upstream: bool = False) -> Peer:
        self._next_peer += 1
        return Peer(self._next_peer, connection, upstream=upstream)

    def _handlers(self, peer: Peer) -> Handlers:
        def bind(method: Callable[[Peer, Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
            async def handler(request: Any) -> None:
                await self._guarded(method, peer, request)
            return handler

        return {
            "publish_namespace": bind(self.namespaces.on_publish_namespace),
            "subscribe_namespace": bind(self.namespaces.on_subscribe_namespace),
            "subscribe": bind(self.subscriptions.on_subscribe),
            "fetch": bind(self.fetches.on_fetch),
            "track_status": bind(self.subscriptions.on_track_status),
            "publish": bind(self.subscriptions.on_publish),
            "subscribe_tracks": bind(self.subscriptions.on_subscribe_tracks),
        }

    async def _guarded(self, method: Callable[[Peer, Any], Awaitable[None]], peer: Peer, request: Any) -> None:
        try:
            await method(peer, request)
        except RequestError as e:
            if int(e.error_code) == 0x1:
                self.stats.unauthorized += 1
            raise

    def _on_connection(self, connection: MoqtConnection) -> None:
        peer = self._new_peer(connection)
        self.stats.sessions_accepted += 1
        self._peers = [p for p in self._peers if p.alive]
        self._peers.append(peer)
        for kind, handler in self._handlers(peer).items():
            connection.set_handler(kind, handler)

    async def _probe_loop(self) -> None:
        """PING every session now and then; close those that no longer answer."""
        probing: set[Peer] = set()
        while True:
            await asyncio.sleep(self.settings.probe_interval)
            peers = [p for p in self._peers if p.alive]
            upstream = self.upstream_peer
            if upstream is not None and upstream.alive:
                peers.append(upstream)
            for peer in peers:
                if peer not in probing:
                    probing.add(peer)
                    self.spawn(self._probe(peer, probing), name="relay-probe-peer")

    async def _probe(self, peer: Peer, probing: set[Peer]) -> None:
        timeout = self.settings.probe_timeout
        try:
            found = await peer.connection.liveness(timeout)
            if found == "sending":
                self.stats.pings_unanswered_kept += 1
                log.info("%s left a PING unanswered for %.1fs but is still sending; kept",
                         peer, timeout)
            elif found == "silent" and peer.alive:
                self.stats.peers_unresponsive += 1
                log.info("%s left a PING unanswered for %.1fs; closing its session", peer, timeout)
                peer.connection.close(SessionCloseCode.NO_ERROR, "no answer to a PING")
        except ConnectionError:
            pass  # the session ended meanwhile
        finally:
            probing.discard(peer)

    def route(self, namespace: tuple[bytes, ...], requester: Peer) -> Peer | None:
        """The session to ask for a track: the longest announced prefix, else upstream."""
        for route in self.routes.candidates(namespace):
            if route.owner.alive:
                return route.owner
        up = self.upstream_peer
        if up is not None and up.alive and requester is not up:
            return up
        return None

    # ---------------------------------------------------------------- upstream relay

    def _new_upstream_peer(self) -> Peer:
        return self._new_peer(None, upstream=True)

    def _upstream_connected(self, up: Peer) -> None:
        self.namespaces.upstream_connected(up)
        self.notify()
