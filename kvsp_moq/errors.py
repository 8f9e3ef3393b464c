"""One exception hierarchy for the whole project, every class importable from here.

Each class maps to one RFC 9457 problem type (with its HTTP status) and one MOQT code: the
REQUEST_ERROR code a MOQT request that fails with it is answered with (`request_code`), and, for
the errors that end a MOQT session, the session close code (`session_code`). The place that
reports an error therefore needs no table of its own, on either transport.

    KvspError                            kvsp-internal 500 · INTERNAL_ERROR
    ├── ProtocolViolation                kvsp-bad-record 400 · closes a MOQT session: PROTOCOL_VIOLATION
    │   ├── BadRecord                    a JSON record that fails validation (`member` names the member)
    │   │   └── BadDescriptor            a Compatibility Descriptor (§4.1)
    │   ├── BadContainer                 a KVB1 container (§4.3) · MALFORMED_TRACK
    │   ├── BufferReadError              MOQT bytes that end inside a field
    │   └── ObjectTooLarge               a MOQT object over this endpoint's limit
    ├── DigestMismatch                   kvsp-digest-mismatch 502 · MALFORMED_TRACK
    ├── Unauthorized                     kvsp-unauthorized 401 · UNAUTHORIZED
    ├── ForbiddenScope                   kvsp-forbidden-scope 403 · UNAUTHORIZED
    │   └── ForbiddenRole                kvsp-forbidden-role 403
    ├── NotFound                         kvsp-not-found 404 · DOES_NOT_EXIST
    │   ├── LayersUnavailable            kvsp-layers-unavailable
    │   │   └── CandidatesExhausted      every source of a block failed (`kvsp_moq.fetch`)
    │   └── CodecUnavailable             kvsp-codec-unavailable
    ├── LeaseQuota                       kvsp-lease-quota 429 · EXCESSIVE_LOAD
    ├── StaleEpoch                       kvsp-stale-epoch 409
    ├── PreconditionFailed               kvsp-exists 412
    ├── PreconditionRequired             kvsp-precondition-required 428
    ├── PayloadTooLarge                  kvsp-too-large 413
    ├── LengthRequired                   kvsp-length-required 411
    ├── Overloaded                       kvsp-overloaded 503 (Retry-After) · EXCESSIVE_LOAD
    ├── StoreFull                        kvsp-store-full 507 · EXCESSIVE_LOAD
    ├── NoActiveInstance                 kvsp-no-instance 503 · EXCESSIVE_LOAD
    ├── NotActive                        kvsp-not-active 503 · GOING_AWAY
    ├── PrefixUnavailable                kvsp-prefix-unavailable 409 · DOES_NOT_EXIST
    ├── SessionConflict                  kvsp-session-exists 409
    ├── NoLiveKV                         kvsp-no-live-kv 409: this instance publishes no live KV
    ├── SettingError                     kvsp-bad-setting (also a ValueError): exit status 2
    │   └── UsageError                   command-line arguments that cannot be acted on
    ├── Failed                           an operation a command tried: exit status 1
    ├── NamespaceError                   (also a RuntimeError) network namespaces, links or
    │                                    addresses could not be made (`kvsp_moq.netns`): exit status 2
    ├── TransportError                   kvsp-transport 502: a peer unreachable, a connection broken
    │   ├── StoreUnavailable             503: the replica store cannot be reached
    │   └── Http1Error                   the block client's HTTP/1.1: ConnectError, ConnectTimeout,
    │                                    ReadTimeout, RemoteProtocolError
    └── MoqtError                        kvsp-transport 502; `error_code` is the wire code
        ├── SessionError                 ends the session; `error_code` is its close code
        │   └── InvalidRequestId, DuplicateTrackAlias, KeyValueFormattingError, InvalidPath,
        │       MalformedPath, AuthTokenCacheOverflow, DuplicateAuthTokenAlias,
        │       MalformedAuthTokenSession, UnknownAuthTokenAlias, InvalidAuthority, MalformedAuthority
        ├── RequestError                 one REQUEST_ERROR, sent or received; `error_code` is its code
        │   ├── UnauthorizedRequest      (also Unauthorized)
        │   ├── MalformedAuthToken       (also Unauthorized)
        │   ├── ExpiredAuthToken         (also Unauthorized)
        │   ├── DoesNotExist             (also NotFound)
        │   └── InternalRequestError, RequestTimeout, NotSupported, GoingAway, ExcessiveLoad,
        │       InvalidRange, MalformedTrack, DuplicateSubscription, Uninterested, PrefixOverlap,
        │       NamespaceTooLarge, InvalidJoiningRequestId, UnsupportedExtension, Redirected
        ├── SessionClosed                the session ended while a request was in progress
        │   └── CertificateRejected      this client did not trust the peer's certificate
        ├── DataStreamReset              a data stream was reset before its FIN
        ├── PublishDoneError             a subscription ended with a status other than a normal end
        └── StreamClosed                 a write to a stream the peer stopped

A MOQT error that is also a KVSP condition (a refusal as UNAUTHORIZED, an answer DOES_NOT_EXIST)
derives from both, so `except NotFound` catches a missing block on HTTP and on MOQT alike. The
wire code tables of MOQT are here too, because the classes carry them.
"""

from __future__ import annotations

from enum import IntEnum

PROBLEM_PREFIX = "urn:kvsp:problem:"


# --------------------------------------------------------------------------- MOQT wire codes


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


# --------------------------------------------------------------------------- the root


class KvspError(Exception):
    """Root of every error raised by kvsp-moq."""

    problem: str = "kvsp-internal"
    status: int = 500
    title: str = "Internal error"
    request_code: int = RequestErrorCode.INTERNAL_ERROR
    session_code: int = SessionCloseCode.INTERNAL_ERROR

    def __init__(self, detail: str = "", *, member: str | None = None) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.member = member

    @property
    def problem_type(self) -> str:
        return PROBLEM_PREFIX + self.problem

    @property
    def reason(self) -> str:
        """The text a MOQT message carries for it (REQUEST_ERROR, CONNECTION_CLOSE)."""
        return self.detail


# --------------------------------------------------------------------------- KVSP conditions


class ProtocolViolation(KvspError):
    """Input that breaks the protocol: a malformed record, container or MOQT message.

    On a MOQT session it ends the session with PROTOCOL_VIOLATION."""

    problem = "kvsp-bad-record"
    status = 400
    title = "Malformed input"
    session_code: int = SessionCloseCode.PROTOCOL_VIOLATION


class BadRecord(ProtocolViolation):
    """A JSON record that fails validation; `member` names the offending member."""

    def __init__(self, detail: str, *, member: str | None = None) -> None:
        if member and not detail.startswith(member):
            detail = f"{member}: {detail}"
        super().__init__(detail, member=member)


class BadDescriptor(BadRecord):
    """A Compatibility Descriptor that is invalid."""

    title = "Invalid compatibility descriptor"


class BadContainer(ProtocolViolation):
    """A KVB1 container that cannot be parsed."""

    title = "Malformed KV block container"
    request_code: int = RequestErrorCode.MALFORMED_TRACK


class BufferReadError(ProtocolViolation):
    """Input ended inside a field; on a framed message that is a protocol violation."""

    title = "Truncated input"


class ObjectTooLarge(ProtocolViolation):
    """An object or field length over this endpoint's configured maximum."""

    title = "Object too large"


class DigestMismatch(KvspError):
    """Bytes whose digest differs from the one promised by a record or a header."""

    problem = "kvsp-digest-mismatch"
    status = 502
    title = "Digest mismatch"
    request_code: int = RequestErrorCode.MALFORMED_TRACK


class Unauthorized(KvspError):
    """No credentials, or credentials that do not verify."""

    problem = "kvsp-unauthorized"
    status = 401
    title = "Unauthorized"
    request_code: int = RequestErrorCode.UNAUTHORIZED
    session_code: int = SessionCloseCode.UNAUTHORIZED


class ForbiddenScope(KvspError):
    problem = "kvsp-forbidden-scope"
    status = 403
    title = "Not authorized for this scope"
    request_code: int = RequestErrorCode.UNAUTHORIZED


class ForbiddenRole(ForbiddenScope):
    """A principal none of whose roles may take the action (kvsp_moq.auth.PERMISSIONS)."""

    problem = "kvsp-forbidden-role"
    title = "No role that may do this"


class NotFound(KvspError):
    problem = "kvsp-not-found"
    status = 404
    title = "Not found"
    request_code: int = RequestErrorCode.DOES_NOT_EXIST


class LayersUnavailable(NotFound):
    problem = "kvsp-layers-unavailable"
    title = "Layers unavailable"


class CandidatesExhausted(LayersUnavailable):
    """Every candidate of a block failed before the range was complete (`kvsp_moq.fetch`);
    `failures` lists (holder, reason) for each one given up."""

    failures: list[tuple[str, str]]


class CodecUnavailable(NotFound):
    """The block is held, but not in the requested codec (a holder does not transcode)."""

    problem = "kvsp-codec-unavailable"
    title = "Codec unavailable"


class LeaseQuota(KvspError):
    problem = "kvsp-lease-quota"
    status = 429
    title = "Lease quota exceeded"
    request_code: int = RequestErrorCode.EXCESSIVE_LOAD


class StaleEpoch(KvspError):
    problem = "kvsp-stale-epoch"
    status = 409
    title = "Stale epoch"


class PreconditionFailed(KvspError):
    problem = "kvsp-exists"
    status = 412
    title = "Precondition failed"


class PreconditionRequired(KvspError):
    problem = "kvsp-precondition-required"
    status = 428
    title = "Precondition required"


class PayloadTooLarge(KvspError):
    problem = "kvsp-too-large"
    status = 413
    title = "Content too large"


class LengthRequired(KvspError):
    """A body whose size must be known before it is read came without Content-Length."""

    problem = "kvsp-length-required"
    status = 411
    title = "Length required"


class Overloaded(KvspError):
    """A bounded resource (connections, octets of bodies being received) is in use; the
    request may be retried after `retry_after` seconds (sent as Retry-After)."""

    problem = "kvsp-overloaded"
    status = 503
    title = "Overloaded"
    request_code: int = RequestErrorCode.EXCESSIVE_LOAD
    retry_after: int = 1

    def __init__(self, detail: str = "", *, member: str | None = None,
                 retry_after: int = 1) -> None:
        super().__init__(detail, member=member)
        self.retry_after = retry_after


class StoreFull(KvspError):
    """No room can be made without evicting leased or busy replicas."""

    problem = "kvsp-store-full"
    status = 507
    title = "Insufficient storage"
    request_code: int = RequestErrorCode.EXCESSIVE_LOAD


class NoActiveInstance(KvspError):
    """No active instance can take the request and none could be started."""

    problem = "kvsp-no-instance"
    status = 503
    title = "No active instance"
    request_code: int = RequestErrorCode.EXCESSIVE_LOAD


class NotActive(KvspError):
    """The instance is draining or sleeping and takes no new sessions (§6.3)."""

    problem = "kvsp-not-active"
    status = 503
    title = "Instance not active"
    request_code: int = RequestErrorCode.GOING_AWAY


class PrefixUnavailable(KvspError):
    """A resume needs prompt blocks that no source can deliver (their tokens are unknown here)."""

    problem = "kvsp-prefix-unavailable"
    status = 409
    title = "Prompt blocks unavailable"
    request_code: int = RequestErrorCode.DOES_NOT_EXIST


class SessionConflict(KvspError):
    """A session that exists already on this instance (§6.8 resume of a live session)."""

    problem = "kvsp-session-exists"
    status = 409
    title = "Session exists"


class NoLiveKV(KvspError):
    """A prefill for another instance asked of one that cannot publish it live (no relay, or
    live KV turned off): the front end sends the whole request to one instance instead."""

    problem = "kvsp-no-live-kv"
    status = 409
    title = "No live KV here"


class SettingError(KvspError, ValueError):
    """A setting (an option, an environment variable) that cannot be used: commands report it
    on one line and exit with status 2, servers refuse to start."""

    problem = "kvsp-bad-setting"
    status = 400
    title = "Invalid setting"


class UsageError(SettingError):
    """Command-line arguments that cannot be acted on: one line and exit status 2."""

    title = "Invalid arguments"


class Failed(KvspError):
    """An operation a command tried that did not succeed: one line and exit status 1."""

    title = "Failed"


class NamespaceError(KvspError, RuntimeError):
    """Network namespaces, links or addresses could not be made (the `ip`, `tc` or `nft`
    command's answer, or why they cannot run here): commands that build a fleet on one machine
    report it on one line and exit with status 2."""

    title = "Network namespaces unavailable"


class TransportError(KvspError):
    """A peer could not be reached, or a connection broke mid-transfer."""

    problem = "kvsp-transport"
    status = 502
    title = "Transport failure"


class StoreUnavailable(TransportError):
    """The replica store cannot be reached or refuses writes (failover, restart, full)."""

    status = 503
    title = "Replica store unavailable"


class Http1Error(TransportError):
    """A source that could not be reached or did not answer in HTTP/1.1 (the block client's
    own HTTP/1.1 connections, `kvsp_moq.fetch.http1`)."""


class ConnectError(Http1Error):
    title = "Connection failed"


class ConnectTimeout(Http1Error):
    title = "Connection timed out"


class ReadTimeout(Http1Error):
    title = "Read timed out"


class RemoteProtocolError(Http1Error):
    title = "Not HTTP/1.1"
    #: set when the connection closed before any octet of the response: a kept-alive
    #: connection the server had closed, so the request may go again on a new one
    before_head: bool = False


# --------------------------------------------------------------------------- MOQT


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


class SessionError(MoqtError):
    """A condition the draft says closes the session (CONNECTION_CLOSE with `error_code`).

    A `ProtocolViolation` closes the session too; it is not a `SessionError` because it is
    not MOQT's alone (a malformed record or container over HTTP is the same condition)."""

    title = "MOQT session error"
    error_code = SessionCloseCode.INTERNAL_ERROR
    session_code: int = SessionCloseCode.INTERNAL_ERROR

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.session_code = cls.error_code

    def __init__(self, reason: str = "", *, error_code: int | None = None) -> None:
        super().__init__(reason, error_code=error_code)
        self.session_code = int(self.error_code)


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


#: The errors that end a MOQT session when the session's own processing raises them.
SESSION_ENDING: tuple[type[KvspError], ...] = (SessionError, ProtocolViolation)


class RequestError(MoqtError):
    """A REQUEST_ERROR, sent or received.

    `retry_interval` is the wire value: 0 means do not retry, otherwise the minimum
    delay in milliseconds plus one. `redirect` is set only for REDIRECT.
    """

    title = "Request failed"
    error_code = RequestErrorCode.INTERNAL_ERROR
    request_code: int = RequestErrorCode.INTERNAL_ERROR

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.request_code = cls.error_code

    def __init__(
        self,
        reason: str = "",
        *,
        error_code: int | None = None,
        retry_interval: int = 0,
        redirect: object | None = None,
    ) -> None:
        super().__init__(reason, error_code=error_code)
        self.request_code = int(self.error_code)
        self.retry_interval = retry_interval
        self.redirect = redirect


class InternalRequestError(RequestError):
    title = "Internal error"
    error_code = RequestErrorCode.INTERNAL_ERROR


class UnauthorizedRequest(RequestError, Unauthorized):
    """A request refused UNAUTHORIZED (sent or received)."""

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


class MalformedAuthToken(RequestError, Unauthorized):
    title = "Malformed authorization token"
    status = 401
    problem = "kvsp-unauthorized"
    error_code = RequestErrorCode.MALFORMED_AUTH_TOKEN


class ExpiredAuthToken(RequestError, Unauthorized):
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


class DoesNotExist(RequestError, NotFound):
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
        UnauthorizedRequest,
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


def as_request_error(error: KvspError) -> RequestError:
    """The REQUEST_ERROR that answers a MOQT request failing with `error`: itself when it is
    one, otherwise the class of its `request_code` carrying its detail."""
    if isinstance(error, RequestError):
        return error
    return request_error_for(error.request_code, error.detail)


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


class CertificateRejected(SessionClosed):
    """A session could not open because this client did not trust the peer's certificate;
    its text says what failed and the options that fix it (`kvsp_moq.moqt.certs`)."""


def reason_of(error: BaseException, *, named: bool = False) -> str:
    """The text to put after "unreachable:" and the like: a KVSP error's detail, else the
    exception's text, else its class name (a bare TimeoutError says nothing, and "()" tells a
    user nothing either). `named` puts the class name first ("ConnectError: ...")."""
    detail = getattr(error, "detail", None)
    text = detail if isinstance(detail, str) and detail else str(error)
    name = type(error).__name__
    if not text:
        return name
    return f"{name}: {text}" if named else text
