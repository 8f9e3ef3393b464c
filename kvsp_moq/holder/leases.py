"""Leases (KVSP §6.6): a client's promise from the holder that listed blocks stay.

While a lease is valid the holder must not evict its blocks, so each client is held to a quota
of leased octets, a number of leases and a longest TTL, the holder to a number of leases in
all, and each scope to pinning no more octets than its share of the store (what its quota
lets it hold): otherwise one client could pin the whole store and every other tenant's store
would fail. A request beyond any of these is refused with 429 "kvsp-lease-quota". An expired
lease protects nothing and is forgotten. This is plain bookkeeping with an injectable clock;
the HTTP resources live in `app.py`.
"""

from __future__ import annotations

import heapq
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from kvsp_moq.errors import BadRecord, LeaseQuota, NotFound

#: A clock in seconds; monotonic so that wall-clock steps neither extend nor cut leases.
Clock = Callable[[], float]


@dataclass(frozen=True)
class LeaseLimits:
    """What one client may hold at once."""

    max_ttl_ms: int = 600_000
    max_octets: int = 16 << 30
    max_leases: int = 1024


#: Leases one holder keeps at once, whoever holds them.
MAX_LEASES_TOTAL = 16384


@dataclass
class Lease:
    id: str
    owner: str
    block_keys: tuple[str, ...]
    octets: int
    ttl_ms: int
    expires_at: float
    #: block key -> (scope, octets) this lease pins, as `LeaseTable.create` was told
    pins: Mapping[str, tuple[str, int]] = field(default_factory=dict)

    def remaining_ms(self, now: float) -> int:
        return max(0, int((self.expires_at - now) * 1000))


class LeaseTable:
    """Live leases by id, by owner and by block key."""

    def __init__(self, *, limits: LeaseLimits | None = None,
                 per_client: Mapping[str, LeaseLimits] | None = None,
                 clock: Clock = time.monotonic, max_total: int = MAX_LEASES_TOTAL,
                 scope_limit: Callable[[str], int | None] | None = None) -> None:
        self.limits = limits or LeaseLimits()
        self.per_client = dict(per_client or {})
        self.clock = clock
        self.max_total = max_total
        #: octets one scope's blocks may have pinned at once (None: no limit); the holder
        #: sets it to the scope's share of its store
        self.scope_limit: Callable[[str], int | None] = scope_limit or (lambda scope_id: None)
        self._pinned: dict[str, tuple[str, int]] = {}  # leased key -> (scope, octets)
        self._scope_pinned: dict[str, int] = {}
        self._leases: dict[str, Lease] = {}
        self._by_key: dict[str, set[str]] = {}
        self._octets: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale entries skipped on pop

    def limits_of(self, owner: str) -> LeaseLimits:
        return self.per_client.get(owner, self.limits)

    def __len__(self) -> int:
        self.expire()
        return len(self._leases)

    def expire(self) -> list[Lease]:
        """Forget leases whose time is up; returns them."""
        now = self.clock()
        gone = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                self._drop(lease)
                gone.append(lease)
        return gone

    def _drop(self, lease: Lease) -> None:
        del self._leases[lease.id]
        for key in lease.block_keys:
            ids = self._by_key.get(key)
            if ids is not None:
                ids.discard(lease.id)
                if not ids:
                    del self._by_key[key]
                    self._unpin(key)
        self._octets[lease.owner] -= lease.octets
        self._count[lease.owner] -= 1
        if not self._count[lease.owner]:
            del self._octets[lease.owner], self._count[lease.owner]

    def _unpin(self, key: str) -> None:
        pin = self._pinned.pop(key, None)
        if pin is None:
            return
        scope, octets = pin
        left = self._scope_pinned.get(scope, 0) - octets
        if left > 0:
            self._scope_pinned[scope] = left
        else:
            self._scope_pinned.pop(scope, None)

    def pinned_octets(self, scope_id: str) -> int:
        """Octets of this scope's blocks under some live lease (each block counted once)."""
        self.expire()
        return self._scope_pinned.get(scope_id, 0)

    def _check_pins(self, pins: Mapping[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
        """The keys a new lease would pin anew, once each scope's share is checked."""
        new = {k: p for k, p in pins.items() if k not in self._pinned}
        more: dict[str, int] = {}
        for scope, octets in new.values():
            more[scope] = more.get(scope, 0) + octets
        for scope, octets in more.items():
            limit = self.scope_limit(scope)
            held = self._scope_pinned.get(scope, 0)
            if limit is not None and held + octets > limit:
                raise LeaseQuota(f"{held} octets of this scope are leased already; {octets} more "
                                 f"exceed its share of this holder's store ({limit})",
                                 member="block_keys")
        return new

    def _check_ttl(self, owner: str, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            raise BadRecord("must be a positive number of milliseconds", member="ttl_ms")
        limit = self.limits_of(owner).max_ttl_ms
        if ttl_ms > limit:
            raise LeaseQuota(f"ttl_ms {ttl_ms} exceeds this client's limit of {limit}",
                             member="ttl_ms")

    def create(self, owner: str, block_keys: Sequence[str], octets: int, ttl_ms: int,
               pins: Mapping[str, tuple[str, int]] | None = None) -> Lease:
        """Protect `block_keys` (holding `octets` in all; `pins` says each key's scope and
        octets) for ttl_ms, within the owner's, the holder's and the scopes' quotas."""
        self.expire()
        self._check_ttl(owner, ttl_ms)
        limits = self.limits_of(owner)
        held = self._octets.get(owner, 0)
        if held + octets > limits.max_octets:
            raise LeaseQuota(f"{held} leased octets plus {octets} exceed this client's quota "
                             f"of {limits.max_octets}", member="block_keys")
        if self._count.get(owner, 0) + 1 > limits.max_leases:
            raise LeaseQuota(f"this client already holds {limits.max_leases} leases")
        if len(self._leases) + 1 > self.max_total:
            raise LeaseQuota(f"this holder already keeps {self.max_total} leases")
        new_pins = self._check_pins(pins or {})
        lease_id = secrets.token_hex(16)
        lease = Lease(lease_id, owner, tuple(dict.fromkeys(block_keys)), octets, ttl_ms,
                      self.clock() + ttl_ms / 1000, dict(pins or {}))
        self._leases[lease_id] = lease
        for key, (scope, size) in new_pins.items():
            if key in lease.block_keys:
                self._pinned[key] = (scope, size)
                self._scope_pinned[scope] = self._scope_pinned.get(scope, 0) + size
        for key in lease.block_keys:
            self._by_key.setdefault(key, set()).add(lease_id)
        self._octets[owner] = held + octets
        self._count[owner] = self._count.get(owner, 0) + 1
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        return lease

    def get(self, lease_id: str, owner: str) -> Lease:
        """The owner's live lease; anyone else's, or an expired one, is not found."""
        self.expire()
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound("no such lease (it may have expired)")
        return lease

    def renew(self, lease_id: str, owner: str, ttl_ms: int | None = None) -> Lease:
        """Extend a live lease by ttl_ms from now (by default its original TTL)."""
        lease = self.get(lease_id, owner)
        ttl = lease.ttl_ms if ttl_ms is None else ttl_ms
        self._check_ttl(owner, ttl)
        lease.ttl_ms = ttl
        lease.expires_at = self.clock() + ttl / 1000
        heapq.heappush(self._expiry, (lease.expires_at, lease_id))
        return lease

    def release(self, lease_id: str, owner: str) -> None:
        self._drop(self.get(lease_id, owner))

    def is_protected(self, block_key: str) -> bool:
        """Whether a live lease covers this block key."""
        ids = self._by_key.get(block_key)
        if not ids:
            return False
        now = self.clock()
        return any(self._leases[i].expires_at > now for i in ids)

    def protected_until(self, block_key: str) -> float | None:
        """When the last live lease on this key ends (clock seconds), or None."""
        now = self.clock()
        ends = [self._leases[i].expires_at for i in self._by_key.get(block_key, ())]
        ends = [e for e in ends if e > now]
        return max(ends) if ends else None

    def leased_octets(self, owner: str) -> int:
        self.expire()
        return self._octets.get(owner, 0)
