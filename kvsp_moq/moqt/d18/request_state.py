"""The draft-18 state of one request (`RequestStream`: its stream and what travels on it),
the requests a peer may open a stream with, and the parameters a REQUEST_UPDATE may
carry by the kind of request it updates."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..state import RequestState
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

__all__ = ["REQUEST_TYPES", "UPDATE_SCOPE", "RequestStream"]


REQUEST_TYPES = (TrackStatus, Subscribe, Publish, Fetch, PublishNamespace, SubscribeNamespace, SubscribeTracks)

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
    message: Message = field(kw_only=True)
    fin_sent: bool = False
    fin_received: bool = False
    our_updates: deque = field(default_factory=deque)  # REQUEST_UPDATEs awaiting an answer
    peer_updates: deque = field(default_factory=deque)  # peer REQUEST_UPDATEs we must answer
    goaway_seen: bool = False
    namespaces: set = field(default_factory=set)  # NAMESPACE suffixes announced on this stream
