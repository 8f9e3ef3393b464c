"""Loading the blocks of a prefix layer by layer into a pool the model reads (KVSP §6.6, §6.7).

`PrefixLoader` fills a pool (the agent's `KVPool`, the vLLM connector's paged blocks: anything
with the `LayerPool` methods) with the matched prefix of a prompt while the model already
runs: every block has an ordered list of candidate replicas (`kvsp_moq.fetch.sources`), read
through `kvsp_moq.fetch.fallback`, which leases each candidate at its holder before the first
octet is read from it and delivers the layers verified and in ascending order; they are copied
into the pool, and layer ``l`` is marked ready once every block holds it, so the forward pass
waiting on layer ``l`` can go on. Loading layer ``l + 1`` thus overlaps computing layer ``l``.

Requests go out layer-range-major: range 0 (the first layers) of every block, then range 1 of
every block, and so on, from a bounded set of workers. A holder streams a whole response at
once, so one request per whole block would deliver block after block and make layer 0 wait for
the last block; layer ranges make the early layers of the whole prefix arrive first. A prefix
of 8 MiB or more starts with layer 0 alone and doubles the range from there, up to about 1 MiB
per request (`layer_ranges`); a smaller one loads whole blocks, in less time than the extra
requests would cost.

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
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvsp_moq.errors import LayersUnavailable, reason_of
from kvsp_moq.fetch.fallback import (
    BlockCandidates,
    CandidatesExhausted,
    SourcedLayer,
    lease_first_candidates,
)
from kvsp_moq.fetch.leases import LeaseClient, LeaseKeeper
from kvsp_moq.fetch.sources import SourceCandidate, live_producer
from kvsp_moq.fetch.stream import SourceFailed
from kvsp_moq.fetch.transfers import TransferObserver, TransferTally
from kvsp_moq.protocol.container import Buffer, layer_digest

__all__ = ["LayerPool", "LayerReadiness", "LoadReport", "PrefixLoader", "Timeline", "TransferObserver",
           "layer_ranges"]


class LayerPool(Protocol):
    """Where a prefix load puts its layers: one slot per block, K and V sections per layer (the
    agent's `KVPool`, the vLLM connector's `PagedBlocks`)."""

    @property
    def block_keys(self) -> Sequence[str]: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def section_bytes(self) -> int:
        """Octets of one block's K (or V) of one layer."""

    def place(self, slot: int, layer: int, k: Buffer, v: Buffer) -> None:
        """Copy one verified layer of the block in `slot` into place."""

    def layer_complete(self, layer: int) -> None:
        """Every block now holds `layer` (a device may start its copies)."""

    def wait_layer(self, layer: int) -> None:
        """Block until `layer`'s copies are usable by the model."""


# --------------------------------------------------------------------------- readiness


class LayerReadiness:
    """Per-layer readiness flags that a loader sets and the forward pass waits on.

    A loader failure is propagated to the waiting forward pass via :meth:`fail`,
    rather than leaving it blocked forever.
    """

    def __init__(self, num_layers: int, *, timeout: float | None = None) -> None:
        self._ready = [False] * num_layers
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._timeout = timeout

    def mark_ready(self, layer: int) -> None:
        """Publish that layer ``layer``'s tensors are completely written."""
        with self._cond:
            self._ready[layer] = True
            self._cond.notify_all()

    def mark_all_ready(self) -> None:
        with self._cond:
            self._ready = [True] * len(self._ready)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Abort every current and future wait with ``error``."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def is_ready(self, layer: int) -> bool:
        with self._cond:
            return self._ready[layer]

    def wait_for_layer(self, layer: int) -> None:
        """Block until ``layer`` is ready; usable directly as ``KVPrefix.wait_for_layer``."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._ready[layer] or self._error is not None, self._timeout)
            if self._error is not None:
                raise RuntimeError(f"loading the prefix of layer {layer} failed") from self._error
            if not ok:
                raise TimeoutError(f"prefix layer {layer} was not ready within {self._timeout} s")


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

        return [{"layer": layer,
                 "load": [ms(self.load_start[layer]), ms(self.load_end[layer])],
                 "wait": ms(self.wait_start[layer]),
                 "compute": [ms(span[0]), ms(span[1])] if span else None}
                for layer, span in enumerate(self.compute_spans())]


# --------------------------------------------------------------------------- prefix loading


def layer_ranges(layers: int, blocks: int, layer_bytes: int, layers_per_request: int | None,
                 request_bytes: int, split_bytes: int) -> list[tuple[int, int]]:
    """The layer ranges requested of every block, in the order they are requested.

    With `layers_per_request` given, ranges of that many layers. Otherwise requests of about
    `request_bytes` (`layer_bytes` is one layer of one block): smaller ones would pay the
    per-request cost (HTTP or MOQT) too often. A prefix smaller than `split_bytes` loads whole
    blocks, in less time than more requests would cost. A larger one starts with layer 0 alone
    and doubles the range from there (0, 1, 2-3, 4-7, ...): the forward pass waits only for
    the first layer of every block, and each later range has the computation of the layers
    before it to arrive in.
    """
    if layers_per_request is not None:
        step = max(1, layers_per_request)
        return [(a, min(a + step, layers) - 1) for a in range(0, layers, step)]
    largest = max(1, min(layers, -(-request_bytes // max(1, layer_bytes))))
    if blocks * layers * layer_bytes < split_bytes:
        return [(a, min(a + largest, layers) - 1) for a in range(0, layers, largest)]
    out: list[tuple[int, int]] = []
    a, size = 0, 1
    while a < layers:
        out.append((a, min(a + size, layers) - 1))
        a += size
        if a > 1:
            size = min(2 * size, largest)
    return out


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
    #: the digest each placed layer was checked against, where the source told it
    digests: list[bytes | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.digests:
            self.digests = [None] * len(self.placed)

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

    def __init__(self, pool: LayerPool, blocks: Sequence[Sequence[SourceCandidate]], *,
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
        self.ranges = layer_ranges(layers, len(blocks), 2 * pool.section_bytes,
                                   layers_per_request, request_bytes, split_bytes)
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
        #: instances whose live layers failed this load (`live_producer`): not rivals to give way to
        self.failed_producers: set[str] = set()
        self._octets = 0
        self._tally = TransferTally()
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

    def layer_digests(self, slot: int) -> list[bytes] | None:
        """The digests block `slot`'s layers were checked against, when every one is known
        (its copy can then be stored without hashing it again)."""
        digests = self._blocks[slot].digests
        return None if any(d is None for d in digests) else digests  # type: ignore[return-value]

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
            # A block still being produced (its first candidate a live record) is one
            # subscription from layer 0, each layer taken as it is computed: ranges would each
            # be a subscription of their own, and the relay's feed could end between them and
            # make the producer send the block again. They wait on the producer, not on the
            # links, so they do not take the workers' turns.
            live = [blk for blk in self._blocks if blk.candidates.candidates
                    and blk.candidates.candidates[0].record.live]
            stored = [blk for blk in self._blocks if blk not in live]
            last = self.pool.num_layers - 1
            queue = deque((a, b, blk) for a, b in self.ranges for blk in stored)
            count = min(self.concurrency, len(queue))
            workers = [asyncio.create_task(self._worker(queue)) for _ in range(count)]
            # Blocks that are slots of one pass track: one subscription for all of them.
            passes: dict[tuple[int, str, int], list[_Block]] = {}
            for blk in live:
                cand = blk.candidates.candidates[0]
                if cand.record.live_pass is not None and hasattr(cand.source, "pass_layers"):
                    key = (id(cand.source), cand.record.live_pass[0], cand.record.codec)
                    passes.setdefault(key, []).append(blk)
            grouped = {blk for group in passes.values() if len(group) > 1 for blk in group}
            workers += [asyncio.create_task(self._load_pass(group)) for group in passes.values()
                        if len(group) > 1]
            workers += [asyncio.create_task(self._load_range(blk, 0, last)) for blk in live
                        if blk not in grouped]
            try:
                await asyncio.gather(*workers)
            except BaseException as e:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                self.readiness.fail(e)
                raise
        self.done = True
        self._tally.report(self.on_transfer)
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

    async def _worker(self, queue: deque[tuple[int, int, _Block]]) -> None:
        while queue:
            first, last, blk = queue.popleft()
            if blk.failed or blk.slot >= self._abort_from:
                continue
            await self._load_range(blk, first, last)

    def _note_failure(self, key: str, cand: SourceCandidate, reason: str) -> None:
        self._failures.append({"block_key": key, "source": cand.record.holder,
                               "kind": cand.source.kind, "reason": reason})
        if cand.record.live:
            self.failed_producers.add(live_producer(cand.record))

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
            self._tally.add(done.candidate.lease_holder, done.octets, done.started)

    async def _load_pass(self, blocks: list[_Block]) -> None:
        """Blocks that are slots of one pass track (DESIGN §9.6): each layer of all of them
        from one object, each slot checked to be the block expected and against its layer
        digest (the Block Key and digest the object carries for it); a slot that does not
        match, and every block not complete when the track fails, go on from their first
        missing layer through their own candidates (`_load_range`)."""
        cand = blocks[0].candidates.candidates[0]
        source: Any = cand.source
        last = self.pool.num_layers - 1
        tl = self.timeline
        started = time.perf_counter()
        for layer in range(last + 1):
            if tl.load_start[layer] is None:
                tl.load_start[layer] = started
        slots = [(blk.candidates.candidates[0].record.live_pass[1], blk) for blk in blocks]  # type: ignore[index]
        dropped: set[int] = set()
        octets = 0
        arrived = False
        layers = source.pass_layers(cand.record, 0, last)
        try:
            async for index, layer in layers:
                arrived = True
                for slot, blk in slots:
                    if blk.slot in dropped or blk.failed or blk.slot >= self._abort_from or blk.placed[index]:
                        continue
                    if slot >= len(layer):
                        await self._give_up_producer(blk, dropped, f"the pass has no slot {slot}")
                        continue
                    k, v, digest, key = layer[slot]
                    if key != blk.key:
                        await self._give_up_producer(blk, dropped, f"slot {slot} of the pass is block "
                                                     f"{key[:12]}, not {blk.key[:12]}")
                        continue
                    if layer_digest(k, v) != digest:
                        await self._give_up_producer(blk, dropped, f"layer {index} of pass slot {slot} "
                                                     "does not match the digest it carries")
                        continue
                    self.pool.place(blk.slot, index, k, v)
                    blk.digests[index] = digest
                    octets += len(k) + len(v)
                    self._placed(blk, index, cand.source.kind)
                if all(b.slot in dropped or b.slot >= self._abort_from for b in blocks):
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the track failed: each block goes on by itself
            reason = f"the pass track failed: {reason_of(e)}"
            if not (arrived or isinstance(e, SourceFailed)):
                self._note_failure(blocks[0].key, cand, reason)
            else:
                # The pass stopped or stalled mid-way: its blocks' own tracks, from the same
                # producer, would wait on it too (the relay holds a SUBSCRIBE for a publisher
                # gone for its rendezvous time). Only a pass already gone when asked (its blocks
                # stored since) leaves them to be read from their block tracks.
                for blk in blocks:
                    if not blk.complete and blk.slot not in dropped:
                        await self._give_up_producer(blk, dropped, reason)
        finally:
            await layers.aclose()
            self._octets += octets
            if octets:
                self._tally.add(cand.lease_holder, octets, started)
        rest = [blk for blk in blocks if not blk.complete and not blk.failed and blk.slot < self._abort_from]
        await asyncio.gather(*(self._load_range(blk, 0, last) for blk in rest))

    async def _give_up_producer(self, blk: _Block, dropped: set[int], reason: str) -> None:
        """A pass slot failed: its producer is a failed source for the block (its block track
        would serve the same layers), which goes on through its other candidates."""
        dropped.add(blk.slot)
        own = blk.candidates.candidates[0]
        blk.candidates.fail(own, reason)  # noted in the load's failures
        await blk.candidates.drop(own)

    def _deliver(self, blk: _Block, layer: SourcedLayer) -> None:
        """Copy a verified layer into the pool (an error here fails the source, as a bad layer
        would); nothing once an earlier block has failed."""
        if blk.slot >= self._abort_from or blk.placed[layer.index]:
            return
        self.pool.place(blk.slot, layer.index, layer.k, layer.v)
        listed = layer.candidate.record.layer_digests
        if listed is not None:  # what the layer was checked against
            blk.digests[layer.index] = bytes.fromhex(listed[layer.index])
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
