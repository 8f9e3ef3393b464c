"""The MOQT part of the error tree (`kvsp_moq.errors`), gathered for the MOQT layer.

Three code spaces exist in draft-18 and they overlap numerically, so each family has
its own base class:

* `SessionError` - session termination codes (section 3.6), sent in CONNECTION_CLOSE.
  Raised by the session when the peer broke the protocol; the session closes the QUIC
  connection with `error_code` and the message as reason. Parsers raise
  `ProtocolViolation` (shared with the rest of KVSP), which closes the session too.
* `RequestError` - REQUEST_ERROR codes (section 10.6), the answer to one request.
  An application handler raises one (or any `KvspError`, answered with its
  `request_code`) to reject a request; the subscriber API raises one when the peer
  rejected its request.
* Stream reset codes (section 3.4) are plain integers in `StreamResetCode`.

The classes live in `kvsp_moq.errors`, the one tree of the project.
"""

from __future__ import annotations

from ..errors import (
    SESSION_ENDING,
    AuthTokenCacheOverflow,
    BufferReadError,
    DataStreamReset,
    DoesNotExist,
    DuplicateAuthTokenAlias,
    DuplicateSubscription,
    DuplicateTrackAlias,
    ExcessiveLoad,
    ExpiredAuthToken,
    GoingAway,
    InternalRequestError,
    InvalidAuthority,
    InvalidJoiningRequestId,
    InvalidPath,
    InvalidRange,
    InvalidRequestId,
    KeyValueFormattingError,
    KvspError,
    MalformedAuthority,
    MalformedAuthToken,
    MalformedAuthTokenSession,
    MalformedPath,
    MalformedTrack,
    MoqtError,
    NamespaceTooLarge,
    NotSupported,
    ObjectTooLarge,
    PrefixOverlap,
    ProtocolViolation,
    PublishDoneCode,
    PublishDoneError,
    Redirected,
    RequestError,
    RequestErrorCode,
    RequestTimeout,
    SessionCloseCode,
    SessionClosed,
    SessionError,
    StreamClosed,
    StreamResetCode,
    Unauthorized,
    UnauthorizedRequest,
    Uninterested,
    UnknownAuthTokenAlias,
    UnsupportedExtension,
    as_request_error,
    request_error_for,
)

__all__ = [
    "KvspError",
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
    "SESSION_ENDING",
    "RequestError",
    "InternalRequestError",
    "Unauthorized",
    "UnauthorizedRequest",
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
    "as_request_error",
    "SessionClosed",
    "DataStreamReset",
    "PublishDoneError",
    "StreamClosed",
]
