"""Draft-18 namespace discovery on draft-14's wire. A draft-18 NAMESPACE / NAMESPACE_DONE
under a SUBSCRIBE_NAMESPACE travels as a PUBLISH_NAMESPACE / PUBLISH_NAMESPACE_DONE (the
ANNOUNCED kind of request), and a peer's SUBSCRIBE_NAMESPACE also stands for the
SUBSCRIBE_TRACKS that draft-18 asks separately (the TRACKS kind, never on the wire); see
the session's module docstring. A part `session.MoqtSession14` owns (`NamespaceMapping`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from ..d18.messages import Parameters
from ..errors import StreamResetCode
from ..session.core import SessionPart
from ..wire import TrackNamespace
from . import messages as d14
from .request_state import (
    ANNOUNCED,
    PUBLISH_NAMESPACE,
    SUBSCRIBE_NAMESPACE,
    TRACKS,
    TRACKS_ID_BASE,
    Request14,
)
from .requests import Requests14

if TYPE_CHECKING:
    from .session import MoqtSession14

__all__ = ["NamespaceMapping"]


class NamespaceMapping(SessionPart[Request14]):
    """PUBLISH_NAMESPACE and SUBSCRIBE_NAMESPACE of a draft-14 session, received and
    sent, for the draft-18 requests and messages they stand for."""

    def __init__(self, session: MoqtSession14, requests14: Requests14) -> None:
        super().__init__(session)
        self._session = session
        self._requests14 = requests14
        self._credit = session._credit

    # -- received ----------------------------------------------------------

    def on_publish_namespace(self, message: d14.PublishNamespace, out: list[ev.MoqtEvent]) -> None:
        parameters = Parameters(authorization_tokens=message.parameters.authorization_tokens)
        parent = self._subscription_for(message.namespace)
        kind = PUBLISH_NAMESPACE if parent is None else ANNOUNCED
        request = self._credit.new_peer_request(
            message.request_id, kind, parameters=parameters, namespace=message.namespace, parent=parent
        )
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        if parent is not None:
            # The draft-18 NAMESPACE: answered here, reported against the SUBSCRIBE_NAMESPACE.
            suffix = message.namespace[len(parent.namespace):]
            parent.announced[suffix] = request
            request.answered = request.accepted = True
            self._session._send(d14.PublishNamespaceOk(request.request_id))
            out.append(ev.NamespaceReceived(parent.request_id, suffix, message.namespace))
            return
        if self._requests14.refuse_if_going_away(request):
            return
        out.append(ev.PublishNamespaceReceived(request.request_id, message.namespace, parameters, tokens))

    def _subscription_for(self, namespace: TrackNamespace) -> Request14 | None:
        """Our open SUBSCRIBE_NAMESPACE with the longest prefix of `namespace`."""
        best: Request14 | None = None
        for request in self._requests.values():
            if (
                request.local and request.kind == SUBSCRIBE_NAMESPACE and not request.closed
                and namespace[: len(request.namespace)] == request.namespace
                and (best is None or len(request.namespace) > len(best.namespace))
            ):
                best = request
        return best

    def on_subscribe_namespace(self, message: d14.SubscribeNamespace, out: list[ev.MoqtEvent]) -> None:
        parameters = Parameters(authorization_tokens=message.parameters.authorization_tokens)
        request = self._credit.new_peer_request(
            message.request_id, SUBSCRIBE_NAMESPACE, parameters=parameters, namespace=message.namespace_prefix
        )
        tokens = self._tokens.resolve(message.parameters.authorization_tokens)
        if self._requests14.refuse_if_going_away(request):
            return
        out.append(ev.SubscribeNamespaceReceived(request.request_id, message.namespace_prefix, parameters, tokens))
        # Draft-14's SUBSCRIBE_NAMESPACE also asks for a PUBLISH of every matching track,
        # which draft-18 asks with SUBSCRIBE_TRACKS: the application sees both requests.
        tracks = Request14(
            TRACKS_ID_BASE + request.request_id, TRACKS, False, parameters=parameters,
            namespace=message.namespace_prefix, parent=request, credit_returned=True,
        )
        request.tracks = tracks
        self._requests[tracks.request_id] = tracks
        out.append(ev.SubscribeTracksReceived(tracks.request_id, message.namespace_prefix, parameters, tokens))

    def on_publish_namespace_done(self, message: d14.PublishNamespaceDone, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace, local=False, kinds=(PUBLISH_NAMESPACE, ANNOUNCED))
        if request is None:
            return
        if request.kind == ANNOUNCED:
            parent = request.parent
            self._requests14.close_request(request)
            if parent is not None and not parent.closed:
                suffix = request.namespace[len(parent.namespace):]
                parent.announced.pop(suffix, None)
                out.append(ev.NamespaceDoneReceived(parent.request_id, suffix, request.namespace))
            return
        self._requests14.peer_cancelled(request, StreamResetCode.CANCELLED, out)

    def on_publish_namespace_cancel(self, message: d14.PublishNamespaceCancel, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace, local=True, kinds=(PUBLISH_NAMESPACE, ANNOUNCED))
        if request is None:
            return
        if request.kind == ANNOUNCED:
            self._requests14.close_request(request)
            self.drop_announced(request)
            return
        code = int(d14.PublishNamespaceError(0, message.error_code).to_draft18().error_code)
        out.append(ev.RequestCancelled(request.request_id, code, True))
        self._requests14.close_request(request)

    def on_unsubscribe_namespace(self, message: d14.UnsubscribeNamespace, out: list[ev.MoqtEvent]) -> None:
        request = self._find_namespace(message.namespace_prefix, local=False, kinds=(SUBSCRIBE_NAMESPACE,))
        if request is None:
            return
        self.withdraw_announced(request)
        self._requests14.peer_cancelled(request, StreamResetCode.CANCELLED, out)
        self.end_tracks(request, out)

    def end_tracks(self, request: Request14, out: list[ev.MoqtEvent]) -> None:
        """End the TRACKS half of a peer SUBSCRIBE_NAMESPACE that has ended."""
        tracks, request.tracks = request.tracks, None
        if tracks is not None and not tracks.closed:
            out.append(ev.RequestCancelled(tracks.request_id, StreamResetCode.CANCELLED, False))
            self._requests14.close_request(tracks)

    def _find_namespace(self, namespace: TrackNamespace, *, local: bool, kinds: tuple[type, ...]) -> Request14 | None:
        for request in self._requests.values():
            if (
                request.local == local and request.kind in kinds and request.namespace == namespace
                and not request.closed
            ):
                return request
        return None

    # -- sent --------------------------------------------------------------

    def namespace(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Announce a namespace under a peer's SUBSCRIBE_NAMESPACE (a PUBLISH_NAMESPACE)."""
        request = self._session._answered_peer_request(request_id, SUBSCRIBE_NAMESPACE)
        suffix = tuple(namespace_suffix)
        if suffix in request.announced:
            raise ValueError("namespace already announced")
        ns = request.namespace + suffix
        announced_id = self._requests14.open_request(
            ANNOUNCED, lambda rid: d14.PublishNamespace(rid, ns), namespace=ns, parent=request
        )
        request.announced[suffix] = self._requests[announced_id]

    def namespace_done(self, request_id: int, namespace_suffix: TrackNamespace) -> None:
        """Withdraw a namespace announced by namespace() (PUBLISH_NAMESPACE_DONE)."""
        request = self._session._answered_peer_request(request_id, SUBSCRIBE_NAMESPACE)
        announced = request.announced.pop(tuple(namespace_suffix), None)
        if announced is None:
            raise ValueError("NAMESPACE_DONE for a suffix never announced")
        self._withdraw(announced)

    def answer_tracks(self, request_id: int, *, refused: bool = False) -> bool:
        """Record the answer to a TRACKS request, which sends nothing; False for another request."""
        if request_id < TRACKS_ID_BASE:
            return False
        request = self._session._peer_request(request_id, (TRACKS,))
        request.answered = True
        if refused:
            self._requests14.close_request(request)
        else:
            request.accepted = True
        return True

    def withdraw_announced(self, request: Request14) -> None:
        """PUBLISH_NAMESPACE_DONE for every namespace announced under a peer's SUBSCRIBE_NAMESPACE."""
        for announced in list(request.announced.values()):
            self._withdraw(announced)
        request.announced.clear()

    def _withdraw(self, announced: Request14) -> None:
        if not announced.closed:
            self._credit.send_about(announced, d14.PublishNamespaceDone(announced.namespace))
            self._requests14.close_request(announced)

    def drop_announced(self, request: Request14) -> None:
        parent = request.parent
        if parent is not None:
            suffix = request.namespace[len(parent.namespace):]
            if parent.announced.get(suffix) is request:
                del parent.announced[suffix]
