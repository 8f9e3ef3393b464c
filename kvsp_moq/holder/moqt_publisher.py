"""The holder's MOQT block publisher (DESIGN §4): its `BlockStore` served through a relay.

`BlockPublisher` announces ("kvsp", compat, scope, publisher_id) once per compat and scope,
answers FETCH of objects a..b of group 0 from the store, answers SUBSCRIBE with the layers on
one subgroup stream in ascending order, and reconnects (with backoff) and re-announces when the
relay restarts. Blocks still being computed are published with `produce()`: their layers go out
to subscribers as they are added. It must run on the event loop that owns the store. The track
naming and the layer objects' payload and properties are `kvsp_moq.naming`'s.

A SUBSCRIBE is answered as the draft's filters say, read for a track whose objects the
publisher holds: SUBSCRIBE_OK carries the largest layer available; without a filter, or with
AbsoluteStart/AbsoluteRange, every layer from the start location is sent (those already
available first, then each as it is added); with Largest Object only the layers after it;
Next Group Start gives nothing, as a block has one group.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvsp_moq.errors import KvspError, LayersUnavailable, PreconditionFailed, reason_of
from kvsp_moq.holder.store import BlockId, BlockRead, BlockStore, StoredBlock
from kvsp_moq.moqt.certs import ClientTls, untrusted_certificate
from kvsp_moq.moqt.errors import (
    DoesNotExist,
    InvalidRange,
    MoqtError,
    PublishDoneCode,
    RequestError,
    SessionClosed,
    StreamClosed,
)
from kvsp_moq.moqt.quic import (
    IncomingFetch,
    IncomingSubscribe,
    IncomingTrackStatus,
    Liveness,
    MoqtConnection,
    PublishedNamespace,
    QuicSettings,
    connect,
)
from kvsp_moq.moqt.wire import FilterType, Location, Properties, SubscriptionFilter
from kvsp_moq.naming import (
    GROUP,
    BlockTrack,
    layer_properties,
    moqt_record,
    pass_first_block,
    pass_properties,
    publisher_id,
)
from kvsp_moq.protocol.container import encode, format_digest
from kvsp_moq.protocol.records import LIVE_DIGEST, ReplicaRecord
from kvsp_moq.tasks import cancel_and_wait

__all__ = ["BlockPublisher", "LiveBlock", "LivePassTrack", "PublisherStats"]

log = logging.getLogger("kvsp.holder.moqt_publisher")


def _http_base(url: str) -> str:
    return url if url.endswith("/") else url + "/"


class _LiveLayers:
    """Layers added in order while they are computed, and their subscribers' wait for them:
    what a live block and a pass track share."""

    def __init__(self, layer_count: int, token_count: int, codec: int) -> None:
        if layer_count <= 0:
            raise ValueError("a block has at least one layer")
        self.layer_count = layer_count
        self.token_count = token_count
        self.codec = codec
        self.payloads: list[bytes | memoryview] = []
        self.error: str | None = None
        self._changed = asyncio.Event()

    @property
    def available(self) -> int:
        """How many layers (0..available-1) exist."""
        return len(self.payloads)

    @property
    def complete(self) -> bool:
        return len(self.payloads) == self.layer_count

    def properties(self, index: int) -> Properties:  # pragma: no cover - overridden
        raise NotImplementedError

    def _check_open(self) -> None:
        if self.complete:
            raise LayersUnavailable(f"the block has only {self.layer_count} layers")
        if self.error is not None:
            raise LayersUnavailable(f"the block was abandoned: {self.error}")

    async def wait_for(self, index: int, timeout: float) -> bytes | memoryview:
        """Layer `index` once it exists."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while index >= len(self.payloads):
            if self.error is not None:
                raise LayersUnavailable(f"the block was abandoned: {self.error}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            event = self._changed
            try:
                async with asyncio.timeout(remaining):  # no task made per layer, as wait_for would
                    await event.wait()
            except TimeoutError:
                pass
        return self.payloads[index]

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class LiveBlock(_LiveLayers):
    """A block whose layers are still being computed: add them in order, then finish().

    Subscribers get each layer as it is added; FETCH serves the layers added so far. finish()
    stores the whole block, from then on served like any stored block.
    """

    def __init__(self, publisher: "BlockPublisher", bid: BlockId, layer_count: int, token_count: int,
                 codec: int = 1, *, pass_slot: "tuple[LivePassTrack, int] | None" = None) -> None:
        super().__init__(layer_count, token_count, codec)
        self.publisher = publisher
        self.id = bid
        self.k_lengths: list[int] = []
        self.digests: list[bytes] = []
        #: the pass track this block is a slot of, and its slot (DESIGN §9.6)
        self.pass_slot = pass_slot
        self._container: bytes | None = None

    def add_layer(self, k: bytes | memoryview, v: bytes | memoryview, *,
                  payload: bytes | memoryview | None = None, digest: bytes | None = None) -> int:
        """Append the next layer (K and V sections); returns its number.

        A producer on another thread may hand the joined `payload` (K then V) and its SHA-256
        `digest` computed there, so that the event loop neither copies nor hashes it."""
        self._check_open()
        joined = payload if payload is not None else bytes(k) + bytes(v)
        self.payloads.append(joined)
        self.k_lengths.append(len(k))
        self.digests.append(digest if digest is not None else hashlib.sha256(joined).digest())
        self._wake()
        return len(self.payloads) - 1

    def properties(self, index: int) -> Properties:
        """Token count, K length and the layer's digest: a live block's record lists no layer
        digests yet, so each layer carries its own."""
        return layer_properties(self.token_count, self.k_lengths[index], self.digests[index])

    def container(self) -> bytes:
        """The block's container once every layer is in, made once (its exporter and `finish`
        both need it)."""
        if self._container is not None:
            return self._container
        layers = [(p[:k], p[k:]) for p, k in zip(self.payloads, self.k_lengths)]
        container = encode(0, self.token_count, layers, codec=self.codec)
        if self.complete:
            self._container = container
        return container

    async def finish(self) -> StoredBlock | None:
        """Store the complete block (None when the store already had it)."""
        if not self.complete:
            raise LayersUnavailable(f"{self.available} of {self.layer_count} layers were added")
        stored = False
        try:
            entry = await self.publisher.store.put(self.id, self.container(), layer_digests=self.digests)
            stored = True
        except PreconditionFailed:
            entry, stored = None, True  # stored already: its complete record is there
        finally:
            self.publisher._ended(self, stored=stored)
        return entry

    def abort(self, reason: str = "production failed") -> None:
        """Give up: subscribers waiting for more layers are told, the in-production record goes."""
        if self.error is not None:
            return
        self.error = reason
        self._wake()
        self.publisher._ended(self, stored=False)


class LivePassTrack(_LiveLayers):
    """The pass track of a forward pass that computes several blocks (DESIGN §9.6): object l
    is layer l of every block of the pass, slot by slot, each slot's K and V sections as its
    block's layer object has them, with the slots' layer digests and Block Keys as properties.

    A subscriber that needs all of them (an instance of a herd) takes one subscription and one
    object per layer instead of one of each per block: the per-object work of publishing,
    relaying and receiving shrinks by the block count. The blocks' own tracks and records
    stay as they are; a slot's layer is the same octets as its block's layer object."""

    def __init__(self, publisher: "BlockPublisher", first: BlockId, layer_count: int, token_count: int,
                 codec: int = 1) -> None:
        super().__init__(layer_count, token_count, codec)
        self.publisher = publisher
        self.first = first
        self.blocks: list[LiveBlock] = []
        self.k_length = 0
        #: the slots' layer digests, joined, of each layer
        self.digests: list[bytes] = []
        #: the slots' Block Keys, joined (fixed before the first layer)
        self.keys = b""
        self._ended = 0

    @property
    def moqt_namespace(self) -> str:
        return self.publisher.track(self.first, self.codec).moqt_namespace

    def produce(self, bid: BlockId) -> LiveBlock:
        """Open the pass's next block (its next slot): `BlockPublisher.produce`, with its
        in-production record naming this track and the slot."""
        if self.payloads or self.error is not None:
            raise LayersUnavailable("a pass takes its blocks before its first layer")
        live = self.publisher.produce(bid, layer_count=self.layer_count, token_count=self.token_count,
                                      codec=self.codec, pass_slot=(self, len(self.blocks)))
        self.blocks.append(live)
        self.keys += bytes.fromhex(bid.block_key)
        return live

    def add_layer(self, payload: bytes | memoryview, digests: bytes, k_length: int) -> int:
        """Append the next layer: every slot's K||V joined (`payload`), and their digests."""
        self._check_open()
        if len(digests) != 32 * len(self.blocks) or len(payload) % max(1, len(self.blocks)):
            raise ValueError(f"a layer of {len(self.blocks)} slots needs as many digests and equal slots")
        self.payloads.append(payload)
        self.digests.append(digests)
        self.k_length = k_length
        self._wake()
        return len(self.payloads) - 1

    def properties(self, index: int) -> Properties:
        return pass_properties(self.token_count, self.k_length, self.digests[index], self.keys)

    def abort(self, reason: str = "production failed") -> None:
        """Subscribers waiting for more layers are told; they fall back to the blocks' tracks."""
        if self.error is not None:
            return
        self.error = reason
        self._wake()
        self.publisher._pass_ended(self)

    def block_ended(self) -> None:
        """One of its blocks was stored or abandoned: once all were, the track goes (a late
        reader takes the blocks' tracks or stored copies)."""
        self._ended += 1
        if self._ended >= len(self.blocks):
            self.publisher._pass_ended(self)


@dataclass
class PublisherStats:
    connections: int = 0
    announces: int = 0
    subscribes: int = 0
    fetches: int = 0
    objects_sent: int = 0
    bytes_sent: int = 0
    refused: int = 0


def _layer_views(read: BlockRead, lengths: Sequence[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
    """(layer, K||V payload) of a pinned read, without copying within a segment."""
    segments = list(read.segments)
    seg, pos = 0, 0
    for index in range(read.first, read.last + 1):
        need = lengths[index][0] + lengths[index][1]
        if seg < len(segments) and len(segments[seg]) - pos >= need:
            view = segments[seg][pos:pos + need]
            pos += need
        else:  # a layer across two segments (not produced by the store today): copy it
            parts = []
            while need:
                if seg >= len(segments):
                    raise LayersUnavailable("the stored copy ended early")
                take = min(need, len(segments[seg]) - pos)
                parts.append(segments[seg][pos:pos + take])
                pos += take
                need -= take
                if pos == len(segments[seg]):
                    seg, pos = seg + 1, 0
            view = memoryview(b"".join(parts))
        if seg < len(segments) and pos == len(segments[seg]):
            seg, pos = seg + 1, 0
        yield index, view


class BlockPublisher:
    """Publishes a holder's blocks to a relay and serves its SUBSCRIBEs and FETCHes."""

    def __init__(
        self,
        store: BlockStore,
        relay_url: str,
        http_holder: str,
        *,
        token: str | None = None,
        settings: QuicSettings | None = None,
        verify: bool = True,
        cadata: bytes | None = None,
        cafile: str | None = None,
        tls: ClientTls | None = None,
        retry_initial: float = 0.2,
        retry_max: float = 5.0,
        rescan_interval: float = 1.0,
        timeout: float = 10.0,
        layer_timeout: float = 60.0,
        probe_interval: float = 2.0,
        probe_timeout: float = 5.0,
        subscribe_wait_s: float = 3.0,
    ) -> None:
        self.store = store
        self.relay_url = relay_url
        self.http_holder = _http_base(http_holder)
        self.publisher_id = publisher_id(self.http_holder)
        self.token = token
        self.settings = settings or QuicSettings()
        if tls is not None:  # `client_tls`'s decision; it also names the options in errors
            verify, cafile = tls.verify, tls.cafile
        self.verify, self.cadata, self.cafile, self.tls = verify, cadata, cafile, tls
        self.retry_initial, self.retry_max = retry_initial, retry_max
        self.rescan_interval = rescan_interval
        self.timeout = timeout
        self.layer_timeout = layer_timeout
        #: A relay that dies without closing (SIGKILL, a lost machine) leaves the session open
        #: until the QUIC idle timeout; a PING unanswered for probe_timeout ends it sooner, so
        #: a relay restarted on the same address gets its announcements back within seconds.
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.stats = PublisherStats()
        self.connection: MoqtConnection | None = None
        self._live: dict[BlockId, LiveBlock] = {}
        #: pass tracks by their first block
        self._passes: dict[BlockId, LivePassTrack] = {}
        #: how long a SUBSCRIBE for a block neither stored nor produced here waits for it
        self.subscribe_wait_s = subscribe_wait_s
        self._appeared = asyncio.Event()
        #: told when a live block starts (None) and when it ends (True: stored, False: abandoned);
        #: the index publisher puts and withdraws in-production records by it
        self.on_live: Callable[[LiveBlock, bool | None], None] | None = None
        self._wanted: set[tuple[str, str]] = set()
        self._announced: dict[tuple[str, str], PublishedNamespace] = {}
        self._refused: set[tuple[str, str]] = set()
        self._connected = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> "BlockPublisher":
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvsp-moqt-publisher")
        return self

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.connection is not None:
            await self.connection.aclose()
            self.connection = None

    async def __aenter__(self) -> "BlockPublisher":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def wait_connected(self, timeout: float = 10.0) -> None:
        """Wait until a session is up and every known compat and scope is announced."""
        await asyncio.wait_for(self._connected.wait(), timeout)

    @property
    def announced(self) -> set[tuple[str, str]]:
        return set(self._announced)

    def is_announced(self, compat_id: str, scope_id: str) -> bool:
        """Whether the relay has accepted this compat and scope's namespace (no copy made)."""
        return (compat_id.lower(), scope_id.lower()) in self._announced

    def namespace(self, compat_id: str, scope_id: str) -> tuple[bytes, ...]:
        return BlockTrack(bytes.fromhex(compat_id), bytes.fromhex(scope_id), self.publisher_id,
                          bytes(32)).announce_prefix

    def track(self, bid: BlockId, codec: int = 1) -> BlockTrack:
        return BlockTrack.for_holder(bid.compat_id, bid.scope_id, bid.block_key, self.http_holder, codec)

    def announce(self, compat_id: str, scope_id: str) -> None:
        """Make sure ("kvsp", compat, scope, publisher_id) is announced (soon, and after every
        reconnection). Blocks in the store are found by a periodic scan anyway."""
        self._wanted.add((compat_id.lower(), scope_id.lower()))
        self._wake.set()

    def produce(self, bid: BlockId, *, layer_count: int, token_count: int, codec: int = 1,
                pass_slot: tuple[LivePassTrack, int] | None = None) -> LiveBlock:
        """Start publishing a block whose layers are still being computed (as slot
        `pass_slot[1]` of a pass track too: `LivePassTrack.produce`)."""
        if bid in self._live:
            raise PreconditionFailed("this block is already being produced")
        live = self._live[bid] = LiveBlock(self, bid, layer_count, token_count, codec, pass_slot=pass_slot)
        self.announce(bid.compat_id, bid.scope_id)
        self._appeared.set()  # subscriptions waiting for a block (`_locate_soon`) look again
        self._appeared = asyncio.Event()
        if self.on_live is not None:
            self.on_live(live, None)
        return live

    def open_pass(self, first: BlockId, *, layer_count: int, token_count: int,
                  codec: int = 1) -> LivePassTrack:
        """A pass track whose first block will be `first` (DESIGN §9.6): its blocks are opened
        with `LivePassTrack.produce`, its layers added once per layer for all of them."""
        if first in self._passes or first in self._live:
            raise PreconditionFailed("this block is already being produced")
        track = self._passes[first] = LivePassTrack(self, first, layer_count, token_count, codec)
        return track

    def live_blocks(self) -> list[LiveBlock]:
        return list(self._live.values())

    def _ended(self, live: LiveBlock, *, stored: bool) -> None:
        if self._live.get(live.id) is live:
            del self._live[live.id]
            if self.on_live is not None:
                self.on_live(live, stored)
            if live.pass_slot is not None:
                live.pass_slot[0].block_ended()

    def _pass_ended(self, track: LivePassTrack) -> None:
        if self._passes.get(track.first) is track:
            del self._passes[track.first]

    def live_record(self, live: LiveBlock, *, ttl_ms: int = 10_000) -> ReplicaRecord:
        """The in-production record of a live block: its track through this publisher's relay,
        `live`, and no digests yet (each layer carries its own)."""
        track = self.track(live.id, live.codec)
        in_pass = None
        if live.pass_slot is not None:
            in_pass = (live.pass_slot[0].moqt_namespace, live.pass_slot[1])
        return ReplicaRecord(block_key=live.id.block_key, compat_id=live.id.compat_id,
                             scope_id=live.id.scope_id, holder=self.relay_url, codec=live.codec, size=0,
                             digest=LIVE_DIGEST, ttl_ms=ttl_ms, moqt_namespace=track.moqt_namespace,
                             http_holder=self.http_holder, live=True, live_pass=in_pass)

    def record(self, entry: StoredBlock, *, ttl_ms: int = 60_000) -> ReplicaRecord:
        """The MOQT Replica Record of a stored block, through this publisher's relay."""
        meta = entry.meta
        http = ReplicaRecord(
            block_key=entry.id.block_key, compat_id=entry.id.compat_id, scope_id=entry.id.scope_id,
            holder=self.http_holder, codec=meta.codec, size=meta.size, digest=format_digest(meta.digest),
            ttl_ms=ttl_ms, layer_digests=tuple(d.hex() for d in meta.layer_digests),
            residency=self.store.residency(entry))
        return moqt_record(http, self.relay_url)

    # ---------------------------------------------------------------- the session

    async def _run(self) -> None:
        backoff = self.retry_initial
        untrusted_said = False
        while not self._closed:
            try:
                connection = await connect(
                    self.relay_url, settings=self.settings, verify=self.verify, cadata=self.cadata,
                    cafile=self.cafile, authorization=self.token, timeout=self.timeout,
                    handlers={"subscribe": self._on_subscribe, "fetch": self._on_fetch,
                              "track_status": self._on_track_status})
            except Exception as e:  # any failure to connect: try again later
                line = untrusted_certificate(e, self.relay_url, self.tls)
                if line is None:
                    log.info("relay %s unreachable (%s); retrying in %.1fs", self.relay_url, reason_of(e),
                             backoff)
                elif not untrusted_said:  # said once, at error level; retried quietly (it may change)
                    untrusted_said = True
                    log.error("%s", line)
                else:
                    log.debug("%s; retrying in %.1fs", line, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.retry_max)
                continue
            backoff = self.retry_initial
            if untrusted_said:
                log.info("the certificate of relay %s is trusted now", self.relay_url)
                untrusted_said = False
            self.connection = connection
            self.stats.connections += 1
            self._announced.clear()
            self._refused.clear()
            log.info("publishing to relay %s", self.relay_url)
            probe: asyncio.Future[Liveness] | None = None
            try:
                closed = asyncio.ensure_future(connection.wait_closed())
                next_probe = time.monotonic() + self.probe_interval
                while not closed.done():
                    await self._announce_pending(connection)
                    self._connected.set()
                    if probe is None and time.monotonic() >= next_probe:
                        probe = asyncio.ensure_future(connection.liveness(self.probe_timeout))
                    elif probe is not None and probe.done():
                        if probe.result() == "silent":
                            raise asyncio.TimeoutError()  # the relay is gone
                        probe = None
                        next_probe = time.monotonic() + self.probe_interval
                    self._wake.clear()
                    wake = asyncio.ensure_future(self._wake.wait())
                    waits = {closed, wake} | ({probe} if probe is not None else set())
                    await asyncio.wait(waits, timeout=self.rescan_interval,
                                       return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
            except (MoqtError, asyncio.TimeoutError, OSError) as e:
                log.info("session to relay %s failed: %s", self.relay_url,
                         "no answer to a PING" if isinstance(e, asyncio.TimeoutError) and not str(e)
                         else reason_of(e))
                connection.close()
            finally:
                if probe is not None:
                    probe.cancel()
                self._connected.clear()
                self.connection = None
            log.info("session to relay %s ended; reconnecting", self.relay_url)

    def _pairs(self) -> set[tuple[str, str]]:
        pairs = {(e.id.compat_id, e.id.scope_id) for e in self.store.blocks()}
        pairs |= {(b.compat_id, b.scope_id) for b in self._live}
        return pairs | self._wanted

    async def _announce_pending(self, connection: MoqtConnection) -> None:
        for pair in sorted(self._pairs() - set(self._announced) - self._refused):
            try:
                published = await connection.publish_namespace(
                    self.namespace(*pair), authorization=self.token, timeout=self.timeout)
            except RequestError as e:
                self._refused.add(pair)
                self.stats.refused += 1
                log.warning("relay refused the namespace of compat %s scope %s: %s", pair[0], pair[1], e)
                continue
            self._announced[pair] = published
            self.stats.announces += 1

    # ---------------------------------------------------------------- requests

    def _locate(self, namespace: tuple[bytes, ...], track_name: bytes) -> tuple[BlockId, _LiveLayers | None,
                                                                                 StoredBlock | None]:
        """The stored block, or the live block or pass track, that a track names."""
        try:
            first = pass_first_block(tuple(namespace), bytes(track_name))
            track = first or BlockTrack.from_namespace(tuple(namespace), bytes(track_name))
        except KvspError:
            raise DoesNotExist("not a KV block track") from None
        if track.publisher_id != self.publisher_id:
            raise DoesNotExist("not a track of this holder")
        bid = BlockId(track.compat_id.hex(), track.scope_id.hex(), track.block_key.hex())
        if first is not None:
            passed = self._passes.get(bid)
            if passed is not None and passed.codec == track.codec and passed.error is None:
                return bid, passed, None
            raise DoesNotExist("no such pass here")
        entry = self.store.get(bid)
        if entry is not None and entry.meta.codec == track.codec:
            return bid, None, entry
        live = self._live.get(bid)
        if live is not None and live.codec == track.codec and live.error is None:
            return bid, live, None
        raise DoesNotExist("no such block here")

    async def _on_track_status(self, req: IncomingTrackStatus) -> None:
        _, live, entry = self._locate(req.namespace, req.track_name)
        if entry is not None:
            available = entry.meta.layer_count
        else:
            assert live is not None
            available = live.available
        req.accept(largest=Location(GROUP, available - 1) if available else None)

    async def _on_fetch(self, req: IncomingFetch) -> None:
        bid, live, entry = self._locate(req.namespace, req.track_name)
        self.stats.fetches += 1
        if entry is not None:
            total = available = entry.meta.layer_count
        else:
            assert live is not None
            total, available = live.layer_count, live.available
        payload: bytes | memoryview  # a stored layer's view, or a live layer
        first = req.start.object if req.start.group == GROUP else None
        last = available - 1
        if req.end.group == GROUP and req.end.object:
            last = min(last, req.end.object - 1)
        if first is None or req.start.group > GROUP or first > last:
            raise InvalidRange(f"layers from {req.start.object} are not available (have {available} of {total})")
        if entry is not None:
            read = await self.store.open_read(bid, first, last)
            try:
                sender = req.accept(end=(GROUP, last + 1), end_of_track=last == total - 1)
                meta = entry.meta
                for index, payload in _layer_views(read, meta.lengths):
                    await sender.send(GROUP, index, payload,
                                      properties=layer_properties(meta.token_count, meta.lengths[index][0],
                                                                  meta.layer_digests[index]))
                    self._count(payload)
                sender.close()
            finally:
                read.release()
            return
        assert live is not None
        sender = req.accept(end=(GROUP, last + 1), end_of_track=last == total - 1)
        for index in range(first, last + 1):
            payload = live.payloads[index]
            await sender.send(GROUP, index, payload, properties=live.properties(index))
            self._count(payload)
        sender.close()

    async def _locate_soon(self, namespace: tuple[bytes, ...], track_name: bytes) -> tuple[
            BlockId, _LiveLayers | None, StoredBlock | None]:
        """`_locate`, but a block that is neither stored nor produced yet is waited for (at most
        `subscribe_wait_s`): a SUBSCRIBE is how a block about to be computed here is asked for
        (prefill and decode apart, a herd routed to it), and may come before its production
        starts. Stored blocks are asked for by FETCH, which is answered at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.subscribe_wait_s
        while True:
            try:
                return self._locate(namespace, track_name)
            except DoesNotExist:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise
            try:
                await asyncio.wait_for(self._appeared.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _on_subscribe(self, req: IncomingSubscribe) -> None:
        bid, live, entry = await self._locate_soon(req.namespace, req.track_name)
        self.stats.subscribes += 1
        if entry is not None:
            total = available = entry.meta.layer_count
        else:
            assert live is not None
            total, available = live.layer_count, live.available
        start = _first_layer(req.subscription_filter, available, total)
        subscription = req.accept(largest=Location(GROUP, available - 1) if available else None)
        if start >= total:
            await subscription.finish(PublishDoneCode.SUBSCRIPTION_ENDED, "no layers after the filter's start")
            return
        read = await self.store.open_read(bid, start, total - 1) if entry is not None else None
        try:
            sender = subscription.open_subgroup(GROUP, 0, has_properties=True)
            payload: bytes | memoryview  # a stored layer's view, or a live layer
            if read is not None:
                assert entry is not None
                meta = entry.meta
                for index, payload in _layer_views(read, meta.lengths):
                    await sender.send(index, payload,
                                      properties=layer_properties(meta.token_count, meta.lengths[index][0],
                                                                  meta.layer_digests[index]))
                    self._count(payload)
            else:
                assert live is not None
                for index in range(start, total):
                    try:
                        payload = await live.wait_for(index, self.layer_timeout)
                    except (LayersUnavailable, asyncio.TimeoutError) as e:
                        sender.reset()
                        await subscription.finish(PublishDoneCode.INTERNAL_ERROR,
                                                  f"layer {index} never came: {e or 'timeout'}")
                        return
                    await sender.send(index, payload, properties=live.properties(index))
                    self._count(payload)
            sender.close()
            await subscription.finish(PublishDoneCode.TRACK_ENDED)
        except (StreamClosed, SessionClosed):
            pass  # the subscriber went away
        finally:
            if read is not None:
                read.release()

    def _count(self, payload: bytes | memoryview) -> None:
        self.stats.objects_sent += 1
        self.stats.bytes_sent += len(payload)


def _first_layer(subscription_filter: SubscriptionFilter | None, available: int, total: int) -> int:
    """The first layer a SUBSCRIBE asks for (total when none)."""
    if subscription_filter is None:
        return 0
    kind = subscription_filter.filter_type
    if kind == FilterType.LARGEST_OBJECT:
        return available
    if kind == FilterType.NEXT_GROUP_START:
        return total
    start = subscription_filter.start
    assert start is not None
    if start.group > GROUP:
        return total
    return start.object if start.group == GROUP else 0
