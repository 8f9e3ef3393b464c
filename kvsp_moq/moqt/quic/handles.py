"""What the connection knows of a live request's handle: `RequestHandle`.

Subscriptions, fetches, senders and namespace requests (subscriber.py, publisher.py,
track_subscriptions.py) are handles of one request each. ConnectionCore keeps them in
one table by Request ID and sees them only through this protocol, so core.py needs no
handle module, not even for annotations: the handle modules import it, never the
reverse. A Request ID names one request of a session: the client's are even, the
server's odd (draft-14 "Request ID", draft-18 "Request ID"), and the session refuses
a peer ID of the wrong parity, so requests of both directions share the table.
"""

from __future__ import annotations

from typing import Protocol

from .. import events as ev
from ..errors import MoqtError

__all__ = ["RequestHandle"]


class RequestHandle(Protocol):
    """A live request of either direction, registered with its connection
    (`ConnectionCore.register()`) while events may still be addressed to it."""

    @property
    def request_id(self) -> int: ...

    def deliver(self, event: ev.MoqtEvent) -> None:
        """Handle an event of the session addressed to this request (an object, an
        answer arriving after the first, a cancellation, ...); others are ignored."""

    def end(self, error: MoqtError | None) -> None:
        """The request is over for this endpoint (the session ended, or the request
        failed before its answer): settle what waits on the handle with `error` and
        forget the handle; nothing more is sent to the peer."""
