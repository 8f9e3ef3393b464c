"""The draft-14 state of one request (`Request14`) and the kinds of request, each named by
its draft-18 message class: what the session tracks of a request whatever its wire."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..d18 import messages as m18
from ..session.records import RequestState
from ..wire import TrackNamespace

__all__ = [
    "ANNOUNCED",
    "FETCH",
    "PUBLISH",
    "PUBLISH_NAMESPACE",
    "SUBSCRIBE",
    "SUBSCRIBE_NAMESPACE",
    "SUBSCRIBE_UPDATE",
    "TRACKS",
    "TRACKS_ID_BASE",
    "TRACK_STATUS",
    "Request14",
]

# Request kinds: the draft-18 message class of each request. ANNOUNCED is a
# PUBLISH_NAMESPACE that answers a SUBSCRIBE_NAMESPACE (draft-18 NAMESPACE); TRACKS
# is the SUBSCRIBE_TRACKS half of a peer's SUBSCRIBE_NAMESPACE, never on the wire.
SUBSCRIBE = m18.Subscribe
FETCH = m18.Fetch
TRACK_STATUS = m18.TrackStatus
PUBLISH = m18.Publish
PUBLISH_NAMESPACE = m18.PublishNamespace
SUBSCRIBE_NAMESPACE = m18.SubscribeNamespace
ANNOUNCED = m18.Namespace
TRACKS = m18.SubscribeTracks
SUBSCRIBE_UPDATE = m18.RequestUpdate

#: Request IDs of TRACKS requests: above every varint, so never a wire Request ID.
TRACKS_ID_BASE = 1 << 62


@dataclass(eq=False)
class Request14(RequestState):
    """State of one draft-14 request; `parameters` are its draft-18 view."""

    namespace: TrackNamespace = ()
    track_name: bytes = b""
    fetch: m18.Fetch | None = None
    sent: bool = True  # False while queued behind the peer's Maximum Request ID
    announced: dict[TrackNamespace, Request14] = field(default_factory=dict)  # SUBSCRIBE_NAMESPACE: suffix -> ANNOUNCED
    parent: Request14 | None = None  # ANNOUNCED, TRACKS: its SUBSCRIBE_NAMESPACE
    tracks: Request14 | None = None  # peer SUBSCRIBE_NAMESPACE: its TRACKS half
    credit_returned: bool = False
