"""Where the blocks a vLLM engine computes go: its embedded holder, or a holder it PUTs to.

"holder": "embedded" runs `kvsp_moq.holder` inside the worker (`Holder`: the store with its
tiers, leases, the HTTP block resources, with "relay" the MOQT publisher too, and the publisher
that keeps the blocks' Replica Records in the Index Service, §6.1). A block is stored there and
announced; records follow within milliseconds, and other instances load it over HTTP or, through
the relay, over MOQT. A holder URL instead sends each block there with PUT If-None-Match: *
(§6.7); that holder publishes it. Either way `put` returns at once: the engine's step never waits
for storage or the index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
from typing import Callable

import httpx

from kvsp_moq.errors import KvspError, PreconditionFailed
from kvsp_moq.holder.moqt_publisher import LiveBlock
from kvsp_moq.holder.service import Holder
from kvsp_moq.holder.settings import HolderSettings
from kvsp_moq.holder.store import BlockId
from kvsp_moq.index_client import raise_for_problem
from kvsp_moq.integrations.vllm.config import ConnectorConfig
from kvsp_moq.integrations.vllm.loop import LoopThread
from kvsp_moq.protocol.container import MEDIA_TYPE
from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.vllm.publish")

__all__ = ["BlockSink", "EmbeddedHolder", "RemoteHolder", "make_sink"]

#: Called with "stored", "held" (the holder had the block already) or "failed".
Done = Callable[[str], None]


class BlockSink:
    """Takes finished KVB1 containers; `put` never blocks the caller."""

    url: str | None = None

    def __init__(self) -> None:
        self._pending: set[concurrent.futures.Future[str]] = set()
        self._lock = threading.Lock()

    def put(self, bid: BlockId, container: bytes, done: Done) -> None:
        future = self._submit(bid, container)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        future.add_done_callback(_report(done))

    def _forget(self, future: "concurrent.futures.Future[str]") -> None:
        with self._lock:
            self._pending.discard(future)

    def _submit(self, bid: BlockId, container: bytes) -> "concurrent.futures.Future[str]":
        raise NotImplementedError

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for the blocks handed over so far: an engine that stops right after a
        request must not lose the blocks still on their way."""
        with self._lock:
            pending = list(self._pending)
        if pending:
            concurrent.futures.wait(pending, timeout)

    def close(self) -> None:
        pass


def _report(done: Done) -> Callable[["concurrent.futures.Future[str]"], None]:
    def callback(f: "concurrent.futures.Future[str]") -> None:
        if f.cancelled():
            done("failed")
            return
        error = f.exception()
        if error is not None:
            log.info("storing a block failed: %s", getattr(error, "detail", None) or repr(error))
            done("failed")
        else:
            done(f.result())
    return callback


class EmbeddedHolder(BlockSink):
    """A holder in this process: blocks go straight into its store."""

    def __init__(self, config: ConnectorConfig) -> None:
        super().__init__()
        settings = HolderSettings(
            listen=config.listen, data_dir=config.data, index_url=config.index,
            public_url=config.public_url, host_bytes=config.host_bytes,
            disk_bytes=config.disk_bytes, record_ttl_ms=config.record_ttl_ms,
            relay=config.relay, relay_ca=config.relay_ca, relay_insecure=config.relay_insecure,
            principals=config.principals, index_token=config.token, quic=config.quic)
        self.holder = Holder(settings).start()
        self.url = self.holder.url
        log.info("embedded holder at %s%s", self.url,
                 f", publishing over MOQT through {config.relay}" if config.relay else "")

    async def _store(self, bid: BlockId, container: bytes) -> str:
        if bid in self.holder.store:
            return "held"
        try:
            entry = await self.holder.store.put(bid, container)
        except PreconditionFailed:
            return "held"
        self.holder.publisher.announce(entry)
        return "stored"

    def _submit(self, bid: BlockId, container: bytes) -> "concurrent.futures.Future[str]":
        loop = self.holder.app.state.loop
        if loop is None:
            failed: concurrent.futures.Future[str] = concurrent.futures.Future()
            failed.set_exception(KvspError("the embedded holder is not running"))
            return failed
        return asyncio.run_coroutine_threadsafe(self._store(bid, container), loop)

    # live KV: blocks published layer by layer while vLLM computes them ---------------------

    @property
    def live_capable(self) -> bool:
        """Whether blocks can be produced live: the holder publishes through a relay."""
        return self.holder.moqt_publisher is not None

    def open_live(self, blocks: list[tuple[BlockId, int, int]], timeout: float = 5.0
                  ) -> list[LiveBlock | None]:
        """Open a live block per (block, layer count, token count), on the holder's loop; None
        for one stored or produced here already (it is not produced twice)."""
        loop = self.holder.app.state.loop
        publisher = self.holder.moqt_publisher
        if loop is None or publisher is None:
            return [None] * len(blocks)

        async def open_all() -> list[LiveBlock | None]:
            out: list[LiveBlock | None] = []
            for bid, layers, tokens in blocks:
                if bid in self.holder.store:
                    out.append(None)
                    continue
                try:
                    out.append(publisher.produce(bid, layer_count=layers, token_count=tokens))
                except KvspError:  # being produced already
                    out.append(None)
            return out

        return asyncio.run_coroutine_threadsafe(open_all(), loop).result(timeout)

    def add_live_layer(self, live: LiveBlock, index: int, k: bytes | memoryview,
                       v: bytes | memoryview) -> None:
        """Layer `index` of a live block, from the model's thread: hashed here, appended on the
        holder's loop (subscribers get it at once); skipped if the block was abandoned or a
        layer is missing before it (the block then is stored whole, not from live layers)."""
        payload = memoryview(bytes(k) + bytes(v)).toreadonly()
        digest = hashlib.sha256(payload).digest()
        loop = self.holder.app.state.loop
        if loop is None:
            return

        def add() -> None:
            if live.error is None and live.available == index:
                live.add_layer(payload[:len(k)], payload[len(k):], payload=payload, digest=digest)

        loop.call_soon_threadsafe(add)

    def finish_live(self, live: LiveBlock, done: Done) -> None:
        """Store a live block from its layers (its in-production record becomes the complete
        one); `done` as for `put`."""
        loop = self.holder.app.state.loop

        async def finish() -> str:
            if not live.complete:
                live.abort("not every layer was computed")
                raise KvspError("a live block missed layers")
            entry = await live.finish()
            if entry is None:
                return "held"
            self.holder.publisher.announce(entry)
            return "stored"

        if loop is None:
            done("failed")
            return
        future = asyncio.run_coroutine_threadsafe(finish(), loop)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        future.add_done_callback(_report(done))

    def abort_live(self, live: LiveBlock, reason: str) -> None:
        loop = self.holder.app.state.loop
        if loop is not None:
            loop.call_soon_threadsafe(live.abort, reason)

    def close(self) -> None:
        self.holder.stop()


class RemoteHolder(BlockSink):
    """A holder elsewhere: each block is PUT there (that holder publishes its records)."""

    def __init__(self, config: ConnectorConfig, loop: LoopThread) -> None:
        super().__init__()
        assert config.holder is not None
        self.url = base_url(config.holder)
        self.loop = loop
        self.headers = {"If-None-Match": "*", "Content-Type": MEDIA_TYPE}
        if config.token:
            self.headers["Authorization"] = f"Bearer {config.token}"
        self._client: httpx.AsyncClient | None = None

    async def _put(self, bid: BlockId, container: bytes) -> str:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False)
        try:
            r = await self._client.put(f"{self.url}blocks/{bid.path}", content=container,
                                       headers=self.headers)
        except httpx.HTTPError as e:
            raise KvspError(f"holder {self.url} unreachable: {type(e).__name__}") from None
        if r.status_code == 412:
            return "held"
        raise_for_problem(r)
        return "stored"

    def _submit(self, bid: BlockId, container: bytes) -> "concurrent.futures.Future[str]":
        return self.loop.submit(self._put(bid, container))

    def close(self) -> None:
        async def close() -> None:
            if self._client is not None:
                await self._client.aclose()

        try:
            self.loop.call(close(), 5.0)
        except Exception:  # closing anyway
            pass


def make_sink(config: ConnectorConfig, loop: LoopThread) -> BlockSink | None:
    """The sink the config names; None when nothing computed here is to be stored."""
    if config.holder is None:
        return None
    if config.embedded:
        return EmbeddedHolder(config)
    return RemoteHolder(config, loop)
