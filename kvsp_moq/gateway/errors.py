"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status an OpenAI client acts on (400, 401, 403, 404, 429, 503, ...).

The gateway answers in the API its clients speak, not in problem documents: an OpenAI client
raises `BadRequestError`, `NotFoundError`, `RateLimitError`... from the status and shows the
message. A KVSP error (from the gateway's own checks, or relayed from the PC or an instance)
keeps its problem name as the "code", so that a client that knows KVSP can still tell
`kvsp-forbidden-role` from `kvsp-forbidden-scope`.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from kvsp_moq.errors import KvspError, Overloaded

__all__ = ["ApiError", "error_body", "error_response", "openai_type", "install_handlers"]

#: OpenAI's error types by HTTP status; any other 5xx is a "server_error".
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 411: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


def openai_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(Exception):
    """An error the gateway itself answers, in OpenAI's terms (unknown model, n > 1...)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or openai_type(status)

    @classmethod
    def from_kvsp(cls, err: KvspError) -> "ApiError":
        return cls(err.status, err.detail, param=err.member, code=err.problem)

    def to_json(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError | KvspError) -> Response:
    api = err if isinstance(err, ApiError) else ApiError.from_kvsp(err)
    headers: dict[str, str] = {}
    if api.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(err.retry_after)
    return Response(json.dumps(api.to_json()).encode(), status_code=api.status,
                    media_type="application/json", headers=headers)


async def _kvsp(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, (KvspError, ApiError))
    return error_response(exc)


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.status_code, str(exc.detail)))


def install_handlers(app: Any) -> None:
    """Every error of the app, its /metrics included, in OpenAI's shape."""
    app.add_exception_handler(KvspError, _kvsp)
    app.add_exception_handler(ApiError, _kvsp)
    app.add_exception_handler(HTTPException, _http)
