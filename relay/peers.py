"""The relay's MOQT sessions: a client that connected, or the upstream relay (`Peer`); and
what the relay answers downstream when a request it forwarded to one of them failed."""

from __future__ import annotations

import asyncio

from kvsp_moq.moqt.errors import (
    DoesNotExist,
    InternalRequestError,
    RequestError,
    RequestTimeout,
    SessionClosed,
)
from kvsp_moq.moqt.quic import IncomingRequest, MoqtConnection

__all__ = ["Peer", "request_error"]


class Peer:
    """One MOQT session of the relay: a client that connected, or the upstream relay."""

    def __init__(self, ident: int, connection: MoqtConnection | None, *, upstream: bool = False) -> None:
        self.id = ident
        # The upstream's Peer exists before its connection (its handlers need it); the link
        # sets it before any use.
        self.connection: MoqtConnection = connection  # type: ignore[assignment]  # None until then
        self.is_upstream = upstream

    @property
    def alive(self) -> bool:
        return self.connection is not None and not self.connection.is_closed

    def tokens(self, request: IncomingRequest) -> list[bytes]:
        """The request's tokens, then those of the session's SETUP."""
        return [t for t in request.authorization if t] + self.tokens_of_session()

    def tokens_of_session(self) -> list[bytes]:
        """The tokens of the session's SETUP."""
        setup = self.connection.peer_setup if self.connection is not None else None
        if setup is None:
            return []
        return [t.value for t in setup.authorization_tokens if t.value]

    def __repr__(self) -> str:
        return f"<peer {self.id}{' upstream' if self.is_upstream else ''}>"


def request_error(error: BaseException) -> RequestError:
    """The REQUEST_ERROR to answer downstream when an upstream request failed."""
    if isinstance(error, RequestError):
        return type(error)(error.reason, error_code=int(error.error_code),
                           retry_interval=error.retry_interval)
    if isinstance(error, asyncio.TimeoutError):
        return RequestTimeout("the publisher did not answer in time")
    if isinstance(error, SessionClosed):
        return DoesNotExist("the publisher went away")
    if isinstance(error, asyncio.CancelledError):
        return InternalRequestError("relay shutting down")
    return InternalRequestError(f"upstream request failed: {error}")
