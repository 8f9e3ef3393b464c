"""The relay's object cache (draft-18 "Caching Relays"; DESIGN §4).

Objects are kept by (full track name, group, object) under one byte budget, least recently
used first out. A track's objects always come from one origin (one upstream session): when an
object of a track arrives from another origin, the track's cached objects are dropped first,
so a response assembled from the cache never mixes two publishers' objects. For kvsp tracks
the full track name already names the publisher (its publisher_id field), so two holders'
replicas of one block are two tracks and never meet here at all.

Sans-I/O: no asyncio, no sockets. The relay calls it from its event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from kvsp_moq.moqt.objects import MoqtObject
from kvsp_moq.moqt.wire import Location, ObjectStatus, TrackNamespace

TrackKey = tuple[TrackNamespace, bytes]
"""A full track name: (namespace fields, track name)."""


def _field(value: bytes) -> str:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return value.hex()
    return text if text.isprintable() else value.hex()


def track_label(key: TrackKey) -> str:
    """A full track name for the log."""
    ns, name = key
    return "/".join(_field(f) for f in ns) + (":" + _field(name) if name else "")


CachedObject = MoqtObject
"""What the cache keeps of an object: the object as received (kept for compatibility)."""


@dataclass
class _Track:
    origin: int
    objects: dict[tuple[int, int], MoqtObject] = field(default_factory=dict)
    #: group -> its last Object ID, once an upstream FETCH has shown the whole group
    group_end: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheLookup:
    """What the cache holds of a requested range, in ascending order.

    `objects` are the cached objects from the start of the range with no unknown gap between
    them; `resume` is the first Location whose status the cache cannot vouch for (None when
    the whole range was answered); `origin` is the upstream session they all came from.
    """

    objects: list[MoqtObject]
    resume: Location | None
    origin: int | None


class ObjectCache:
    """Objects by full track name, group and object, within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.bytes = 0
        self.evictions = 0
        self.invalidations = 0
        self._lru: OrderedDict[tuple[TrackKey, int, int], MoqtObject] = OrderedDict()
        self._tracks: dict[TrackKey, _Track] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def origin_of(self, track: TrackKey) -> int | None:
        entry = self._tracks.get(track)
        return None if entry is None else entry.origin

    # ---------------------------------------------------------------- writing

    def put(self, track: TrackKey, origin: int, obj: MoqtObject) -> bool:
        """Cache an object received from `origin`; False when it is not kept.

        A duplicate keeps the first copy (the draft lets a relay ignore later ones).
        """
        size = obj.size
        if size > self.max_bytes:
            return False
        entry = self._tracks.get(track)
        if entry is not None and entry.origin != origin:
            self.invalidate(track)
            entry = None
        if entry is None:
            entry = self._tracks[track] = _Track(origin)
        loc = (obj.group_id, obj.object_id)
        if loc in entry.objects:
            self._lru.move_to_end((track, *loc))
            return True
        entry.objects[loc] = obj
        self._lru[(track, *loc)] = obj
        self.bytes += size
        self._make_room()
        return (track, *loc) in self._lru

    def note_group_end(self, track: TrackKey, origin: int, group: int, last_object: int) -> None:
        """Record that `group` of the track ends at `last_object` (as shown by a FETCH)."""
        entry = self._tracks.get(track)
        if entry is not None and entry.origin == origin:
            entry.group_end[group] = last_object

    def invalidate(self, track: TrackKey) -> None:
        """Forget every object of a track."""
        entry = self._tracks.pop(track, None)
        if entry is None:
            return
        self.invalidations += 1
        for group, obj in list(entry.objects):
            cached = self._lru.pop((track, group, obj), None)
            if cached is not None:
                self.bytes -= cached.size

    def _make_room(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            (track, group, obj), cached = self._lru.popitem(last=False)
            self.bytes -= cached.size
            self.evictions += 1
            entry = self._tracks.get(track)
            if entry is not None:
                entry.objects.pop((group, obj), None)
                if not entry.objects:
                    del self._tracks[track]

    # ---------------------------------------------------------------- reading

    def get(self, track: TrackKey, location: Location | tuple[int, int]) -> MoqtObject | None:
        entry = self._tracks.get(track)
        if entry is None:
            return None
        obj = entry.objects.get((location[0], location[1]))
        if obj is not None:
            self._lru.move_to_end((track, location[0], location[1]))
        return obj

    def objects(self, track: TrackKey) -> Iterator[MoqtObject]:
        """The track's cached objects in ascending Location order (no LRU effect)."""
        entry = self._tracks.get(track)
        if entry is None:
            return iter(())
        return iter([entry.objects[k] for k in sorted(entry.objects)])

    def lookup(self, track: TrackKey, start: Location, end: Location) -> CacheLookup:
        """The cached objects of a FETCH range, ascending.

        `end` is the wire End Location: {G, O+1} for a range ending at object O of group G,
        {G, 0} for the whole of group G. Within a group the cache answers for consecutive
        Object IDs only; after the last one cached it can vouch for the rest of the group only
        when the group's end is known. Objects it returns are touched in the LRU order.
        """
        entry = self._tracks.get(track)
        if entry is None:
            return CacheLookup([], start, None)
        whole_last_group = end.object == 0
        out: list[MoqtObject] = []
        group, obj = start
        while group <= end.group:
            last: int | None
            if group == end.group and not whole_last_group:
                last = end.object - 1
            else:
                last = entry.group_end.get(group)
            while last is None or obj <= last:
                cached = entry.objects.get((group, obj))
                if cached is None:
                    if last is not None and obj > last:
                        break
                    for found in out:
                        self._lru.move_to_end((track, found.group_id, found.object_id))
                    return CacheLookup(out, Location(group, obj), entry.origin)
                out.append(cached)
                if cached.status in (ObjectStatus.END_OF_GROUP, ObjectStatus.END_OF_TRACK):
                    break
                obj += 1
            group, obj = group + 1, 0
        for found in out:
            self._lru.move_to_end((track, found.group_id, found.object_id))
        return CacheLookup(out, None, entry.origin)

    def stats(self) -> dict[str, int]:
        return {
            "cache_bytes": self.bytes,
            "cache_budget_bytes": self.max_bytes,
            "cache_objects": len(self._lru),
            "cache_tracks": len(self._tracks),
            "cache_evictions": self.evictions,
            "cache_invalidations": self.invalidations,
        }
