"""MOQT over raw QUIC with asyncio: the only package of the MOQT layer that touches sockets.

`connect()` opens a client session to a ``moqt://host:port/path`` URL and `serve()`
accepts sessions (endpoints.py); a `MoqtConnection` (connection.py) drives one
sans-I/O session of the negotiated draft and offers an awaitable API on top of it:

* publisher side: `publish_namespace()`, `publish()`, and handlers for incoming
  SUBSCRIBE, FETCH, TRACK_STATUS, PUBLISH_NAMESPACE, SUBSCRIBE_NAMESPACE, PUBLISH
  and SUBSCRIBE_TRACKS requests (`on_subscribe()`, `on_fetch()`, ...);
* subscriber side: `subscribe()` and `fetch()` return async iterators of
  `MoqtObject`; `Subscription.update()` sends REQUEST_UPDATE (filter, Forward
  State, priority, delivery timeouts); `track_status()`, `subscribe_namespace()`;
* the peer's REQUEST_UPDATEs reach `OutgoingSubscription.on_update` (else they
  are checked and accepted); delivery timeouts are enforced where objects are
  handed to QUIC (`SubgroupSender`, `OutgoingSubscription.send_datagram()`).

The package, by role: settings.py (engines, datagram sizes, drafts), protocol.py (one
QUIC connection on asyncio), core.py (what the handles share: tables, transmission,
backpressure), subscriber.py, publisher.py, incoming.py (the handles), connection.py,
endpoints.py, and one adapter per QUIC engine (aioquic_engine.py, qh3_engine.py) behind
the interface of ``kvsp_moq.moqt.engine``. The engine is `QuicSettings.engine`
("aioquic" or "qh3", default KVSP_QUIC_ENGINE); peers need not share one.

A QUIC connection that is lost ends every iterator and pending call with
`SessionClosed`, never with a silent end of data.

On a draft-14 session (``moq-00``) the API is the same, but draft-14 has no wire
form for some of it (see `d14.session`), so these are lost or weakened:

* `Subscription.update()` sends SUBSCRIBE_UPDATE, which has no answer: it returns
  at once with no LARGEST_OBJECT / EXPIRES, a publisher cannot refuse it except by
  ending the subscription, and only FORWARD, SUBSCRIBER_PRIORITY,
  OBJECT_DELIVERY_TIMEOUT, tokens and an absolute start / end group can change
  (anything else raises NotSupported); only subscriptions can be updated;
* delivery timeouts: only OBJECT_DELIVERY_TIMEOUT travels (as DELIVERY_TIMEOUT);
  SUBGROUP_DELIVERY_TIMEOUT, RENDEZVOUS_TIMEOUT and the delivery-timeout Track
  Properties are not sent, so the peer enforces no subgroup deadline of ours;
* GOAWAY carries no timeout (it arrives as 0) and no Request ID; per-request
  GOAWAY, SUBSCRIBE_TRACKS, PUBLISH_BLOCKED and padding streams raise NotSupported;
* REQUEST_ERROR retry intervals and REQUEST_OK EXPIRES do not exist; error codes
  are renumbered to the closest draft-14 code (INTERNAL_ERROR when none);
* FETCH end-of-range markers are not written, and fetched objects that are not
  Normal produce no object;
* namespaces matched by a SUBSCRIBE_NAMESPACE travel as PUBLISH_NAMESPACE /
  PUBLISH_NAMESPACE_DONE; a peer's SUBSCRIBE_NAMESPACE, which in draft-14 also asks
  for a PUBLISH of every matching track, reaches both the ``subscribe_namespace``
  and the ``subscribe_tracks`` handler (the latter's answer sends nothing).
"""

from ..objects import MoqtObject, SubgroupEnd
from .connection import Handler, MoqtConnection
from .endpoints import MoqtServer, connect, serve
from .incoming import (
    HANDLER_KINDS,
    IncomingFetch,
    IncomingPublish,
    IncomingPublishNamespace,
    IncomingRequest,
    IncomingSubscribe,
    IncomingSubscribeNamespace,
    IncomingSubscribeTracks,
    IncomingTrackStatus,
)
from .protocol import Liveness
from .publisher import (
    FetchSender,
    IncomingUpdate,
    NamespacePublisher,
    NamespaceRegistration,
    OutgoingSubscription,
    SubgroupSender,
)
from .settings import (
    DATAGRAM_SIZE_ENV,
    DEFAULT_ENGINE,
    ENGINE_ENV,
    ENGINES,
    LOOPBACK_DATAGRAM_SIZE,
    PATH_DATAGRAM_SIZE,
    SUPPORTED_DRAFTS,
    QuicSettings,
    alpn_of,
    check_engine,
    new_event_loop,
    run,
)
from .subscriber import (
    BlockedTrack,
    FetchResponse,
    NamespaceSubscription,
    NamespaceUpdate,
    PublishedNamespace,
    Subscription,
    TrackStatusInfo,
)
from .track_subscriptions import TrackSubscriptions

__all__ = [
    "QuicSettings",
    "DATAGRAM_SIZE_ENV",
    "DEFAULT_ENGINE",
    "ENGINE_ENV",
    "ENGINES",
    "LOOPBACK_DATAGRAM_SIZE",
    "PATH_DATAGRAM_SIZE",
    "MoqtObject",
    "SubgroupEnd",
    "MoqtConnection",
    "Liveness",
    "MoqtServer",
    "Handler",
    "HANDLER_KINDS",
    "Subscription",
    "FetchResponse",
    "TrackStatusInfo",
    "NamespaceSubscription",
    "NamespaceUpdate",
    "PublishedNamespace",
    "OutgoingSubscription",
    "SubgroupSender",
    "FetchSender",
    "IncomingRequest",
    "IncomingSubscribe",
    "IncomingFetch",
    "IncomingTrackStatus",
    "IncomingPublishNamespace",
    "IncomingSubscribeNamespace",
    "IncomingPublish",
    "IncomingSubscribeTracks",
    "BlockedTrack",
    "TrackSubscriptions",
    "IncomingUpdate",
    "NamespaceRegistration",
    "NamespacePublisher",
    "SUPPORTED_DRAFTS",
    "alpn_of",
    "check_engine",
    "connect",
    "serve",
    "new_event_loop",
    "run",
]
