"""The state of a draft-14 session's requests and what every part does with them: send
a message or a new request on the control stream, refuse a request while going away,
and end a request (its data streams reset or stopped, its credit given back, and it
forgotten once nothing refers to it). The lowest of the session's parts, under its
namespaces (`namespaces`), what it sends (`sending`) and the control messages it
receives (`control`), each of which derives from the one below it and calls only what
is defined at its level or beneath. `session.MoqtSession14` sets the state."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from .. import events as ev
from ..d18 import messages as m18
from ..errors import RequestErrorCode, StreamResetCode
from ..session.base import SessionBase
from . import messages as d14
from .credit import RequestCredit
from .request_state import Request14

__all__ = ["Requests14"]


class Requests14(SessionBase[Request14]):
    """The state the parts of `MoqtSession14` share, and sending and ending its requests."""

    # SETUP and GOAWAY.
    versions: tuple[int, ...]  # offered (client) or accepted (server)
    version: int | None  # negotiated; None before SETUP
    _goaway_sent: bool

    _updates: dict[int, Request14]  # peer SUBSCRIBE_UPDATE Request ID -> the subscription it updates

    _credit: RequestCredit  # Request IDs and their credit, a part of its own

    # The one control stream.
    _control_stream_id: int | None
    _control_parser: d14.ControlStreamParser
    # Message class -> handler, a method of one of the parts taking a message of that
    # class: neither the receiver nor the message type can be spelled for every entry.
    _HANDLERS: ClassVar[dict[type[d14.Message], Callable[[Any, Any, list[ev.MoqtEvent]], None]]]

    # -- sending on the control stream -------------------------------------

    def _send(self, message: d14.Message) -> None:
        assert self._control_stream_id is not None
        self._quic.send_stream_data(self._control_stream_id, message.encode())

    def _open_request(self, kind: type[m18.Message], build: Callable[[int], d14.Message], **fields: Any) -> int:
        self._check_open()
        request_id = self._next_request_id
        # Encoded first: a value draft-14 cannot carry is refused before the ID is spent.
        data = build(request_id).encode()
        self._next_request_id += 2
        request = Request14(request_id, kind, True, **fields)
        self._requests[request_id] = request
        self._credit.send_request(request, data)
        return request_id

    # -- requests ---------------------------------------------------------------

    def _was_ours(self, request_id: int) -> bool:
        """Whether a Request ID is one this endpoint used (its request may be forgotten)."""
        return request_id & 1 == self._next_request_id & 1 and request_id < self._next_request_id

    def _refuse_if_going_away(self, request: Request14) -> bool:
        if self._goaway_sent:
            self._reject(request, RequestErrorCode.GOING_AWAY, "going away")
            return True
        return False

    def _peer_cancelled(self, request: Request14, code: int, out: list[ev.MoqtEvent]) -> None:
        if self._fetches.forget_held(request):
            self._close_request(request)
            return
        out.append(ev.RequestCancelled(request.request_id, code, request.local))
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription cancelled")
        self._end_data_streams(request, StreamResetCode.CANCELLED)
        self._close_request(request)

    # -- teardown ---------------------------------------------------------------

    def _end_data_streams(self, request: Request14, error_code: int) -> None:
        """Reset the data streams we send for a request and stop those we receive."""
        for sid in list(request.open_data_streams):
            if sid in self._sending.streams:
                self.reset_data_stream(sid, error_code)
            else:
                stream = self._receiving.streams.get(sid)
                if stream is not None:
                    self._receiving.stop(sid, stream, error_code)

    def _fetch_stream_reset(self, request: Request14) -> None:
        """The publisher has dropped the fetch already, so no FETCH_CANCEL follows."""
        self._close_request(request)

    def _data_stream_reset(self, request: Request14) -> None:
        """A data stream reset or stopped may be the last thing keeping a closed request."""
        self._forget_if_done(request)

    def _maybe_finish_fetch(self, request: Request14) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if request.fetch_stream_closed and not request.open_data_streams:
            self._close_request(request)

    def _close_request(self, request: Request14) -> None:
        """Mark a request over; a peer request gives its Request ID credit back."""
        request.closed = True
        if not request.local and not request.credit_returned:
            request.credit_returned = True
            self._credit.peer_request_ended()
        self._forget_if_done(request)

    def _forget_if_done(self, request: Request14) -> None:
        """Drop a closed request once no data stream refers to it."""
        if request.closed and not request.open_data_streams:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
            if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                del self._aliases_out[request.track_alias]
