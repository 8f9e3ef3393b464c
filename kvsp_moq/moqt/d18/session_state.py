"""The state of a draft-18 session and the methods its parts call on one another, declared
once so that each part (`streams`, `control`, `sending`) is checked against them.
`session.MoqtSession` sets the state, and its parts, ahead of this class in the MRO,
override every method stubbed here: the class holds declarations only."""

from __future__ import annotations

from .. import events as ev
from ..session.base import SessionBase
from ..session.records import RequestIdTracker
from .fill import Fills
from .messages import ControlStreamParser, Message, Parameters, Redirect
from .profiles import Profile
from .request_state import Request18, RequestStream

__all__ = ["SessionState"]


class SessionState(SessionBase[Request18]):
    """What the parts of `MoqtSession` share: its state (set in `MoqtSession.__init__`)
    and the methods one part calls on another. `_requests` holds request streams and
    fills (under IDs from 2^64 up)."""

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

    # -- control messages received (`control`) ---------------------------------

    def _on_new_request(self, sid: int, message: Message, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    def _on_request_message(self, request: RequestStream, message: Message, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    def _on_request_fin(self, request: RequestStream, out: list[ev.MoqtEvent]) -> None:
        raise NotImplementedError

    # -- what is sent (`sending`) ----------------------------------------------

    def request_error(
        self,
        request_id: int,
        error_code: int,
        reason: str = "",
        *,
        retry_interval: int = 0,
        redirect: Redirect | None = None,
    ) -> None:
        raise NotImplementedError

    def _send_on_request(self, request: RequestStream, message: Message, end_stream: bool = False) -> None:
        raise NotImplementedError

    def _apply_update(self, request: RequestStream, update: Parameters, answer: Parameters) -> None:
        raise NotImplementedError

    # -- request stream teardown (`session`) -----------------------------------

    def _finish_stream(self, request: RequestStream) -> None:
        raise NotImplementedError

    def _abort_stream(self, request: RequestStream, error_code: int) -> None:
        raise NotImplementedError

    def _cancel(self, request: Request18, error_code: int) -> None:
        raise NotImplementedError
