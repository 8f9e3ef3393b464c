"""One subscriber of a feed (`Downstream`): its filter, its bounded queue and the task that
drains it into its QUIC streams.

Slow subscribers: the upstream subscription is read as fast as it arrives and never waits
for a subscriber. Each downstream subscriber has its own bounded queue (objects and bytes,
`subscriber_queue_bytes` / `subscriber_queue_objects`) drained by its own task into its QUIC
streams, which apply the subscriber's flow control. A subscriber whose queue overflows is
dropped: its open streams are reset and its subscription ends with PUBLISH_DONE
TOO_FAR_BEHIND. So one slow subscriber never stalls the others, and the relay holds at most
one queue's worth (plus QUIC's bounded send buffer) per subscriber. Payloads are shared, not
copied, between the cache and the queues.

* A subscriber's REQUEST_UPDATE changes its filter, Forward State and priority here; what
  matters upstream is the feed's to decide (feed.py). An update that cannot be honoured (an
  End Group already published) is refused and ends that subscription with PUBLISH_DONE
  UPDATE_FAILED.
* Delivery timeouts are per subscriber: an object that waited in a subscriber's queue past
  its timeout is not sent, its subgroup stream is reset with DELIVERY_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from kvsp_moq.moqt.errors import (
    InvalidRange,
    MoqtError,
    PublishDoneCode,
    RequestError,
    SessionClosed,
    StreamClosed,
    StreamResetCode,
)
from kvsp_moq.moqt.quic import (
    IncomingUpdate,
    MoqtObject,
    OutgoingSubscription,
    SubgroupEnd,
    SubgroupSender,
)
from kvsp_moq.moqt.wire import FilterType, Location, ObjectStatus, SubscriptionFilter

from .access import Action
from .cache import TrackKey
from .host import RelayHost
from .peers import Peer

__all__ = ["OPEN_STREAMS", "Downstream", "FeedView", "filter_bounds"]

log = logging.getLogger("kvsp.relay")

#: subgroup streams kept open per subscriber
OPEN_STREAMS = 8


class FeedView(Protocol):
    """The feed a subscriber is attached to, as the subscriber sees it (feed.py's `Feed`)."""

    key: TrackKey
    largest: Location | None
    #: set when a subscriber's queue empties or a subscriber leaves
    drained: asyncio.Event

    def reconsider(self, *, new_group_request: int | None = None) -> None:
        """Update the upstream subscription after a change of this subscriber's."""
        ...

    def detach(self, downstream: Downstream) -> None:
        """The subscriber has finished."""
        ...


class Downstream:
    """One subscriber of a feed: its filter, its bounded queue and the task that drains it.

    Its REQUEST_UPDATEs change the filter, the Forward State, the priority and the
    delivery timeouts; the feed then reconsiders what its upstream subscription needs.
    Objects that outlived the subscriber's delivery timeout while queued are not sent:
    their subgroup stream is reset with DELIVERY_TIMEOUT and the rest of that subgroup
    is skipped (draft-18 "Delivery Timeouts and Data Reliability").
    """

    def __init__(self, host: RelayHost, feed: FeedView, peer: Peer, outgoing: OutgoingSubscription,
                 start: Location, end_group: int | None, forward: bool, priority: int | None = None) -> None:
        self.host = host
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
        self.task = host.spawn(self._run(), name=f"relay-downstream-{peer.id}")
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
        settings = self.host.settings
        if self.queue and (self.queued_bytes + obj.size > settings.subscriber_queue_bytes
                           or len(self.queue) >= settings.subscriber_queue_objects):
            return False
        self.queue.append(obj)
        self.queued_bytes += obj.size
        stats = self.host.stats
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
        host = self.host
        feed = self.feed
        parameters = update.parameters
        try:
            if parameters.authorization_tokens:
                tokens = [t for t in update.authorization if t] + self.peer.tokens_of_session()
                host.policy.check(Action.SUBSCRIBE, feed.key[0], tokens, upstream=self.peer.is_upstream)
            start, end_group = self.start, self.end_group
            if parameters.subscription_filter is not None:
                start, end_group = filter_bounds(parameters.subscription_filter, feed.largest)
                if end_group is not None and feed.largest is not None and end_group < feed.largest.group:
                    raise InvalidRange("the filter's end group has already been published")
            if self.finished or self.closing is not None:
                raise InvalidRange("the subscription is ending")
        except RequestError:
            host.stats.updates_refused += 1
            raise
        self.start, self.end_group = start, end_group
        if parameters.forward is not None:
            self.forward = parameters.forward
        if parameters.subscriber_priority is not None:
            self.priority = parameters.subscriber_priority
        host.stats.updates += 1
        update.accept(largest=feed.largest)
        feed.reconsider(new_group_request=parameters.new_group_request)

    def close(self, code: int, reason: str = "") -> None:
        """End after the queued objects are sent (or after the drain timeout)."""
        if self.closing is None and not self.finished:
            self.closing = (int(code), reason)
            self._wake.set()
            loop = asyncio.get_running_loop()
            self._drain_timer = loop.call_later(
                self.host.settings.drain_timeout, self.drop, PublishDoneCode.TOO_FAR_BEHIND,
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
        self.host.spawn(self.outgoing.finish(code, reason), name="relay-publish-done")

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
        stats = self.host.stats
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


def filter_bounds(subscription_filter: SubscriptionFilter | None,
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
