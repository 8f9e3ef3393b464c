"""The state of a draft-14 session's requests and what every other part does with them:
send a new request on the control stream, refuse a request while going away, and end a
request (its data streams reset or stopped, its credit given back, and it forgotten once
nothing refers to it). A part `session.MoqtSession14` owns (`Requests14`), shared by its
namespaces (`namespaces`), what it sends (`sending`) and the control messages it
receives (`control`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import events as ev
from ..d18 import messages as m18
from ..errors import RequestErrorCode, StreamResetCode
from ..session.core import SessionPart
from . import messages as d14
from .request_state import Request14

if TYPE_CHECKING:
    from .session import MoqtSession14

__all__ = ["Requests14"]


class Requests14(SessionPart[Request14]):
    """The requests of a draft-14 session: sending a new one, and ending each; the
    SUBSCRIBE_UPDATEs the peer sent (`updates`) and whether this side sent GOAWAY."""

    def __init__(self, session: MoqtSession14) -> None:
        super().__init__(session)
        self._session = session
        self._credit = session._credit
        self.goaway_sent = False  # peer requests are refused from then on
        self.updates: dict[int, Request14] = {}  # peer SUBSCRIBE_UPDATE Request ID -> the subscription it updates

    def open_request(self, kind: type[m18.Message], build: Callable[[int], d14.Message], **fields: Any) -> int:
        self._session._check_open()
        request_id = self._session._next_request_id
        # Encoded first: a value draft-14 cannot carry is refused before the ID is spent.
        data = build(request_id).encode()
        self._session._next_request_id += 2
        request = Request14(request_id, kind, True, **fields)
        self._requests[request_id] = request
        self._credit.send_request(request, data)
        return request_id

    # -- requests ---------------------------------------------------------------

    def was_ours(self, request_id: int) -> bool:
        """Whether a Request ID is one this endpoint used (its request may be forgotten)."""
        return request_id & 1 == self._session._next_request_id & 1 and request_id < self._session._next_request_id

    def refuse_if_going_away(self, request: Request14) -> bool:
        if self.goaway_sent:
            self._session._reject(request, RequestErrorCode.GOING_AWAY, "going away")
            return True
        return False

    def peer_cancelled(self, request: Request14, code: int, out: list[ev.MoqtEvent]) -> None:
        if self._fetches.forget_held(request):
            self.close_request(request)
            return
        out.append(ev.RequestCancelled(request.request_id, code, request.local))
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription cancelled")
        self.end_data_streams(request, StreamResetCode.CANCELLED)
        self.close_request(request)

    # -- teardown ---------------------------------------------------------------

    def end_data_streams(self, request: Request14, error_code: int) -> None:
        """Reset the data streams we send for a request and stop those we receive."""
        for sid in list(request.open_data_streams):
            if sid in self._sending.streams:
                self._sending.reset_data_stream(sid, error_code)
            else:
                stream = self._receiving.streams.get(sid)
                if stream is not None:
                    self._receiving.stop(sid, stream, error_code)

    def fetch_stream_reset(self, request: Request14) -> None:
        """The publisher has dropped the fetch already, so no FETCH_CANCEL follows."""
        self.close_request(request)

    def data_stream_reset(self, request: Request14) -> None:
        """A data stream reset or stopped may be the last thing keeping a closed request."""
        self.forget_if_done(request)

    def maybe_finish_fetch(self, request: Request14) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if request.fetch_stream_closed and not request.open_data_streams:
            self.close_request(request)

    def close_request(self, request: Request14) -> None:
        """Mark a request over; a peer request gives its Request ID credit back."""
        request.closed = True
        if not request.local and not request.credit_returned:
            request.credit_returned = True
            self._credit.peer_request_ended()
        self.forget_if_done(request)

    def forget_if_done(self, request: Request14) -> None:
        """Drop a closed request once no data stream refers to it."""
        if request.closed and not request.open_data_streams:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
            if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                del self._aliases_out[request.track_alias]
