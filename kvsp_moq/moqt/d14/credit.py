"""Draft-14 Request IDs and their credit (section 9.1): each peer request must carry the
next ID and stay below the Maximum Request ID granted, which MAX_REQUEST_ID raises as
peer requests end; a request of ours beyond the peer's grant is queued until
MAX_REQUEST_ID arrives, and REQUESTS_BLOCKED is sent once per grant. A part the draft-14
session owns (`RequestCredit`); what it asks of the session is `CreditHooks`."""

from __future__ import annotations

from collections import deque
from typing import Any, MutableMapping, Protocol

from ..d18.messages import Message, Setup
from ..engine import QuicEngine
from ..errors import InvalidRequestId, ProtocolViolation, SessionError
from . import messages as d14
from .request_state import Request14

__all__ = ["CreditHooks", "RequestCredit"]


class CreditHooks(Protocol):
    """What the credit part asks of its session: whether the control stream can carry
    a message yet, and to send one on it."""

    @property
    def closed(self) -> bool: ...

    @property
    def peer_setup(self) -> Setup | None: ...

    @property
    def _control_stream_id(self) -> int | None: ...

    def _send(self, message: d14.Message) -> None: ...


class RequestCredit:
    """The peer's Request IDs and ours, and the queue of requests waiting for credit.
    `requests` is the session's table of requests, which `new_peer_request` adds to."""

    def __init__(
        self,
        session: CreditHooks,
        quic: QuicEngine,
        requests: MutableMapping[int, Request14],
        *,
        is_client: bool,
        max_requests: int,
    ) -> None:
        self._session = session
        self._quic = quic
        self._requests = requests
        self._max_requests = max_requests
        self._peer_next_id = 1 if is_client else 0
        self._peer_active = 0
        self.granted = self._peer_next_id + 2 * max_requests  # peer Request IDs below this are allowed
        self.peer_grant = 0  # our Request IDs below this may be sent
        self.blocked_reported: int | None = None  # the grant a REQUESTS_BLOCKED was sent for
        self._queue: deque[tuple[int, bytearray]] = deque()  # encoded requests not yet sent

    def _ready(self) -> bool:
        session = self._session
        return not session.closed and session._control_stream_id is not None and session.peer_setup is not None

    def on_max_request_id(self, message: d14.MaxRequestId) -> None:
        if message.request_id <= self.peer_grant:
            raise ProtocolViolation(f"MAX_REQUEST_ID {message.request_id} does not increase {self.peer_grant}")
        self.peer_grant = message.request_id
        self.flush_queue()

    def accept_peer_id(self, request_id: int) -> None:
        if request_id != self._peer_next_id:
            raise InvalidRequestId(f"peer Request ID {request_id}, expected {self._peer_next_id}")
        if request_id >= self.granted:
            raise SessionError(
                f"Request ID {request_id} at or over the maximum {self.granted}",
                error_code=d14.SessionCloseCode.TOO_MANY_REQUESTS,
            )
        self._peer_next_id += 2

    def new_peer_request(self, request_id: int, kind: type[Message], **fields: Any) -> Request14:
        self.accept_peer_id(request_id)
        request = Request14(request_id, kind, False, **fields)
        self._requests[request_id] = request
        self._peer_active += 1
        return request

    def peer_request_ended(self) -> None:
        """A peer request is over: its credit goes back to the peer."""
        self._peer_active -= 1
        self.grant()

    def grant(self, force: bool = False) -> None:
        """Raise the peer's Maximum Request ID to keep `max_requests` available."""
        if not self._ready():
            return
        target = self._peer_next_id + 2 * max(0, self._max_requests - self._peer_active)
        step = 2 * max(1, self._max_requests // 4)
        if target > self.granted and (force or target - self.granted >= step):
            self.granted = target
            self._session._send(d14.MaxRequestId(target))

    def flush_queue(self) -> None:
        if not self._ready():
            return
        control = self._session._control_stream_id
        assert control is not None  # _ready()
        while self._queue and self._queue[0][0] < self.peer_grant:
            request_id, data = self._queue.popleft()
            self._quic.send_stream_data(control, bytes(data))
            request = self._requests.get(request_id)
            if request is not None:
                request.sent = True
        if self._queue and self.blocked_reported != self.peer_grant:
            self.blocked_reported = self.peer_grant
            self._session._send(d14.RequestsBlocked(self.peer_grant))

    def send_request(self, request: Request14, data: bytes) -> None:
        """Send an encoded request, or queue it until the peer's SETUP and grant allow."""
        if self._queue or self._session.peer_setup is None or request.request_id >= self.peer_grant:
            request.sent = False
            self._queue.append((request.request_id, bytearray(data)))
            self.flush_queue()
            return
        control = self._session._control_stream_id
        assert control is not None
        self._quic.send_stream_data(control, data)

    def send_about(self, request: Request14, message: d14.Message) -> None:
        """Send a message about a request, after the request itself if still queued."""
        self.send_encoded_about(request, message.encode())

    def send_encoded_about(self, request: Request14, encoded: bytes) -> None:
        """`send_about()` for a message already encoded."""
        if not request.sent:
            for request_id, data in self._queue:
                if request_id == request.request_id:
                    data.extend(encoded)
                    return
        control = self._session._control_stream_id
        assert control is not None  # a request is sent only once the control stream exists
        self._quic.send_stream_data(control, encoded)
