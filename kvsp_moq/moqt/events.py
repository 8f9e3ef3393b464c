"""Events returned by `MoqtSession.handle_event()`.

Requests are named by their Request ID throughout: the ID of the request the peer
sent (for the "...Received" request events) or the one this endpoint sent (for the
answers and for objects of a subscription or fetch).
"""

from __future__ import annotations

from dataclasses import dataclass

from .d18.data import SubgroupHeader
from .d18.messages import Parameters, Redirect, Setup
from .wire import (
    AuthToken,
    FetchType,
    Location,
    ObjectStatus,
    Properties,
    TrackNamespace,
)

__all__ = [
    "MoqtEvent",
    "SetupCompleted",
    "SessionTerminated",
    "GoawayReceived",
    "SubscribeReceived",
    "PublishReceived",
    "FetchReceived",
    "TrackStatusReceived",
    "PublishNamespaceReceived",
    "SubscribeNamespaceReceived",
    "SubscribeTracksReceived",
    "RequestUpdateReceived",
    "SubscribeAccepted",
    "FetchAccepted",
    "RequestAccepted",
    "RequestRejected",
    "PublishDoneReceived",
    "NamespaceReceived",
    "NamespaceDoneReceived",
    "PublishBlockedReceived",
    "RequestCancelled",
    "SubgroupStreamOpened",
    "ObjectReceived",
    "FetchObjectReceived",
    "FetchRangeReceived",
    "DataStreamEnded",
    "DataStreamStopped",
]


class MoqtEvent:
    """Base class of the session events."""

    __slots__ = ()


# ---------------------------------------------------------------------------
# Session
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetupCompleted(MoqtEvent):
    """The peer's SETUP arrived; requests and data from it are now processed."""

    setup: Setup
    "The peer's SETUP message with its Setup Options."


@dataclass(frozen=True, slots=True)
class SessionTerminated(MoqtEvent):
    """The session ended; no further events follow."""

    error_code: int
    "Session close code (SessionCloseCode) or QUIC transport error code."
    reason: str
    "Reason phrase of the close."
    local: bool
    "True when this endpoint closed the session (for example on a protocol violation)."


@dataclass(frozen=True, slots=True)
class GoawayReceived(MoqtEvent):
    """The peer sent GOAWAY, for the whole session or for one request."""

    new_session_uri: str
    "Where to reconnect; empty means the current URI."
    timeout_ms: int
    "How long the peer intends to wait before closing, in milliseconds (0: unspecified)."
    last_request_id: int | None
    "On the control stream: smallest of our Request IDs the peer did not process."
    request_id: int | None
    "For a GOAWAY on a request stream: the request to re-issue elsewhere; None for the session."


# ---------------------------------------------------------------------------
# Requests from the peer
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeReceived(MoqtEvent):
    """The peer subscribes; answer with subscribe_ok() or request_error()."""

    request_id: int
    "Request ID of the SUBSCRIBE."
    namespace: TrackNamespace
    "Track Namespace."
    track_name: bytes
    "Track Name."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class PublishReceived(MoqtEvent):
    """The peer offers a track; answer with request_ok() (PUBLISH_OK) or request_error()."""

    request_id: int
    "Request ID of the PUBLISH."
    namespace: TrackNamespace
    "Track Namespace."
    track_name: bytes
    "Track Name."
    track_alias: int
    "Alias the peer's objects for this track will carry."
    parameters: Parameters
    "Message Parameters as sent."
    track_properties: Properties
    "Track Properties."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class FetchReceived(MoqtEvent):
    """The peer fetches a range; answer with fetch_ok() or request_error() and send
    the objects with open_fetch_stream() / write_fetch_object().

    For a joining fetch the session has already resolved the track and the range
    from the joined subscription.
    """

    request_id: int
    "Request ID of the FETCH."
    fetch_type: FetchType
    "Standalone, relative joining or absolute joining."
    namespace: TrackNamespace
    "Track Namespace (of the joined subscription for a joining fetch)."
    track_name: bytes
    "Track Name (of the joined subscription for a joining fetch)."
    start: Location
    "First Location of the range."
    end: Location
    "End Location as on the wire: last Object plus one; Object 0 means the whole group."
    joining_request_id: int | None
    "For a joining fetch, the Request ID of the joined subscription."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class TrackStatusReceived(MoqtEvent):
    """The peer asks for a track's status; answer with request_ok() or request_error()."""

    request_id: int
    "Request ID of the TRACK_STATUS."
    namespace: TrackNamespace
    "Track Namespace."
    track_name: bytes
    "Track Name."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class PublishNamespaceReceived(MoqtEvent):
    """The peer publishes a namespace; answer with request_ok() or request_error()."""

    request_id: int
    "Request ID of the PUBLISH_NAMESPACE."
    namespace: TrackNamespace
    "The namespace offered."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class SubscribeNamespaceReceived(MoqtEvent):
    """The peer wants NAMESPACE messages under a prefix; answer, then namespace()."""

    request_id: int
    "Request ID of the SUBSCRIBE_NAMESPACE."
    namespace_prefix: TrackNamespace
    "The prefix."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class SubscribeTracksReceived(MoqtEvent):
    """The peer wants PUBLISH for tracks under a prefix; answer, then publish()."""

    request_id: int
    "Request ID of the SUBSCRIBE_TRACKS."
    namespace_prefix: TrackNamespace
    "The prefix."
    parameters: Parameters
    "Message Parameters as sent."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


@dataclass(frozen=True, slots=True)
class RequestUpdateReceived(MoqtEvent):
    """The peer updates one of its requests; answer with request_ok() or request_error()
    using `request_id` (the update's own ID)."""

    request_id: int
    "Request ID of the REQUEST_UPDATE itself."
    existing_request_id: int
    "Request ID of the request being updated."
    parameters: Parameters
    "Parameters present in the update (absent ones are unchanged)."
    authorization_tokens: tuple[AuthToken, ...]
    "Tokens with aliases resolved to USE_VALUE form."


# ---------------------------------------------------------------------------
# Answers to this endpoint's requests
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubscribeAccepted(MoqtEvent):
    """SUBSCRIBE_OK arrived; objects of the track carry `track_alias`."""

    request_id: int
    "Request ID of our SUBSCRIBE."
    track_alias: int
    "Track Alias chosen by the publisher."
    parameters: Parameters
    "EXPIRES and LARGEST_OBJECT when sent."
    track_properties: Properties
    "Track Properties."


@dataclass(frozen=True, slots=True)
class FetchAccepted(MoqtEvent):
    """FETCH_OK arrived."""

    request_id: int
    "Request ID of our FETCH."
    end_of_track: bool
    "True when the range reaches the final object of the track."
    end_location: Location
    "End of the range as on the wire (last Object plus one; Object 0 = whole group)."
    parameters: Parameters
    "Message Parameters."
    track_properties: Properties
    "Track Properties."


@dataclass(frozen=True, slots=True)
class RequestAccepted(MoqtEvent):
    """REQUEST_OK arrived for a PUBLISH, TRACK_STATUS, PUBLISH_NAMESPACE,
    SUBSCRIBE_NAMESPACE, SUBSCRIBE_TRACKS or REQUEST_UPDATE of ours."""

    request_id: int
    "Request ID of our request (of the REQUEST_UPDATE when answering one)."
    parameters: Parameters
    "Message Parameters."
    track_properties: Properties
    "Track Properties (TRACK_STATUS_OK only)."


@dataclass(frozen=True, slots=True)
class RequestRejected(MoqtEvent):
    """REQUEST_ERROR arrived for one of our requests (or was synthesised when this
    endpoint had to cancel it, e.g. for an unsupported mandatory property)."""

    request_id: int
    "Request ID of our request (of the REQUEST_UPDATE when answering one)."
    error_code: int
    "REQUEST_ERROR code (RequestErrorCode); unknown codes are kept as received."
    reason: str
    "Reason phrase."
    retry_interval: int
    "Wire retry interval: 0 never retry, else milliseconds plus one."
    redirect: Redirect | None
    "Where to retry, for REDIRECT."


@dataclass(frozen=True, slots=True)
class PublishDoneReceived(MoqtEvent):
    """PUBLISH_DONE arrived: no further objects beyond `stream_count` streams."""

    request_id: int
    "Request ID of the subscription (our SUBSCRIBE or the peer's PUBLISH)."
    status_code: int
    "PUBLISH_DONE status (PublishDoneCode)."
    stream_count: int
    "Data streams the publisher opened for the subscription (2^62-1 when unknown)."
    reason: str
    "Reason phrase."


@dataclass(frozen=True, slots=True)
class NamespaceReceived(MoqtEvent):
    """NAMESPACE arrived on one of our SUBSCRIBE_NAMESPACE streams."""

    request_id: int
    "Request ID of our SUBSCRIBE_NAMESPACE."
    namespace_suffix: TrackNamespace
    "The fields after our prefix."
    namespace: TrackNamespace
    "Prefix and suffix together."


@dataclass(frozen=True, slots=True)
class NamespaceDoneReceived(MoqtEvent):
    """NAMESPACE_DONE arrived on one of our SUBSCRIBE_NAMESPACE streams."""

    request_id: int
    "Request ID of our SUBSCRIBE_NAMESPACE."
    namespace_suffix: TrackNamespace
    "The fields after our prefix."
    namespace: TrackNamespace
    "Prefix and suffix together."


@dataclass(frozen=True, slots=True)
class PublishBlockedReceived(MoqtEvent):
    """PUBLISH_BLOCKED arrived on one of our SUBSCRIBE_TRACKS streams."""

    request_id: int
    "Request ID of our SUBSCRIBE_TRACKS."
    namespace: TrackNamespace
    "Full namespace of the track that could not be published."
    track_name: bytes
    "Track Name."


@dataclass(frozen=True, slots=True)
class RequestCancelled(MoqtEvent):
    """The peer cancelled a request (STOP_SENDING, reset, or a FIN that cancels).

    For a peer's request this ends it (an unsubscribe, a namespace withdrawn);
    for one of ours the peer abandoned it without an answer.
    """

    request_id: int
    "Request ID of the cancelled request."
    error_code: int
    "Stream reset code (StreamResetCode); CANCELLED for a FIN."
    local_request: bool
    "True when the request was sent by this endpoint."


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubgroupStreamOpened(MoqtEvent):
    """A subgroup stream of one of our subscriptions began."""

    request_id: int
    "Request ID of the subscription."
    stream_id: int
    "QUIC stream ID."
    header: SubgroupHeader | None
    "The SUBGROUP_HEADER as received; None for a fill's fetch stream (draft-20+)."


@dataclass(frozen=True, slots=True)
class ObjectReceived(MoqtEvent):
    """An object of a subscription, from a subgroup stream or a datagram."""

    request_id: int
    "Request ID of the subscription."
    track_alias: int | None
    "Track Alias on the wire; None for an object of a fill (draft-20+) read before SUBSCRIBE_OK."
    group_id: int
    "Group ID."
    subgroup_id: int | None
    "Subgroup ID; None for an object with Forwarding Preference Datagram."
    object_id: int
    "Object ID."
    publisher_priority: int
    "Publisher Priority, the subscription's default resolved when inherited."
    status: ObjectStatus
    "Normal, End of Group or End of Track."
    payload: bytes
    "Object Payload (empty unless Normal)."
    properties: Properties
    "Object Properties."
    stream_id: int | None
    "QUIC stream carrying it; None for a datagram."
    end_of_group: bool
    "The stream's END_OF_GROUP bit (or the datagram's)."


@dataclass(frozen=True, slots=True)
class FetchObjectReceived(MoqtEvent):
    """An object of one of our FETCH requests."""

    request_id: int
    "Request ID of the FETCH."
    group_id: int
    "Group ID."
    subgroup_id: int | None
    "Subgroup ID; None for Forwarding Preference Datagram."
    object_id: int
    "Object ID."
    publisher_priority: int
    "Publisher Priority."
    payload: bytes
    "Object Payload."
    properties: Properties
    "Object Properties."
    stream_id: int
    "QUIC stream carrying the FETCH response."


@dataclass(frozen=True, slots=True)
class FetchRangeReceived(MoqtEvent):
    """An End of Range marker of a FETCH response."""

    request_id: int
    "Request ID of the FETCH."
    location: Location
    "Last Location of the range, inclusive."
    unknown: bool
    "True: status unknown; False: the objects do not exist."


@dataclass(frozen=True, slots=True)
class DataStreamEnded(MoqtEvent):
    """An incoming data stream ended, by FIN or by reset."""

    request_id: int | None
    "Request ID of the subscription or fetch, None when the stream was never matched."
    stream_id: int
    "QUIC stream ID."
    fetch: bool
    "True for a FETCH stream, False for a subgroup stream."
    reset: bool
    "True when the stream was reset (objects may be missing)."
    error_code: int | None
    "Reset code (StreamResetCode) when reset."


@dataclass(frozen=True, slots=True)
class DataStreamStopped(MoqtEvent):
    """The peer sent STOP_SENDING on one of our data streams; it has been reset."""

    request_id: int | None
    "Request ID of the subscription or fetch the stream served."
    stream_id: int
    "QUIC stream ID."
    error_code: int
    "STOP_SENDING code."
