"""A peer's FETCH in its draft-18 form: a standalone range is checked; a joining FETCH
becomes the range of the subscription it joins, and waits while that SUBSCRIBE is
pending (section 10.12.2) until subscribe_ok() releases it or a refusal refuses it.
A part the session owns (`PeerFetches`); what it asks of the session is `FetchHooks`."""

from __future__ import annotations

from typing import Generic, Mapping, Protocol, TypeVar, cast

from .. import events as ev
from ..d18.messages import Fetch, Subscribe
from ..errors import RequestErrorCode, StreamClosed
from ..wire import AuthToken, FetchType, Location
from .dialect import Dialect
from .records import RequestState, RequestT

__all__ = ["FetchHooks", "PeerFetches", "fetch_end_before_start"]

_RequestC = TypeVar("_RequestC", bound=RequestState, contravariant=True)


class FetchHooks(Protocol[_RequestC]):
    """What the FETCH part asks of its session: whether it is closed, how it refuses a
    request, and whether it resolves a joining FETCH of its own (a draft-20 fill that
    names its range)."""

    @property
    def closed(self) -> bool: ...

    def _reject(self, request: _RequestC, error_code: int, reason: str) -> None: ...

    def _resolve_own_joining(
        self, request: _RequestC, message: Fetch, tokens: tuple[AuthToken, ...], joined: _RequestC,
        out: list[ev.MoqtEvent],
    ) -> bool:
        """Resolve a joining FETCH the draft resolves itself; False when it has none."""
        ...


class PeerFetches(Generic[RequestT]):
    """Peer FETCHes, standalone and joining; a held joining FETCH sits in its
    SUBSCRIBE's `held_fetches` and names it in `held_by`. `requests` is the session's
    table of requests, read here to find the subscription a FETCH joins."""

    def __init__(
        self, session: FetchHooks[RequestT], dialect: Dialect[RequestT], requests: Mapping[int, RequestT]
    ) -> None:
        self._session = session
        self._dialect = dialect
        self._requests = requests

    def on_fetch(
        self, request: RequestT, message: Fetch, tokens: tuple[AuthToken, ...], out: list[ev.MoqtEvent]
    ) -> None:
        """A peer FETCH (in its draft-18 form): check a standalone range, or find the
        subscription a joining FETCH joins."""
        if message.parameters.group_order is not None:
            request.fetch_group_order = message.parameters.group_order
        if message.fetch_type == FetchType.STANDALONE:
            namespace, track_name, start, end = message.track_and_range()
            if end < start and not (end.object == 0 and end.group >= start.group):
                self._session._reject(request, RequestErrorCode.INVALID_RANGE, "end before start")
                return
            out.append(
                ev.FetchReceived(
                    request.request_id,
                    message.fetch_type,
                    namespace,
                    track_name,
                    start,
                    end,
                    None,
                    message.parameters,
                    tokens,
                )
            )
            return
        joining_request_id, _ = message.joining()
        joined = self._requests.get(joining_request_id)
        if (
            joined is None
            or joined.kind is not Subscribe
            or joined.local
            or joined.closed
        ):
            self._session._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, "no such subscription")
            return
        if not joined.accepted:
            # Section 10.12.2: the subscription is Pending, so the FETCH waits for its answer.
            request.held_by = joined
            joined.held_fetches.append((request, message, tokens))
            return
        self._resolve_joining(request, message, tokens, joined, out)

    def _resolve_joining(
        self,
        request: RequestT,
        message: Fetch,
        tokens: tuple[AuthToken, ...],
        joined: RequestT,
        out: list[ev.MoqtEvent],
    ) -> None:
        """Turn a joining FETCH of an Established subscription into its range."""
        if self._session._resolve_own_joining(request, message, tokens, joined, out):
            return
        if joined.parameters.forward is False:
            self._session._reject(request, RequestErrorCode.INVALID_RANGE, "joined subscription has Forward 0")
            return
        largest = joined.largest_at_ok
        if largest is None:
            self._session._reject(request, RequestErrorCode.INVALID_RANGE, "no objects published")
            return
        _, joining_start = message.joining()
        if message.fetch_type == FetchType.RELATIVE_JOINING:
            start = Location(max(0, largest.group - joining_start), 0)
        else:
            start = Location(joining_start, 0)
        end = Location(largest.group, largest.object + 1)
        namespace, track_name = self._dialect.track_of(joined)
        out.append(
            ev.FetchReceived(
                request.request_id,
                message.fetch_type,
                namespace,
                track_name,
                start,
                end,
                joined.request_id,
                message.parameters,
                tokens,
            )
        )

    def release_held(self, joined: RequestT, out: list[ev.MoqtEvent]) -> None:
        """SUBSCRIBE_OK went out: resolve the joining FETCHes that waited for it."""
        held, joined.held_fetches = joined.held_fetches, []
        for held_request, message, tokens in held:
            # Held by on_fetch(), so one of this session's records.
            request = cast(RequestT, held_request)
            request.held_by = None
            if request.closed or self._session.closed:
                continue
            self._resolve_joining(request, message, tokens, joined, out)

    def refuse_held(self, joined: RequestT, reason: str) -> None:
        """The SUBSCRIBE was refused or cancelled: so are the FETCHes joining it."""
        held, joined.held_fetches = joined.held_fetches, []
        for held_request, _, _ in held:
            request = cast(RequestT, held_request)  # one of this session's records
            request.held_by = None
            if request.closed or request.answered or self._session.closed:
                continue
            try:
                self._session._reject(request, RequestErrorCode.INVALID_JOINING_REQUEST_ID, reason)
            except StreamClosed:
                request.closed = True

    def forget_held(self, request: RequestState) -> bool:
        """A held joining FETCH was cancelled by its requester: drop it quietly (the
        application never saw it). Returns whether it was held."""
        joined = request.held_by
        if joined is None:
            return False
        request.held_by = None
        joined.held_fetches = [entry for entry in joined.held_fetches if entry[0] is not request]
        return True


def fetch_end_before_start(end: Location, start: Location) -> bool:
    """FETCH_OK's End Location is smaller than the FETCH's Start Location (drafts 14 and 18:
    a PROTOCOL_VIOLATION). End is encoded as in a FETCH: {G, 0} covers all of group G, so it
    is smaller only for an earlier group; an End equal to the Start (an empty range, which a
    FETCH may ask for: "the same or a larger Location") is not smaller."""
    if end.object == 0:
        return end.group < start.group
    return (end.group, end.object) < (start.group, start.object)
