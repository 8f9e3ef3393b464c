"""Where a block's layers can be read from, and in which order to try them (DESIGN §5).

A `LayerSource` is one way to read replicas: over HTTP from the holder (§6.7), over MOQT
through a relay (DESIGN §4), or in place from the caller's own holder store. Each replica of a
block that a source accepts is a `SourceCandidate`; `order_candidates` puts them in the
sources' order (cheapest first: local, then MOQT, then HTTP), and `fetch.fallback` tries them
in that order. A caller with another way to read replicas (a test double, a different
transport) plugs it in by implementing `LayerSource`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator, Protocol, Sequence, runtime_checkable

from kvsp_moq.errors import TransportError, reason_of
from kvsp_moq.fetch.http import HttpFetcher
from kvsp_moq.fetch.stream import FetchedBlock
from kvsp_moq.naming import PassSlot
from kvsp_moq.protocol.container import Buffer, Container
from kvsp_moq.protocol.records import BlockId, ReplicaRecord
from kvsp_moq.protocol.urls import base_url

if TYPE_CHECKING:  # the MOQT binding is imported only by callers that read over MOQT
    from kvsp_moq.fetch.moqt import MoqtBlockFetcher

__all__ = [
    "BlockSource", "HttpLayerSource", "LayerSource", "LayerTuple", "LocalLayerSource", "LocalStore",
    "MoqtLayerSource", "PinnedLayers", "SourceCandidate", "lease_holder", "live_producer", "order_candidates",
]

log = logging.getLogger("kvsp.fetch.sources")

#: (layer index, K section, V section) of one verified layer.
LayerTuple = tuple[int, Buffer, Buffer]


@runtime_checkable
class LayerSource(Protocol):
    """One way to read a replica's layers: verified, in ascending order.

    `layers(record, first, last)` yields ``(index, K, V)`` for layers first..last of the
    replica the record describes, each already checked against the record's layer digest, and
    raises (any exception) when the source cannot deliver the rest; the fallback then goes on
    from the next candidate at the first layer not yet delivered.
    """

    kind: str
    """"local", "moqt" or "http": the name a load is counted under."""
    needs_lease: bool
    """Whether a lease must be taken at the record's holder before reading (§6.6)."""

    def accepts(self, record: ReplicaRecord) -> bool: ...

    def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]: ...


@runtime_checkable
class BlockSource(LayerSource, Protocol):
    """A `LayerSource` that also reads a whole replica as one verified container: a prefetch
    stores whole blocks, and a transport that hands over its container as it came avoids
    encoding the layers into a new one."""

    async def fetch_block(self, record: ReplicaRecord) -> FetchedBlock: ...


class HttpLayerSource:
    """Layers over HTTP (§6.7) from the record's holder, via `HttpFetcher`."""

    kind = "http"
    needs_lease = True

    def __init__(self, fetcher: HttpFetcher) -> None:
        self.fetcher = fetcher

    def accepts(self, record: ReplicaRecord) -> bool:
        return record.holder.lower().startswith(("http://", "https://"))

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        stream = self.fetcher.layers([record.holder], record, (first, last))
        try:
            async for layer in stream:
                yield layer.index, layer.k, layer.v
        finally:
            await stream.aclose()

    async def fetch_block(self, record: ReplicaRecord) -> FetchedBlock:
        """The whole block as one verified container (prefetch)."""
        return await self.fetcher.fetch_block([record.holder], record)


class MoqtLayerSource:
    """Layers over MOQT (DESIGN §4) through the caller's relay, via `MoqtBlockFetcher`;
    leases go to the record's "http_holder".

    Every MOQT replica is read through the caller's own relay (the fetcher's TLS settings
    were chosen for it), whichever relay its record names: relays chained with --upstream
    forward a request for a namespace published elsewhere in the chain, and where no chain
    leads there the fetch is a miss like any other and the next candidate is tried.

    A relay that cannot be reached, or whose requests time out, is skipped for `down_s`:
    every block would otherwise wait for its own connection attempt (one at a time, as the
    fetcher keeps one session per relay) before falling back to HTTP. Concurrent reads share
    one connection attempt.
    """

    kind = "moqt"
    needs_lease = True

    def __init__(self, fetcher: "MoqtBlockFetcher", relay: str, *, down_s: float = 5.0) -> None:
        self.fetcher = fetcher
        self.relay = relay.rstrip("/").lower()
        self.down_s = down_s
        self._down_until = 0.0
        self._probes: dict[str, asyncio.Future] = {}

    def accepts(self, record: ReplicaRecord) -> bool:
        return record.is_moqt and bool(record.moqt_namespace) and record.http_holder is not None

    def _via(self, record: ReplicaRecord) -> ReplicaRecord:
        """The record as read through this relay."""
        if record.holder.rstrip("/").lower() == self.relay:
            return record
        return dataclasses.replace(record, holder=self.relay)

    @property
    def reachable(self) -> bool:
        """False while the relay is taken to be down (after a failed connection or a timeout)."""
        return time.monotonic() >= self._down_until

    def _mark_down(self, reason: object) -> None:
        if self.reachable:
            log.info("relay %s unusable (%s); HTTP only for %.1fs", self.relay, reason, self.down_s)
        self._down_until = time.monotonic() + self.down_s

    async def _ready(self, url: str) -> None:
        """A session to the relay, or TransportError at once while it is known to be down."""
        if not self.reachable:
            raise TransportError(f"the relay {self.relay} is unreachable")
        probe = self._probes.get(url)
        if probe is None or probe.done():
            probe = asyncio.ensure_future(self.fetcher.connection(url))
            probe.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._probes[url] = probe
        try:
            await asyncio.shield(probe)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._mark_down(reason_of(e, named=True))
            raise TransportError(f"the relay {self.relay} is unreachable: {reason_of(e, named=True)}") from None

    def connect(self) -> None:
        """Start the session to the relay in the background, so that the first load does not
        wait for a whole handshake; a failure here marks nothing down (the first load retries)."""
        if self.relay not in self._probes:
            probe = asyncio.ensure_future(self.fetcher.connection(self.relay))
            probe.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._probes[self.relay] = probe

    async def pass_layers(self, record: ReplicaRecord, first: int, last: int
                          ) -> AsyncIterator[tuple[int, list[PassSlot]]]:
        """Layers first..last of the pass track an in-production record names (`live_pass`,
        DESIGN §9.6), every slot of each, not yet checked."""
        assert record.live_pass is not None
        await self._ready(self.relay)
        try:
            async for layer in self.fetcher.pass_layers(self.relay, record.live_pass[0], record.codec,
                                                        first, last):
                yield layer
        except TransportError as e:
            self._mark_down(e.detail)
            raise

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        record = self._via(record)
        await self._ready(record.holder)
        stream = self.fetcher.layers([record.holder], record, (first, last))
        try:
            async for layer in stream:
                yield layer.index, layer.k, layer.v
        except TransportError as e:  # timed out or cut off, not a miss or a bad layer
            self._mark_down(e.detail)
            raise
        finally:
            await stream.aclose()

    async def fetch_block(self, record: ReplicaRecord) -> FetchedBlock:
        """The whole block as one verified container (prefetch), under the same health gate."""
        record = self._via(record)
        await self._ready(record.holder)
        try:
            return await self.fetcher.fetch_block([record.holder], record)
        except TransportError as e:
            self._mark_down(e.detail)
            raise


class _HeldReplica(Protocol):
    @property
    def host(self) -> Container | None: ...


class PinnedLayers(Protocol):
    """Layers of a replica pinned for reading (the holder store's `BlockRead`)."""

    @property
    def entry(self) -> _HeldReplica: ...

    def chunks(self) -> Iterator[Buffer]: ...

    def release(self) -> None: ...


class LocalStore(Protocol):
    """What `LocalLayerSource` needs of a holder's store (`kvsp_moq.holder.store.BlockStore`),
    spelled out so that fetching does not depend on the holder."""

    def get(self, bid: BlockId) -> object | None: ...

    async def open_read(self, bid: BlockId, first: int | None = None,
                        last: int | None = None) -> PinnedLayers: ...


class LocalLayerSource:
    """Layers of replicas in the caller's own holder store, read in place.

    The store computed the layer digests of these octets when it took them, and the caller's
    records are made from those digests, so the layers are not hashed again here.
    """

    kind = "local"
    needs_lease = False

    def __init__(self, store: LocalStore, self_url: Callable[[], str]) -> None:
        self.store = store
        self.self_url = self_url

    def accepts(self, record: ReplicaRecord) -> bool:
        return base_url(record.holder) == base_url(self.self_url())

    def holds(self, bid: BlockId) -> bool:
        return self.store.get(bid) is not None

    async def layers(self, record: ReplicaRecord, first: int, last: int) -> AsyncIterator[LayerTuple]:
        bid = BlockId(record.compat_id, record.scope_id, record.block_key)
        read = await self.store.open_read(bid, first, last)  # pinned: not evicted meanwhile
        try:
            host = read.entry.host
            container = host if host is not None else Container(b"".join(read.chunks()))
            for index in range(first, last + 1):
                layer = container.layer(index)
                yield index, layer.k, layer.v
        finally:
            read.release()


@dataclass(frozen=True)
class SourceCandidate:
    """One replica of a block and the source that reads it."""

    source: LayerSource
    record: ReplicaRecord

    @property
    def lease_holder(self) -> str:
        return lease_holder(self.record)

    @property
    def needs_lease(self) -> bool:
        """A lease pins a stored replica; a block still being produced (`live`) has none yet
        and lives at its producer until it is stored."""
        return self.source.needs_lease and not self.record.live


def lease_holder(record: ReplicaRecord) -> str:
    """Where a replica's leases are taken and its blocks are served over HTTP: a MOQT
    replica's HTTP holder, else the holder itself."""
    return base_url(record.http_holder or record.holder)


def live_producer(record: ReplicaRecord) -> str:
    """The instance that produces (or produced) a replica, by the base URL its record names.

    Of two instances computing the same block, the one whose URL sorts first keeps producing
    and the other subscribes to it (DESIGN §9): both decide alike from the same records."""
    return base_url(record.http_holder or record.holder)


def order_candidates(records: Sequence[ReplicaRecord],
                     sources: Sequence[LayerSource]) -> list[SourceCandidate]:
    """Replicas ordered by the sources' order (local, MOQT, HTTP), one per holder, track and
    kind; within a source, stored replicas before blocks still being produced (`live`), and
    those by `live_producer`, the producer that two computing one block settle on first."""
    out: list[SourceCandidate] = []
    seen: set[tuple[str, str, str]] = set()
    # stable: the given order otherwise
    records = sorted(records, key=lambda r: (r.live, live_producer(r) if r.live else ""))
    for source in sources:
        for record in records:
            ident = (source.kind, base_url(record.holder), record.moqt_namespace or "")
            if ident in seen or not source.accepts(record):
                continue
            seen.add(ident)
            out.append(SourceCandidate(source, record))
    return out
