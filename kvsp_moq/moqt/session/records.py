"""What a session keeps of each request, from either side (`RequestState`), of each data
stream it reads or writes (`IncomingDataStream`, `OutgoingDataStream`, with the draft's
parser or writer as the protocols here describe them), and of the peer's Request IDs
(`RequestIdTracker`); both drafts use the same records. A draft's session names its own
request record through `RequestT`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, Sequence, TypeVar

from ..d18.data import SubgroupHeader
from ..d18.messages import Fetch, Message, Parameters, Publish, Subscribe
from ..wire import DEFAULT_PUBLISHER_PRIORITY, AuthToken, GroupOrder, Location, ObjectStatus, Properties

__all__ = [
    "UNKNOWN_STREAM_COUNT",
    "DataStreamReader",
    "FetchObjectWriter",
    "HeldFetch",
    "IncomingDataStream",
    "OutgoingDataStream",
    "RequestIdTracker",
    "RequestState",
    "RequestT",
    "SubgroupObjectWriter",
]

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
    open_data_streams: set[int] = field(default_factory=set)
    fetch_stream_closed: bool = False
    done_stream_count: int | None = None  # PUBLISH_DONE received: streams the publisher opened
    data_streams_ended: int = 0
    held_fetches: list[HeldFetch] = field(default_factory=list)  # joining FETCHes waiting for this SUBSCRIBE's answer
    held_by: RequestState | None = None  # a joining FETCH: the pending SUBSCRIBE it waits for

    @property
    def is_subscription(self) -> bool:
        return self.kind in (Subscribe, Publish)

    @property
    def publisher_is_local(self) -> bool:
        """For a subscription: whether this endpoint is the publisher."""
        return (self.kind is Publish) == self.local


#: A joining FETCH held until its SUBSCRIBE is answered: the FETCH's own record (one of
#: the session's), the FETCH in its draft-18 form, and its resolved tokens.
HeldFetch = tuple[RequestState, Fetch, tuple[AuthToken, ...]]

#: The record a draft's session keeps of each request: `RequestState` or a subclass.
RequestT = TypeVar("RequestT", bound=RequestState)


class DataStreamReader(Protocol):
    """A data stream parser of the session's draft whose items are draft-18 ones."""

    def feed(self, data: bytes | bytearray | memoryview, end_stream: bool = False) -> Sequence[object]: ...


class SubgroupObjectWriter(Protocol):
    """A subgroup stream writer of the session's draft, taking draft-18 properties."""

    def header_bytes(self) -> bytes: ...

    def object_header(
        self, object_id: int, payload_length: int, *, properties: Properties = ..., status: ObjectStatus = ...
    ) -> bytes: ...


class FetchObjectWriter(Protocol):
    """A fetch stream writer of the session's draft, taking draft-18 properties."""

    def __init__(self, request_id: int, group_order: GroupOrder = ...) -> None: ...

    def header_bytes(self) -> bytes: ...

    def object_header(
        self,
        group_id: int,
        object_id: int,
        payload_length: int,
        *,
        subgroup_id: int | None = ...,
        publisher_priority: int = ...,
        properties: Properties = ...,
    ) -> bytes: ...


@dataclass(eq=False)
class IncomingDataStream(Generic[RequestT]):
    """A data stream being read; its items are draft-18 ones whatever the wire."""

    parser: DataStreamReader
    request: RequestT | None = None
    fetch: bool = False
    header: SubgroupHeader | None = None
    held: list[object | None] = field(default_factory=list)  # items waiting for their track alias; None = FIN
    held_bytes: int = 0
    discard: bool = False
    fill: bool = False  # draft-20+: a fetch stream carrying a fill of `request`, a subscription


@dataclass(eq=False)
class OutgoingDataStream(Generic[RequestT]):
    """A data stream being written, with the writer of the session's draft."""

    request: RequestT
    writer: SubgroupObjectWriter | FetchObjectWriter
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
