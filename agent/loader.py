"""Loading cached KV blocks into the agent (DESIGN §5; KVSP §6.5, §6.6, §6.7).

`PrefixLoader` fills a `KVPool` with the matched prefix of a prompt while the model already
runs: every block has an ordered list of candidate replicas (local store, then MOQT, then
HTTP: `kvsp_moq.fetch.sources`), read through `kvsp_moq.fetch.fallback`, which leases each
candidate at its holder before the first octet is read from it and delivers the layers verified
and in ascending order; they are copied into the pool, and layer ``l`` is marked ready once
every block holds it, so the forward pass's pre-hook on decoder layer ``l`` can go on. Loading
layer ``l + 1`` thus overlaps computing layer ``l``.

Requests go out layer-group-major: group 0 (the first layers) of every block, then group 1 of
every block, and so on, from a bounded set of workers. A holder streams a whole response at
once, so one request per whole block would deliver block after block and make layer 0 wait for
the last block; layer groups make the early layers of the whole prefix arrive first. Groups are
sized to about 1 MiB per request, since each request has a fixed cost that small requests would
pay too often, and a prefix of 8 MiB or more is split into at least two groups; a smaller one
loads whole blocks, in less time than the extra requests would cost.

Failures: when a source fails mid-block (404, cut body, digest mismatch, dead holder), the
fallback continues the block from the next candidate at its first missing layer; layers already
placed are verified and stay. A block whose candidates are all exhausted fails the readiness, so
the forward pass raises instead of reading a partial layer; loading continues for the blocks
before it, and the caller recomputes everything after the longest fully loaded prefix. A layer
is marked ready only when every block of the prefix holds it verified, so correctness never
rests on a partial layer.

Leases: a load that outlasts a lease's term renews it each third of the term, and releases it
when done (`kvsp_moq.fetch.leases.LeaseKeeper`), so a slow load never reads from a replica its
holder is free to evict.

`Prefetcher` executes prefetch directives (§6.5): the listed blocks are leased at a listed
source, fetched and verified whole (over MOQT through the agent's relay when the source
publishes the block there, over HTTP from the source otherwise or when MOQT fails), stored in
the agent's holder store and published as new replicas, all on the event loop beside the
requests already admitted, until the deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import httpx

from agent.model import LayerReadiness
from kvsp_moq.errors import KvspError, LayersUnavailable, PreconditionFailed
from kvsp_moq.fetch.fallback import (
    BlockCandidates,
    CandidatesExhausted,
    SourcedLayer,
    lease_first_candidates,
)
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.leases import LeaseClient, LeaseKeeper
from kvsp_moq.fetch.sources import MoqtLayerSource, SourceCandidate
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.index_client import IndexClient
from kvsp_moq.protocol.container import Buffer
from kvsp_moq.protocol.records import PrefetchBlock, PrefetchDirective, ReplicaRecord
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.agent.loader")

__all__ = ["DirectiveState", "LoadReport", "Prefetcher", "PrefixLoader", "Timeline"]

#: Called with (holder URL, octets, seconds) after each completed transfer: link rates.
TransferObserver = Callable[[str, int, float], None]


class LayerTarget(Protocol):
    """Where a `PrefixLoader` writes: the agent's `KVPool`, or the paged blocks of the vLLM
    connector (`kvsp_moq.integrations.vllm.layout.PagedBlocks`)."""

    @property
    def block_keys(self) -> Sequence[str]: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def section_bytes(self) -> int: ...

    def place(self, slot: int, layer: int, k: Buffer, v: Buffer) -> None: ...

    def layer_complete(self, layer: int) -> None: ...

    def wait_layer(self, layer: int) -> None: ...


# --------------------------------------------------------------------------- timeline


@dataclass
class Timeline:
    """Per-layer load and compute spans of one pipelined prefill, in perf_counter seconds."""

    layers: int
    t0: float = field(default_factory=time.perf_counter)
    load_start: list[float | None] = field(default_factory=list)
    load_end: list[float | None] = field(default_factory=list)
    wait_start: list[float | None] = field(default_factory=list)
    compute_start: list[float | None] = field(default_factory=list)
    forward_start: float | None = None
    forward_end: float | None = None

    def __post_init__(self) -> None:
        for name in ("load_start", "load_end", "wait_start", "compute_start"):
            if not getattr(self, name):
                setattr(self, name, [None] * self.layers)

    def compute_spans(self) -> list[tuple[float, float] | None]:
        """Layer l computes from the end of its wait until layer l+1 starts waiting."""
        out: list[tuple[float, float] | None] = []
        for layer in range(self.layers):
            start = self.compute_start[layer]
            end = self.wait_start[layer + 1] if layer + 1 < self.layers else self.forward_end
            out.append(None if start is None or end is None else (start, end))
        return out

    def to_json(self) -> list[dict[str, Any]]:
        """Milliseconds from the start of the request, per layer."""
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - self.t0) * 1000, 3)

        compute = self.compute_spans()
        return [{"layer": layer,
                 "load": [ms(self.load_start[layer]), ms(self.load_end[layer])],
                 "wait": ms(self.wait_start[layer]),
                 "compute": [ms(span[0]), ms(span[1])] if span else None}
                for layer, span in enumerate(compute)]


# --------------------------------------------------------------------------- prefix loading


@dataclass
class LoadReport:
    """What a prefix load achieved."""

    planned: int
    """Blocks the load set out to bring in."""
    loaded: int
    """Leading blocks fully loaded: the prefix the model may use."""
    by_kind: dict[str, int]
    """Fully loaded leading blocks per source kind (the kind that delivered most layers)."""
    failures: list[dict[str, str]]
    octets: int
    seconds: float


@dataclass(eq=False)
class _Block:
    slot: int
    key: str
    #: its replicas in the order to try them, and the leases taken for it
    candidates: BlockCandidates
    placed: list[bool]
    layers_by_kind: dict[str, int] = field(default_factory=dict)
    failed: bool = False

    @property
    def complete(self) -> bool:
        return all(self.placed)

    def first_missing(self, a: int, b: int) -> int | None:
        for layer in range(a, b + 1):
            if not self.placed[layer]:
                return layer
        return None


class PrefixLoader:
    """Loads the blocks of a prefix into a pool, marking layers ready as they complete.

    `wait_for_layer` is the `KVPrefix.wait_for_layer` of the forward pass; it runs on the
    model's thread. `run()` runs on the event loop and returns once nothing more can be loaded.
    """

    def __init__(self, pool: LayerTarget, blocks: Sequence[Sequence[SourceCandidate]], *,
                 leases: LeaseClient, lease_ms: int = 10_000, concurrency: int = 8,
                 layers_per_request: int | None = None, request_bytes: int = 1 << 20,
                 split_bytes: int = 8 << 20, readiness_timeout: float = 120.0,
                 on_transfer: TransferObserver | None = None, timeline: Timeline | None = None) -> None:
        if len(blocks) != len(pool.block_keys):
            raise ValueError("one candidate list per pool block is needed")
        self.pool = pool
        self.leases = leases
        self.lease_ms = lease_ms
        self.concurrency = max(1, concurrency)
        layers = pool.num_layers
        if layers_per_request is None:
            # Requests of about `request_bytes`: smaller ones would pay the per-request cost
            # (HTTP or MOQT) too often. A prefix of `split_bytes` or more is requested in at
            # least two layer groups, or layer 0 would wait for whole blocks; a smaller one
            # loads in less time than the extra requests would cost, so whole blocks it is.
            per_layer = max(1, 2 * pool.section_bytes)
            layers_per_request = min(layers, -(-request_bytes // per_layer))
            if len(blocks) * layers * per_layer >= split_bytes:
                layers_per_request = min(layers_per_request, -(-layers // 2))
        self.group = max(1, layers_per_request)
        self.readiness = LayerReadiness(layers, timeout=readiness_timeout)
        self.on_transfer = on_transfer
        self.timeline = timeline or Timeline(layers)
        self._keeper = LeaseKeeper(leases, lease_ms)
        self._blocks = [_Block(i, key, BlockCandidates(key, c, keeper=self._keeper,
                                                       on_failure=self._note_failure),
                               [False] * layers)
                        for i, (key, c) in enumerate(zip(pool.block_keys, blocks))]
        self._counts = [0] * layers
        self._abort_from = len(self._blocks)
        self._failures: list[dict[str, str]] = []
        self._octets = 0
        self._by_holder: dict[str, list[float]] = {}  # holder -> [octets, first start, last end]
        self.done = False  #: nothing more will be loaded (set before run() returns)
        if not self._blocks:
            self.readiness.mark_all_ready()

    # ---------------------------------------------------------------- model side

    def wait_for_layer(self, layer: int) -> None:
        """Block the forward pass until ``layer`` of every block is in place."""
        tl = self.timeline
        tl.wait_start[layer] = time.perf_counter()
        self.readiness.wait_for_layer(layer)
        self.pool.wait_layer(layer)
        tl.compute_start[layer] = time.perf_counter()

    def fail(self, error: BaseException) -> None:
        """Release a waiting forward pass with ``error`` (e.g. on shutdown)."""
        self.readiness.fail(error)

    # ---------------------------------------------------------------- loop side

    async def run(self) -> LoadReport:
        """Load until nothing more can be; the leases are renewed meanwhile (not released)."""
        try:
            return await self._run()
        finally:
            await self._keeper.stop()

    async def _run(self) -> LoadReport:
        started = time.perf_counter()
        if self._blocks:
            await self._batch_leases()
            layers = self.pool.num_layers
            queue = deque((a, blk) for a in range(0, layers, self.group) for blk in self._blocks)
            count = min(self.concurrency, len(queue))
            workers = [asyncio.create_task(self._worker(queue)) for _ in range(count)]
            try:
                await asyncio.gather(*workers)
            except BaseException as e:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                self.readiness.fail(e)
                raise
        self.done = True
        if self.on_transfer is not None:
            # One observation per holder over the whole load: the rate its parallel streams
            # reached together, which is what a placement estimate for a prefix needs.
            for holder, (octets, first, last) in self._by_holder.items():
                self.on_transfer(holder, int(octets), last - first)  # a sum of ints
        loaded = 0
        for blk in self._blocks:
            if not blk.complete:
                break
            loaded += 1
        if loaded < len(self._blocks):
            self.readiness.fail(LayersUnavailable(
                f"only {loaded} of {len(self._blocks)} blocks loaded"))
        by_kind: dict[str, int] = {}
        for blk in self._blocks[:loaded]:
            kind = max(blk.layers_by_kind.items(), key=lambda kv: kv[1])[0]
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return LoadReport(len(self._blocks), loaded, by_kind, list(self._failures), self._octets,
                          time.perf_counter() - started)

    async def release_leases(self) -> None:
        """Release every lease this load took (after the loaded layers are in the pool)."""
        await self._keeper.release()

    @property
    def lease_renewals(self) -> int:
        """Leases renewed because the load outlasted their term."""
        return self._keeper.renewals

    async def _batch_leases(self) -> None:
        """One lease per holder for the blocks that start there: one round trip, not one per block."""
        await lease_first_candidates([blk.candidates for blk in self._blocks], self._keeper)

    async def _worker(self, queue: deque[tuple[int, _Block]]) -> None:
        while queue:
            first, blk = queue.popleft()
            if blk.failed or blk.slot >= self._abort_from:
                continue
            await self._load_range(blk, first, min(first + self.group, self.pool.num_layers) - 1)

    def _note_failure(self, key: str, cand: SourceCandidate, reason: str) -> None:
        self._failures.append({"block_key": key, "source": cand.record.holder,
                               "kind": cand.source.kind, "reason": reason})

    async def _load_range(self, blk: _Block, a: int, b: int) -> None:
        tl = self.timeline
        now = time.perf_counter()
        for layer in range(a, b + 1):
            if tl.load_start[layer] is None:
                tl.load_start[layer] = now
        first = blk.first_missing(a, b)
        if first is None:
            return
        stream = blk.candidates.layers(first, b, deliver=functools.partial(self._deliver, blk))
        aborted = False
        try:
            async for _ in stream:
                if blk.slot >= self._abort_from:
                    aborted = True  # a block before this one failed: these layers are of no use
                    return
        except CandidatesExhausted:
            self._block_failed(blk)
            return
        finally:
            await stream.aclose()
            # Octets of every candidate's turn, but the one cut short because no longer wanted.
            attempts = stream.attempts[:-1] if aborted else stream.attempts
            self._octets += sum(attempt.octets for attempt in attempts)
        done = stream.attempts[-1]
        if done.candidate.source.kind != "local":
            seen = self._by_holder.setdefault(done.candidate.lease_holder, [0, done.started, done.started])
            seen[0] += done.octets
            seen[1] = min(seen[1], done.started)
            seen[2] = max(seen[2], time.perf_counter())

    def _deliver(self, blk: _Block, layer: SourcedLayer) -> None:
        """Copy a verified layer into the pool (an error here fails the source, as a bad layer
        would); nothing once an earlier block has failed."""
        if blk.slot >= self._abort_from or blk.placed[layer.index]:
            return
        self.pool.place(blk.slot, layer.index, layer.k, layer.v)
        self._placed(blk, layer.index, layer.candidate.source.kind)

    def _placed(self, blk: _Block, layer: int, kind: str) -> None:
        blk.placed[layer] = True
        blk.layers_by_kind[kind] = blk.layers_by_kind.get(kind, 0) + 1
        self._counts[layer] += 1
        if self._counts[layer] == len(self._blocks):
            self.pool.layer_complete(layer)
            self.timeline.load_end[layer] = time.perf_counter()
            self.readiness.mark_ready(layer)

    def _block_failed(self, blk: _Block) -> None:
        if blk.failed:
            return
        blk.failed = True
        if blk.slot < self._abort_from:
            self._abort_from = blk.slot
        # The forward pass must not wait for layers that will never be complete.
        self.readiness.fail(LayersUnavailable(f"block {blk.slot} ({blk.key[:12]}) could not be loaded"))


# --------------------------------------------------------------------------- prefetch (§6.5)


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
        self.stats: dict[str, int] = {"moqt": 0, "http": 0}
        self.directives: dict[str, DirectiveState] = {}
        self._loading: dict[BlockId, asyncio.Task[str | None]] = {}  # block loads in flight
        self._adopted: set[BlockId] = set()  # ... that a request waits for
        self._releases: set[asyncio.Task[None]] = set()  # batch leases being released

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

    def get(self, directive: str) -> DirectiveState | None:
        return self.directives.get(directive)

    async def close(self) -> None:
        tasks = [s.task for s in self.directives.values() if s.task is not None and not s.task.done()]
        tasks += [t for t in self._loading.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._releases, return_exceptions=True)

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
                kind = await self._load_one(d, key, sources, found, batch)
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
        loads: dict[BlockId, asyncio.Task[str | None]] = {}
        for bid, b in wanted.items():
            task = asyncio.ensure_future(one(b.block_key, b.sources))
            task.add_done_callback(functools.partial(self._loaded, bid))
            loads[bid] = self._loading[bid] = task
        if batch:
            left = len(loads)

            def done(_: object) -> None:
                nonlocal left
                left -= 1
                if left == 0:  # (adopted loads may outlast the directive)
                    release = asyncio.ensure_future(self._release_batch(batch, keeper))
                    self._releases.add(release)
                    release.add_done_callback(self._releases.discard)

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
                by_source.setdefault(b.sources[0], []).append(b.block_key)

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

    def _attempts(self, source: str,
                  records: Sequence[ReplicaRecord]) -> list[tuple[str, ReplicaRecord]]:
        """How to read a block from one listed source, in order: (kind, record).

        MOQT first when the source publishes the block through the agent's relay, then HTTP
        from the source itself.
        """
        out: list[tuple[str, ReplicaRecord]] = []
        base = base_url(source)
        if self.moqt is not None and self.moqt.reachable:
            for r in records:
                if (r.is_moqt and r.http_holder is not None and base_url(r.http_holder) == base
                        and self.moqt.accepts(r)):
                    out.append(("moqt", r))
                    break
        for r in records:
            if not r.is_moqt and base_url(r.holder) == base:
                out.append(("http", r))
                break
        return out

    async def _load_one(self, d: PrefetchDirective, key: str, sources: Sequence[str],
                        records: Sequence[ReplicaRecord],
                        batch: Mapping[str, "asyncio.Future[str | None]"]) -> str | None:
        """The transport the block was loaded over ("held" when it already was), or None;
        a lease of `batch` covers the block at its source when there is one."""
        bid = BlockId(d.compat_id, d.scope_id, key)
        if bid in self.store:
            return "held"
        for source in sources:
            attempts = self._attempts(source, records)
            if not attempts:
                log.info("prefetch %s: no record of %s at %s", d.directive, key[:12], source)
                continue
            shared = batch.get(source)
            lease = await asyncio.shield(shared) if shared is not None else None
            keeper: LeaseKeeper | None = None
            if lease is None:
                try:
                    lease = await self.leases.acquire(source, [key], d.lease_ms)
                except KvspError as e:
                    log.info("prefetch %s: lease for %s at %s refused: %s", d.directive, key[:12],
                             source, e.detail)
                    continue
                keeper = LeaseKeeper(self.leases, d.lease_ms)
                keeper.add(source, lease)
            try:
                for kind, record in attempts:
                    try:
                        if kind == "moqt":
                            assert self.moqt is not None
                            result = await self.moqt.fetch_block(record)
                        else:
                            result = await self.fetcher.fetch_block([source], record)
                    except asyncio.CancelledError:
                        raise
                    except PreconditionFailed:
                        return "held"
                    except Exception as e:  # any failure of a transport moves on to the next
                        log.info("prefetch %s: %s over %s from %s failed: %s", d.directive, key[:12],
                                 kind, record.holder, getattr(e, "detail", None) or repr(e))
                        continue
                    if self.on_transfer is not None:
                        self.on_transfer(base_url(source), result.bytes_received, result.seconds)
                    if bid in self.store:
                        return "held"
                    try:
                        entry = await self.store.put(bid, result.container.buffer)
                    except PreconditionFailed:
                        return "held"  # stored meanwhile (a request computed or loaded it)
                    except KvspError as e:
                        log.info("prefetch %s: %s not stored: %s", d.directive, key[:12], e.detail)
                        continue
                    self.announce(entry)
                    self.stats[kind] += 1
                    return kind
            finally:
                if keeper is not None:
                    await keeper.release()
        return None
