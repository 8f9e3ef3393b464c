"""MOQT objects as endpoints and relays hold them (sans-I/O).

One type serves a subscriber's iterators (`quic.Subscription`, `quic.FetchResponse`) and a
relay's cache and queues, so that an object received upstream is cached and forwarded as
it came, without being copied into another record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .wire import DEFAULT_PUBLISHER_PRIORITY, Location, ObjectStatus, Properties

__all__ = ["MoqtObject", "SubgroupEnd", "ENTRY_OVERHEAD"]

#: bytes counted for holding an object besides its payload, so that a flood of empty
#: objects is bounded too
ENTRY_OVERHEAD = 64


@dataclass(frozen=True, slots=True)
class MoqtObject:
    """An object received by a subscription or a fetch: every field of it that the draft
    requires a cache to keep (draft-18 "Caching Relays")."""

    group_id: int
    object_id: int
    payload: bytes
    subgroup_id: int | None = 0
    status: ObjectStatus = ObjectStatus.NORMAL
    properties: Properties = ()
    publisher_priority: int = DEFAULT_PUBLISHER_PRIORITY
    #: event-loop time its first byte arrived, from which a relay counts delivery timeouts
    received_at: float | None = field(default=None, compare=False)
    #: the END_OF_GROUP bit of the subgroup stream that carried it: that subgroup's last
    #: object is the group's last (a relay opens its own stream of the subgroup with it)
    end_of_group: bool = field(default=False, compare=False)

    @property
    def location(self) -> Location:
        return Location(self.group_id, self.object_id)

    @property
    def size(self) -> int:
        """What holding it costs: its payload plus ENTRY_OVERHEAD."""
        return len(self.payload) + ENTRY_OVERHEAD


@dataclass(frozen=True, slots=True)
class SubgroupEnd:
    """The publisher finished a subgroup stream with a FIN: every object of the subgroup was
    sent (draft-18 "Closing Subgroup Streams"). A relay ends its own stream of the subgroup
    then, so that a subscriber that takes a group as complete only when its stream ends (as
    moq-rs does, dropping an unfinished group when a newer one begins) gets it at once.
    `quic.Subscription` yields these after a subgroup's last object when `subgroup_ends` is
    set."""

    group_id: int
    subgroup_id: int
    end_of_group: bool = False
