"""The draft-18 state of one request (`RequestStream`: its stream and what travels on it),
a fill (`FillState`, drafts 20 and 22), the requests a peer may open a stream with, and
the parameters a REQUEST_UPDATE may carry by the kind of request it updates."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from ..session.records import RequestState
from ..wire import Location, TrackNamespace
from .messages import (
    Fetch,
    Message,
    Publish,
    PublishNamespace,
    Subscribe,
    SubscribeNamespace,
    SubscribeTracks,
    TrackStatus,
)

__all__ = ["REQUEST_TYPES", "UPDATE_SCOPE", "FillState", "Request18", "RequestMessage", "RequestStream"]

_M = TypeVar("_M", bound=Message)


REQUEST_TYPES = (TrackStatus, Subscribe, Publish, Fetch, PublishNamespace, SubscribeNamespace, SubscribeTracks)
RequestMessage = TrackStatus | Subscribe | Publish | Fetch | PublishNamespace | SubscribeNamespace | SubscribeTracks

# Parameters a REQUEST_UPDATE may carry, by the kind of request it updates ("Parameter Scope":
# each parameter names the messages it may appear in, "REQUEST_UPDATE (for a
# subscription)" and the like; any other is a PROTOCOL_VIOLATION).
_SUBSCRIPTION_UPDATE_SCOPE = frozenset({0x02, 0x03, 0x06, 0x10, 0x20, 0x21, 0x32})
UPDATE_SCOPE: dict[type, frozenset[int]] = {
    Subscribe: _SUBSCRIPTION_UPDATE_SCOPE,
    Publish: _SUBSCRIPTION_UPDATE_SCOPE,
    Fetch: frozenset({0x03, 0x20}),
    SubscribeNamespace: frozenset({0x03, 0x34}),
    SubscribeTracks: frozenset({0x03, 0x34}),
    PublishNamespace: frozenset({0x03}),
}


@dataclass(eq=False)
class RequestStream(RequestState):
    """State of one draft-18 request stream."""

    stream_id: int = field(kw_only=True)
    message: RequestMessage = field(kw_only=True)
    fin_sent: bool = False
    fin_received: bool = False
    our_updates: deque[int] = field(default_factory=deque)  # REQUEST_UPDATEs awaiting an answer
    peer_updates: deque[int] = field(default_factory=deque)  # peer REQUEST_UPDATEs we must answer
    goaway_seen: bool = False
    namespaces: set[TrackNamespace] = field(default_factory=set)  # NAMESPACE suffixes announced on this stream

    def message_as(self, kind: type[_M]) -> _M:
        """The request message, known to be a `kind` (as `self.kind` says)."""
        message = self.message
        if not isinstance(message, kind):
            raise TypeError(f"request {self.request_id} is a {self.kind.NAME}, not a {kind.NAME}")
        return message


@dataclass(eq=False)
class FillState(RequestState):
    """A draft-20+ fill: FILL_PARAMETERS on a peer's SUBSCRIBE (or REQUEST_UPDATE),
    served as the joining FETCH it replaces. It has no stream of its own and no answer
    (no FETCH_OK; a refusal sends nothing, or resets the fetch stream); its fetch stream
    carries the Request ID of the message that asked for it (`wire_id`)."""

    wire_id: int = field(kw_only=True)
    joined: RequestStream = field(kw_only=True)  # the subscription it fills
    #: The range, when the fill names one: evaluated as a FETCH's (draft-18 form: end
    #: exclusive, Object 0 the whole group), clamped to the Largest Object.
    bounds: tuple[Location, Location] | None = None


#: What a draft-18 session keeps of a request: its stream, or a fill, which has none.
Request18 = RequestStream | FillState
