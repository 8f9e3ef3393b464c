"""What a session keeps of each request, from either side (`RequestState`), of each data
stream it reads or writes (`IncomingDataStream`, `OutgoingDataStream`), and of the peer's
Request IDs (`RequestIdTracker`); both drafts use the same records."""

from __future__ import annotations

from dataclasses import dataclass, field

from .d18.data import SubgroupHeader
from .d18.messages import Message, Parameters, Publish, Subscribe
from .wire import DEFAULT_PUBLISHER_PRIORITY, GroupOrder, Location

__all__ = ["UNKNOWN_STREAM_COUNT", "IncomingDataStream", "OutgoingDataStream", "RequestIdTracker", "RequestState"]

UNKNOWN_STREAM_COUNT = (1 << 62) - 1


@dataclass(eq=False)
class RequestState:
    """What both drafts track of one request, from either side; `kind` is the
    draft-18 request message class (draft-14 requests are named the same way)."""

    request_id: int
    kind: type[Message]
    local: bool  # this endpoint sent the request
    parameters: Parameters = field(default_factory=Parameters)
    answered: bool = False  # the first answer was sent (peer request) or received (ours)
    accepted: bool = False
    closed: bool = False
    track_alias: int | None = None
    default_priority: int = DEFAULT_PUBLISHER_PRIORITY
    largest_at_ok: Location | None = None  # Joining Location of a subscription
    fetch_group_order: GroupOrder = GroupOrder.ASCENDING
    data_streams_opened: int = 0
    open_data_streams: set = field(default_factory=set)
    fetch_stream_closed: bool = False
    done_stream_count: int | None = None  # PUBLISH_DONE received: streams the publisher opened
    data_streams_ended: int = 0
    held_fetches: list = field(default_factory=list)  # joining FETCHes waiting for this SUBSCRIBE's answer
    held_by: "RequestState | None" = None  # a joining FETCH: the pending SUBSCRIBE it waits for

    @property
    def is_subscription(self) -> bool:
        return self.kind in (Subscribe, Publish)

    @property
    def publisher_is_local(self) -> bool:
        """For a subscription: whether this endpoint is the publisher."""
        return (self.kind is Publish) == self.local


@dataclass(eq=False)
class IncomingDataStream:
    """A data stream being read; its items are draft-18 ones whatever the wire."""

    parser: object  # feed(data, end_stream) -> draft-18 items
    request: RequestState | None = None
    fetch: bool = False
    header: SubgroupHeader | None = None
    held: list = field(default_factory=list)  # items waiting for their track alias; None = FIN
    held_bytes: int = 0
    discard: bool = False
    fill: bool = False  # draft-20+: a fetch stream carrying a fill of `request`, a subscription


@dataclass(eq=False)
class OutgoingDataStream:
    request: RequestState
    writer: object  # a subgroup or fetch stream writer of the session's draft
    fin_sent: bool = False
    reset: bool = False
    payload_remaining: int = 0  # bytes of the current object's payload still to write


class RequestIdTracker:
    """Detects repeated peer Request IDs without keeping every ID seen."""

    __slots__ = ("floor", "seen", "highest")

    def __init__(self, first: int) -> None:
        self.floor = first  # every ID below this was seen
        self.seen: set[int] = set()
        self.highest: int | None = None

    def add(self, request_id: int) -> bool:
        """False when the ID was seen before."""
        if request_id < self.floor or request_id in self.seen:
            return False
        self.seen.add(request_id)
        while self.floor in self.seen:
            self.seen.discard(self.floor)
            self.floor += 2
        if self.highest is None or request_id > self.highest:
            self.highest = request_id
        return True
