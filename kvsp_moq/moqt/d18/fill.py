"""Fills (drafts 20 and 22): FILL_PARAMETERS on a peer's SUBSCRIBE or REQUEST_UPDATE
replaces draft-18's joining FETCH (see `profiles`). A fill is served as the joining FETCH
it replaces (a FetchReceived for the layer above), on a fetch stream that carries the
Request ID of the message that asked for it, with no FETCH_OK; a fill of one of our
subscriptions arrives on such a stream, and its objects are that subscription's."""

from __future__ import annotations

from typing import Mapping, MutableMapping

from .. import events as ev
from ..session.dialect import Dialect
from ..session.fetches import PeerFetches
from ..session.sending import DataSender
from ..wire import AuthToken, FetchType, Location, SubscriptionFilter
from .messages import (
    OPEN_END,
    Fetch,
    Fill,
    LocationFilterType,
    Parameters,
    Subscribe,
    inclusive_end_to_exclusive,
    location_filter_to_range,
)
from .profiles import Profile
from .request_state import FillState, Request18, RequestStream

__all__ = ["Fills", "FillState"]  # FillState lives in `request_state`


#: Fills are kept under IDs no peer request can have.
_FILL_ID_BASE = 1 << 64


def _fill_as_joining(
    fill: Fill, subscription: SubscriptionFilter | None
) -> tuple[FetchType, int, tuple[Location, Location] | None] | None:
    """The joining FETCH a fill amounts to: its type, Joining Start and, for a range named
    by Locations, that range (a FETCH's, ended at the Largest Object when open); None when
    it is empty (it starts after the Largest Object)."""
    if fill.location_filter is not None:
        kind, values = fill.location_filter
        if kind == LocationFilterType.NEXT_OBJECT or (kind == LocationFilterType.RELATIVE_START and values[0] == 0):
            return None
        if kind == LocationFilterType.RELATIVE_START:
            return FetchType.RELATIVE_JOINING, values[0] - 1, None
        start, end = location_filter_to_range(fill.location_filter)
        return FetchType.ABSOLUTE_JOINING, start.group, (start, end)
    if subscription is None:
        return FetchType.ABSOLUTE_JOINING, 0, None
    if subscription.start is None:  # Next Group Start, Largest Object: nothing before them
        return None
    end_group, end_object = subscription.end_group, subscription.end_object
    if end_group is None:  # and so no end object either
        end = OPEN_END
    elif end_object is None:
        end = Location(end_group, 0)
    else:
        end = inclusive_end_to_exclusive(Location(end_group, end_object))
    return FetchType.ABSOLUTE_JOINING, subscription.start.group, (subscription.start, end)


def _covers_more(end: Location, other: Location) -> bool:
    """Whether the range end `end` reaches past `other` (both draft-18 FETCH ends)."""
    def key(x: Location) -> tuple[int, int]:
        return (x.group + 1, 0) if x.object == 0 else (x.group, x.object)
    return key(end) > key(other)


class Fills:
    """The peer's fills being served (by the Request ID of the subscription they fill)
    and the recognition of our subscriptions' fills: a part of `RequestStreams`, whose
    tables of requests and of REQUEST_UPDATEs (`update_parent`) it shares, and it hands
    a fill to the session's FETCH part as the joining FETCH it replaces."""

    def __init__(
        self,
        profile: Profile,
        requests: MutableMapping[int, Request18],
        update_parent: Mapping[int, RequestStream],
        fetches: PeerFetches[Request18],
        sending: DataSender[Request18],
        dialect: Dialect[Request18],
    ) -> None:
        self._profile = profile
        self._requests = requests
        self._update_parent = update_parent
        self._fetches = fetches
        self._sending = sending
        self._dialect = dialect
        self._by_subscription: dict[int, list[FillState]] = {}

    def of(self, subscription_id: int) -> list[FillState]:
        """The fills being served of a subscription (a copy)."""
        return list(self._by_subscription.get(subscription_id, ()))

    def open(
        self, joined: RequestStream, fill: Fill, wire_id: int, tokens: tuple[AuthToken, ...], out: list[ev.MoqtEvent]
    ) -> None:
        """Serve a fill as the joining FETCH it replaces (held until the SUBSCRIBE is
        answered, like one); the layer above sees a FetchReceived."""
        joining = _fill_as_joining(fill, joined.parameters.subscription_filter)
        if joining is None:
            return
        fetch_type, joining_start, bounds = joining
        internal = _FILL_ID_BASE + wire_id
        parameters = Parameters(
            subscriber_priority=fill.subscriber_priority,
            group_order=fill.group_order or joined.parameters.group_order,
        )
        message = Fetch(internal, fetch_type, joining_request_id=joined.request_id, joining_start=joining_start,
                        parameters=parameters)
        request = FillState(internal, Fetch, False, parameters, wire_id=wire_id, joined=joined, bounds=bounds)
        self._requests[internal] = request
        self._by_subscription.setdefault(joined.request_id, []).append(request)
        self._fetches.on_fetch(request, message, tokens, out)

    def resolve_own_joining(
        self,
        request: Request18,
        message: Fetch,
        tokens: tuple[AuthToken, ...],
        joined: Request18,
        out: list[ev.MoqtEvent],
    ) -> bool:
        """A fill that names its range is that range clamped to the Largest Object (a
        FETCH's evaluation); nothing is sent when it starts after the Largest Object.
        False for anything else (the FETCH part resolves it)."""
        if not isinstance(request, FillState) or request.bounds is None:
            return False
        largest = joined.largest_at_ok
        start, end = request.bounds
        if joined.parameters.forward is False or largest is None or start > largest:
            self.end(request)
            return True
        limit = Location(largest.group, largest.object + 1)
        if _covers_more(end, limit):
            end = limit
        namespace, track_name = self._dialect.track_of(joined)
        out.append(ev.FetchReceived(request.request_id, message.fetch_type, namespace, track_name, start, end,
                                    joined.request_id, message.parameters, tokens))
        return True

    def filled_subscription(self, request_id: int) -> Request18 | None:
        """Our subscription whose fill a FETCH_HEADER with this Request ID carries: the
        SUBSCRIBE's own ID, or one of its REQUEST_UPDATEs' (draft-20+)."""
        if not self._profile.location_filter:
            return None
        request = self._requests.get(request_id)
        if request is None:
            request = self._update_parent.get(request_id)
        if request is None or request.kind is not Subscribe or not request.local:
            return None
        return request

    def end(self, request: FillState, error_code: int | None = None) -> None:
        """A fill is over: reset its stream when it failed, and forget it."""
        request.answered = request.closed = True
        siblings = self._by_subscription.get(request.joined.request_id)
        if siblings is not None and request in siblings:
            siblings.remove(request)
            if not siblings:
                del self._by_subscription[request.joined.request_id]
        if error_code is not None:
            for sid in list(request.open_data_streams):
                if sid in self._sending.streams:
                    self._sending.reset_data_stream(sid, error_code)
        if not request.open_data_streams:
            self._requests.pop(request.request_id, None)
