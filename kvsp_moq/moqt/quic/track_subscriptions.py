"""Our SUBSCRIBE_TRACKS: `TrackSubscriptions`, the subscriber side of the peer's PUBLISHes.

Its items are requests from the peer (incoming.py) as well as notices, so it lives apart
from subscriber.py, which incoming.py builds on: neither module imports the other back.
"""

from __future__ import annotations

from typing import AsyncIterator, cast

from ..errors import SessionClosed, StreamClosed, Uninterested
from ..wire import TrackNamespace
from .incoming import IncomingPublish
from .subscriber import BlockedTrack, NamespaceSubscription

__all__ = ["TrackSubscriptions"]


class TrackSubscriptions(NamespaceSubscription):
    """Our SUBSCRIBE_TRACKS: iterate it for the peer's PUBLISHes of tracks under the prefix
    (IncomingPublish: `accept()` returns the Subscription to read, or `reject()`) and for
    BlockedTrack notices. The PUBLISHes it covers come here, not to the "publish" handler;
    `cancel()` refuses those still queued."""

    # Its items are the peer's PUBLISHes and BlockedTrack notices, not NamespaceUpdates.
    def __aiter__(self) -> AsyncIterator[IncomingPublish | BlockedTrack]:  # type: ignore[override]  # items differ
        return self

    async def __anext__(self) -> IncomingPublish | BlockedTrack:  # type: ignore[override]  # items differ
        return cast("IncomingPublish | BlockedTrack", await super().__anext__())

    def covers(self, namespace: TrackNamespace) -> bool:
        return tuple(namespace[:len(self.prefix)]) == tuple(self.prefix)

    def offer(self, request: IncomingPublish) -> bool:
        """Queue a peer PUBLISH of a track under the prefix; False (nothing queued) when
        it is not under it or this subscription has ended."""
        if self._finished or not self.covers(request.namespace):
            return False
        self._items.put_nowait(request)
        return True

    async def cancel(self) -> None:
        kept = []
        while not self._items.empty():
            item = self._items.get_nowait()
            if not isinstance(item, IncomingPublish):
                kept.append(item)  # a notice, or the end already queued
            elif not item.answered:
                try:
                    item.reject(Uninterested("SUBSCRIBE_TRACKS cancelled"))
                except (SessionClosed, StreamClosed):
                    pass
        for item in kept:
            self._items.put_nowait(item)
        await super().cancel()
