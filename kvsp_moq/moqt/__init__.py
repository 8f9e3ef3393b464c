"""MOQT: what every draft shares (wire: value types and framing; session: the sans-I/O
session machinery every draft builds on), one package per draft (d18, d14: messages, data, session and its parts),
the registry of drafts by ALPN (drafts), the QUIC engine interface (engine), and the
asyncio binding (quic).

The binding's public names are available here too (`from kvsp_moq.moqt import connect,
serve, QuicSettings`), imported on first use so that the codec alone stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "QuicSettings", "MoqtConnection", "MoqtServer", "MoqtObject", "Subscription", "FetchResponse",
    "TrackStatusInfo", "NamespaceSubscription", "NamespaceUpdate", "PublishedNamespace",
    "OutgoingSubscription", "SubgroupSender", "FetchSender", "IncomingRequest", "IncomingSubscribe",
    "IncomingFetch", "IncomingTrackStatus", "IncomingPublishNamespace", "IncomingSubscribeNamespace",
    "IncomingPublish", "IncomingSubscribeTracks", "BlockedTrack", "TrackSubscriptions", "IncomingUpdate",
    "NamespaceRegistration", "NamespacePublisher", "connect", "serve", "new_event_loop", "run",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import quic

        return getattr(quic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
