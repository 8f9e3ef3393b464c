"""The client side of leases (KVSP §6.6): take, renew and release them at holders.

A lease keeps a holder from evicting the leased replicas for its term, so a reader takes one
before the first octet is read from a replica and releases it once the layers are where they
are needed. `LeaseKeeper` holds the leases of one load and renews them while it runs, since a
load (a slow link, a long prefix, a prefetch with a distant deadline) can outlast a term.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable, Sequence

import httpx

from kvsp_moq.errors import KvspError, TransportError, reason_of
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import cancel_and_wait

__all__ = ["LeaseClient", "LeaseKeeper", "RttObserver", "lease_unavailable"]

log = logging.getLogger("kvsp.fetch.leases")

#: Called with (holder URL, seconds) for each lease round trip: link RTTs.
RttObserver = Callable[[str, float], None]


def lease_unavailable(error: KvspError) -> bool:
    """Whether a refused lease says nothing of the block: the holder's lease endpoint is
    unreachable, overloaded, or not implemented (a static web server).

    The request path may then read the replica without a lease: every layer is verified, and
    a replica evicted meanwhile is a miss like any other (§6.1). A 404 or a quota refusal is
    an answer about the block or the client, and moves on to the next candidate.
    """
    return isinstance(error, TransportError) or getattr(error, "status", 0) in (405, 501, 503)


class LeaseClient:
    """POST/PUT/DELETE {holder}leases (§6.6) with the caller's token; refusals raise the
    KvspError their problem type names."""

    def __init__(self, client: httpx.AsyncClient, *, token: str | None = None,
                 on_rtt: RttObserver | None = None, timeout: float = 5.0) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.on_rtt = on_rtt
        self.timeout = timeout

    async def acquire(self, holder: str, block_keys: Sequence[str], ttl_ms: int) -> str:
        """A lease id; raises KvspError (e.g. NotFound, LeaseQuota) when refused."""
        url = base_url(holder) + "leases"
        started = time.perf_counter()
        try:
            r = await self.client.post(url, json={"block_keys": list(block_keys), "ttl_ms": ttl_ms},
                                       headers=self.headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise TransportError(f"lease at {holder}: {reason_of(e, named=True)}") from None
        if self.on_rtt is not None:
            self.on_rtt(base_url(holder), time.perf_counter() - started)
        raise_for_problem(r)
        return str(r.json()["lease"])

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> int:
        """PUT {holder}leases/{id}: the term granted from now (ms); raises KvspError (NotFound
        once the lease has expired) when refused."""
        url = f"{base_url(holder)}leases/{lease}"
        try:
            r = await self.client.put(url, json={"ttl_ms": ttl_ms}, headers=self.headers,
                                      timeout=self.timeout)
        except httpx.HTTPError as e:
            raise TransportError(f"renewing lease at {holder}: {reason_of(e, named=True)}") from None
        raise_for_problem(r)
        return int(r.json().get("ttl_ms", ttl_ms))

    async def release(self, holder: str, lease: str) -> None:
        """Best effort: an unreleased lease only runs out."""
        try:
            await self.client.delete(f"{base_url(holder)}leases/{lease}", headers=self.headers,
                                     timeout=self.timeout)
        except httpx.HTTPError as e:
            log.info("releasing lease %s at %s failed: %s", lease, holder, e)


class LeaseKeeper:
    """The leases of one load: renewed before their term runs out, released at its end.

    A lease protects its blocks only for its term (§6.6), and a load can take longer (a slow
    link, a long prefix, a prefetch with a distant deadline); the holder could then evict a
    block being read. So every lease held is renewed each third of its term until
    `release()`. A renewal refused outright (the lease expired, or the holder restarted and
    lost it) drops that lease: the read goes on unprotected, as it would have anyway; a holder
    that cannot be reached is tried again at the next renewal.
    """

    def __init__(self, client: LeaseClient, ttl_ms: int, *, fraction: float = 1 / 3,
                 patience_s: float = 1.0) -> None:
        self.client = client
        self.ttl_ms = ttl_ms
        self.period_s = max(0.005, ttl_ms / 1000 * fraction)
        #: how long a load waits for a lease before it reads without one (`acquire`)
        self.patience_s = patience_s
        self.leases: list[tuple[str, str]] = []  # (holder, lease id), in the order taken
        #: holders whose lease endpoint could not be used during this load (unreachable,
        #: overloaded, none, or slower than `patience_s`): their blocks are read without a
        #: lease rather than each one waiting out its own lease request (a relay's cache may
        #: still serve them)
        self.unavailable: set[str] = set()
        self.renewals = 0
        self._task: asyncio.Task | None = None
        self._late: set[asyncio.Future[str]] = set()

    async def acquire(self, holder: str, keys: list[str]) -> str:
        """A lease at `holder` for `keys`, waited for at most `patience_s`.

        A holder that answers at all answers lease requests in milliseconds; one that has not
        within the patience is unreachable or swamped, and waiting out the request's own
        timeout (seconds) would hold up the whole load, whose layers are verified anyway. The
        request then fails as unavailable (TransportError) and the load reads without the
        lease; should the lease still be granted, it is kept (renewed, released) from then on.
        """
        request = asyncio.ensure_future(self.client.acquire(holder, keys, self.ttl_ms))
        done, _ = await asyncio.wait({request}, timeout=self.patience_s)
        if not done:
            self._late.add(request)
            request.add_done_callback(functools.partial(self._adopt, holder))
            raise TransportError(f"lease at {holder}: no answer within {self.patience_s:g} s")
        return request.result()

    def _adopt(self, holder: str, request: "asyncio.Future[str]") -> None:
        self._late.discard(request)
        if not request.cancelled() and request.exception() is None:
            self.add(holder, request.result())

    async def take(self, holder: str, keys: list[str], what: str = "") -> str | None:
        """One lease at `holder` for all of `keys`, kept from now on; None when the holder
        refuses it (then each block leases its own) or cannot lease (`unavailable`)."""
        try:
            lease = await self.acquire(holder, keys)
        except KvspError as e:
            if lease_unavailable(e):
                self.unavailable.add(base_url(holder))
                log.info("%sno lease at %s (%s); reading its blocks without one", what, holder,
                         e.detail)
            else:
                log.info("%sbatch lease at %s refused (%s); leasing block by block", what, holder,
                         e.detail)
            return None
        self.add(holder, lease)
        return lease

    def add(self, holder: str, lease: str) -> None:
        """Keep this lease alive from now on (the renewing task starts with the first one)."""
        self.leases.append((holder, lease))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._renew_loop(),
                                                                name="kvsp-lease-renewal")

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            held = list(self.leases)
            results = await asyncio.gather(
                *(self.client.renew(h, lease, self.ttl_ms) for h, lease in held),
                return_exceptions=True)
            for (holder, lease), result in zip(held, results):
                if isinstance(result, BaseException):
                    if isinstance(result, TransportError) or not isinstance(result, KvspError):
                        log.info("renewing lease %s at %s failed (%s); trying again", lease, holder,
                                 result)
                        continue
                    log.info("lease %s at %s is gone (%s); the load goes on without it", lease,
                             holder, result.detail)
                    if (holder, lease) in self.leases:
                        self.leases.remove((holder, lease))
                else:
                    self.renewals += 1

    async def stop(self) -> None:
        """Stop renewing (the leases then run out on their own unless released); lease
        requests still unanswered are given up."""
        late, self._late = list(self._late), set()
        for request in late:
            request.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def release(self) -> None:
        """Stop renewing and release every lease still held."""
        await self.stop()
        taken, self.leases = self.leases, []
        await asyncio.gather(*(self.client.release(h, lease) for h, lease in taken),
                             return_exceptions=True)
