"""Instance status and lifecycle (KVSP §6.3), as a state machine without I/O.

The registry takes Instance Status Records and the clock, and gives back the state to answer
with plus events (an instance failed, a state changed) that the caller acts on: the session
manager fails sessions over, the HTTP layer forwards state changes. Keeping the clock injectable
lets the expiry and sleep rules be tested without waiting.

The PC's view of an instance's state is authoritative; the instance learns it from the reply to
each status PUT (and from PUT {ii}state when the PC changes it):

- a new instance, or one that restarted (higher epoch), takes the state it reports ("failed"
  and "draining" reported by a newcomer are kept as such; "sleeping" too);
- active -> draining when the instance asks to sleep and its load has stayed below the
  configured threshold for the configured time (otherwise the answer is "active");
- draining -> sleeping when the instance reports "sleeping" with no running sessions;
- sleeping -> active only through `set_state` (the PC's word);
- any -> failed when the last record expires (ttl_ms after it arrived). A failed instance
  comes back only by restarting with a higher epoch: its sessions have already moved on.

Two things the PC knows before the instance says so:

- Routed requests: between `POST route` choosing an instance and that instance's next status
  record, the request is in no record yet. The registry counts it in the instance's "queued"
  (`note_routed`) until a record accounts for it, or until `routed_hold_ms` passes, so that a
  burst of routes spreads by the §6.4 cost instead of piling onto the instance that looked
  idle. A record that carries the extension member "admitted" (requests admitted this epoch)
  accounts for exactly as many routed requests as were admitted since the previous record;
  one without it, for those routed at least `routed_settle_ms` before it arrived.
- Started instances: an instance the start hook launched is registered at once
  (`register_started`), active, so that it can take its prefetch directive while it starts
  (§6.4). Its first status record replaces the provisional one whatever its epoch (above the
  epoch of a failed incarnation at the same URL); without one within `start_grace_ms` it fails.

Who may report (docs/authorization.md): a record is taken only from a principal that may
publish for the instance's URL (its "holders"), and the instance then serves that principal's
scopes and no other: the PC routes a scope only to instances that serve it. While an
incarnation is alive (not failed, not expired) only the principal that registered it may report
for it, so no other principal can push its epoch forward or mark it failed. Requests routed but
not yet accounted for count per scope, each scope at most `routed_cap_per_scope`, so that one
tenant's routes cannot make a shared instance look full to the others.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal
from urllib.parse import quote

from kvsp_moq.auth import ANY, OPEN, Principal
from kvsp_moq.errors import BadRecord, ForbiddenScope, NotFound, StaleEpoch
from kvsp_moq.protocol.instances import instance_id
from kvsp_moq.protocol.records import InstanceStatus
from kvsp_moq.protocol.urls import base_url

#: States the PC may set with `set_state`.
SETTABLE_STATES = ("active", "draining", "sleeping")

Clock = Callable[[], float]


def id_matches(path_id: str, url: str) -> bool:
    """Whether a path identifier names this instance: its hash id or its percent-encoded URL."""
    url = base_url(url)
    return path_id.lower() == instance_id(url) or path_id in (quote(url, safe=""), url)


def load_of(status: InstanceStatus) -> float:
    """Work in hand per batch slot: what "load" means for the sleep policy."""
    return (status.running + status.queued) / max(status.batch_size, 1)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class InstanceFailed:
    """An instance stopped serving: its sessions need another instance."""

    instance: str
    """Base URL of the instance."""
    epoch: int
    """The epoch of the incarnation that failed."""
    reason: Literal["expired", "restarted", "reported"]
    """Why: its record expired, it came back with a higher epoch, or it said so."""


@dataclass(frozen=True)
class StateChanged:
    """The PC's view of an instance's state changed."""

    instance: str
    """Base URL of the instance."""
    epoch: int
    """Epoch of the instance when it changed."""
    old: str | None
    """State before (None for a newcomer)."""
    new: str
    """State now."""
    by_pc: bool = False
    """True when the PC decided it (set_state): the instance should be told."""


Event = InstanceFailed | StateChanged


@dataclass(frozen=True)
class LifecycleSettings:
    """The sleep policy of §6.3."""

    sleep_load_threshold: float = 0.1
    """An instance may sleep once (running + queued) / batch_size stayed below this..."""
    sleep_after_ms: int = 60_000
    """...for this long."""
    routed_settle_ms: int = 100
    """A status record accounts for a routed request only when it arrives at least this long
    after the route: the client still has to reach the instance with the request."""
    routed_hold_ms: int = 10_000
    """A routed request no record has accounted for is forgotten after this long."""
    start_grace_ms: int = 120_000
    """How long a started instance may take to send its first status record."""
    routed_cap_per_scope: int = 64
    """At most this many unaccounted routed requests of one scope count in an instance's queue."""


@dataclass
class _Entry:
    record: InstanceStatus
    state: str
    expires_at: float
    low_since: float | None
    reported_at: float
    routed: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    """(clock time, Scope ID) of requests routed here that no status record has accounted
    for yet."""
    provisional: bool = False
    """Registered by the start hook; no record from the instance yet."""
    floor_epoch: int | None = None
    """For a provisional entry: the epoch of the failed incarnation it replaced."""
    scopes: frozenset[str] = frozenset({ANY})
    """The Scope IDs the instance serves: those of the principal that reports it ("*": all)."""
    owner: str | None = None
    """The name of that principal; None for a provisional entry."""
    counted: tuple[list, int, int] | None = None
    """The last count of `routed` under the per-scope cap: (the list, its length, count). The
    list only grows until it is replaced, so the same list at the same length counts the same."""
    view: tuple[InstanceStatus, str, int, InstanceStatus] | None = None
    """The last view built of the record: (record, state, routed count, view). Routing reads
    every active instance's view twice per request; it changes far less often."""

    def serves(self, scope_id: str) -> bool:
        return ANY in self.scopes or scope_id.lower() in self.scopes

    def to_json(self) -> dict:
        """What processes sharing the registry share (`pc.redis_state`); `routed` stays with
        the process that routed (each PC counts its own routes until a record accounts for
        them), and the caches are rebuilt."""
        return {"record": self.record.to_json(), "state": self.state,
                "expires_at": self.expires_at, "low_since": self.low_since,
                "reported_at": self.reported_at, "provisional": self.provisional,
                "floor_epoch": self.floor_epoch, "scopes": sorted(self.scopes),
                "owner": self.owner}

    @classmethod
    def from_json(cls, data: dict, routed: list[tuple[float, str]] | None = None) -> "_Entry":
        return cls(InstanceStatus.from_json(data["record"]), data["state"],
                   float(data["expires_at"]),
                   None if data["low_since"] is None else float(data["low_since"]),
                   float(data["reported_at"]), routed if routed is not None else [],
                   provisional=bool(data["provisional"]), floor_epoch=data["floor_epoch"],
                   scopes=frozenset(data["scopes"]), owner=data["owner"])

    def visible_to(self, viewer: Principal) -> bool:
        return (ANY in viewer.scopes or ANY in self.scopes
                or not viewer.scopes.isdisjoint(self.scopes))


@dataclass(frozen=True)
class Reply:
    """What to answer a status PUT with, and what happened."""

    state: str
    events: tuple[Event, ...] = ()

    def to_json(self) -> dict:
        return {"state": self.state}


class InstanceRegistry:
    """Every instance the PC knows of, its latest record and the PC's view of its state.

    Also the `InstanceDirectory` of the Index Service: `get(url)` gives the record that lookup
    estimates for targets need.
    """

    def __init__(self, settings: LifecycleSettings | None = None, *,
                 clock: Clock = time.monotonic) -> None:
        self.settings = settings or LifecycleSettings()
        self.clock = clock
        self._entries: dict[str, _Entry] = {}

    # ------------------------------------------------------------------ reports

    def report(self, record: InstanceStatus, by: Principal = OPEN) -> Reply:
        """Take one Instance Status Record from principal `by`; a lower epoch than seen is
        refused (StaleEpoch), a principal that may not speak for the instance too
        (ForbiddenScope)."""
        now = self.clock()
        url = base_url(record.instance)
        if url != record.instance:
            record = dataclasses.replace(record, instance=url)
        if not by.may_publish_for(url):
            raise ForbiddenScope(f"principal {by.name!r} may not report for instance {url}",
                                 member="instance")
        entry = self._entries.get(url)
        if (entry is not None and entry.owner is not None and entry.owner != by.name
                and not by.has_role("admin") and entry.state != "failed"
                and now < entry.expires_at):
            raise ForbiddenScope(f"instance {url} is reported by another principal until its "
                                 f"record expires or it fails", member="instance")
        scopes, owner = by.scopes, by.name
        expires = now + record.ttl_ms / 1000.0
        low = load_of(record) < self.settings.sleep_load_threshold
        events: list[Event] = []
        if entry is not None and entry.provisional:
            if entry.floor_epoch is not None and record.epoch <= entry.floor_epoch:
                raise StaleEpoch(f"instance {url} has reported epoch {entry.floor_epoch}; "
                                 f"epoch {record.epoch} is stale", member="epoch")
            # The started instance speaks for the first time: its record replaces the
            # provisional one, and it keeps what was routed to it meanwhile.
            state = record.state
            routed = self._accounted(entry.routed, None, record, now)
            self._entries[url] = _Entry(record, state, expires, now if low else None, now, routed,
                                        scopes=scopes, owner=owner)
            events.append(StateChanged(url, record.epoch, entry.state, state))
            if state == "failed":
                events.append(InstanceFailed(url, record.epoch, "reported"))
            return Reply(state, tuple(events))
        if entry is not None and record.epoch < entry.record.epoch:
            raise StaleEpoch(f"instance {url} has reported epoch {entry.record.epoch}; "
                             f"epoch {record.epoch} is stale", member="epoch")
        if entry is None or record.epoch > entry.record.epoch:
            if entry is not None and entry.state != "failed":
                events.append(InstanceFailed(url, entry.record.epoch, "restarted"))
            state = record.state
            self._entries[url] = _Entry(record, state, expires, now if low else None, now,
                                        scopes=scopes, owner=owner)
            events.append(StateChanged(url, record.epoch, entry.state if entry else None, state))
            if state == "failed":
                events.append(InstanceFailed(url, record.epoch, "reported"))
            return Reply(state, tuple(events))

        # Same epoch: the PC's view decides; the record only refreshes status and expiry.
        if entry.state != "failed" and now >= entry.expires_at:
            # Expired before this record came: failed, whether or not a sweep saw it yet.
            entry.state = "failed"
            events.append(InstanceFailed(url, entry.record.epoch, "expired"))
        old = entry.state
        entry.routed = self._accounted(entry.routed, entry.record, record, now)
        entry.record = record
        entry.scopes, entry.owner = scopes, owner
        entry.reported_at = now
        entry.low_since = (entry.low_since if entry.low_since is not None else now) if low else None
        if old == "failed":
            return Reply("failed", tuple(events))
        entry.expires_at = expires
        new = old
        if record.state == "failed":
            new = "failed"
            events.append(InstanceFailed(url, record.epoch, "reported"))
        elif old == "active" and record.requested_state == "sleeping":
            if self._quiet_long_enough(entry, now):
                new = "draining"
        elif old == "draining" and record.state == "sleeping" and record.running == 0:
            new = "sleeping"
        if new != old:
            entry.state = new
            events.insert(0, StateChanged(url, record.epoch, old, new))
        return Reply(new, tuple(events))

    def _accounted(self, routed: list[tuple[float, str]], before: InstanceStatus | None,
                   record: InstanceStatus, now: float) -> list[tuple[float, str]]:
        """Routed requests the record arriving now does not count yet.

        A record with `admitted` (requests admitted this epoch) after one of the same epoch
        with it counts one routed request per admission between them, the oldest first: no
        guess. Otherwise a record counts those routed at least `routed_settle_ms` before it
        arrived (a record sent sooner may predate their arrival)."""
        if (record.admitted is not None and before is not None and before.admitted is not None
                and before.epoch == record.epoch):
            return routed[max(0, record.admitted - before.admitted):]
        cutoff = now - self.settings.routed_settle_ms / 1000.0
        return [r for r in routed if r[0] > cutoff]

    def _quiet_long_enough(self, entry: _Entry, now: float) -> bool:
        return (entry.low_since is not None
                and (now - entry.low_since) * 1000.0 >= self.settings.sleep_after_ms)

    def expire(self) -> list[InstanceFailed]:
        """Mark instances whose record expired as failed; call it periodically."""
        failed = (self.expire_one(url) for url in self.expired())
        return [f for f in failed if f is not None]

    def expired(self) -> list[str]:
        """Instances whose record expired and that are not marked failed yet."""
        now = self.clock()
        return [url for url, entry in self._entries.items()
                if entry.state != "failed" and now >= entry.expires_at]

    def expire_one(self, url: str) -> InstanceFailed | None:
        """Mark one instance failed if its record expired."""
        entry = self._entries.get(url)
        if entry is None or entry.state == "failed" or self.clock() < entry.expires_at:
            return None
        entry.state = "failed"
        return InstanceFailed(url, entry.record.epoch, "expired")

    def set_state(self, instance: str, state: str) -> StateChanged | None:
        """The PC's word: the only way out of sleeping. None when nothing changed."""
        if state not in SETTABLE_STATES:
            raise BadRecord(f"must be one of {', '.join(SETTABLE_STATES)}", member="state")
        entry = self._entries.get(base_url(instance))
        if entry is None:
            raise NotFound(f"no instance {instance}")
        if entry.state == "failed":
            raise BadRecord("a failed instance comes back only by restarting with a higher "
                            "epoch", member="state")
        if entry.state == state:
            return None
        old, entry.state = entry.state, state
        if state != "active":
            entry.low_since = None
        return StateChanged(entry.record.instance, entry.record.epoch, old, state, by_pc=True)

    def note_routed(self, instance: str, scope_id: str = ANY) -> None:
        """A request of `scope_id` was just routed to the instance: count it in its queue until
        a status record accounts for it (or `routed_hold_ms` passes)."""
        entry = self._entries.get(base_url(instance))
        if entry is not None:
            entry.routed.append((self.clock(), scope_id.lower()))

    def pending(self, instance: str) -> int:
        """Routed requests not yet accounted for by a status record of the instance."""
        entry = self._entries.get(base_url(instance))
        return 0 if entry is None else self._pending(entry, self.clock())

    def _pending(self, entry: _Entry, now: float) -> int:
        if entry.routed:
            oldest = now - self.settings.routed_hold_ms / 1000.0
            if entry.routed[0][0] <= oldest:
                entry.routed = [r for r in entry.routed if r[0] > oldest]
        cap = self.settings.routed_cap_per_scope
        routed = entry.routed
        if len(routed) <= cap:
            return len(routed)
        last = entry.counted
        if last is not None and last[0] is routed and last[1] == len(routed):
            return last[2]
        per_scope: dict[str, int] = {}
        for _, scope in routed:
            per_scope[scope] = per_scope.get(scope, 0) + 1
        count = sum(min(n, cap) for n in per_scope.values())
        entry.counted = (routed, len(routed), count)
        return count

    def register_started(self, started: str | InstanceStatus, scope_id: str = ANY) -> bool:
        """Make an instance the start hook launched known, active, before its first record.

        `started` is its base URL, or a record with what the hook knows of it (rates, links);
        its state and ttl_ms are set here (active, `start_grace_ms`); until it reports, it
        serves the scope it was started for. An instance that already reports is left as it
        is. Returns whether the instance may now get requests (of `scope_id`).
        """
        now = self.clock()
        if isinstance(started, str):
            url = base_url(started)
            record = InstanceStatus(instance=url, epoch=0, state="active",
                                    ttl_ms=self.settings.start_grace_ms)
        else:
            url = base_url(started.instance)
            record = dataclasses.replace(started, instance=url, state="active",
                                         ttl_ms=self.settings.start_grace_ms,
                                         requested_state=None)
        entry = self._entries.get(url)
        if entry is not None and entry.state != "failed":
            if entry.provisional:  # started again before it spoke: wait for it longer
                entry.expires_at = now + record.ttl_ms / 1000.0
                entry.scopes = entry.scopes | {scope_id.lower()}
            return self.is_active(url) and entry.serves(scope_id)
        floor = None if entry is None else (entry.floor_epoch if entry.provisional
                                            else entry.record.epoch)
        if floor is not None and record.epoch <= floor:
            record = dataclasses.replace(record, epoch=floor)
        self._entries[url] = _Entry(record, "active", now + record.ttl_ms / 1000.0, None, now,
                                    provisional=True, floor_epoch=floor,
                                    scopes=frozenset({scope_id.lower()}))
        return True

    def known(self, instance_url: str) -> bool:
        return base_url(instance_url) in self._entries

    def forget(self, instance: str) -> bool:
        return self._entries.pop(base_url(instance), None) is not None

    # ------------------------------------------------------------------ queries

    def _view(self, entry: _Entry, now: float, *, routed: bool = True) -> InstanceStatus:
        """The record as the PC sees it: its state, and (with `routed`) the requests routed
        there since counted in "queued"."""
        state = entry.state
        if state != "failed" and now >= entry.expires_at:
            state = "failed"  # expired but not swept yet: never offered as active
        extra = self._pending(entry, now) if routed else 0
        record = entry.record
        if state == record.state and not extra:
            return record
        last = entry.view
        if last is not None and last[0] is record and last[1] == state and last[2] == extra:
            return last[3]
        view = dataclasses.replace(record, state=state, queued=record.queued + extra)
        entry.view = (record, state, extra, view)
        return view

    def get(self, instance_url: str) -> InstanceStatus | None:
        """`InstanceDirectory.get` of the Index Service: the unexpired record of an instance,
        with the PC's view of its state; None when unknown, expired or failed."""
        status = self.status_of(instance_url)
        return None if status is None or status.state == "failed" else status

    def status_of(self, instance_url: str) -> InstanceStatus | None:
        """The latest record with the PC's view of its state, failed ones included."""
        entry = self._entries.get(base_url(instance_url))
        return None if entry is None else self._view(entry, self.clock())

    def is_alive(self, instance_url: str) -> bool:
        """Known, unexpired and not failed (active, draining or sleeping)."""
        return self.get(instance_url) is not None

    def is_active(self, instance_url: str) -> bool:
        status = self.get(instance_url)
        return status is not None and status.state == "active"

    def scopes_of(self, instance_url: str) -> frozenset[str]:
        """The Scope IDs the instance serves ("*": every one); empty when unknown."""
        entry = self._entries.get(base_url(instance_url))
        return frozenset() if entry is None else entry.scopes

    def serves(self, instance_url: str, scope_id: str) -> bool:
        """Whether the instance serves the scope (its reporting principal holds it)."""
        entry = self._entries.get(base_url(instance_url))
        return entry is not None and entry.serves(scope_id)

    def active(self, exclude: Iterable[str] = (), scope_id: str | None = None
               ) -> list[InstanceStatus]:
        """Active, unexpired instances (serving `scope_id`, when given): the only ones that may
        get requests or prefetches."""
        now = self.clock()
        skip = {base_url(u) for u in exclude}
        out = []
        for url, entry in self._entries.items():
            # The view's state is the entry's, failed once expired: only an active one is
            # viewed (routing asks this twice per request).
            if (entry.state != "active" or now >= entry.expires_at or url in skip
                    or (scope_id is not None and not entry.serves(scope_id))):
                continue
            record = entry.record
            out.append(record if not entry.routed and record.state == "active"
                       else self._view(entry, now))
        return out

    def all(self) -> list[InstanceStatus]:
        now = self.clock()
        return [self._view(e, now) for e in self._entries.values()]

    def find_by_id(self, path_id: str) -> InstanceStatus | None:
        for url in self._entries:
            if id_matches(path_id, url):
                return self.status_of(url)
        return None

    def describe(self, viewer: Principal = OPEN) -> list[dict]:
        """GET {pc}instances: each record the viewer may see (an instance serving one of its
        scopes) with the PC's state, its id and expiry."""
        now = self.clock()
        out = []
        for url, entry in sorted(self._entries.items()):
            if not entry.visible_to(viewer):
                continue
            view = self._view(entry, now, routed=False)
            item = view.to_json()
            item["id"] = instance_id(url)
            item["reported_state"] = None if entry.provisional else entry.record.state
            item["routed"] = self._pending(entry, now)
            item["provisional"] = entry.provisional
            item["scopes"] = sorted(entry.scopes if ANY in viewer.scopes
                                    else entry.scopes & (viewer.scopes | {ANY}))
            item["expires_in_ms"] = max(0, round((entry.expires_at - now) * 1000))
            out.append(item)
        return out


__all__ = [
    "SETTABLE_STATES", "InstanceFailed", "InstanceRegistry",
    "LifecycleSettings", "Reply", "StateChanged", "id_matches", "load_of",
]
