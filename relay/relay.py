"""The MOQT relay (draft-18 "Relays"; DESIGN §4).

A `Relay` accepts MOQT sessions on 127.0.0.1 and connects publishers with subscribers:

* PUBLISH_NAMESPACE registers a route; SUBSCRIBE, FETCH and TRACK_STATUS go to the publisher
  whose announced namespace is the longest prefix of the track's (routing.py), or else to the
  upstream relay when one is configured (a chain of relays).
* One upstream subscription per track is fanned out to every downstream subscriber.
* A SUBSCRIBE with RENDEZVOUS_TIMEOUT for a track nobody publishes yet waits (up to the
  relay's own cap) for a PUBLISH_NAMESPACE or PUBLISH that covers it, then proceeds; on
  expiry it is refused with TIMEOUT, and without the parameter at once with DOES_NOT_EXIST.
* Every object that passes through is cached (cache.py). A FETCH is answered from the cache
  as far as the cache can vouch for the range, and the rest is fetched upstream, once,
  appended to the response and cached in turn. Cold FETCHes of one range that arrive while
  it is in flight read the same upstream response (`_SharedFetch`), so N agents loading one
  prefix cost the publisher one copy; a reader that takes nothing for `fetch_stall_timeout`
  while the others wait for it has its response reset, and the others go on.
* A subscriber's REQUEST_UPDATE changes its filter, Forward State and priority here; what
  matters upstream (Forward 1 while any subscriber forwards, the most urgent priority, a
  NEW_GROUP_REQUEST) is sent upstream as a REQUEST_UPDATE of the one upstream subscription.
  An update that cannot be honoured (an End Group already published) is refused and ends
  that subscription with PUBLISH_DONE UPDATE_FAILED.
* Delivery timeouts are per subscriber: an object that waited in a subscriber's queue past
  its timeout is not sent, its subgroup stream is reset with DELIVERY_TIMEOUT.
* SUBSCRIBE_NAMESPACE is answered with the namespaces announced here, those of tracks
  PUBLISHed here and, with an upstream relay, those the upstream relay reports: the relay
  keeps one SUBSCRIBE_NAMESPACE there for every prefix its watchers need.
* Every request is authorized by its AUTHORIZATION TOKENs and its session's (access.py);
  a request on the session to the upstream relay comes from that relay and is accepted.
  Requests forwarded upstream carry no client token: upstream this relay is authorized as
  itself, by the token of its SETUP there (`upstream_token`, a principal with the relay role).
* A publisher that goes away ends its subscriptions downstream with PUBLISH_DONE
  (INTERNAL_ERROR, "publisher went away") after what was already received; its FETCH
  responses in progress are reset. Other tracks are not affected.

Slow subscribers: the upstream subscription is read as fast as it arrives and never waits
for a subscriber. Each downstream subscriber has its own bounded queue (objects and bytes,
`subscriber_queue_bytes` / `subscriber_queue_objects`) drained by its own task into its QUIC
streams, which apply the subscriber's flow control. A subscriber whose queue overflows is
dropped: its open streams are reset and its subscription ends with PUBLISH_DONE
TOO_FAR_BEHIND. So one slow subscriber never stalls the others, and the relay holds at most
one queue's worth (plus QUIC's bounded send buffer) per subscriber. Payloads are shared, not
copied, between the cache and the queues.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine

from kvsp_moq.auth import Authenticator, Principal
from kvsp_moq.moqt.certs import ClientTls, SelfSignedCertificate, untrusted_certificate
from kvsp_moq.moqt.errors import (
    DoesNotExist,
    InternalRequestError,
    InvalidRange,
    MoqtError,
    PrefixOverlap,
    PublishDoneCode,
    PublishDoneError,
    RequestError,
    RequestTimeout,
    SessionCloseCode,
    SessionClosed,
    StreamClosed,
    StreamResetCode,
    Uninterested,
)
from kvsp_moq.moqt.quic import (
    FetchResponse,
    FetchSender,
    IncomingFetch,
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingSubscribeNamespace,
    IncomingSubscribeTracks,
    IncomingTrackStatus,
    IncomingUpdate,
    MoqtConnection,
    MoqtObject,
    MoqtServer,
    NamespacePublisher,
    NamespaceSubscription,
    OutgoingSubscription,
    PublishedNamespace,
    QuicSettings,
    SubgroupEnd,
    SubgroupSender,
    Subscription,
    connect,
    serve,
)
from kvsp_moq.moqt.wire import (
    FilterType,
    GroupOrder,
    Location,
    ObjectStatus,
    Properties,
    SubscriptionFilter,
    TrackPropertyType,
    property_value,
)

from .access import AccessPolicy, Action
from .cache import ObjectCache, TrackKey
from .routing import Route, RouteTable, covers

__all__ = ["Relay", "RelaySettings", "RelayStats"]

log = logging.getLogger("kvsp.relay")

MiB = 1 << 20
#: subgroup streams kept open per subscriber
OPEN_STREAMS = 8


@dataclass
class RelaySettings:
    """Everything a relay is configured with."""

    host: str = "127.0.0.1"
    port: int = 0
    #: a certificate to serve with; else `certfile`/`keyfile`; else one is generated
    certificate: SelfSignedCertificate | None = None
    certfile: str | None = None
    keyfile: str | None = None
    #: byte budget of the object cache
    cache_bytes: int = 256 * MiB
    #: moqt:// URL of the relay to ask for what no local publisher announced
    upstream: str | None = None
    #: token this relay presents in SETUP to its upstream relay
    upstream_token: str | None = None
    #: verify the upstream relay's certificate (with `upstream_cadata` / `upstream_cafile`)
    upstream_verify: bool = True
    upstream_cadata: bytes | None = None
    upstream_cafile: str | None = None
    #: how `kvsp relay` decided to check the upstream's certificate (names the options that
    #: fix a rejected one); None: from upstream_verify / upstream_cafile alone
    upstream_tls: ClientTls | None = None
    #: moqt:// URL at which others reach this relay (what `kvsp relay` prints; None: its
    #: listen address); its host goes in a generated certificate
    public_url: str | None = None
    #: without one the relay runs open
    authenticator: Authenticator | None = None
    quic: QuicSettings = field(default_factory=QuicSettings)
    #: per-subscriber queue limits; a subscriber beyond them is dropped (TOO_FAR_BEHIND)
    subscriber_queue_bytes: int = 32 * MiB
    subscriber_queue_objects: int = 4096
    #: longest RENDEZVOUS_TIMEOUT honoured, in milliseconds
    max_rendezvous_ms: int = 30_000
    #: how long an upstream request may take to be answered
    upstream_timeout: float = 10.0
    #: how long a subscriber gets to take its queued objects once its track has ended
    drain_timeout: float = 30.0
    #: how long a reader of a shared FETCH may take nothing while the others wait for it;
    #: then its stream is reset and the others go on
    fetch_stall_timeout: float = 10.0
    #: reconnect backoff towards the upstream relay
    upstream_retry_initial: float = 0.2
    upstream_retry_max: float = 5.0
    #: seconds between PINGs to every session (0: none). A peer that vanished without closing
    #: (killed, its machine lost) would otherwise keep its announcements and subscriptions
    #: until QUIC's idle timeout; one that leaves a PING unanswered for `probe_timeout` is
    #: closed, which withdraws its namespaces and ends its tracks' subscriptions.
    probe_interval: float = 2.0
    probe_timeout: float = 6.0


@dataclass
class RelayStats:
    """Counters, for tests and metrics. "in" is from upstream, "out" towards subscribers."""

    objects_in: int = 0
    bytes_in: int = 0
    objects_out: int = 0
    bytes_out: int = 0
    subscribes: int = 0
    fetches: int = 0
    track_statuses: int = 0
    announces: int = 0
    publishes: int = 0
    #: FETCHes answered entirely from the cache, and those that needed upstream
    cache_hits: int = 0
    cache_misses: int = 0
    cache_objects_served: int = 0
    upstream_requests: int = 0
    #: cold FETCHes that read a response already coming from upstream for another
    fetches_shared: int = 0
    #: readers of a shared FETCH response dropped for stalling the others
    fetch_readers_dropped: int = 0
    upstream_subscribes: int = 0
    upstream_fetches: int = 0
    upstream_track_statuses: int = 0
    subscribers_dropped: int = 0
    #: the most octets ever queued for one subscriber
    subscriber_queue_peak_bytes: int = 0
    unauthorized: int = 0
    rendezvous_waits: int = 0
    rendezvous_timeouts: int = 0
    publishers_lost: int = 0
    #: REQUEST_UPDATEs from subscribers accepted and refused, and those sent upstream
    updates: int = 0
    updates_refused: int = 0
    upstream_updates: int = 0
    #: objects not forwarded because they outlived a subscriber's delivery timeout
    objects_expired: int = 0
    #: SUBSCRIBE_NAMESPACEs forwarded to the upstream relay
    upstream_namespace_subscribes: int = 0
    #: MOQT sessions clients opened
    sessions_accepted: int = 0
    #: sessions closed because a PING went unanswered
    peers_unresponsive: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# --------------------------------------------------------------------------- sessions


class _Peer:
    """One MOQT session of the relay: a client that connected, or the upstream relay."""

    def __init__(self, ident: int, connection: MoqtConnection | None, *, upstream: bool = False) -> None:
        self.id = ident
        self.connection: MoqtConnection = connection  # type: ignore[assignment]
        self.is_upstream = upstream

    @property
    def alive(self) -> bool:
        return self.connection is not None and not self.connection.is_closed

    def tokens(self, request: IncomingRequest) -> list[bytes]:
        """The request's tokens, then those of the session's SETUP."""
        return [t for t in request.authorization if t] + self.tokens_of_session()

    def tokens_of_session(self) -> list[bytes]:
        """The tokens of the session's SETUP."""
        setup = self.connection.peer_setup if self.connection is not None else None
        if setup is None:
            return []
        return [t.value for t in setup.authorization_tokens if t.value]

    def __repr__(self) -> str:
        return f"<peer {self.id}{' upstream' if self.is_upstream else ''}>"


def _cached(obj: MoqtObject, received_at: float | None = None) -> MoqtObject:
    """The object as the cache and the subscriber queues keep it: itself, stamped with
    the time it arrived when that matters for delivery timeouts."""
    if received_at is None or obj.received_at is not None:
        return obj
    return replace(obj, received_at=received_at)


# --------------------------------------------------------------------------- fan-out


class _Downstream:
    """One subscriber of a feed: its filter, its bounded queue and the task that drains it.

    Its REQUEST_UPDATEs change the filter, the Forward State, the priority and the
    delivery timeouts; the feed then reconsiders what its upstream subscription needs.
    Objects that outlived the subscriber's delivery timeout while queued are not sent:
    their subgroup stream is reset with DELIVERY_TIMEOUT and the rest of that subgroup
    is skipped (draft-18 "Delivery Timeouts and Data Reliability").
    """

    def __init__(self, relay: "Relay", feed: "_Feed", peer: _Peer, outgoing: OutgoingSubscription,
                 start: Location, end_group: int | None, forward: bool, priority: int | None = None) -> None:
        self.relay = relay
        self.feed = feed
        self.peer = peer
        self.outgoing = outgoing
        self.start = start
        self.end_group = end_group
        self.forward = forward
        self.priority = priority
        self._expired: set[tuple[int, int]] = set()
        outgoing.on_update = self._on_update
        self.queue: deque[MoqtObject | SubgroupEnd] = deque()
        self.queued_bytes = 0
        #: sending an object taken from its queue
        self.busy = False
        self.closing: tuple[int, str] | None = None
        self.finished = False
        self._wake = asyncio.Event()
        self._senders: dict[tuple[int, int], SubgroupSender] = {}
        self._drain_timer: asyncio.TimerHandle | None = None
        self.task = relay._spawn(self._run(), name=f"relay-downstream-{peer.id}")
        outgoing.cancelled.add_done_callback(lambda _: self._gone())

    def offer(self, obj: MoqtObject) -> bool:
        """Queue an object for this subscriber; False when its queue is full."""
        if self.finished or self.closing is not None:
            return True
        if obj.location < self.start:
            return True
        if self.end_group is not None and obj.group_id > self.end_group:
            self.close(PublishDoneCode.SUBSCRIPTION_ENDED, "end of the subscription filter")
            return True
        if not self.forward:
            return True
        settings = self.relay.settings
        if self.queue and (self.queued_bytes + obj.size > settings.subscriber_queue_bytes
                           or len(self.queue) >= settings.subscriber_queue_objects):
            return False
        self.queue.append(obj)
        self.queued_bytes += obj.size
        stats = self.relay.stats
        if self.queued_bytes > stats.subscriber_queue_peak_bytes:
            stats.subscriber_queue_peak_bytes = self.queued_bytes
        self._wake.set()
        return True

    def end_subgroup(self, end: SubgroupEnd) -> None:
        """The publisher finished a subgroup stream: finish ours after its queued objects
        (draft-18 "Closing Subgroup Streams": once all objects of a subgroup are delivered,
        the stream MUST be closed with a FIN)."""
        if not self.finished:
            self.queue.append(end)  # (never refused: it holds nothing)
            self._wake.set()

    def _on_update(self, update: IncomingUpdate) -> None:
        """A REQUEST_UPDATE of this subscription (draft-18 "Updating Subscriptions")."""
        relay = self.relay
        feed = self.feed
        parameters = update.parameters
        try:
            if parameters.authorization_tokens:
                tokens = [t for t in update.authorization if t] + self.peer.tokens_of_session()
                relay.policy.check(Action.SUBSCRIBE, feed.key[0], tokens, upstream=self.peer.is_upstream)
            start, end_group = self.start, self.end_group
            if parameters.subscription_filter is not None:
                start, end_group = _filter_bounds(parameters.subscription_filter, feed.largest)
                if end_group is not None and feed.largest is not None and end_group < feed.largest.group:
                    raise InvalidRange("the filter's end group has already been published")
            if self.finished or self.closing is not None:
                raise InvalidRange("the subscription is ending")
        except RequestError:
            relay.stats.updates_refused += 1
            raise
        self.start, self.end_group = start, end_group
        if parameters.forward is not None:
            self.forward = parameters.forward
        if parameters.subscriber_priority is not None:
            self.priority = parameters.subscriber_priority
        relay.stats.updates += 1
        update.accept(largest=feed.largest)
        feed.reconsider(new_group_request=parameters.new_group_request)

    def close(self, code: int, reason: str = "") -> None:
        """End after the queued objects are sent (or after the drain timeout)."""
        if self.closing is None and not self.finished:
            self.closing = (int(code), reason)
            self._wake.set()
            loop = asyncio.get_running_loop()
            self._drain_timer = loop.call_later(
                self.relay.settings.drain_timeout, self.drop, PublishDoneCode.TOO_FAR_BEHIND,
                "subscriber did not take the end of the track in time")

    def drop(self, code: int = PublishDoneCode.TOO_FAR_BEHIND, reason: str = "subscriber too slow") -> None:
        """End now: reset the streams, discard the queue, send PUBLISH_DONE with `code`."""
        if self.finished:
            return
        self._stop()
        self.task.cancel()
        for sender in self._senders.values():
            sender.reset(StreamResetCode.CANCELLED)
        self._senders.clear()
        self.relay._spawn(self.outgoing.finish(code, reason), name="relay-publish-done")

    def _gone(self) -> None:
        """The subscriber unsubscribed, or its session ended."""
        if not self.finished:
            self._stop()
            self.task.cancel()

    def _stop(self) -> None:
        self.finished = True
        self.outgoing.on_update = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.queue.clear()
        self.queued_bytes = 0
        self.feed.detach(self)

    async def _run(self) -> None:
        try:
            while True:
                while self.queue:
                    self.busy = True
                    obj = self.queue.popleft()
                    if isinstance(obj, SubgroupEnd):
                        self._close_stream((obj.group_id, obj.subgroup_id))
                        continue
                    self.queued_bytes -= obj.size
                    if self.forward:  # objects queued before Forward turned 0 are not sent
                        await self._send(obj)
                self.busy = False
                self.feed.drained.set()
                if self.closing is not None:
                    break
                self._wake.clear()
                await self._wake.wait()
            code, reason = self.closing
            self._stop()
            await self.outgoing.finish(code, reason)
        except (StreamClosed, SessionClosed):
            self._gone()
        except asyncio.CancelledError:
            raise
        except (MoqtError, ValueError) as e:
            log.info("subscriber %s: %s", self.peer, e)
            self.drop(PublishDoneCode.INTERNAL_ERROR, str(e))

    async def _send(self, obj: MoqtObject) -> None:
        stats = self.relay.stats
        if obj.subgroup_id is None:
            if not self.outgoing.send_datagram(
                    obj.group_id, obj.object_id, obj.payload, publisher_priority=obj.publisher_priority,
                    status=None if obj.status == ObjectStatus.NORMAL else obj.status, properties=obj.properties,
                    received_at=obj.received_at):
                stats.objects_expired += 1
                return
        else:
            key = (obj.group_id, obj.subgroup_id)
            if key in self._expired:
                stats.objects_expired += 1  # the rest of a subgroup given up on a delivery timeout
                return
            for attempt in (0, 1):
                sender = self._sender(obj, reopen=attempt == 1)
                try:
                    if obj.status != ObjectStatus.NORMAL:
                        await sender.send_status(obj.object_id, obj.status)
                    elif not await sender.send(obj.object_id, obj.payload, properties=obj.properties,
                                               received_at=obj.received_at):
                        self._expired.add(key)
                        self._senders.pop(key, None)
                        stats.objects_expired += 1
                        return
                    break
                except ValueError:
                    # An object that cannot follow the previous one on this stream (late,
                    # or with properties on a stream opened without): a new stream carries it.
                    if attempt:
                        raise
            if obj.status in (ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK):
                self._close_stream((obj.group_id, obj.subgroup_id))
        stats.objects_out += 1
        stats.bytes_out += len(obj.payload)

    def _sender(self, obj: MoqtObject, *, reopen: bool) -> SubgroupSender:
        key = (obj.group_id, obj.subgroup_id or 0)
        sender = self._senders.get(key)
        if sender is not None and not reopen:
            return sender
        if sender is not None:
            self._close_stream(key)
        # At most OPEN_STREAMS subgroup streams stay open per subscriber, the oldest groups'
        # are finished first: groups arrive on separate streams, so a little reordering is
        # normal; a later straggler gets a stream of its own.
        while len(self._senders) >= OPEN_STREAMS:
            self._close_stream(min(self._senders))
        sender = self.outgoing.open_subgroup(
            obj.group_id, obj.subgroup_id or 0, publisher_priority=obj.publisher_priority,
            end_of_group=obj.end_of_group, has_properties=bool(obj.properties) or reopen)
        self._senders[key] = sender
        return sender

    def _close_stream(self, key: tuple[int, int]) -> None:
        sender = self._senders.pop(key, None)
        if sender is not None:
            sender.close()


@dataclass(eq=False)
class _SharedFetch:
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

    async def read(self, reader: int, drop: Callable[[], None] = lambda: None) -> AsyncIterator[MoqtObject]:
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


class _Feed:
    """One upstream subscription to a track and the subscribers it feeds."""

    def __init__(self, relay: "Relay", key: TrackKey, origin: _Peer, *, published: bool = False) -> None:
        self.relay = relay
        self.key = key
        self.origin = origin
        self.published = published  # opened by the publisher's PUBLISH, not by our SUBSCRIBE
        self.upstream: Subscription | None = None
        self.largest: Location | None = None
        self.track_properties: Properties = ()
        self.downstreams: list[_Downstream] = []
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
        self.pump = self.relay._spawn(self._pump(), name="relay-feed")

    def fail(self, error: BaseException) -> None:
        self.ended = True
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: nobody else may be waiting

    def attach(self, downstream: _Downstream) -> None:
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
        relay = self.relay
        relay.stats.upstream_updates += 1

        async def send() -> None:
            try:
                await upstream.update(**changes, timeout=relay.settings.upstream_timeout)
            except (MoqtError, asyncio.TimeoutError) as e:
                log.info("upstream refused an update of %s: %s", _name(self.key), e)

        relay._spawn(send(), name="relay-update-upstream")

    def _wants_new_group(self, value: int) -> bool:
        """Whether a downstream NEW_GROUP_REQUEST goes upstream (its "Relay Handling")."""
        if property_value(self.track_properties, TrackPropertyType.DYNAMIC_GROUPS) != 1:
            return False
        largest_group = self.largest.group if self.largest is not None else None
        if value != 0 and largest_group is not None and value <= largest_group:
            return False
        outstanding = self.new_group_requested
        return outstanding is None or outstanding < value

    def detach(self, downstream: _Downstream) -> None:
        self.drained.set()
        if downstream in self.downstreams:
            self.downstreams.remove(downstream)
            if self.downstreams:
                self.reconsider()
        if not self.downstreams and not self.published and not self.ended:
            # Nobody is left: stop the upstream subscription (the pump then ends).
            self.ended = True
            self.relay._forget_feed(self)
            if self.upstream is not None:
                # A new SUBSCRIBE for the track waits for this to go out first (one upstream
                # subscription per track at a time).
                self.relay._closing[self.key] = self.relay._spawn(
                    self.upstream.aclose(), name="relay-unsubscribe")

    async def _pump(self) -> None:
        relay = self.relay
        stats = relay.stats
        cache = relay.cache
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
                        log.info("dropping slow subscriber %s of %s", downstream.peer, _name(self.key))
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
            log.info("publisher %s of %s went away", self.origin, _name(self.key))
        except MoqtError as e:
            code, reason = int(PublishDoneCode.INTERNAL_ERROR), f"upstream failed: {e}"
        except asyncio.CancelledError:
            code, reason = int(PublishDoneCode.GOING_AWAY), "relay shutting down"
            raise
        finally:
            self.ended = True
            relay._forget_feed(self)
            for downstream in list(self.downstreams):
                downstream.close(code, reason)
            if self.published and not relay._closed:
                relay._count_namespace(relay._published_namespaces, self.key[0], -1)


def _field(value: bytes) -> str:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return value.hex()
    return text if text.isprintable() else value.hex()


def _name(key: TrackKey) -> str:
    """A full track name for the log."""
    ns, name = key
    return "/".join(_field(f) for f in ns) + (":" + _field(name) if name else "")


@dataclass
class _NamespaceWatcher:
    peer: _Peer
    prefix: tuple[bytes, ...]
    publisher: NamespacePublisher
    principals: list[Principal]
    shown: set[tuple[bytes, ...]] = field(default_factory=set)
    upstream: "_UpstreamWatch | None" = None


@dataclass(eq=False)
class _UpstreamWatch:
    """A SUBSCRIBE_NAMESPACE this relay keeps at its upstream relay for its own watchers."""

    prefix: tuple[bytes, ...]
    users: int = 0
    namespaces: set[tuple[bytes, ...]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    #: the upstream subscription in force, cancelled at once when a wider watch replaces this one
    subscription: NamespaceSubscription | None = None


@dataclass
class _TrackWatcher:
    peer: _Peer
    prefix: tuple[bytes, ...]
    principals: list[Principal]


def _check_overlap(watchers: list[Any], peer: _Peer, prefix: tuple[bytes, ...]) -> None:
    """Refuse a prefix that overlaps one the same session already watches (draft-18
    SUBSCRIBE_NAMESPACE / SUBSCRIBE_TRACKS: the receiver MUST answer PREFIX_OVERLAP)."""
    for watcher in watchers:
        if watcher.peer is peer and (covers(watcher.prefix, prefix) or covers(prefix, watcher.prefix)):
            raise PrefixOverlap(f"the session already subscribes to {_name((watcher.prefix, b''))}")


# --------------------------------------------------------------------------- the relay


class Relay:
    """A MOQT relay in this process: `await relay.start()`, then `relay.url`."""

    def __init__(self, settings: RelaySettings | None = None) -> None:
        self.settings = settings or RelaySettings()
        self.policy = AccessPolicy(self.settings.authenticator)
        self.cache = ObjectCache(self.settings.cache_bytes)
        self.stats = RelayStats()
        self.routes: RouteTable[_Peer] = RouteTable()
        self.server: MoqtServer | None = None
        self._route_tokens: dict[Route[_Peer], list[bytes]] = {}
        self._forwarded: dict[Route[_Peer], PublishedNamespace] = {}
        self._feeds: dict[TrackKey, _Feed] = {}
        #: cold FETCHes in flight upstream, by track and range: a FETCH of the same range
        #: that arrives meanwhile reads the same response instead of asking again
        self._fetching: dict[tuple[TrackKey, Location, Location, bool], _SharedFetch] = {}
        self._closing: dict[TrackKey, asyncio.Task[Any]] = {}
        self._namespace_watchers: list[_NamespaceWatcher] = []
        self._track_watchers: list[_TrackWatcher] = []
        # Namespaces known besides announced routes: of tracks PUBLISHed here, and those the
        # upstream relay reported (NAMESPACE); each with how many sources say so.
        self._published_namespaces: dict[tuple[bytes, ...], int] = {}
        self._upstream_namespaces: dict[tuple[bytes, ...], int] = {}
        self._upstream_watches: dict[tuple[bytes, ...], _UpstreamWatch] = {}
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_peer = 0
        self._peers: list[_Peer] = []
        self._upstream_peer: _Peer | None = None
        self._upstream_ready: asyncio.Event | None = None
        self._upstream_task: asyncio.Task[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> "Relay":
        s = self.settings
        certificate = s.certificate
        if certificate is None and s.certfile is None:
            from urllib.parse import urlsplit  # noqa: PLC0415

            from kvsp_moq.moqt.certs import certificate_names, generate_self_signed  # noqa: PLC0415

            public_host = urlsplit(s.public_url).hostname if s.public_url else None
            certificate = s.certificate = generate_self_signed(certificate_names(s.host, public_host))
        self._changed = asyncio.Event()
        self.server = await serve(s.host, s.port, certificate=certificate, certfile=s.certfile,
                                  keyfile=s.keyfile, settings=s.quic, on_connection=self._on_connection)
        if s.upstream:
            self._upstream_ready = asyncio.Event()
            self._upstream_task = self._spawn(self._upstream_loop(), name="relay-upstream")
        if s.probe_interval > 0:
            self._spawn(self._probe_loop(), name="relay-probe")
        log.info("relay at %s (cache %d octets%s)%s", self.url, s.cache_bytes,
                 f", upstream {s.upstream}" if s.upstream else "",
                 "; no principals: open to every client" if self.policy.is_open else "")
        return self

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._upstream_peer is not None and self._upstream_peer.connection is not None:
            await self._upstream_peer.connection.aclose()
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
        return self._upstream_peer is not None and self._upstream_peer.alive

    async def wait_upstream(self, timeout: float = 10.0) -> None:
        """Wait until the session to the upstream relay is up (tests, the demo)."""
        assert self._upstream_ready is not None, "no upstream configured"
        await asyncio.wait_for(self._upstream_ready.wait(), timeout)

    def snapshot(self) -> dict[str, int]:
        """Counters and cache figures in one flat dict."""
        out = self.stats.as_dict()
        out.update(self.cache.stats())
        out["feeds"] = len(self._feeds)
        out["routes"] = len(self.routes)
        out["subscribers"] = sum(len(f.downstreams) for f in self._feeds.values())
        self._peers = [p for p in self._peers if p.alive]
        out["sessions"] = len(self._peers) + (1 if self.upstream_connected else 0)
        return out

    def _spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, (MoqtError, asyncio.TimeoutError)):
                log.error("relay task %s failed", task.get_name(), exc_info=exc)

    def _notify(self) -> None:
        """Wake requests waiting for a publisher (rendezvous)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # ---------------------------------------------------------------- sessions

    def _new_peer(self, connection: MoqtConnection | None, *, upstream: bool = False) -> _Peer:
        self._next_peer += 1
        return _Peer(self._next_peer, connection, upstream=upstream)

    def _handlers(self, peer: _Peer) -> dict[str, Callable[[Any], Awaitable[None]]]:
        def bind(method: Callable[[_Peer, Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
            async def handler(request: Any) -> None:
                await self._guarded(method, peer, request)
            return handler

        return {
            "publish_namespace": bind(self._on_publish_namespace),
            "subscribe_namespace": bind(self._on_subscribe_namespace),
            "subscribe": bind(self._on_subscribe),
            "fetch": bind(self._on_fetch),
            "track_status": bind(self._on_track_status),
            "publish": bind(self._on_publish),
            "subscribe_tracks": bind(self._on_subscribe_tracks),
        }

    async def _guarded(self, method: Callable[[_Peer, Any], Awaitable[None]], peer: _Peer, request: Any) -> None:
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
        probing: set[_Peer] = set()
        while True:
            await asyncio.sleep(self.settings.probe_interval)
            peers = [p for p in self._peers if p.alive]
            if self._upstream_peer is not None and self._upstream_peer.alive:
                peers.append(self._upstream_peer)
            for peer in peers:
                if peer not in probing:
                    probing.add(peer)
                    self._spawn(self._probe(peer, probing), name="relay-probe-peer")

    async def _probe(self, peer: _Peer, probing: set[_Peer]) -> None:
        timeout = self.settings.probe_timeout
        try:
            await asyncio.wait_for(peer.connection.ping(), timeout)
        except asyncio.TimeoutError:
            if peer.alive:
                self.stats.peers_unresponsive += 1
                log.info("%s left a PING unanswered for %.1fs; closing its session", peer, timeout)
                peer.connection.close(SessionCloseCode.NO_ERROR, "no answer to a PING")
        except ConnectionError:
            pass  # the session ended meanwhile
        finally:
            probing.discard(peer)

    def _route(self, namespace: tuple[bytes, ...], requester: _Peer) -> _Peer | None:
        """The session to ask for a track: the longest announced prefix, else upstream."""
        for route in self.routes.candidates(namespace):
            if route.owner.alive:
                return route.owner
        up = self._upstream_peer
        if up is not None and up.alive and requester is not up:
            return up
        return None

    # ---------------------------------------------------------------- namespaces

    async def _on_publish_namespace(self, peer: _Peer, req: IncomingPublishNamespace) -> None:
        tokens = peer.tokens(req)
        self.policy.check(Action.ANNOUNCE, req.namespace, tokens, upstream=peer.is_upstream)
        namespace = tuple(req.namespace)
        registration = req.accept()
        route = self.routes.add(namespace, peer)
        self._route_tokens[route] = tokens
        self.stats.announces += 1
        log.info("%s announced %s", peer, _name((namespace, b"")))
        self._namespace_shown(namespace)
        self._forward_announce(route)
        self._notify()
        try:
            await registration.closed
        finally:
            self.routes.remove(route)
            self._route_tokens.pop(route, None)
            forwarded = self._forwarded.pop(route, None)
            if forwarded is not None and not self._closed:
                self._spawn(forwarded.withdraw(), name="relay-withdraw-upstream")
            self._namespace_gone(namespace)
            log.info("%s withdrew %s", peer, _name((namespace, b"")))

    def _namespace_shown(self, namespace: tuple[bytes, ...]) -> None:
        for watcher in list(self._namespace_watchers):
            if covers(watcher.prefix, namespace) and namespace not in watcher.shown \
                    and self.policy.may_see(watcher.principals, namespace):
                try:
                    watcher.publisher.announce(namespace)
                    watcher.shown.add(namespace)
                except (MoqtError, ValueError):
                    pass

    def _known_namespaces(self, prefix: tuple[bytes, ...]) -> list[tuple[bytes, ...]]:
        """Every namespace under `prefix` this relay can tell a SUBSCRIBE_NAMESPACE about."""
        known = dict.fromkeys(self.routes.under(prefix))
        for source in (self._published_namespaces, self._upstream_namespaces):
            known.update(dict.fromkeys(ns for ns in source if covers(prefix, ns)))
        return list(known)

    def _namespace_gone(self, namespace: tuple[bytes, ...]) -> None:
        """One source of a namespace went away: NAMESPACE_DONE if it was the last."""
        if not (self.routes.is_announced(namespace) or namespace in self._published_namespaces
                or namespace in self._upstream_namespaces):
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
        for watcher in list(self._namespace_watchers):
            if namespace in watcher.shown:
                watcher.shown.discard(namespace)
                try:
                    watcher.publisher.withdraw(namespace)
                except (MoqtError, ValueError):
                    pass

    async def _on_subscribe_namespace(self, peer: _Peer, req: IncomingSubscribeNamespace) -> None:
        tokens = peer.tokens(req)
        principals = self.policy.check(Action.DISCOVER, req.namespace_prefix, tokens,
                                       upstream=peer.is_upstream)
        _check_overlap(self._namespace_watchers, peer, tuple(req.namespace_prefix))
        publisher = req.accept()
        watcher = _NamespaceWatcher(peer, tuple(req.namespace_prefix), publisher, principals)
        self._namespace_watchers.append(watcher)
        try:
            for namespace in self._known_namespaces(watcher.prefix):
                if self.policy.may_see(principals, namespace):
                    publisher.announce(namespace)
                    watcher.shown.add(namespace)
            self._watch_upstream(watcher)
            await publisher.closed
        finally:
            self._namespace_watchers.remove(watcher)
            self._unwatch_upstream(watcher)

    # ---------------------------------------------------------------- namespaces upstream

    def _watch_upstream(self, watcher: _NamespaceWatcher) -> None:
        """Forward a watcher's SUBSCRIBE_NAMESPACE to the upstream relay, so that namespaces
        announced (or tracks published) there reach it too. One upstream subscription serves
        every watcher whose prefix it covers, and the upstream subscriptions never overlap
        (the upstream would refuse with PREFIX_OVERLAP): a wider prefix replaces the
        narrower ones it covers, taking over their watchers and namespaces."""
        if self.settings.upstream is None or watcher.peer.is_upstream or self._closed:
            return
        for prefix, watch in self._upstream_watches.items():
            if covers(prefix, watcher.prefix):
                watch.users += 1
                watcher.upstream = watch
                return
        watch = _UpstreamWatch(watcher.prefix, users=1)
        watcher.upstream = watch
        for prefix, narrower in list(self._upstream_watches.items()):
            if not covers(watcher.prefix, prefix):
                continue
            del self._upstream_watches[prefix]
            watch.users += narrower.users
            watch.namespaces |= narrower.namespaces  # still known: no NAMESPACE_DONE in between
            narrower.namespaces.clear()
            for other in self._namespace_watchers:
                if other.upstream is narrower:
                    other.upstream = watch
            if narrower.subscription is not None:
                # Cancelled before the wider SUBSCRIBE_NAMESPACE is sent.
                self._spawn(narrower.subscription.cancel(), name="relay-namespaces-upstream-cancel")
            if narrower.task is not None:
                narrower.task.cancel()
        self._upstream_watches[watcher.prefix] = watch
        watch.task = self._spawn(self._run_upstream_watch(watch), name="relay-namespaces-upstream")

    def _unwatch_upstream(self, watcher: _NamespaceWatcher) -> None:
        watch, watcher.upstream = watcher.upstream, None
        if watch is None:
            return
        watch.users -= 1
        if watch.users <= 0:
            if self._upstream_watches.get(watch.prefix) is watch:
                del self._upstream_watches[watch.prefix]
            if watch.task is not None:
                watch.task.cancel()

    async def _run_upstream_watch(self, watch: _UpstreamWatch) -> None:
        """Keep one SUBSCRIBE_NAMESPACE at the upstream relay (again after each reconnection)
        and mirror its NAMESPACE / NAMESPACE_DONE into what this relay knows."""
        assert self._upstream_ready is not None
        s = self.settings
        while not self._closed:
            await self._upstream_ready.wait()
            up = self._upstream_peer
            if up is None or not up.alive:
                await asyncio.sleep(s.upstream_retry_initial)
                continue
            subscription: NamespaceSubscription | None = None
            try:
                self.stats.upstream_requests += 1
                self.stats.upstream_namespace_subscribes += 1
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
                        self._count_namespace(self._upstream_namespaces, namespace, +1)
                    elif not item.active and namespace in watch.namespaces:
                        watch.namespaces.discard(namespace)
                        self._count_namespace(self._upstream_namespaces, namespace, -1)
                log.info("upstream ended the namespace subscription to %s", _name((watch.prefix, b"")))
                return
            except RequestError as e:
                log.info("upstream refused the namespace subscription to %s: %s", _name((watch.prefix, b"")), e)
                return
            except (MoqtError, asyncio.TimeoutError):
                pass  # the upstream session ended: subscribe again on the next one
            finally:
                watch.subscription = None
                # A subscription that ended counts as NAMESPACE_DONE for each of its namespaces.
                for namespace in list(watch.namespaces):
                    self._count_namespace(self._upstream_namespaces, namespace, -1)
                watch.namespaces.clear()
                if subscription is not None and not self._closed:
                    self._spawn(subscription.cancel(), name="relay-namespaces-upstream-cancel")
            if up.alive:
                await up.connection.wait_closed()

    def _forward_announce(self, route: Route[_Peer]) -> None:
        """Announce a local publisher's namespace to the upstream relay too."""
        up = self._upstream_peer
        if up is None or not up.alive or route.owner is up:
            return

        async def forward() -> None:
            try:
                published = await up.connection.publish_namespace(
                    route.namespace, authorization=self._route_tokens.get(route) or None,
                    timeout=self.settings.upstream_timeout)
            except (MoqtError, asyncio.TimeoutError) as e:
                log.info("upstream refused the announcement of %s: %s", _name((route.namespace, b"")), e)
                return
            if route in self._route_tokens:
                self._forwarded[route] = published
            else:
                await published.withdraw()

        self._spawn(forward(), name="relay-announce-upstream")

    # ---------------------------------------------------------------- subscriptions

    async def _on_subscribe(self, peer: _Peer, req: IncomingSubscribe) -> None:
        self.policy.check(Action.SUBSCRIBE, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.stats.subscribes += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        feed = await self._feed_for(key, peer, req.parameters.rendezvous_timeout or 0,
                                    req.parameters.new_group_request)
        start, end_group = _filter_bounds(req.subscription_filter, feed.largest)
        if end_group is not None and feed.largest is not None and end_group < feed.largest.group:
            raise InvalidRange("the filter's end group has already been published")
        outgoing = req.accept(largest=feed.largest, track_properties=feed.track_properties)
        if feed.ended:
            await outgoing.finish(PublishDoneCode.TRACK_ENDED, "track ended")
            return
        feed.attach(_Downstream(self, feed, peer, outgoing, start, end_group, req.forward,
                                req.parameters.subscriber_priority))

    async def _feed_for(self, key: TrackKey, requester: _Peer, rendezvous_ms: int,
                        new_group_request: int | None = None) -> _Feed:
        """The live feed of a track, opening one upstream (after a rendezvous wait) if needed."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        for _ in range(10_000):  # bounded: each turn waits for a change or the deadline
            feed = self._feeds.get(key)
            if feed is not None and not feed.ended:
                if not feed.ready.done():
                    await asyncio.shield(feed.ready)
                if not feed.ended:
                    return feed
                continue
            source = self._route(key[0], requester)
            if source is not None:
                try:
                    return await self._open_feed(key, source, new_group_request)
                except _SourceGone:
                    continue  # its session just ended; its routes are gone with it
            if not rendezvous_ms:
                raise DoesNotExist("no publisher for this track")
            if deadline is None:
                self.stats.rendezvous_waits += 1
                deadline = loop.time() + min(rendezvous_ms, self.settings.max_rendezvous_ms) / 1000
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.stats.rendezvous_timeouts += 1
                raise RequestTimeout("no publisher appeared within the rendezvous timeout")
            assert self._changed is not None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        raise InternalRequestError("no stable route for this track")

    async def _open_feed(self, key: TrackKey, source: _Peer,
                         new_group_request: int | None = None) -> _Feed:
        feed = _Feed(self, key, source)
        self._feeds[key] = feed
        closing = self._closing.pop(key, None)
        if closing is not None:
            await asyncio.wait([closing], timeout=self.settings.upstream_timeout)
        self.stats.upstream_requests += 1
        self.stats.upstream_subscribes += 1
        try:
            # Forward 1 whatever the subscriber asked ("Forward Handling"); a NEW_GROUP_REQUEST
            # for a track without an Established subscription goes along (its "Relay Handling").
            # No token of the subscriber's goes along: the subscriber was authorized here, and
            # upstream this relay is authorized as itself (its SETUP token; access.py).
            upstream = await source.connection.subscribe(
                key[0], key[1], forward=True, new_group_request=new_group_request,
                timeout=self.settings.upstream_timeout)
        except BaseException as e:
            self._forget_feed(feed)
            error = _request_error(e)
            feed.fail(error)
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, SessionClosed) and not source.alive:
                raise _SourceGone() from None
            raise error from None
        log.info("subscribed upstream to %s via %s", _name(key), source)
        feed.start(upstream)
        return feed

    def _forget_feed(self, feed: _Feed) -> None:
        if self._feeds.get(feed.key) is feed:
            del self._feeds[feed.key]

    async def _on_publish(self, peer: _Peer, req: IncomingPublish) -> None:
        self.policy.check(Action.PUBLISH, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        current = self._feeds.get(key)
        if current is not None and not current.ended:
            raise Uninterested("this track already has a publisher here")
        self.stats.publishes += 1
        feed = _Feed(self, key, peer, published=True)
        self._feeds[key] = feed
        try:
            upstream = req.accept(forward=True)
        except BaseException:
            self._forget_feed(feed)
            raise
        feed.start(upstream)
        self._count_namespace(self._published_namespaces, key[0], +1)
        self._notify()
        for watcher in list(self._track_watchers):
            if watcher.peer is not peer and covers(watcher.prefix, key[0]) \
                    and self.policy.may_see(watcher.principals, key[0]):
                self._spawn(self._publish_to(watcher, feed), name="relay-publish-downstream")

    async def _publish_to(self, watcher: _TrackWatcher, feed: _Feed) -> None:
        """Offer a published track to a SUBSCRIBE_TRACKS subscriber."""
        try:
            outgoing = await watcher.peer.connection.publish(
                feed.key[0], feed.key[1], largest=feed.largest, track_properties=feed.track_properties,
                timeout=self.settings.upstream_timeout)
        except (MoqtError, asyncio.TimeoutError) as e:
            log.info("%s declined %s: %s", watcher.peer, _name(feed.key), e)
            return
        if feed.ended:
            await outgoing.finish(PublishDoneCode.TRACK_ENDED, "track ended")
            return
        start, _ = _filter_bounds(SubscriptionFilter.largest_object(), feed.largest)
        feed.attach(_Downstream(self, feed, watcher.peer, outgoing, start, None, True))

    async def _on_subscribe_tracks(self, peer: _Peer, req: IncomingSubscribeTracks) -> None:
        principals = self.policy.check(Action.DISCOVER, req.namespace_prefix, peer.tokens(req),
                                       upstream=peer.is_upstream)
        _check_overlap(self._track_watchers, peer, tuple(req.namespace_prefix))
        publisher = req.accept()
        watcher = _TrackWatcher(peer, tuple(req.namespace_prefix), principals)
        self._track_watchers.append(watcher)
        try:
            for feed in list(self._feeds.values()):
                if feed.published and not feed.ended and feed.origin is not peer \
                        and covers(watcher.prefix, feed.key[0]) and self.policy.may_see(principals, feed.key[0]):
                    self._spawn(self._publish_to(watcher, feed), name="relay-publish-downstream")
            await publisher.closed
        finally:
            self._track_watchers.remove(watcher)

    async def _on_track_status(self, peer: _Peer, req: IncomingTrackStatus) -> None:
        self.policy.check(Action.SUBSCRIBE, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.stats.track_statuses += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        feed = self._feeds.get(key)
        if feed is not None and not feed.ended and feed.ready.done():
            req.accept(largest=feed.largest, track_properties=feed.track_properties)
            return
        source = self._route(key[0], peer)
        if source is None:
            raise DoesNotExist("no publisher for this track")
        self.stats.upstream_requests += 1
        self.stats.upstream_track_statuses += 1
        try:
            info = await source.connection.track_status(
                key[0], key[1], timeout=self.settings.upstream_timeout)
        except BaseException as e:
            raise _request_error(e) from None
        req.accept(largest=info.largest, track_properties=info.track_properties)

    # ---------------------------------------------------------------- fetches

    async def _on_fetch(self, peer: _Peer, req: IncomingFetch) -> None:
        self.policy.check(Action.FETCH, req.namespace, peer.tokens(req), upstream=peer.is_upstream)
        self.stats.fetches += 1
        key: TrackKey = (tuple(req.namespace), bytes(req.track_name))
        descending = req.group_order == GroupOrder.DESCENDING
        found = self.cache.lookup(key, req.start, req.end)
        if found.resume is None:
            self.stats.cache_hits += 1
            objects = _ordered(found.objects, descending)
            sender = req.accept(end=req.end)
            await self._send_fetched(sender, objects, from_cache=True)
            sender.close()
            return
        self.stats.cache_misses += 1
        prefix, resume = found.objects, found.resume
        end = req.end
        whole = end.object == 0
        last = Location(end.group, 0) if whole else Location(end.group, end.object - 1)
        ident = (key, resume, last, whole)
        shared: _SharedFetch | None = None
        if not descending and not prefix:  # cold: the response may be shared
            joined = self._fetching.get(ident)
            if joined is not None and not joined.done:
                try:
                    upstream = await asyncio.shield(joined.started)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:
                    raise _request_error(e) from None
                self.stats.fetches_shared += 1
                sender = req.accept(end=upstream.end_location or req.end, end_of_track=upstream.end_of_track,
                                    track_properties=upstream.track_properties)
                await self._follow(joined, req, sender)
                return
            shared = self._fetching[ident] = _SharedFetch(self.settings.quic.max_stream_data,
                                                          self.settings.fetch_stall_timeout)
        try:
            upstream, source, prefix = await self._fetch_upstream(req, peer, key, found, prefix, resume,
                                                                  last, whole)
        except BaseException as e:
            if shared is not None:  # those who joined get the same answer
                del self._fetching[ident]
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
            shared = _SharedFetch(self.settings.quic.max_stream_data, self.settings.fetch_stall_timeout)
        shared.started.set_result(upstream)
        self._spawn(self._read_shared(key, source, shared, ident), name="relay-fetch")
        try:
            await self._send_fetched(sender, prefix, from_cache=True)
        except (StreamClosed, SessionClosed):
            upstream.close()  # the subscriber went away
            return
        await self._follow(shared, req, sender)

    async def _fetch_upstream(self, req: IncomingFetch, peer: _Peer, key: TrackKey, found: Any,
                              prefix: list[MoqtObject], resume: Location, last: Location, whole: bool
                              ) -> tuple[FetchResponse | None, _Peer, list[MoqtObject]]:
        """FETCH the rest of the range from a publisher of the track: the response, its
        publisher and the cache's prefix to send before it (none when the response must
        cover the whole range); no response when it could not and the prefix was served."""
        descending = req.group_order == GroupOrder.DESCENDING
        for _ in range(3):  # a route whose session just ended is skipped
            source = self._route(key[0], peer)
            if descending or (source is not None and prefix and found.origin != source.id):
                prefix, resume = [], req.start  # the response must come from one origin, in order
            if source is None:
                if prefix:
                    await self._serve_prefix(req, prefix)
                    return None, peer, prefix
                raise DoesNotExist("no publisher for this track")
            self.stats.upstream_requests += 1
            self.stats.upstream_fetches += 1
            try:
                upstream = await source.connection.fetch(
                    key[0], key[1], resume, last, whole_end_group=whole,
                    group_order=req.parameters.group_order,
                    timeout=self.settings.upstream_timeout)
                return upstream, source, prefix
            except BaseException as e:
                if isinstance(e, asyncio.CancelledError):
                    raise
                if isinstance(e, SessionClosed) and not source.alive:
                    continue
                if prefix:
                    await self._serve_prefix(req, prefix)
                    return None, peer, prefix
                raise _request_error(e) from None
        raise DoesNotExist("the publishers of this track went away")

    async def _read_shared(self, key: TrackKey, source: _Peer, shared: _SharedFetch,
                           ident: tuple[TrackKey, Location, Location, bool]) -> None:
        """Read an upstream FETCH response into `shared` and the cache, no faster than its
        slowest reader takes it (what arrives together is taken without a trip through the
        event loop)."""
        stats = self.stats
        put = self.cache.put
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
                        self.cache.note_group_end(key, source.id, group, last)
        except MoqtError as e:
            log.info("upstream FETCH of %s failed: %s", _name(key), e)
            error = e
        except BaseException:
            # (the relay closing): the readers reset their streams rather than end them,
            # since a FETCH response ended by FIN says the range is complete
            error = InternalRequestError("the relay stopped reading this response")
            raise
        finally:
            if self._fetching.get(ident) is shared:
                del self._fetching[ident]
            shared.finish(error)

    async def _follow(self, shared: _SharedFetch, req: IncomingFetch, sender: FetchSender) -> None:
        """Send a shared response's objects in `req`'s range; reset the stream if the
        upstream failed, stop reading if the subscriber left."""
        includes = req.includes
        normal = ObjectStatus.NORMAL
        stream_closed = asyncio.Event()
        sender.cancelled.add_done_callback(lambda _: stream_closed.set())

        def drop() -> None:  # it stalled the others: reset (not end) its response
            self.stats.fetch_readers_dropped += 1
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
        stats = self.stats
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
        stats = self.stats
        stats.objects_out += 1
        stats.bytes_out += len(obj.payload)

    # ---------------------------------------------------------------- upstream relay

    async def _upstream_loop(self) -> None:
        """Keep a session to the upstream relay, re-announcing local namespaces on each."""
        s = self.settings
        assert s.upstream is not None and self._upstream_ready is not None
        backoff = s.upstream_retry_initial
        untrusted_said = False
        tls = s.upstream_tls or ClientTls(s.upstream_verify, s.upstream_cafile, peer="upstream relay",
                                          ca_option="--upstream-ca", insecure_option="--upstream-insecure")
        while not self._closed:
            peer = self._new_peer(None, upstream=True)
            try:
                connection = await connect(
                    s.upstream, settings=s.quic, verify=s.upstream_verify, cadata=s.upstream_cadata,
                    cafile=s.upstream_cafile, authorization=s.upstream_token, handlers=self._handlers(peer),
                    timeout=s.upstream_timeout)
            except Exception as e:  # any failure to connect: try again later
                line = untrusted_certificate(e, s.upstream, tls)
                if line is None:
                    log.info("upstream relay %s unreachable (%s); retrying in %.1fs", s.upstream, e or "timeout",
                             backoff)
                elif not untrusted_said:  # said once; the upstream may get another certificate
                    untrusted_said = True
                    log.error("%s", line)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, s.upstream_retry_max)
                continue
            backoff = s.upstream_retry_initial
            untrusted_said = False
            peer.connection = connection
            self._upstream_peer = peer
            self._upstream_ready.set()
            log.info("connected to upstream relay %s", s.upstream)
            for route in list(self.routes):
                if route.owner is not peer:
                    self._forward_announce(route)
            self._notify()
            try:
                await connection.wait_closed()
            finally:
                self._upstream_ready.clear()
                self._upstream_peer = None
                self._forwarded.clear()
            log.info("session to upstream relay %s ended", s.upstream)


#: how often, and after how long (s, growing), a refused wider upstream namespace
#: subscription is asked again while the narrower one it replaces is being cancelled
_OVERLAP_RETRIES = 5
_OVERLAP_RETRY_DELAY = 0.05


class _SourceGone(Exception):
    """The session a request was routed to ended before answering."""


def _filter_bounds(subscription_filter: SubscriptionFilter | None,
                   largest: Location | None) -> tuple[Location, int | None]:
    """(first Location passed, last Group passed or None) of a subscription filter."""
    if subscription_filter is None:
        return Location(0, 0), None
    kind = subscription_filter.filter_type
    if kind == FilterType.LARGEST_OBJECT:
        return (Location(largest.group, largest.object + 1) if largest else Location(0, 0)), None
    if kind == FilterType.NEXT_GROUP_START:
        return (Location(largest.group + 1, 0) if largest else Location(0, 0)), None
    assert subscription_filter.start is not None
    return subscription_filter.start, subscription_filter.end_group


def _ordered(objects: list[MoqtObject], descending: bool) -> list[MoqtObject]:
    if not descending:
        return objects
    return sorted(objects, key=lambda o: (-o.group_id, o.object_id))


def _request_error(error: BaseException) -> RequestError:
    """The REQUEST_ERROR to answer downstream when an upstream request failed."""
    if isinstance(error, RequestError):
        return type(error)(error.reason, error_code=int(error.error_code),
                           retry_interval=error.retry_interval)
    if isinstance(error, asyncio.TimeoutError):
        return RequestTimeout("the publisher did not answer in time")
    if isinstance(error, SessionClosed):
        return DoesNotExist("the publisher went away")
    if isinstance(error, asyncio.CancelledError):
        return InternalRequestError("relay shutting down")
    return InternalRequestError(f"upstream request failed: {error}")
