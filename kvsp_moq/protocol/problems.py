"""RFC 9457 problem details, tied to the project's error hierarchy.

A server turns any `KvspError` into a problem document; a client turns a problem document back
into the same exception class, so both ends of an HTTP exchange speak in one set of errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvsp_moq import errors

MEDIA_TYPE = "application/problem+json"

_BY_NAME: dict[str, type[errors.KvspError]] = {}


def _register(cls: type[errors.KvspError]) -> None:
    _BY_NAME.setdefault(cls.problem, cls)
    for sub in cls.__subclasses__():
        _register(sub)


_register(errors.KvspError)


@dataclass(frozen=True)
class Problem:
    type: str
    title: str
    status: int
    detail: str = ""
    instance: str | None = None
    extensions: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_error(cls, err: errors.KvspError, *, instance: str | None = None) -> "Problem":
        ext: dict[str, Any] = {}
        if err.member:
            ext["member"] = err.member
        return cls(err.problem_type, err.title, err.status, err.detail, instance, ext)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status}
        if self.detail:
            out["detail"] = self.detail
        if self.instance:
            out["instance"] = self.instance
        out.update(self.extensions)
        return out

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_json(cls, data: Any, *, status: int = 0) -> "Problem":
        if not isinstance(data, dict):
            return cls("about:blank", "Error", status, str(data)[:512])
        known = {"type", "title", "status", "detail", "instance"}
        raw_status = data.get("status")
        return cls(
            type=str(data.get("type", "about:blank")),
            title=str(data.get("title", "")),
            status=raw_status if isinstance(raw_status, int) else status,
            detail=str(data.get("detail", "")),
            instance=data.get("instance"),
            extensions={k: val for k, val in data.items() if k not in known},
        )

    @property
    def name(self) -> str | None:
        """The problem name (e.g. "kvsp-lease-quota"), or None for a foreign type."""
        if self.type.startswith(errors.PROBLEM_PREFIX):
            return self.type[len(errors.PROBLEM_PREFIX):]
        return None

    def to_error(self) -> errors.KvspError:
        cls = _BY_NAME.get(self.name or "", None)
        if cls is None:
            cls = {400: errors.ProtocolViolation, 401: errors.Unauthorized,
                   403: errors.ForbiddenScope, 404: errors.NotFound,
                   412: errors.PreconditionFailed, 428: errors.PreconditionRequired,
                   429: errors.LeaseQuota}.get(self.status, errors.KvspError)
        err = cls.__new__(cls)
        errors.KvspError.__init__(err, self.detail or self.title,
                                  member=self.extensions.get("member"))
        if cls is errors.KvspError and self.status:
            err.status = self.status  # no class of ours for it: keep the status it came with
        return err


def problem_for_status(status: int, detail: str) -> Problem:
    """A problem for plain HTTP failures (unknown route, wrong method)."""
    titles = {404: "Not found", 405: "Method not allowed", 413: "Payload too large"}
    return Problem("about:blank", titles.get(status, "Error"), status, detail)
