"""Prefetch directives in the agent (DESIGN §5; KVSP §6.5, §6.6).

`Prefetcher` executes prefetch directives (§6.5): the listed blocks are leased at a listed
source, fetched and verified whole, stored in the agent's holder store and published as new
replicas, all on the event loop beside the requests already admitted, until the deadline.
Each block is read through `kvsp_moq.fetch`'s candidates and fallback (`BlockCandidates.whole`),
as requests read theirs: the listed sources in order, each over MOQT through the agent's relay
when the source publishes the block there, then over HTTP from the source itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import httpx

from kvsp_moq.errors import KvspError, PreconditionFailed
from kvsp_moq.fetch.fallback import BlockCandidates, CandidatesExhausted
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.leases import LeaseClient, LeaseKeeper
from kvsp_moq.fetch.sources import (
    HttpLayerSource,
    LayerSource,
    MoqtLayerSource,
    SourceCandidate,
    lease_holder,
    order_candidates,
)
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.fetch.transfers import TransferObserver, TransferTally
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.records import PrefetchBlock, PrefetchDirective, ReplicaRecord
from kvsp_moq.protocol.urls import base_url
from kvsp_moq.tasks import TaskSet

log = logging.getLogger("kvsp.agent.prefetch")

#: How much a background link measurement loads (`Prefetcher.measure`): enough that the
#: transfer, not the round trips, takes most of its time on a fast link.
MEASURE_OCTETS = 4 << 20

__all__ = ["DirectiveState", "Prefetcher"]


@dataclass
class DirectiveState:
    """The status resource of one prefetch directive."""

    directive: PrefetchDirective
    state: str = "pending"
    loaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    #: blocks loaded per transport ("moqt", "http")
    sources: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    task: asyncio.Task | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"directive": self.directive.directive, "state": self.state,
                               "loaded": list(self.loaded)}
        if self.failed:
            out["failed"] = list(self.failed)
        if self.sources:
            out["sources"] = dict(self.sources)
        if self.directive.request_ref is not None:
            out["request_ref"] = self.directive.request_ref
        if self.finished is not None:
            out["elapsed_ms"] = round((self.finished - self.started) * 1000, 3)
        return out


class Prefetcher:
    """Runs prefetch directives into the agent's holder store, each under its deadline.

    `moqt` is the agent's MOQT source (None without a relay): a block whose listed source
    also publishes it through that relay is fetched over MOQT first, as requests load it.
    `stats` counts the blocks loaded per transport.
    """

    def __init__(self, store: BlockStore, announce: Callable[[Any], None], fetcher: HttpFetcher,
                 leases: LeaseClient, index: IndexClient | None, *, concurrency: int = 8,
                 keep: int = 1024, on_transfer: TransferObserver | None = None,
                 moqt: MoqtLayerSource | None = None) -> None:
        self.store = store
        self.announce = announce
        self.fetcher = fetcher
        self.leases = leases
        self.index = index
        self.concurrency = concurrency
        self.keep = keep
        self.on_transfer = on_transfer
        self.moqt = moqt
        self.http = HttpLayerSource(fetcher)
        self.stats: dict[str, int] = {"moqt": 0, "http": 0}
        self.directives: dict[str, DirectiveState] = {}
        self._loading: dict[BlockId, asyncio.Task[str | None]] = {}  # block loads in flight
        self._adopted: set[BlockId] = set()  # ... that a request waits for
        self._releases = TaskSet()  # batch leases being released

    def adopt(self, bid: BlockId) -> "asyncio.Task[str | None] | None":
        """The load of `bid` in flight for a directive, now awaited by a request (None when
        there is none): the directive's deadline no longer cancels it, since the request
        would otherwise load the block again from the start."""
        task = self._loading.get(bid)
        if task is None or task.done():
            return None
        self._adopted.add(bid)
        return task

    def submit(self, directive: PrefetchDirective) -> DirectiveState:
        """Start a directive (a repeated id returns the state of the first)."""
        known = self.directives.get(directive.directive)
        if known is not None:
            return known
        state = DirectiveState(directive)
        self.directives[directive.directive] = state
        while len(self.directives) > self.keep:
            oldest = next(iter(self.directives))
            old = self.directives[oldest]
            if old.task is not None and not old.task.done():
                break
            del self.directives[oldest]
        loads = self._start_loads(state)
        state.task = asyncio.get_running_loop().create_task(self._run(state, loads),
                                                           name=f"prefetch-{directive.directive}")
        return state

    def measure(self, scope_id: str, records: Sequence[ReplicaRecord], *,
                octets: int = MEASURE_OCTETS, deadline_ms: int = 60_000) -> DirectiveState | None:
        """Load the leading blocks of `records` (about `octets` of them) from their holders in
        the background, as a directive of the agent's own, so that the links they come over
        are measured again (`TransferTally`, `Meters`) without a request waiting for it. The
        blocks are kept and published like any prefetched block. None when there is nothing
        to load."""
        blocks: list[PrefetchBlock] = []
        total = 0
        for r in records:
            if total >= octets:
                break
            blocks.append(PrefetchBlock(r.block_key, (lease_holder(r),)))
            total += r.size
        if not blocks:
            return None
        return self.submit(PrefetchDirective(
            directive=str(uuid.uuid4()), scope_id=scope_id, compat_id=records[0].compat_id,
            blocks=tuple(blocks), deadline_ms=deadline_ms, lease_ms=10_000,
            request_ref="link measurement"))

    def get(self, directive: str) -> DirectiveState | None:
        return self.directives.get(directive)

    async def close(self) -> None:
        tasks = [s.task for s in self.directives.values() if s.task is not None and not s.task.done()]
        tasks += [t for t in self._loading.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._releases, return_exceptions=True)  # let releases finish

    async def _run(self, state: DirectiveState, loads: dict[BlockId, "asyncio.Task[str | None]"]) -> None:
        d = state.directive
        try:
            await asyncio.wait_for(self._load_all(loads), d.deadline_ms / 1000)
            expired = False
        except (asyncio.TimeoutError, TimeoutError):
            expired = True
        except Exception:  # a bug must still leave a readable status
            log.exception("prefetch %s failed", d.directive)
            expired = False
        total = len(d.blocks)
        if len(state.loaded) == total:
            state.state = "complete"
        elif expired or state.loaded:
            state.state = "partial"
        else:
            state.state = "failed"
        state.finished = time.monotonic()
        log.info("prefetch %s: %s, %d of %d blocks", d.directive, state.state, len(state.loaded), total)

    async def _records(self, d: PrefetchDirective) -> dict[str, list[ReplicaRecord]]:
        """The Replica Records of the directive's blocks: the digests to verify against."""
        if self.index is None:
            return {}
        keys = [b.block_key for b in d.blocks
                if self.store.get(BlockId(d.compat_id, d.scope_id, b.block_key)) is None]
        out: dict[str, list[ReplicaRecord]] = {}
        if not keys:
            return out
        result = await self.index.lookup(d.scope_id, d.compat_id, keys)
        for block in result.blocks[:result.matched]:
            out[block.block_key] = list(block.replicas)
        # Keys past the first gap of the chain: asked one by one (the IS stops at a gap).
        rest = [k for k in keys if k not in out]
        for key in rest:
            single = await self.index.lookup(d.scope_id, d.compat_id, [key])
            if single.matched:
                out[key] = list(single.blocks[0].replicas)
        return out

    def _start_loads(self, state: DirectiveState) -> dict[BlockId, "asyncio.Task[str | None]"]:
        """One task per block, started at once: a request that arrives right behind its
        directive (the PC sends the directive first) finds them and waits (`adopt`)."""
        d = state.directive
        gate = asyncio.Semaphore(self.concurrency)
        records = asyncio.ensure_future(self._records(d))

        def looked_up(f: "asyncio.Future[dict[str, list[ReplicaRecord]]]") -> None:
            if not f.cancelled() and f.exception() is not None:
                log.info("prefetch %s: lookup failed: %s", d.directive, f.exception())

        records.add_done_callback(looked_up)

        async def one(key: str, sources: Sequence[str]) -> str | None:
            async with gate:
                try:
                    found = (await asyncio.shield(records)).get(key, [])
                except (KvspError, httpx.HTTPError):
                    found = []  # no digests to verify against: nothing is loaded
                kind = await self._load_one(d, key, sources, found, batch, keeper, tally)
            if state.finished is None:  # (an adopted load may end after the deadline)
                if kind is not None:
                    state.loaded.append(key)
                    if kind != "held":
                        state.sources[kind] = state.sources.get(kind, 0) + 1
                else:
                    state.failed.append(key)
            return kind

        wanted = {}
        for b in d.blocks:
            bid = BlockId(d.compat_id, d.scope_id, b.block_key)
            if bid not in wanted and bid not in self._loading:  # listed twice, or loading
                wanted[bid] = b                                 # for another directive
        batch, keeper = self._batch_leases(d, list(wanted.values()))
        # One observation of each source's link for the whole directive (`TransferTally`).
        tally = TransferTally()
        loads: dict[BlockId, asyncio.Task[str | None]] = {}
        for bid, b in wanted.items():
            task = asyncio.ensure_future(one(b.block_key, b.sources))
            task.add_done_callback(functools.partial(self._loaded, bid))
            loads[bid] = self._loading[bid] = task
        left = len(loads)

        def done(_: object) -> None:
            nonlocal left
            left -= 1
            if left == 0:  # (adopted loads may outlast the directive)
                tally.report(self.on_transfer)
                if batch:
                    self._releases.add(asyncio.ensure_future(self._release_batch(batch, keeper)))

        for task in loads.values():
            task.add_done_callback(done)
        return loads

    def _batch_leases(self, d: PrefetchDirective, blocks: Sequence[PrefetchBlock]
                      ) -> tuple[dict[str, "asyncio.Future[str | None]"], LeaseKeeper]:
        """One lease per first source for all the blocks listed there, asked for at once
        beside the lookup: one round trip instead of one per block before any byte moves
        (as `PrefixLoader` does). A refused batch leaves each block to lease its own."""
        keeper = LeaseKeeper(self.leases, d.lease_ms)
        by_source: dict[str, list[str]] = {}
        for b in blocks:
            if b.sources and BlockId(d.compat_id, d.scope_id, b.block_key) not in self.store:
                by_source.setdefault(base_url(b.sources[0]), []).append(b.block_key)

        return ({source: asyncio.ensure_future(keeper.take(source, keys, f"prefetch {d.directive}: "))
                 for source, keys in by_source.items() if len(keys) > 1}, keeper)

    @staticmethod
    async def _release_batch(batch: Mapping[str, "asyncio.Future[str | None]"],
                             keeper: LeaseKeeper) -> None:
        for f in batch.values():
            f.cancel()
        await asyncio.gather(*batch.values(), return_exceptions=True)
        await keeper.release()

    async def _load_all(self, loads: dict[BlockId, "asyncio.Task[str | None]"]) -> None:
        try:
            await asyncio.gather(*(asyncio.shield(t) for t in loads.values()))
        finally:
            for bid, task in loads.items():
                if not task.done() and bid not in self._adopted:
                    task.cancel()  # the deadline: stop loading what no request waits for

    def _loaded(self, bid: BlockId, task: "asyncio.Task[str | None]") -> None:
        if self._loading.get(bid) is task:
            del self._loading[bid]
            self._adopted.discard(bid)
        if not task.cancelled() and task.exception() is not None:
            log.error("prefetch of %s failed", bid.block_key[:12], exc_info=task.exception())

    def _candidates(self, source: str, records: Sequence[ReplicaRecord]) -> list[SourceCandidate]:
        """How to read a block from one listed source, in order: over MOQT when the source
        publishes the block through the agent's relay, then over HTTP from the source itself
        (one replica of each)."""
        sources: list[LayerSource] = [self.http]
        if self.moqt is not None and self.moqt.reachable:
            sources.insert(0, self.moqt)
        at = base_url(source)
        first: dict[str, SourceCandidate] = {}
        for cand in order_candidates([r for r in records if lease_holder(r) == at], sources):
            first.setdefault(cand.source.kind, cand)
        return list(first.values())

    async def _load_one(self, d: PrefetchDirective, key: str, sources: Sequence[str],
                        records: Sequence[ReplicaRecord],
                        batch: Mapping[str, "asyncio.Future[str | None]"], keeper: LeaseKeeper,
                        tally: TransferTally) -> str | None:
        """The transport the block was loaded over ("held" when it already was), or None.

        The listed sources' candidates are read in order by `BlockCandidates.whole`, each
        leased at its source: by the lease of `batch` that covers the block at its first
        source, else by one of its own, kept until the block is stored. What moved is added to
        `tally`.
        """
        bid = BlockId(d.compat_id, d.scope_id, key)
        if bid in self.store:
            return "held"
        candidates: list[SourceCandidate] = []
        for source in sources:
            found = self._candidates(source, records)
            if not found:
                log.info("prefetch %s: no record of %s at %s", d.directive, key[:12], source)
            candidates += found
        if not candidates:
            return None
        own = LeaseKeeper(self.leases, d.lease_ms)
        own.unavailable = keeper.unavailable  # lease endpoints found down during this directive
        block = BlockCandidates(key, candidates, keeper=own)

        async def take(cand: SourceCandidate, fetched: FetchedBlock) -> str:
            ended = time.perf_counter()
            tally.add(cand.lease_holder, fetched.bytes_received, ended - fetched.seconds, ended)
            if bid in self.store:
                return "held"
            try:
                entry = await self.store.put(bid, fetched.container.buffer)
            except PreconditionFailed:
                return "held"  # stored meanwhile (a request computed or loaded it)
            self.announce(entry)
            self.stats[cand.source.kind] += 1
            return cand.source.kind

        try:
            holder = candidates[0].lease_holder
            shared = batch.get(holder) if base_url(sources[0]) == holder else None
            lease = await asyncio.shield(shared) if shared is not None else None
            if lease is not None:
                block.hold(holder, lease)
            return await block.whole(take)
        except CandidatesExhausted:
            return None
        finally:
            await own.release()
