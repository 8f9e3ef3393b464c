"""Draft-14 Request IDs and their credit (section 9.1): each peer request must carry the
next ID and stay below the Maximum Request ID granted, which MAX_REQUEST_ID raises as
peer requests end; a request of ours beyond the peer's grant is queued until
MAX_REQUEST_ID arrives, and REQUESTS_BLOCKED is sent once per grant."""

from __future__ import annotations

from typing import Any

from .. import events as ev
from ..d18.messages import Message
from ..errors import InvalidRequestId, ProtocolViolation, SessionError
from . import messages as d14
from .request_state import Request14
from .session_state import SessionState14

__all__ = ["RequestCredit"]


class RequestCredit(SessionState14):
    """Part of `MoqtSession14`: the peer's Request IDs and ours, and the queue of requests
    waiting for credit."""

    def _on_max_request_id(self, message: d14.MaxRequestId, out: list[ev.MoqtEvent]) -> None:
        if message.request_id <= self._peer_grant:
            raise ProtocolViolation(f"MAX_REQUEST_ID {message.request_id} does not increase {self._peer_grant}")
        self._peer_grant = message.request_id
        self._flush_queue()

    def _on_requests_blocked(self, message: d14.RequestsBlocked, out: list[ev.MoqtEvent]) -> None:
        self._grant(force=True)

    def _accept_peer_id(self, request_id: int) -> None:
        if request_id != self._peer_next_id:
            raise InvalidRequestId(f"peer Request ID {request_id}, expected {self._peer_next_id}")
        if request_id >= self._granted:
            raise SessionError(
                f"Request ID {request_id} at or over the maximum {self._granted}",
                error_code=d14.SessionCloseCode.TOO_MANY_REQUESTS,
            )
        self._peer_next_id += 2

    def _new_peer_request(self, request_id: int, kind: type[Message], **fields: Any) -> Request14:
        self._accept_peer_id(request_id)
        request = Request14(request_id, kind, False, **fields)
        self._requests[request_id] = request
        self._peer_active += 1
        return request

    def _grant(self, force: bool = False) -> None:
        """Raise the peer's Maximum Request ID to keep `max_requests` available."""
        if self._closed or self._control_stream_id is None or self.peer_setup is None:
            return
        target = self._peer_next_id + 2 * max(0, self._max_requests - self._peer_active)
        step = 2 * max(1, self._max_requests // 4)
        if target > self._granted and (force or target - self._granted >= step):
            self._granted = target
            self._send(d14.MaxRequestId(target))

    def _flush_queue(self) -> None:
        if self.peer_setup is None or self._control_stream_id is None or self._closed:
            return
        while self._queue and self._queue[0][0] < self._peer_grant:
            request_id, data = self._queue.popleft()
            self._quic.send_stream_data(self._control_stream_id, bytes(data))
            request = self._requests.get(request_id)
            if request is not None:
                request.sent = True
        if self._queue and self._blocked_reported != self._peer_grant:
            self._blocked_reported = self._peer_grant
            self._send(d14.RequestsBlocked(self._peer_grant))

    def _send_request(self, request: Request14, data: bytes) -> None:
        """Send an encoded request, or queue it until the peer's SETUP and grant allow."""
        if self._queue or self.peer_setup is None or request.request_id >= self._peer_grant:
            request.sent = False
            self._queue.append([request.request_id, bytearray(data)])
            self._flush_queue()
            return
        assert self._control_stream_id is not None
        self._quic.send_stream_data(self._control_stream_id, data)

    def _send_about(self, request: Request14, message: d14.Message) -> None:
        """Send a message about a request, after the request itself if still queued."""
        if not request.sent:
            for entry in self._queue:
                if entry[0] == request.request_id:
                    entry[1] += message.encode()
                    return
        self._send(message)
