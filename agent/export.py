"""Export of the blocks a session computed: stored here, published, replicated (KVSP §4.2, §6.1).

Every complete block whose KV a session's decode state holds, prompt or generated, is cut out
as a KVB1 container on the model thread, put into the agent's own holder store and announced
(the publisher puts its records in the index and, with a relay, serves it over MOQT), so the
next request anywhere can load it. Blocks this session computed (not the ones it loaded, which
have their replicas already) are also stored at the `replicate_to` holders, so that they
outlive this instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

import httpx

from agent.model import DecodeState, ModelAdapter
from agent.options import EngineOptions
from agent.pool import block_container
from agent.sessions import Session
from kvsp_moq.errors import KvspError
from kvsp_moq.holder.store import BlockId, BlockStore

log = logging.getLogger("kvsp.agent.export")


class BlockExporter:
    """Stores, announces and replicates the complete blocks of sessions."""

    def __init__(self, adapter: ModelAdapter, *, store: BlockStore, announce: Callable[[Any], None],
                 is_published: Callable[[BlockId], bool], client: httpx.AsyncClient,
                 headers: Mapping[str, str], indexed: bool, compat_id: str, block_tokens: int,
                 options: EngineOptions, run_model: Callable[..., Awaitable[Any]],
                 spawn: Callable[[Any], asyncio.Task]) -> None:
        self.adapter = adapter
        self.store = store
        self.announce = announce
        self.is_published = is_published
        self.client = client
        self.headers = dict(headers)
        self.indexed = indexed  # an Index Service takes the records (else nothing to wait for)
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.options = options
        self.run_model = run_model
        self.spawn = spawn
        #: waits (at most its argument, in seconds) until the next batch of records reached the
        #: index; without it `wait_published` looks every 5 ms
        self.published_change: Callable[[float], Awaitable[None]] | None = None

    async def export(self, session: Session, state: DecodeState) -> None:
        """Store and publish every complete block whose KV is now cached and not held yet."""
        b = self.block_tokens
        ready = min(state.length // b, len(session.sequence.chain.keys))
        for i in range(session.exported, ready):
            key = session.sequence.chain.keys[i].hex()
            bid = BlockId(self.compat_id, session.scope_id, key)
            live = session.live.pop(key, None)
            if bid in self.store:
                if live is not None:
                    live.abort("stored already")
                continue
            try:
                if live is not None and live.complete:
                    # Produced live: its layers are the block's octets already.
                    octets = live.container()
                    stored = await live.finish()
                    if stored is None:
                        continue
                    entry = stored
                else:
                    if live is not None:
                        live.abort("the pass did not produce every layer")
                    pool = session.loaded_pool if i < session.loaded else None
                    # A loaded block is the pool's copy of the layers received (and verified):
                    # no pass through the model's state on its thread.
                    from_pool = pool.block_container(i) if pool is not None else None
                    octets = from_pool if from_pool is not None else await self.run_model(
                        self._block_octets, state, i * b, (i + 1) * b)
                    # Verified on arrival against these digests: not hashed again to store it.
                    digests = (session.loaded_digests[i] if from_pool is not None
                               and i < len(session.loaded_digests) else None)
                    entry = await self.store.put(bid, octets, layer_digests=digests)
            except KvspError as e:  # e.g. 412 from a concurrent put, or a full store
                log.info("block %s not stored: %s", key[:12], e.detail)
                continue
            self.announce(entry)
            if i >= session.loaded:  # a loaded block has its replicas already
                for holder in self.options.replicate_to:
                    self.spawn(self._replicate(holder, bid, octets))
        session.exported = max(session.exported, ready)
        if session.exported >= session.loaded:
            session.loaded_pool = None
            session.loaded_digests = []

    def _block_octets(self, state: DecodeState, start: int, end: int) -> bytes:
        """On the model thread: tokens [start, end) of `state` as a KVB1 container."""
        return block_container(self.adapter.kv_for_range(state, start, end))

    async def _replicate(self, holder: str, bid: BlockId, octets: bytes) -> None:
        url = f"{holder.rstrip('/')}/blocks/{bid.path}"
        try:
            r = await self.client.put(url, content=octets, headers={
                **self.headers, "If-None-Match": "*", "Content-Type": "application/kvsp-block"})
            if r.status_code not in (201, 204, 412):
                log.info("replicating %s to %s: HTTP %d", bid.block_key[:12], holder, r.status_code)
        except httpx.HTTPError as e:
            log.info("replicating %s to %s failed: %s", bid.block_key[:12], holder, e)

    async def wait_published(self, session: Session) -> None:
        """Until the blocks this session stored are in the index (bounded): a client that got
        the answer can count on the next lookup finding them."""
        if not self.indexed:
            return
        deadline = time.monotonic() + self.options.publish_wait_s
        keys = [k.hex() for k in session.sequence.chain.keys[:session.exported]]
        pending = [BlockId(self.compat_id, session.scope_id, k) for k in keys]
        pending = [bid for bid in pending if self.store.get(bid) is not None]
        for _ in range(int(self.options.publish_wait_s / 0.005) + 1):
            pending = [bid for bid in pending
                       if not self.is_published(bid) and self.store.get(bid) is not None]
            left = deadline - time.monotonic()
            if not pending or left < 0:
                return
            if self.published_change is not None:
                # Woken by the publisher; the bound covers what it does not see (the relay's
                # answer to an announcement, which `is_published` may also wait for).
                await self.published_change(min(left, 0.05))
            else:
                await asyncio.sleep(0.005)


__all__ = ["BlockExporter"]
