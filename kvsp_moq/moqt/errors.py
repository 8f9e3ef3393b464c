"""MOQT errors, each carrying the code it is sent with on the wire.

Three code spaces exist in draft-18 and they overlap numerically, so each family has
its own base class:

* `SessionError` - session termination codes (section 3.6), sent in CONNECTION_CLOSE.
  Raised by parsers and the session when the peer broke the protocol; the session
  closes the QUIC connection with `error_code` and the message as reason.
* `RequestError` - REQUEST_ERROR codes (section 10.6), the answer to one request.
  An application handler raises one to reject a request; the subscriber API raises
  one when the peer rejected its request.
* Stream reset codes (section 3.4) are plain integers in `StreamResetCode`.

All of them are `KvspError`s, so the rest of the project can report them without a
translation table.
"""

from __future__ import annotations

from enum import IntEnum

from ..errors import KvspError

__all__ = [
    "SessionCloseCode",
    "RequestErrorCode",
    "PublishDoneCode",
    "StreamResetCode",
    "MoqtError",
    "SessionError",
    "ProtocolViolation",
    "BufferReadError",
    "InvalidRequestId",
    "DuplicateTrackAlias",
    "KeyValueFormattingError",
    "InvalidPath",
    "MalformedPath",
    "AuthTokenCacheOverflow",
    "DuplicateAuthTokenAlias",
    "MalformedAuthTokenSession",
    "UnknownAuthTokenAlias",
    "InvalidAuthority",
    "MalformedAuthority",
    "ObjectTooLarge",
    "RequestError",
    "InternalRequestError",
    "Unauthorized",
    "RequestTimeout",
    "NotSupported",
    "MalformedAuthToken",
    "ExpiredAuthToken",
    "GoingAway",
    "ExcessiveLoad",
    "DoesNotExist",
    "InvalidRange",
    "MalformedTrack",
    "DuplicateSubscription",
    "Uninterested",
    "PrefixOverlap",
    "NamespaceTooLarge",
    "InvalidJoiningRequestId",
    "UnsupportedExtension",
    "Redirected",
    "request_error_for",
    "SessionClosed",
    "DataStreamReset",
    "PublishDoneError",
    "StreamClosed",
]


class SessionCloseCode(IntEnum):
    """Session termination error codes (draft-18 section 3.6)."""

    NO_ERROR = 0x0
    INTERNAL_ERROR = 0x1
    UNAUTHORIZED = 0x2
    PROTOCOL_VIOLATION = 0x3
    INVALID_REQUEST_ID = 0x4
    DUPLICATE_TRACK_ALIAS = 0x5
    KEY_VALUE_FORMATTING_ERROR = 0x6
    INVALID_PATH = 0x8
    MALFORMED_PATH = 0x9
    GOAWAY_TIMEOUT = 0x10
    CONTROL_MESSAGE_TIMEOUT = 0x11
    DATA_STREAM_TIMEOUT = 0x12
    AUTH_TOKEN_CACHE_OVERFLOW = 0x13
    DUPLICATE_AUTH_TOKEN_ALIAS = 0x14
    VERSION_NEGOTIATION_FAILED = 0x15
    MALFORMED_AUTH_TOKEN = 0x16
    UNKNOWN_AUTH_TOKEN_ALIAS = 0x17
    EXPIRED_AUTH_TOKEN = 0x18
    INVALID_AUTHORITY = 0x19
    MALFORMED_AUTHORITY = 0x1A


class RequestErrorCode(IntEnum):
    """REQUEST_ERROR codes (draft-18 section 15.11.2)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TIMEOUT = 0x2
    NOT_SUPPORTED = 0x3
    MALFORMED_AUTH_TOKEN = 0x4
    EXPIRED_AUTH_TOKEN = 0x5
    GOING_AWAY = 0x6
    EXCESSIVE_LOAD = 0x9
    DOES_NOT_EXIST = 0x10
    INVALID_RANGE = 0x11
    MALFORMED_TRACK = 0x12
    DUPLICATE_SUBSCRIPTION = 0x19
    UNINTERESTED = 0x20
    PREFIX_OVERLAP = 0x30
    NAMESPACE_TOO_LARGE = 0x31
    INVALID_JOINING_REQUEST_ID = 0x32
    UNSUPPORTED_EXTENSION = 0x33
    REDIRECT = 0x34
    CONFLICTING_FILTERS = 0x35  # draft-20+
    INVALID_FILTER = 0x36  # draft-20+


class PublishDoneCode(IntEnum):
    """PUBLISH_DONE status codes (draft-18 section 10.11)."""

    INTERNAL_ERROR = 0x0
    UNAUTHORIZED = 0x1
    TRACK_ENDED = 0x2
    SUBSCRIPTION_ENDED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    EXPIRED = 0x6
    UPDATE_FAILED = 0x8
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class StreamResetCode(IntEnum):
    """RESET_STREAM / STOP_SENDING codes (draft-18 section 3.4)."""

    INTERNAL_ERROR = 0x0
    CANCELLED = 0x1
    DELIVERY_TIMEOUT = 0x2
    SESSION_CLOSED = 0x3
    GOING_AWAY = 0x4
    TOO_FAR_BEHIND = 0x5
    UNKNOWN_OBJECT_STATUS = 0x6
    EXPIRED_AUTH_TOKEN = 0x7
    EXCESSIVE_LOAD = 0x9
    MALFORMED_TRACK = 0x12


class MoqtError(KvspError):
    """Root of the MOQT errors; `error_code` is the wire code of its family."""

    problem = "kvsp-transport"
    status = 502
    title = "MOQT error"
    error_code: int = 0

    def __init__(self, reason: str = "", *, error_code: int | None = None) -> None:
        super().__init__(reason or self.title)
        if error_code is not None:
            self.error_code = error_code
        self.reason = reason or self.title


# ---------------------------------------------------------------------------
# Session errors: the connection is closed with error_code.
# ---------------------------------------------------------------------------


class SessionError(MoqtError):
    """A condition the draft says closes the session."""

    title = "MOQT session error"
    error_code = SessionCloseCode.INTERNAL_ERROR


class ProtocolViolation(SessionError):
    """Malformed or disallowed input from the peer."""

    title = "Protocol violation"
    error_code = SessionCloseCode.PROTOCOL_VIOLATION


class BufferReadError(ProtocolViolation):
    """Input ended inside a field; on a framed message that is a protocol violation."""

    title = "Truncated input"


class ObjectTooLarge(ProtocolViolation):
    """An object or field length over this endpoint's configured maximum."""

    title = "Object too large"


class InvalidRequestId(SessionError):
    title = "Invalid request ID"
    error_code = SessionCloseCode.INVALID_REQUEST_ID


class DuplicateTrackAlias(SessionError):
    title = "Duplicate track alias"
    error_code = SessionCloseCode.DUPLICATE_TRACK_ALIAS


class KeyValueFormattingError(SessionError):
    title = "Key-value formatting error"
    error_code = SessionCloseCode.KEY_VALUE_FORMATTING_ERROR


class InvalidPath(SessionError):
    title = "Invalid path"
    error_code = SessionCloseCode.INVALID_PATH


class MalformedPath(SessionError):
    title = "Malformed path"
    error_code = SessionCloseCode.MALFORMED_PATH


class AuthTokenCacheOverflow(SessionError):
    title = "Authorization token cache overflow"
    error_code = SessionCloseCode.AUTH_TOKEN_CACHE_OVERFLOW


class DuplicateAuthTokenAlias(SessionError):
    title = "Duplicate authorization token alias"
    error_code = SessionCloseCode.DUPLICATE_AUTH_TOKEN_ALIAS


class MalformedAuthTokenSession(SessionError):
    title = "Malformed authorization token"
    error_code = SessionCloseCode.MALFORMED_AUTH_TOKEN


class UnknownAuthTokenAlias(SessionError):
    title = "Unknown authorization token alias"
    error_code = SessionCloseCode.UNKNOWN_AUTH_TOKEN_ALIAS


class InvalidAuthority(SessionError):
    title = "Invalid authority"
    error_code = SessionCloseCode.INVALID_AUTHORITY


class MalformedAuthority(SessionError):
    title = "Malformed authority"
    error_code = SessionCloseCode.MALFORMED_AUTHORITY


# ---------------------------------------------------------------------------
# Request errors: one request fails, the session lives on.
# ---------------------------------------------------------------------------


class RequestError(MoqtError):
    """A REQUEST_ERROR, sent or received.

    `retry_interval` is the wire value: 0 means do not retry, otherwise the minimum
    delay in milliseconds plus one. `redirect` is set only for REDIRECT.
    """

    title = "Request failed"
    error_code = RequestErrorCode.INTERNAL_ERROR

    def __init__(
        self,
        reason: str = "",
        *,
        error_code: int | None = None,
        retry_interval: int = 0,
        redirect: object | None = None,
    ) -> None:
        super().__init__(reason, error_code=error_code)
        self.retry_interval = retry_interval
        self.redirect = redirect

    @property
    def moqt_code(self) -> int:  # type: ignore[override]
        return int(self.error_code)


class InternalRequestError(RequestError):
    title = "Internal error"
    error_code = RequestErrorCode.INTERNAL_ERROR


class Unauthorized(RequestError):
    title = "Unauthorized"
    status = 401
    problem = "kvsp-unauthorized"
    error_code = RequestErrorCode.UNAUTHORIZED


class RequestTimeout(RequestError):
    title = "Timeout"
    status = 504
    error_code = RequestErrorCode.TIMEOUT


class NotSupported(RequestError):
    title = "Not supported"
    status = 501
    error_code = RequestErrorCode.NOT_SUPPORTED


class MalformedAuthToken(RequestError):
    title = "Malformed authorization token"
    status = 401
    problem = "kvsp-unauthorized"
    error_code = RequestErrorCode.MALFORMED_AUTH_TOKEN


class ExpiredAuthToken(RequestError):
    title = "Expired authorization token"
    status = 401
    problem = "kvsp-unauthorized"
    error_code = RequestErrorCode.EXPIRED_AUTH_TOKEN


class GoingAway(RequestError):
    title = "Going away"
    status = 503
    error_code = RequestErrorCode.GOING_AWAY


class ExcessiveLoad(RequestError):
    title = "Excessive load"
    status = 503
    error_code = RequestErrorCode.EXCESSIVE_LOAD


class DoesNotExist(RequestError):
    title = "Does not exist"
    status = 404
    problem = "kvsp-not-found"
    error_code = RequestErrorCode.DOES_NOT_EXIST


class InvalidRange(RequestError):
    title = "Invalid range"
    status = 416
    error_code = RequestErrorCode.INVALID_RANGE


class MalformedTrack(RequestError):
    title = "Malformed track"
    error_code = RequestErrorCode.MALFORMED_TRACK


class DuplicateSubscription(RequestError):
    title = "Duplicate subscription"
    status = 409
    error_code = RequestErrorCode.DUPLICATE_SUBSCRIPTION


class Uninterested(RequestError):
    title = "Uninterested"
    error_code = RequestErrorCode.UNINTERESTED


class PrefixOverlap(RequestError):
    title = "Prefix overlap"
    status = 409
    error_code = RequestErrorCode.PREFIX_OVERLAP


class NamespaceTooLarge(RequestError):
    title = "Namespace too large"
    error_code = RequestErrorCode.NAMESPACE_TOO_LARGE


class InvalidJoiningRequestId(RequestError):
    title = "Invalid joining request ID"
    status = 400
    error_code = RequestErrorCode.INVALID_JOINING_REQUEST_ID


class UnsupportedExtension(RequestError):
    title = "Unsupported extension"
    error_code = RequestErrorCode.UNSUPPORTED_EXTENSION


class Redirected(RequestError):
    title = "Redirect"
    status = 307
    error_code = RequestErrorCode.REDIRECT


_REQUEST_ERRORS: dict[int, type[RequestError]] = {
    cls.error_code: cls
    for cls in (
        InternalRequestError,
        Unauthorized,
        RequestTimeout,
        NotSupported,
        MalformedAuthToken,
        ExpiredAuthToken,
        GoingAway,
        ExcessiveLoad,
        DoesNotExist,
        InvalidRange,
        MalformedTrack,
        DuplicateSubscription,
        Uninterested,
        PrefixOverlap,
        NamespaceTooLarge,
        InvalidJoiningRequestId,
        UnsupportedExtension,
        Redirected,
    )
}


def request_error_for(
    error_code: int, reason: str = "", *, retry_interval: int = 0, redirect: object | None = None
) -> RequestError:
    """The RequestError subclass for a received code.

    An unknown code (a grease value, or one from a later draft) is treated as
    INTERNAL_ERROR (section 14) but keeps its wire value in `error_code`.
    """
    cls = _REQUEST_ERRORS.get(error_code, RequestError)
    return cls(reason, error_code=error_code, retry_interval=retry_interval, redirect=redirect)


# ---------------------------------------------------------------------------
# Errors of the local API (not sent on the wire as such).
# ---------------------------------------------------------------------------


class SessionClosed(MoqtError):
    """The session or its QUIC connection ended while a request was in progress.

    `error_code` is the session close code received or sent, when known.
    """

    title = "Session closed"
    error_code = SessionCloseCode.NO_ERROR


class DataStreamReset(MoqtError):
    """A data stream was reset before its FIN, so objects may be missing."""

    title = "Data stream reset"
    error_code = StreamResetCode.INTERNAL_ERROR


class PublishDoneError(MoqtError):
    """The publisher ended a subscription with a status other than a normal end."""

    title = "Subscription ended by the publisher"
    error_code = PublishDoneCode.INTERNAL_ERROR


class StreamClosed(MoqtError):
    """A write to a stream the peer stopped, or that was already closed."""

    title = "Stream closed"
    error_code = StreamResetCode.CANCELLED
