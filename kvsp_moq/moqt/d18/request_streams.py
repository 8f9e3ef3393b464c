"""The state of a draft-18 session's requests and the teardown of their streams: a part
`session.MoqtSession` owns (`RequestStreams`), shared by its other parts (what it sends,
`sending`; the control messages it receives, `control`; its stream routing, `streams`).
It owns the fills of drafts 20 and 22 (`fill.Fills`), which share its tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import StreamResetCode
from ..session.core import SessionPart
from ..session.records import RequestIdTracker
from .fill import Fills
from .messages import ControlStreamParser, Parameters
from .request_state import FillState, Request18, RequestStream

if TYPE_CHECKING:
    from .session import MoqtSession

__all__ = ["RequestStreams"]


class RequestStreams(SessionPart[Request18]):
    """The requests' streams and the end of each request: a finished request's stream
    FINned, an aborted one's reset and stopped, and each forgotten once nothing refers to
    it. The session's table of requests holds request streams and fills (under IDs from
    2^64 up)."""

    def __init__(self, session: MoqtSession) -> None:
        super().__init__(session)
        self.peer_ids = RequestIdTracker(1 if session.is_client else 0)  # the peer's Request IDs so far
        self.by_stream: dict[int, RequestStream] = {}  # request stream ID -> its request
        self.parsers: dict[int, ControlStreamParser] = {}  # by request stream ID
        self.ignored: set[int] = set()  # streams of forgotten or refused requests, read no further
        self.update_parent: dict[int, RequestStream] = {}  # REQUEST_UPDATE ID -> the request it updates
        self.update_parameters: dict[int, Parameters] = {}  # REQUEST_UPDATEs not yet answered
        # Drafts 20 and 22: the peer's fills and our subscriptions'.
        self.fills = Fills(
            session.profile, self._requests, self.update_parent, self._fetches, self._sending, self._dialect
        )

    def fetch_stream_reset(self, request: Request18) -> None:
        if isinstance(request, FillState):
            self.fills.end(request, StreamResetCode.CANCELLED)
            return
        self.cancel(request, StreamResetCode.CANCELLED)

    def data_stream_reset(self, request: Request18) -> None:
        """Nothing to do: a request stream outlives its data streams."""

    def close_request(self, request: Request18) -> None:
        if isinstance(request, FillState):
            self.fills.end(request)
            return
        request.closed = True
        self.forget_if_done(request)

    def maybe_finish_fetch(self, request: Request18) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if isinstance(request, FillState):
            if request.fetch_stream_closed and not request.open_data_streams:
                self.fills.end(request)
            return
        if request.local:
            if request.fetch_stream_closed:
                request.closed = True
                self.finish_stream(request)
        elif request.fetch_stream_closed and not request.open_data_streams:
            request.closed = True
            self.finish_stream(request)

    def finish_stream(self, request: RequestStream) -> None:
        """FIN our side of a finished request's stream and forget it once both ends closed."""
        if not request.fin_sent:
            request.fin_sent = True
            try:
                self._quic.send_stream_data(request.stream_id, b"", end_stream=True)
            except (ValueError, RuntimeError, AssertionError):
                pass
        self.forget_if_done(request)

    def abort_stream(self, request: RequestStream, error_code: int) -> None:
        for fill in self.fills.of(request.request_id):
            self.fills.end(fill, error_code)  # draft-20: cancelling a subscription resets its fills
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription cancelled")
        for sid in list(request.open_data_streams):
            if sid in self._sending.streams:
                self._sending.reset_data_stream(sid, error_code)
        if not request.fin_sent:
            request.fin_sent = True
            try:
                self._quic.reset_stream(request.stream_id, error_code)
            except (ValueError, RuntimeError, AssertionError):
                pass
        if not request.fin_received:
            try:
                self._quic.stop_stream(request.stream_id, error_code)
            except (ValueError, RuntimeError, AssertionError):
                pass
            request.fin_received = True

    def cancel(self, request: Request18, error_code: int) -> None:
        if isinstance(request, FillState):
            self.fills.end(request, error_code)
            return
        request.closed = True
        self.abort_stream(request, error_code)
        self.forget_if_done(request)

    def forget_if_done(self, request: Request18) -> None:
        """Drop per-stream state; the request entry stays while data may still refer to it."""
        if isinstance(request, FillState):
            if request.closed and not request.open_data_streams:
                self._requests.pop(request.request_id, None)
            return
        if request.fin_sent and request.fin_received and request.closed:
            self.by_stream.pop(request.stream_id, None)
            self.parsers.pop(request.stream_id, None)
            self.ignored.add(request.stream_id)
            if not request.open_data_streams:
                self._requests.pop(request.request_id, None)
                for update_id in (*request.our_updates, *request.peer_updates):
                    self.update_parent.pop(update_id, None)
                    self.update_parameters.pop(update_id, None)
                if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                    del self._aliases_out[request.track_alias]
