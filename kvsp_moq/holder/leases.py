"""Leases (KVSP §6.6): a client's promise from the holder that listed blocks stay.

While a lease is valid the holder must not evict its blocks, so each client is held to a quota
of leased octets and a longest TTL; a request beyond either is refused with
"kvsp-lease-quota". An expired lease protects nothing and is forgotten. This is plain
bookkeeping with an injectable clock; the HTTP resources live in `app.py`.
"""

from __future__ import annotations

import heapq
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from kvsp_moq.errors import BadRecord, LeaseQuota, NotFound

#: A clock in seconds; monotonic so that wall-clock steps neither extend nor cut leases.
Clock = Callable[[], float]


@dataclass(frozen=True)
class LeaseLimits:
    """What one client may hold at once."""

    max_ttl_ms: int = 600_000
    max_octets: int = 16 << 30
    max_leases: int = 100_000


@dataclass
class Lease:
    id: str
    owner: str
    block_keys: tuple[str, ...]
    octets: int
    ttl_ms: int
    expires_at: float

    def remaining_ms(self, now: float) -> int:
        return max(0, int((self.expires_at - now) * 1000))


class LeaseTable:
    """Live leases by id, by owner and by block key."""

    def __init__(self, *, limits: LeaseLimits | None = None,
                 per_client: Mapping[str, LeaseLimits] | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.limits = limits or LeaseLimits()
        self.per_client = dict(per_client or {})
        self.clock = clock
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
        self._octets[lease.owner] -= lease.octets
        self._count[lease.owner] -= 1
        if not self._count[lease.owner]:
            del self._octets[lease.owner], self._count[lease.owner]

    def _check_ttl(self, owner: str, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            raise BadRecord("must be a positive number of milliseconds", member="ttl_ms")
        limit = self.limits_of(owner).max_ttl_ms
        if ttl_ms > limit:
            raise LeaseQuota(f"ttl_ms {ttl_ms} exceeds this client's limit of {limit}",
                             member="ttl_ms")

    def create(self, owner: str, block_keys: Sequence[str], octets: int, ttl_ms: int) -> Lease:
        """Protect `block_keys` (holding `octets` in all) for ttl_ms, within the owner's quota."""
        self.expire()
        self._check_ttl(owner, ttl_ms)
        limits = self.limits_of(owner)
        held = self._octets.get(owner, 0)
        if held + octets > limits.max_octets:
            raise LeaseQuota(f"{held} leased octets plus {octets} exceed this client's quota "
                             f"of {limits.max_octets}", member="block_keys")
        if self._count.get(owner, 0) + 1 > limits.max_leases:
            raise LeaseQuota(f"this client already holds {limits.max_leases} leases")
        lease_id = secrets.token_hex(16)
        lease = Lease(lease_id, owner, tuple(dict.fromkeys(block_keys)), octets, ttl_ms,
                      self.clock() + ttl_ms / 1000)
        self._leases[lease_id] = lease
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
