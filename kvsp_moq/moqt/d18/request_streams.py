"""The state of a draft-18 session's requests and the teardown of their streams: the
lowest of the session's parts, under what it sends (`sending`), the control messages it
receives (`control`) and its stream routing (`streams`), each of which derives from the
one below it and calls only what is defined at its level or beneath.
`session.MoqtSession` sets the state in its `__init__`."""

from __future__ import annotations

from ..errors import StreamResetCode
from ..session.base import SessionBase
from ..session.records import RequestIdTracker
from .fill import Fills
from .messages import ControlStreamParser, Parameters
from .profiles import Profile
from .request_state import FillState, Request18, RequestStream

__all__ = ["RequestStreams"]


class RequestStreams(SessionBase[Request18]):
    """The state the parts of `MoqtSession` share and the end of its requests: a
    finished request's stream FINned, an aborted one's reset and stopped, and each
    forgotten once nothing refers to it. `_requests` holds request streams and fills
    (under IDs from 2^64 up)."""

    profile: Profile
    _control_stream_id: int
    _control_parser: ControlStreamParser
    _peer_control_stream_id: int | None
    _goaway_sent_request_id: int | None  # peer requests from this ID on are refused
    _peer_ids: RequestIdTracker
    _stream_requests: dict[int, RequestStream]  # request stream ID -> its request
    _request_parsers: dict[int, ControlStreamParser]  # by request stream ID
    _update_parent: dict[int, RequestStream]  # REQUEST_UPDATE ID -> the request it updates
    _update_parameters: dict[int, Parameters]  # REQUEST_UPDATEs not yet answered
    _fills: Fills  # drafts 20 and 22: the peer's fills and our subscriptions'
    _unclassified_uni: dict[int, bytearray]  # new unidirectional streams before their type
    _ignored_streams: set[int]

    def _fetch_stream_reset(self, request: Request18) -> None:
        if isinstance(request, FillState):
            self._fills.end(request, StreamResetCode.CANCELLED)
            return
        self._cancel(request, StreamResetCode.CANCELLED)

    def _close_request(self, request: Request18) -> None:
        if isinstance(request, FillState):
            self._fills.end(request)
            return
        request.closed = True
        self._forget_if_done(request)

    def _maybe_finish_fetch(self, request: Request18) -> None:
        """A fetch ends once it was accepted and its data stream is done."""
        if not request.accepted or request.closed:
            return
        if isinstance(request, FillState):
            if request.fetch_stream_closed and not request.open_data_streams:
                self._fills.end(request)
            return
        if request.local:
            if request.fetch_stream_closed:
                request.closed = True
                self._finish_stream(request)
        elif request.fetch_stream_closed and not request.open_data_streams:
            request.closed = True
            self._finish_stream(request)

    def _finish_stream(self, request: RequestStream) -> None:
        """FIN our side of a finished request's stream and forget it once both ends closed."""
        if not request.fin_sent:
            request.fin_sent = True
            try:
                self._quic.send_stream_data(request.stream_id, b"", end_stream=True)
            except (ValueError, RuntimeError, AssertionError):
                pass
        self._forget_if_done(request)

    def _abort_stream(self, request: RequestStream, error_code: int) -> None:
        for fill in self._fills.of(request.request_id):
            self._fills.end(fill, error_code)  # draft-20: cancelling a subscription resets its fills
        if request.held_fetches:
            self._fetches.refuse_held(request, "subscription cancelled")
        for sid in list(request.open_data_streams):
            if sid in self._sending.streams:
                self.reset_data_stream(sid, error_code)
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

    def _cancel(self, request: Request18, error_code: int) -> None:
        if isinstance(request, FillState):
            self._fills.end(request, error_code)
            return
        request.closed = True
        self._abort_stream(request, error_code)
        self._forget_if_done(request)

    def _forget_if_done(self, request: Request18) -> None:
        """Drop per-stream state; the request entry stays while data may still refer to it."""
        if isinstance(request, FillState):
            if request.closed and not request.open_data_streams:
                self._requests.pop(request.request_id, None)
            return
        if request.fin_sent and request.fin_received and request.closed:
            self._stream_requests.pop(request.stream_id, None)
            self._request_parsers.pop(request.stream_id, None)
            self._ignored_streams.add(request.stream_id)
            if not request.open_data_streams:
                self._requests.pop(request.request_id, None)
                for update_id in (*request.our_updates, *request.peer_updates):
                    self._update_parent.pop(update_id, None)
                    self._update_parameters.pop(update_id, None)
                if request.track_alias is not None and self._aliases_out.get(request.track_alias) is request:
                    del self._aliases_out[request.track_alias]

