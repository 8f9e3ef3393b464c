"""One exception hierarchy for the whole project.

Each error knows the RFC 9457 problem type and HTTP status it maps to, and the MOQT
REQUEST_ERROR code it maps to, so that the place that reports an error needs no table.
"""

from __future__ import annotations

PROBLEM_PREFIX = "urn:kvsp:problem:"


class KvspError(Exception):
    """Root of every error raised by kvsp-moq."""

    problem: str = "kvsp-internal"
    status: int = 500
    title: str = "Internal error"
    moqt_code: int = 0x0  # INTERNAL_ERROR

    def __init__(self, detail: str = "", *, member: str | None = None) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.member = member

    @property
    def problem_type(self) -> str:
        return PROBLEM_PREFIX + self.problem


class ProtocolViolation(KvspError):
    """Input that breaks the protocol: a malformed record, container or message."""

    problem = "kvsp-bad-record"
    status = 400
    title = "Malformed input"
    moqt_code = 0x3  # PROTOCOL_VIOLATION


class BadRecord(ProtocolViolation):
    """A JSON record that fails validation; `member` names the offending member."""

    def __init__(self, detail: str, *, member: str | None = None) -> None:
        if member and not detail.startswith(member):
            detail = f"{member}: {detail}"
        super().__init__(detail, member=member)


class BadContainer(ProtocolViolation):
    """A KVB1 container that cannot be parsed."""

    title = "Malformed KV block container"


class BadDescriptor(BadRecord):
    """A Compatibility Descriptor that is invalid."""

    title = "Invalid compatibility descriptor"


class DigestMismatch(KvspError):
    """Bytes whose digest differs from the one promised by a record or a header."""

    problem = "kvsp-digest-mismatch"
    status = 502
    title = "Digest mismatch"
    moqt_code = 0x3


class Unauthorized(KvspError):
    problem = "kvsp-unauthorized"
    status = 401
    title = "Unauthorized"
    moqt_code = 0x1  # UNAUTHORIZED


class ForbiddenScope(KvspError):
    problem = "kvsp-forbidden-scope"
    status = 403
    title = "Not authorized for this scope"
    moqt_code = 0x1


class ForbiddenRole(ForbiddenScope):
    """A principal none of whose roles may take the action (kvsp_moq.auth.PERMISSIONS)."""

    problem = "kvsp-forbidden-role"
    title = "No role that may do this"


class NotFound(KvspError):
    problem = "kvsp-not-found"
    status = 404
    title = "Not found"
    moqt_code = 0x10  # DOES_NOT_EXIST


class LayersUnavailable(NotFound):
    problem = "kvsp-layers-unavailable"
    title = "Layers unavailable"


class LeaseQuota(KvspError):
    problem = "kvsp-lease-quota"
    status = 429
    title = "Lease quota exceeded"


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


class TransportError(KvspError):
    """A peer could not be reached, or a connection broke mid-transfer."""

    problem = "kvsp-transport"
    status = 502
    title = "Transport failure"


class SettingError(ValueError):
    """A setting (an option, an environment variable) that cannot be used: commands report it
    on one line and exit with status 2, servers refuse to start."""
