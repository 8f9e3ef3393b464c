"""Live KV at the producer (DESIGN §9): the prompt blocks a prefill computes, published layer
by layer while the forward pass runs.

Before the pass, every complete prompt block it will compute (and that is neither stored nor
already being produced here) is opened with the holder's `BlockPublisher.produce`, which makes
its track servable and, through the index publisher, puts an in-production record. A hook
after each decoder layer (`ModelAdapter.prefill(on_layer=...)`) hands layer l of the pass's new
tokens over on the model thread; each block's slice is copied to octets and hashed there, and
added to its live block on the event loop, so subscribers receive layer l while layer l+1
computes. After the pass the exporter stores the blocks from their live layers (`finish`);
a pass that fails abandons them, which withdraws their records.

Two instances that get a new prefix within the time it takes either to publish its records
both find nothing and both compute it. Each then looks up the first block of its pass once its
own in-production records are in (`watch_rivals`), and again for a short while: the one whose
URL sorts after another's in-production record stops its pass at the next layer (`Outpaced`),
withdraws its records and subscribes to the other. Both decide from the same records, so at
most one of two stops, and the later of the two to look always sees the other.

A consumer holds the producer to what it sent (`audit_live_loads`): the layers of a live block
were checked against the digests they carried, and the copy stored from them lists those
digests; once the producer's complete record is in the index it must list the same ones. A
block whose record differs is discarded here and counted: the producer published one thing and
stored another.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from agent.pool import tensor_octets
from kvsp_moq.errors import KvspError
from kvsp_moq.fetch.sources import live_producer
from kvsp_moq.holder.moqt_publisher import LiveBlock, LivePassTrack
from kvsp_moq.holder.store import BlockId, BlockStore
from kvsp_moq.index_client import IndexClient, LookupResult
from kvsp_moq.protocol.records import ReplicaRecord
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.agent.live")

#: opens the pass track of a pass whose first block is given: (block, layer count, token count)
Produce = Callable[[BlockId, int, int], LivePassTrack]
#: A pass track's object at most this large: relays and subscribers hold an object whole, a
#: relay drops a subscriber whose queue passes 32 MiB (`subscriber_queue_bytes`: four layers
#: behind at this size), and a session refuses an object above `QuicSettings.max_object_size`
#: (64 MiB). A longer pass is published as several pass tracks of consecutive blocks.
PASS_OBJECT_OCTETS = 8 << 20


class Outpaced(Exception):
    """Raised out of a forward pass whose prefix another instance produces too and that
    instance wins (`live_producer` sorts it first): subscribe to `winner` instead."""

    def __init__(self, winner: str) -> None:
        super().__init__(f"{winner} produces this prefix too")
        self.winner = winner


@dataclass
class LivePass:
    """The live blocks of one forward pass: block ``first + j`` is ``blocks[j]`` (slot j of
    its pass track), and the pass's new tokens start at position ``start``."""

    blocks: list[LiveBlock]
    first: int
    start: int
    block_tokens: int
    loop: asyncio.AbstractEventLoop
    #: the pass tracks, each of consecutive blocks, in order
    tracks: list[LivePassTrack] = field(default_factory=list)
    #: set (from the event loop) when another instance produces the same blocks and wins: the
    #: pass stops at its next layer
    yield_to: str | None = None

    @property
    def over(self) -> bool:
        return all(b.complete or b.error is not None for b in self.blocks)

    def on_layer(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """On the model thread, right after decoder layer ``index`` ran: each block's payload
        (its K section, then its V section) is made by one copy out of the cache for all the
        blocks of the pass, then hashed."""
        if self.yield_to is not None:
            raise Outpaced(self.yield_to)
        b, n = self.block_tokens, len(self.blocks)
        a = self.first * b - self.start
        rows = k[a:a + n * b]
        payloads = torch.empty((n, 2, b, *rows.shape[1:]), dtype=rows.dtype, device="cpu")
        payloads[:, 0].copy_(rows.reshape(n, b, *rows.shape[1:]))
        payloads[:, 1].copy_(v[a:a + n * b].reshape(n, b, *rows.shape[1:]))
        flat = tensor_octets(payloads).cast("B").toreadonly()
        size = len(flat) // n
        layer = []
        for j in range(n):
            payload = flat[j * size:(j + 1) * size]
            layer.append((payload, hashlib.sha256(payload).digest()))
        # One hand-over per layer, not per block: each wakes the event loop (a write to its pipe).
        self.loop.call_soon_threadsafe(self._add, index, flat, layer, size)

    def _add(self, index: int, flat: memoryview, layer: list[tuple[memoryview, bytes]], size: int) -> None:
        k_length = size // 2
        for live, (payload, digest) in zip(self.blocks, layer):
            if live.error is not None or live.available != index:
                continue  # abandoned meanwhile
            live.add_layer(payload[:k_length], payload[k_length:], payload=payload, digest=digest)
        lo = 0
        for track in self.tracks:
            hi = lo + len(track.blocks)
            if track.error is None and track.available == index:
                # the same octets: its slots' layers, joined as the blocks' layers were cut from them
                track.add_layer(flat[lo * size:hi * size], b"".join(d for _, d in layer[lo:hi]), k_length)
            lo = hi

    def abort(self, reason: str) -> None:
        for live in self.blocks:
            if not live.complete:
                live.abort(reason)
        for track in self.tracks:
            if not track.complete:
                track.abort(reason)


class LiveProducer:
    """Opens the live blocks of a pass through the holder's publisher."""

    def __init__(self, produce: Produce, *, num_layers: int, block_tokens: int, compat_id: str,
                 layer_octets: int | None = None) -> None:
        self.produce = produce
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.compat_id = compat_id
        #: blocks per pass track: as many as keep its objects (a layer of each, `layer_octets`
        #: apiece) within PASS_OBJECT_OCTETS
        self.pass_blocks = max(1, PASS_OBJECT_OCTETS // layer_octets) if layer_octets else 1 << 20

    def open(self, scope_id: str, keys: list[str], first: int, start: int,
             skip: Callable[[BlockId], bool]) -> LivePass | None:
        """A pass computing blocks ``first..len(keys)-1`` (tokens from ``start``): their live
        blocks, the slots of one pass track, opened in order up to the first one `skip` says
        is held already (a stored block is not produced twice). None when there is nothing
        to produce."""
        blocks: list[LiveBlock] = []
        tracks: list[LivePassTrack] = []
        for j, key in enumerate(keys[first:]):
            bid = BlockId(self.compat_id, scope_id, key)
            if skip(bid):
                break
            try:
                if j % self.pass_blocks == 0:
                    tracks.append(self.produce(bid, self.num_layers, self.block_tokens))
                blocks.append(tracks[-1].produce(bid))
            except KvspError as e:  # produced here already by another session
                log.debug("block %s not produced live: %s", key[:12], e.detail)
                break
        if tracks and not tracks[-1].blocks:
            tracks.pop().abort("no block to produce")
        if not blocks:
            return None
        return LivePass(blocks, first, start, self.block_tokens, asyncio.get_running_loop(), tracks=tracks)


async def watch_rivals(live: LivePass, index: IndexClient, *, me: str,
                       records_in: Callable[[BlockId], bool],
                       sent: Callable[[float], Awaitable[None]] | None = None,
                       window_s: float = 2.0, first_wait_s: float = 5.0,
                       distrusted: Collection[str] = ()) -> str | None:
    """Look for another instance producing the first block of `live` that wins over `me`;
    not one of `distrusted` (whose live layers failed this request: it would be given way to
    only to be loaded from again).

    Looks once this pass's in-production record of that block is in the index (`records_in`,
    woken by `sent`; at most `first_wait_s`), then again with growing pauses for `window_s`: a
    rival that started as late as this pass publishes its records within that time. On a
    winner, sets `live.yield_to` (the pass stops at its next layer) and returns it."""
    bid = live.blocks[0].id
    me = base_url(me)
    deadline = time.monotonic() + first_wait_s
    while not records_in(bid):
        if live.over or live.blocks[0].error is not None or time.monotonic() > deadline:
            return None
        if sent is not None:
            await sent(min(0.05, max(0.0, deadline - time.monotonic())))
        else:
            await asyncio.sleep(0.01)
    deadline = time.monotonic() + window_s
    delay = 0.02
    while not live.over:
        result = await _lookup(index, bid.compat_id, bid.scope_id, [bid.block_key])
        if result is not None and result.matched:
            rivals = sorted(p for r in result.blocks[0].replicas
                            if r.live and (p := live_producer(r)) != me and p not in distrusted)
            if rivals and rivals[0] < me:
                live.yield_to = rivals[0]
                return rivals[0]
        if time.monotonic() + delay > deadline:
            return None
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.5)
    return None


async def audit_live_loads(index: IndexClient, store: BlockStore, *, compat_id: str, scope_id: str,
                           producers: Mapping[str, str], wait_s: float = 10.0,
                           step_s: float = 0.1) -> tuple[list[str], list[str]]:
    """Compare the copies stored from live layers with their producers' complete records.

    `producers` maps each block key (leading blocks of one prompt, in order) to the HTTP base of
    the holder that produced it live. Waits (bounded) for the complete records; returns the keys
    compared, and those whose record lists other layer digests than the stored copy (discarded)."""
    pending = dict(producers)
    compared: list[str] = []
    mismatched: list[str] = []
    # The complete records come once the producer has stored its blocks, which may take a
    # while. Until then a look is a lookup of one block, the last (the producer stores them in
    # order); every pending block is looked up once that one is complete, or at the last look.
    # The looks thin out (x2, up to 1 s apart).
    deadline = time.monotonic() + wait_s
    delay = step_s
    for _ in range(max(1, int(wait_s / step_s))):
        keys = [k for k in producers if k in pending]
        if not keys:
            break
        last_look = time.monotonic() + delay > deadline
        if len(keys) == 1 or last_look or await _complete(index, compat_id, scope_id, keys[-1], pending):
            await _compare(index, store, compat_id, scope_id, keys, pending, compared, mismatched)
        if not pending or last_look:
            break
        await asyncio.sleep(delay)
        delay = min(2 * delay, max(step_s, 1.0))
    return compared, mismatched


def _complete_record(replicas: Sequence[ReplicaRecord], producer: str) -> ReplicaRecord | None:
    """The producer's complete record among a block's replicas, if it is in the index yet."""
    return next((r for r in replicas if not r.live and r.layer_digests
                 and base_url(r.http_holder or r.holder) == producer), None)


async def _lookup(index: IndexClient, compat_id: str, scope_id: str, keys: list[str]) -> LookupResult | None:
    try:
        return await index.lookup(scope_id, compat_id, keys)
    except KvspError as e:
        log.info("auditing live loads: lookup failed (%s)", e.detail)
        return None


async def _complete(index: IndexClient, compat_id: str, scope_id: str, key: str,
                    pending: Mapping[str, str]) -> bool:
    result = await _lookup(index, compat_id, scope_id, [key])
    return bool(result is not None and result.matched
                and _complete_record(result.blocks[0].replicas, pending[key]) is not None)


async def _compare(index: IndexClient, store: BlockStore, compat_id: str, scope_id: str,
                   keys: list[str], pending: dict[str, str], compared: list[str],
                   mismatched: list[str]) -> None:
    """One look at `keys`: each block whose complete record is in compared with the stored copy
    (and taken off `pending`), the copy discarded if they differ."""
    result = await _lookup(index, compat_id, scope_id, keys)
    for block in result.blocks[:result.matched] if result is not None else ():
        producer = pending.get(block.block_key)
        entry = store.get(BlockId(compat_id, scope_id, block.block_key))
        if producer is None or entry is None:
            pending.pop(block.block_key, None)
            continue
        record = _complete_record(block.replicas, producer)
        if record is None:
            continue  # not complete yet
        del pending[block.block_key]
        compared.append(block.block_key)
        if tuple(record.layer_digest_bytes()) != tuple(entry.meta.layer_digests):
            log.error("block %s: %s published layers live whose digests its complete record "
                      "does not list; the copy made from them is discarded", block.block_key[:12],
                      producer)
            mismatched.append(block.block_key)
            await store.discard(entry.id)


__all__ = ["LivePass", "LiveProducer", "Outpaced", "Produce", "audit_live_loads", "watch_rivals"]
