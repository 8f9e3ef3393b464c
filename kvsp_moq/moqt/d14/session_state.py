"""The typed state of a draft-14 session: what the parts of `MoqtSession14` (`control`,
`sending`, `namespaces`) share. Each part derives from `SessionState14`, so
that every attribute and method one part uses of another is declared once, with its
type, and checked. Nothing here runs: the attributes are set by `MoqtSession14.__init__`
and each method below is defined by the part or the session class named beside it,
which come first in the session's MRO."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from .. import events as ev
from ..d18.messages import Message
from ..session.base import SessionBase
from . import messages as d14
from .credit import RequestCredit
from .request_state import Request14

__all__ = ["SessionState14"]


class SessionState14(SessionBase[Request14]):
    """Declarations of the state and methods the parts of `MoqtSession14` share."""

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

    # -- MoqtSession14 -------------------------------------------------------

    def _send(self, message: d14.Message) -> None:
        """Defined by MoqtSession14."""
        raise NotImplementedError

    def _was_ours(self, request_id: int) -> bool:
        """Defined by MoqtSession14."""
        raise NotImplementedError

    def _end_data_streams(self, request: Request14, error_code: int) -> None:
        """Defined by MoqtSession14."""
        raise NotImplementedError

    # -- control -------------------------------------------------------------

    def _refuse_if_going_away(self, request: Request14) -> bool:
        """Defined by ControlMessageHandling."""
        raise NotImplementedError

    def _peer_cancelled(self, request: Request14, code: int, out: list[ev.MoqtEvent]) -> None:
        """Defined by ControlMessageHandling."""
        raise NotImplementedError

    # -- namespaces ----------------------------------------------------------

    def _end_tracks(self, request: Request14, out: list[ev.MoqtEvent]) -> None:
        """Defined by NamespaceMapping."""
        raise NotImplementedError

    def _answer_tracks(self, request_id: int, *, refused: bool = False) -> bool:
        """Defined by NamespaceMapping."""
        raise NotImplementedError

    def _withdraw_announced(self, request: Request14) -> None:
        """Defined by NamespaceMapping."""
        raise NotImplementedError

    def _drop_announced(self, request: Request14) -> None:
        """Defined by NamespaceMapping."""
        raise NotImplementedError

    # -- sending -------------------------------------------------------------

    def _open_request(self, kind: type[Message], build: Callable[[int], d14.Message], **fields: Any) -> int:
        """Defined by MessageSending."""
        raise NotImplementedError
