"""Layers a..b of one block from its candidates in order, falling back mid-block (DESIGN §5).

A block usually has several replicas: in the caller's own store, published over MOQT through a
relay, on holders over HTTP. `BlockCandidates` tries them in the order given (see
`order_candidates`), each under a lease at its holder (§6.6), and when one fails (a miss, a
refused lease, a cut stream, a digest mismatch, a dead holder, a layer the caller cannot take)
goes on from the next candidate at the first layer not yet delivered. Layers already delivered
were verified and stay, so a MOQT path that breaks mid-block is finished over HTTP, from the
same holder or another, without reading any layer twice.

    block = BlockCandidates(key, order_candidates(records, [local, moqt, http]), keeper=keeper)
    async with block.layers(0, n - 1) as stream:
        async for layer in stream:   # SourcedLayer(index, k, v, candidate): verified, ascending
            ...
    stream.attempts                  # which candidate delivered which layers, and why others failed

The candidates' state belongs to the block, not to one range: a caller that loads layer groups
of one block concurrently shares one `BlockCandidates`, so a candidate that failed for one group
is not tried again for the next, and one lease per holder covers them all.

A caller that stores whole blocks (the agent's prefetch) reads them with `BlockCandidates.whole`:
the same candidates, order, leases and failure accounting, one verified container at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, NamedTuple, Sequence, TypeVar

from kvsp_moq.errors import CandidatesExhausted, KvspError, LayersUnavailable, reason_of
from kvsp_moq.fetch.leases import LeaseKeeper, lease_unavailable
from kvsp_moq.fetch.sources import BlockSource, SourceCandidate
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.protocol.container import Buffer
from kvsp_moq.protocol.urls import base_url

__all__ = [
    "Attempt", "BlockCandidates", "CandidatesExhausted", "FailureObserver", "FallbackStream",
    "SourcedLayer", "fetch_layers", "lease_first_candidates",
]

log = logging.getLogger("kvsp.fetch.fallback")

#: Called with (block key, candidate, reason) each time a candidate is given up.
FailureObserver = Callable[[str, SourceCandidate, str], None]

T = TypeVar("T")


class SourcedLayer(NamedTuple):
    """One verified layer and the candidate that delivered it."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index(), as NamedTuple fields may
    k: Buffer
    v: Buffer
    candidate: SourceCandidate


@dataclass
class Attempt:
    """One candidate's turn at a range: where it started, what it delivered, how it ended."""

    candidate: SourceCandidate
    first: int
    #: perf_counter when reading began (after the lease was taken)
    started: float
    ended: float | None = None
    layers: int = 0
    octets: int = 0
    #: why the candidate was given up; None when it delivered the rest of the range
    error: str | None = None

    @property
    def last(self) -> int | None:
        """The last layer it delivered (None: none)."""
        return self.first + self.layers - 1 if self.layers else None


async def _close(iterator: AsyncIterator[Any]) -> None:
    """Close an async generator left early, so its response is released now, not at GC."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # closing a broken source must not mask the outcome
            pass


class BlockCandidates:
    """The candidates of one block, which one is current, and the leases taken for it.

    `keeper` takes a lease at a candidate's holder before the first octet is read from it and
    keeps it renewed (the caller releases it, once the layers are where they are needed);
    without a keeper no lease is taken. A holder whose lease endpoint is unreachable or absent
    (`lease_unavailable`) is read without one: every layer is verified anyway.
    """

    def __init__(self, block_key: str, candidates: Sequence[SourceCandidate], *,
                 keeper: LeaseKeeper | None = None, on_failure: FailureObserver | None = None) -> None:
        self.block_key = block_key
        self.candidates = list(candidates)
        self.keeper = keeper
        self.on_failure = on_failure
        #: index of the candidate tried next; len(candidates) once every one has failed
        self.current = 0
        #: holder -> lease id; None where no lease could be had and the block is read without one
        self.leases: dict[str, str | None] = {}
        #: (candidate, reason) for each candidate given up, in order
        self.failures: list[tuple[SourceCandidate, str]] = []
        self._lock = asyncio.Lock()

    @property
    def exhausted(self) -> bool:
        return self.current >= len(self.candidates)

    def hold(self, holder: str, lease: str) -> None:
        """A lease taken elsewhere (one for many blocks) covers this block at `holder`."""
        self.leases[holder] = lease

    def layers(self, first: int, last: int, *,
               deliver: Callable[[SourcedLayer], None] | None = None) -> "FallbackStream":
        """Layers first..last, verified, in ascending order, each from the first candidate
        that delivers it.

        `deliver`, when given, is called with each layer before it is yielded; an exception it
        raises counts as the candidate's failure (a layer the caller cannot take, e.g. of the
        wrong size, is as bad as one that never came), so the next candidate is asked for it.
        """
        return FallbackStream(self, first, last, deliver)

    async def whole(self, take: Callable[[SourceCandidate, FetchedBlock], Awaitable[T]]) -> T:
        """The whole block as one verified container from the first candidate that delivers
        it, handed to `take` (which stores it, say); what `take` returns is returned.

        Candidates are leased and given up as for `layers`, but there is no continuing
        mid-block: a candidate whose source cannot read whole replicas (`BlockSource`), fails
        to, or whose block `take` refuses by raising (a block the caller cannot store is as bad
        as one that never came) is given up and the next one reads the block from the start.
        Raises `CandidatesExhausted` when no candidate is left.
        """
        while (cand := await self.candidate()) is not None:
            try:
                if not isinstance(cand.source, BlockSource):
                    raise LayersUnavailable(f"a {cand.source.kind} source reads layers only")
                fetched = await cand.source.fetch_block(cand.record)
                return await take(cand, fetched)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of a source moves on to the next one
                self.fail(cand, getattr(e, "detail", None) or reason_of(e, named=True))
                await self.drop(cand)
        raise self._exhausted("the block")

    async def candidate(self) -> SourceCandidate | None:
        """The current candidate, leased; None when every one has failed."""
        async with self._lock:
            while self.current < len(self.candidates):
                cand = self.candidates[self.current]
                holder = cand.lease_holder
                keeper = self.keeper
                if keeper is None or not cand.needs_lease or holder in self.leases:
                    return cand
                if base_url(holder) in keeper.unavailable:
                    self.leases[holder] = None  # its lease endpoint failed once this load
                    return cand
                try:
                    lease = await keeper.acquire(holder, [self.block_key])
                except KvspError as e:
                    if lease_unavailable(e):
                        keeper.unavailable.add(base_url(holder))
                        # No lease to be had there, yet the replica may well be readable (its
                        # relay is up, or a static server holds it): read it unprotected.
                        self.leases[holder] = None
                        log.info("block %s: no lease at %s (%s); reading it without one",
                                 self.block_key[:12], holder, e.detail)
                        return cand
                    self.fail(cand, f"lease refused: {e.detail}")
                    self.current += 1
                    continue
                self.leases[holder] = lease
                keeper.add(holder, lease)
                return cand
            return None

    async def drop(self, cand: SourceCandidate) -> None:
        """Move past `cand` unless a concurrent range has already done so."""
        async with self._lock:
            if self.current < len(self.candidates) and self.candidates[self.current] is cand:
                self.current += 1

    def fail(self, cand: SourceCandidate, reason: str) -> None:
        """Record that `cand` failed (it is not dropped here: see `drop`)."""
        self.failures.append((cand, reason))
        log.info("block %s from %s failed: %s", self.block_key[:12], cand.record.holder, reason)
        if self.on_failure is not None:
            self.on_failure(self.block_key, cand, reason)

    def _exhausted(self, what: str) -> CandidatesExhausted:
        summary = "; ".join(f"{c.record.holder}: {r}" for c, r in self.failures) or "no candidates"
        err = CandidatesExhausted(f"block {self.block_key[:12]}: no candidate delivered {what} "
                                  f"({summary})")
        err.failures = [(c.record.holder, r) for c, r in self.failures]
        return err


class FallbackStream:
    """Verified layers first..last of one block, ascending, across candidates; an async
    iterator of `SourcedLayer` and an async context manager (closing releases the source).

    Raises `CandidatesExhausted` when no candidate is left before `last` was delivered.
    """

    def __init__(self, block: BlockCandidates, first: int, last: int,
                 deliver: Callable[[SourcedLayer], None] | None) -> None:
        if not 0 <= first <= last:
            raise ValueError(f"no layers {first}-{last}")
        self.block = block
        self.first, self.last = first, last
        self.deliver = deliver
        #: each candidate's turn, in order; the last one delivered the end of the range
        self.attempts: list[Attempt] = []
        #: the first layer not yet delivered
        self.next_layer = first
        self._gen = self._run()

    def __aiter__(self) -> "FallbackStream":
        return self

    async def __anext__(self) -> SourcedLayer:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> "FallbackStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[SourcedLayer, None]:
        block, last = self.block, self.last
        while self.next_layer <= last:
            cand = await block.candidate()
            if cand is None:
                raise block._exhausted(f"layers {self.next_layer}-{last}")
            attempt = Attempt(cand, self.next_layer, time.perf_counter())
            self.attempts.append(attempt)
            layers = cand.source.layers(cand.record, self.next_layer, last)
            try:
                async for index, k, v in layers:
                    if index != self.next_layer:
                        raise LayersUnavailable(f"layer {index} arrived, {self.next_layer} was expected")
                    layer = SourcedLayer(index, k, v, cand)
                    if self.deliver is not None:
                        self.deliver(layer)
                    attempt.layers += 1
                    attempt.octets += len(k) + len(v)
                    self.next_layer = index + 1
                    yield layer
                    if index == last:
                        break
                if self.next_layer <= last:
                    raise LayersUnavailable(f"the source ended before layer {last}")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of a source moves on to the next one
                attempt.error = getattr(e, "detail", None) or reason_of(e, named=True)
                block.fail(cand, attempt.error)
                await block.drop(cand)
            finally:
                attempt.ended = time.perf_counter()
                await _close(layers)


def fetch_layers(candidates: Sequence[SourceCandidate], first: int, last: int, *,
                 keeper: LeaseKeeper | None = None,
                 deliver: Callable[[SourcedLayer], None] | None = None) -> FallbackStream:
    """Layers first..last of one block from `candidates` (replicas of that block, in the order
    to try them), verified, ascending, with fallback: `BlockCandidates` for a single range."""
    key = candidates[0].record.block_key if candidates else ""
    return BlockCandidates(key, candidates, keeper=keeper).layers(first, last, deliver=deliver)


async def lease_first_candidates(blocks: Sequence[BlockCandidates], keeper: LeaseKeeper) -> None:
    """One lease per holder for all the blocks whose first candidate is there, asked for at
    once: one round trip per holder before any octet moves, instead of one per block. A holder
    that refuses the batch leaves each block to lease its own when it gets there."""
    by_holder: dict[str, list[BlockCandidates]] = {}
    for block in blocks:
        if block.candidates and block.candidates[0].needs_lease:
            by_holder.setdefault(block.candidates[0].lease_holder, []).append(block)

    async def one(holder: str, group: list[BlockCandidates]) -> None:
        lease = await keeper.take(holder, [b.block_key for b in group])
        if lease is not None:
            for b in group:
                b.hold(holder, lease)

    await asyncio.gather(*(one(h, g) for h, g in by_holder.items()))
